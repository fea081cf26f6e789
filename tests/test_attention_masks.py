"""Attention as models call it: boolean and additive masks (broadcast, combined with the
causal rule, fully masked rows), the BSND / BSH / SBH layouts, and their errors."""

from __future__ import annotations

import math

import pytest
import torch

import opforge
from opforge.core.opdef import Case

from .conftest import DEVICE, assert_golden, force_attention_tiles

ATTENTION = opforge.get_op("attention")
ATTENTION_BACKWARD = opforge.get_op("attention_backward")


def _qkv(b: int, h: int, hkv: int, sq: int, sk: int, d: int, dtype: torch.dtype = torch.float32,
         seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shapes = ((b, h, sq, d), (b, hkv, sk, d), (b, hkv, sk, d))
    return [torch.randn(s, generator=generator).to(DEVICE, dtype) for s in shapes]


def _key_padding(lengths: list[int], sk: int, left: bool = False) -> torch.Tensor:
    """``(B, 1, 1, Sk)`` bool: the valid keys of each entry, right- or left-padded."""
    positions = torch.arange(sk, device=DEVICE)
    lengths_t = torch.tensor(lengths, device=DEVICE)[:, None]
    valid = positions >= sk - lengths_t if left else positions < lengths_t
    return valid[:, None, None, :]


def _both_passes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                 causal: bool) -> None:
    """Forward, and the backward from its own out and lse, against the float64 golden."""
    out, lse = opforge.attention(q, k, v, causal=causal, return_lse=True, attn_mask=mask)
    attrs = {"causal": causal}
    assert_golden(ATTENTION, Case("mask", (q, k, v, mask), attrs), (out, lse))
    dout = torch.randn_like(out)
    grads = opforge.attention_backward(dout, q, k, v, out, lse, causal=causal, attn_mask=mask)
    assert_golden(ATTENTION_BACKWARD, Case("mask", (dout, q, k, v, out, lse, None, mask),
                                           attrs), grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_boolean_and_additive_masks_match_the_golden(causal, dtype, backend):
    """Key padding broadcast over heads and queries (one entry with no valid key), and an
    additive per-head mask with -inf entries, with GQA, forward and backward."""
    q, k, v = _qkv(3, 4, 2, 23, 23, 32, dtype, seed=1)
    _both_passes(q, k, v, _key_padding([23, 7, 0], 23), causal)
    generator = torch.Generator().manual_seed(2)
    bias = torch.randn((1, 4, 23, 23), generator=generator).to(DEVICE, dtype)
    _both_passes(q, k, v, bias.masked_fill(bias > 1.2, -math.inf), causal)


def test_a_padded_batch_equals_each_sequence_alone(backend):
    """Left padding as Hugging Face's generation makes it (queries of the pad positions
    see nothing but their own key: causal and padding together), in float32: each
    sequence's valid rows equal its own unpadded attention, and gradients reach no pad
    key."""
    lengths, s = [9, 4, 1], 9
    q, k, v = (t.requires_grad_() for t in _qkv(3, 2, 2, s, s, 16, seed=3))
    mask = _key_padding(lengths, s, left=True)
    out = opforge.attention(q, k, v, causal=True, attn_mask=mask)
    out.square().sum().backward()
    for entry, length in enumerate(lengths):
        alone = opforge.attention(q[entry:entry + 1, :, s - length:],
                                  k[entry:entry + 1, :, s - length:],
                                  v[entry:entry + 1, :, s - length:], causal=True)
        torch.testing.assert_close(out[entry:entry + 1, :, s - length:], alone,
                                   rtol=2e-6, atol=2e-6)
        assert (k.grad[entry, :, :s - length] == 0).all()
        assert (v.grad[entry, :, :s - length] == 0).all()
    # The pad queries see no key: zeros, not NaN, and no gradient either way.
    assert (out[1, :, :s - 4] == 0).all() and (q.grad[1, :, :s - 4] == 0).all()


def test_fully_masked_rows_give_zero_and_minus_inf_with_finite_gradients(backend):
    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 2, 6, 8, 16, seed=4))
    mask = torch.ones(1, 1, 6, 8, dtype=torch.bool, device=DEVICE)
    mask[..., 2, :] = False
    additive = torch.zeros(1, 2, 6, 8, device=DEVICE).masked_fill(~mask, -math.inf)
    for given in (mask, additive):
        out, lse = opforge.attention(q, k, v, attn_mask=given, return_lse=True)
        assert (out[:, :, 2] == 0).all() and torch.isneginf(lse[:, :, 2]).all()
        assert torch.isfinite(out).all() and torch.isfinite(lse[:, :, [0, 1, 3, 4, 5]]).all()
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        assert all(torch.isfinite(g).all() for g in grads)
        assert (grads[0][:, :, 2] == 0).all()


def test_masks_match_torch_sdpa_for_every_broadcast_rank(backend):
    """torch's rule: a mask of lower rank aligns to the right; True attends; an additive
    mask adds to the scaled scores."""
    q, k, v = _qkv(2, 3, 3, 5, 7, 16, seed=5)
    generator = torch.Generator().manual_seed(6)
    for shape in ((1, 7), (5, 7), (3, 1, 7), (2, 1, 5, 7), (2, 3, 5, 7)):
        keep = torch.rand(shape, generator=generator).to(DEVICE) > 0.3
        keep[..., 0] = True  # SDPA gives NaN for a row that sees nothing
        bias = torch.randn(shape, generator=generator).to(DEVICE)
        for mask in (keep, bias):
            expected = torch.nn.functional.scaled_dot_product_attention(q, k, v,
                                                                        attn_mask=mask)
            torch.testing.assert_close(opforge.attention(q, k, v, attn_mask=mask), expected,
                                       rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("pack, splits", [(1, 1), (2, 1), (2, 3)])
def test_masks_on_forced_tilings_with_packed_heads_and_key_splits(pack, splits, monkeypatch):
    """Small tiles on the Triton kernels: many blocks of either side, the GQA packing of
    decoding (a block's rows from two heads with their own mask rows) and key slices
    merged by log-sum-exp, with a per-head additive mask and key padding."""
    force_attention_tiles(monkeypatch, pack, splits, block_q=32)
    q, k, v = _qkv(2, 4, 2, 37, 70, 16, seed=7)
    generator = torch.Generator().manual_seed(8)
    bias = torch.randn((2, 4, 37, 70), generator=generator).to(DEVICE)
    bias = bias.masked_fill(bias > 1.0, -math.inf)
    opforge.clear_caches()
    try:
        with opforge.use_backend("triton"):
            for mask, causal in ((bias, True), (_key_padding([70, 20], 70), False)):
                _both_passes(q, k, v, mask, causal)
    finally:
        opforge.clear_caches()


@pytest.mark.parametrize("layout", ["BSND", "BSH", "SBH"])
def test_layouts_equal_bnsd_and_come_back_in_their_layout(layout, backend):
    """``layout`` inputs are views of the BNSD ones: the same output, laid out as the
    inputs, and the same gradients (GQA: 4 query heads over 2)."""
    q, k, v = _qkv(2, 4, 2, 5, 6, 8, seed=9)
    expected = opforge.attention(q, k, v, causal=True)

    def to_layout(t: torch.Tensor) -> torch.Tensor:
        t = t.transpose(1, 2).contiguous()  # BSND
        if layout == "BSND":
            return t
        t = t.flatten(-2)
        return t.transpose(0, 1).contiguous() if layout == "SBH" else t

    inputs = [to_layout(t).requires_grad_() for t in (q, k, v)]
    out = opforge.attention(*inputs, causal=True, layout=layout, heads=4)
    torch.testing.assert_close(out, to_layout(expected), rtol=0, atol=0)
    out.sum().backward()
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    opforge.attention(*leaves, causal=True).sum().backward()
    for given, want in zip(inputs, leaves, strict=True):
        torch.testing.assert_close(given.grad, to_layout(want.grad), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kwargs, error, param", [
    ({"attn_mask": torch.ones(1, 1, 5, 6, dtype=torch.bool)}, opforge.ShapeError, "mask"),
    ({"attn_mask": torch.ones(2, 2, 1, 5, 5, dtype=torch.bool)}, opforge.ShapeError, "mask"),
    ({"attn_mask": torch.zeros(5, 5, dtype=torch.float16)}, opforge.DtypeError, "mask"),
    ({"attn_mask": torch.zeros(5, 5, dtype=torch.int64)}, opforge.DtypeError, "mask"),
    ({"layout": "TBD"}, opforge.AttrError, "layout"),
    ({"layout": "BSH"}, opforge.ShapeError, "q"),
])
def test_bad_masks_and_layouts_raise_before_any_kernel(kwargs, error, param):
    q, k, v = _qkv(1, 2, 2, 5, 5, 16)
    kwargs = {name: value.to(DEVICE) if isinstance(value, torch.Tensor) else value
              for name, value in kwargs.items()}
    with pytest.raises(error) as raised:
        opforge.attention(q, k, v, **kwargs)
    assert raised.value.param == param


def test_a_packed_layout_needs_a_head_count_that_divides():
    q, k, v = (t.transpose(1, 2).flatten(-2) for t in _qkv(1, 2, 2, 5, 5, 16))
    for heads in (None, 3):
        with pytest.raises(opforge.ShapeError) as raised:
            opforge.attention(q, k, v, layout="BSH", heads=heads)
        assert raised.value.param == "q"


def test_opcheck_with_a_mask():
    q, k, v = _qkv(1, 2, 1, 5, 7, 16, seed=13)
    mask = torch.rand(1, 1, 5, 7, device=DEVICE) > 0.2
    torch.library.opcheck(torch.ops.opforge.attention, (q, k, v, mask, True, None))
