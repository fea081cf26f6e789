"""Precision standards: a verdict (pass / warning / error, with reasons) for `Metrics`.

Categories, as the Ascend precision standard (msprobe) assigns them to operators:

``absolute``         simple arithmetic (add, mul, ...): no NaN/Inf mismatch, no element of a
                     normal-sized golden with relative error above ``rtol``, no golden below
                     the small value with an absolute error above its tolerance.
``binary``           exact operators and integer/bool outputs: every element equal.
``ulp``              matmul-like: float16/bfloat16 pass when under 0.1% of elements exceed
                     1 ULP; float32 when the mean ULP error is under 64 or under 5% exceed
                     32 ULP; either passes too when doing no worse than the peer.
``dual_thousandth``  cosine > 0.99, then max abs error < 0.001 passes outright; otherwise
                     the share of elements with relative error under t must exceed 1 - t:
                     float16/bfloat16 error at t = 1%, warning at 1‰; float32 error at 1‰,
                     warning at 0.1‰.
``benchmark_ratio``  every other operator: opforge's error over the peer's (torch's own
                     operator against the same float64 golden), each ratio over
                     ``max(peer, min_err)``, within the limits of the operator's level
                     (L0 general, L1 fused/attention-like, L2 the most common: matmul,
                     layer norm, GELU, sum...). The error-balance ratio's floor is also
                     3/sqrt(n), the chance imbalance of unbiased rounding (opforge's
                     addition: msprobe's floor alone makes the EB ratio of two unbiased
                     results a coin toss), and RMSE, an absolute error, has the floor
                     min_err x the golden's RMS: the relative floor of the RE ratios.

All thresholds live in `THRESHOLDS`; ``docs/precision.md`` documents them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from opforge.precision.metrics import SMALL_VALUES, Metrics

CATEGORIES = ("absolute", "binary", "ulp", "dual_thousandth", "benchmark_ratio")
LEVELS = ("L0", "L1", "L2")

THRESHOLDS: dict[str, dict[object, dict[str, float]]] = {
    # msprobe api_precision_threshold.yaml (absolute threshold).
    # The small value and its absolute tolerance are `metrics.SMALL_VALUES`.
    "absolute": {
        torch.float32: {"rtol": 1e-6},
        torch.float16: {"rtol": 1e-3},
        torch.bfloat16: {"rtol": 4e-3},
        torch.float64: {"rtol": 1e-12},
    },
    # ULP standard: share of elements above the per-element threshold, mean ULP limit.
    "ulp": {
        torch.float32: {"threshold": 32.0, "max_share": 0.05, "mean_limit": 64.0},
        torch.float64: {"threshold": 32.0, "max_share": 0.05, "mean_limit": 64.0},
        torch.float16: {"threshold": 1.0, "max_share": 0.001},
        torch.bfloat16: {"threshold": 1.0, "max_share": 0.001},
    },
    # Dual-t: the share of elements with relative error < t must exceed 1 - t.
    "dual_thousandth": {
        torch.float32: {"error_t": 1e-3, "warning_t": 1e-4},
        torch.float64: {"error_t": 1e-3, "warning_t": 1e-4},
        torch.float16: {"error_t": 1e-2, "warning_t": 1e-3},
        torch.bfloat16: {"error_t": 1e-2, "warning_t": 1e-3},
        "first_pass": {"min_cosine": 0.99, "max_abs_pass": 1e-3},
    },
    # Comparing two runs entry by entry: an entry diverges when the cosine similarity falls
    # below min_cosine or the L2 norms differ by more than norm_rtol (relative), for the
    # lower-precision dtype of the two runs (a bf16 run drifts from an fp32 one by design).
    "run_compare": {
        torch.float32: {"min_cosine": 0.9999, "norm_rtol": 1e-3},
        torch.float64: {"min_cosine": 0.999999, "norm_rtol": 1e-6},
        torch.float16: {"min_cosine": 0.999, "norm_rtol": 1e-2},
        torch.bfloat16: {"min_cosine": 0.99, "norm_rtol": 5e-2},
    },
    # Benchmark ratio: ratio limits per level, and the floor of the peer's error.
    "benchmark_ratio": {
        "L0": {"max_rel": 10.0, "mean_rel": 2.0, "rmse": 2.0, "small_value": 2.0, "eb": 2.0},
        "L1": {"max_rel": 5.0, "mean_rel": 1.5, "rmse": 1.5, "small_value": 2.0, "eb": 2.0},
        "L2": {"max_rel": 2.0, "mean_rel": 1.2, "rmse": 1.2, "small_value": 2.0, "eb": 2.0},
        "min_err": {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8,
                    torch.float32: 2.0**-14, torch.float64: 2.0**-30},
        # Unbiased rounding of n elements gives an error balance of about 1/sqrt(n) by
        # chance: the EB ratio's floor is also eb_noise_sigmas / sqrt(n), so that two
        # unbiased results are never told apart by noise (truncation still gives EB ~ 1).
        "eb_noise_sigmas": 3.0,
    },
}

# Share of small-golden elements with an absolute error above the dtype's tolerance is
# `Metrics.small_value_error_ratio`; the ratios that map to a `Metrics` field:
_RATIO_FIELDS = {"max_rel": "max_rel", "mean_rel": "mean_rel", "rmse": "rmse",
                 "small_value": "small_value_error_ratio", "eb": "error_balance"}
_DUAL_FIELDS = {1e-2: "hundredth_ratio", 1e-3: "thousandth_ratio",
                1e-4: "ten_thousandth_ratio"}


@dataclass(frozen=True)
class Verdict:
    """A standard's decision: ``status`` in ``pass``/``warning``/``error``, and why."""

    status: str
    category: str
    reasons: tuple[str, ...] = field(default_factory=tuple)

    @property
    def passed(self) -> bool:
        return self.status != "error"


def _table(category: str, dtype: torch.dtype) -> dict[str, float]:
    try:
        return THRESHOLDS[category][dtype]
    except KeyError:
        raise ValueError(f"the {category} standard has no thresholds for {dtype}") from None


def judge(metrics: Metrics, dtype: torch.dtype, category: str,
          peer: Metrics | None = None, level: str = "L0") -> Verdict:
    """Judge ``metrics`` (of an output of ``dtype``) by the ``category`` standard.

    Args:
        metrics: from `compare_tensors` against the float64 golden.
        dtype: the output dtype (selects the thresholds).
        category: one of `CATEGORIES`.
        peer: torch's own operator's metrics against the same golden; required by
            ``benchmark_ratio``, optional for ``ulp`` (doing no worse than it passes).
        level: ``L0``/``L1``/``L2`` for ``benchmark_ratio``.

    Raises:
        ValueError: unknown category or level, a dtype without thresholds, or a missing
            peer for ``benchmark_ratio``.
    """
    if category not in CATEGORIES:
        raise ValueError(f"unknown precision category {category!r}; expected one of "
                         f"{', '.join(CATEGORIES)}")
    if metrics.nan_inf_mismatch:
        return Verdict("error", category,
                       (f"{metrics.nan_inf_mismatch} elements differ in NaN/Inf",))
    if category == "binary":
        if metrics.binary_mismatch:
            return Verdict("error", category,
                           (f"{metrics.binary_mismatch} of {metrics.count} elements differ",))
        return Verdict("pass", category)
    return {"absolute": _absolute, "ulp": _ulp, "dual_thousandth": _dual,
            "benchmark_ratio": _benchmark}[category](metrics, dtype, peer, level)


def _absolute(metrics: Metrics, dtype: torch.dtype, peer: Metrics | None,
              level: str) -> Verdict:
    limits = _table("absolute", dtype)
    reasons = []
    if metrics.max_rel_normal > limits["rtol"]:
        reasons.append(f"relative error {metrics.max_rel_normal:.3g} > rtol "
                       f"{limits['rtol']:g} on a normal-sized golden")
    if metrics.small_value_error_ratio > 0:
        small, atol = SMALL_VALUES[dtype]
        reasons.append(f"{metrics.small_value_error_ratio:.3g} of elements are goldens below "
                       f"{small:g} with absolute error > {atol:g}")
    return Verdict("error" if reasons else "pass", "absolute", tuple(reasons))


def _ulp(metrics: Metrics, dtype: torch.dtype, peer: Metrics | None, level: str) -> Verdict:
    limits = _table("ulp", dtype)
    share = metrics.ulp_over_threshold_ratio
    ok = share < limits["max_share"]
    if "mean_limit" in limits:
        ok = ok or metrics.mean_ulp < limits["mean_limit"]
    if not ok and peer is not None and share <= peer.ulp_over_threshold_ratio:
        return Verdict("pass", "ulp", (f"{share:.3g} of elements exceed "
                                       f"{limits['threshold']:g} ULP, no more than the peer",))
    if ok:
        return Verdict("pass", "ulp")
    return Verdict("error", "ulp", (f"{share:.3g} of elements exceed {limits['threshold']:g} "
                                    f"ULP (limit {limits['max_share']:g}); mean "
                                    f"{metrics.mean_ulp:.3g} ULP",))


def _dual(metrics: Metrics, dtype: torch.dtype, peer: Metrics | None, level: str) -> Verdict:
    first = THRESHOLDS["dual_thousandth"]["first_pass"]
    if metrics.count and metrics.cosine <= first["min_cosine"]:
        return Verdict("error", "dual_thousandth",
                       (f"cosine {metrics.cosine:.6f} <= {first['min_cosine']}",))
    if metrics.max_abs < first["max_abs_pass"]:
        return Verdict("pass", "dual_thousandth")
    limits = _table("dual_thousandth", dtype)
    for status, key in (("error", "error_t"), ("warning", "warning_t")):
        t = limits[key]
        share = getattr(metrics, _DUAL_FIELDS[t])
        if share <= 1 - t:
            return Verdict(status, "dual_thousandth",
                           (f"{share:.6f} of elements have relative error < {t:g}; "
                            f"needs > {1 - t:g}",))
    return Verdict("pass", "dual_thousandth")


def _benchmark(metrics: Metrics, dtype: torch.dtype, peer: Metrics | None,
               level: str) -> Verdict:
    if peer is None:
        raise ValueError("the benchmark_ratio standard needs the peer's metrics")
    if level not in LEVELS:
        raise ValueError(f"unknown level {level!r}; expected one of {', '.join(LEVELS)}")
    limits = THRESHOLDS["benchmark_ratio"][level]
    floor = THRESHOLDS["benchmark_ratio"]["min_err"].get(dtype)
    if floor is None:
        raise ValueError(f"the benchmark_ratio standard has no thresholds for {dtype}")
    noise = THRESHOLDS["benchmark_ratio"]["eb_noise_sigmas"] / math.sqrt(max(metrics.count, 1))
    reasons = []
    for name, limit in limits.items():
        ours = abs(getattr(metrics, _RATIO_FIELDS[name]))
        theirs = abs(getattr(peer, _RATIO_FIELDS[name]))
        # The rmse floor is relative to the golden's RMS, and to the small value where the
        # golden is (nearly) all zero: an error of 1e-40 against zeros is no failure.
        denominator = max(theirs, {"eb": max(floor, noise),
                                   "rmse": floor * max(metrics.golden_rms,
                                                       SMALL_VALUES[dtype][0])
                                   }.get(name, floor))
        ratio = ours / denominator if denominator else (math.inf if ours else 0.0)
        if ratio > limit:
            reasons.append(f"{name} ratio {ratio:.3g} > {limit:g} "
                           f"(opforge {ours:.3g}, peer {theirs:.3g})")
    return Verdict("error" if reasons else "pass", "benchmark_ratio", tuple(reasons))
