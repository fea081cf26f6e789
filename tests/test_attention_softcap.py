"""Attention's soft cap (``softcap``, Gemma 2's): the scaled scores become ``softcap *
tanh(scores / softcap)`` before any mask, in the kernels forward and backward, against a
float64 softmax of the capped scores; bands, additive masks, packed sequences, forced small
tiles with GQA packing and key slices; bad caps refused."""

from __future__ import annotations

import pytest
import torch

import opforge
from opforge.core.errors import AttrError
from opforge.core.opdef import Case

from .conftest import DEVICE, assert_golden, force_attention_tiles
from .test_attention_masks import _qkv
from .test_attention_sinks import hide_outside

ATTENTION = opforge.get_op("attention")
ATTENTION_BACKWARD = opforge.get_op("attention_backward")
CAP = 3.0  # small against scores of size ~4 (scale 1): the cap bends most of them


def _golden(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softcap: float,
            causal: bool, window_left: int | None, mask: torch.Tensor | None = None,
            scale: float | None = None) -> torch.Tensor:
    """float64 ``softmax(softcap * tanh(q k^T scale / softcap) + mask) v``."""
    q, k, v = (t.double() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = softcap * torch.tanh(q @ k.transpose(-1, -2) * scale / softcap)
    if mask is not None:
        scores = scores + mask.double()
    return hide_outside(scores, causal, window_left).softmax(-1) @ v


# (B, H, Hkv, Sq, Sk, causal, window_left): GQA, decoding, a sliding window, odd sizes.
SHAPES = [(2, 4, 2, 9, 9, True, None), (1, 6, 3, 1, 37, True, None),
          (2, 4, 4, 13, 21, False, None), (1, 4, 2, 17, 17, True, 4)]


def _check_both_passes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                       window_left: int | None, mask: torch.Tensor | None = None,
                       scale: float | None = None, bound: float = 1e-5) -> None:
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    golden_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    out = opforge.attention(*leaves, causal, scale, attn_mask=mask, softcap=CAP,
                            window_left=window_left)
    golden = _golden(*golden_leaves, CAP, causal, window_left, mask, scale)
    torch.testing.assert_close(out.double(), golden, rtol=bound, atol=bound)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out)
    # The operators' own float64 goldens within the precision metrics' bound too.
    attrs = {"causal": causal, "scale": scale, "window_left": window_left, "softcap": CAP}
    forward = opforge.attention(q, k, v, causal, scale, True, attn_mask=mask, softcap=CAP,
                                window_left=window_left)
    assert_golden(ATTENTION, Case("softcap", (q, k, v, mask), attrs), forward)
    backward_inputs = (dout, q, k, v, *forward, None, mask)
    assert_golden(ATTENTION_BACKWARD, Case("softcap", backward_inputs, attrs),
                  opforge.attention_backward(*backward_inputs[:6], causal, scale,
                                             attn_mask=mask, window_left=window_left,
                                             softcap=CAP))
    grads = torch.autograd.grad(out, leaves, dout)
    golden_grads = torch.autograd.grad(golden, golden_leaves, dout.double())
    for name, grad, expected in zip(("q", "k", "v"), grads, golden_grads, strict=True):
        torch.testing.assert_close(grad.double(), expected, rtol=bound, atol=bound, msg=name)


@pytest.mark.parametrize("b, h, hkv, sq, sk, causal, window_left", SHAPES)
def test_softcap_matches_the_float64_softmax_of_capped_scores(b, h, hkv, sq, sk, causal,
                                                              window_left, backend):
    """float32 forward and gradients; the scale 1 makes most scores exceed the cap."""
    q, k, v = _qkv(b, h, hkv, sq, sk, 16, torch.float32, seed=sq + sk)
    _check_both_passes(q, k, v, causal, window_left, scale=1.0)


def test_softcap_in_bf16_is_within_its_rounding(backend):
    q, k, v = _qkv(2, 4, 2, 19, 19, 32, torch.bfloat16, seed=8)
    out = opforge.attention(q, k, v, True, 1.0, softcap=CAP)
    bound = 2 * torch.finfo(torch.bfloat16).eps
    torch.testing.assert_close(out.double(), _golden(q, k, v, CAP, True, None, scale=1.0),
                               rtol=bound, atol=bound)


def test_an_additive_mask_is_added_after_the_cap(backend):
    """A float mask of -2 on some keys moves the capped scores (Gemma 2 adds its mask
    after capping): capping the mask too would give another softmax."""
    q, k, v = _qkv(1, 2, 2, 11, 11, 16, torch.float32, seed=9)
    mask = torch.zeros(1, 1, 11, 11, device=DEVICE)
    mask[..., 1::3] = -2.0
    _check_both_passes(q, k, v, False, None, mask=mask, scale=1.0)


def test_packed_sequences_are_capped_per_sequence(backend):
    q, k, v = _qkv(1, 4, 2, 11, 11, 16, torch.float32, seed=10)
    cu = torch.tensor([0, 4, 11], dtype=torch.int32, device=DEVICE)
    leaves = [t[0].transpose(0, 1).contiguous().requires_grad_() for t in (q, k, v)]
    packed = opforge.attention_varlen(*leaves, cu, cu, True, 1.0, softcap=CAP)
    dout = torch.randn(packed.shape, generator=torch.Generator().manual_seed(4)).to(packed)
    grads = torch.autograd.grad(packed, leaves, dout)
    for start, end in ((0, 4), (4, 11)):
        parts = [t[None, :, start:end].double().requires_grad_() for t in
                 (q[0], k[0], v[0])]
        golden = _golden(*parts, CAP, True, None, scale=1.0)
        torch.testing.assert_close(packed[start:end].double(), golden[0].transpose(0, 1),
                                   rtol=1e-5, atol=1e-5)
        golden_grads = torch.autograd.grad(golden, parts,
                                           dout[start:end].transpose(0, 1)[None].double())
        for grad, expected in zip(grads, golden_grads, strict=True):
            torch.testing.assert_close(grad[start:end].double(), expected[0].transpose(0, 1),
                                       rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sq, sk, pack, splits", [(5, 40, 1, 1), (1, 70, 2, 3), (33, 33, 1, 2)])
def test_softcap_on_forced_small_tiles(sq, sk, pack, splits, monkeypatch):
    """16-wide blocks on the Triton kernels: full and masked key blocks, the GQA packing of
    decoding and key slices merged by log-sum-exp, all capped alike."""
    force_attention_tiles(monkeypatch, pack, splits)
    q, k, v = _qkv(1, 4, 2, sq, sk, 16, torch.float32, seed=sq * sk)
    opforge.clear_caches()
    try:
        with opforge.use_backend("triton"):
            _check_both_passes(q, k, v, True, None, scale=1.0)
    finally:
        opforge.clear_caches()


def test_a_nan_query_poisons_its_row_only(backend):
    q, k, v = _qkv(1, 2, 2, 5, 5, 16, torch.float32, seed=7)
    q[0, 1, 3, 0] = float("nan")
    out = opforge.attention(q, k, v, softcap=CAP)
    assert out[0, 1, 3].isnan().all()
    out[0, 1, 3] = 0
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("softcap", [0.0, -1.0, float("nan"), float("inf"), 1e300, 1e-40])
def test_a_cap_that_is_not_positive_and_normal_is_refused(softcap, backend):
    q, k, v = _qkv(1, 2, 2, 3, 3, 16, torch.float32)
    with pytest.raises(AttrError) as raised:
        opforge.attention(q, k, v, softcap=softcap)
    assert raised.value.param == "softcap"
    out, lse = opforge.attention(q, k, v, return_lse=True)
    with pytest.raises(AttrError):
        opforge.attention_backward(out, q, k, v, out, lse, softcap=softcap)
