"""What LayerNorm and RMSNorm share: row statistics in float32, the two tiling variants, the
kernels, the launchers and the error scale.

A norm works on rows of ``N = prod(normalized dims)`` elements. With ``CENTER`` (LayerNorm)
the row mean is subtracted and the variance is the mean squared deviation, computed by two
passes over the row in registers (``rows``: for a row whose mean stands beyond its spread,
a corrected second pass takes the rough mean's rounding out of the deviations) or by
merging per-block (count, mean, M2) statistics of ``x - x[0]`` with Chan's formula
(``looped``: the shifted values are formed exactly, so rows far from zero normalise to a
few ulps there too), never by ``E[x^2] - E[x]^2``, which cancels catastrophically for data
far from zero. Without it (RMSNorm) the mean is 0 and the "variance" is ``mean(x^2)``.
``rstd = 1 / sqrt(var + eps)``, ``x_hat = (x - mean) * rstd``, ``y = x_hat * weight +
bias``.

A float32 sum of squares overflows once it passes 3.4e38 (values beyond 1.8e19 /
sqrt(N)) and underflows for values below about 1e-19. Rows whose variance came out Inf,
NaN or below `TINY_VARIANCE` (and whose values are finite and not all zero) are summed
again, scaled by the power of two that brings their largest deviation into [2^20, 2^21)
(`rescaled_inverse_rms`): exact, and the squares then neither overflow nor underflow.
``y = ((x - mean) * scale) * inv`` and ``rstd = scale * inv`` with ``inv = 1 / sqrt(var *
scale^2 + eps * scale^2)``; a scale under which ``eps * scale^2`` would overflow is
dropped (eps then outweighs the variance anyway). What float32 cannot hold remains: rows
near its largest value save an rstd below its smallest normal (fewer bits), and
LayerNorm's mean of such rows can overflow (a known limitation); subnormal rows with eps
0 save an rstd of Inf, though their ``y`` is right.

Backward, with ``g = grad * weight``: ``grad_x = rstd * (g - mean(g) - x_hat * mean(g *
x_hat))`` (no ``mean(g)`` term without ``CENTER``; with ``RECENTRE``, x_hat less its row
mean where the mean stands beyond the spread), ``grad_weight = sum grad * x_hat`` and
``grad_bias = sum grad`` over rows: each program sums its rows into its own row of float32
partials in the workspace (in registers while whole rows fit on chip, written once at the
end; a looped row's blocks are added in memory), and a second kernel sums the partials in
program order, so the result is deterministic (no atomics).

Variants: ``rows`` keeps ``BLOCK_M`` whole rows on chip (one read of each input);
``looped`` takes one row at a time in ``BLOCK_N`` blocks (the row is read twice).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from opforge.core.hardware import HardwareProfile
from opforge.core.opdef import Attrs, Cost, Specs, Tiling
from opforge.core.tiling import (
    INT32_LIMIT,
    MAX_PROGRAMS,
    cdiv,
    launch_options,
    next_power_of_2,
    persistent_grid,
    rows_then_looped,
)

try:
    import triton
    import triton.language as tl

    from opforge.ops._math import rounded_for, widen
except ImportError:  # pragma: no cover
    triton = None

SUM_BLOCK = 1024
MIN_SUM_BLOCK = 64
SUM_TILE = 4096  # partials a program of the sum loads per step
# float32 variances below this (2^26 times the smallest normal) may have lost bits to
# underflowing squares: such rows are summed again, scaled (as are rows whose variance
# overflowed).
TINY_VARIANCE = 2.0 ** -100
# The scale brings a row's largest deviation to [2^20, 2^21); its exponent stays within
# float32's normal range.
SCALED_EXPONENT = 20
# (rows, cols) of a norm call from its specs and attributes.
Geometry = Callable[[Specs, Attrs], tuple[int, int]]


def rows_and_cols(shape: Sequence[int], normalized: int) -> tuple[int, int]:
    """``(rows, N)`` when the last ``normalized`` dims of ``shape`` are normalised."""
    shape = tuple(shape) or (1,)
    cols = math.prod(shape[len(shape) - normalized:])
    return (math.prod(shape) // cols if cols else 0), cols


def tiling(geometry: Geometry, streams: int, one_row: int | None = None
           ) -> Callable[..., list[Tiling]]:
    """Candidates: ``rows`` when ``BLOCK_M`` rows of ``streams`` row-sized tensors (and
    their float32 copies) fit on chip, then ``looped`` with shrinking blocks; ``one_row``:
    values a thread of a one-row tile (`rows_then_looped`)."""
    def choose(inputs: Specs, outputs: Specs, attrs: Attrs, hardware: HardwareProfile
               ) -> list[Tiling]:
        rows, cols = geometry(inputs, attrs)
        return rows_then_looped(rows, cols, streams * (inputs[0].itemsize + 4), hardware,
                                one_row=one_row)
    return choose


# Backward programs per core: each program owns a row of float32 weight/bias partials (the
# workspace, then read again by the final sum), so fewer programs move fewer bytes; two a
# core overlap one program's loads with the other's arithmetic where both fit on the SM.
BACKWARD_PROGRAMS_PER_CORE = 2
# Warps from which one backward program fills an SM's registers: at 16 values a thread
# it keeps a row's terms and its partials live, over 64 registers a thread
# (rms_norm_backward 71, layer_norm_backward 119 at sm_90, 8192 columns), and 16 warps of
# that take more than half of the 65536; a second program a core would only run after
# the first, with twice the partials to write and sum.
BACKWARD_FULL_SM_WARPS = 16


def grid(geometry: Geometry, backward: bool = False) -> Callable[..., tuple[int, ...]]:
    """A persistent grid over row blocks: the shared count of programs a core
    (`tiling.persistent_grid`'s) for a forward; for a ``backward``,
    `BACKWARD_PROGRAMS_PER_CORE`, or one where a program of its warps fills the SM's
    registers (`BACKWARD_FULL_SM_WARPS`)."""
    def choose(tiling: Tiling, inputs: Specs, outputs: Specs, attrs: Attrs,
               hardware: HardwareProfile) -> tuple[int, ...]:
        rows, _ = geometry(inputs, attrs)
        per_core = None
        if backward:
            warps = tiling.options.get("warps")
            per_core = 1 if warps is not None and warps >= BACKWARD_FULL_SM_WARPS \
                else BACKWARD_PROGRAMS_PER_CORE
        return (persistent_grid(cdiv(rows, tiling.blocks["BLOCK_M"]), hardware, per_core),)
    return choose


def backward_workspace(geometry: Geometry, partial_sets: Callable[[Specs], int]
                       ) -> Callable[..., int]:
    """float32 partials: ``partial_sets(inputs)`` arrays (weight, bias) of one row per
    program."""
    def size(tiling: Tiling, grid: tuple[int, ...], inputs: Specs, outputs: Specs,
             attrs: Attrs) -> int:
        _, cols = geometry(inputs, attrs)
        return 4 * partial_sets(inputs) * grid[0] * cols
    return size


def backward_kernel_costs(geometry: Geometry, partial_sets: Callable[[Specs], int],
                          cost: Callable[[Specs, Specs, Attrs], Cost]) -> Callable[..., dict]:
    """The row kernel (the operator's ``cost``, plus the weight read and the float32
    partials written) and the one launch that sums every set of partials (weight's and
    bias's: read once, the gradients written)."""
    def costs(tiling: Tiling, grid: tuple[int, ...], inputs: Specs, outputs: Specs,
              attrs: Attrs) -> dict[str, Cost]:
        _, cols = geometry(inputs, attrs)
        rows_cost = cost(inputs, outputs, attrs)
        sets = partial_sets(inputs)
        partials = 4 * grid[0] * cols
        gradient = cols * inputs[0].itemsize
        return {"norm_backward_kernel": Cost(rows_cost.flops, rows_cost.bytes_moved
                                             + sets * (gradient + partials)),
                "sum_partials_kernel": Cost(sets * grid[0] * cols,
                                            sets * (partials + gradient))}
    return costs


def gradient_scale(grad: torch.Tensor, x_hat: torch.Tensor, rstd: torch.Tensor,
                   g: torch.Tensor, golden: torch.Tensor, center: bool) -> torch.Tensor:
    """The magnitude a norm's gradient is judged against (float64 ``(rows, N)`` views):
    grad_x's row sums cancel, so rstd (|g| + mean|g| + |x_hat| mean|g x_hat|); the weight
    gradient is a sum over rows, so sum|grad x_hat|."""
    if golden.numel() == grad.numel():
        spread = g.abs() + x_hat.abs() * (g * x_hat).abs().mean(-1, keepdim=True)
        if center:
            spread = spread + g.abs().mean(-1, keepdim=True)
        return golden.abs() + (rstd * spread).reshape(golden.shape)
    return golden.abs() + (grad * x_hat).abs().sum(0).reshape(golden.shape)


def rescaled_inverse_rms(deviation: torch.Tensor, variance: torch.Tensor,
                         dims: Sequence[int], eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, inv)`` of rows of ``deviation`` (reduced over ``dims``, kept) whose mean
    square is ``variance``: ``y = (deviation * scale) * inv`` and ``rstd = scale * inv``.
    ``scale`` is 1, or, where the variance overflowed or may have underflowed, the power of
    two that brings the row's largest magnitude into [2^20, 2^21) (the variance is then
    summed again from the scaled deviations); the torch form of the kernels' rule (module
    doc), for the dtype's own exponent range."""
    info = torch.finfo(variance.dtype)
    max_exponent = math.frexp(info.max)[1]  # 128 for float32
    top = deviation.abs().amax(dims, keepdim=True)
    # top = m 2^exponent with m in [0.5, 1): 2^(SCALED_EXPONENT + 1 - exponent) brings it to
    # [2^20, 2^21).
    shift = (SCALED_EXPONENT + 1 - torch.frexp(top).exponent).clamp(
        SCALED_EXPONENT + 1 - max_exponent, max_exponent - 2)
    scale = torch.ldexp(torch.ones_like(variance), shift)
    tiny = info.tiny * TINY_VARIANCE / torch.finfo(torch.float32).tiny
    usable = ((~variance.isfinite() | (variance < tiny)) & (top > 0) & top.isfinite()
              & (eps * scale * scale).isfinite())
    scale = torch.where(usable, scale, 1.0)
    if usable.any():
        variance = torch.where(usable, (deviation * scale).square().mean(dims, keepdim=True),
                               variance)
    return scale, torch.rsqrt(variance + eps * scale * scale)


# ---------------------------------------------------------------------------------------------
# Kernels

if triton is not None:
    _TINY_VARIANCE = tl.constexpr(TINY_VARIANCE)
    _SCALED_EXPONENT = tl.constexpr(SCALED_EXPONENT)

    @triton.jit
    def _rescaled(variance, top, eps):
        """The scale of each row (`rescaled_inverse_rms`): a power of two built from the
        exponent bits of its largest deviation ``top``, 1 where the variance is usable as
        it is or ``eps * scale^2`` would overflow."""
        biased = (top.to(tl.int32, bitcast=True) >> 23) & 0xFF
        shift = tl.minimum(tl.maximum(_SCALED_EXPONENT + 127 - biased,
                                      _SCALED_EXPONENT - 127), 126)
        scale = ((shift + 127) << 23).to(tl.float32, bitcast=True)
        usable = ((variance == float("inf")) | (variance != variance)
                  | (variance < _TINY_VARIANCE)) & (top > 0) \
            & (top < float("inf")) & (eps * scale * scale < float("inf"))
        return tl.where(usable, scale, 1.0)

    @triton.jit
    def _needs_rescale(variance):
        """Whether any row's variance overflowed (Inf, or NaN where Chan's merge multiplied
        an overflowed square by 0) or may have underflowed: a scalar, so that the common
        case skips the rescaled sums."""
        flagged = (variance == float("inf")) | (variance != variance) \
            | (variance < _TINY_VARIANCE)
        return tl.max(flagged.to(tl.int32), axis=0) > 0

    @triton.jit
    def _real_rows(variance, row_mask, BLOCK_M: tl.constexpr):
        """The variances of a block's real rows, 1 past M. Every row of a one-row block is
        real (the persistent loop stops at M): triton-ascend fails to lower its mask in the
        select (rms_norm and layer_norm at 4096 columns and more, one row a tile)."""
        if BLOCK_M == 1:
            return variance
        else:
            return tl.where(row_mask, variance, 1.0)

    @triton.jit
    def _load_row_block(x_ptr, residual_ptr, rows, offsets, mask, stride_x, stride_r,
                        HAS_RESIDUAL: tl.constexpr):
        """x (+ residual) of a block of rows, in float32; 0 where masked."""
        s = widen(tl.load(x_ptr + rows[:, None] * stride_x + offsets[None, :], mask=mask,
                          other=0.0))
        if HAS_RESIDUAL:
            s += widen(tl.load(residual_ptr + rows[:, None] * stride_r + offsets[None, :],
                               mask=mask, other=0.0))
        return s

    @triton.jit
    def _deviation_block(x_ptr, residual_ptr, rows, row_mask, offsets, N, stride_x, stride_r,
                         shift, mean, HAS_RESIDUAL: tl.constexpr):
        """``(x (+ residual) - shift) - mean`` of a block of rows (the shifted values
        formed first, exactly), 0 where masked; and the mask."""
        mask = row_mask[:, None] & (offsets < N)[None, :]
        s = _load_row_block(x_ptr, residual_ptr, rows, offsets, mask, stride_x, stride_r,
                            HAS_RESIDUAL)
        return tl.where(mask, (s - shift[:, None]) - mean[:, None], 0.0), mask

    @triton.jit
    def _parameter_block(ptr, offsets, N, PRESENT: tl.constexpr):
        """A weight's or bias's values over ``offsets`` in float32 (1 when absent). The
        forward loads them once a program for tiles of several rows, else once a row, and
        the backward once a row (see their NOTEs: registers)."""
        if PRESENT:
            return widen(tl.load(ptr + offsets, mask=offsets < N, other=0.0))
        else:
            return 1.0

    @triton.jit
    def _affine(x_hat, weight, bias, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr):
        """``x_hat * weight + bias`` over rows, with `_parameter_block`'s vectors."""
        y = x_hat
        if HAS_WEIGHT:
            y *= weight[None, :]
        if HAS_BIAS:
            y += bias[None, :]
        return y

    @triton.jit
    def norm_forward_kernel(x_ptr, residual_ptr, weight_ptr, bias_ptr, y_ptr, mean_ptr,
                            rstd_ptr, sum_ptr, M, N, stride_x, stride_r, eps,
                            CENTER: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                            HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                            LOOPED: tl.constexpr, WIDE: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        cols = tl.arange(0, BLOCK_N)
        # NOTE: one-row tiles read the parameters again for each row (from L1 or L2):
        # held across the program's rows, they took layer_norm's forward at 8192 columns
        # and 8 warps from 80 to 128 registers (sm_90: 3 programs an SM to 2) and spilled
        # rms_norm's at 32768 columns (112 B) and layer_norm's at 16384 (24 B). Tiles of
        # several rows hold them (read per tile, rms_norm's int64-offset 4 x 1024 tile
        # spilled 8 B).
        held_weight = _parameter_block(weight_ptr, cols, N,
                                       HAS_WEIGHT and (BLOCK_M > 1 and not LOOPED))
        held_bias = _parameter_block(bias_ptr, cols, N,
                                     HAS_BIAS and (BLOCK_M > 1 and not LOOPED))
        for block in range(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.num_programs(0)):
            rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
            if WIDE:
                rows = rows.to(tl.int64)
            row_mask = rows < M
            if LOOPED:
                count = 0.0
                mean = tl.zeros([BLOCK_M], dtype=tl.float32)
                m2 = tl.zeros([BLOCK_M], dtype=tl.float32)
                if CENTER:
                    # Shifted data: statistics of x - x[0]. Far from zero (1e6 + N(0, 1))
                    # the block means themselves would round by 0.03 and Chan's deltas and
                    # x - mean inherit it; the shifted values are formed exactly and their
                    # mean is small. |x[0] - mean| <= sqrt(N) * std bounds the cost of an
                    # outlying first element. A non-finite x[0] shifts by nothing.
                    first = tl.sum(_load_row_block(x_ptr, residual_ptr, rows,
                                                   tl.zeros([1], dtype=tl.int32),
                                                   row_mask[:, None], stride_x, stride_r,
                                                   HAS_RESIDUAL), axis=1)
                    shift = tl.where(tl.abs(first) < float("inf"), first, 0.0)
                else:
                    shift = tl.zeros([BLOCK_M], dtype=tl.float32)
                for start in range(0, N, BLOCK_N):
                    offsets = start + cols
                    mask = row_mask[:, None] & (offsets < N)[None, :]
                    s = _load_row_block(x_ptr, residual_ptr, rows, offsets, mask, stride_x,
                                        stride_r, HAS_RESIDUAL)
                    if HAS_RESIDUAL:
                        sums = sum_ptr + rows[:, None] * N + offsets[None, :]
                        tl.store(sums, rounded_for(s, sum_ptr), mask=mask)
                    if CENTER:
                        # Chan et al.: merge the block's (count, mean, M2) into the row's.
                        s = tl.where(mask, s - shift[:, None], 0.0)
                        block_count = tl.minimum(N - start, BLOCK_N).to(tl.float32)
                        block_mean = tl.sum(s, axis=1) / block_count
                        deviation = tl.where(mask, s - block_mean[:, None], 0.0)
                        delta = block_mean - mean
                        total = count + block_count
                        mean += delta * (block_count / total)
                        m2 += (tl.sum(deviation * deviation, axis=1)
                               + delta * delta * (count * block_count / total))
                        count = total
                    else:
                        m2 += tl.sum(s * s, axis=1)
                variance = m2 / N
                scale = tl.full([BLOCK_M], 1.0, tl.float32)
                if _needs_rescale(_real_rows(variance, row_mask, BLOCK_M)):
                    # Two more passes for such rows only: their largest deviation, then
                    # their scaled squares.
                    top = tl.zeros([BLOCK_M], dtype=tl.float32)
                    for start in range(0, N, BLOCK_N):
                        deviation, _ = _deviation_block(
                            x_ptr, residual_ptr, rows, row_mask, start + cols, N, stride_x,
                            stride_r, shift, mean, HAS_RESIDUAL)
                        top = tl.maximum(top, tl.max(tl.abs(deviation), axis=1))
                    scale = _rescaled(variance, top, eps)
                    scaled_m2 = tl.zeros([BLOCK_M], dtype=tl.float32)
                    for start in range(0, N, BLOCK_N):
                        deviation, _ = _deviation_block(
                            x_ptr, residual_ptr, rows, row_mask, start + cols, N, stride_x,
                            stride_r, shift, mean, HAS_RESIDUAL)
                        scaled = deviation * scale[:, None]
                        scaled_m2 += tl.sum(scaled * scaled, axis=1)
                    variance = tl.where(scale != 1.0, scaled_m2 / N, variance)
                inverse = 1.0 / tl.sqrt(variance + eps * scale * scale)
                rstd = scale * inverse
                for start in range(0, N, BLOCK_N):
                    offsets = start + cols
                    deviation, mask = _deviation_block(
                        x_ptr, residual_ptr, rows, row_mask, offsets, N, stride_x, stride_r,
                        shift, mean, HAS_RESIDUAL)
                    y = _affine((deviation * scale[:, None]) * inverse[:, None],
                                _parameter_block(weight_ptr, offsets, N, HAS_WEIGHT),
                                _parameter_block(bias_ptr, offsets, N, HAS_BIAS),
                                HAS_WEIGHT, HAS_BIAS)
                    outs = y_ptr + rows[:, None] * N + offsets[None, :]
                    tl.store(outs, rounded_for(y, y_ptr), mask=mask)
                if CENTER:
                    mean += shift
            else:
                mask = row_mask[:, None] & (cols < N)[None, :]
                s = _load_row_block(x_ptr, residual_ptr, rows, cols, mask, stride_x, stride_r,
                                    HAS_RESIDUAL)
                if HAS_RESIDUAL:
                    sums = sum_ptr + rows[:, None] * N + cols[None, :]
                    tl.store(sums, rounded_for(s, sum_ptr), mask=mask)
                if CENTER:
                    # Corrected two-pass deviations: a row far from zero (1e4 + N(0, 1), say)
                    # rounds its sum by whole units, but its deviations from that rough mean
                    # are formed exactly, and their mean is the rough mean's error: taken
                    # out, the normalised row is exact to float32 rounding. Only where the
                    # mean stands beyond the spread: on a row centred near zero the
                    # correction is another cancelling sum, noise the rough mean lacks. The
                    # saved mean stays the rough one; a row holding inf or NaN is left as it
                    # was.
                    mean = tl.sum(s, axis=1) / N
                    deviation = tl.where(mask, s - mean[:, None], 0.0)
                    variance = tl.sum(deviation * deviation, axis=1) / N
                    correction = tl.sum(deviation, axis=1) / N
                    offset = (mean * mean > variance) & (tl.abs(mean) < float("inf"))
                    correction = tl.where(offset, correction, 0.0)
                    deviation = tl.where(mask, deviation - correction[:, None], 0.0)
                    variance -= correction * correction
                else:
                    mean = tl.zeros([BLOCK_M], dtype=tl.float32)
                    deviation = s
                    variance = tl.sum(s * s, axis=1) / N
                scale = tl.full([BLOCK_M], 1.0, tl.float32)
                if _needs_rescale(_real_rows(variance, row_mask, BLOCK_M)):
                    top = tl.max(tl.where(mask, tl.abs(deviation), 0.0), axis=1)
                    scale = _rescaled(variance, top, eps)
                    scaled = deviation * scale[:, None]
                    variance = tl.where(scale != 1.0, tl.sum(scaled * scaled, axis=1) / N,
                                        variance)
                inverse = 1.0 / tl.sqrt(variance + eps * scale * scale)
                rstd = scale * inverse
                if BLOCK_M > 1:
                    weight, bias = held_weight, held_bias
                else:
                    weight = _parameter_block(weight_ptr, cols, N, HAS_WEIGHT)
                    bias = _parameter_block(bias_ptr, cols, N, HAS_BIAS)
                y = _affine((deviation * scale[:, None]) * inverse[:, None], weight, bias,
                            HAS_WEIGHT, HAS_BIAS)
                outs = y_ptr + rows[:, None] * N + cols[None, :]
                tl.store(outs, rounded_for(y, y_ptr), mask=mask)
            if CENTER:
                tl.store(mean_ptr + rows, rounded_for(mean, mean_ptr), mask=row_mask)
            tl.store(rstd_ptr + rows, rounded_for(rstd, rstd_ptr), mask=row_mask)

    @triton.jit
    def _grad_block(grad_ptr, x_ptr, weight, row, offsets, stride_g, stride_x, N, mean,
                    rstd):
        """(grad, x_hat, lifted * grad * weight) of one block of a row, in float32, with
        ``lifted`` the part of rstd applied first (`_rstd_split`) and ``weight`` the
        block's (`_parameter_block`)."""
        mask = offsets < N
        grad = widen(tl.load(grad_ptr + row * stride_g + offsets, mask=mask, other=0.0))
        x = widen(tl.load(x_ptr + row * stride_x + offsets, mask=mask, other=0.0))
        x_hat = tl.where(mask, (x - mean) * rstd, 0.0)
        return grad, x_hat, _rstd_split(rstd)[0] * grad * weight

    @triton.jit
    def _offset_row(mean, rstd):
        """Whether a row's finite mean stands beyond its spread (mean^2 > 1 / rstd^2)."""
        return (mean * mean * rstd * rstd > 1.0) & (tl.abs(mean) < float("inf"))

    @triton.jit
    def _rstd_split(rstd):
        """(applied first, applied last) of ``grad_x = rstd (g - mean(g) - ...)``: a row of
        tiny values (rstd >= 1) scales g first, which lifts subnormal gradients (few
        significant bits) before any other rounding; a row of large values scales last,
        after the terms (of its large gradients) have cancelled."""
        lift = rstd >= 1.0
        return tl.where(lift, rstd, 1.0), tl.where(lift, 1.0, rstd)

    @triton.jit
    def _store_grad_x(grad_w, x_hat, rstd, mean_g, mean_gx, dx_ptr, row, offsets, N):
        """grad_x of one block of a row, from ``grad_w`` (`_grad_block`) and its means."""
        dx = _rstd_split(rstd)[1] * (grad_w - mean_g - x_hat * mean_gx)
        tl.store(dx_ptr + row * N + offsets, rounded_for(dx, dx_ptr), mask=offsets < N)

    @triton.jit
    def norm_backward_kernel(grad_ptr, x_ptr, mean_ptr, rstd_ptr, weight_ptr, dx_ptr,
                             partial_ptr, M, N, stride_g, stride_x, CENTER: tl.constexpr,
                             RECENTRE: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                             HAS_BIAS: tl.constexpr,
                             LOOPED: tl.constexpr, WIDE: tl.constexpr,
                             BLOCK_N: tl.constexpr):
        """grad_x row by row, and the program's weight and bias terms summed over its rows
        into its own row of float32 partials (a row of the workspace no other program
        touches). With whole rows on chip the sums stay in registers until the program
        ends; a looped row adds its blocks to the partials in memory. ``RECENTRE`` (the
        mean is the forward's rough float32 mean of x): x_hat less its row mean where the
        mean stands beyond the spread, as the forward's corrected pass."""
        cols = tl.arange(0, BLOCK_N)
        program = tl.program_id(0)
        programs = tl.num_programs(0)
        partial_w = partial_ptr + program * N
        if HAS_WEIGHT:
            partial_b = partial_ptr + (programs + program) * N
        else:
            partial_b = partial_w
        if LOOPED:
            for start in range(0, N, BLOCK_N):
                offsets = start + cols
                zeros = tl.zeros([BLOCK_N], dtype=tl.float32)
                if HAS_WEIGHT:
                    tl.store(partial_w + offsets, zeros, mask=offsets < N)
                if HAS_BIAS:
                    tl.store(partial_b + offsets, zeros, mask=offsets < N)
        sum_w = tl.zeros([BLOCK_N], dtype=tl.float32)
        sum_b = tl.zeros([BLOCK_N], dtype=tl.float32)
        for row in range(program, M, programs):
            if WIDE:
                row = row.to(tl.int64)
            rstd = widen(tl.load(rstd_ptr + row))
            if CENTER:
                mean = widen(tl.load(mean_ptr + row))
            else:
                mean = 0.0
            if LOOPED:
                sum_g = 0.0
                sum_gx = 0.0
                sum_x = 0.0
                for start in range(0, N, BLOCK_N):
                    grad, x_hat, grad_w = _grad_block(
                        grad_ptr, x_ptr, _parameter_block(weight_ptr, start + cols, N, HAS_WEIGHT),
                        row, start + cols, stride_g, stride_x, N, mean, rstd)
                    sum_g += tl.sum(grad_w, axis=0)
                    sum_gx += tl.sum(grad_w * x_hat, axis=0)
                    sum_x += tl.sum(x_hat, axis=0)
                drift = 0.0
                if RECENTRE:  # noqa: SIM102 - a constexpr; the row's test is a runtime branch
                    # The rows branch's recentring (below). An offset row (rare) sums
                    # g (x_hat - drift) in a pass of its own: sum(g x_hat) - drift sum(g)
                    # cancels, and is NaN where an infinite gradient makes sum(g) infinite.
                    if _offset_row(mean, rstd):
                        drift = sum_x / N
                        sum_gx = 0.0
                        for start in range(0, N, BLOCK_N):
                            offsets = start + cols
                            grad, x_hat, grad_w = _grad_block(
                                grad_ptr, x_ptr,
                                _parameter_block(weight_ptr, offsets, N, HAS_WEIGHT), row,
                                offsets, stride_g, stride_x, N, mean, rstd)
                            x_hat = tl.where(offsets < N, x_hat - drift, 0.0)
                            sum_gx += tl.sum(grad_w * x_hat, axis=0)
                mean_gx = sum_gx / N
                if CENTER:
                    mean_g = sum_g / N
                else:
                    mean_g = 0.0
                for start in range(0, N, BLOCK_N):
                    offsets = start + cols
                    grad, x_hat, grad_w = _grad_block(
                        grad_ptr, x_ptr, _parameter_block(weight_ptr, offsets, N, HAS_WEIGHT),
                        row, offsets, stride_g, stride_x, N, mean, rstd)
                    x_hat = tl.where(offsets < N, x_hat - drift, 0.0)
                    _store_grad_x(grad_w, x_hat, rstd, mean_g, mean_gx, dx_ptr, row, offsets,
                                  N)
                    mask = offsets < N
                    if HAS_WEIGHT:
                        acc = tl.load(partial_w + offsets, mask=mask, other=0.0)
                        tl.store(partial_w + offsets, acc + grad * x_hat, mask=mask)
                    if HAS_BIAS:
                        acc = tl.load(partial_b + offsets, mask=mask, other=0.0)
                        tl.store(partial_b + offsets, acc + grad, mask=mask)
            else:
                # NOTE: sm_90, bf16: the weight read once a row (an L1 hit) and the
                # partials summed before the row's reductions, so that grad dies early,
                # take rms_norm_backward at 8192 columns (16 warps) from 112 registers to
                # 71 and its spill at 16384 (32 warps) from 136 B to 16 (layer_norm's 288
                # to 184: its two partial rows and a row's x_hat and grad_w fill the 64
                # registers a thread of 32 warps has); all row loads stay at the loop's top.
                grad, x_hat, grad_w = _grad_block(
                    grad_ptr, x_ptr, _parameter_block(weight_ptr, cols, N, HAS_WEIGHT), row,
                    cols, stride_g, stride_x, N, mean, rstd)
                if RECENTRE:  # noqa: SIM102 - a constexpr; the row's test is a runtime branch
                    # The saved mean is the forward's rough one: on a row whose mean stands
                    # beyond its spread, x - mean is exact but off by the mean's rounding,
                    # and the mean of x_hat is that error (in units of the spread): taken
                    # out, as the forward's corrected pass did, x_hat is the forward's. A
                    # branch on the row, so that other rows make no fourth reduction.
                    if _offset_row(mean, rstd):
                        x_hat = tl.where(cols < N, x_hat - tl.sum(x_hat, axis=0) / N, 0.0)
                sum_w += grad * x_hat
                sum_b += grad
                sum_gx = tl.sum(grad_w * x_hat, axis=0)
                mean_g = 0.0
                if CENTER:
                    mean_g = tl.sum(grad_w, axis=0) / N
                mean_gx = sum_gx / N
                _store_grad_x(grad_w, x_hat, rstd, mean_g, mean_gx, dx_ptr, row, cols, N)
        if not LOOPED:
            if HAS_WEIGHT:
                tl.store(partial_w + cols, sum_w, mask=cols < N)
            if HAS_BIAS:
                tl.store(partial_b + cols, sum_b, mask=cols < N)

    @triton.jit
    def sum_partials_kernel(partial_ptr, out_ptr, second_out_ptr, P, N,
                            BLOCK_P: tl.constexpr, BLOCK: tl.constexpr):
        # Column sums of the (P, N) partials, BLOCK_P rows a step in a fixed order
        # (deterministic): one row a step left one load in flight, and a program's chain of
        # P dependent loads was latency-bound. The grid's second dim is the set of
        # partials: the weight's into out, the bias's (the next P rows) into second_out,
        # in one launch.
        parts = tl.arange(0, BLOCK_P)
        first_set = tl.program_id(1) == 0
        partials = partial_ptr + tl.cast(tl.program_id(1), tl.int64) * P * N
        for block in range(tl.program_id(0), tl.cdiv(N, BLOCK), tl.num_programs(0)):
            offsets = block * BLOCK + tl.arange(0, BLOCK)
            mask = offsets < N
            total = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, P, BLOCK_P):
                rows = start + parts
                tile = tl.load(partials + rows[:, None] * N + offsets[None, :],
                               mask=(rows < P)[:, None] & mask[None, :], other=0.0)
                total += tl.sum(tile, axis=0)
            if first_set:
                tl.store(out_ptr + offsets, rounded_for(total, out_ptr), mask=mask)
            else:
                tl.store(second_out_ptr + offsets, rounded_for(total, second_out_ptr),
                         mask=mask)


# ---------------------------------------------------------------------------------------------
# Launchers


def rstd_split(rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The references' form of the kernels' `_rstd_split`: (rstd applied to g first,
    rstd applied to grad_x last), 1 for the other."""
    lift = rstd >= 1
    return torch.where(lift, rstd, 1.0), torch.where(lift, 1.0, rstd)


def as_rows(tensor: torch.Tensor, cols: int) -> torch.Tensor:
    """``(rows, cols)`` with unit column stride: a view when possible, else a copy."""
    matrix = tensor.reshape(-1, cols)
    return matrix if matrix.stride(-1) == 1 or cols <= 1 else matrix.contiguous()


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter or statistic read as a contiguous vector (a copy only when it is
    strided: the kernels index it with unit stride, and ``reshape`` of a strided 1-D view
    is that view)."""
    return tensor if tensor.is_contiguous() else tensor.contiguous().view(-1)


def _wide(rows: int, cols: int, *matrices: torch.Tensor) -> bool:
    reach = max([rows * cols] + [(rows - 1) * m.stride(0) + cols for m in matrices])
    return reach > INT32_LIMIT


def launch_forward(plan: object, cols: int, x: torch.Tensor, residual: torch.Tensor | None,
                   weight: torch.Tensor | None, bias: torch.Tensor | None, y: torch.Tensor,
                   mean: torch.Tensor | None, rstd: torch.Tensor, total: torch.Tensor | None,
                   center: bool) -> None:
    """Normalise the rows of ``x`` (+ ``residual``) into ``y``; ``mean`` (with
    ``center``), ``rstd`` and ``total`` (the sum, with a residual) are written too."""
    if cols == 0:  # rows of nothing: statistics 0, as the reference has them
        for statistic in (mean, rstd):
            if statistic is not None:
                statistic.zero_()
        return
    # Kernels take only the data pointers: the contiguous outputs need no (rows, cols) view
    # (each view is a microsecond of host time per call).
    matrix = as_rows(x, cols)
    other = as_rows(residual, cols) if residual is not None else matrix
    rows = matrix.shape[0]
    tiling = plan.tiling
    norm_forward_kernel[plan.grid](
        matrix, other, _flat(weight) if weight is not None else matrix,
        _flat(bias) if bias is not None else matrix, y,
        mean if mean is not None else rstd, rstd, total if total is not None else y, rows, cols,
        matrix.stride(0), other.stride(0), plan.attrs["eps"], CENTER=center,
        HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None,
        HAS_BIAS=bias is not None, LOOPED=tiling.variant == "looped",
        WIDE=_wide(rows, cols, matrix, other), **tiling.blocks, **launch_options(tiling))


def launch_backward(plan: object, cols: int, grad: torch.Tensor, x: torch.Tensor,
                    mean: torch.Tensor | None, rstd: torch.Tensor,
                    weight: torch.Tensor | None, has_bias: bool, grad_x: torch.Tensor,
                    grad_weight: torch.Tensor | None, grad_bias: torch.Tensor | None,
                    workspace: torch.Tensor | None, center: bool, recentre: bool = False
                    ) -> None:
    """grad_x row by row; grad_weight and grad_bias from per-program partials;
    ``recentre``: see `norm_backward_kernel`."""
    grad_rows, x_rows = as_rows(grad, cols), as_rows(x, cols)
    rows = x_rows.shape[0]
    programs = plan.grid[0]
    tiling = plan.tiling
    # The saved statistics are indexed by row with unit stride, as the parameters are.
    rstd = _flat(rstd)
    partials = workspace.view(torch.float32) if workspace is not None else rstd
    norm_backward_kernel[plan.grid](
        grad_rows, x_rows, _flat(mean) if mean is not None else rstd,
        rstd, _flat(weight) if weight is not None else x_rows,
        grad_x, partials, rows, cols, grad_rows.stride(0), x_rows.stride(0),
        CENTER=center, RECENTRE=center and recentre, HAS_WEIGHT=weight is not None,
        HAS_BIAS=has_bias, LOOPED=tiling.variant == "looped",
        WIDE=_wide(rows, cols, grad_rows, x_rows), BLOCK_N=tiling.blocks["BLOCK_N"],
        **launch_options(tiling))
    sums = [out for out in (grad_weight, grad_bias) if out is not None]
    # Columns per program of the sum: enough programs for every core (1024 columns gave an
    # 8192-wide weight 8 programs on a 132-core GPU), at least 64 (256 B a row, coalesced).
    block = min(SUM_BLOCK, max(MIN_SUM_BLOCK, next_power_of_2(
        cdiv(cols, plan.hardware.core_count))))
    parts = min(next_power_of_2(programs), max(1, SUM_TILE // block))
    if sums:
        sum_partials_kernel[(max(1, min(cdiv(cols, block), MAX_PROGRAMS)), len(sums))](
            partials, sums[0], sums[-1], programs, cols, BLOCK_P=parts, BLOCK=block)
