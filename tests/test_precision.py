"""opforge.precision: metrics against hand-computed values and edge cases; each standard
with passing and failing examples."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from opforge.precision import CATEGORIES, Metrics, compare_tensors, judge

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


# -- documented values (docs/precision.md), restated so that a change to the code's tables fails

# Small value and its absolute tolerance, msprobe's absolute-threshold table.
DOC_SMALL_VALUES = {torch.float32: (2.0**-20, 1e-9), torch.float16: (2.0**-10, 1e-5),
                    torch.bfloat16: (2.0**-10, 1e-5)}
DOC_RTOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 4e-3}
DOC_ULP_THRESHOLD = {torch.float32: 32, torch.float16: 1, torch.bfloat16: 1}
DOC_LEVEL_LIMITS = {
    "L0": {"max_rel": 10, "mean_rel": 2, "rmse": 2, "small_value": 2, "eb": 2},
    "L1": {"max_rel": 5, "mean_rel": 1.5, "rmse": 1.5, "small_value": 2, "eb": 2},
    "L2": {"max_rel": 2, "mean_rel": 1.2, "rmse": 1.2, "small_value": 2, "eb": 2},
}
LOW = [torch.float32, torch.float16, torch.bfloat16]


def _spacing(value: float, dtype: torch.dtype) -> float:
    """The gap from ``value`` (representable in ``dtype``) up to the next value of ``dtype``."""
    v = torch.tensor([value], dtype=dtype)
    return float(torch.nextafter(v, torch.full_like(v, math.inf)).double() - v.double())


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("where", ["one", "below_one", "subnormal"])
def test_ulp_error_counts_steps_of_the_dtype(dtype, where):
    """One step of the dtype's spacing at the golden is one ULP, for subnormal goldens too
    (the min exponent); the over-threshold share counts errors strictly above 32 ULP
    (float32) or 1 ULP (float16, bfloat16)."""
    smallest = _spacing(0.0, dtype)
    golden_value = {"one": 1.5, "below_one": 1.5 * 2.0**-9, "subnormal": 64 * smallest}[where]
    assert where != "subnormal" or golden_value < torch.finfo(dtype).tiny
    threshold = DOC_ULP_THRESHOLD[dtype]
    steps = torch.tensor([0, threshold, threshold + 1, -(threshold + 1)], dtype=torch.float64)
    golden = torch.full((4,), golden_value, dtype=torch.float64)
    wanted = golden + steps * _spacing(golden_value, dtype)
    actual = wanted.to(dtype)
    assert torch.equal(actual.double(), wanted)   # every value exactly representable
    m = compare_tensors(actual, golden)
    assert m.max_ulp == threshold + 1
    assert m.mean_ulp == pytest.approx(float(steps.abs().mean()), rel=1e-12)
    assert m.ulp_over_threshold_ratio == 0.5      # the two at threshold + 1, not the one at it


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_small_value_rule_judges_goldens_below_the_small_value_by_absolute_error(dtype):
    """Goldens below the small value (2^-20 float32, 2^-10 16-bit) are judged by absolute
    error against its tolerance, not by relative error; a golden at the small value is
    normal-sized."""
    small, atol = DOC_SMALL_VALUES[dtype]
    golden = torch.tensor([0.75 * small, 0.75 * small, small, 1.0], dtype=torch.float64)

    within = (golden + torch.tensor([0.25 * atol, 0.25 * atol, 0.0, 0.0],
                                    dtype=torch.float64)).to(dtype)
    m = compare_tensors(within, golden)
    rel = (within.double() - golden).abs() / golden
    assert float(rel.max()) > DOC_RTOL[dtype]     # a relative error the rtol would fail...
    assert m.max_rel == pytest.approx(float(rel.max()), rel=1e-12)
    assert m.max_rel_normal == 0.0                # ...only on small goldens: excluded
    assert m.small_value_error_ratio == 0.0
    assert judge(m, dtype, "absolute").status == "pass"

    beyond = (golden + torch.tensor([2 * atol, 0.25 * atol, 2 * atol, 0.0],
                                    dtype=torch.float64)).to(dtype)
    diff = (beyond.double() - golden).abs()
    assert atol < diff[0] < 3 * atol and diff[1] <= atol   # the rounding kept the intent
    m = compare_tensors(beyond, golden)
    assert m.small_value_error_ratio == 0.25      # the first only: the third is not small
    assert m.max_rel_normal == pytest.approx(float(diff[2] / small), rel=1e-12)
    verdict = judge(m, dtype, "absolute")
    assert verdict.status == "error" and any("below" in r for r in verdict.reasons)


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("where", ["one", "below_one", "below_small"])
def test_max_eps_is_the_error_in_eps_of_the_golden(dtype, where):
    """max_eps = |a - g| / (eps * max(scale, small)), scale |g| by default: pins the bound
    every golden test asserts (one step at 1.5 is 2/3 eps, not 1/16 of that)."""
    small = DOC_SMALL_VALUES[dtype][0]
    eps = torch.finfo(dtype).eps
    golden_value = {"one": 1.5, "below_one": 1.5 * 2.0**-9, "below_small": 0.25 * small}[where]
    golden = torch.tensor([golden_value, golden_value], dtype=torch.float64)
    actual = (golden + torch.tensor([3.0, 0.0], dtype=torch.float64)
              * _spacing(golden_value, dtype)).to(dtype)
    diff = float((actual.double() - golden).abs().max())
    assert diff > 0
    m = compare_tensors(actual, golden)
    assert m.max_eps == pytest.approx(diff / (eps * max(golden_value, small)), rel=1e-12)
    scaled = compare_tensors(actual, golden, scale=torch.full((2,), 8.0))
    assert scaled.max_eps == pytest.approx(diff / (eps * 8.0), rel=1e-12)


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_correctly_rounded_results_stay_within_half_an_eps(dtype):
    """Rounding the golden to the dtype gives max_eps in (0.25, 0.5]: the bound is tight."""
    generator = torch.Generator().manual_seed(5)
    golden = torch.randn(1000, generator=generator, dtype=torch.float64) * torch.pow(
        2.0, torch.randint(-12, 4, (1000,), generator=generator).double())
    m = compare_tensors(golden.to(dtype), golden)
    assert 0.25 < m.max_eps <= 0.5


@pytest.mark.parametrize("field, t", [
    ("hundredth_ratio", 1e-2), ("thousandth_ratio", 1e-3),
    ("five_thousandths_ratio", 5e-3), ("ten_thousandth_ratio", 1e-4)])
def test_dual_ratios_count_relative_errors_strictly_under_t(field, t):
    """Each dual-t ratio is the share of elements with relative error < t: an error of
    exactly t does not count."""
    golden = torch.full((2,), 10_000.0, dtype=torch.float64)
    off = 10_000 * t                                # an integer: exact in float32
    actual = torch.tensor([10_000 + off, 10_000 + off - 1], dtype=torch.float32)
    assert (actual.double()[0] - golden[0]) / golden[0] == t
    assert getattr(compare_tensors(actual, golden), field) == 0.5


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_absolute_standard_fails_relative_errors_above_rtol(dtype):
    """The absolute standard errs when a normal-sized golden's relative error exceeds rtol
    (float32 1e-6, float16 1e-3, bfloat16 4e-3), and passes just under it."""
    rtol = DOC_RTOL[dtype]
    actual = torch.ones(2, dtype=dtype)
    for factor, status in ((0.5, "pass"), (1.5, "error")):
        golden = torch.tensor([1 / (1 + factor * rtol), 1.0], dtype=torch.float64)
        m = compare_tensors(actual, golden)
        assert m.max_rel_normal == pytest.approx(factor * rtol, rel=1e-9)
        assert judge(m, dtype, "absolute").status == status


@pytest.mark.parametrize("ulps, status", [
    ([40] * 100, "pass"),                  # every element above 32 ULP, but the mean 40 < 64
    ([70] * 100, "error"),                 # mean 70, share 1
    ([2000] * 4 + [0] * 96, "pass"),       # mean 80, but the share 0.04 < 0.05
    ([2000] * 5 + [0] * 95, "error"),      # share 0.05 is not under 0.05, mean 100
], ids=["mean_40", "mean_70", "share_4pc", "share_5pc"])
def test_float32_ulp_standard_passes_on_the_mean_or_the_share(ulps, status):
    """float32 passes the ULP standard when the mean ULP error is under 64 or under 5% of
    elements exceed 32 ULP."""
    golden = torch.full((len(ulps),), 1.5, dtype=torch.float64)
    actual = (golden + torch.tensor(ulps, dtype=torch.float64) * F32_EPS).float()
    m = compare_tensors(actual, golden)
    assert m.mean_ulp == pytest.approx(sum(ulps) / len(ulps), rel=1e-12)
    assert judge(m, torch.float32, "ulp").status == status


def test_dual_thousandth_small_errors_pass_on_max_abs():
    """Max abs error < 0.001 passes dual_thousandth outright (after the cosine gate), even
    when no element meets the dual-1000 ratio; the same relative error on larger values
    fails."""
    for low, status in ((1e-4, "pass"), (1.0, "error")):
        golden = torch.linspace(low, 2 * low, 1000, dtype=torch.float64)
        m = compare_tensors((golden * 1.01).float(), golden)
        assert m.thousandth_ratio == 0.0 and m.cosine > 0.99
        assert judge(m, torch.float32, "dual_thousandth").status == status


@pytest.mark.parametrize("dtype, t", [(torch.float32, 1e-3), (torch.float16, 1e-2),
                                      (torch.bfloat16, 1e-2)], ids=str)
def test_dual_share_must_exceed_one_minus_t(dtype, t):
    """The dual-t share must be > 1 - t: exactly 1 - t is an error (t = 1‰ for float32,
    1% for 16-bit), one element fewer off passes to the warning level."""
    n = 10_000
    golden = torch.linspace(1, 2, n, dtype=torch.float64)
    for off, status in ((round(n * t), "error"), (round(n * t) - 1, "warning")):
        noisy = golden.clone()
        noisy[:off] *= 1 + 5 * t
        m = compare_tensors(noisy.to(dtype), golden)
        share = {1e-3: m.thousandth_ratio, 1e-2: m.hundredth_ratio}[t]
        assert share == (n - off) / n
        assert judge(m, dtype, "dual_thousandth").status == status


def test_dual_thousandth_cosine_gate_comes_first():
    """Cosine <= 0.99 is an error even when max abs error < 0.001 would pass."""
    golden = torch.linspace(-1e-5, 1e-5, 1000, dtype=torch.float64)
    actual = golden.float()
    actual[:500] = 0                                # half the signal lost: cosine 1/sqrt(2)
    m = compare_tensors(actual, golden)
    assert m.cosine == pytest.approx(1 / math.sqrt(2), rel=1e-3) and m.max_abs < 1e-3
    verdict = judge(m, torch.float32, "dual_thousandth")
    assert verdict.status == "error" and "cosine" in verdict.reasons[0]
    for cosine, status in ((0.99, "error"), (0.995, "pass")):
        gated = dataclasses.replace(m, cosine=cosine)
        assert judge(gated, torch.float32, "dual_thousandth").status == status


@pytest.mark.parametrize("level", sorted(DOC_LEVEL_LIMITS))
def test_benchmark_ratio_limits_per_level(level):
    """Each benchmark ratio (opforge's error over the peer's) passes at 0.9x its level's
    limit and fails at 1.1x, naming the ratio."""
    fields = {"max_rel": "max_rel", "mean_rel": "mean_rel", "rmse": "rmse",
              "small_value": "small_value_error_ratio", "eb": "error_balance"}
    # Peer errors of 0.01, far above every floor (min_err 2^-14, 3/sqrt(n) = 0.003).
    peer = Metrics(count=10**6, golden_rms=1.0,
                   **{field: 0.01 for field in fields.values()})
    assert judge(peer, torch.float32, "benchmark_ratio", peer=peer, level=level).passed
    for name, limit in DOC_LEVEL_LIMITS[level].items():
        for factor, status in ((0.9, "pass"), (1.1, "error")):
            ours = dataclasses.replace(peer, **{fields[name]: 0.01 * limit * factor})
            verdict = judge(ours, torch.float32, "benchmark_ratio", peer=peer, level=level)
            assert verdict.status == status, (name, factor, verdict.reasons)
            if status == "error":
                assert [r.split()[0] for r in verdict.reasons] == [name]


@pytest.mark.parametrize("category", CATEGORIES)
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nan_inf_mismatch_is_an_error_in_every_category(category, bad):
    """A NaN or Inf where the golden is finite fails every standard, even when every
    finite element is exact."""
    golden = torch.ones(8, dtype=torch.float64)
    clean = compare_tensors(golden.float(), golden)
    assert judge(clean, torch.float32, category, peer=clean).passed
    actual = golden.float()
    actual[3] = bad
    verdict = judge(compare_tensors(actual, golden), torch.float32, category, peer=clean)
    assert verdict.status == "error" and "NaN/Inf" in verdict.reasons[0]
