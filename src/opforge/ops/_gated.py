"""Gated linear units: ``glu(x, dim) = act(a) * b`` with ``a, b`` the two halves of ``x``
along ``dim`` (the first half gated by the second), and their gradient, from an activation's
value and derivative. One kernel pass reads each half once and writes each output once;
`gated` makes an operator of it, as `opforge.ops._elementwise.pointwise` does for unary
ones.

Layout: ``x`` as ``(outer, 2, half * inner)`` contiguous, so element ``i`` of the output,
row ``o = i // (half * inner)``, pairs ``x[o, 0, r]`` and ``x[o, 1, r]``. A strided ``x``
or gradient is copied to contiguous first (the launchers read them by offset).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from opforge.core.errors import AttrError, ShapeError
from opforge.core.opdef import Attr, Attrs, BenchSpec, Case, OpDef, PrecisionSpec, Specs, TensorArg
from opforge.core.shapes import normalize_dim
from opforge.core.tiling import INT32_LIMIT
from opforge.ops._elementwise import elementwise_op, random_input
from opforge.precision.cases import generate

try:
    import triton
    import triton.language as tl

    from opforge.ops._math import bind_functions, rounded_for, widen
except ImportError:  # pragma: no cover
    triton = None

DIM = Attr("dim", "int", -1, doc="the dim cut into halves")


def split_sizes(shape: Sequence[int], dim: int) -> tuple[int, int]:
    """``(outer, half * inner)`` of a gated call on ``shape`` split along ``dim``."""
    dim = normalize_dim(dim, len(shape))
    return math.prod(shape[:dim]), shape[dim] // 2 * math.prod(shape[dim + 1:])


def _check(op: str) -> Callable[[Specs, Attrs], None]:
    def check(inputs: Specs, attrs: Attrs) -> None:
        x = inputs[-1]
        if not len(x.shape):
            raise ShapeError("must have a dim to split", op=op, param="x",
                             expected="at least 1-D", got=tuple(x.shape))
        if not -len(x.shape) <= attrs["dim"] < len(x.shape):
            raise AttrError("is out of range", op=op, param="dim",
                            expected=f"a dim of a {len(x.shape)}-D tensor", got=attrs["dim"])
        if x.shape[attrs["dim"]] % 2:
            raise ShapeError("must have an even size along dim", op=op, param="x",
                             expected="2 * half", got=tuple(x.shape))
        if len(inputs) == 2:
            expected = list(x.shape)
            expected[attrs["dim"]] //= 2
            if tuple(inputs[0].shape) != tuple(expected):
                raise ShapeError("must have x's shape with dim halved", op=op,
                                 param="grad", expected=tuple(expected),
                                 got=tuple(inputs[0].shape))
    return check


def _halved(inputs: Specs, attrs: Attrs) -> list[tuple[int, ...]]:
    shape = list(inputs[0].shape)
    shape[normalize_dim(attrs["dim"], len(shape))] //= 2
    return [tuple(shape)]


def _x_shape(inputs: Specs, attrs: Attrs) -> list[tuple[int, ...]]:
    return [tuple(inputs[1].shape)]


def halves(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a, b)``: the gated and the gating half of ``x`` along ``dim``."""
    return x.chunk(2, dim)


if triton is not None:

    ACT = ACT_GRAD = None  # the unit's activation and its slope: bound by `bind_functions`

    def _gated_kernel(x_ptr, grad_ptr, out_ptr, n, width, BACKWARD: tl.constexpr,
                      WIDE: tl.constexpr, BLOCK: tl.constexpr):
        # A kernel per unit: ACT and ACT_GRAD are bound by `bind_functions`.
        first = tl.program_id(0) * BLOCK
        if WIDE:
            first = first.to(tl.int64)
        for start in range(first, n, tl.num_programs(0) * BLOCK):
            index = start + tl.arange(0, BLOCK)
            mask = index < n
            gated = index // width * (2 * width) + index % width
            a = widen(tl.load(x_ptr + gated, mask=mask))
            b = widen(tl.load(x_ptr + gated + width, mask=mask))
            if BACKWARD:
                g = widen(tl.load(grad_ptr + index, mask=mask))
                # (g act'(a)) b: an act' that underflows to 0 gives 0, not inf * 0.
                tl.store(out_ptr + gated, rounded_for(g * ACT_GRAD(a) * b, out_ptr), mask=mask)
                tl.store(out_ptr + gated + width, rounded_for(g * ACT(a), out_ptr), mask=mask)
            else:
                tl.store(out_ptr + index, rounded_for(ACT(a) * b, out_ptr), mask=mask)


def _drawn(kind: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device,
           generator: torch.Generator) -> torch.Tensor:
    """A draw of ``kind`` whose last dim is even (``long_rows`` stretches it to an odd
    length: one column fewer)."""
    x = generate(kind, shape, dtype, device=device, generator=generator)
    return x[..., :x.shape[-1] // 2 * 2] if x.ndim else x


def _sweep(kind: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
           generator: torch.Generator) -> list[Case]:
    """x of the kind with the shape's last dim doubled, split along it."""
    return [Case("", (_drawn(kind, (*shape[:-1], 2 * shape[-1]), dtype, device, generator),))]


def _gradient_sweep(kind: str, shape: tuple[int, ...], dtype: torch.dtype,
                    device: torch.device, generator: torch.Generator) -> list[Case]:
    """The gradient and x (the shape's last dim doubled) both of the kind."""
    x = _drawn(kind, (*shape[:-1], 2 * shape[-1]), dtype, device, generator)
    grad = generate(kind, (*x.shape[:-1], x.shape[-1] // 2), dtype, device=device,
                    generator=generator)
    return [Case("", (grad[..., :x.shape[-1] // 2], x))]


def _samples(dtype: torch.dtype, device: torch.device, generator: torch.Generator
             ) -> list[Case]:
    def x(*shape: int) -> torch.Tensor:
        return random_input(shape, dtype, device, generator)
    return [Case("rows_63x2000", (x(63, 2000),)), Case("dim0_6x7x3", (x(6, 7, 3),), {"dim": 0}),
            Case("transposed_dim1", (x(34, 17).t(),), {"dim": 1}),
            Case("zero_rows", (x(0, 8),))]


def _gradient_samples(dtype: torch.dtype, device: torch.device, generator: torch.Generator
                      ) -> list[Case]:
    def pair(shape: tuple[int, ...], dim: int) -> Case:
        halved = list(shape)
        halved[dim] //= 2
        return Case(f"{'x'.join(map(str, shape))}_dim{dim}",
                    (random_input(halved, dtype, device, generator, scale=1.0),
                     random_input(shape, dtype, device, generator)), {"dim": dim})
    return [pair((7, 126), -1), pair((4, 6, 5), 1), pair((0, 4), -1)]


def gated(name: str, doc: str, *, act: Any, act_grad: Any,
          reference: Callable[[torch.Tensor], torch.Tensor],
          reference_grad: Callable[[torch.Tensor], torch.Tensor],
          flops: int, gradient_flops: int) -> tuple[OpDef, OpDef]:
    """A gated operator ``name(x, dim=-1) = act(a) * b`` and its gradient
    ``name_backward(grad, x, dim)``, registered with autograd and exported as
    ``opforge.<name>``.

    Args:
        act, act_grad: ``triton.jit`` functions of a float32 block: the activation and
            its derivative (``None`` without triton).
        reference, reference_grad: the same in torch, in their input's dtype.
        flops, gradient_flops: floating-point operations per output element.
    """
    from opforge.library import register_op

    def peer(x: torch.Tensor, dim: int) -> torch.Tensor:
        a, b = halves(x, dim)
        return reference(a) * b

    def gradient_peer(grad: torch.Tensor, x: torch.Tensor, dim: int) -> torch.Tensor:
        a, b = halves(x, dim)
        return torch.cat([grad * reference_grad(a) * b, grad * reference(a)], dim)

    peer.__doc__ = f"torch.chunk(x, 2, dim), then {reference.__name__}(a) * b"
    gradient_peer.__doc__ = f"torch: the gradient of {reference.__name__}(a) * b, concatenated"

    forward = elementwise_op(
        name, doc, (TensorArg("x"),), _samples, attrs=(DIM,), flops_per_element=flops,
        infer_shape=_halved, check=_check(name),
        precision=PrecisionSpec("benchmark_ratio", "L0", peer, sweep=_sweep),
        bench=BenchSpec())
    backward = elementwise_op(
        f"{name}_backward", f"the gradient of {name} with respect to x.",
        (TensorArg("grad"), TensorArg("x")), _gradient_samples, attrs=(DIM,),
        flops_per_element=gradient_flops, infer_shape=_x_shape, check=_check(name),
        precision=PrecisionSpec("benchmark_ratio", "L0", gradient_peer,
                                sweep=_gradient_sweep))
    forward.reference(lambda x, *, compute_dtype, dim: peer(x.to(compute_dtype), dim))
    backward.reference(lambda grad, x, *, compute_dtype, dim: gradient_peer(
        grad.to(compute_dtype), x.to(compute_dtype), dim))

    def launch(plan: Any, inputs: Sequence[torch.Tensor | None],
               outputs: Sequence[torch.Tensor], workspace: torch.Tensor | None) -> None:
        x = inputs[-1].contiguous()
        grad = inputs[0].contiguous() if len(inputs) == 2 else x
        n = x.numel() // 2
        kernel = bind_functions(_gated_kernel, ACT=act, ACT_GRAD=act_grad)
        kernel[plan.grid](x, grad, outputs[0], n, split_sizes(x.shape, plan.attrs["dim"])[1],
                          BACKWARD=len(inputs) == 2, WIDE=2 * n > INT32_LIMIT,
                          BLOCK=plan.tiling.blocks["BLOCK"])

    forward.launcher("triton")(launch)
    backward.launcher("triton")(launch)

    def save_input(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.save_for_backward(inputs[0])
        ctx.dim = inputs[1]

    @forward.autograd(save_input)
    def differentiate(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (x,) = ctx.saved_tensors
        return backward(grad, x, ctx.dim).to(x.dtype), None

    register_op(backward)
    register_op(forward)

    def functional(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return forward(x, dim)

    functional.__name__ = functional.__qualname__ = name
    functional.__doc__ = (f"{doc}\n\n    Returns x's shape with ``dim`` halved, in x's "
                          "dtype; differentiable.\n\n    Raises:\n        ShapeError: an odd "
                          "size along ``dim``, or a 0-d ``x``. AttrError: ``dim`` out of "
                          "range.\n        DtypeError: ``x`` is not a float dtype.\n    ")
    forward.exported(functional)
    return forward, backward
