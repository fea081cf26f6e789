"""Softmax and LogSoftmax over one dim, and their gradients.

``softmax(x, dim) = exp(x - max) / sum(exp(x - max))`` and ``log_softmax(x, dim) =
x - max - log(sum(exp(x - max)))``, as ``torch.softmax``/``torch.log_softmax`` and CANN's
SoftmaxV2/LogSoftmaxV2: the row max is subtracted, so no ``exp`` overflows, and the
statistics (max, sum) are float32 whatever the storage dtype. Rows that are entirely
``-inf`` give NaN, as torch does (0/0); a NaN anywhere in a row makes the row NaN.

The rows are the other dims flattened; ``dim`` is moved last (a copy unless it already is,
or the tensor is 2-D). Two variants, chosen by the tiling from the row length and the
`HardwareProfile`:

``rows``   a row fits on chip: each program loads ``BLOCK_M`` whole rows once, reduces and
           writes (one read, one write).
``split``  long rows (up to 2^31 columns): each row is cut into ``splits`` chunks of
           ``BLOCK_N``-column blocks. Pass 1 keeps a running (max, sum) per chunk,
           rescaling the sum whenever the max grows (the online softmax), and writes it to
           the workspace; pass 2 merges a row's chunk statistics in a fixed order and
           writes the chunk's outputs (two reads, one write). Splitting a row over several
           programs keeps the device busy when there are few rows.

The gradients take the forward output ``y``: ``softmax_backward(grad, y, dim) =
y * (grad - sum(grad * y))`` and ``log_softmax_backward(grad, y, dim) =
grad - exp(y) * sum(grad)``, with the row sums in float32 and the same two variants (the
split one reduces per-chunk partial sums through the workspace, deterministically).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from opforge.core.hardware import HardwareProfile
from opforge.core.opdef import (
    Attr,
    Attrs,
    AutocastPolicy,
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
from opforge.core.shapes import UNKNOWN_RANK, is_unknown_rank, normalize_dim
from opforge.core.tiling import (
    INT32_LIMIT,
    MAX_PROGRAMS,
    PROGRAMS_PER_CORE,
    VALUES_PER_THREAD,
    cdiv,
    gpu_warps,
    launch_options,
    next_power_of_2,
    one_row_values_per_thread,
)
from opforge.library import register_op
from opforge.ops._elementwise import random_input, same_dtype, same_shape_pair
from opforge.ops._liger import liger_peer
from opforge.ops._rows import OVERFLOWING_ROW_SUM, SHARED_ROW_STATISTIC
from opforge.precision.cases import generate

try:
    import triton
    import triton.language as tl

    from opforge.ops._math import finite_shift, rounded_for, widen
except ImportError:  # pragma: no cover
    triton = None

DIM = Attr("dim", "int", -1, doc="the dim to normalise over")
# Elements of one block of the split variant, and of a rows-variant tile of short rows.
SPLIT_BLOCK = 4096
ROWS_TILE = 4096
# Chunk statistics of one row are merged as one block: at most this many chunks.
MAX_SPLITS = 1024


def _dim(inputs: Specs, attrs: Attrs, op: str) -> int:
    return normalize_dim(attrs["dim"], max(len(inputs[0].shape), 1), op=op, param="dim")


def _rows_and_cols(spec: object, dim: int) -> tuple[int, int]:
    shape = tuple(spec.shape) or (1,)
    cols = shape[dim]
    return (math.prod(shape) // cols if cols else 0), cols


def _check(op: str, paired: bool = False) -> Callable[[Specs, Attrs], None]:
    """The dim is in range; a gradient has its forward output's shape."""
    same_shape = same_shape_pair(op, ("grad", "y"))

    def check(inputs: Specs, attrs: Attrs) -> None:
        if paired:
            same_shape(inputs, attrs)
        if not is_unknown_rank(inputs[0].shape):
            _dim(inputs, attrs, op)
    return check


def _infer_shape(inputs: Specs, attrs: Attrs) -> list[tuple[int, ...]]:
    shape = inputs[0].shape
    return [UNKNOWN_RANK if is_unknown_rank(shape) else tuple(shape)]


def _cost(exps_per_element: int, reads: int) -> Callable[..., object]:
    def cost(inputs: Specs, outputs: Specs, attrs: Attrs) -> Cost:
        count = outputs[0].numel
        read = sum(spec.numel * spec.itemsize for spec in inputs[:reads])
        return Cost(flops=(4 + exps_per_element) * count,
                    bytes_moved=read + count * outputs[0].itemsize)
    return cost


def _kernel_costs(op: str, reads: int, backward: bool) -> Callable[..., dict[str, Cost]]:
    """The split variant's two kernels (the rows variant is one): the first reads the
    inputs and writes each chunk's float32 statistics (max and sum; the backward's one sum),
    the second reads the inputs again with the merged statistics and writes the output.
    Per element, the forward's first kernel takes a max, a subtraction, an exponential and
    a sum, its second a subtraction, an exponential (softmax) and a division; the
    backward's take a product and a sum, then a subtraction and a product."""
    first, second = (("_softmax_backward_chunk_sums_kernel",
                      "_softmax_backward_chunk_write_kernel") if backward else
                     ("_softmax_chunk_stats_kernel", "_softmax_chunk_write_kernel"))

    def costs(tiling: Tiling, grid: tuple[int, ...], inputs: Specs, outputs: Specs,
              attrs: Attrs) -> dict[str, Cost]:
        if tiling.variant == "rows":
            return {}
        rows, _ = _rows_and_cols(inputs[0], _dim(inputs, attrs, op))
        count = outputs[0].numel
        read = sum(spec.numel * spec.itemsize for spec in inputs[:reads])
        partials = rows * grid[1] * (4 if backward else 8)
        return {first: Cost(flops=(2 if backward else 4) * count, bytes_moved=read + partials),
                second: Cost(flops=(2 if backward else 3) * count,
                             bytes_moved=read + partials + count * outputs[0].itemsize)}
    return costs


def _tiling(op: str, streams: int, one_row: int | None = None) -> Callable[..., object]:
    """Candidates: the rows variant when a row fits on chip, else the split variant.
    ``streams``: tensors a program holds per element (inputs read plus the float32
    working copy); ``one_row``: values a thread of a one-row tile
    (`tiling.one_row_values_per_thread`)."""
    def tiling(inputs: Specs, outputs: Specs, attrs: Attrs, hardware: HardwareProfile
               ) -> list[Tiling]:
        x = inputs[0]
        dim = _dim(inputs, attrs, op)
        rows, cols = _rows_and_cols(x, dim)
        per_element = streams * x.itemsize + 4
        block_n = next_power_of_2(max(cols, 1))
        block_m = max(1, min(next_power_of_2(max(rows, 1)), ROWS_TILE // block_n))
        candidates = [Tiling("rows", {"BLOCK_M": block_m, "BLOCK_N": block_n},
                             block_m * block_n * per_element, double_buffered=False,
                             options={"warps": gpu_warps(
                                 block_m * block_n, hardware,
                                 one_row_values_per_thread(block_m, block_n,
                                                           VALUES_PER_THREAD, one_row))})]
        block = min(SPLIT_BLOCK, hardware.max_tile_elements, block_n)
        while block >= 16:
            chunks = cdiv(cols, block)
            target = hardware.core_count * PROGRAMS_PER_CORE
            splits = max(1, min(chunks, MAX_SPLITS, cdiv(target, max(rows, 1))))
            candidates.append(Tiling("split", {"BLOCK_N": block}, block * per_element,
                                     options={"splits": splits,
                                              "warps": gpu_warps(block, hardware)}))
            block //= 2
        return candidates
    return tiling


def _grid(op: str) -> Callable[..., object]:
    def grid(tiling: Tiling, inputs: Specs, outputs: Specs, attrs: Attrs,
             hardware: HardwareProfile) -> tuple[int, ...]:
        rows, cols = _rows_and_cols(inputs[0], _dim(inputs, attrs, op))
        if tiling.variant == "rows":
            return (max(1, min(cdiv(rows, tiling.blocks["BLOCK_M"]), MAX_PROGRAMS)),)
        splits = max(1, min(tiling.options["splits"], cdiv(cols, tiling.blocks["BLOCK_N"])))
        return (max(1, min(rows, MAX_PROGRAMS // splits)), splits)
    return grid


def _workspace(op: str, per_chunk: int) -> Callable[..., object]:
    def workspace(tiling: Tiling, grid: tuple[int, ...], inputs: Specs, outputs: Specs,
                  attrs: Attrs) -> int:
        if tiling.variant == "rows":
            return 0
        rows, _ = _rows_and_cols(inputs[0], _dim(inputs, attrs, op))
        return 4 * per_chunk * rows * grid[1]
    return workspace


def _samples(dtype: torch.dtype, device: torch.device, generator: torch.Generator
             ) -> list[Case]:
    def x(*shape: int, scale: float = 3.0) -> torch.Tensor:
        return random_input(shape, dtype, device, generator, scale=scale)

    big = float(min(1e4, torch.finfo(dtype).max / 8))
    mixed = x(7, 1000, scale=1.0)
    mixed[:, 0::2] += big
    mixed[:, 1::2] -= big
    masked = x(5, 33)
    masked[0] = float("-inf")
    masked[1, 10:] = float("-inf")
    special = torch.tensor([[0.0, 1.0, float("inf"), 2.0], [1.0, float("nan"), 0.0, -1.0],
                            [float("-inf")] * 4, [3.0, float("-inf"), 3.0, 3.0]])
    return [
        Case("rows_63x1000", (x(63, 1000),), {}),
        Case("around_1e4", (x(7, 1000, scale=1.0) + big,), {}),
        Case("mixed_+-1e4", (mixed,), {}),
        Case("masked_rows", (masked,), {}),
        Case("special", (special.to(dtype=dtype, device=device),), {}),
        Case("dim0_33x17", (x(33, 17),), {"dim": 0}),
        Case("middle_dim_4x7x33", (x(4, 7, 33),), {"dim": 1}),
        Case("transposed", (x(33, 17).t(),), {}),
        Case("wide_rows_3x8192", (x(3, 8192),), {}),
        Case("long_row_70000", (x(2, 70000),), {}),
        Case("one_column", (x(9, 1),), {}),
        Case("scalar", (x(),), {}),
        Case("zero_size", (x(0, 5),), {}),
    ]


def _sweep(kind: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
           generator: torch.Generator) -> list[Case]:
    """Over the last dim and, for 2-D and up, the first."""
    x = generate(kind, shape, dtype, device=device, generator=generator)
    cases = [Case("last", (x,), {})]
    if x.ndim > 1:
        cases.append(Case("first", (x,), {"dim": 0}))
    return cases


def _backward_samples(dtype: torch.dtype, device: torch.device, generator: torch.Generator
                      ) -> list[Case]:
    def pair(*shape: int, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
        grad = random_input(shape, dtype, device, generator, scale=1.0)
        logits = random_input(shape, torch.float32, device, generator)
        return grad, torch.softmax(logits, dim).to(dtype)

    return [Case("rows_63x1000", pair(63, 1000)), Case("dim0_33x17", pair(33, 17, dim=0),
                                                       {"dim": 0}),
            Case("long_row_70000", pair(2, 70000)), Case("zero_size", pair(0, 5))]


def _log_backward_samples(dtype: torch.dtype, device: torch.device,
                          generator: torch.Generator) -> list[Case]:
    return [Case(case.name, (case.inputs[0], case.inputs[1].float().log().to(dtype)),
                 case.attrs)
            for case in _backward_samples(dtype, device, generator)]


def _backward_sweep(log: bool) -> Callable[..., object]:
    def sweep(kind: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
              generator: torch.Generator) -> list[Case]:
        """The gradient drawn from the kind; y the (log-)softmax of a draw of the kind."""
        grad = generate(kind, shape, dtype, device=device, generator=generator)
        logits = generate(kind, shape, torch.float64, device=device, generator=generator)
        y = (torch.log_softmax if log else torch.softmax)(logits, -1).to(dtype)
        return [Case("", (grad, y))]
    return sweep


def _softmax_scale(log: bool) -> Callable[..., object]:
    def scale(opdef: OpDef, inputs: Sequence[torch.Tensor | None], attrs: Attrs,
              golden: torch.Tensor, output: str) -> torch.Tensor:
        """Rounding z = x - max and the sum at float32 moves y by eps |z| relative
        (softmax), or by eps (|z| + |log sum| + 1) absolute (log_softmax: the sum's own
        rounding is an absolute error of eps in its log)."""
        x = inputs[0]
        if x.ndim == 0 or not x.numel():
            return golden.abs()
        dim = normalize_dim(attrs["dim"], x.ndim)
        shifted = x - x.amax(dim, keepdim=True)
        if log:
            log_sum = (shifted - golden).abs()
            return (golden.abs() + shifted.abs() + log_sum + 1.0).nan_to_num(0.0, 0.0, 0.0)
        return golden.abs() * (1.0 + shifted.abs().nan_to_num(0.0, 0.0, 0.0))
    return scale


def _gradient_scale(log: bool) -> Callable[..., object]:
    def scale(opdef: OpDef, inputs: Sequence[torch.Tensor | None], attrs: Attrs,
              golden: torch.Tensor, output: str) -> torch.Tensor:
        """The row sum cancels: its float32 error is eps sum|terms|, which reaches dx as
        y eps (|grad| + sum|grad y|) (softmax) or eps (|grad| + exp(y) sum|grad|)."""
        grad, y = inputs[0], inputs[1]
        if y.ndim == 0 or not y.numel():
            return golden.abs()
        dim = normalize_dim(attrs["dim"], y.ndim)
        if log:
            spread = grad.abs() + torch.exp(y) * grad.abs().sum(dim, keepdim=True)
        else:
            spread = y.abs() * (grad.abs() + (grad * y).abs().sum(dim, keepdim=True))
        return golden.abs() + spread.nan_to_num(0.0, 0.0, 0.0)
    return scale


def _torch_softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """torch.softmax"""
    return torch.softmax(x, dim)


def _torch_log_softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """torch.log_softmax"""
    return torch.log_softmax(x, dim)


def _torch_softmax_backward(grad: torch.Tensor, y: torch.Tensor, dim: int) -> torch.Tensor:
    """torch.ops.aten._softmax_backward_data"""
    return torch.ops.aten._softmax_backward_data(grad, y, dim, y.dtype)


def _torch_log_softmax_backward(grad: torch.Tensor, y: torch.Tensor, dim: int
                                ) -> torch.Tensor:
    """torch.ops.aten._log_softmax_backward_data"""
    return torch.ops.aten._log_softmax_backward_data(grad, y, dim, y.dtype)



def _forward_opdef(name: str, log: bool, doc: str, peer: Callable[..., torch.Tensor],
                   bench: BenchSpec) -> OpDef:
    return OpDef(
        name=name, doc=doc, inputs=(TensorArg("x"),), outputs=(OutputArg("out"),),
        attrs=(DIM,), infer_shape=_infer_shape, infer_dtype=same_dtype, check=_check(name),
        cost=_cost(1, 1), tiling=_tiling(name, 1), grid=_grid(name),
        workspace=_workspace(name, 2), kernel_costs=_kernel_costs(name, 1, backward=False),
        samples=_samples, autocast=AutocastPolicy.FP32,
        error_scale=_softmax_scale(log),
        precision=PrecisionSpec("benchmark_ratio", "L0", peer, sweep=_sweep,
                                known_limitations=(SHARED_ROW_STATISTIC,)), bench=bench,
        inplace_out=True)


# NOTE: H200, bf16 8192 x 8192 (results/gpu_2026-12-04, kernel_breakdown run 2): the
# backward's one-row tile took 94.8 µs at 8 warps, 32 values a thread, against 104.7 at
# 16; the forward's was faster at 16 (79.6 against 82.1).
BACKWARD_ONE_ROW_VALUES_PER_THREAD = 32


def _backward_opdef(name: str, log: bool, doc: str, peer: Callable[..., torch.Tensor],
                    samples: Callable[..., list[Case]]) -> OpDef:
    return OpDef(
        name=name, doc=doc, inputs=(TensorArg("grad"), TensorArg("y")),
        outputs=(OutputArg("grad_x"),), attrs=(DIM,), infer_shape=_infer_shape,
        infer_dtype=same_dtype,
        check=_check(name, paired=True),
        cost=_cost(int(log), 2),
        tiling=_tiling(name, 2, one_row=BACKWARD_ONE_ROW_VALUES_PER_THREAD), grid=_grid(name),
        workspace=_workspace(name, 1), kernel_costs=_kernel_costs(name, 2, backward=True),
        samples=samples, error_scale=_gradient_scale(log),
        precision=PrecisionSpec("benchmark_ratio", "L0", peer, sweep=_backward_sweep(log),
                                known_limitations=(SHARED_ROW_STATISTIC,
                                                   OVERFLOWING_ROW_SUM)))


SOFTMAX = _forward_opdef("softmax", False, "exp(x - max) / sum(exp(x - max)) over dim, "
                         "float32 statistics.", _torch_softmax, BenchSpec(peers={
                             "Liger-Kernel": liger_peer("softmax", "LigerSoftmaxFunction",
                                                        lambda case: case.inputs[:1])}))
LOG_SOFTMAX = _forward_opdef("log_softmax", True, "x - max - log(sum(exp(x - max))) over "
                             "dim, float32 statistics.", _torch_log_softmax, BenchSpec())
SOFTMAX_BACKWARD = _backward_opdef("softmax_backward", False,
                                   "y * (grad - sum(grad * y)) from the softmax output y.",
                                   _torch_softmax_backward, _backward_samples)
LOG_SOFTMAX_BACKWARD = _backward_opdef("log_softmax_backward", True,
                                       "grad - exp(y) * sum(grad) from the log_softmax "
                                       "output y.", _torch_log_softmax_backward,
                                       _log_backward_samples)


# ---------------------------------------------------------------------------------------------
# References


def _reference(log: bool) -> Callable[..., object]:
    def reference(x: torch.Tensor, *, compute_dtype: torch.dtype, dim: int) -> torch.Tensor:
        """Max-subtracted (log-)softmax in ``compute_dtype``, the exponentials summed in
        float64: torch's float32 softmax adds a long non-last dim serially (1250 eps off
        over 10^5 elements, where the kernels are within 1)."""
        wide = x.to(compute_dtype)
        if wide.numel() == 0:
            return (torch.log_softmax if log else torch.softmax)(wide, dim)
        shifted = wide - wide.amax(dim, keepdim=True)
        exps = torch.exp(shifted)
        total = exps.sum(dim, keepdim=True, dtype=torch.float64)
        if log:
            return shifted - torch.log(total).to(compute_dtype)
        return exps / total.to(compute_dtype)
    return reference


def _backward_reference(log: bool) -> Callable[..., object]:
    def reference(grad: torch.Tensor, y: torch.Tensor, *, compute_dtype: torch.dtype,
                  dim: int) -> torch.Tensor:
        """The gradient formula in ``compute_dtype``."""
        grad, y = grad.to(compute_dtype), y.to(compute_dtype)
        if y.ndim == 0:
            return grad - torch.exp(y) * grad if log else y * (grad - grad * y)
        if log:
            return grad - torch.exp(y) * grad.sum(dim, keepdim=True)
        return y * (grad - (grad * y).sum(dim, keepdim=True))
    return reference


SOFTMAX.reference(_reference(False))
LOG_SOFTMAX.reference(_reference(True))
SOFTMAX_BACKWARD.reference(_backward_reference(False))
LOG_SOFTMAX_BACKWARD.reference(_backward_reference(True))


# ---------------------------------------------------------------------------------------------
# Kernels

if triton is not None:
    @triton.jit
    def _block_offsets(block, cols, N, WIDE: tl.constexpr, BLOCK_N: tl.constexpr):
        """(column offsets, in-row mask) of one BLOCK_N block of a row."""
        offsets = block * BLOCK_N + cols
        if WIDE:
            offsets = offsets.to(tl.int64)
        return offsets, offsets < N

    @triton.jit
    def _softmax_rows_kernel(x_ptr, out_ptr, M, N, stride_xm, stride_xn,
                             LOG: tl.constexpr, WIDE: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < N
        for block in range(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.num_programs(0)):
            rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
            if WIDE:
                rows = rows.to(tl.int64)
            mask = (rows < M)[:, None] & col_mask[None, :]
            x = widen(tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xn,
                              mask=mask, other=float("-inf")))
            shift = finite_shift(tl.max(x, axis=1))
            z = x - shift[:, None]
            e = tl.exp(z)
            total = tl.sum(tl.where(mask, e, 0.0), axis=1)
            if LOG:
                y = z - tl.log(total)[:, None]
            else:
                y = e / total[:, None]
            tl.store(out_ptr + rows[:, None] * N + cols[None, :], rounded_for(y, out_ptr),
                     mask=mask)

    @triton.jit
    def _softmax_chunk_stats_kernel(x_ptr, partial_ptr, M, N, stride_xm, stride_xn,
                                    blocks_per_split, WIDE: tl.constexpr,
                                    BLOCK_N: tl.constexpr):
        split = tl.program_id(1)
        splits = tl.num_programs(1)
        cols = tl.arange(0, BLOCK_N)
        for row in range(tl.program_id(0), M, tl.num_programs(0)):
            if WIDE:
                row = row.to(tl.int64)
            running_max = float("-inf")
            running_sum = 0.0
            first = split * blocks_per_split
            for block in range(first, first + blocks_per_split):
                offsets, mask = _block_offsets(block, cols, N, WIDE, BLOCK_N)
                x = widen(tl.load(x_ptr + row * stride_xm + offsets * stride_xn,
                                  mask=mask, other=float("-inf")))
                new_max = tl.maximum(running_max, tl.max(x, axis=0))
                shift = finite_shift(new_max)
                # The online softmax: the sum so far was taken against the old max.
                running_sum = (running_sum * tl.exp(running_max - shift)
                               + tl.sum(tl.exp(x - shift), axis=0))
                running_max = new_max
            slot = (row * splits + split) * 2
            tl.store(partial_ptr + slot, running_max)
            tl.store(partial_ptr + slot + 1, running_sum)

    @triton.jit
    def _merged_stats(partial_ptr, row, splits, SPLITS_BLOCK: tl.constexpr):
        """(shift, total) of a row from its chunks' (max, sum), merged in a fixed order."""
        index = tl.arange(0, SPLITS_BLOCK)
        present = index < splits
        row_partials = partial_ptr + (row * splits + index) * 2
        maxima = tl.load(row_partials, mask=present, other=float("-inf"))
        sums = tl.load(row_partials + 1, mask=present, other=0.0)
        shift = finite_shift(tl.max(maxima, axis=0))
        total = tl.sum(sums * tl.exp(maxima - shift), axis=0)
        return shift, total

    @triton.jit
    def _softmax_chunk_write_kernel(x_ptr, out_ptr, partial_ptr, M, N, stride_xm, stride_xn,
                                    blocks_per_split, LOG: tl.constexpr,
                                    WIDE: tl.constexpr, BLOCK_N: tl.constexpr,
                                    SPLITS_BLOCK: tl.constexpr):
        split = tl.program_id(1)
        splits = tl.num_programs(1)
        cols = tl.arange(0, BLOCK_N)
        for row in range(tl.program_id(0), M, tl.num_programs(0)):
            if WIDE:
                row = row.to(tl.int64)
            shift, total = _merged_stats(partial_ptr, row, splits, SPLITS_BLOCK)
            log_total = tl.log(total)
            first = split * blocks_per_split
            for block in range(first, first + blocks_per_split):
                offsets, mask = _block_offsets(block, cols, N, WIDE, BLOCK_N)
                x = widen(tl.load(x_ptr + row * stride_xm + offsets * stride_xn, mask=mask,
                                  other=float("-inf")))
                if LOG:
                    y = (x - shift) - log_total
                else:
                    y = tl.exp(x - shift) / total
                tl.store(out_ptr + row * N + offsets, rounded_for(y, out_ptr), mask=mask)

    @triton.jit
    def _row_term(grad, y, LOG: tl.constexpr):
        # What the backward sums over a row: grad * y (softmax) or grad (log_softmax).
        if LOG:
            return grad
        else:
            return grad * y

    @triton.jit
    def _grad_input(grad, y, total, LOG: tl.constexpr):
        if LOG:
            return grad - tl.exp(y) * total
        else:
            return y * (grad - total)

    @triton.jit
    def _softmax_backward_rows_kernel(grad_ptr, y_ptr, out_ptr, M, N, stride_gm, stride_gn,
                                      stride_ym, stride_yn, LOG: tl.constexpr,
                                      WIDE: tl.constexpr, BLOCK_M: tl.constexpr,
                                      BLOCK_N: tl.constexpr):
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < N
        for block in range(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.num_programs(0)):
            rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
            if WIDE:
                rows = rows.to(tl.int64)
            mask = (rows < M)[:, None] & col_mask[None, :]
            grad = widen(tl.load(grad_ptr + rows[:, None] * stride_gm
                                 + cols[None, :] * stride_gn, mask=mask, other=0.0))
            y = widen(tl.load(y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn,
                              mask=mask, other=0.0))
            total = tl.sum(_row_term(grad, y, LOG), axis=1)
            dx = _grad_input(grad, y, total[:, None], LOG)
            tl.store(out_ptr + rows[:, None] * N + cols[None, :], rounded_for(dx, out_ptr),
                     mask=mask)

    @triton.jit
    def _gradient_block(grad_ptr, y_ptr, row, offsets, mask, stride_gm, stride_gn, stride_ym,
                        stride_yn):
        """(grad, y) of one block of a row, in float32."""
        grad = widen(tl.load(grad_ptr + row * stride_gm + offsets * stride_gn, mask=mask,
                             other=0.0))
        y = widen(tl.load(y_ptr + row * stride_ym + offsets * stride_yn, mask=mask, other=0.0))
        return grad, y

    @triton.jit
    def _softmax_backward_chunk_sums_kernel(grad_ptr, y_ptr, partial_ptr, M, N, stride_gm,
                                            stride_gn, stride_ym, stride_yn,
                                            blocks_per_split, LOG: tl.constexpr,
                                            WIDE: tl.constexpr, BLOCK_N: tl.constexpr):
        split = tl.program_id(1)
        splits = tl.num_programs(1)
        cols = tl.arange(0, BLOCK_N)
        for row in range(tl.program_id(0), M, tl.num_programs(0)):
            if WIDE:
                row = row.to(tl.int64)
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            first = split * blocks_per_split
            for block in range(first, first + blocks_per_split):
                offsets, mask = _block_offsets(block, cols, N, WIDE, BLOCK_N)
                grad, y = _gradient_block(grad_ptr, y_ptr, row, offsets, mask, stride_gm,
                                          stride_gn, stride_ym, stride_yn)
                acc += _row_term(grad, y, LOG)
            tl.store(partial_ptr + row * splits + split, tl.sum(acc, axis=0))

    @triton.jit
    def _softmax_backward_chunk_write_kernel(grad_ptr, y_ptr, out_ptr, partial_ptr, M, N,
                                             stride_gm, stride_gn, stride_ym, stride_yn,
                                             blocks_per_split, LOG: tl.constexpr,
                                             WIDE: tl.constexpr, BLOCK_N: tl.constexpr,
                                             SPLITS_BLOCK: tl.constexpr):
        split = tl.program_id(1)
        splits = tl.num_programs(1)
        cols = tl.arange(0, BLOCK_N)
        index = tl.arange(0, SPLITS_BLOCK)
        for row in range(tl.program_id(0), M, tl.num_programs(0)):
            if WIDE:
                row = row.to(tl.int64)
            total = tl.sum(tl.load(partial_ptr + row * splits + index, mask=index < splits,
                                   other=0.0), axis=0)
            first = split * blocks_per_split
            for block in range(first, first + blocks_per_split):
                offsets, mask = _block_offsets(block, cols, N, WIDE, BLOCK_N)
                grad, y = _gradient_block(grad_ptr, y_ptr, row, offsets, mask, stride_gm,
                                          stride_gn, stride_ym, stride_yn)
                dx = _grad_input(grad, y, total, LOG)
                tl.store(out_ptr + row * N + offsets, rounded_for(dx, out_ptr), mask=mask)


# ---------------------------------------------------------------------------------------------
# Launchers


def _as_rows(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """``tensor`` as ``(rows, cols)`` with ``dim`` last: a view when the layout allows."""
    if tensor.ndim == 0:
        return tensor.reshape(1, 1)
    moved = tensor if dim == tensor.ndim - 1 else tensor.movedim(dim, -1)
    return moved.reshape(-1, moved.shape[-1])


def _launch(plan: object, inputs: Sequence[torch.Tensor], out: torch.Tensor,
            workspace: torch.Tensor | None, log: bool, backward: bool) -> None:
    """Both variants of both directions: ``inputs`` is ``(x,)`` or ``(grad, y)``."""
    dim = normalize_dim(plan.attrs["dim"], max(out.ndim, 1))
    matrices = [_as_rows(t, dim) for t in inputs]
    rows, cols = matrices[0].shape
    # The kernels write contiguous rows: straight into ``out`` when dim is its last, else
    # into a buffer of the moved shape that is copied back.
    direct = out.ndim <= 1 or (dim == out.ndim - 1 and out.is_contiguous())
    moved = out if direct else torch.empty(out.movedim(dim, -1).shape, dtype=out.dtype,
                                           device=out.device)
    strides = [s for m in matrices for s in m.stride()]
    reach = max((rows - 1) * abs(m.stride(0)) + (cols - 1) * abs(m.stride(1)) + 1
                for m in matrices)
    wide = max(reach, rows * cols) > INT32_LIMIT
    tiling, grid = plan.tiling, plan.grid
    if tiling.variant == "rows":
        kernel = _softmax_backward_rows_kernel if backward else _softmax_rows_kernel
        kernel[grid](*matrices, moved, rows, cols, *strides, LOG=log, WIDE=wide,
                     **tiling.blocks, **launch_options(tiling))
    else:
        splits = grid[1]
        blocks_per_split = cdiv(cdiv(cols, tiling.blocks["BLOCK_N"]), splits)
        partials = workspace.view(torch.float32)
        common = {"WIDE": wide, **tiling.blocks, **launch_options(tiling)}
        if backward:
            _softmax_backward_chunk_sums_kernel[grid](
                *matrices, partials, rows, cols, *strides, blocks_per_split, LOG=log,
                **common)
            _softmax_backward_chunk_write_kernel[grid](
                *matrices, moved, partials, rows, cols, *strides, blocks_per_split, LOG=log,
                SPLITS_BLOCK=next_power_of_2(splits), **common)
        else:
            _softmax_chunk_stats_kernel[grid](*matrices, partials, rows, cols, *strides,
                                              blocks_per_split, **common)
            _softmax_chunk_write_kernel[grid](*matrices, moved, partials, rows, cols, *strides,
                                              blocks_per_split, LOG=log,
                                              SPLITS_BLOCK=next_power_of_2(splits), **common)
    if not direct:
        out.copy_(moved.movedim(-1, dim))


for _opdef, _log, _backward in ((SOFTMAX, False, False), (LOG_SOFTMAX, True, False),
                                (SOFTMAX_BACKWARD, False, True),
                                (LOG_SOFTMAX_BACKWARD, True, True)):
    def _launcher(plan: object, inputs: Sequence[torch.Tensor | None],
                  outputs: Sequence[torch.Tensor], workspace: torch.Tensor | None,
                  log: bool = _log, backward: bool = _backward) -> None:
        _launch(plan, inputs, outputs[0], workspace, log, backward)
    _opdef.launcher("triton")(_launcher)


# ---------------------------------------------------------------------------------------------
# Backward


def _setup_context(ctx: object, inputs: tuple[object, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(output)
    ctx.dim = inputs[1]


@SOFTMAX.autograd(_setup_context)
def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    """dx = y * (grad - sum(grad * y)), through `softmax_backward`."""
    (y,) = ctx.saved_tensors
    return SOFTMAX_BACKWARD(grad, y, ctx.dim), None


@LOG_SOFTMAX.autograd(_setup_context)
def log_backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    """dx = grad - exp(y) * sum(grad), through `log_softmax_backward`."""
    (y,) = ctx.saved_tensors
    return LOG_SOFTMAX_BACKWARD(grad, y, ctx.dim), None


register_op(SOFTMAX_BACKWARD)
register_op(LOG_SOFTMAX_BACKWARD)
register_op(SOFTMAX)
register_op(LOG_SOFTMAX)


@SOFTMAX.exported
def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``exp(x - max) / sum(exp(x - max))`` over ``dim``, like ``torch.softmax``: the row
    max is subtracted and the statistics are float32, so no input overflows; rows of only
    ``-inf`` give NaN, as in torch. Same shape and dtype as ``x``; long rows (up to 2^31
    columns) use the online multi-block variant.

    Raises:
        DtypeError: ``x`` is not float32/float16/bfloat16/float64.
        AttrError: ``dim`` is out of range for ``x``.
    """
    return SOFTMAX(x, dim)


@LOG_SOFTMAX.exported
def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``x - max - log(sum(exp(x - max)))`` over ``dim``, like ``torch.log_softmax``;
    same shape and dtype as ``x``, float32 statistics.

    Raises:
        DtypeError: ``x`` is not float32/float16/bfloat16/float64.
        AttrError: ``dim`` is out of range for ``x``.
    """
    return LOG_SOFTMAX(x, dim)
