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


class Softmax(torch.nn.Module):
    """``torch.nn.Softmax`` computed by `opforge.softmax` (max-subtracted, float32
    statistics, online multi-block for long rows). ``dim=None`` follows torch's legacy
    rule: dim 0 for 0-, 1- and 3-D inputs, else dim 1."""

    def __init__(self, dim: int | None = None) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dim = self.dim if self.dim is not None else (0 if x.ndim in (0, 1, 3) else 1)
        return functional.softmax(x, dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"
