"""Gated linear units: ``glu(x, dim) = act(a) * b`` with ``a, b`` the two halves of ``x``
along ``dim`` (the first half gated by the second), or ``act(gate) * up`` of two tensors
(a model's MLP, whose gate and up projections are separate), and their gradients, from an
activation's value and derivative. One kernel pass reads each operand once and writes
each output once; `gated` and `gated_product` make operators of it, as
`opforge.ops._elementwise.pointwise` does for unary ones.

Layout: ``x`` as ``(outer, 2, half * inner)`` contiguous, so element ``i`` of the output,
row ``o = i // (half * inner)``, pairs ``x[o, 0, r]`` and ``x[o, 1, r]``; ``gate`` and
``up`` contiguous, element ``i`` with element ``i``. A strided operand is copied to
contiguous first (the launchers read them by offset).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from opforge.core.errors import AttrError, ShapeError
from opforge.core.opdef import (
    Attr,
    Attrs,
    BenchSpec,
    Case,
    OpDef,
    OutputArg,
    PrecisionSpec,
    Specs,
    TensorArg,
)
from opforge.core.shapes import normalize_dim
from opforge.core.tiling import INT32_LIMIT, grid_stride_wide
from opforge.ops._elementwise import (
    elementwise_cost,
    elementwise_grid,
    elementwise_op,
    elementwise_tiling,
    perturbation_scale,
    random_input,
    registered,
    same_shape_pair,
)
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

    def _gated_kernel(x_ptr, up_ptr, grad_ptr, out_ptr, grad_up_ptr, n, width,
                      BACKWARD: tl.constexpr, HALVES: tl.constexpr, WIDE: tl.constexpr,
                      BLOCK: tl.constexpr):
        # A kernel per unit: ACT and ACT_GRAD are bound by `bind_functions`. HALVES: a and
        # b are the halves of each row of x (the gradient is one tensor of x's layout);
        # otherwise a is x and b is up, both contiguous (each gradient a tensor of its own).
        first = tl.program_id(0) * BLOCK
        if WIDE:
            first = first.to(tl.int64)
        for start in range(first, n, tl.num_programs(0) * BLOCK):
            index = start + tl.arange(0, BLOCK)
            mask = index < n
            if HALVES:
                gated = index // width * (2 * width) + index % width
                b = widen(tl.load(x_ptr + gated + width, mask=mask))
            else:
                gated = index
                b = widen(tl.load(up_ptr + index, mask=mask))
            a = widen(tl.load(x_ptr + gated, mask=mask))
            if BACKWARD:
                g = widen(tl.load(grad_ptr + index, mask=mask))
                # (g act'(a)) b: an act' that underflows to 0 gives 0, not inf * 0.
                tl.store(out_ptr + gated, rounded_for(g * ACT_GRAD(a) * b, out_ptr), mask=mask)
                if HALVES:
                    tl.store(out_ptr + gated + width, rounded_for(g * ACT(a), out_ptr),
                             mask=mask)
                else:
                    tl.store(grad_up_ptr + index, rounded_for(g * ACT(a), grad_up_ptr),
                             mask=mask)
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
          flops: int, gradient_flops: int, bench: BenchSpec) -> tuple[OpDef, OpDef]:
    """A gated operator ``name(x, dim=-1) = act(a) * b`` and its gradient
    ``name_backward(grad, x, dim)``, registered with autograd and exported as
    ``opforge.<name>``.

    Args:
        act, act_grad: ``triton.jit`` functions of a float32 block: the activation and
            its derivative (``None`` without triton).
        reference, reference_grad: the same in torch, in their input's dtype.
        flops, gradient_flops: floating-point operations per output element.
        bench: how ``opforge bench`` sweeps the forward (its peers).
    """

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
        bench=bench)
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
        block = plan.tiling.blocks["BLOCK"]
        kernel[plan.grid](x, x, grad, outputs[0], outputs[0], n,
                          split_sizes(x.shape, plan.attrs["dim"])[1], BACKWARD=len(inputs) == 2,
                          HALVES=True,
                          WIDE=2 * n > INT32_LIMIT or grid_stride_wide(n, plan.grid[0], block),
                          BLOCK=block)

    forward.launcher("triton")(launch)
    backward.launcher("triton")(launch)

    def save_input(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.save_for_backward(inputs[0])
        ctx.dim = inputs[1]

    @forward.autograd(save_input)
    def differentiate(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (x,) = ctx.saved_tensors
        return backward(grad, x, ctx.dim).to(x.dtype), None

    def functional(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return forward(x, dim)

    return registered(forward, backward, functional,
                      f"{doc}\n\n    Returns x's shape with ``dim`` halved, in x's "
                      "dtype; differentiable.\n\n    Raises:\n        ShapeError: an odd "
                      "size along ``dim``, or a 0-d ``x``. AttrError: ``dim`` out of "
                      "range.\n        DtypeError: ``x`` is not a float dtype.\n    ")


# ---------------------------------------------------------------------------------------------
# act(gate) * up of two tensors


def _pair_samples(dtype: torch.dtype, device: torch.device, generator: torch.Generator
                  ) -> list[Case]:
    def x(*shape: int) -> torch.Tensor:
        return random_input(shape, dtype, device, generator)
    inf, nan = float("inf"), float("nan")
    # No gate whose float32 silu underflows meets an infinite up: 0 * inf is NaN where
    # the float64 golden's tiny value gives inf (torch's float32 silu is NaN there too).
    gate = torch.tensor([0.0, -0.0, inf, -inf, nan, 1e-20, -88.7, 88.7, -104.0, 1e4, -1e4, 3.0])
    up = torch.tensor([1.5, -2.0, 1e4, -0.5, 2.0, inf, -3.0, -inf, 0.25, nan, -1e4, 0.0])
    return [Case("rows_63x1000", (x(63, 1000), x(63, 1000))),
            Case("batched_3x5x129", (x(3, 5, 129), x(3, 5, 129))),
            Case("special", (gate.to(device, dtype), up.to(device, dtype))),
            Case("transposed", (x(33, 17).t(), x(17, 33))),
            Case("zero_rows", (x(0, 8), x(0, 8)))]


def _pair_gradient_samples(dtype: torch.dtype, device: torch.device,
                           generator: torch.Generator) -> list[Case]:
    def triple(*shape: int) -> Case:
        return Case(f"rows_{'x'.join(map(str, shape))}",
                    (random_input(shape, dtype, device, generator, scale=1.0),
                     random_input(shape, dtype, device, generator),
                     random_input(shape, dtype, device, generator)))
    return [triple(1000), triple(7, 63), triple(0, 4)]


def _pair_sweep(count: int) -> Callable[..., list[Case]]:
    """``count`` tensors of the kind and shape (the gradient first, for the backward)."""
    def sweep(kind: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
              generator: torch.Generator) -> list[Case]:
        return [Case("", tuple(generate(kind, shape, dtype, device=device, generator=generator)
                               for _ in range(count)))]
    return sweep


def gated_product(name: str, doc: str, *, act: Any, act_grad: Any,
                  reference: Callable[[torch.Tensor], torch.Tensor],
                  reference_grad: Callable[[torch.Tensor], torch.Tensor],
                  flops: int, gradient_flops: int, bench: BenchSpec) -> tuple[OpDef, OpDef]:
    """An operator ``name(gate, up) = act(gate) * up`` of two tensors of one shape and its
    gradient ``name_backward(grad, gate, up) -> (grad_gate, grad_up)``, registered with
    autograd and exported as ``opforge.<name>``; arguments as `gated`'s, and ``bench``:
    how ``opforge bench`` sweeps the forward (its peers)."""

    def peer(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return reference(gate) * up

    def gradient_peer(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        return grad * reference_grad(gate) * up, grad * reference(gate)

    peer.__doc__ = f"torch: {reference.__name__}(gate) * up"
    gradient_peer.__doc__ = f"torch: the gradients of {reference.__name__}(gate) * up"

    forward = elementwise_op(
        name, doc, (TensorArg("gate"), TensorArg("up")), _pair_samples,
        flops_per_element=flops, check=same_shape_pair(name, ("gate", "up")),
        precision=PrecisionSpec("benchmark_ratio", "L0", peer, sweep=_pair_sweep(2)),
        bench=bench)

    def check_backward(inputs: Specs, attrs: Attrs) -> None:
        same_shape_pair(f"{name}_backward", ("grad", "gate"))(inputs[:2], attrs)
        same_shape_pair(f"{name}_backward", ("gate", "up"))(inputs[1:], attrs)

    backward = OpDef(
        name=f"{name}_backward", doc=f"the gradients of {name} with respect to gate and up.",
        inputs=(TensorArg("grad"), TensorArg("gate"), TensorArg("up")),
        outputs=(OutputArg("grad_gate"), OutputArg("grad_up")), attrs=(),
        infer_shape=lambda inputs, attrs: [tuple(inputs[1].shape), tuple(inputs[2].shape)],
        infer_dtype=lambda inputs, attrs: [inputs[1].dtype, inputs[2].dtype],
        check=check_backward, cost=elementwise_cost(gradient_flops),
        tiling=elementwise_tiling, grid=elementwise_grid, error_scale=perturbation_scale,
        samples=_pair_gradient_samples, inplace_out=True,
        precision=PrecisionSpec("benchmark_ratio", "L0", gradient_peer,
                                sweep=_pair_sweep(3)))
    forward.reference(lambda gate, up, *, compute_dtype: peer(gate.to(compute_dtype),
                                                              up.to(compute_dtype)))
    backward.reference(lambda grad, gate, up, *, compute_dtype: gradient_peer(
        grad.to(compute_dtype), gate.to(compute_dtype), up.to(compute_dtype)))

    def launch(plan: Any, inputs: Sequence[torch.Tensor | None],
               outputs: Sequence[torch.Tensor], workspace: torch.Tensor | None) -> None:
        gate, up = (t.contiguous() for t in inputs[-2:])
        grad = inputs[0].contiguous() if len(inputs) == 3 else gate
        kernel = bind_functions(_gated_kernel, ACT=act, ACT_GRAD=act_grad)
        block = plan.tiling.blocks["BLOCK"]
        kernel[plan.grid](gate, up, grad, outputs[0], outputs[-1], gate.numel(), 1,
                          BACKWARD=len(inputs) == 3, HALVES=False,
                          WIDE=grid_stride_wide(gate.numel(), plan.grid[0], block), BLOCK=block)

    forward.launcher("triton")(launch)
    backward.launcher("triton")(launch)

    def save_inputs(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.save_for_backward(inputs[0], inputs[1])

    @forward.autograd(save_inputs)
    def differentiate(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = ctx.saved_tensors
        return backward(grad, gate, up)

    def functional(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return forward(gate, up)

    return registered(forward, backward, functional,
                      f"{doc}\n\n    ``gate`` and ``up`` of one shape, any float dtypes; "
                      "returns that shape in their promoted dtype; differentiable.\n\n"
                      "    Raises:\n        ShapeError: ``gate`` and ``up`` differ in "
                      "shape.\n        DtypeError: an operand is not a float dtype.\n    ")
