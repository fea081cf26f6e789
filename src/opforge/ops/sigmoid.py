"""Sigmoid: ``out = 1 / (1 + exp(-x))``, and its gradient ``sigmoid_backward``.

The kernel only ever takes ``exp(-|x|)``, so it cannot overflow for any |x| in any dtype:
``sigmoid(x) = 1 / (1 + e)`` for x >= 0 and ``e / (1 + e)`` for x < 0. ``±inf`` give exactly
1 and 0; NaN propagates. ``sigmoid_backward(grad, y) = grad * y * (1 - y)`` takes the forward
output, as CANN's SigmoidGrad and ``torch.ops.aten.sigmoid_backward`` do.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from opforge.core.opdef import BenchSpec, Case, PrecisionSpec, TensorArg
from opforge.library import register_op
from opforge.ops._elementwise import (
    elementwise_op,
    launch_elementwise,
    random_input,
    same_shape_pair,
    stable_sigmoid,
)
from opforge.precision.cases import generate

try:
    import triton
    import triton.language as tl  # noqa: F401 - the kernels' module must hold `tl`

    from opforge.ops._math import sigmoid_pair
except ImportError:  # pragma: no cover
    triton = None


def _samples(dtype: torch.dtype, device: torch.device, generator: torch.Generator
             ) -> list[Case]:
    extremes = torch.tensor([0.0, -0.0, 1e-8, -1e-8, 15.0, -15.0, 88.7, -88.7, 89.0, -89.0,
                             104.0, -104.0, 1e4, -1e4, float("inf"), float("-inf"),
                             float("nan")])
    extremes = extremes.to(dtype=dtype, device=device)
    return [
        Case("randn_4097", (random_input((4097,), dtype, device, generator, scale=6.0),)),
        Case("rows_63x1000", (random_input((63, 1000), dtype, device, generator),)),
        Case("extremes", (extremes,)),
        Case("transposed", (random_input((33, 17), dtype, device, generator).t(),)),
        Case("zero_size", (random_input((0, 3), dtype, device, generator),)),
    ]


def _backward_samples(dtype: torch.dtype, device: torch.device, generator: torch.Generator
                      ) -> list[Case]:
    def pair(*shape: int) -> tuple[torch.Tensor, torch.Tensor]:
        grad = random_input(shape, dtype, device, generator, scale=1.0)
        y = torch.sigmoid(random_input(shape, torch.float32, device, generator)).to(dtype)
        return grad, y

    return [Case("odd_1000", pair(1000)), Case("rows_7x63", pair(7, 63)),
            Case("zero_size", pair(0))]


def _torch_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """torch.sigmoid"""
    return torch.sigmoid(x)


def _torch_sigmoid_backward(grad: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """torch.ops.aten.sigmoid_backward"""
    return torch.ops.aten.sigmoid_backward(grad, y)


def _backward_sweep(kind: str, shape: tuple[int, ...], dtype: torch.dtype,
                    device: torch.device, generator: torch.Generator) -> list[Case]:
    """The gradient drawn from the kind; y = sigmoid of a draw of the kind, in (0, 1)."""
    grad = generate(kind, shape, dtype, device=device, generator=generator)
    logits = generate(kind, shape, torch.float64, device=device, generator=generator)
    return [Case("", (grad, torch.sigmoid(logits).to(dtype)))]


SIGMOID = elementwise_op("sigmoid", "1 / (1 + exp(-x)), overflow-free for any |x|.",
                         (TensorArg("x"),), _samples, flops_per_element=4,
                         precision=PrecisionSpec("benchmark_ratio", "L0", _torch_sigmoid),
                         bench=BenchSpec())

SIGMOID_BACKWARD = elementwise_op(
    "sigmoid_backward", "grad * y * (1 - y), from the forward output y.",
    (TensorArg("grad"), TensorArg("y")), _backward_samples, flops_per_element=3,
    check=same_shape_pair("sigmoid_backward", ("grad", "y")),
    precision=PrecisionSpec("benchmark_ratio", "L0", _torch_sigmoid_backward,
                            sweep=_backward_sweep),
)


# ---------------------------------------------------------------------------------------------
# References


@SIGMOID.reference
def reference(x: torch.Tensor, *, compute_dtype: torch.dtype) -> torch.Tensor:
    """The kernel's ``exp(-|x|)`` form in ``compute_dtype``: in float32 it keeps the
    subnormal results below x = -88.7 that ``torch.sigmoid`` flushes to 0."""
    return stable_sigmoid(x.to(compute_dtype))


@SIGMOID_BACKWARD.reference
def backward_reference(grad: torch.Tensor, y: torch.Tensor, *,
                       compute_dtype: torch.dtype) -> torch.Tensor:
    """``grad * y * (1 - y)`` in ``compute_dtype``."""
    y = y.to(compute_dtype)
    return grad.to(compute_dtype) * y * (1 - y)


# ---------------------------------------------------------------------------------------------
# Kernels

if triton is not None:

    @triton.jit
    def _sigmoid(x, unused, scalar):
        value, _ = sigmoid_pair(x)
        return value

    @triton.jit
    def _sigmoid_grad(grad, y, scalar):
        return grad * y * (1.0 - y)


# ---------------------------------------------------------------------------------------------
# Launchers


@SIGMOID.launcher("triton")
def launch(plan: object, inputs: Sequence[torch.Tensor | None], outputs: Sequence[torch.Tensor],
           workspace: torch.Tensor | None) -> None:
    """One pass of the strided elementwise kernel."""
    launch_elementwise(_sigmoid, outputs[0], inputs[0], None, 0.0, plan.tiling, plan.grid)


@SIGMOID_BACKWARD.launcher("triton")
def launch_backward(plan: object, inputs: Sequence[torch.Tensor | None],
                    outputs: Sequence[torch.Tensor], workspace: torch.Tensor | None) -> None:
    """One pass of the strided elementwise kernel over (grad, y)."""
    launch_elementwise(_sigmoid_grad, outputs[0], inputs[0], inputs[1], 0.0, plan.tiling,
                       plan.grid)


# ---------------------------------------------------------------------------------------------
# Backward


def _setup_context(ctx: object, inputs: tuple[object, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(output)
    ctx.input_dtype = inputs[0].dtype


@SIGMOID.autograd(_setup_context)
def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
    """d sigmoid(x)/dx = y (1 - y), from the saved output y."""
    (y,) = ctx.saved_tensors
    return SIGMOID_BACKWARD(grad, y).to(ctx.input_dtype)


register_op(SIGMOID)
register_op(SIGMOID_BACKWARD)


@SIGMOID.exported
def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``1 / (1 + exp(-x))`` without overflow for any |x|; same shape and dtype as ``x``.

    Raises:
        DtypeError: ``x`` is not float32/float16/bfloat16/float64.
    """
    return SIGMOID(x)
