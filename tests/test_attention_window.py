"""Attention's band (``window_left`` / ``window_right``): sliding windows and CANN's band
in the kernels, on their own and with masks, packed sequences, GQA packing and key
slices; the work counted over the band only."""

from __future__ import annotations

import pytest
import torch

import opforge
from opforge.core.errors import AttrError
from opforge.core.opdef import Case
from opforge.ops.attention import key_limits, visible_keys
from opforge.ops.attention_varlen import cumulative

from .conftest import DEVICE, assert_golden, force_attention_tiles
from .test_attention_masks import _qkv

ATTENTION = opforge.get_op("attention")
ATTENTION_BACKWARD = opforge.get_op("attention_backward")
VARLEN = opforge.get_op("attention_varlen")
VARLEN_BACKWARD = opforge.get_op("attention_varlen_backward")

# (Sq, Sk, causal, window_left, window_right): a sliding window, a band off the diagonal
# on either side, one side only, a band narrower than a block, decoding over a long cache,
# queries that see nothing (Sq > Sk, and a band that holds no key).
BANDS = [
    (37, 37, True, 5, None),
    (45, 45, False, 3, 4),
    (70, 150, True, 20, None),
    (100, 100, False, -2, 5),
    (64, 200, False, 10, -3),
    (3, 300, True, 40, None),
    (40, 24, True, 7, None),
    (33, 33, False, None, 2),
    (33, 33, False, 4, None),
    (20, 20, False, -5, -8),
]


def _both_passes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                 attrs: dict[str, object]) -> tuple[torch.Tensor, ...]:
    """Forward, and the backward from its own out and lse, against the float64 golden;
    returns (out, lse, dq, dk, dv)."""
    out, lse = opforge.attention(q, k, v, return_lse=True, attn_mask=mask, **attrs)
    assert_golden(ATTENTION, Case("band", (q, k, v, mask), attrs), (out, lse))
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out)
    grads = opforge.attention_backward(dout, q, k, v, out, lse, attn_mask=mask, **attrs)
    assert_golden(ATTENTION_BACKWARD, Case("band", (dout, q, k, v, out, lse, None, mask),
                                           attrs), grads)
    return out, lse, *grads


@pytest.mark.parametrize("sq, sk, causal, left, right", BANDS)
def test_bands_match_the_golden(sq, sk, causal, left, right, backend):
    """Every band shape, GQA 4 over 2, bf16, forward and backward."""
    q, k, v = _qkv(2, 4, 2, sq, sk, 32, torch.bfloat16, seed=sq + sk)
    _both_passes(q, k, v, None, {"causal": causal, "window_left": left,
                                 "window_right": right})


# (GQA packing, key slices), one per band in turn: decoding (3 over 300) packs and splits.
FORCED = [(1, 1), (2, 3), (1, 4), (2, 1)]


@pytest.mark.parametrize("sq, sk, causal, left, right, pack, splits",
                         [(*band, *FORCED[i % len(FORCED)]) for i, band in enumerate(BANDS)])
def test_bands_on_forced_small_tiles(sq, sk, causal, left, right, pack, splits, monkeypatch):
    """16-wide blocks on the Triton kernels: the band's masked blocks on both sides of its
    unmasked ones, blocks the band skips, the GQA packing of decoding and key slices
    counted from each query block's band; the result equals the same band given as a
    boolean mask, to float32 rounding."""
    force_attention_tiles(monkeypatch, pack, splits)
    q, k, v = _qkv(1, 4, 2, sq, sk, 16, torch.float32, seed=sq * sk)
    attrs = {"causal": causal, "window_left": left, "window_right": right}
    opforge.clear_caches()
    try:
        with opforge.use_backend("triton"):
            banded = _both_passes(q, k, v, None, attrs)
            band = visible_keys(sq, sk, key_limits(causal, left, right), DEVICE)
            masked = _both_passes(q, k, v, band[None, None], {"causal": False})
    finally:
        opforge.clear_caches()
    for got, expected in zip(banded, masked, strict=True):
        torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-6)


def test_a_window_with_a_mask_hides_what_either_hides(backend):
    """Key padding (one entry with no valid key) inside a sliding window: the golden of
    both, the fully hidden rows 0 and lse -inf."""
    q, k, v = _qkv(3, 4, 2, 29, 29, 32, torch.float32, seed=3)
    lengths = torch.tensor([29, 9, 0], device=DEVICE)
    padding = (torch.arange(29, device=DEVICE) < lengths[:, None])[:, None, None, :]
    out, lse, *_ = _both_passes(q, k, v, padding, {"causal": True, "window_left": 6})
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    assert torch.isneginf(lse[2]).all()


def test_a_window_wider_than_the_keys_is_the_causal_attention(backend):
    """A window past every key changes nothing: bitwise the causal result (the kernels
    take the same blocks)."""
    q, k, v = _qkv(1, 2, 2, 50, 70, 32, torch.float32, seed=4)
    causal = opforge.attention(q, k, v, causal=True, return_lse=True)
    wide = opforge.attention(q, k, v, causal=True, window_left=10**9, return_lse=True)
    for got, expected in zip(wide, causal, strict=True):
        assert torch.equal(got, expected)


def test_sliding_window_equals_sdpa_with_transformers_mask(backend):
    """transformers' sliding window of W keys (query i sees i - W < j <= i) is ``causal``
    with ``window_left = W - 1``: SDPA given that mask agrees."""
    q, k, v = _qkv(2, 4, 4, 41, 41, 16, torch.float32, seed=6)
    window = 8
    positions = torch.arange(41, device=DEVICE)
    shift = positions[None, :] - positions[:, None]
    mask = (shift <= 0) & (shift > -window)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    got = opforge.attention(q, k, v, causal=True, window_left=window - 1)
    torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-6)


def test_the_counted_work_is_the_band():
    """The plan's FLOPs count the pairs within the band: a sliding window of W keys over
    S queries computes S*W - W*(W-1)/2 pairs per head, not the causal S*(S+1)/2."""
    q, k, v = (torch.empty(1, 2, 1000, 64) for _ in range(3))
    window = 128
    plan = opforge.plan("attention", q, k, v, causal=True, window_left=window - 1)
    pairs = 1000 * window - window * (window - 1) // 2
    assert plan.cost.flops == 2 * 2 * pairs * (64 + 64)
    causal = opforge.plan("attention", q, k, v, causal=True)
    assert causal.cost.flops == 2 * 2 * (1000 * 1001 // 2) * (64 + 64)


def test_decoding_slices_cover_the_band_not_the_cache(monkeypatch):
    """Decoding one query over a long cache under a window: the key slices divide the
    band (a few blocks), so that no slice is empty; the merged result is the golden."""
    from opforge.ops import attention

    force_attention_tiles(monkeypatch, 1, 3)
    q, k, v = _qkv(1, 2, 2, 1, 500, 16, torch.float32, seed=8)
    attrs = {"causal": True, "window_left": 40}
    opforge.clear_caches()
    try:
        with opforge.use_backend("triton"):
            plan = opforge.plan("attention", q, k, v, None, **attrs)
            keys = attention._block_keys(plan.tiling, plan.attrs, 2, 2, 1, 500)
            # A block's 16 rows (one query, padded), the window's 40 keys before the
            # diagonal and a block of alignment: not the 500 of the cache.
            assert keys == 16 + 40 + 16
            _, slices = attention._key_slices(plan.tiling, keys)
            assert slices == 3
            _both_passes(q, k, v, None, attrs)
    finally:
        opforge.clear_caches()


@pytest.mark.parametrize("left, right", [(3, None), (-1, 6)])
def test_packed_sequences_take_the_band_per_sequence(left, right, backend):
    """Each packed sequence takes the band from its own bottom-right diagonal: the same
    out, lse and gradients as attention on the sequence alone."""
    lengths, key_lengths = [1, 0, 23, 40], [3, 5, 23, 31]
    generator = torch.Generator().manual_seed(9)
    t, tk = sum(lengths), sum(key_lengths)
    q, k, v = (torch.randn(shape, generator=generator).to(DEVICE).requires_grad_()
               for shape in ((t, 4, 16), (tk, 2, 16), (tk, 2, 16)))
    cu_q, cu_k = cumulative(lengths, DEVICE), cumulative(key_lengths, DEVICE)
    attrs = {"causal": True, "window_left": left, "window_right": right}
    out, lse = opforge.attention_varlen(q, k, v, cu_q, cu_k, True, return_lse=True,
                                        window_left=left, window_right=right)
    assert_golden(VARLEN, Case("band", (q, k, v, cu_q, cu_k),
                               {**attrs, "max_seqlen_q": None, "max_seqlen_k": None}),
                  (out, lse))
    grads = torch.autograd.grad(out.sum() + lse[torch.isfinite(lse)].sum(), (q, k, v))
    for b in range(len(lengths)):
        rows = slice(sum(lengths[:b]), sum(lengths[:b + 1]))
        keys = slice(sum(key_lengths[:b]), sum(key_lengths[:b + 1]))
        parts = [x[rows if i == 0 else keys].detach().requires_grad_()
                 for i, x in enumerate((q, k, v))]
        alone, alone_lse = opforge.attention(*(x[None] for x in parts), return_lse=True,
                                             layout="BSND", **attrs)
        torch.testing.assert_close(out[rows], alone[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lse[:, rows], alone_lse[0], rtol=1e-5, atol=1e-6)
        if parts[0].numel():
            alone_grads = torch.autograd.grad(
                alone.sum() + alone_lse[torch.isfinite(alone_lse)].sum(), parts)
            for grad, alone_grad, span in zip(grads, alone_grads, (rows, keys, keys)):
                torch.testing.assert_close(grad[span], alone_grad, rtol=1e-5, atol=1e-5)


def test_window_attributes_must_be_32_bit_integers(backend):
    q, k, v = _qkv(1, 1, 1, 4, 4, 8, torch.float32, seed=0)
    for value, param in ((2.5, "window_left"), ("2", "window_right"), (2**31, "window_left"),
                         (-2**31 - 1, "window_right")):
        with pytest.raises(AttrError) as raised:
            opforge.attention(q, k, v, **{param: value})
        assert raised.value.param == param
