"""EmbeddingDenseGrad: the gradient of an embedding table, equal to
``torch.ops.aten.embedding_dense_backward``.

``embedding_dense_grad(grad, indices, num_weights, padding_idx=-1,
scale_grad_by_freq=False, deterministic=None)`` with ``grad`` ``(*indices.shape, D)``::

    out = zeros(num_weights, D)                       float32 accumulation
    for each position i with indices[i] != padding_idx:
        out[indices[i]] += grad[i] * (1 / count(indices[i]) if scale_grad_by_freq else 1)

in grad's dtype. A negative ``padding_idx`` skips nothing (indices are never negative).

Two kernels:

``atomic``
    one program per block of positions adds its gradient rows into a zeroed float32 table
    with atomic adds (fast; the order of the additions, hence the last bits, varies
    between runs), then one pass rounds the table to grad's dtype. Three kernels and no
    torch operator, so a plan holds its launches (`launches`).
``deterministic``
    the positions are sorted by index (a stable sort: equal indices keep their position
    order) and cut into chunks of `SORTED_CHUNK`; a segmented scan sums each run of equal
    indices within a chunk, and a run that spans chunks (a frequent token's) is the sum of
    its chunks' partials in chunk order. Every sum's order is fixed by the sorted
    positions alone, so the result is bitwise identical across runs and grid sizes. A hot
    index's rows are summed by as many programs as it has chunks, and then its partials,
    one per 32 positions, by one program per column block (one program summing every
    row of it serialised a Zipf head).

``deterministic=None`` follows ``torch.are_deterministic_algorithms_enabled()``. Every index
(other than ``padding_idx``) must lie in ``[0, num_weights)``: checked before any kernel
(``IndexRangeError``) at the cost of one read of the extremes, which ``check_range=False``
skips on GPUs (the kernels then skip an out-of-range index: it adds nothing).

Forward only: this is itself a gradient operator (no double backward).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from opforge.core.errors import IndexRangeError, ShapeError
from opforge.core.hardware import HardwareProfile
from opforge.core.opdef import (
    Attr,
    Attrs,
    BenchSpec,
    Case,
    Cost,
    OpDef,
    OutputArg,
    PrecisionSpec,
    Specs,
    TensorArg,
    Tiling,
)
from opforge.core.tiling import MAX_PROGRAMS, cdiv, gpu_warps, launch_options, next_power_of_2
from opforge.library import register_op
from opforge.ops._rows import OVERFLOWING_ROW_SUM
from opforge.precision.cases import generate

try:
    import triton
    import triton.language as tl

    from opforge.ops._math import rounded_for, widen
except ImportError:  # pragma: no cover
    triton = None

NAME = "embedding_dense_grad"
INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
COLUMN_BLOCK = 1024
TABLE_BLOCK = 1024  # elements a program zeroes or rounds at once in the float32 table
SORTED_CHUNK = 32  # sorted positions a tile of the deterministic kernel sums
SORTED_COLUMNS = 128  # its columns: CHUNK x 128 float32 values and run ids in registers


def _check(inputs: Specs, attrs: Attrs) -> None:
    grad, indices = inputs
    if len(grad.shape) < 1 or tuple(grad.shape[:-1]) != tuple(indices.shape):
        raise ShapeError("must be (*indices.shape, D)", op=NAME, param="grad",
                         expected=(*indices.shape, "D"), got=tuple(grad.shape))


def _infer_shape(inputs: Specs, attrs: Attrs) -> list[tuple[int, ...]]:
    return [(attrs["num_weights"], inputs[0].shape[-1])]


def _infer_dtype(inputs: Specs, attrs: Attrs) -> list[torch.dtype]:
    return [inputs[0].dtype]


def _cost(inputs: Specs, outputs: Specs, attrs: Attrs) -> Cost:
    """The least: the gradient and indices read, the table written once (the float32
    table of the atomic variant is its own account's, `_kernel_costs`)."""
    grad, indices = inputs
    return Cost(flops=grad.numel, bytes_moved=grad.numel * grad.itemsize + indices.numel
                * indices.itemsize + outputs[0].numel * outputs[0].itemsize)


def _kernel_costs(tiling: Tiling, grid: tuple[int, ...], inputs: Specs, outputs: Specs,
                  attrs: Attrs) -> dict[str, Cost]:
    """Atomic: the float32 table zeroed, each gradient row added into it (a read and a
    write of the table row per position), then the table rounded into the output.
    Deterministic (the sort is torch's operator, costed as its own): the gradient read
    once, the sorted keys and positions once per column block, each present row written
    once, and at most two float32 partial rows a chunk written, then read by the
    combining pass."""
    grad, indices = inputs
    positions = indices.numel
    width = grad.shape[-1] if grad.shape else 1
    read = grad.numel * grad.itemsize + positions * indices.itemsize
    table = outputs[0].numel
    if use_deterministic(attrs):
        partials = 2 * cdiv(positions, SORTED_CHUNK) * width * 4
        return {"_sorted_chunk_kernel": Cost(
                    flops=grad.numel, bytes_moved=grad.numel * grad.itemsize + 16 * positions
                    * cdiv(width, tiling.blocks["SORTED_D"]) + partials
                    + min(positions * width, table) * outputs[0].itemsize),
                "_sorted_combine_kernel": Cost(flops=positions * width // SORTED_CHUNK,
                                               bytes_moved=partials)}
    return {"_zero_table_kernel": Cost(flops=0, bytes_moved=4 * table),
            "_atomic_kernel": Cost(flops=grad.numel, bytes_moved=read + 8 * grad.numel),
            "_round_table_kernel": Cost(flops=0, bytes_moved=table
                                        * (4 + outputs[0].itemsize))}


def _tiling(inputs: Specs, outputs: Specs, attrs: Attrs, hardware: HardwareProfile
            ) -> list[Tiling]:
    """The atomic kernel's ``BLOCK_M`` positions x ``BLOCK_D`` columns of the gradient
    (columns in blocks of at most 1024); the deterministic kernel's `SORTED_CHUNK`
    positions x ``SORTED_D`` columns (at most `SORTED_COLUMNS`). Both in one tiling: with
    ``deterministic=None`` the kernel is chosen at each run."""
    width = inputs[0].shape[-1]
    block_d = min(COLUMN_BLOCK, next_power_of_2(max(width, 1)))
    block_m = max(1, min(64, 4096 // block_d))
    sorted_d = min(SORTED_COLUMNS, next_power_of_2(max(width, 1)))
    return [Tiling("rows", {"BLOCK_M": block_m, "BLOCK_D": block_d, "SORTED_D": sorted_d},
                   block_m * block_d * 8, options={"warps": gpu_warps(block_m * block_d,
                                                                       hardware)})]


def _grid(tiling: Tiling, inputs: Specs, outputs: Specs, attrs: Attrs,
          hardware: HardwareProfile) -> tuple[int, ...]:
    positions = math.prod(inputs[1].shape)
    tiles = cdiv(positions, tiling.blocks["BLOCK_M"])
    return (max(1, min(tiles, hardware.core_count * 8, MAX_PROGRAMS)),)


def _workspace(tiling: Tiling, grid: tuple[int, ...], inputs: Specs, outputs: Specs,
               attrs: Attrs) -> int:
    """The float32 table of the atomic kernel, or the deterministic kernel's two float32
    partial rows a chunk; the larger where ``deterministic=None`` leaves the choice to
    each run (the functional resolves it first)."""
    atomic = 4 * outputs[0].numel
    chunks = 2 * cdiv(math.prod(inputs[1].shape), SORTED_CHUNK) * inputs[0].shape[-1] * 4
    chosen = attrs["deterministic"]
    return max(atomic, chunks) if chosen is None else chunks if chosen else atomic


def zipf_indices(shape: Sequence[int], num_weights: int, generator: torch.Generator,
                 exponent: float = 1.2) -> torch.Tensor:
    """int64 indices drawn with probability proportional to ``rank^-exponent``: a few
    heavily repeated rows, as real token ids."""
    ranks = torch.arange(1, num_weights + 1, dtype=torch.float64)
    weights = ranks ** -exponent
    count = math.prod(shape)
    if count == 0:
        return torch.zeros(tuple(shape), dtype=torch.int64)
    picks = torch.multinomial(weights, count, replacement=True, generator=generator)
    return picks.reshape(tuple(shape))


def flat_indices(indices: torch.Tensor) -> torch.Tensor:
    """The positions' indices as the kernels read them: int64, one contiguous vector (a
    strided or expanded view would be read as if it were contiguous)."""
    return indices.reshape(-1).long().contiguous()


def _checked_range(flat: torch.Tensor, attrs: Attrs) -> None:
    """Raises IndexRangeError for an index of ``flat`` (`flat_indices`, what the kernels
    read) outside [0, num_weights) (padding_idx aside), by one host read of the extremes.
    """
    if not flat.numel():
        return
    padding, num_weights = attrs["padding_idx"], attrs["num_weights"]
    if padding >= 0 and num_weights:
        # padding_idx counted as row 0: a boolean selection of the kept indices and their
        # min and max were three synchronisations on a GPU.
        flat = flat.masked_fill(flat == padding, 0)
    elif padding >= 0:  # an empty table: no row to count padding as
        flat = flat[flat != padding]
        if not flat.numel():
            return
    extremes = torch.aminmax(flat)
    low, high = (extremes.min.item(), extremes.max.item()) if flat.device.type == "cpu" \
        else torch.stack(extremes).tolist()
    if low < 0 or high >= num_weights:
        raise IndexRangeError("holds an index outside the table", op=NAME, param="indices",
                              expected=f"0..{attrs['num_weights'] - 1}",
                              got=low if low < 0 else high)


def _check_values(plan: object, inputs: Sequence[torch.Tensor | None]) -> None:
    """The index range, unless ``check_range=False`` lets a GPU skip it."""
    if plan.attrs["check_range"] or inputs[0].device.type != "cuda":
        _checked_range(flat_indices(inputs[1]), plan.attrs)


def _holds_launches(attrs: Attrs) -> bool:
    """``deterministic=None`` chooses the kernels at each run, by torch's setting: a
    replay would keep the first run's."""
    return attrs["deterministic"] is not None


def _samples(dtype: torch.dtype, device: torch.device, generator: torch.Generator
             ) -> list[Case]:
    def grad(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator).to(device, dtype)

    def ids(shape: tuple[int, ...], high: int, index_dtype: torch.dtype = torch.int64
            ) -> torch.Tensor:
        return torch.randint(0, high, shape, generator=generator).to(device, index_dtype)

    zipf = zipf_indices((300,), 50, generator).to(device)
    return [
        Case("tokens_2x7_d33", (grad(2, 7, 33), ids((2, 7), 10)), {"num_weights": 10}),
        Case("zipf_300_deterministic", (grad(300, 16), zipf),
             {"num_weights": 50, "deterministic": True}),
        Case("zipf_300_atomic", (grad(300, 16), zipf),
             {"num_weights": 50, "deterministic": False}),
        Case("padding_and_freq", (grad(40, 8), ids((40,), 6, torch.int32)),
             {"num_weights": 6, "padding_idx": 2, "scale_grad_by_freq": True}),
        Case("int16_ids_wide_d1500", (grad(9, 1500), ids((9,), 4, torch.int16)),
             {"num_weights": 5, "deterministic": True}),
        Case("unused_rows", (grad(3, 4), torch.tensor([0, 0, 7], device=device)),
             {"num_weights": 9, "scale_grad_by_freq": True, "deterministic": True}),
        Case("no_positions", (grad(0, 4), ids((0,), 3)), {"num_weights": 3}),
    ]


def _sweep(kind: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
           generator: torch.Generator) -> list[Case]:
    """The gradient drawn from the kind as ``(positions, D)`` (the shape's leading size
    and last size, at most 64; 4097 columns for long rows), Zipf indices over 37 rows;
    both kernels."""
    positions = shape[0]
    width = 4097 if kind == "long_rows" else min(shape[-1], 64)
    grad = generate(kind, (positions, width), dtype, device=device, generator=generator)
    indices = zipf_indices((positions,), 37, generator).to(device)
    return [Case("deterministic", (grad, indices), {"num_weights": 37, "deterministic": True}),
            Case("atomic_freq", (grad, indices), {"num_weights": 37, "deterministic": False,
                                                  "scale_grad_by_freq": True})]


def _sum_scale(opdef: OpDef, inputs: Sequence[torch.Tensor | None], attrs: Attrs,
               golden: torch.Tensor, output: str) -> torch.Tensor:
    """The same sums over |grad|: a sum's rounding is relative to its terms."""
    grad, indices = inputs
    return reference(grad.abs(), indices, compute_dtype=torch.float64, **attrs)


def _torch_embedding_backward(grad: torch.Tensor, indices: torch.Tensor, num_weights: int,
                              padding_idx: int, scale_grad_by_freq: bool,
                              deterministic: bool | None, check_range: bool
                              ) -> torch.Tensor:
    """torch.ops.aten.embedding_dense_backward"""
    return torch.ops.aten.embedding_dense_backward(grad, indices.long(), num_weights,
                                                   padding_idx, scale_grad_by_freq)


def _bench_case(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                generator: torch.Generator) -> Case:
    """``shape = (positions, D, V)``: a gradient of ``(positions, D)`` over a table of V
    rows, Zipf-distributed token ids (as text has), the atomic kernel."""
    positions, width, rows = shape
    grad = generate("normal", (positions, width), dtype, device=device, generator=generator)
    indices = zipf_indices((positions,), rows, generator).to(device)
    return Case("zipf", (grad, indices), {"num_weights": rows, "deterministic": False})


EMBEDDING_DENSE_GRAD = OpDef(
    name=NAME, doc="Embedding table gradient (aten.embedding_dense_backward): atomic or "
                   "sort-based deterministic accumulation in float32.",
    inputs=(TensorArg("grad"),
            TensorArg("indices", dtypes=INDEX_DTYPES)),
    outputs=(OutputArg("grad_weight"),),
    attrs=(Attr("num_weights", "int", 0, range=(0, None), doc="rows of the table"),
           Attr("padding_idx", "int", -1, doc="index whose rows get no gradient"),
           Attr("scale_grad_by_freq", "bool", False, doc="divide by the index's count"),
           Attr("deterministic", "bool", None,
                doc="sort-based kernel; None: torch's deterministic setting"),
           Attr("check_range", "bool", True, doc="check indices before the kernels")),
    infer_shape=_infer_shape, infer_dtype=_infer_dtype, check=_check,
    check_values=_check_values, cost=_cost, tiling=_tiling, grid=_grid, workspace=_workspace,
    kernel_costs=_kernel_costs, samples=_samples, error_scale=_sum_scale,
    held_launches=_holds_launches,
    precision=PrecisionSpec("benchmark_ratio", "L0", _torch_embedding_backward,
                            sweep=_sweep, known_limitations=(OVERFLOWING_ROW_SUM,)),
    bench=BenchSpec(shapes=((4096, 4096, 128256), (16384, 4096, 128256)),
                    cpu_shapes=((1024, 256, 32000), (4096, 256, 32000)), case=_bench_case))


# ---------------------------------------------------------------------------------------------
# Reference


@EMBEDDING_DENSE_GRAD.reference
def reference(grad: torch.Tensor, indices: torch.Tensor, *, compute_dtype: torch.dtype,
              num_weights: int, padding_idx: int, scale_grad_by_freq: bool,
              deterministic: bool | None, check_range: bool) -> torch.Tensor:
    """``index_add`` of the gradient rows in ``compute_dtype`` (the plan checked the
    indices)."""
    flat = indices.reshape(-1).long()
    rows = grad.reshape(flat.numel(), grad.shape[-1]).to(compute_dtype)
    if scale_grad_by_freq:
        counts = torch.bincount(flat, minlength=num_weights).to(compute_dtype)
        rows = rows / counts[flat][:, None]
    keep = flat != padding_idx
    out = torch.zeros(num_weights, grad.shape[-1], dtype=compute_dtype, device=grad.device)
    return out.index_add(0, flat[keep], rows[keep])


# ---------------------------------------------------------------------------------------------
# Kernels

if triton is not None:

    @triton.jit
    def _atomic_kernel(grad_ptr, index_ptr, scale_ptr, table_ptr, N, D, V, padding_idx,
                       SCALED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        columns = tl.arange(0, BLOCK_D)
        for tile in range(tl.program_id(0), tl.cdiv(N, BLOCK_M), tl.num_programs(0)):
            rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
            row_mask = rows < N
            index = tl.load(index_ptr + rows, mask=row_mask, other=0)  # integer index
            index = index.to(tl.int64)
            keep = row_mask & (index != padding_idx) & (index >= 0) & (index < V)
            factor = tl.full([BLOCK_M], 1.0, tl.float32)
            if SCALED:
                factor = tl.load(scale_ptr + index, mask=keep, other=0.0)  # float32 statistic
            for start in range(0, D, BLOCK_D):
                cols = start + columns
                mask = keep[:, None] & (cols < D)[None, :]
                values = widen(tl.load(grad_ptr + rows[:, None].to(tl.int64) * D
                                       + cols[None, :], mask=mask, other=0.0))
                tl.atomic_add(table_ptr + index[:, None] * D + cols[None, :],
                              values * factor[:, None], mask=mask)

    @triton.jit
    def _add_within_run(total, run, later, later_run):
        """The segmented scan's step: a running sum that restarts where the run changes (a
        selection, so a non-finite row stays within its own run)."""
        return tl.where(run == later_run, total + later, later), later_run

    @triton.jit
    def _chunk_tile(tile, D, BLOCK_D: tl.constexpr):
        """(chunk, columns, their mask) of a tile of the chunked kernels: tiles run over the
        column blocks of chunk 0, then of chunk 1, ..."""
        column_blocks = tl.cdiv(D, BLOCK_D)
        cols = (tile % column_blocks) * BLOCK_D + tl.arange(0, BLOCK_D)
        return tile // column_blocks, cols, cols < D

    @triton.jit
    def _sorted_chunk_kernel(grad_ptr, keys_ptr, order_ptr, scale_ptr, out_ptr, partial_ptr,
                             N, D, V, padding_idx, SCALED: tl.constexpr, CHUNK: tl.constexpr,
                             BLOCK_D: tl.constexpr):
        """A tile of CHUNK sorted positions x BLOCK_D columns: the runs of equal keys summed
        in float32 by a segmented scan. A run wholly inside the chunk is written to its
        table row; the part of a run begun in an earlier chunk goes to the chunk's partial
        row 0, that of a run going on into the next chunk to row 1, for
        `_sorted_combine_kernel`."""
        offsets = tl.arange(0, CHUNK)
        for tile in range(tl.program_id(0), tl.cdiv(N, CHUNK) * tl.cdiv(D, BLOCK_D),
                          tl.num_programs(0)):
            chunk, cols, col_mask = _chunk_tile(tile, D, BLOCK_D)
            first = chunk * CHUNK
            positions = first + offsets
            valid = positions < N
            keys = tl.load(keys_ptr + positions, mask=valid, other=0)  # integer index
            inner = valid & (offsets > 0)
            previous = tl.load(keys_ptr + positions - 1, mask=inner, other=0)  # integer index
            after = positions + 1
            following = tl.load(keys_ptr + after, mask=after < N, other=0)  # integer index
            # Scalars loaded in bounds unmasked (a clamped address) and compared with care.
            before = tl.load(keys_ptr + tl.maximum(first - 1, 0))  # integer index
            continued = (first > 0) & (before == tl.load(keys_ptr + first))  # integer index
            ends = (after >= N) | (following != keys)
            runs = tl.cumsum((inner & (previous != keys)).to(tl.int32), 0)
            kept = valid & (keys != padding_idx) & (keys >= 0) & (keys < V)
            order = tl.load(order_ptr + positions, mask=kept, other=0)  # integer index
            values = widen(tl.load(grad_ptr + order[:, None] * D + cols[None, :],
                                   mask=kept[:, None] & col_mask[None, :], other=0.0))
            sums, _ = tl.associative_scan(
                (values, tl.broadcast_to(runs[:, None], (CHUNK, BLOCK_D))), 0, _add_within_run)
            held = kept & (ends | (offsets == CHUNK - 1))  # the row holding its run's sum
            # The scalar widened to the block: the interpreter's & refuses a scalar boolean
            # beside a block of them.
            head = (runs == 0) & (tl.zeros_like(runs) + continued.to(tl.int32) != 0)
            whole = held & ends & (head == 0)  # no ~: the Ascend interpreter cannot invert
            factor = tl.full([CHUNK], 1.0, tl.float32)
            if SCALED:
                factor = tl.load(scale_ptr + keys, mask=whole, other=1.0)  # float32 statistic
            rows = keys[:, None] * D + cols[None, :]
            tl.store(out_ptr + rows, rounded_for(sums * factor[:, None], out_ptr),
                     mask=whole[:, None] & col_mask[None, :])
            slot = (2 * chunk + tl.where(head, 0, 1)).to(tl.int64)
            tl.store(partial_ptr + slot[:, None] * D + cols[None, :], sums,  # float32 partial
                     mask=(held & (whole == 0))[:, None] & col_mask[None, :])

    @triton.jit
    def _sorted_combine_kernel(keys_ptr, scale_ptr, partial_ptr, out_ptr, N, D, V,
                               padding_idx, SEARCH_STEPS, SCALED: tl.constexpr,
                               CHUNK: tl.constexpr, BLOCK_D: tl.constexpr):
        """Each run that spans chunks, written once by the chunk it begins in: its partial
        row 1 there, then row 0 of each chunk it goes on through, added in chunk order
        (its end found by a binary search of the sorted keys)."""
        for tile in range(tl.program_id(0), tl.cdiv(N, CHUNK) * tl.cdiv(D, BLOCK_D),
                          tl.num_programs(0)):
            chunk, cols, col_mask = _chunk_tile(tile, D, BLOCK_D)
            first = chunk * CHUNK
            last = tl.minimum(first + CHUNK, N) - 1
            key = tl.load(keys_ptr + last)  # integer index
            following = tl.load(keys_ptr + tl.minimum(last + 1, N - 1))  # integer index
            before = tl.load(keys_ptr + tl.maximum(first - 1, 0))  # integer index
            begins_here = (first == 0) | (before != key)
            if (last + 1 < N) & (following == key) & begins_here & (key != padding_idx) \
                    & (key >= 0) & (key < V):
                low = last + 1  # holds key; the run ends in (low, high]
                high = tl.zeros_like(low) + N  # a tensor, should N be specialised as 1
                for _ in range(SEARCH_STEPS):
                    middle = low + (high - low) // 2
                    same = tl.load(keys_ptr + middle) == key  # integer index
                    low = tl.where(same, middle, low)
                    high = tl.where(same, high, middle)
                total = tl.load(partial_ptr + tl.cast(2 * chunk + 1, tl.int64) * D + cols,
                                mask=col_mask)  # float32 partial
                for later in range(chunk + 1, (high - 1) // CHUNK + 1):
                    total += tl.load(partial_ptr + tl.cast(2 * later, tl.int64) * D + cols,
                                     mask=col_mask)  # float32 partial
                if SCALED:
                    total = total * tl.load(scale_ptr + key)  # float32 statistic
                tl.store(out_ptr + key * D + cols, rounded_for(total, out_ptr), mask=col_mask)

    @triton.jit
    def _zero_table_kernel(table_ptr, TOTAL, BLOCK: tl.constexpr):
        """The float32 table zeroed (a kernel, not torch's fill: the launches stay held)."""
        for tile in range(tl.program_id(0), tl.cdiv(TOTAL, BLOCK), tl.num_programs(0)):
            offsets = tl.cast(tile, tl.int64) * BLOCK + tl.arange(0, BLOCK)
            zeros = tl.zeros([BLOCK], tl.float32)
            tl.store(table_ptr + offsets, zeros, mask=offsets < TOTAL)  # float32 partial

    @triton.jit
    def _round_table_kernel(table_ptr, out_ptr, TOTAL, BLOCK: tl.constexpr):
        for tile in range(tl.program_id(0), tl.cdiv(TOTAL, BLOCK), tl.num_programs(0)):
            offsets = tl.cast(tile, tl.int64) * BLOCK + tl.arange(0, BLOCK)
            mask = offsets < TOTAL
            values = tl.load(table_ptr + offsets, mask=mask)  # float32 partial
            tl.store(out_ptr + offsets, rounded_for(values, out_ptr), mask=mask)


# ---------------------------------------------------------------------------------------------
# Launcher


def use_deterministic(attrs: Attrs) -> bool:
    """The kernel a call runs: the attribute, or torch's deterministic setting."""
    chosen = attrs["deterministic"]
    return torch.are_deterministic_algorithms_enabled() if chosen is None else chosen


@EMBEDDING_DENSE_GRAD.launcher("triton")
def launch(plan: object, inputs: Sequence[torch.Tensor | None],
           outputs: Sequence[torch.Tensor], workspace: torch.Tensor | None) -> None:
    """Atomic adds into a float32 table then a rounding pass, or the stable sort, the
    chunks' segmented sums and the spanning runs' combination (see the module
    docstring)."""
    grad, indices = inputs
    out = outputs[0]
    attrs = plan.attrs
    flat = flat_indices(indices)
    positions, width = flat.numel(), grad.shape[-1]
    rows = grad.reshape(positions, width).contiguous()
    scale = None
    if attrs["scale_grad_by_freq"]:
        scale = 1.0 / torch.bincount(flat, minlength=attrs["num_weights"]).float()
    blocks = plan.tiling.blocks
    options = launch_options(plan.tiling)
    if not use_deterministic(attrs):
        total = out.numel()
        table = workspace[:4 * total].view(torch.float32).view(out.shape)
        grid = (max(1, min(cdiv(total, TABLE_BLOCK), MAX_PROGRAMS)),)
        _zero_table_kernel[grid](table, total, BLOCK=TABLE_BLOCK)
        _atomic_kernel[plan.grid](rows, flat, rows if scale is None else scale, table,
                                  positions, width, attrs["num_weights"], attrs["padding_idx"],
                                  SCALED=scale is not None, BLOCK_M=blocks["BLOCK_M"],
                                  BLOCK_D=blocks["BLOCK_D"], **options)
        _round_table_kernel[grid](table, out, total, BLOCK=TABLE_BLOCK)
        return
    out.zero_()
    if not positions:
        return
    sorted_keys, order = torch.sort(flat, stable=True)
    chunks = cdiv(positions, SORTED_CHUNK)
    partials = workspace[: 8 * chunks * width].view(torch.float32)
    grid = (max(1, min(chunks * cdiv(width, blocks["SORTED_D"]), plan.grid[0])),)
    common = dict(SCALED=scale is not None, CHUNK=SORTED_CHUNK, BLOCK_D=blocks["SORTED_D"],
                  **options)
    _sorted_chunk_kernel[grid](rows, sorted_keys, order, rows if scale is None else scale, out,
                               partials, positions, width, attrs["num_weights"],
                               attrs["padding_idx"], **common)
    _sorted_combine_kernel[grid](sorted_keys, rows if scale is None else scale, partials, out,
                                 positions, width, attrs["num_weights"], attrs["padding_idx"],
                                 positions.bit_length(), **common)


register_op(EMBEDDING_DENSE_GRAD)


@EMBEDDING_DENSE_GRAD.exported
def embedding_dense_grad(grad: torch.Tensor, indices: torch.Tensor, num_weights: int,
                         padding_idx: int = -1, scale_grad_by_freq: bool = False,
                         deterministic: bool | None = None, check_range: bool = True
                         ) -> torch.Tensor:
    """The embedding table's gradient, equal to ``torch.ops.aten.embedding_dense_backward``:
    ``out[indices[i]] += grad[i]`` (divided by the index's count when
    ``scale_grad_by_freq``), rows of ``padding_idx`` skipped, float32 accumulation.

    Args:
        grad: ``(*indices.shape, D)`` fp32/fp16/bf16. indices: int64, int32, int16, int8
            or uint8, any shape and layout. deterministic: the sort-based kernel (bitwise
            reproducible) or the atomic one; None follows
            ``torch.are_deterministic_algorithms_enabled()``.
        check_range: check every index before the kernels (one read of the extremes);
            ``False`` skips it on GPUs only.

    Returns:
        ``(num_weights, D)`` in grad's dtype.

    Raises:
        ShapeError: grad's leading dims differ from indices'. DtypeError: unsupported
        dtypes. IndexRangeError: an index outside ``[0, num_weights)``.
    """
    if deterministic is None:  # resolved here, so that the plan holds one kernel's scratch
        deterministic = torch.are_deterministic_algorithms_enabled()
    return EMBEDDING_DENSE_GRAD(grad, indices, num_weights, padding_idx,
                                scale_grad_by_freq, deterministic, check_range)
