"""``torch.nn.Module`` wrappers of the opforge operators, drop-in for their torch namesakes."""

from __future__ import annotations

import torch

from opforge import functional


class GELU(torch.nn.Module):
    """``torch.nn.GELU`` computed by `opforge.gelu` (erf form accurate in the tails)."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return functional.gelu(x, self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class Sigmoid(torch.nn.Module):
    """``torch.nn.Sigmoid`` computed by `opforge.sigmoid` (overflow-free)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return functional.sigmoid(x)
