"""opforge.precision: metrics against hand-computed values and edge cases; each standard
with passing and failing examples."""

from __future__ import annotations

import math

import pytest
import torch

from opforge.precision import compare_tensors, judge

F32_EPS = 2.0**-23


def test_metrics_match_hand_computed_values():
    golden = torch.tensor([1.0, 2.0, -4.0, 0.5], dtype=torch.float64)
    actual = torch.tensor([1.0, 2.002, -4.0, 0.49], dtype=torch.float32)
    m = compare_tensors(actual, golden)
    diff = torch.tensor([0.0, float(torch.tensor(2.002)) - 2.0, 0.0,
                         float(torch.tensor(0.49)) - 0.5], dtype=torch.float64)
    rel = diff.abs() / golden.abs()
    assert m.count == 4
    assert m.max_abs == pytest.approx(float(diff.abs().max()), rel=1e-12)
    assert m.max_rel == pytest.approx(float(rel.max()), rel=1e-12)   # 0.01 / 0.5 = 0.02
    assert m.mean_rel == pytest.approx(float(rel.mean()), rel=1e-12)
    assert m.rmse == pytest.approx(math.sqrt(float(diff.square().mean())), rel=1e-12)
    assert m.euclidean == pytest.approx(float(diff.norm()), rel=1e-12)
    a64 = actual.double()
    assert m.cosine == pytest.approx(float(a64 @ golden / (a64.norm() * golden.norm())))
    assert m.error_balance == pytest.approx(abs(1 - 1) / 4)   # one above, one below
    # Relative errors are 0, ~1e-3 (2.002 in float32), 0, 0.02.
    assert m.hundredth_ratio == 0.75 and m.ten_thousandth_ratio == 0.5
    assert m.worst[0].index == (3,) and m.worst_index == (3,)
    assert m.worst[0].golden == 0.5
    # ULP: 0.49 vs 0.5 (exponent -1): |diff| * 2^(23 + 1).
    assert m.max_ulp == pytest.approx(abs(float(diff[3])) * 2.0**24, rel=1e-9)
    assert m.nan_inf_mismatch == 0 and m.binary_mismatch == 2


def test_zero_golden_shifts_by_eps():
    m = compare_tensors(torch.tensor([1e-6, 0.0]), torch.zeros(2, dtype=torch.float64))
    assert m.max_rel == pytest.approx(float(torch.tensor(1e-6)) / F32_EPS, rel=1e-9)
    assert m.cosine == 0.0   # one side is all zeros, the other is not
    both_zero = compare_tensors(torch.zeros(3), torch.zeros(3, dtype=torch.float64))
    assert both_zero.cosine == 1.0 and both_zero.max_rel == 0.0


def test_nan_and_inf_positions():
    golden = torch.tensor([math.nan, math.inf, -math.inf, 1.0], dtype=torch.float64)
    same = compare_tensors(torch.tensor([math.nan, math.inf, -math.inf, 1.0]), golden)
    assert same.nan_inf_mismatch == 0 and same.count == 1 and same.max_abs == 0.0
    wrong = compare_tensors(torch.tensor([1.0, -math.inf, -math.inf, math.nan]), golden)
    assert wrong.nan_inf_mismatch == 3
    assert judge(wrong, torch.float32, "absolute").status == "error"


def test_empty_and_integer_outputs():
    empty = compare_tensors(torch.empty(0, 3), torch.empty(0, 3, dtype=torch.float64))
    assert empty.count == 0 and empty.max_abs == 0.0 and empty.cosine == 1.0
    ints = compare_tensors(torch.tensor([1, 2, 3]), torch.tensor([1, 2, 4]))
    assert ints.binary_mismatch == 1
    assert judge(ints, torch.int64, "binary").status == "error"
    flags = compare_tensors(torch.tensor([True, False]), torch.tensor([True, False]))
    assert judge(flags, torch.bool, "binary").status == "pass"


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="shape"):
        compare_tensors(torch.ones(3), torch.ones(4))


def test_small_value_errors_are_absolute():
    golden = torch.tensor([1e-8, 1.0], dtype=torch.float64)
    ok = compare_tensors(torch.tensor([1.0005e-8, 1.0]), golden)
    assert ok.small_value_error_ratio == 0.0   # abs error 5e-12 < 1e-9
    bad = compare_tensors(torch.tensor([5e-8, 1.0]), golden)
    assert bad.small_value_error_ratio == 0.5
    assert judge(bad, torch.float32, "absolute").status == "error"


def test_absolute_standard():
    golden = torch.linspace(1, 2, 101, dtype=torch.float64)
    assert judge(compare_tensors(golden.float(), golden), torch.float32, "absolute").passed
    off = golden.float() * (1 + 4e-6)
    verdict = judge(compare_tensors(off, golden), torch.float32, "absolute")
    assert verdict.status == "error" and "rtol" in verdict.reasons[0]
    assert judge(compare_tensors(off.half(), golden), torch.float16, "absolute").passed


def test_ulp_standard():
    golden = torch.linspace(1, 2, 1000, dtype=torch.float64)
    rounded = golden.to(torch.bfloat16)
    assert judge(compare_tensors(rounded, golden), torch.bfloat16, "ulp").passed
    two_ulp = (golden + 2 * 2.0**-7 * 1.5).to(torch.bfloat16)
    failed = judge(compare_tensors(two_ulp, golden), torch.bfloat16, "ulp")
    assert failed.status == "error" and "ULP" in failed.reasons[0]
    # Doing no worse than the peer passes.
    peer = compare_tensors(two_ulp, golden)
    assert judge(peer, torch.bfloat16, "ulp", peer=peer).passed


def test_dual_thousandth_standard():
    golden = torch.linspace(1, 2, 10_000, dtype=torch.float64)
    assert judge(compare_tensors(golden.float(), golden), torch.float32,
                 "dual_thousandth").status == "pass"
    noisy = golden.clone()
    noisy[:5] *= 1.01          # 0.05% of elements 1% off: dual-1000 holds, dual-10000 fails
    verdict = judge(compare_tensors(noisy.float(), golden), torch.float32, "dual_thousandth")
    assert verdict.status == "warning"
    noisy[:50] *= 1.01         # 0.5% of elements off: dual-1000 fails
    assert judge(compare_tensors(noisy.float(), golden), torch.float32,
                 "dual_thousandth").status == "error"
    flipped = judge(compare_tensors(-golden.float(), golden), torch.float32, "dual_thousandth")
    assert flipped.status == "error" and "cosine" in flipped.reasons[0]


def test_benchmark_ratio_standard():
    golden = torch.randn(4096, generator=torch.Generator().manual_seed(0),
                         dtype=torch.float64)
    peer = compare_tensors(golden.to(torch.bfloat16), golden)     # rounded once
    ours = compare_tensors(golden.to(torch.bfloat16), golden)
    assert judge(ours, torch.bfloat16, "benchmark_ratio", peer=peer, level="L2").passed
    sloppy = compare_tensors((golden * (1 + 0.05)).to(torch.bfloat16), golden)
    verdict = judge(sloppy, torch.bfloat16, "benchmark_ratio", peer=peer, level="L2")
    assert verdict.status == "error" and any("mean_rel" in r for r in verdict.reasons)
    with pytest.raises(ValueError, match="peer"):
        judge(ours, torch.bfloat16, "benchmark_ratio")
    with pytest.raises(ValueError, match="level"):
        judge(ours, torch.bfloat16, "benchmark_ratio", peer=peer, level="L9")
    with pytest.raises(ValueError, match="category"):
        judge(ours, torch.bfloat16, "vibes")


def test_error_balance_ratio_ignores_chance_imbalance_but_not_truncation():
    generator = torch.Generator().manual_seed(3)
    golden = torch.randn(4096, generator=generator, dtype=torch.float64).abs()
    rounded = compare_tensors(golden.to(torch.bfloat16), golden)
    # A peer whose rounding happened to balance exactly: the noise floor 3/sqrt(n) decides.
    balanced_peer = compare_tensors(golden.to(torch.bfloat16), golden)
    object.__setattr__(balanced_peer, "error_balance", 0.0)
    assert rounded.error_balance < 3 / math.sqrt(4096)
    assert judge(rounded, torch.bfloat16, "benchmark_ratio", peer=balanced_peer).passed
    # Truncating positive values leans every error one way: EB ~ 1, far above the floor.
    bits = golden.float().view(torch.int32) & ~0xFFFF
    truncated = compare_tensors(bits.view(torch.float32).to(torch.bfloat16), golden)
    verdict = judge(truncated, torch.bfloat16, "benchmark_ratio", peer=rounded)
    assert truncated.error_balance > 0.9
    assert verdict.status == "error" and any(r.startswith("eb ratio") for r in verdict.reasons)


def test_rmse_ratio_floor_is_relative_to_the_golden():
    """RMSE is absolute: its floor scales with the golden's RMS, like the RE ratios' floor."""
    golden = torch.full((16,), 8e4, dtype=torch.float64)
    exact_peer = compare_tensors(golden.float(), golden)
    ours = compare_tensors((golden + 0.004).float(), golden)   # well under one ulp (0.0078)
    assert exact_peer.rmse == 0 and ours.rmse > 0
    assert ours.golden_rms == pytest.approx(8e4)
    assert judge(ours, torch.float32, "benchmark_ratio", peer=exact_peer, level="L2").passed
    off = compare_tensors((golden * (1 + 1e-3)).float(), golden)
    assert not judge(off, torch.float32, "benchmark_ratio", peer=exact_peer, level="L2").passed


@pytest.mark.parametrize("actual, golden", [
    (torch.ones(3, dtype=torch.float8_e4m3fn), torch.ones(3, dtype=torch.float64)),
    (torch.tensor([1 + 1j]), torch.tensor([1 + 2j], dtype=torch.complex128)),
    (torch.ones(3), torch.ones(3, dtype=torch.complex128)),
], ids=["float8", "complex", "complex golden"])
def test_dtypes_without_metrics_are_typed_errors(actual, golden):
    from opforge.core.errors import DtypeError

    with pytest.raises(DtypeError, match="no precision metrics"):
        compare_tensors(actual, golden)
