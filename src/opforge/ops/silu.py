"""SiLU (swish): ``x * sigmoid(x)``, as ``torch.nn.functional.silu``, and its gradient
``silu_backward(grad, x) = grad * s * (1 + x * (1 - s))`` with ``s = sigmoid(x)``. The
sigmoid and ``1 - s`` both come from ``exp(-|x|)``, so no |x| overflows and ``1 - s`` does
not cancel for large x; SwiGLU (`opforge.ops.swiglu`) gates with the same math.
"""

from __future__ import annotations

import torch

from opforge.ops._elementwise import INTERPRETER_EXP_BIAS, pointwise, stable_sigmoid
from opforge.ops._math import jit, sigmoid_pair, tl


@jit
def silu_of(x):
    # One division, as torch's x / (1 + exp(-x)): x * sigmoid(x) rounds twice, which left
    # a bias (error balance) 2-3x torch's on normal draws.
    e = tl.exp(-tl.abs(x))
    return tl.where(x >= 0, x, x * e) / (1.0 + e)


@jit
def silu_slope(x):
    s, t = sigmoid_pair(x)  # t = 1 - s, without the cancellation
    return s * (1.0 + x * t)


@jit
def _value(x, unused, scalar):
    return silu_of(x)


@jit
def _gradient(grad, x, scalar):
    return grad * silu_slope(x)


def silu_reference(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(x)`` in x's dtype (sigmoid from ``exp(-|x|)``)."""
    return x * stable_sigmoid(x)


def silu_slope_reference(x: torch.Tensor) -> torch.Tensor:
    """``d silu(x) / dx`` in x's dtype."""
    return stable_sigmoid(x) * (1 + x * stable_sigmoid(-x))


SILU, SILU_BACKWARD = pointwise(
    "silu", "SiLU ``x * sigmoid(x)``, like ``torch.nn.functional.silu``, overflow-free.",
    value=_value, gradient=_gradient, reference=silu_reference,
    reference_gradient=lambda grad, x: grad * silu_slope_reference(x),
    peer=torch.nn.functional.silu, gradient_peer=torch.ops.aten.silu_backward,
    flops=5, gradient_flops=8, special=(1e-20, -1.278, 88.7, -88.7, -104.0, 1e4, -1e4),
    known_limitations=(INTERPRETER_EXP_BIAS,))
