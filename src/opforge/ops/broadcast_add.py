"""BroadcastAdd: ``out = a + alpha * b`` with NumPy broadcasting up to 8 dims.

Semantics of CANN's Add/AddV2 with ``torch.add``'s ``alpha``: shapes broadcast (pad with 1s
on the left, size-1 dims stretch), the output dtype is ``torch.add``'s (``promote_types(a,
b)``, except that a 0-d operand beside a dimensioned one does not raise the dtype), the sum
is computed in float32 (float64 for float64 inputs) and rounded once. Broadcast inputs are
read through stride-0 views, never expanded in memory. The backward sums the gradient over
each input's broadcast dims with `reduce_sum` (float32 accumulation, ``alpha`` folded in).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from opforge.core.errors import ShapeError
from opforge.core.opdef import Attr, Attrs, BenchSpec, Case, PrecisionSpec, Specs, TensorArg
from opforge.core.shapes import broadcast_shapes, is_unknown_rank
from opforge.library import register_op
from opforge.ops._elementwise import (
    MAX_DIMS,
    elementwise_op,
    launch_elementwise,
    random_input,
)
from opforge.ops._statistics import check_scalar
from opforge.ops.reduce_sum import sum_to_shape
from opforge.precision.cases import generate

try:
    import triton
    import triton.language as tl  # noqa: F401 - the kernels' module must hold `tl`
except ImportError:  # pragma: no cover
    triton = None

NAME = "broadcast_add"


def _check(inputs: Specs, attrs: Attrs) -> None:
    check_scalar(NAME, "alpha", attrs["alpha"], inputs)
    for name, spec in zip(("a", "b"), inputs):
        if not is_unknown_rank(spec.shape) and len(spec.shape) > MAX_DIMS:
            raise ShapeError("has too many dims", op=NAME, param=name,
                             expected=f"at most {MAX_DIMS} dims", got=len(spec.shape))


def _infer_shape(inputs: Specs, attrs: Attrs) -> list[tuple[int, ...]]:
    a, b = inputs
    return [broadcast_shapes(a.shape, b.shape, op=NAME, names=("a", "b"))]


def _samples(dtype: torch.dtype, device: torch.device, generator: torch.Generator
             ) -> list[Case]:
    def x(*shape: int, of: torch.dtype = dtype) -> torch.Tensor:
        return random_input(shape, of, device, generator)

    return [
        Case("same_shape_4097", (x(4097), x(4097)), {}),
        Case("bias_63x1000", (x(63, 1000), x(1000)), {}),
        Case("outer_7x1_1x13", (x(7, 1), x(1, 13)), {"alpha": -0.5}),
        Case("rank4_mixed", (x(2, 1, 5, 7), x(3, 1, 7)), {"alpha": 2.0}),
        Case("scalar_b", (x(7, 63), x()), {}),
        Case("transposed_a", (x(33, 17).t(), x(33)), {}),
        Case("rank8", (x(2, 1, 3, 1, 2, 3, 1, 5), x(1, 2, 1, 4, 1, 3, 2, 1)), {}),
        Case("mixed_dtype_b_fp32", (x(63, 7), x(7, of=torch.float32)), {"alpha": 0.25}),
        Case("zero_size", (x(0, 5), x(5)), {}),
    ]


def _torch_add(a: torch.Tensor, b: torch.Tensor, alpha: float) -> torch.Tensor:
    """torch.add"""
    return torch.add(a, b, alpha=alpha)


def _sweep(kind: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
           generator: torch.Generator) -> list[Case]:
    """``a`` drawn from the kind with a bias ``b`` over its last dim; for ``cancellation``
    also ``b = -a (1 + 4 eps)`` of a's shape, whose sum cancels to a few ulps of a."""
    a = generate(kind, shape, dtype, device=device, generator=generator)
    bias = generate(kind, a.shape[-1:], dtype, device=device, generator=generator)
    cases = [Case("bias", (a, bias))]
    if kind == "cancellation":
        eps = torch.finfo(dtype).eps
        cases.append(Case("negated", (a, (-a.double() * (1 + 4 * eps)).to(dtype))))
    return cases


BROADCAST_ADD = elementwise_op(
    NAME, "a + alpha * b with NumPy broadcasting (up to 8 dims) and torch dtype promotion.",
    (TensorArg("a"), TensorArg("b")), _samples,
    attrs=(Attr("alpha", "float", 1.0, doc="multiplier of b"),),
    flops_per_element=2, infer_shape=_infer_shape, check=_check,
    precision=PrecisionSpec("absolute", peer=_torch_add, sweep=_sweep), bench=BenchSpec(),
)


# ---------------------------------------------------------------------------------------------
# Reference


@BROADCAST_ADD.reference
def reference(a: torch.Tensor, b: torch.Tensor, *, compute_dtype: torch.dtype,
              alpha: float) -> torch.Tensor:
    """``a + alpha * b`` in ``compute_dtype``."""
    return a.to(compute_dtype) + alpha * b.to(compute_dtype)


# ---------------------------------------------------------------------------------------------
# Kernels

if triton is not None:

    @triton.jit
    def _add_scaled(a, b, alpha):
        return a + alpha * b


# ---------------------------------------------------------------------------------------------
# Launcher


@BROADCAST_ADD.launcher("triton")
def launch(plan: object, inputs: Sequence[torch.Tensor | None], outputs: Sequence[torch.Tensor],
           workspace: torch.Tensor | None) -> None:
    """One pass of the strided elementwise kernel over the broadcast output."""
    a, b = inputs
    launch_elementwise(_add_scaled, outputs[0], a, b, plan.attrs["alpha"], plan.tiling,
                       plan.grid)


# ---------------------------------------------------------------------------------------------
# Backward


def _setup_context(ctx: object, inputs: tuple[object, ...], output: torch.Tensor) -> None:
    a, b, alpha = inputs
    ctx.specs = ((tuple(a.shape), a.dtype), (tuple(b.shape), b.dtype))
    ctx.alpha = alpha


@BROADCAST_ADD.autograd(_setup_context)
def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """grad_a = sum of grad over a's broadcast dims; grad_b = alpha * the same for b."""
    (a_shape, a_dtype), (b_shape, b_dtype) = ctx.specs
    grad_a = sum_to_shape(grad, a_shape, a_dtype, 1.0) if ctx.needs_input_grad[0] else None
    grad_b = sum_to_shape(grad, b_shape, b_dtype, ctx.alpha) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b, None


register_op(BROADCAST_ADD)


@BROADCAST_ADD.exported
def broadcast_add(a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """``a + alpha * b`` with NumPy broadcasting (up to 8 dims), like ``torch.add``.

    Args:
        a, b: float32/float16/bfloat16/float64 tensors of broadcastable shapes, on one
            device.
        alpha: multiplier of ``b`` (a finite number).

    Returns:
        A tensor of the broadcast shape and ``torch.add``'s dtype: ``torch.promote_types(
        a.dtype, b.dtype)``, except that a 0-d operand beside a dimensioned one keeps the
        dimensioned one's dtype (fp16 tensor + 0-d float32 tensor: fp16).

    Raises:
        ShapeError: the shapes cannot be broadcast (the message names both shapes and the
            offending dim) or have more than 8 dims.
        DtypeError: an unsupported dtype. DeviceError: inputs on different devices.
        AttrError: ``alpha`` is not a finite number.
    """
    return BROADCAST_ADD(a, b, alpha)
