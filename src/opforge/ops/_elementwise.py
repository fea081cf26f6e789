"""Building blocks of elementwise operators: one strided, broadcasting Triton kernel that
applies a per-element function, and the tiling, grid and cost every elementwise op shares.

The kernel reads up to two inputs of any strides (stride 0 on broadcast dims: inputs are
never expanded in memory), applies ``FN(a, b, scalar)`` in float32 and writes a contiguous
output. Dims that are contiguous in every operand are merged on the host first, so the
common cases (same-shape contiguous: 1 dim; bias add: 2 dims) pay little index arithmetic.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from opforge.core.errors import ShapeError
from opforge.core.hardware import HardwareProfile
from opforge.core.opdef import (
    Attr,
    Attrs,
    BenchSpec,
    Case,
    Cost,
    KnownLimitation,
    OpDef,
    OutputArg,
    PrecisionSpec,
    Specs,
    TensorArg,
    Tiling,
)
from opforge.core.shapes import contiguous_strides, is_unknown_rank
from opforge.core.tiling import (
    INT32_LIMIT,
    cdiv,
    grid_stride_wide,
    next_power_of_2,
    persistent_grid,
)

try:
    import triton
    import triton.language as tl

    from opforge.ops._math import bind_functions, rounded_for, widen
except ImportError:  # pragma: no cover - exercised on installs without triton
    triton = None

MAX_DIMS = 8
BLOCK_SIZES = (4096, 2048, 1024, 512, 256, 128)


def collapse_dims(shape: Sequence[int], strides: Sequence[Sequence[int]]
                  ) -> tuple[list[int], list[list[int]]]:
    """Merge adjacent dims that are contiguous with each other in every operand and drop
    size-1 dims. Returns (sizes, strides per operand), at least one dim."""
    sizes: list[int] = []
    merged: list[list[int]] = [[] for _ in strides]
    for axis, size in enumerate(shape):
        if size == 1:
            continue
        if sizes and all(m[-1] == s[axis] * size for m, s in zip(merged, strides)):
            sizes[-1] *= size
            for m, s in zip(merged, strides):
                m[-1] = s[axis]
            continue
        sizes.append(size)
        for m, s in zip(merged, strides):
            m.append(s[axis])
    if not sizes:
        return [1], [[0] for _ in strides]
    return sizes, merged


# ---------------------------------------------------------------------------------------------
# OpDef pieces


def elementwise_tiling(inputs: Specs, outputs: Specs, attrs: Attrs, hardware: HardwareProfile,
                       temporaries: int = 4) -> list[Tiling]:
    """Block-size candidates, largest first. One program keeps a block of every operand
    plus ``temporaries`` float32 values per element live on chip."""
    numel = max((s.numel for s in outputs if s is not None), default=1)
    per_element = sum(s.itemsize for s in (*inputs, *outputs) if s is not None)
    per_element += 4 * temporaries
    cap = max(BLOCK_SIZES[-1], min(next_power_of_2(numel), hardware.max_tile_elements))
    return [Tiling("persistent", {"BLOCK": block}, onchip_bytes=block * per_element)
            for block in BLOCK_SIZES if block <= cap]


def elementwise_grid(tiling: Tiling, inputs: Specs, outputs: Specs, attrs: Attrs,
                     hardware: HardwareProfile) -> tuple[int, ...]:
    """A persistent 1-D grid over blocks of the output."""
    return (persistent_grid(cdiv(outputs[0].numel, tiling.blocks["BLOCK"]), hardware),)


def elementwise_cost(flops_per_element: int) -> Callable[[Specs, Specs, Attrs], Cost]:
    """An `OpDef.cost` for an op that reads each input once and writes each output once."""
    def cost(inputs: Specs, outputs: Specs, attrs: Attrs) -> Cost:
        moved = sum(s.numel * s.itemsize for s in (*inputs, *outputs) if s is not None)
        return Cost(flops=flops_per_element * outputs[0].numel, bytes_moved=moved)
    return cost


def same_shape(inputs: Specs, attrs: Attrs) -> list[tuple[int, ...]]:
    """`OpDef.infer_shape` of a unary op: the output has the input's shape."""
    return [tuple(inputs[0].shape)]


def same_dtype(inputs: Specs, attrs: Attrs) -> list[torch.dtype]:
    """`OpDef.infer_dtype` of an op whose output has its first input's dtype."""
    return [inputs[0].dtype]


def promoted_dtype(inputs: Specs, attrs: Attrs) -> list[torch.dtype]:
    """`OpDef.infer_dtype` of a binary op: ``torch.result_type`` of its two (floating)
    inputs. A 0-d operand beside a dimensioned one does not raise its dtype (an fp16
    tensor plus a 0-d float32 tensor is fp16); otherwise ``torch.promote_types``."""
    first, second = inputs[0], inputs[1]
    ranks = [None if is_unknown_rank(spec.shape) else len(spec.shape) for spec in inputs[:2]]
    if None not in ranks and (ranks[0] == 0) != (ranks[1] == 0):
        return [first.dtype if ranks[1] == 0 else second.dtype]
    return [torch.promote_types(first.dtype, second.dtype)]


def same_shape_pair(op: str, names: tuple[str, str]) -> Callable[[Specs, Attrs], None]:
    """An `OpDef.check` requiring two inputs of one shape (a gradient and what it pairs
    with: no broadcasting)."""
    def check(inputs: Specs, attrs: Attrs) -> None:
        first, second = inputs[0].shape, inputs[1].shape
        if tuple(first) != tuple(second):
            raise ShapeError(f"must have the shape of {names[0]}", op=op, param=names[1],
                             expected=tuple(first), got=tuple(second))
    return check


def stable_sigmoid(z: torch.Tensor) -> torch.Tensor:
    """Sigmoid for references: ``exp`` of ``-|z|`` only, so a float32 result keeps its
    subnormal and small normal values (torch's float32 sigmoid returns 0 below z = -88.7,
    which ``x * sigmoid(z)`` would carry back into the normal range)."""
    e = torch.exp(-z.abs())
    return torch.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


RELATIVE_STEP = 1e-6


def perturbation_scale(opdef: OpDef, inputs: Sequence[torch.Tensor | None], attrs: Attrs,
                       golden: torch.Tensor, output: str) -> torch.Tensor:
    """`OpDef.error_scale` of an elementwise op: ``|f| + sum_i |x_i df/dx_i|``.

    A float32 kernel rounds its inputs and intermediates at relative size ~eps, and that
    error reaches the output amplified by each input's relative condition number
    ``|x_i df/dx_i| / |f|`` (large in the tanh-GELU tail, near the zero of GELU's slope,
    for a sum that cancels). ``x_i df/dx_i`` is a central difference of the float64
    reference under a relative perturbation of one input at a time (of the output named
    ``output``, for an operator with several)."""
    scale = golden.abs()
    position = [arg.name for arg in opdef.outputs].index(output)
    for index, tensor in enumerate(inputs):
        if tensor is None or not tensor.is_floating_point():
            continue
        shifted = []
        for sign in (1.0, -1.0):
            moved = list(inputs)
            moved[index] = tensor * (1.0 + sign * RELATIVE_STEP)
            results = opdef.reference_fn(*moved, compute_dtype=torch.float64, **attrs)
            shifted.append(results[position] if isinstance(results, tuple) else results)
        scale = scale + ((shifted[0] - shifted[1]) / (2 * RELATIVE_STEP)).abs()
    return scale


def elementwise_op(name: str, doc: str, inputs: tuple[TensorArg, ...],
                   samples: Callable[..., list[Case]], *, precision: PrecisionSpec,
                   attrs: tuple[Attr, ...] = (), flops_per_element: int, temporaries: int = 4,
                   infer_shape: Callable[[Specs, Attrs], list[tuple[int, ...]]] = same_shape,
                   check: Callable[[Specs, Attrs], None] | None = None,
                   bench: BenchSpec | None = None, inplace_out: bool = True) -> OpDef:
    """The OpDef of an elementwise operator with one output ``out``: by default the
    output has the first input's shape and the inputs' promoted dtype; tiling, grid, cost
    and error scale are the shared ones above. ``inplace_out``: each element of the output
    is computed from the same element of the inputs only (``run(out=x)`` is safe)."""
    extra = {"check": check} if check is not None else {}
    return OpDef(
        name=name, doc=doc, inputs=inputs, outputs=(OutputArg("out"),), attrs=attrs,
        infer_shape=infer_shape,
        infer_dtype=same_dtype if len(inputs) == 1 else promoted_dtype,
        cost=elementwise_cost(flops_per_element),
        tiling=functools.partial(elementwise_tiling, temporaries=temporaries),
        grid=elementwise_grid,
        error_scale=perturbation_scale,
        samples=samples,
        precision=precision,
        bench=bench,
        inplace_out=inplace_out,
        **extra,
    )


def random_input(shape: Sequence[int], dtype: torch.dtype, device: torch.device,
                 generator: torch.Generator, scale: float = 3.0) -> torch.Tensor:
    """Normal samples times ``scale``, drawn in float32 and rounded to ``dtype``."""
    sample = torch.randn(tuple(shape), generator=generator, dtype=torch.float32) * scale
    return sample.to(device=device, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# Kernel and launcher

if triton is not None:

    @triton.jit
    def _peel_dim(rem, off_a, off_b, size, stride_a, stride_b):
        """Split the innermost remaining dim off a linear index; add its offsets."""
        index = rem % size
        return rem // size, off_a + index * stride_a, off_b + index * stride_b

    FN = None  # the operator's function of (a, b, scalar): bound by `bind_functions`

    def _elementwise_kernel(
        out_ptr, a_ptr, b_ptr, n, scalar,
        s1, s2, s3, s4, s5, s6, s7,
        a0, a1, a2, a3, a4, a5, a6, a7,
        b0, b1, b2, b3, b4, b5, b6, b7,
        NDIM: tl.constexpr, HAS_B: tl.constexpr, WIDE: tl.constexpr, BLOCK: tl.constexpr,
    ):
        # A kernel per operator: FN is bound by `bind_functions`. Dims are right-aligned in
        # slots 1..7; the leading dim's index is what remains after peeling the NDIM-1
        # trailing ones.
        first = tl.program_id(0) * BLOCK
        if WIDE:
            first = first.to(tl.int64)
        step = tl.num_programs(0) * BLOCK
        for start in range(first, n, step):
            lin = start + tl.arange(0, BLOCK)
            mask = lin < n
            rem = lin
            off_a = lin * 0
            off_b = lin * 0
            if NDIM >= 2:
                rem, off_a, off_b = _peel_dim(rem, off_a, off_b, s7, a7, b7)
            if NDIM >= 3:
                rem, off_a, off_b = _peel_dim(rem, off_a, off_b, s6, a6, b6)
            if NDIM >= 4:
                rem, off_a, off_b = _peel_dim(rem, off_a, off_b, s5, a5, b5)
            if NDIM >= 5:
                rem, off_a, off_b = _peel_dim(rem, off_a, off_b, s4, a4, b4)
            if NDIM >= 6:
                rem, off_a, off_b = _peel_dim(rem, off_a, off_b, s3, a3, b3)
            if NDIM >= 7:
                rem, off_a, off_b = _peel_dim(rem, off_a, off_b, s2, a2, b2)
            if NDIM >= 8:
                rem, off_a, off_b = _peel_dim(rem, off_a, off_b, s1, a1, b1)
            off_a += rem * a0
            off_b += rem * b0
            a = widen(tl.load(a_ptr + off_a, mask=mask))
            if HAS_B:
                b = widen(tl.load(b_ptr + off_b, mask=mask))
            else:
                b = a
            tl.store(out_ptr + lin, rounded_for(FN(a, b, scalar), out_ptr), mask=mask)


def _broadcast_strides(shape: tuple[int, ...], sizes: tuple[int, ...],
                       strides: tuple[int, ...]) -> list[int]:
    """The strides of a tensor expanded to ``shape`` (0 on new and broadcast dims)."""
    lead = len(shape) - len(sizes)
    return [0] * lead + [0 if size == 1 and full != 1 else stride
                         for size, full, stride in zip(sizes, shape[lead:], strides)]


@functools.lru_cache(maxsize=1024)
def _layout(shape: tuple[int, ...], a_layout: tuple[tuple[int, ...], tuple[int, ...]],
            b_layout: tuple[tuple[int, ...], tuple[int, ...]] | None
            ) -> tuple[int, list[int], bool] | None:
    """(NDIM, the size and stride arguments, WIDE) of the kernel for operands of these
    (sizes, strides) written into a contiguous ``shape``; ``None`` when more than
    `MAX_DIMS` dims stay after collapsing. Cached: a call's layout repeats from call to
    call, and working it out is most of the launcher's host time."""
    operands = [a_layout] + ([b_layout] if b_layout is not None else [])
    strides = [_broadcast_strides(shape, *layout) for layout in operands] + [
        list(contiguous_strides(shape))]
    sizes, merged = collapse_dims(shape, strides)
    if len(sizes) > MAX_DIMS:
        return None
    ndim = len(sizes)
    pad = MAX_DIMS - ndim
    slots = [1] * pad + sizes
    a_strides = [0] * pad + merged[0]
    b_strides = [0] * pad + merged[1] if b_layout is not None else [0] * MAX_DIMS
    # The leading real dim's stride goes in slot 0; trailing dims stay right-aligned.
    arguments = [*slots[1:], a_strides[pad], *a_strides[1:], b_strides[pad], *b_strides[1:]]
    reach = max(math.prod(shape),
                *(sum((s - 1) * abs(st) for s, st in zip(sizes, m)) + 1 for m in merged))
    return ndim, arguments, reach > INT32_LIMIT


def launch_elementwise(fn: object, out: torch.Tensor, a: torch.Tensor,
                       b: torch.Tensor | None, scalar: float, tiling: Tiling,
                       grid: tuple[int, ...]) -> None:
    """Write ``fn(a, b, scalar)`` (``b`` broadcast against ``a``; ``fn`` a ``triton.jit``
    function of float32 blocks) into the contiguous ``out``. Inputs are read through their
    strides, with stride 0 on broadcast dims."""
    shape = tuple(out.shape)
    b_layout = (tuple(b.shape), b.stride()) if b is not None else None
    layout = _layout(shape, (tuple(a.shape), a.stride()), b_layout)
    if layout is None:  # only reachable past 8 dims of mutually strided operands
        a = a.expand(shape).contiguous()
        b = b.expand(shape).contiguous() if b is not None else None
        layout = _layout(shape, (shape, a.stride()),
                         (shape, b.stride()) if b is not None else None)
    ndim, arguments, wide = layout
    block = tiling.blocks["BLOCK"]
    bind_functions(_elementwise_kernel, FN=fn)[grid](
        out, a, b if b is not None else a, out.numel(), scalar, *arguments,
        NDIM=ndim, HAS_B=b is not None,
        WIDE=wide or grid_stride_wide(out.numel(), grid[0], block), BLOCK=block)


# ---------------------------------------------------------------------------------------------
# Operators from their math alone


# Measured on 10^6 normal draws: 40% of numpy's float32 exp results differ from the
# nearest float, 5.6% more of them low than high (torch's: 1%, balanced).
INTERPRETER_EXP_BIAS = KnownLimitation(
    "the interpreter's exp is numpy's float32 exp, 40% of whose results are off the nearest "
    "float and 5.6% more of them low than high: an output proportional to exp(x) carries "
    "that bias into an error balance 2-4x torch's (the max error stays within 2 eps)",
    backend="triton", dtype="float32", failures="eb ratio*", interpreter=True)


def _unary_samples(special: Sequence[float]) -> Callable[..., list[Case]]:
    """The samples every unary operator shares: wide normal draws of odd sizes, a
    transposed and an empty input, and the operator's ``special`` values (±0, ±inf and
    NaN always among them)."""
    values = (0.0, -0.0, float("inf"), float("-inf"), float("nan"), *special)

    def samples(dtype: torch.dtype, device: torch.device, generator: torch.Generator
                ) -> list[Case]:
        return [
            Case("randn_4097", (random_input((4097,), dtype, device, generator, scale=6.0),)),
            Case("rows_63x1000", (random_input((63, 1000), dtype, device, generator),)),
            Case("special", (torch.tensor(values).to(dtype=dtype, device=device),)),
            Case("transposed", (random_input((33, 17), dtype, device, generator).t(),)),
            Case("zero_size", (random_input((0, 3), dtype, device, generator),)),
        ]
    return samples


def _gradient_samples(dtype: torch.dtype, device: torch.device, generator: torch.Generator
                      ) -> list[Case]:
    def pair(*shape: int) -> Case:
        return Case(f"rows_{'x'.join(map(str, shape))}",
                    (random_input(shape, dtype, device, generator, scale=1.0),
                     random_input(shape, dtype, device, generator)))
    return [pair(1000), pair(7, 63), pair(0)]


def named_peer(peer: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``peer`` under its dotted name (``torch.nn.functional.silu``): the label reports
    give a torch peer (a docstring's first line)."""
    module = getattr(peer, "__module__", "torch").replace("torch._ops", "torch.ops")

    def call(*args: Any, **kwargs: Any) -> torch.Tensor:
        return peer(*args, **kwargs)

    call.__doc__ = f"{module}.{peer.__name__}"
    return call


def pointwise(name: str, doc: str, *, value: Any, gradient: Any,
              reference: Callable[[torch.Tensor], torch.Tensor],
              reference_gradient: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
              peer: Callable[..., torch.Tensor], gradient_peer: Callable[..., torch.Tensor],
              flops: int, gradient_flops: int, special: Sequence[float] = (),
              known_limitations: tuple[KnownLimitation, ...] = ()) -> tuple[OpDef, OpDef]:
    """A unary elementwise operator ``name(x)`` and its gradient ``name_backward(grad, x)``
    from their math alone: registered (torch.ops.opforge, autograd saving ``x``), tested
    by every generic test (samples, sweep, layouts, compile), and exported as the
    functional ``opforge.<name>``.

    Args:
        name, doc: the operator's name and one line on what it computes.
        value, gradient: ``triton.jit`` functions ``(a, b, scalar)`` of float32 blocks:
            ``value(x, x, 0)`` and ``gradient(grad, x, 0) = grad * d value(x) / dx``
            (``None`` without triton).
        reference, reference_gradient: the same in torch, in the dtype of their inputs
            (float64 gives the golden).
        peer, gradient_peer: torch's own operator and its gradient (the benchmark).
        flops, gradient_flops: floating-point operations per element.
        special: values beyond the shared samples the operator is checked on.
        known_limitations: of the operator (see `opforge.core.opdef.KnownLimitation`).

    Returns:
        The two OpDefs, registered.
    """

    forward = elementwise_op(
        name, doc, (TensorArg("x"),), _unary_samples(special), flops_per_element=flops,
        precision=PrecisionSpec("benchmark_ratio", "L0", named_peer(peer),
                                known_limitations=known_limitations), bench=BenchSpec())
    backward = elementwise_op(
        f"{name}_backward", f"grad * d {name}(x) / dx.", (TensorArg("grad"), TensorArg("x")),
        _gradient_samples, flops_per_element=gradient_flops,
        check=same_shape_pair(f"{name}_backward", ("grad", "x")),
        precision=PrecisionSpec("benchmark_ratio", "L0", named_peer(gradient_peer)))
    forward.reference(lambda x, *, compute_dtype: reference(x.to(compute_dtype)))
    backward.reference(lambda grad, x, *, compute_dtype: reference_gradient(
        grad.to(compute_dtype), x.to(compute_dtype)))
    forward.launcher("triton")(lambda plan, inputs, outputs, workspace: launch_elementwise(
        value, outputs[0], inputs[0], None, 0.0, plan.tiling, plan.grid))
    backward.launcher("triton")(lambda plan, inputs, outputs, workspace: launch_elementwise(
        gradient, outputs[0], inputs[0], inputs[1], 0.0, plan.tiling, plan.grid))

    def save_input(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ctx.save_for_backward(inputs[0])

    @forward.autograd(save_input)
    def differentiate(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return backward(grad, x).to(x.dtype)

    def functional(x: torch.Tensor) -> torch.Tensor:
        return forward(x)

    return registered(forward, backward, functional,
                      f"{doc}\n\n    Same shape and dtype as ``x`` (any float dtype), "
                      "differentiable.\n\n    Raises:\n        DtypeError: ``x`` is not "
                      "float32/float16/bfloat16/float64.\n    ")


def registered(forward: OpDef, backward: OpDef, functional: Callable[..., torch.Tensor],
               doc: str) -> tuple[OpDef, OpDef]:
    """Register an operator made from its math and its gradient (``torch.ops.opforge``),
    and export ``functional`` under the operator's name with ``doc``; returns the pair."""
    from opforge.library import register_op

    register_op(backward)
    register_op(forward)
    functional.__name__ = functional.__qualname__ = forward.name
    functional.__doc__ = doc
    forward.exported(functional)
    return forward, backward
