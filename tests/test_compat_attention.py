"""`opforge.compat.torch_npu.npu_fusion_attention` and `npu_rotary_mul` against formulas
re-derived from Ascend's op-plugin tests (`test_npu_fusion_attention.py`: softmax of
``q k^T * scale + atten_mask * (-10000)`` in float32, masks built per sparse mode;
`test_npu_rotary_mul.py`: ``x * r1 + rotate(x) * r2``), in float64."""

from __future__ import annotations

import math

import pytest
import torch

import opforge
from opforge.compat.torch_npu import npu_fusion_attention, npu_rotary_mul

from .conftest import DEVICE


def _bnsd(b: int, n: int, sq: int, sk: int, d: int, seed: int = 0, nkv: int | None = None
          ) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shapes = ((b, n, sq, d), (b, nkv or n, sk, d), (b, nkv or n, sk, d))
    return [torch.randn(s, generator=generator).to(DEVICE) for s in shapes]


def _golden(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor | None,
            scale: float, pse: torch.Tensor | None = None) -> torch.Tensor:
    """The op-plugin test's formula in float64 (GQA by repeated heads): masked scores get
    -10000 added, as the test does."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, 1) for t in (k, v))
    scores = q.double() @ k.transpose(-1, -2)
    if pse is not None:
        scores = scores + pse.double()
    scores = scores * scale
    if hidden is not None:
        scores = scores + hidden.double() * -10000.0
    return torch.softmax(scores, -1) @ v


def _hidden(sq: int, sk: int, mode: int, pre: int = 0, nxt: int = 0) -> torch.Tensor:
    """The ``(Sq, Sk)`` 1 = hidden mask each sparse mode stands for (as the op-plugin test
    builds its references): triu above the top-left (2) or bottom-right (3) diagonal, a
    band around the bottom-right diagonal (4)."""
    ones = torch.ones(sq, sk, device=DEVICE)
    if mode == 2:
        return torch.triu(ones, diagonal=1)
    if mode == 3:
        return torch.triu(ones, diagonal=sk - sq + 1)
    offset = sk - sq
    return torch.triu(ones, diagonal=offset + nxt + 1) + torch.tril(ones, diagonal=offset - pre - 1)


@pytest.mark.parametrize("mode", [2, 3, 4])
@pytest.mark.parametrize("sq, sk", [(16, 16), (9, 20)])
def test_causal_and_band_sparse_modes_match_the_op_plugin_golden(mode, sq, sk, backend):
    q, k, v = _bnsd(2, 4, sq, sk, 16, seed=sq + mode, nkv=2)
    scale = 16 ** -0.5
    out, softmax_max, softmax_sum, softmax_out, *ints = npu_fusion_attention(
        q, k, v, 4, "BNSD", scale=scale, sparse_mode=mode, pre_tockens=3, next_tockens=1,
        atten_mask=torch.ones(2048, 2048, dtype=torch.bool, device=DEVICE))  # ignored in 2-4
    expected = _golden(q, k, v, _hidden(sq, sk, mode, pre=3, nxt=1), scale)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6)
    assert softmax_max.shape == softmax_sum.shape == (2, 4, sq, 8)
    assert softmax_out.numel() == 0 and ints == [0, 0, 0]


def test_given_masks_with_and_without_a_band_and_pse(backend):
    """Modes 0 and 1 take the given mask (True hides), SS or B1SS; mode 0 also bounds a
    band aligned top-left; pse is added before the scale."""
    q, k, v = _bnsd(2, 2, 12, 12, 32, seed=3)
    generator = torch.Generator().manual_seed(4)
    hidden = (torch.rand(2, 1, 12, 12, generator=generator) > 0.7).to(DEVICE)
    hidden[..., 0] = False
    scale = 0.1
    for mode in (0, 1):
        out = npu_fusion_attention(q, k, v, 2, "BNSD", atten_mask=hidden, scale=scale,
                                   sparse_mode=mode)[0]
        torch.testing.assert_close(out.double(), _golden(q, k, v, hidden, scale),
                                   rtol=1e-5, atol=1e-6)
    banded = npu_fusion_attention(q, k, v, 2, "BNSD", atten_mask=hidden[0, 0], scale=scale,
                                  pre_tockens=2, next_tockens=0)[0]
    ones = torch.ones(12, 12, device=DEVICE)
    band_hidden = torch.triu(ones, 1) + torch.tril(ones, -3)
    combined = ((hidden[0, 0].double() + band_hidden) > 0).double()
    torch.testing.assert_close(banded.double(), _golden(q, k, v, combined, scale),
                               rtol=1e-5, atol=1e-6)
    pse = torch.randn(1, 2, 12, 12, generator=generator).to(DEVICE)
    with_pse = npu_fusion_attention(q, k, v, 2, "BNSD", pse=pse, scale=scale)[0]
    torch.testing.assert_close(with_pse.double(), _golden(q, k, v, None, scale, pse),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", ["BSH", "SBH", "BSND"])
def test_layouts_give_the_bnsd_result_in_their_own_layout(layout, backend):
    q, k, v = _bnsd(2, 4, 7, 9, 8, seed=5, nkv=2)
    expected = npu_fusion_attention(q, k, v, 4, "BNSD", scale=0.3, sparse_mode=3)[0]

    def arrange(t: torch.Tensor) -> torch.Tensor:
        t = t.transpose(1, 2)
        if layout == "BSND":
            return t
        t = t.flatten(-2)
        return t.transpose(0, 1) if layout == "SBH" else t

    out = npu_fusion_attention(*(arrange(t) for t in (q, k, v)), 4, layout, scale=0.3,
                               sparse_mode=3)[0]
    torch.testing.assert_close(out, arrange(expected), rtol=0, atol=0)


def test_packed_tnd_sequences_equal_each_sequence_alone_forward_and_backward(backend):
    """TND with cumulative lengths (a sequence of one token, and one key-longer than its
    queries): each sequence's rows equal BSND attention on it alone, causal aligned
    bottom-right (mode 3); gradients flow to the packed tensors; the statistics are
    ``(T, N, 8)`` and reproduce the softmax."""
    lengths_q, lengths_k = [5, 1, 7], [5, 3, 7]
    generator = torch.Generator().manual_seed(6)
    q = torch.randn(13, 4, 16, generator=generator).to(DEVICE).requires_grad_()
    k = torch.randn(15, 2, 16, generator=generator).to(DEVICE).requires_grad_()
    v = torch.randn(15, 2, 16, generator=generator).to(DEVICE).requires_grad_()
    cumulative_q = torch.tensor(lengths_q).cumsum(0).tolist()
    cumulative_k = torch.tensor(lengths_k).cumsum(0).tolist()
    out, softmax_max, softmax_sum, *_ = npu_fusion_attention(
        q, k, v, 4, "TND", scale=0.25, sparse_mode=3, actual_seq_qlen=cumulative_q,
        actual_seq_kvlen=cumulative_k)
    assert out.shape == (13, 4, 16) and softmax_max.shape == (13, 4, 8)
    out.square().sum().backward()
    starts_q, starts_k = [0, *cumulative_q[:-1]], [0, *cumulative_k[:-1]]
    for sq, sk, q0, k0 in zip(lengths_q, lengths_k, starts_q, starts_k, strict=True):
        rows = slice(q0, q0 + sq)
        keys = slice(k0, k0 + sk)
        leaves = [t.detach()[None, index].requires_grad_()
                  for t, index in ((q, rows), (k, keys), (v, keys))]
        alone = opforge.attention(*leaves, True, 0.25, layout="BSND")
        torch.testing.assert_close(out[rows], alone[0], rtol=1e-6, atol=1e-6)
        alone.square().sum().backward()
        torch.testing.assert_close(q.grad[rows], leaves[0].grad[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(k.grad[keys], leaves[1].grad[0], rtol=1e-5, atol=1e-6)
        scores = torch.einsum("snd,tnd->nst", q[rows].double(),
                              k[keys].double().repeat_interleave(2, 1)) * 0.25
        scores = scores.masked_fill(_hidden(sq, sk, 3).bool(), -math.inf)
        probabilities = torch.exp(scores - softmax_max[rows, :, 0].T[..., None].double()) \
            / softmax_sum[rows, :, 0].T[..., None]
        torch.testing.assert_close(probabilities, torch.softmax(scores, -1), rtol=1e-5,
                                   atol=1e-6)


@pytest.mark.parametrize("kwargs, error, param", [
    ({"keep_prob": 0.9}, opforge.UnsupportedError, "keep_prob"),
    ({"prefix": [1]}, opforge.UnsupportedError, "prefix"),
    ({"sparse_mode": 5}, opforge.AttrError, "sparse_mode"),
    ({"input_layout": "NSD"}, opforge.AttrError, "input_layout"),
    ({"input_layout": "TND"}, opforge.ShapeError, "actual_seq_qlen"),
    ({"input_layout": "TND", "actual_seq_qlen": [2, 3], "actual_seq_kvlen": [2, 4]},
     opforge.ShapeError, "actual_seq_qlen"),
    ({"input_layout": "TND", "actual_seq_qlen": [3, 2, 4], "actual_seq_kvlen": [3, 2, 4]},
     opforge.ShapeError, "actual_seq_qlen"),
])
def test_unsupported_arguments_raise_before_any_kernel(kwargs, error, param):
    q = torch.randn(4, 2, 16, device=DEVICE)
    kwargs = {"input_layout": "BSH", **kwargs}
    with pytest.raises(error) as raised:
        npu_fusion_attention(q, q, q, 2, **kwargs)
    assert raised.value.param == param


@pytest.mark.parametrize("mode", ["half", "interleave"])
def test_rotary_mul_matches_the_op_plugin_formula(mode, backend):
    """``x * r1 + rotate(x) * r2`` with tables broadcast over batch and heads (the
    op-plugin test's ``(1, S, 1, D)``)."""
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(2, 5, 3, 16, generator=generator).to(DEVICE)
    r1, r2 = (torch.randn(1, 5, 1, 16, generator=generator).to(DEVICE) for _ in range(2))
    wide = x.double()
    if mode == "half":
        rotated = torch.cat((-wide[..., 8:], wide[..., :8]), -1)
    else:
        rotated = torch.stack((-wide[..., 1::2], wide[..., 0::2]), -1).flatten(-2)
    expected = wide * r1.double() + rotated * r2.double()
    torch.testing.assert_close(npu_rotary_mul(x, r1, r2, mode).double(), expected,
                               rtol=1e-6, atol=1e-6)
    with pytest.raises(opforge.AttrError):
        npu_rotary_mul(x, r1, r2, "quarter")
