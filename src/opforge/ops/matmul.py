"""Matmul with ``torch.matmul``'s rules and float32 accumulation.

``matmul(a, b, allow_tf32=False, float32_out=False)``: 1-D operands are promoted (``a`` to a
row, ``b`` to a column) and the added dim dropped from the result; batch dims broadcast; both
operands must have one dtype, which the result has (float32 with ``float32_out``: the
accumulator stored unrounded, for a caller that sums several products). Tiles of
``BLOCK_M x BLOCK_K`` and ``BLOCK_K x BLOCK_N`` accumulate in float32 through ``tl.dot``;
float32 inputs use IEEE products unless
``allow_tf32`` (then the tensor cores' tf32, ~10 mantissa bits per product). Output tiles
are visited in groups of ``GROUP_M`` rows so that neighbouring programs share ``b`` tiles in
the L2 cache. The tiling picks block sizes from M, N, K and the `HardwareProfile` (smaller
blocks for skinny problems, the on-chip budget for the pipelined stages). A decode-sized
product (a few rows against a wide weight) has too few output tiles to keep a GPU's cores
streaming the weight: K is then cut into slices, each a program writing float32 partial
sums to the workspace, and a second kernel adds them in slice order (the same result on
every run) and rounds once to the output dtype. The variants ``tiles_tma`` and
``tiles_tma_ws`` read the operand blocks by on-device tensor descriptor (TMA on Hopper or
newer; 16-bit operands with unit-stride, 16-byte-aligned rows, else the pointer kernel), the
second with a warp-specialized K loop; on CUDA the tiling lists them, with other block
shapes, after its own choice, for autotuning (`opforge.core.autotune`) to measure.

Under Triton's interpreter the operands are widened to float32 before ``tl.dot`` (it has
no bf16 dot); compiled, bf16/fp16 operands go to the tensor cores as they are.

The backward is two matmuls through this operator, ``grad_a = grad @ b^T`` and
``grad_b = a^T @ grad``, each summed over the batch dims its operand was broadcast along.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from opforge.core import backends
from opforge.core.errors import DtypeError, ShapeError
from opforge.core.hardware import HardwareProfile
from opforge.core.opdef import (
    Attr,
    Attrs,
    AutocastPolicy,
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
from opforge.core.shapes import UNKNOWN_RANK, broadcast_shapes, is_unknown_rank
from opforge.core.tiling import (
    INT32_LIMIT,
    MAX_PROGRAMS,
    cdiv,
    gpu_warps,
    launch_options,
    next_power_of_2,
    persistent_grid,
    split_steps,
    wide_offsets,
    work_splits,
)
from opforge.library import register_op
from opforge.ops._descriptors import descriptors_usable, use_scratch_allocator
from opforge.ops._elementwise import random_input
from opforge.ops.reduce_sum import sum_to_shape
from opforge.precision.cases import generate

try:
    import triton
    import triton.language as tl

    from opforge.ops._descriptors import descriptor_pair
    from opforge.ops._math import dot_operand, rounded_for, widen
except ImportError:  # pragma: no cover
    triton = None

NAME = "matmul"
GROUP_M = 8
SUM_BLOCK = 1024  # elements a program of the K-slice sum adds per step


def _operands(a: Sequence[int], b: Sequence[int]) -> tuple[tuple[int, ...], int, int, int]:
    """(broadcast batch shape, M, K, N) of ``a @ b`` (1-D operands promoted).

    Raises:
        ShapeError: a 0-d operand, K mismatch, or batch dims that do not broadcast.
    """
    if not a or not b:
        raise ShapeError("operands must have at least one dim", op=NAME,
                         param="a" if not a else "b", expected="a tensor of 1+ dims",
                         got=tuple(a) if not a else tuple(b))
    a2 = (1, *a) if len(a) == 1 else tuple(a)
    b2 = (*b, 1) if len(b) == 1 else tuple(b)
    if a2[-1] != b2[-2]:
        raise ShapeError("inner dims differ", op=NAME, param="b",
                         expected=f"{a2[-1]} rows (a has {a2[-1]} columns)", got=tuple(b))
    try:
        batch = broadcast_shapes(a2[:-2], b2[:-2], op=NAME, names=("a", "b"))
    except ShapeError as error:
        raise ShapeError(f"batch dims (all but the last two) cannot be broadcast: {error.got}",
                         op=NAME, param="a,b", expected="batch dims equal or 1",
                         got=f"a {tuple(a)}, b {tuple(b)}") from None
    return tuple(batch), a2[-2], a2[-1], b2[-1]


def _output_shape(a: Sequence[int], b: Sequence[int]) -> tuple[int, ...]:
    batch, m, _, n = _operands(a, b)
    return (*batch, *((m,) if len(a) > 1 else ()), *((n,) if len(b) > 1 else ()))


def _check(inputs: Specs, attrs: Attrs) -> None:
    a, b = inputs
    if a.dtype != b.dtype:
        raise DtypeError("must have a's dtype", op=NAME, param="b",
                         expected=str(a.dtype).removeprefix("torch."),
                         got=str(b.dtype).removeprefix("torch."))
    if attrs["float32_out"] and a.dtype == torch.float64:
        raise DtypeError("float32_out would round float64 products", op=NAME, param="a",
                         expected="a 16-bit or float32 operand", got="float64")
    if not (is_unknown_rank(a.shape) or is_unknown_rank(b.shape)):
        _operands(a.shape, b.shape)


def _infer_shape(inputs: Specs, attrs: Attrs) -> list[tuple[int, ...]]:
    a, b = inputs
    if is_unknown_rank(a.shape) or is_unknown_rank(b.shape):
        return [UNKNOWN_RANK]
    return [_output_shape(a.shape, b.shape)]


def _infer_dtype(inputs: Specs, attrs: Attrs) -> list[torch.dtype]:
    return [torch.float32 if attrs["float32_out"] else inputs[0].dtype]


def _cost(inputs: Specs, outputs: Specs, attrs: Attrs) -> Cost:
    batch, m, k, n = _operands(inputs[0].shape, inputs[1].shape)
    count = math.prod(batch)
    return Cost(flops=2 * count * m * n * k,
                bytes_moved=inputs[0].itemsize * (inputs[0].numel + inputs[1].numel)
                + outputs[0].itemsize * count * m * n)


def _tiling(inputs: Specs, outputs: Specs, attrs: Attrs, hardware: HardwareProfile
            ) -> list[Tiling]:
    """Block sizes from the problem and the device: 128-wide output tiles for large
    problems, narrower ones for skinny M or N, ``BLOCK_K`` 64 for 16-bit inputs (32 for
    float32); ``stages`` buffers of both operand tiles must fit on chip. On CUDA, large
    16-bit products take the measured Hopper tiles first (`_hopper_tiles`), and the
    alternatives autotuning measures follow (`_tuning_alternatives`)."""
    batch, m, k, n = _operands(inputs[0].shape, inputs[1].shape)
    item = inputs[0].itemsize
    block_m = min(128, max(16, next_power_of_2(m)))
    block_n = min(128, max(16, next_power_of_2(n)))
    block_k = min(64 if item <= 2 else 32, max(16, next_power_of_2(k)))
    gpu = hardware.device_type == "cuda"
    candidates = []
    if gpu and item == 2 and (block_m, block_n, block_k) == (128, 128, 64):
        candidates += _hopper_tiles(m, n, math.prod(batch), hardware)
    for stages in ((4, 3, 2) if gpu else (1,)):
        onchip = (_gpu_shared_bytes((block_m, block_n, block_k), item, stages) if gpu else
                  (block_m + block_n) * block_k * item + block_m * block_n * 4)
        candidates.append(Tiling(
            "tiles", {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k},
            onchip, double_buffered=False,
            options={"warps": gpu_warps(block_m * block_n // 2, hardware) if gpu else None,
                     "stages": stages if gpu else None}))
    if gpu:
        candidates += _tuning_alternatives(m, k, n, item)
    # Smaller tiles for devices whose on-chip memory holds none of the above.
    while block_m > 16 or block_n > 16:
        block_m, block_n = max(16, block_m // 2), max(16, block_n // 2)
        candidates.append(Tiling(
            "tiles", {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k},
            (block_m + block_n) * block_k * item + block_m * block_n * 4,
            double_buffered=False))
    return candidates


# CUDA configurations for autotuning to measure after the rule's own (BLOCK_M, BLOCK_N,
# BLOCK_K, warps, stages): Hopper's two-warpgroup tiles and fewer warps; for products of at
# most 64 rows (decoding), narrow tiles; then for 16-bit operands the blocks by tensor
# descriptor, with and without a warp-specialized K loop (benchmarks/matmul_tuning.py
# sweeps the same configurations).
WIDE_ALTERNATIVES = ((128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (128, 128, 64, 8, 4),
                     (64, 128, 64, 4, 4))
SKINNY_ALTERNATIVES = ((16, 128, 128, 4, 4), (16, 256, 64, 4, 4))
DESCRIPTOR_ALTERNATIVES = ((128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (16, 128, 128, 4, 4))


def _hopper_tiles(m: int, n: int, count: int, hardware: HardwareProfile) -> list[Tiling]:
    """The first choices for large 16-bit products on CUDA, from the H200's autotuning
    (benchmarks/results/gpu_2026-12-01/): two warpgroups (8 warps) on 128 x 128 tiles beat
    16 warps (MlaProlog's 1024 x 8192 x 2048: 53.9 against 59.0 µs), and 128 x 256 tiles
    beat those when they still give every core two tiles (1024 x 2048 x 32768: 134 against
    165 µs; the 128 x 256 tiles of 1024 x 8192 x 2048 fill half the cores, 110 µs)."""
    tiles = [((128, 128, 64), 8, 4)]
    if cdiv(m, 128) * cdiv(n, 256) * count >= 2 * hardware.core_count:
        tiles.insert(0, ((128, 256, 64), 8, 3))
    return [_cuda_tiling("tiles", blocks, 2, warps, stages) for blocks, warps, stages in tiles]


def _cuda_tiling(variant: str, blocks: Sequence[int], item: int, warps: int, stages: int
                 ) -> Tiling:
    """A CUDA tiling of ``(BLOCK_M, BLOCK_N, BLOCK_K)`` with its launch options."""
    return Tiling(variant, dict(zip(("BLOCK_M", "BLOCK_N", "BLOCK_K"), blocks)),
                  _gpu_shared_bytes(blocks, item, stages), double_buffered=False,
                  options={"warps": warps, "stages": stages})


def _gpu_shared_bytes(blocks: Sequence[int], item: int, stages: int) -> int:
    """Shared memory of a CUDA tile: ``stages`` buffers of both operand blocks (the float32
    accumulator lives in registers)."""
    block_m, block_n, block_k = blocks
    return stages * (block_m + block_n) * block_k * item


def _tuning_alternatives(m: int, k: int, n: int, item: int) -> list[Tiling]:
    """The alternatives that suit the product, their blocks no larger than its padded
    dims."""
    def fitted(dim: int, block: int) -> int:
        return min(block, max(16, next_power_of_2(dim)))

    shapes = WIDE_ALTERNATIVES + (SKINNY_ALTERNATIVES if m <= 64 else ())
    configs = [("tiles", *shape) for shape in shapes]
    if item == 2:
        configs += [(variant, *shape) for variant in ("tiles_tma", "tiles_tma_ws")
                    for shape in DESCRIPTOR_ALTERNATIVES if shape[0] > 16 or m <= 64]
    return [_cuda_tiling(variant, (fitted(m, block_m), fitted(n, block_n), fitted(k, block_k)),
                         item, warps, stages)
            for variant, block_m, block_n, block_k, warps, stages in configs]


def _grid(tiling: Tiling, inputs: Specs, outputs: Specs, attrs: Attrs,
          hardware: HardwareProfile) -> tuple[int, ...]:
    """(programs over the output tiles, batch, K slices). When the output tiles of all
    batches leave most cores idle (a few rows against a wide weight: decoding), K is cut
    into slices of whole ``BLOCK_K`` steps (`work_splits`) whose float32 partials a second
    kernel sums."""
    batch, m, k, n = _operands(inputs[0].shape, inputs[1].shape)
    count = math.prod(batch)
    tiles = cdiv(m, tiling.blocks["BLOCK_M"]) * cdiv(n, tiling.blocks["BLOCK_N"])
    steps = cdiv(k, tiling.blocks["BLOCK_K"])
    # A tile's pipelined operands fill most of a core's shared memory, so slices run in
    # rounds of one program a core: they pay off while at least half the cores would idle.
    _, slices = split_steps(steps, work_splits(tiles * count, steps, hardware,
                                               busy_share=0.5))
    return max(1, min(tiles, MAX_PROGRAMS)), max(1, min(count, MAX_PROGRAMS)), slices


def _partials(grid: tuple[int, ...], inputs: Specs) -> int:
    """Float32 partial sums of split K: slices x batch x M x N (0 without slices)."""
    batch, m, _, n = _operands(inputs[0].shape, inputs[1].shape)
    return 0 if grid[2] == 1 else grid[2] * math.prod(batch) * m * n


def _workspace(tiling: Tiling, grid: tuple[int, ...], inputs: Specs, outputs: Specs,
               attrs: Attrs) -> int:
    return 4 * _partials(grid, inputs)


def _kernel_costs(tiling: Tiling, grid: tuple[int, ...], inputs: Specs, outputs: Specs,
                  attrs: Attrs) -> dict[str, Cost]:
    """The product kernel's cost, and with K slices the sum kernel's: the float32
    partials the first writes instead of the output, and the second reads back."""
    cost = _cost(inputs, outputs, attrs)
    partials = _partials(grid, inputs)
    if not partials:
        return {"_matmul_kernel": cost}
    written = outputs[0].numel * outputs[0].itemsize
    return {"_matmul_kernel": Cost(cost.flops, cost.bytes_moved - written + 4 * partials),
            "_sum_slices_kernel": Cost(partials, 4 * partials + written)}


def _samples(dtype: torch.dtype, device: torch.device, generator: torch.Generator
             ) -> list[Case]:
    def x(*shape: int) -> torch.Tensor:
        return random_input(shape, dtype, device, generator, scale=1.0)

    return [
        Case("33x17_17x9", (x(33, 17), x(17, 9))),
        Case("batch_broadcast", (x(2, 1, 5, 7), x(3, 7, 4))),
        Case("vector_vector", (x(65), x(65))),
        Case("matrix_vector", (x(9, 70), x(70))),
        Case("vector_batch", (x(12), x(3, 12, 5))),
        Case("k_1", (x(20, 1), x(1, 30))),
        Case("transposed", (x(40, 24).t(), x(40, 33))),
        Case("k_300", (x(17, 300), x(300, 130))),
        Case("tile_129x64x130", (x(129, 64), x(64, 130))),
        Case("zero_k", (x(4, 0), x(0, 6))),
        Case("zero_m", (x(0, 8), x(8, 6))),
        *([Case("float32_out_k_300", (x(17, 300), x(300, 130)), {"float32_out": True})]
          if dtype != torch.float64 else []),
    ]


def _sweep(kind: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
           generator: torch.Generator) -> list[Case]:
    """a drawn from the kind (its last dim is K: 65537 for long rows), b normal with 5
    columns."""
    a = generate(kind, shape, dtype, device=device, generator=generator)
    b = generate("normal", (a.shape[-1], 5), dtype, device=device, generator=generator)
    return [Case("", (a, b))]


def _abs_product_scale(opdef: OpDef, inputs: Sequence[torch.Tensor | None], attrs: Attrs,
                       golden: torch.Tensor, output: str) -> torch.Tensor:
    """|a| @ |b|: a dot product's rounding error is relative to its terms' magnitudes, not
    to the (possibly cancelled) result."""
    a, b = inputs
    return torch.matmul(a.abs(), b.abs()).reshape(golden.shape)


def _torch_matmul(a: torch.Tensor, b: torch.Tensor, allow_tf32: bool, float32_out: bool
                  ) -> torch.Tensor:
    """torch.matmul (of float32 operands for ``float32_out``)"""
    return torch.matmul(a.float(), b.float()) if float32_out else torch.matmul(a, b)


def _bench_case(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                generator: torch.Generator) -> Case:
    """Square products ``(n, n) @ (n, n)``: n is the shape's only size."""
    (n,) = shape
    return Case("", (generate("normal", (n, n), dtype, device=device, generator=generator),
                     generate("normal", (n, n), dtype, device=device, generator=generator)))


MATMUL = OpDef(
    name=NAME, doc="a @ b with torch.matmul's rules, float32 accumulation.",
    inputs=(TensorArg("a"), TensorArg("b")), outputs=(OutputArg("out"),),
    attrs=(Attr("allow_tf32", "bool", False, doc="float32 products in tf32 on GPUs"),
           Attr("float32_out", "bool", False,
                doc="the float32 accumulator as the result, unrounded")),
    infer_shape=_infer_shape, infer_dtype=_infer_dtype, check=_check, cost=_cost,
    tiling=_tiling, grid=_grid, workspace=_workspace, kernel_costs=_kernel_costs,
    samples=_samples, autocast=AutocastPolicy.LOWER,
    error_scale=_abs_product_scale,
    precision=PrecisionSpec("ulp", peer=_torch_matmul, sweep=_sweep, known_limitations=(
        KnownLimitation(
            "Dot products accumulate in float32: partial sums of products near float32's "
            "maximum overflow to Inf although the exact result is finite; torch.matmul's "
            "float32 accumulation overflows alike.", case="large_*", failures="*NaN/Inf*"),
    )),
    bench=BenchSpec(shapes=((2048,), (4096,), (8192,)), cpu_shapes=((256,), (512,), (1024,)),
                    case=_bench_case, metric="TFLOP/s"),
    strided_out=True)


# ---------------------------------------------------------------------------------------------
# Reference


@MATMUL.reference
def reference(a: torch.Tensor, b: torch.Tensor, *, compute_dtype: torch.dtype,
              allow_tf32: bool, float32_out: bool) -> torch.Tensor:
    """``torch.matmul`` in ``compute_dtype``; 16-bit products are summed in float64 even
    at float32 (the torch backend), so that they round to the output within its half-ulp:
    a float32 BLAS adds in the order its CPU kernel chooses, and on one CPU 0.3% of a
    63x1000 float16 product's cancelling elements missed the 1-ulp standard."""
    narrow = torch.promote_types(a.dtype, b.dtype).itemsize == 2
    wide = torch.float64 if narrow and compute_dtype == torch.float32 else compute_dtype
    return torch.matmul(a.to(wide), b.to(wide))


# ---------------------------------------------------------------------------------------------
# Kernel

if triton is not None:

    @triton.jit
    def _k_step(acc, a_src, b_src, first_m, first_n, start, k_end, M, N, stride_am,
                stride_ak, stride_bk, stride_bn, UPCAST: tl.constexpr,
                PRECISION: tl.constexpr, DESCRIPTORS: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """``acc`` + the product of the ``BLOCK_K`` columns of a and rows of b from
        ``start``: by tensor descriptor (TMA copies; the descriptors' bounds zero the rows
        past M, the columns past N and the K past its end, and K slices start on whole
        blocks, so no block reaches into the next slice) or by masked pointer loads."""
        if DESCRIPTORS:
            a = a_src.load([first_m, start])  # dot operand, kept in its dtype
            b = b_src.load([start, first_n])  # dot operand, kept in its dtype
            if UPCAST:
                a = widen(a)
                b = widen(b)
        else:
            rows = first_m + tl.arange(0, BLOCK_M)
            cols = first_n + tl.arange(0, BLOCK_N)
            ks = start + tl.arange(0, BLOCK_K)
            a = dot_operand(a_src + rows[:, None] * stride_am + ks[None, :] * stride_ak,
                            (rows < M)[:, None] & (ks < k_end)[None, :], UPCAST)
            b = dot_operand(b_src + ks[:, None] * stride_bk + cols[None, :] * stride_bn,
                            (ks < k_end)[:, None] & (cols < N)[None, :], UPCAST)
        return tl.dot(a, b, acc, input_precision=PRECISION)

    @triton.jit
    def _matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, K_SLICE, stride_ab, stride_am, stride_ak,
                       stride_bb, stride_bk, stride_bn, stride_cs, stride_cb, stride_cm,
                       stride_cn, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                       WIDE: tl.constexpr, DESCRIPTORS: tl.constexpr,
                       WARP_SPECIALIZE: tl.constexpr, GROUP: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Output tiles of batch ``program_id(1)`` over K slice ``program_id(2)`` (``K_SLICE``
        of K; all of it unsplit), into ``c_ptr`` through its strides: the output, or the
        float32 partials of the slices ``stride_cs`` apart. ``DESCRIPTORS``: operand
        blocks by tensor descriptor (rows of unit stride, checked by the launcher);
        ``WARP_SPECIALIZE`` asks Triton to split the K loop into producer (TMA copies) and
        consumer warps (the keyword exists only in Triton versions that have it, so the
        plain loop never names it)."""
        batch = tl.program_id(1)
        k_slice = tl.program_id(2)
        if WIDE:
            batch = batch.to(tl.int64)
            k_slice = k_slice.to(tl.int64)
        a_ptr += batch * stride_ab
        b_ptr += batch * stride_bb
        c_ptr += batch * stride_cb + k_slice * stride_cs
        a_src, b_src = descriptor_pair(a_ptr, M, K, stride_am, b_ptr, K, N, stride_bk,
                                       DESCRIPTORS, BLOCK_M, BLOCK_K, BLOCK_K, BLOCK_N)
        k_first = k_slice * K_SLICE
        k_end = tl.minimum(K, k_first + K_SLICE)
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_n = tl.cdiv(N, BLOCK_N)
        for tile in range(tl.program_id(0), tiles_m * tiles_n, tl.num_programs(0)):
            # Grouped order: GROUP rows of tiles share the b tiles they read.
            group_first = tile // (GROUP * tiles_n) * GROUP
            group_rows = tl.minimum(tiles_m - group_first, GROUP)
            tile_m = group_first + (tile % (GROUP * tiles_n)) % group_rows
            tile_n = (tile % (GROUP * tiles_n)) // group_rows
            first_m = tile_m * BLOCK_M
            first_n = tile_n * BLOCK_N
            if WIDE:
                first_m = first_m.to(tl.int64)
                first_n = first_n.to(tl.int64)
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            if WARP_SPECIALIZE:
                for start in tl.range(k_first, k_end, BLOCK_K, warp_specialize=True):
                    acc = _k_step(acc, a_src, b_src, first_m, first_n, start, k_end, M, N,
                                  stride_am, stride_ak, stride_bk, stride_bn, UPCAST,
                                  PRECISION, DESCRIPTORS, BLOCK_M, BLOCK_N, BLOCK_K)
            else:
                for start in range(k_first, k_end, BLOCK_K):
                    acc = _k_step(acc, a_src, b_src, first_m, first_n, start, k_end, M, N,
                                  stride_am, stride_ak, stride_bk, stride_bn, UPCAST,
                                  PRECISION, DESCRIPTORS, BLOCK_M, BLOCK_N, BLOCK_K)
            rows = first_m + tl.arange(0, BLOCK_M)
            cols = first_n + tl.arange(0, BLOCK_N)
            mask = (rows < M)[:, None] & (cols < N)[None, :]
            at = rows[:, None] * stride_cm + cols[None, :] * stride_cn
            tl.store(c_ptr + at, rounded_for(acc, c_ptr), mask=mask)

    @triton.jit
    def _sum_slices_kernel(partials_ptr, out_ptr, M, N, slices, stride_ps, stride_ob,
                           stride_om, stride_on, WIDE: tl.constexpr, BLOCK: tl.constexpr):
        """out[batch ``program_id(1)``] = the float32 sum of the K slices' partials
        (contiguous ``(slices, batch, M, N)``, ``stride_ps`` apart), in slice order
        (deterministic), rounded once to the output dtype, written through its strides."""
        batch = tl.program_id(1)
        if WIDE:
            batch = batch.to(tl.int64)
            stride_ps = stride_ps.to(tl.int64)
        partials_ptr += batch * M * N
        out_ptr += batch * stride_ob
        for block in range(tl.program_id(0), tl.cdiv(M * N, BLOCK), tl.num_programs(0)):
            if WIDE:
                first = block.to(tl.int64) * BLOCK
            else:
                first = block * BLOCK
            offsets = first + tl.arange(0, BLOCK)
            mask = offsets < M * N
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for k_slice in range(slices):
                acc += tl.load(partials_ptr + k_slice * stride_ps + offsets, mask=mask,
                               other=0.0)
            at = (offsets // N) * stride_om + (offsets % N) * stride_on
            tl.store(out_ptr + at, rounded_for(acc, out_ptr), mask=mask)


# ---------------------------------------------------------------------------------------------
# Launcher


def _batched(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both operands as ``(batch, rows, cols)`` over the broadcast batch: views with
    stride-0 batch dims where the layout allows, copies otherwise."""
    if a.ndim == b.ndim == 3 and a.shape[0] == b.shape[0]:
        return a, b  # one batch dim on both sides (per-head products): nothing to build
    a2 = a.unsqueeze(0) if a.ndim == 1 else a
    b2 = b.unsqueeze(-1) if b.ndim == 1 else b
    batch, m, k, n = _operands(tuple(a.shape), tuple(b.shape))
    count = math.prod(batch)
    return (a2.expand(*batch, m, k).reshape(count, m, k),
            b2.expand(*batch, k, n).reshape(count, k, n))


# Variants: (operand blocks by tensor descriptor, warp-specialized K loop). Without
# autotuning the tiling's first choice is "tiles"; the descriptor variants are among the
# alternatives autotuning measures.
VARIANTS = {"tiles": (False, False), "tiles_tma": (True, False), "tiles_tma_ws": (True, True)}


def _batched_out(out: torch.Tensor, count: int, m: int, n: int) -> tuple[torch.Tensor, bool]:
    """(``out`` as ``(batch, M, N)``, whether it must be copied back): a view when its
    strides allow (any layout of a 3-D output), else a contiguous buffer."""
    try:
        return out.view(count, m, n), False
    except RuntimeError:  # batch dims whose strides do not merge
        return torch.empty((count, m, n), dtype=out.dtype, device=out.device), True


@MATMUL.launcher("triton")
def launch(plan: object, inputs: Sequence[torch.Tensor | None],
           outputs: Sequence[torch.Tensor], workspace: torch.Tensor | None) -> None:
    """One program per output tile (persistently), ``program_id(1)`` the batch index,
    ``program_id(2)`` the K slice; batches past the grid limit are launched in chunks. With
    K slices, the products write float32 partials to the workspace and a second kernel
    sums them into the output. The output is written through its strides (``out=`` may
    be a transposed view)."""
    out = outputs[0]
    if inputs[0].ndim == 2 and inputs[1].ndim == 2:
        # No batch: the operands as they are, with a batch stride of 0 (no views to build:
        # host time per call).
        a, b = inputs[0], inputs[1]
        count, (m, k), n = 1, a.shape, b.shape[1]
        strides = (0, *a.stride(), 0, *b.stride())
        target, copy_back = out, False
        out_strides = (0, *out.stride())
    else:
        a, b = _batched(inputs[0], inputs[1])
        count, m, k = a.shape
        n = b.shape[-1]
        strides = (*a.stride(), *b.stride())
        target, copy_back = _batched_out(out, count, m, n)
        out_strides = target.stride()
    if k == 0:
        out.zero_()
        return
    slices = plan.grid[2]
    block_k = plan.tiling.blocks["BLOCK_K"]
    k_per_slice = split_steps(cdiv(k, block_k), slices)[0] * block_k
    wide = wide_offsets(a, b, target) or slices * target.numel() > INT32_LIMIT
    descriptors, warp_specialize = VARIANTS[plan.tiling.variant]
    # Descriptors serve the tensor cores' 16-bit operands (float32's IEEE products compiled
    # for sm_90 with them spill 5 KB); their coordinates are int32, so tensors past that
    # take the pointer kernel too.
    if descriptors and (wide or a.element_size() != 2 or not descriptors_usable(a, b)):
        descriptors = warp_specialize = False
    if descriptors:
        use_scratch_allocator(a.device)
    options = {"UPCAST": backends.interpreter_enabled(),
               "PRECISION": plan.hardware.reduced_fp32_dot if plan.attrs["allow_tf32"]
               and a.dtype == torch.float32 else "ieee", "WIDE": wide, "DESCRIPTORS": descriptors,
               "WARP_SPECIALIZE": warp_specialize, "GROUP": GROUP_M,
               **plan.tiling.blocks, **launch_options(plan.tiling)}
    if slices > 1:
        # Slices are chosen only while the tiles of all batches leave cores idle, so the
        # batch fits one launch.
        total = count * m * n
        partials = workspace.view(torch.float32)[: slices * total]
        _matmul_kernel[(plan.grid[0], count, slices)](
            a, b, partials, m, n, k, k_per_slice, *strides, total, m * n, n, 1, **options)
        _sum_slices_kernel[(persistent_grid(cdiv(m * n, SUM_BLOCK), plan.hardware), count)](
            partials, target, m, n, slices, total, *out_strides, WIDE=wide, BLOCK=SUM_BLOCK)
    elif count <= MAX_PROGRAMS:
        _matmul_kernel[(plan.grid[0], count, 1)](a, b, target, m, n, k, k, *strides, 0,
                                                 *out_strides, **options)
    else:
        for start in range(0, count, MAX_PROGRAMS):
            chunk = slice(start, min(count, start + MAX_PROGRAMS))
            _matmul_kernel[(plan.grid[0], chunk.stop - start, 1)](
                a[chunk], b[chunk], target[chunk], m, n, k, k, *strides, 0, *out_strides,
                **options)
    if copy_back:
        out.copy_(target.view(out.shape))


# ---------------------------------------------------------------------------------------------
# Backward


def _setup_context(ctx: object, inputs: tuple[object, ...], output: torch.Tensor) -> None:
    a, b, allow_tf32, _ = inputs
    ctx.save_for_backward(a, b)
    ctx.allow_tf32 = allow_tf32


@MATMUL.autograd(_setup_context)
def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """grad_a = grad @ b^T and grad_b = a^T @ grad through this operator, summed over the
    dims each operand was broadcast along (1-D operands promoted and squeezed back)."""
    a, b = ctx.saved_tensors
    a2 = a.unsqueeze(0) if a.ndim == 1 else a
    b2 = b.unsqueeze(-1) if b.ndim == 1 else b
    batch, m, _, n = _operands(tuple(a.shape), tuple(b.shape))
    # A float32_out result's gradient is rounded to the operands' dtype once.
    grad2 = grad.reshape(*batch, m, n).to(a.dtype)
    grad_a = grad_b = None
    if ctx.needs_input_grad[0]:
        full = MATMUL(grad2, b2.mT, ctx.allow_tf32)
        grad_a = sum_to_shape(full, tuple(a2.shape), a.dtype).reshape(a.shape)
    if ctx.needs_input_grad[1]:
        full = MATMUL(a2.mT, grad2, ctx.allow_tf32)
        grad_b = sum_to_shape(full, tuple(b2.shape), b.dtype).reshape(b.shape)
    return grad_a, grad_b, None, None


register_op(MATMUL)


@MATMUL.exported
def matmul(a: torch.Tensor, b: torch.Tensor, *, allow_tf32: bool = False,
           float32_out: bool = False) -> torch.Tensor:
    """``a @ b`` with ``torch.matmul``'s rules (1-D operands promoted and the added dim
    dropped, batch dims broadcast), float32 accumulation, output in the operands' dtype,
    or with ``float32_out=True`` the float32 accumulator unrounded (16-bit or float32
    operands: products to be summed further without a rounding each). float32 products
    use tf32 on GPUs only with ``allow_tf32=True``.

    Raises:
        ShapeError: a 0-d operand, mismatched inner dims, or batch dims that do not
            broadcast. DtypeError: operands of different or unsupported dtypes, or
            float64 operands with ``float32_out``.
    """
    return MATMUL(a, b, allow_tf32, float32_out)
