"""The dtype of the statistics an operator saves for its backward (a norm's mean and rstd,
attention's log-sum-exp): float32, as the Ascend operators define them, and float64 for
float64 inputs, so that float64 gradients (gradcheck, goldens) are float64-exact too."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from opforge.core.errors import DtypeError
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
