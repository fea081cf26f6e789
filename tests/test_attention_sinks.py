"""Attention sinks (``sinks=``, gpt-oss's): one logit per head in every softmax's
denominator that attends to no value, against a float64 softmax over the scores with that
logit as one more column; gradients for q, k, v and the sinks; every layout; rows that see
no key; NaN rows; bad sinks refused before a kernel."""

from __future__ import annotations

import pytest
import torch

import opforge
from opforge.core.errors import DtypeError, ShapeError

from .conftest import DEVICE
from .test_attention_masks import _qkv

# (B, H, Hkv, Sq, Sk, causal, window_left): GQA, decoding over a cache, a sliding window,
# odd sizes.
SHAPES = [(2, 4, 2, 9, 9, True, None), (1, 6, 3, 1, 37, True, None),
          (2, 4, 4, 13, 21, False, None), (1, 4, 2, 17, 17, True, 4)]


def hide_outside(scores: torch.Tensor, causal: bool, window_left: int | None) -> torch.Tensor:
    """``scores`` (..., Sq, Sk) at -inf where a query does not see the key: after its
    bottom-right diagonal (``causal``), or more than ``window_left`` keys before it."""
    sq, sk = scores.shape[-2:]
    diagonal = torch.arange(sq, device=scores.device)[:, None] + sk - sq
    keys = torch.arange(sk, device=scores.device)[None, :]
    hidden = torch.zeros(sq, sk, dtype=torch.bool, device=scores.device)
    if causal:
        hidden |= keys > diagonal
    if window_left is not None:
        hidden |= keys < diagonal - window_left
    return scores.masked_fill(hidden, float("-inf"))


def _golden(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
            causal: bool, window_left: int | None) -> torch.Tensor:
    """float64 softmax over ``[scores, sink]``, the sink's column dropped before ``@ v``."""
    q, k, v, sinks = (t.double() for t in (q, k, v, sinks))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = hide_outside(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, causal, window_left)
    column = sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probabilities = torch.cat([scores, column], -1).softmax(-1)[..., :-1]
    return probabilities @ v


@pytest.mark.parametrize("b, h, hkv, sq, sk, causal, window_left", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sinks_match_the_float64_softmax_with_a_sink_column(b, h, hkv, sq, sk, causal,
                                                            window_left, dtype, backend):
    q, k, v = _qkv(b, h, hkv, sq, sk, 16, dtype, seed=sq + sk)
    sinks = torch.randn(h, generator=torch.Generator().manual_seed(1)).to(DEVICE) * 2
    out, lse = opforge.attention(q, k, v, causal, return_lse=True, sinks=sinks,
                                 window_left=window_left)
    golden = _golden(q, k, v, sinks, causal, window_left)
    bound = 2 * torch.finfo(dtype).eps
    torch.testing.assert_close(out.double(), golden, rtol=bound, atol=bound)
    # lse holds the sink too: exp(sink - lse) is the sink's probability.
    plain_lse = opforge.attention(q, k, v, causal, return_lse=True,
                                  window_left=window_left)[1]
    torch.testing.assert_close(lse, torch.logaddexp(plain_lse, sinks[:, None]))


@pytest.mark.parametrize("b, h, hkv, sq, sk, causal, window_left", SHAPES)
def test_sinks_get_the_float64_gradients(b, h, hkv, sq, sk, causal, window_left, backend):
    """dq, dk, dv and dsinks (through the kernels' backward, which takes the gradient
    reaching lse) against float64 autograd of the golden."""
    q, k, v = _qkv(b, h, hkv, sq, sk, 16, torch.float32, seed=sq * sk)
    sinks = torch.randn(h, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    golden_leaves = [t.double().requires_grad_() for t in (q, k, v, sinks)]
    out = opforge.attention(*leaves[:3], causal, sinks=leaves[3], window_left=window_left)
    golden = _golden(*golden_leaves, causal, window_left)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    grads = torch.autograd.grad(out, leaves, dout)
    golden_grads = torch.autograd.grad(golden, golden_leaves, dout.double())
    for name, grad, expected in zip(("q", "k", "v", "sinks"), grads, golden_grads,
                                    strict=True):
        torch.testing.assert_close(grad.double(), expected, rtol=1e-5, atol=1e-5, msg=name)


def test_sinks_in_every_layout_and_packed(backend):
    """BSND and packed sequences (TND, each sequence alone) give BNSD's values."""
    q, k, v = _qkv(1, 4, 2, 11, 11, 16, torch.float32, seed=4)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    expected = opforge.attention(q, k, v, True, sinks=sinks)
    as_bsnd = opforge.attention(*(t.transpose(1, 2) for t in (q, k, v)), True,
                                layout="BSND", sinks=sinks)
    torch.testing.assert_close(as_bsnd.transpose(1, 2), expected)
    cu = torch.tensor([0, 4, 11], dtype=torch.int32, device=DEVICE)
    packed = opforge.attention(*(t[0].transpose(0, 1) for t in (q, k, v)), True,
                               layout="TND", cu_seqlens_q=cu, cu_seqlens_k=cu, sinks=sinks)
    for start, end in ((0, 4), (4, 11)):
        alone = opforge.attention(*(t[:, :, start:end] for t in (q, k, v)), True, sinks=sinks)
        torch.testing.assert_close(packed[start:end], alone[0].transpose(0, 1))


def test_a_query_that_sees_no_key_gets_zero_and_the_sink_as_lse(backend):
    q, k, v = _qkv(1, 2, 2, 6, 4, 16, torch.float32, seed=6)
    sinks = torch.tensor([0.5, -1.0], device=DEVICE)
    out, lse = opforge.attention(q, k, v, True, return_lse=True, sinks=sinks)
    # Bottom-right causal with Sq 6 > Sk 4: queries 0 and 1 see no key.
    assert torch.equal(out[:, :, :2], torch.zeros_like(out[:, :, :2]))
    torch.testing.assert_close(lse[0, :, :2], sinks[:, None].expand(2, 2))
    assert torch.isfinite(out).all()


def test_a_minus_infinite_sink_is_no_sink(backend):
    """A head whose sink is -inf (no sink) gives the plain attention, 0 and lse -inf for a
    query that sees no key, and finite gradients."""
    q, k, v = _qkv(1, 2, 2, 6, 4, 16, torch.float32, seed=11)
    sinks = torch.tensor([-float("inf"), 0.5], device=DEVICE, requires_grad=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = opforge.attention(*leaves, True, return_lse=True, sinks=sinks)
    plain, plain_lse = opforge.attention(q, k, v, True, return_lse=True)
    torch.testing.assert_close(out[:, 0], plain[:, 0])
    assert torch.equal(lse[:, 0], plain_lse[:, 0])
    assert torch.equal(out[:, :, :2], torch.zeros_like(out[:, :, :2]))
    grads = torch.autograd.grad(out.sum() + lse[torch.isfinite(lse)].sum(), [*leaves, sinks])
    assert all(torch.isfinite(grad).all() for grad in grads)


def test_a_nan_query_poisons_its_row_only(backend):
    q, k, v = _qkv(1, 2, 2, 5, 5, 16, torch.float32, seed=7)
    q[0, 1, 3, 0] = float("nan")
    out = opforge.attention(q, k, v, sinks=torch.zeros(2, device=DEVICE))
    assert out[0, 1, 3].isnan().all()
    out[0, 1, 3] = 0
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("sinks, error", [
    (torch.zeros(3), ShapeError), (torch.zeros(4, 1), ShapeError),
    (torch.zeros(4, dtype=torch.int64), DtypeError), ([0.0] * 4, DtypeError),
])
def test_bad_sinks_are_refused_before_a_kernel(sinks, error, backend):
    q, k, v = _qkv(1, 4, 2, 3, 3, 16, torch.float32)
    sinks = sinks.to(DEVICE) if isinstance(sinks, torch.Tensor) else sinks
    with pytest.raises(error) as raised:
        opforge.attention(q, k, v, sinks=sinks)
    assert raised.value.param == "sinks"
    cu = torch.tensor([0, 3], dtype=torch.int32, device=DEVICE)
    with pytest.raises(error):
        opforge.attention_varlen(*(t[0].transpose(0, 1) for t in (q, k, v)), cu, cu,
                                 sinks=sinks)
