"""The dtype of the statistics an operator saves for its backward (a norm's mean and rstd,
attention's log-sum-exp): float32, as the Ascend operators define them, and float64 for
float64 inputs, so that float64 gradients (gradcheck, goldens) are float64-exact too. It is
also the dtype kernels apply a scalar attribute in (alpha, scale)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from opforge.core.errors import AttrError, DtypeError
from opforge.core.opdef import TensorSpec, dtype_name

STATISTICS_DTYPES = (torch.float32, torch.float64)


def statistics_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the statistics of an input of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_statistics(op: str, x: TensorSpec,
                     statistics: Sequence[tuple[str, TensorSpec | None]]) -> None:
    """A backward's saved statistics have the dtype the forward gives ``x``'s dtype.

    Raises:
        DtypeError: a statistic of another dtype.
    """
    want = statistics_dtype(x.dtype)
    for name, spec in statistics:
        if spec is not None and spec.dtype != want:
            raise DtypeError(f"must be {dtype_name(want)} for inputs of {dtype_name(x.dtype)}",
                             op=op, param=name, expected=dtype_name(want),
                             got=dtype_name(spec.dtype))


def check_scalar(op: str, name: str, value: float | None,
                 inputs: Sequence[TensorSpec | None]) -> None:
    """A scalar attribute must be finite in the dtype the kernels apply it in (float32,
    float64 for float64 inputs): alpha = 1e300 would become inf there, and inf * 0 NaN,
    where torch.add refuses it.

    Raises:
        AttrError: ``value`` is beyond that dtype's largest finite value.
    """
    wide = any(spec is not None and spec.dtype == torch.float64 for spec in inputs)
    compute = torch.float64 if wide else torch.float32
    if value is not None and abs(value) > torch.finfo(compute).max:
        raise AttrError(f"is not finite in {dtype_name(compute)}, the dtype it is applied "
                        "in", op=op, param=name,
                        expected=f"|{name}| <= {torch.finfo(compute).max:.4g}", got=value)
