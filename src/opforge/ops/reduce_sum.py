"""ReduceSum: ``out = scale * sum(x, dims)``, accumulated in float32.

Semantics of CANN's ReduceSum: ``dims=None`` reduces every dim, ``dims=()`` reduces none
(the output is ``scale * x``; unlike ``torch.sum(x, dim=())``, which reduces every dim),
``keepdim`` keeps reduced dims as size 1, and the output has the input's dtype. ``scale``
is applied in float32 before the single rounding to the output dtype, which is how
`broadcast_add`'s backward scales the gradient of ``b`` by ``alpha`` without a second
rounding.

The kernel views the input as a 2-D ``(M kept, K reduced)`` matrix through its strides. When
there are too few output rows to fill the device, the K axis is split across programs that
write float32 partial sums into the workspace; a second kernel adds the partials in a fixed
order, so results are deterministic (no atomics).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

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
from opforge.core.shapes import UNKNOWN_RANK, broadcast_dims, is_unknown_rank, normalize_dims
from opforge.core.tiling import (
    INT32_LIMIT,
    MAX_PROGRAMS,
    PROGRAMS_PER_CORE,
    cdiv,
    next_power_of_2,
    persistent_grid,
)
from opforge.library import register_op
from opforge.ops._elementwise import random_input
from opforge.ops._statistics import check_scalar
from opforge.precision.cases import generate

try:
    import triton
    import triton.language as tl

    from opforge.ops._math import rounded_for, widen
except ImportError:  # pragma: no cover
    triton = None

NAME = "reduce_sum"
TILE_ELEMENTS = 4096


def _reduced(inputs: Specs, attrs: Attrs) -> tuple[int, ...]:
    rank = len(inputs[0].shape)
    dims = attrs["dims"]
    return tuple(range(rank)) if dims is None else normalize_dims(dims, rank, op=NAME,
                                                                  param="dims")


def _check(inputs: Specs, attrs: Attrs) -> None:
    check_scalar(NAME, "scale", attrs["scale"], inputs)
    if not is_unknown_rank(inputs[0].shape):
        _reduced(inputs, attrs)


def _infer_shape(inputs: Specs, attrs: Attrs) -> list[tuple[int, ...]]:
    shape = inputs[0].shape
    if is_unknown_rank(shape):
        return [UNKNOWN_RANK]
    reduced = _reduced(inputs, attrs)
    if attrs["keepdim"]:
        return [tuple(1 if i in reduced else d for i, d in enumerate(shape))]
    return [tuple(d for i, d in enumerate(shape) if i not in reduced)]


def _infer_dtype(inputs: Specs, attrs: Attrs) -> list[torch.dtype]:
    return [inputs[0].dtype]


def _cost(inputs: Specs, outputs: Specs, attrs: Attrs) -> Cost:
    x, out = inputs[0], outputs[0]
    return Cost(flops=x.numel + out.numel,
                bytes_moved=x.numel * x.itemsize + out.numel * out.itemsize)


def _kernel_costs(tiling: Tiling, grid: tuple[int, ...], inputs: Specs, outputs: Specs,
                  attrs: Attrs) -> dict[str, Cost]:
    """Split: the row kernel sums each slice of the reduced columns into float32 partials,
    the second kernel sums the partials of each output; unsplit, one kernel."""
    splits = grid[1]
    if splits == 1:
        return {}
    x, out = inputs[0], outputs[0]
    partials = 4 * splits * out.numel
    return {"_reduce_rows_kernel": Cost(flops=x.numel, bytes_moved=x.numel * x.itemsize
                                        + partials),
            "_reduce_partials_kernel": Cost(flops=splits * out.numel, bytes_moved=partials
                                            + out.numel * out.itemsize)}


def _rows_and_cols(inputs: Specs, outputs: Specs) -> tuple[int, int]:
    rows = outputs[0].numel
    return rows, (inputs[0].numel // rows if rows else 0)


def _tiling(inputs: Specs, outputs: Specs, attrs: Attrs, hardware: HardwareProfile
            ) -> list[Tiling]:
    x = inputs[0]
    rows, cols = _rows_and_cols(inputs, outputs)
    reduced = _reduced(inputs, attrs)
    kept = [i for i, d in enumerate(x.shape) if i not in reduced and d != 1]
    # Reducing trailing dims of a contiguous input reads along K: wide K tiles coalesce.
    # Reducing leading dims reads along M: wide M tiles coalesce.
    inner = not kept or not reduced or max(kept) < min(reduced)
    tile = min(TILE_ELEMENTS, hardware.max_tile_elements)
    if inner:
        block_k = min(next_power_of_2(max(cols, 1)), 1024)
        block_m = min(next_power_of_2(max(rows, 1)), max(1, tile // block_k))
    else:
        block_m = min(next_power_of_2(max(rows, 1)), 256)
        block_k = min(next_power_of_2(max(cols, 1)), max(1, tile // block_m))
    target = hardware.core_count * PROGRAMS_PER_CORE
    candidates = []
    while True:
        m_blocks = cdiv(rows, block_m)
        k_blocks = max(1, cdiv(cols, block_k))
        splits = max(1, min(k_blocks, target // max(m_blocks, 1)))
        # A [BLOCK_M, BLOCK_K] tile of the input, its float32 accumulator, the row sums.
        onchip = block_m * block_k * (x.itemsize + 4) + block_m * 4
        candidates.append(Tiling("split_k" if splits > 1 else "rows",
                                 {"BLOCK_M": block_m, "BLOCK_K": block_k}, onchip,
                                 options={"splits": splits}))
        if block_m * block_k <= 64:
            return candidates
        if block_k >= block_m:
            block_k //= 2
        else:
            block_m //= 2


def _grid(tiling: Tiling, inputs: Specs, outputs: Specs, attrs: Attrs,
          hardware: HardwareProfile) -> tuple[int, ...]:
    rows, cols = _rows_and_cols(inputs, outputs)
    splits = max(1, min(tiling.options["splits"], cdiv(cols, tiling.blocks["BLOCK_K"])))
    m_blocks = cdiv(rows, tiling.blocks["BLOCK_M"])
    return (max(1, min(m_blocks, MAX_PROGRAMS // splits)), splits)


def _workspace(tiling: Tiling, grid: tuple[int, ...], inputs: Specs, outputs: Specs,
               attrs: Attrs) -> int:
    splits = grid[1]
    return 4 * splits * outputs[0].numel if splits > 1 else 0


def _samples(dtype: torch.dtype, device: torch.device, generator: torch.Generator
             ) -> list[Case]:
    def x(*shape: int) -> torch.Tensor:
        return random_input(shape, dtype, device, generator)

    return [
        Case("rows_1000", (x(63, 1000),), {"dims": (1,)}),
        Case("cols_63x1000", (x(63, 1000),), {"dims": (0,)}),
        Case("split_k_4097x3", (x(4097, 3),), {"dims": (0,), "scale": -0.5}),
        Case("mixed_dims_keepdim", (x(4, 7, 33),), {"dims": (0, 2), "keepdim": True}),
        Case("all", (x(7, 63),), {}),
        Case("none_scaled", (x(7, 5),), {"dims": (), "scale": 2.0}),
        Case("transposed", (x(33, 17).t(),), {"dims": (-1,)}),
        Case("empty_dim", (x(0, 5),), {"dims": (0,)}),
    ]


def _sum_abs_scale(opdef: OpDef, inputs: Sequence[torch.Tensor | None], attrs: Attrs,
                   golden: torch.Tensor, output: str) -> torch.Tensor:
    """|scale| * sum(|x|): a sum's rounding error is relative to its terms' magnitudes, not
    to the (possibly cancelled) result."""
    return reference(inputs[0].abs(), compute_dtype=torch.float64, **attrs).abs()


def _torch_sum(x: torch.Tensor, dims: Sequence[int] | None, keepdim: bool, scale: float
               ) -> torch.Tensor:
    """torch.sum"""
    if dims is not None and len(dims) == 0:
        return x * scale
    return torch.sum(x, dim=dims, keepdim=keepdim) * scale


def _sweep(kind: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
           generator: torch.Generator) -> list[Case]:
    """Rows summed (last dim) and, for 2-D and up, columns (first dim)."""
    x = generate(kind, shape, dtype, device=device, generator=generator)
    cases = [Case("rows", (x,), {"dims": (-1,)})]
    if x.ndim > 1:
        cases.append(Case("cols", (x,), {"dims": (0,)}))
    return cases


REDUCE_SUM = OpDef(
    name=NAME,
    doc="Sum over dims, accumulated in float32 and scaled once: scale * x.sum(dims).",
    inputs=(TensorArg("x"),),
    outputs=(OutputArg("out"),),
    attrs=(
        Attr("dims", "ints", None, doc="dims to reduce; None: all, (): none"),
        Attr("keepdim", "bool", False, doc="keep reduced dims as size 1"),
        Attr("scale", "float", 1.0, doc="factor applied in float32 before rounding"),
    ),
    infer_shape=_infer_shape,
    infer_dtype=_infer_dtype,
    check=_check,
    cost=_cost,
    tiling=_tiling,
    grid=_grid,
    workspace=_workspace,
    kernel_costs=_kernel_costs,
    error_scale=_sum_abs_scale,
    samples=_samples,
    bench=BenchSpec(),
    precision=PrecisionSpec("benchmark_ratio", "L2", _torch_sum, sweep=_sweep, known_limitations=(
        KnownLimitation(
            "Sums accumulate in float32: when a partial sum of near-overflow terms passes "
            "3.4e38 it becomes Inf although the exact total is finite. torch.sum accumulates "
            "in float32 too and overflows alike; float16 inputs cannot reach the float32 "
            "range.", case="large_*", failures="*NaN/Inf*"),
    )),
)


# ---------------------------------------------------------------------------------------------
# Reference


@REDUCE_SUM.reference
def reference(x: torch.Tensor, *, compute_dtype: torch.dtype, dims: Sequence[int] | None,
              keepdim: bool, scale: float) -> torch.Tensor:
    """``scale * x.sum(dims)`` in ``compute_dtype`` (``dims=()`` reduces nothing)."""
    wide = x.to(compute_dtype)
    if dims is not None and len(dims) == 0:
        return wide * scale
    if dims is None:
        dims = tuple(range(x.ndim))
    return wide.sum(dim=tuple(dims), keepdim=keepdim) * scale if x.ndim else wide * scale


# ---------------------------------------------------------------------------------------------
# Kernels

if triton is not None:

    @triton.jit
    def _reduce_rows_kernel(x_ptr, out_ptr, partial_ptr, M, K, stride_m, stride_k, scale,
                            SPLIT: tl.constexpr, WIDE: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        split = tl.program_id(1)
        splits = tl.num_programs(1)
        for m_block in range(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.num_programs(0)):
            rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
            if WIDE:
                rows = rows.to(tl.int64)
            row_mask = rows < M
            # Accumulate lane-wise and reduce the tile once at the end: each lane adds
            # K / (BLOCK_K * splits) terms, which keeps the float32 rounding error small.
            acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
            for k_block in range(split, tl.cdiv(K, BLOCK_K), splits):
                cols = k_block * BLOCK_K + tl.arange(0, BLOCK_K)
                if WIDE:
                    cols = cols.to(tl.int64)
                mask = row_mask[:, None] & (cols < K)[None, :]
                ptrs = x_ptr + rows[:, None] * stride_m + cols[None, :] * stride_k
                acc += widen(tl.load(ptrs, mask=mask, other=0.0))
            total = tl.sum(acc, axis=1)
            if SPLIT:
                tl.store(partial_ptr + split * M + rows, total, mask=row_mask)
            else:
                tl.store(out_ptr + rows, rounded_for(total * scale, out_ptr), mask=row_mask)

    @triton.jit
    def _reduce_partials_kernel(partial_ptr, out_ptr, M, scale, SPLITS: tl.constexpr,
                                WIDE: tl.constexpr, BLOCK: tl.constexpr):
        for m_block in range(tl.program_id(0), tl.cdiv(M, BLOCK), tl.num_programs(0)):
            rows = m_block * BLOCK + tl.arange(0, BLOCK)
            if WIDE:
                rows = rows.to(tl.int64)
            mask = rows < M
            total = tl.zeros([BLOCK], dtype=tl.float32)
            for split in range(SPLITS):
                total += tl.load(partial_ptr + split * M + rows, mask=mask, other=0.0)
            tl.store(out_ptr + rows, rounded_for(total * scale, out_ptr), mask=mask)


# ---------------------------------------------------------------------------------------------
# Launcher


@REDUCE_SUM.launcher("triton")
def launch(plan: object, inputs: Sequence[torch.Tensor | None], outputs: Sequence[torch.Tensor],
           workspace: torch.Tensor | None) -> None:
    """Two-pass (split) or one-pass reduction of the ``(M, K)`` view of ``x``."""
    # A 0-d x reduced over its dim 0 (as torch allows) is the 1-element vector.
    x, out = inputs[0] if inputs[0].ndim else inputs[0].reshape(1), outputs[0]
    reduced = _reduced(plan.inputs, plan.attrs)
    kept = [i for i in range(x.ndim) if i not in reduced]
    rows, cols = _rows_and_cols(plan.inputs, plan.outputs)
    # A view when the kept and the reduced dims each collapse; a copy otherwise.
    matrix = x.permute((*kept, *reduced)).reshape(rows, cols)
    stride_m, stride_k = matrix.stride()
    grid, tiling = plan.grid, plan.tiling
    splits = grid[1]
    reach = (rows - 1) * abs(stride_m) + (cols - 1) * abs(stride_k) + 1
    wide = max(reach, splits * rows) > INT32_LIMIT
    flat = out.view(-1)
    partials = workspace.view(torch.float32) if splits > 1 else flat
    scale = plan.attrs["scale"]
    _reduce_rows_kernel[grid](matrix, flat, partials, rows, cols, stride_m, stride_k, scale,
                              SPLIT=splits > 1, WIDE=wide, **tiling.blocks)
    if splits > 1:
        block = 1024
        programs = persistent_grid(cdiv(rows, block), plan.hardware)
        _reduce_partials_kernel[(programs,)](partials, flat, rows, scale, SPLITS=splits,
                                             WIDE=wide, BLOCK=block)


# ---------------------------------------------------------------------------------------------
# Backward


def _setup_context(ctx: object, inputs: tuple[object, ...], output: torch.Tensor) -> None:
    x, dims, keepdim, scale = inputs
    ctx.shape = tuple(x.shape)
    ctx.dims = dims
    ctx.keepdim = keepdim
    ctx.scale = scale


@REDUCE_SUM.autograd(_setup_context)
def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
    """d(scale * sum x)/dx = scale, broadcast back over the reduced dims."""
    rank = len(ctx.shape)
    dims = (tuple(range(rank)) if ctx.dims is None
            else normalize_dims(ctx.dims, rank, op=NAME, param="dims"))
    if rank and not ctx.keepdim:
        for dim in dims:
            grad = grad.unsqueeze(dim)
    return (grad * ctx.scale).expand(ctx.shape), None, None, None


register_op(REDUCE_SUM)


# ---------------------------------------------------------------------------------------------
# For other operators' backward


def sum_to_shape(grad: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype,
                 scale: float = 1.0) -> torch.Tensor:
    """``scale *`` the sum of ``grad`` over the dims it was broadcast along from ``shape``
    (the gradient of a broadcast input), in ``dtype``, through `reduce_sum`."""
    dims = broadcast_dims(shape, tuple(grad.shape))
    if not dims and scale == 1.0:
        # Nothing was broadcast: the gradient passes through (as torch's own backward
        # formulas return it) instead of being copied by an empty reduction.
        return grad.reshape(shape).to(dtype)
    summed = REDUCE_SUM(grad, list(dims), True, scale)
    return summed.reshape(shape).to(dtype)


@REDUCE_SUM.exported
def reduce_sum(x: torch.Tensor, dims: int | Sequence[int] | None = None,
               keepdim: bool = False, scale: float = 1.0) -> torch.Tensor:
    """``scale * x.sum(dims)`` accumulated in float32, output in ``x.dtype``.

    ``dims=None`` reduces every dim; ``dims=()`` reduces none, as CANN's ReduceSum does
    (``torch.sum(x, dim=())`` reduces every dim).

    Raises:
        AttrError: a dim out of range or repeated. DtypeError: unsupported dtype.
    """
    if isinstance(dims, int):
        dims = [dims]
    return REDUCE_SUM(x, None if dims is None else list(dims), keepdim, scale)
