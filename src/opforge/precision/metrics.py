"""Error metrics of an output against its float64 golden.

Three numbers per comparison:

- ``max_abs``: the largest ``|actual - golden|``;
- ``max_rel``: the largest ``|actual - golden| / |golden|`` over goldens at or above the
  dtype's small-value threshold (relative error is meaningless below it);
- ``max_eps``: the largest ``|actual - golden| / (eps(dtype) * max(scale, small(dtype)))``,
  the error in units of the output dtype's epsilon relative to the operator's error scale
  (`OpDef.error_scale`: ``|golden|``, or a condition-aware magnitude such as ``sum |x|`` for
  a reduction). A correctly rounded result scores at most 0.5; this is what verdicts use.

Below the small-value threshold (2^-20 for float32, 2^-10 for float16 and bfloat16, the
thresholds of the Ascend precision standard's small-value rule) errors are absolute: an
output that underflows, is flushed to zero or passes through subnormal intermediates is
judged against ``eps * small``, not against its own vanishing magnitude.

NaN and ±Inf must sit at the same positions with the same values as in the golden.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SMALL_VALUES = {torch.float32: 2.0**-20, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-10,
                torch.float64: 2.0**-40}


def eps(dtype: torch.dtype) -> float:
    """Spacing of ``dtype`` at 1.0 (2^-23 for float32, 2^-10 for float16, 2^-7 for bf16)."""
    return torch.finfo(dtype).eps


def small_value(dtype: torch.dtype) -> float:
    """Magnitude below which errors of ``dtype`` outputs are judged as absolute errors."""
    return SMALL_VALUES.get(dtype, torch.finfo(dtype).tiny)


@dataclass(frozen=True)
class ErrorStats:
    """How far one output is from its golden (see the module docstring)."""

    max_abs: float
    max_rel: float
    max_eps: float
    worst_index: tuple[int, ...]
    special_mismatches: int
    count: int

    @property
    def finite(self) -> bool:
        return self.special_mismatches == 0


def compare(actual: torch.Tensor, golden: torch.Tensor, scale: torch.Tensor | None = None,
            dtype: torch.dtype | None = None) -> ErrorStats:
    """Compare ``actual`` (any float dtype) with ``golden`` (float64).

    Args:
        actual: the operator's output.
        golden: the float64 reference, same shape.
        scale: the magnitude errors are judged against (default ``|golden|``).
        dtype: whose eps and tiny to use (default ``actual.dtype``).

    Raises:
        ValueError: the shapes differ.
    """
    if tuple(actual.shape) != tuple(golden.shape):
        raise ValueError(f"shape {tuple(actual.shape)} differs from the golden's "
                         f"{tuple(golden.shape)}")
    dtype = dtype or actual.dtype
    got = actual.detach().to(device="cpu", dtype=torch.float64)
    want = golden.detach().to(device="cpu", dtype=torch.float64)
    magnitude = want.abs() if scale is None else scale.detach().to("cpu", torch.float64).abs()
    special = ~torch.isfinite(want) | ~torch.isfinite(got)
    nan_mismatch = torch.isnan(want) != torch.isnan(got)
    inf_mismatch = torch.isinf(want) & (got != want)
    mismatches = int((nan_mismatch | inf_mismatch | (special & ~torch.isnan(want)
                                                     & ~torch.isinf(want))).sum())
    ok = ~special
    small = small_value(dtype)
    diff = torch.where(ok, (got - want).abs(), torch.zeros_like(want))
    normal = ok & (want.abs() >= small)
    rel = torch.where(normal, diff / want.abs().clamp_min(small), torch.zeros_like(diff))
    scaled = diff / (eps(dtype) * torch.nan_to_num(magnitude, nan=0.0, posinf=0.0)
                     .clamp_min(small))
    if diff.numel() == 0:
        return ErrorStats(0.0, 0.0, 0.0, (), mismatches, 0)
    worst = int(scaled.reshape(-1).argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), diff.shape))
    return ErrorStats(float(diff.max()), float(rel.max()), float(scaled.max()), index,
                      mismatches, diff.numel())
