"""``torch_npu``'s fused-operator signatures, computed by opforge on any device: code written
for Ascend runs unchanged on a GPU or a CPU.

``rstd`` is float32 with the input's shape and the normalised (last) dim kept as 1, as
torch_npu returns it.
"""

from __future__ import annotations

import torch

import opforge.ops.rms_norm  # noqa: F401 - registers the operators


def npu_rms_norm(x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch_npu.npu_rms_norm``: ``(x * rstd * gamma, rstd)`` over the last dim.

    Raises:
        ShapeError: ``gamma`` is not 1-D of x's last dim. DtypeError, AttrError.
    """
    y, rstd = torch.ops.opforge.rms_norm(x, gamma, epsilon)
    return y, rstd.unsqueeze(-1)


def npu_add_rms_norm(x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor,
                     epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch_npu.npu_add_rms_norm``: ``(rms_norm(x1 + x2), rstd, x1 + x2)``, each input
    read once.

    Raises:
        ShapeError: ``x2`` differs from ``x1`` in shape, or a bad ``gamma``.
    """
    y, rstd, total = torch.ops.opforge.add_rms_norm(x1, x2, gamma, epsilon)
    return y, rstd.unsqueeze(-1), total
