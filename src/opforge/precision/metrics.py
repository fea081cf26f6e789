"""Error metrics of an output against its float64 golden.

`compare_tensors(actual, golden)` computes, over the elements where both are finite:

- ``max_abs``: max ``|a - g|``; ``rmse``; ``euclidean`` ``||a - g||_2``; ``golden_rms``,
  the root mean square of the golden (the magnitude an RMSE is relative to);
- ``max_rel`` / ``mean_rel`` of ``|a - g| / |g|``; where ``g == 0`` both values are shifted
  by the eps of the compared dtype (msprobe's rule), so the relative error is ``|a| / eps``;
  ``max_rel_normal``, the largest over goldens at or above the small value;
- ``cosine`` ``a.g / (|a| |g|)`` (1 when both are all zeros, 0 when only one is);
- ``error_balance`` ``|#(a > g) - #(a < g)| / n``: systematic bias of the rounding;
- the share of elements with relative error under 1%, 1‰, 5‰ and 0.1‰ (the dual-100,
  dual-1000, five-thousandths and dual-10000 ratios);
- ULP error ``|a - g| * 2^(mantissa_bits - e)``, ``e = max(floor(log2 |g|), min_exponent)``:
  ``max_ulp``, ``mean_ulp``, and ``ulp_over_threshold_ratio``, the share above the dtype's
  per-element threshold (32 for float32, 1 for float16/bfloat16);
- ``small_value_error_ratio``: among goldens below the dtype's small-value threshold, the
  share whose absolute error exceeds the small-value tolerance;
- ``max_eps``: ``|a - g| / (eps * max(scale, small))`` against an operator's error scale
  (`OpDef.error_scale`; ``|g|`` by default): opforge's condition-aware measure, at most 0.5
  for a correctly rounded result;
- ``nan_inf_mismatch``: positions where NaN/±Inf differ between the two;
- ``binary_mismatch``: elements that are not bit-for-bit equal (the measure for integer
  and bool outputs);
- ``worst``: the elements with the largest relative error, with their indices.

The small-value thresholds (below which errors are judged as absolute errors) and the
tolerances come from two tables of the Ascend precision standard (msprobe): see
`SMALL_VALUES` and `docs/precision.md`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from opforge.core.errors import DtypeError

# (small value, absolute tolerance below it): msprobe's standard_config.py `_small_value`
# with api_precision_threshold.yaml's `small_value_atol` (why: docs/precision.md).
SMALL_VALUES = {torch.float32: (2.0**-20, 1e-9), torch.float16: (2.0**-10, 1e-5),
                torch.bfloat16: (2.0**-10, 1e-5), torch.float64: (2.0**-40, 1e-15)}
MANTISSA_BITS = {torch.float64: 52, torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}
# Per-element ULP thresholds of the Ascend ULP standard.
ULP_THRESHOLDS = {torch.float32: 32.0, torch.float64: 32.0, torch.float16: 1.0,
                  torch.bfloat16: 1.0}
RATIO_THRESHOLDS = {"hundredth_ratio": 1e-2, "thousandth_ratio": 1e-3,
                    "five_thousandths_ratio": 5e-3, "ten_thousandth_ratio": 1e-4}
WORST_COUNT = 5


def eps(dtype: torch.dtype) -> float:
    """Spacing of ``dtype`` at 1.0 (2^-23 for float32, 2^-10 for float16, 2^-7 for bf16);
    1 for integer and bool dtypes."""
    return torch.finfo(dtype).eps if dtype.is_floating_point else 1.0


@dataclass(frozen=True)
class WorstElement:
    """One of the elements with the largest relative error."""

    index: tuple[int, ...]
    actual: float
    golden: float
    abs_err: float
    rel_err: float


@dataclass(frozen=True)
class Metrics:
    """The result of `compare_tensors` (see the module docstring for each field)."""

    count: int
    max_abs: float = 0.0
    max_rel: float = 0.0
    max_rel_normal: float = 0.0
    mean_rel: float = 0.0
    rmse: float = 0.0
    golden_rms: float = 0.0
    euclidean: float = 0.0
    cosine: float = 1.0
    error_balance: float = 0.0
    hundredth_ratio: float = 1.0
    thousandth_ratio: float = 1.0
    five_thousandths_ratio: float = 1.0
    ten_thousandth_ratio: float = 1.0
    max_ulp: float = 0.0
    mean_ulp: float = 0.0
    ulp_over_threshold_ratio: float = 0.0
    small_value_error_ratio: float = 0.0
    max_eps: float = 0.0
    nan_inf_mismatch: int = 0
    binary_mismatch: int = 0
    dtype: torch.dtype = torch.float32
    worst: tuple[WorstElement, ...] = field(default_factory=tuple)

    @property
    def worst_index(self) -> tuple[int, ...]:
        """Index of the element with the largest relative error (``()`` when none)."""
        return self.worst[0].index if self.worst else ()


def _ulp_errors(diff: torch.Tensor, golden: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if not dtype.is_floating_point:
        return diff
    min_exponent = math.frexp(torch.finfo(dtype).tiny)[1] - 1
    exponent = torch.floor(torch.log2(golden.abs())).clamp_min(min_exponent)
    exponent = torch.where(golden == 0, torch.full_like(exponent, min_exponent), exponent)
    return diff * torch.pow(2.0, MANTISSA_BITS[dtype] - exponent)


def compare_tensors(actual: torch.Tensor, golden: torch.Tensor, *,
                    dtype: torch.dtype | None = None, scale: torch.Tensor | None = None,
                    worst: int = WORST_COUNT) -> Metrics:
    """Compare ``actual`` with ``golden`` (any dtypes; computed in float64 on the CPU).

    Args:
        actual: the output under test.
        golden: the reference, same shape (usually float64).
        dtype: whose eps, ULP and small-value thresholds apply (default ``actual.dtype``).
        scale: magnitude for ``max_eps`` (default ``|golden|``).
        worst: how many worst elements to keep.

    Raises:
        ValueError: the shapes differ.
        DtypeError: a complex tensor or dtype (its imaginary part would be dropped), or a
            floating-point dtype without thresholds here (float8).
    """
    if tuple(actual.shape) != tuple(golden.shape):
        raise ValueError(f"shape {tuple(actual.shape)} differs from the golden's "
                         f"{tuple(golden.shape)}")
    dtype = dtype or actual.dtype
    for name, given in (("actual", actual.dtype), ("golden", golden.dtype), ("dtype", dtype)):
        if given.is_complex or (given.is_floating_point and given not in MANTISSA_BITS):
            raise DtypeError("no precision metrics for this dtype", param=name,
                             expected="float64, float32, float16, bfloat16, an integer "
                                      "or bool dtype", got=str(given))
    a = actual.detach().to(device="cpu", dtype=torch.float64).reshape(-1)
    g = golden.detach().to(device="cpu", dtype=torch.float64).reshape(-1)
    binary_mismatch = int((actual.detach().cpu().reshape(-1).to(golden.dtype)
                           != golden.detach().cpu().reshape(-1)).sum()) \
        if not dtype.is_floating_point else int(((a != g) & ~(a.isnan() & g.isnan())).sum())
    nan_mismatch = a.isnan() != g.isnan()
    inf_mismatch = (a.isinf() | g.isinf()) & (a != g) & ~a.isnan() & ~g.isnan()
    nan_inf_mismatch = int((nan_mismatch | inf_mismatch).sum())
    finite = a.isfinite() & g.isfinite()
    a, g = a[finite], g[finite]
    count = a.numel()
    if count == 0:
        return Metrics(0, nan_inf_mismatch=nan_inf_mismatch, binary_mismatch=binary_mismatch,
                       dtype=dtype)
    shift = eps(dtype)
    diff = (a - g).abs()
    rel = diff / torch.where(g == 0, torch.full_like(g, shift), g.abs())
    small, small_atol = SMALL_VALUES.get(dtype, (0.0, 0.0))
    tiny = g.abs() < small
    ulp = _ulp_errors(diff, g, dtype)
    norms = a.norm() * g.norm()
    if norms > 0:
        cosine = float((a @ g) / norms)
    else:
        cosine = 1.0 if bool((a == 0).all() and (g == 0).all()) else 0.0
    magnitude = g.abs() if scale is None else \
        scale.detach().to("cpu", torch.float64).reshape(-1)[finite].abs()
    scaled = diff / (shift * torch.nan_to_num(magnitude, nan=0.0, posinf=0.0).clamp_min(
        small or torch.finfo(torch.float64).tiny))
    order = torch.argsort(rel, descending=True)[:worst]
    positions = torch.nonzero(finite.reshape(-1)).reshape(-1)[order]
    shape = tuple(actual.shape)
    worst_elements = tuple(
        WorstElement(tuple(int(i) for i in torch.unravel_index(p, shape)) if shape else (),
                     float(a[o]), float(g[o]), float(diff[o]), float(rel[o]))
        for p, o in zip(positions, order))
    ratios = {name: float((rel < t).double().mean()) for name, t in RATIO_THRESHOLDS.items()}
    return Metrics(
        count=count,
        max_abs=float(diff.max()),
        max_rel=float(rel.max()),
        max_rel_normal=float(rel[~tiny].max()) if bool((~tiny).any()) else 0.0,
        mean_rel=float(rel.mean()),
        rmse=float(diff.square().mean().sqrt()),
        golden_rms=float(g.square().mean().sqrt()),
        euclidean=float(diff.norm()),
        cosine=cosine,
        error_balance=float(((a > g).sum() - (a < g).sum()).abs()) / count,
        max_ulp=float(ulp.max()),
        mean_ulp=float(ulp.mean()),
        ulp_over_threshold_ratio=float((ulp > ULP_THRESHOLDS.get(dtype, 0.0)).double().mean()),
        small_value_error_ratio=float((tiny & (diff > small_atol)).sum()) / count,
        max_eps=float(scaled.max()),
        nan_inf_mismatch=nan_inf_mismatch,
        binary_mismatch=binary_mismatch,
        dtype=dtype,
        worst=worst_elements,
        **ratios,
    )
