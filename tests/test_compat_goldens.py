"""`opforge.compat.torch_npu` follows the vendor's own goldens where they round
differently from opforge's native operators: each golden re-derived from the formula of
the Ascend op-plugin test file named in the test."""

from __future__ import annotations

import torch

import opforge
from opforge.compat.torch_npu import npu_add_rms_norm, npu_moe_gating_top_k_softmax

from .conftest import DEVICE


def _add_rms_norm_golden(x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor,
                         eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`test_npu_add_rms_norm.py`: the sum in the inputs' dtype, then the norm in float32."""
    total = (x1 + x2).float()
    rstd = torch.rsqrt(total.square().mean(-1, keepdim=True) + eps)
    return (total * rstd * gamma.float()).to(x1.dtype), rstd


def test_add_rms_norm_normalises_the_rounded_sum_in_float16(backend):
    """``x1 = [[1024, 1]]``, ``x2 = [[0.5, 0]]``: 1024.5 rounds to 1024 in float16. The
    compat function's rstd is the golden's; the native operator normalises 1024.5 (rstd
    about 4.9e-4 relative apart, the issue's example)."""
    x1 = torch.tensor([[1024.0, 1.0]], device=DEVICE).half()
    x2 = torch.tensor([[0.5, 0.0]], device=DEVICE).half()
    gamma = torch.tensor([1.0, 1.0], device=DEVICE).half()
    y, rstd, total = npu_add_rms_norm(x1, x2, gamma, 1e-6)
    golden_y, golden_rstd = _add_rms_norm_golden(x1, x2, gamma, 1e-6)
    torch.testing.assert_close(rstd, golden_rstd, rtol=2 ** -23, atol=0)
    assert torch.equal(y, golden_y) and torch.equal(total, x1 + x2)
    native_rstd = torch.ops.opforge.add_rms_norm(x1, x2, gamma, 1e-6)[1]
    assert abs(float(native_rstd.flatten()[0] / golden_rstd.flatten()[0]) - 1) > 1e-4


def test_add_rms_norm_matches_the_golden_on_random_rows(backend):
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        x1, x2 = (torch.randn(7, 96, generator=generator).to(DEVICE, dtype) for _ in range(2))
        gamma = torch.randn(96, generator=generator).to(DEVICE, dtype)
        y, rstd, _ = npu_add_rms_norm(x1, x2, gamma, 1e-6)
        golden_y, golden_rstd = _add_rms_norm_golden(x1, x2, gamma, 1e-6)
        torch.testing.assert_close(rstd, golden_rstd, rtol=4 * 2 ** -23, atol=0)
        # rstd and the two products each round once in the golden: a few ulps of float32
        # apart; one rounding to a 16-bit dtype hides that almost always.
        eps = torch.finfo(dtype).eps
        assert ((y.float() - golden_y.float()).abs() <= 4 * eps * golden_y.float().abs()
                + torch.finfo(dtype).tiny).all()


def _top_k_softmax_golden(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`test_npu_moe_gating_top_k_softmax.py`: float32 softmax rounded to x's dtype, then
    the top k of the rounded values, ties to the lower index."""
    probabilities = torch.softmax(x.float(), -1).to(x.dtype)
    order = torch.argsort(-probabilities.float(), dim=-1, stable=True)[..., :k]
    return probabilities.gather(-1, order), order.int()


def test_top_k_softmax_selects_on_the_rounded_probabilities(backend):
    """``x = [[0, 1e-4, -1, -1]]`` in float16, k = 1: the two leading probabilities round
    to one float16 value, so the golden takes expert 0; the native operator, selecting on
    float32 probabilities, takes expert 1."""
    x = torch.tensor([[0.0, 1e-4, -1.0, -1.0]], device=DEVICE).half()
    y, idx, _ = npu_moe_gating_top_k_softmax(x, k=1)
    golden_y, golden_idx = _top_k_softmax_golden(x, 1)
    assert idx.tolist() == [[0]] and torch.equal(idx, golden_idx)
    assert torch.equal(y, golden_y)
    assert opforge.moe_gating_top_k_softmax(x, k=1)[1].tolist() == [[1]]


def test_top_k_softmax_matches_the_golden_bit_for_bit_with_many_ties(backend):
    """Logits on a coarse grid make ties in float16 everywhere: indices and weights are the
    golden's exactly."""
    generator = torch.Generator().manual_seed(1)
    for dtype in (torch.float16, torch.bfloat16):
        x = (torch.randint(-8, 8, (2, 9, 64), generator=generator) / 4).to(DEVICE, dtype)
        y, idx, _ = npu_moe_gating_top_k_softmax(x, k=6)
        golden_y, golden_idx = _top_k_softmax_golden(x, 6)
        assert torch.equal(idx, golden_idx) and torch.equal(y, golden_y)
