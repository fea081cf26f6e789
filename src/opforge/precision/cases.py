"""Input generators for precision sweeps: the value distributions that break operators.

``generate(kind, shape, dtype, generator=...)`` draws in float64 and rounds once to
``dtype``, so a seed gives the same tensor on every machine:

==============  ==============================================================================
``normal``      N(0, 1)
``uniform``     U(-1, 1)
``large``       ±U(1/4, 1/2) x the dtype's largest finite value: within a factor 4 of overflow
``tiny``        ±2^U(e_min - mantissa_bits, e_min + 4): subnormals and the smallest normals
``cancellation``  neighbours x, -x (1 + k eps), k = 1..8: sums cancel to a few ulps
``outliers``    N(0, 1) with 1% of the elements scaled by 1e4 (capped at 1/4 of the max)
``masked_rows``  N(0, 1) along the last dim with whole rows and half rows set to -inf, as
                attention masks do
``long_rows``   N(0, 1) with the last dim stretched to 65537 (past one 64K tile)
==============  ==============================================================================

`sweep` pairs kinds with the shapes of `SHAPES` (odd sizes, a zero-size tensor).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch

from opforge.precision.metrics import MANTISSA_BITS

KINDS = ("normal", "uniform", "large", "tiny", "cancellation", "outliers", "masked_rows",
         "long_rows")
SHAPES: tuple[tuple[int, ...], ...] = ((1,), (7,), (63,), (1000,), (4097,), (33, 17),
                                       (63, 1000), (4, 7, 33), (0, 5))
LONG_ROW = 65537
OUTLIER_SHARE = 0.01
OUTLIER_SCALE = 1e4
CANCELLATION_ULPS = 8


def _exponent_range(dtype: torch.dtype) -> tuple[int, int]:
    """(exponent of the smallest subnormal, exponent of the smallest normal)."""
    smallest_normal = int(math.log2(torch.finfo(dtype).tiny))
    return smallest_normal - MANTISSA_BITS[dtype], smallest_normal


def generate(kind: str, shape: Sequence[int], dtype: torch.dtype, *,
             device: torch.device | str = "cpu",
             generator: torch.Generator | None = None) -> torch.Tensor:
    """A tensor of ``kind`` values (see the module docstring).

    ``long_rows`` keeps the leading dims of ``shape`` (one row when it has one dim) and
    stretches the last to `LONG_ROW`.

    Raises:
        ValueError: unknown kind, or a dtype that is not floating point.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown case kind {kind!r}; expected one of {', '.join(KINDS)}")
    if not dtype.is_floating_point:
        raise ValueError(f"cases are floating point; got {dtype}")
    shape = tuple(shape)
    if kind == "long_rows":
        shape = (*(shape[:-1] or (1,)), LONG_ROW)
    generator = generator or torch.Generator().manual_seed(0)

    def normal() -> torch.Tensor:
        return torch.randn(shape, generator=generator, dtype=torch.float64)

    def uniform(low: float, high: float) -> torch.Tensor:
        return torch.rand(shape, generator=generator, dtype=torch.float64) * (high - low) + low

    def signs() -> torch.Tensor:
        return torch.where(uniform(0, 1) < 0.5, -1.0, 1.0)

    largest = torch.finfo(dtype).max
    if kind in ("normal", "long_rows"):
        values = normal()
    elif kind == "uniform":
        values = uniform(-1.0, 1.0)
    elif kind == "large":
        values = signs() * uniform(0.25, 0.5) * largest
    elif kind == "tiny":
        low, high = _exponent_range(dtype)
        values = signs() * torch.pow(2.0, uniform(low, high + 4))
    elif kind == "cancellation":
        values = normal()
        flat = values.reshape(-1)
        # k cycles through 1..8 so that every pair cancels, whatever the tensor's size
        # (a k growing with the index would make far pairs differ by k eps >> 1 in 16 bits).
        steps = torch.arange(flat[1::2].numel(), dtype=torch.float64) % CANCELLATION_ULPS + 1
        flat[1::2] = -flat[0::2][: steps.numel()] * (1 + steps * torch.finfo(dtype).eps)
    elif kind == "outliers":
        values = normal()
        picked = uniform(0, 1) < OUTLIER_SHARE
        values = torch.where(picked, (values * OUTLIER_SCALE).clamp(-largest / 4, largest / 4),
                             values)
    else:  # masked_rows
        values = normal()
        if values.numel():
            rows = values.reshape(-1, shape[-1])
            rows[0::3] = -math.inf                       # fully masked rows
            rows[1::3, shape[-1] // 2:] = -math.inf      # half-masked rows
    return values.to(device=device, dtype=dtype)


def sweep(kinds: Sequence[str] = KINDS, shapes: Sequence[Sequence[int]] = SHAPES
          ) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every (kind, shape) pair; ``long_rows`` once per distinct leading shape."""
    for kind in kinds:
        seen: set[tuple[int, ...]] = set()
        for shape in shapes:
            key = tuple(shape[:-1]) if kind == "long_rows" else tuple(shape)
            if key in seen:
                continue
            seen.add(key)
            yield kind, tuple(shape)
