"""Scaled dot-product attention, flash-style: ``attention(q, k, v, causal, scale)`` and
its gradient ``attention_backward``.

Layout ``[B, H, S, D]``: ``q`` is ``(B, H, Sq, D)``, ``k`` is ``(B, Hkv, Sk, D)``, ``v`` is
``(B, Hkv, Sk, Dv)`` with ``H`` a multiple of ``Hkv`` (grouped-query attention: query
head ``h`` reads key/value head ``h // (H / Hkv)``), ``D, Dv <= 256``. Outputs: ``out``
``(B, H, Sq, Dv)`` in q's dtype and ``lse`` ``(B, H, Sq)`` float32 (float64 for float64
inputs), the natural-log log-sum-exp of each row of scaled scores.

``causal`` masks aligned to the bottom-right: query ``i`` sees keys ``j <= i + Sk - Sq``
(the last query sees every key, as in KV-cache decoding and FlashAttention). torch's
``scaled_dot_product_attention(is_causal=True)`` aligns top-left (``j <= i``); the two
agree only when ``Sq == Sk``. ``window_left`` / ``window_right`` bound a band around the
same diagonal: query ``i`` sees keys ``i + Sk - Sq - window_left`` to ``i + Sk - Sq +
window_right`` (a sliding window of ``W`` keys is ``causal`` with ``window_left = W - 1``;
CANN's band, ``sparse_mode`` 4, is ``pre_tokens`` / ``next_tokens``). A query that sees no
key (``Sq > Sk``, causal; a band past the keys) gets ``out = 0`` and ``lse = -inf``.

Forward: each program holds a ``BLOCK_M`` block of queries and streams key/value blocks
through an online softmax: float32 running max and sum, ``scale * log2(e)`` folded into one
float32 multiply before ``exp2``, the probabilities rounded to v's dtype for the ``P @ V``
product (the tensor cores' operand), float32 accumulation. No ``Sq x Sk`` matrix is ever
stored. Blocks entirely visible skip the mask; only blocks crossing the band's edges (the
causal diagonal, a window's start) or the sequence end apply it, and the key blocks outside
the band are never visited: a window of ``W`` keys costs ``O(Sq W)``. The tiling's variant
``flash_tma`` reads keys and values through on-device tensor descriptors (TMA copies on
Hopper and newer; the descriptor's bounds replace the masks), ``flash_tma_ws`` also
warp-specializes the key loop; inputs that descriptors cannot address run the pointer
kernel. The tiling lists these variants on CUDA after the pointer kernel, for autotuning
(`opforge.core.autotune`) to measure; without it the pointer kernel runs. With
grouped-query attention and few queries (decoding), the queries of the heads that share a
key/value head fit one block: the tiling packs them (query-major rows), so that each key
block is read once per group instead of once per head. When the query blocks of all heads
would still leave cores idle (decoding: a few queries over a long KV cache), the tiling
also cuts the keys into slices, one program each, whose float32 (out, lse) a second kernel
merges by log-sum-exp (flash-decoding); under a window the slices divide the band a query
block sees, not the whole cache.

Backward (``attention_backward``), by recomputation from ``lse``: ``delta = rowsum(dout *
out) - grad_lse``, then one kernel per key block accumulates ``dk`` and ``dv`` over every
query block and every query head of its group (no atomics: deterministic), and one kernel
per query block accumulates ``dq``; the key side computes the transposed products (``S^T
= K Q^T``), so that no computed tile is transposed on chip. The ``flash_tma`` variants
stream their blocks by tensor descriptor here too (keys and values for dQ, queries and
output gradients for dK/dV): without the pointer tiles the kernels spill far less
(`benchmarks/attention_tuning.py --compile-only`). With ``P = exp(S - lse)`` and
``dS = P * (dP - delta)``, the formulas hold for any key subset as long as ``out`` and
``lse`` are those of the full attention: the ring attention runs this backward on one key
block at a time.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch

from opforge.core import backends
from opforge.core.errors import AttrError, DtypeError, ShapeError
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
    dtype_name,
)
from opforge.core.shapes import is_unknown_rank
from opforge.core.tiling import (
    MAX_PROGRAMS,
    cdiv,
    gpu_warps,
    launch_options,
    next_power_of_2,
    split_steps,
    wide_offsets,
    work_splits,
)
from opforge.library import register_op
from opforge.ops._descriptors import descriptors_usable, use_scratch_allocator
from opforge.ops._elementwise import random_input
from opforge.ops._rows import SHARED_ROW_STATISTIC
from opforge.ops._statistics import (
    STATISTICS_DTYPES,
    check_scalar,
    check_statistics,
    statistics_dtype,
)
from opforge.precision.cases import LONG_ROW, generate

try:
    import triton
    import triton.language as tl

    from opforge.ops._descriptors import descriptor_pair
    from opforge.ops._math import as_dot_operand, dot_operand, rounded_for, widen
except ImportError:  # pragma: no cover
    triton = None

MAX_HEAD_DIM = 256
LOG2_E = 1.4426950408889634
CAUSAL = Attr("causal", "bool", False, doc="mask keys after i + Sk - Sq (bottom-right)")
MASK = TensorArg("mask", dtypes=(torch.bool, torch.float32, torch.float16, torch.bfloat16,
                                 torch.float64), optional=True,
                 doc="(B|1, H|1, Sq|1, Sk|1): bool (True: seen) or added to the scores")
SCALE = Attr("scale", "float", None, doc="score scale; None: 1 / sqrt(D)")
# A window's sides are 32-bit, as CANN's token limits (past the lengths they change nothing).
WINDOW_RANGE = (-2**31, 2**31 - 1)
WINDOW_LEFT = Attr("window_left", "int", None, range=WINDOW_RANGE,
                   doc="hide keys before i + Sk - Sq - window_left; None: none")
WINDOW_RIGHT = Attr("window_right", "int", None, range=WINDOW_RANGE,
                    doc="hide keys after i + Sk - Sq + window_right; None: none")
SOFTCAP = Attr("softcap", "float", None,
               doc="scores become softcap * tanh(scores / softcap) before any mask; None: none")
ATTRS = (CAUSAL, SCALE, WINDOW_LEFT, WINDOW_RIGHT, SOFTCAP)

# Keys a query sees around its diagonal key ``i + Sk - Sq``: (before, after), None where
# unbounded.
Limits = tuple[int | None, int | None]


def key_limits(causal: bool, window_left: int | None, window_right: int | None) -> Limits:
    """(before, after): query ``i`` sees the keys ``j`` with ``i + Sk - Sq - before <= j <=
    i + Sk - Sq + after``, None where unbounded; ``causal`` caps ``after`` at 0 (the
    intersection of the causal mask and the window)."""
    if causal:
        window_right = 0 if window_right is None else min(window_right, 0)
    return window_left, window_right


def limits_of(attrs: Attrs) -> Limits:
    return key_limits(attrs["causal"], attrs["window_left"], attrs["window_right"])


def _reach(limits: Limits, sq: int, sk: int) -> tuple[bool, int, int]:
    """The kernels' band: (whether one applies, keys before the diagonal, keys after),
    clamped to ``[-Sq, Sk]`` and ``[-Sk, Sq]`` (past them every key, or none, is seen
    alike: 32-bit arithmetic stays exact). For packed sequences ``Sq, Sk`` are the token
    counts, at least any sequence's."""
    before, after = limits
    if before is None and after is None:
        return False, 0, 0
    before = sk if before is None else min(max(before, -sq), sk)
    after = sq if after is None else min(max(after, -sk), sq)
    return True, before, after


def _shapes(q: object, k: object, v: object, op: str) -> tuple[int, ...]:
    """(B, H, Hkv, Sq, Sk, D, Dv) of a call.

    Raises:
        ShapeError: not 4-D, batch or key/value mismatch, heads not grouped, D or Dv
            beyond 256.
    """
    for name, spec in (("q", q), ("k", k), ("v", v)):
        if len(spec.shape) != 4:
            raise ShapeError("must be 4-D [B, H, S, D]", op=op, param=name,
                             expected="(B, H, S, D)", got=tuple(spec.shape))
    b, h, sq, d = q.shape
    bk, hkv, sk, dk = k.shape
    if bk != b:
        raise ShapeError("batch differs from q's", op=op, param="k", expected=b, got=bk)
    if dk != d:
        raise ShapeError("head dim differs from q's", op=op, param="k", expected=d, got=dk)
    if tuple(v.shape[:3]) != (b, hkv, sk):
        raise ShapeError("must match k in batch, heads and length", op=op, param="v",
                         expected=(b, hkv, sk, "Dv"), got=tuple(v.shape))
    if h == 0:
        raise ShapeError("needs at least one head", op=op, param="q", expected="H >= 1",
                         got=tuple(q.shape))
    if hkv == 0 or h % hkv:
        raise ShapeError("query heads must be a multiple of key/value heads", op=op,
                         param="k", expected=f"a divisor of {h} heads", got=hkv)
    dv = v.shape[3]
    for name, size in (("q", d), ("v", dv)):
        if not 1 <= size <= MAX_HEAD_DIM:
            raise ShapeError("head dim out of range", op=op, param=name,
                             expected=f"1..{MAX_HEAD_DIM}", got=size)
    return b, h, hkv, sq, sk, d, dv


MASK_KINDS = {None: 0, torch.bool: 1}  # every float mask: 2 (added to the scores)


def _mask_kind(mask: object) -> int:
    """0: no mask; 1: boolean (True: the query sees the key); 2: additive (float)."""
    return MASK_KINDS.get(None if mask is None else mask.dtype, 2)


def _check_mask(op: str, q: object, mask: object, full: tuple[int, ...]) -> None:
    """A mask is 4-D, each dim 1 (broadcast) or the attention's ``(B, H, Sq, Sk)``; a
    float mask has q's dtype or float32.

    Raises:
        ShapeError: another rank or size. DtypeError: another float dtype.
    """
    if mask is None:
        return
    if mask.dtype != torch.bool and mask.dtype not in (q.dtype, torch.float32):
        raise DtypeError("a float mask must have q's dtype or float32", op=op, param="mask",
                         expected=f"bool | {dtype_name(q.dtype)} | float32",
                         got=dtype_name(mask.dtype))
    if len(mask.shape) != 4 or any(size not in (1, want)
                                   for size, want in zip(mask.shape, full, strict=True)):
        raise ShapeError("must broadcast to (B, H, Sq, Sk): each dim 1 or full", op=op,
                         param="mask", expected=full, got=tuple(mask.shape))


def _same_dtype(op: str, first: object, named: Sequence[tuple[str, object]]) -> None:
    for name, spec in named:
        if spec is not None and spec.dtype != first.dtype:
            raise DtypeError("must have q's dtype", op=op, param=name,
                             expected=str(first.dtype).removeprefix("torch."),
                             got=str(spec.dtype).removeprefix("torch."))


def check_softcap(op: str, attrs: Attrs, inputs: Specs) -> None:
    """A soft cap is positive and its kernel constants normal float32 numbers (or None).

    Raises:
        AttrError: a cap outside ``[2**-120, 2**120]`` (zero, negative, NaN, inf).
    """
    softcap = attrs["softcap"]
    # The kernels take cap * log2(e) and its reciprocal as float32 constants.
    if softcap is not None and not 2.0**-120 <= softcap <= 2.0**120:  # NaN too
        raise AttrError("a soft cap is positive, within float32's normal range", op=op,
                        param="softcap", expected="2**-120 <= softcap <= 2**120",
                        got=softcap)
    check_scalar(op, "softcap", softcap, inputs)


def _check(inputs: Specs, attrs: Attrs) -> None:
    q, k, v, mask = inputs
    check_scalar("attention", "scale", attrs["scale"], inputs)
    check_softcap("attention", attrs, inputs)
    _same_dtype("attention", q, (("k", k), ("v", v)))
    if not any(is_unknown_rank(t.shape) for t in inputs if t is not None):
        b, h, _, sq, sk, _, _ = _shapes(q, k, v, "attention")
        _check_mask("attention", q, mask, (b, h, sq, sk))


def _infer_shape(inputs: Specs, attrs: Attrs) -> list[tuple[int, ...]]:
    q, _, v, _ = inputs
    b, h, sq = q.shape[:3]
    return [(b, h, sq, v.shape[3]), (b, h, sq)]


def _infer_dtype(inputs: Specs, attrs: Attrs) -> list[torch.dtype]:
    return [inputs[0].dtype, statistics_dtype(inputs[0].dtype)]


def _visible_pairs(sq: int, sk: int, limits: Limits) -> int:
    """(query, key) pairs a head computes: those within the ``limits`` (`key_limits`).
    Host arithmetic only (a plan may be made while a compiler traces, where torch's
    operators make fake tensors)."""
    before, after = limits
    if before is None and after is None:
        return sq * sk
    offset = sk - sq  # query row i's diagonal key

    def keys(row: int) -> int:
        first = 0 if before is None else max(row + offset - before, 0)
        last = sk - 1 if after is None else min(row + offset + after, sk - 1)
        return last - first + 1

    # The rows split where a clamp starts or stops binding; on each piece a row's count
    # of keys is linear (slope -1, 0 or 1), summed in closed form where it is positive.
    cuts = {0, sq}
    if before is not None:
        cuts.add(min(max(before - offset, 0), sq))
    if after is not None:
        cuts.add(min(max(sk - 1 - after - offset, 0), sq))
    total = 0
    for start, stop in itertools.pairwise(sorted(cuts)):
        low, high = keys(start), keys(stop - 1)
        if low <= 0 and high <= 0:
            continue
        if low <= 0:  # rising through zero inside the piece
            start, low = start + 1 - low, 1
        elif high <= 0:  # falling through zero
            stop, high = stop - 1 + high, 1
        total += (low + high) * (stop - start) // 2
    return total


def _cost(inputs: Specs, outputs: Specs, attrs: Attrs) -> Cost:
    b, h, hkv, sq, sk, d, dv = _shapes(*inputs[:3], "attention")
    pairs = b * h * _visible_pairs(sq, sk, limits_of(attrs))
    item = inputs[0].itemsize
    return Cost(flops=2 * pairs * (d + dv),
                bytes_moved=item * (b * h * sq * (d + dv) + b * hkv * sk * (d + dv))
                + 4 * b * h * sq + _mask_bytes(inputs[3]))


def _mask_bytes(mask: object) -> int:
    """A mask's distinct elements, read once (a mask broadcast over heads is re-read per
    head from the cache)."""
    return 0 if mask is None else math.prod(mask.shape) * mask.itemsize


def _head_blocks(d: int, dv: int) -> tuple[int, int]:
    return max(16, next_power_of_2(d)), max(16, next_power_of_2(dv))


# CUDA blocks by head-dim bucket, from the H200 sweep (benchmarks/attention_tuning.py, bf16,
# S = 4096). Forward: ((held queries, streamed keys), warps, stages to try). Backward: ((dQ:
# held queries, streamed keys), (dK/dV: held keys, streamed queries), warps, stages). At
# head dim 256 the backward holds 64 queries but only 32 keys: 64 keys' float32 dK and dV
# would not fit the registers of 4 warps.
CUDA_FORWARD = {64: ((128, 64), 4, (3, 2)), 128: ((128, 64), 8, (3, 2)),
                256: ((128, 64), 8, (2,))}
CUDA_BACKWARD = {64: ((64, 64), (64, 64), 4, (3, 2)), 128: ((64, 64), (64, 64), 4, (2,)),
                 256: ((64, 32), (32, 64), 4, (2,))}


def _shared_bytes(sides: Sequence[tuple[int, int]], block_d: int, block_dv: int, item: int,
                  stages: int, backward: bool) -> int:
    """Shared memory of the pass's largest kernel: per kernel, its streamed rows once per
    stage and its held rows once (forward: q held, k and v streamed; backward query side:
    q and dout held, k and v streamed; key side: k and v held, q and dout streamed). The
    model reproduces Triton's figures for the configurations the H200 sweep rejected."""
    width = (block_d + block_dv) * item
    held_width = width if backward else block_d * item
    return max(stages * streamed * width + held * held_width for held, streamed in sides)


def _fitted(side: tuple[int, int], held_rows: int, streamed_rows: int) -> tuple[int, int]:
    """A (held, streamed) pair shrunk to the rows there are, never below 16 (the dot's
    minimum)."""
    return (min(side[0], max(16, next_power_of_2(held_rows))),
            min(side[1], max(16, next_power_of_2(streamed_rows))))


def _tiles(sq: int, sk: int, d: int, dv: int, item: int, hardware: HardwareProfile,
           backward: bool, group: int = 1) -> list[Tiling]:
    """Each kernel holds rows on chip and streams others past them (it keeps its held block
    in registers and pipelines the streamed one): ``BLOCK_M`` queries held x ``BLOCK_N``
    keys streamed in the forward and for dQ; ``BLOCK_K`` keys held x ``BLOCK_Q`` queries
    streamed for dK and dV. On CUDA, the sweep's best per head-dim bucket
    (`CUDA_FORWARD`, `CUDA_BACKWARD`), fewer stages then smaller blocks while the shared
    memory does not fit; on Ascend 64 x 128 (larger blocks suit its cube unit); on the CPU
    (the interpreter) 64 x 1024. All shrink to the problem, never below 16. On CUDA each
    block level also lists the tensor-descriptor variants (``flash_tma``, and
    ``flash_tma_ws`` for the forward), after the pointer kernel: taken only when
    autotuning measures them faster.

    GQA packing (forward, option ``pack_gqa``): when the queries of all ``group`` heads
    that share a key/value head fit one query block (decoding), a program holds them
    together and reads each key block once for the group instead of once per head. (The
    tiling sees power-of-two buckets of the shapes: the grid and the launcher take the
    real group size.)"""
    block_d, block_dv = _head_blocks(d, dv)
    widest = max(block_d, block_dv)
    gpu = hardware.device_type == "cuda"
    if gpu:
        bucket = 64 if widest <= 64 else 128 if widest <= 128 else 256
        if backward:
            query_side, key_side, warps, stage_choices = CUDA_BACKWARD[bucket]
        else:
            query_side, warps, stage_choices = CUDA_FORWARD[bucket]
    else:
        # The interpreter's cost is per block operation, not per element: long streamed
        # blocks.
        query_side = (64, 1024) if hardware.device_type == "cpu" else (64, 128)
        key_side, warps, stage_choices = query_side, None, (1,)
    pack = group > 1 and sq * group <= query_side[0]
    sides = [_fitted(query_side, sq * (group if pack else 1), sk)]
    if backward:
        sides.append(_fitted(key_side, sk, sq))
    # Each level of blocks: the pointer kernel first (the choice without autotuning), then
    # on CUDA the descriptor variants for autotuning to measure (`opforge.core.autotune`).
    # Triton's warp specialization rejects 4 warps at these blocks: that variant takes 8.
    variants = [("flash", warps, stage_choices)]
    if gpu:
        variants.append(("flash_tma", warps, stage_choices))
        if not backward:
            variants.append(("flash_tma_ws", 8, (2,)))
    candidates = []
    while True:
        blocks = {"BLOCK_M": sides[0][0], "BLOCK_N": sides[0][1], "BLOCK_D": block_d,
                  "BLOCK_DV": block_dv}
        if backward:
            blocks.update(BLOCK_K=sides[1][0], BLOCK_Q=sides[1][1])
        for variant, variant_warps, stage_list in variants:
            for stages in stage_list:
                candidates.append(Tiling(
                    variant, blocks, _shared_bytes(sides, block_d, block_dv, item, stages,
                                                   backward),
                    double_buffered=False,
                    options={"warps": variant_warps, "stages": stages if gpu else None,
                             **({"pack_gqa": True} if pack else {})}))
        if all(block == 16 for side in sides for block in side):
            return candidates
        sides = [(max(16, held // 2), max(16, streamed // 2)) for held, streamed in sides]


# Rows of the split forward's merge kernel per program.
MERGE_ROWS = 64


def _key_splits(query_blocks: int, heads: int, keys: int, block_n: int,
                hardware: HardwareProfile) -> int:
    """Slices of the ``keys`` a query block sees in the forward (flash-decoding): when the
    query blocks of every head leave cores idle (decoding: a few queries over a long
    cache), each program takes one slice of the keys and a second kernel merges the
    slices by their log-sum-exp (`work_splits`: two programs a core, each slice at least 4
    key blocks long)."""
    return work_splits(query_blocks * heads, keys // block_n, hardware)


def _block_keys(tiling: Tiling, attrs: Attrs, h: int, hkv: int, sq: int, sk: int) -> int:
    """The keys the slices of a query block cover, from its first visible key block: all
    ``Sk``, or under a window the band its queries see (their spread, the window and a
    block of alignment; the kernel's `_key_ranges` stay within it)."""
    band, before, after = _reach(limits_of(attrs), sq, sk)
    if not band:
        return sk
    queries = cdiv(tiling.blocks["BLOCK_M"], _pack(tiling, h, hkv))
    return min(sk, max(0, queries + before + after) + tiling.blocks["BLOCK_N"])


def _tiling(inputs: Specs, outputs: Specs, attrs: Attrs, hardware: HardwareProfile
            ) -> list[Tiling]:
    b, h, hkv, sq, sk, d, dv = _shapes(*inputs[:3], "attention")
    tilings = _tiles(sq, sk, d, dv, inputs[0].itemsize, hardware, backward=False,
                     group=h // hkv)
    return [Tiling(t.variant, t.blocks, t.onchip_bytes, t.double_buffered,
                   {**t.options, "splits": _key_splits(
                       *_program_counts(t, b, h, hkv, sq),
                       _block_keys(t, attrs, h, hkv, sq, sk), t.blocks["BLOCK_N"], hardware)})
            for t in tilings]


def _pack(tiling: Tiling, h: int, hkv: int) -> int:
    """Query heads a forward block holds: the whole GQA group when the tiling packs."""
    return h // hkv if tiling.options.get("pack_gqa") else 1


def _program_counts(tiling: Tiling, b: int, h: int, hkv: int, sq: int) -> tuple[int, int]:
    """(query blocks, head groups) of the forward: with GQA packing a block holds the
    queries of a group's heads."""
    pack = _pack(tiling, h, hkv)
    return cdiv(sq * pack, tiling.blocks["BLOCK_M"]), b * h // pack


def _grid(tiling: Tiling, inputs: Specs, outputs: Specs, attrs: Attrs,
          hardware: HardwareProfile) -> tuple[int, ...]:
    """(query blocks, batch x head groups), each capped at the grid limit (programs loop);
    the launcher adds the key slices as a third dimension."""
    b, h, hkv, sq, _, _, _ = _shapes(*inputs[:3], "attention")
    blocks, groups = _program_counts(tiling, b, h, hkv, sq)
    return max(1, min(blocks, MAX_PROGRAMS)), max(1, min(groups, MAX_PROGRAMS))


def _key_slices(tiling: Tiling, keys: int) -> tuple[int, int]:
    """(keys a slice holds, slices that hold any) of a query block's ``keys``
    (`_block_keys`): whole key blocks per slice, as few slices as the tiling's ``splits``
    allow."""
    block_n = tiling.blocks["BLOCK_N"]
    blocks_per_split, slices = split_steps(cdiv(keys, block_n),
                                           tiling.options.get("splits", 1))
    return blocks_per_split * block_n, slices


def _kernel_costs(tiling: Tiling, grid: tuple[int, ...], inputs: Specs, outputs: Specs,
                  attrs: Attrs) -> dict[str, Cost]:
    """The forward kernel's cost, and with key slices the merge kernel's: the float32
    partials the first writes instead of out and lse, and the second reads back."""
    cost = _cost(inputs, outputs, attrs)
    b, h, hkv, sq, sk, _, dv = _shapes(*inputs[:3], "attention")
    _, slices = _key_slices(tiling, _block_keys(tiling, attrs, h, hkv, sq, sk))
    if slices <= 1:
        return {"_attention_forward_kernel": cost}
    rows = b * h * sq
    partials = 4 * slices * rows * (dv + 1)
    written = rows * (dv * inputs[0].itemsize + 4)
    return {"_attention_forward_kernel": Cost(cost.flops,
                                              cost.bytes_moved - written + partials),
            "_attention_merge_kernel": Cost(4 * slices * rows * dv, partials + written)}


def _workspace(tiling: Tiling, grid: tuple[int, ...], inputs: Specs, outputs: Specs,
               attrs: Attrs) -> int:
    """Split keys: float32 out and lse of every slice, ``slices · B·H·Sq·(Dv + 1) · 4``
    bytes."""
    splits = tiling.options.get("splits", 1)
    if splits == 1:
        return 0
    b, h, _, sq, _, _, dv = _shapes(*inputs[:3], "attention")
    return 4 * splits * b * h * sq * (dv + 1)


def _samples(dtype: torch.dtype, device: torch.device, generator: torch.Generator
             ) -> list[Case]:
    def x(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return random_input(shape, dtype, device, generator, scale=scale)

    def padding(b: int, h: int, sq: int, sk: int, valid: Sequence[int]) -> torch.Tensor:
        """A bool mask ``(B, H, Sq, Sk)`` hiding the keys of each batch entry past its
        valid length (a right-padded batch)."""
        lengths = torch.tensor(valid, device=device)[:, None, None, None]
        return (torch.arange(sk, device=device) < lengths).expand(b, h, sq, sk)

    def bias(*shape: int) -> torch.Tensor:
        """An additive mask: ALiBi-like slopes with a third of the keys hidden (-inf)."""
        drawn = random_input(shape, torch.float32, device, generator, scale=2.0)
        return drawn.masked_fill(drawn > 1.0, -math.inf).to(dtype)

    cases = [
        Case("b2h3_s37_d16", (x(2, 3, 37, 16), x(2, 3, 37, 16), x(2, 3, 37, 16), None)),
        Case("causal_s37", (x(1, 2, 37, 32), x(1, 2, 37, 32), x(1, 2, 37, 32), None),
             {"causal": True}),
        Case("gqa_4_over_2", (x(1, 4, 19, 64), x(1, 2, 45, 64), x(1, 2, 45, 64), None)),
        Case("causal_decode_sq3_sk70", (x(1, 2, 3, 64), x(1, 2, 70, 64), x(1, 2, 70, 64),
                                        None), {"causal": True}),
        Case("causal_sq_longer_than_sk", (x(1, 1, 40, 16), x(1, 1, 24, 16),
                                          x(1, 1, 24, 16), None), {"causal": True}),
        Case("d_v_differs_d100_dv40", (x(1, 2, 33, 100), x(1, 2, 29, 100), x(1, 2, 29, 40),
                                       None), {"scale": 0.05}),
        Case("d256", (x(1, 1, 20, 256), x(1, 1, 20, 256), x(1, 1, 20, 256), None)),
        Case("peaked_scores", (x(1, 2, 24, 32, scale=4.0), x(1, 2, 24, 32, scale=4.0),
                               x(1, 2, 24, 32), None), {"causal": True}),
        Case("transposed_q", (x(1, 17, 2, 32).transpose(1, 2), x(1, 2, 17, 32),
                              x(1, 2, 17, 32), None)),
        Case("zero_keys", (x(1, 2, 5, 16), x(1, 2, 0, 16), x(1, 2, 0, 16), None)),
        Case("zero_queries", (x(1, 2, 0, 16), x(1, 2, 9, 16), x(1, 2, 9, 16), None)),
        # Masks: padded keys (one entry with no valid key: its rows give 0), broadcast
        # over heads and queries, with GQA; an additive mask per head and query.
        Case("bool_padding_gqa", (x(3, 4, 21, 32), x(3, 2, 21, 32), x(3, 2, 21, 32),
                                  padding(3, 1, 1, 21, (21, 9, 0)))),
        Case("bool_padding_causal", (x(2, 2, 19, 16), x(2, 2, 19, 16), x(2, 2, 19, 16),
                                     padding(2, 1, 19, 19, (19, 6))), {"causal": True}),
        Case("additive_per_head", (x(1, 3, 23, 32), x(1, 3, 40, 32), x(1, 3, 40, 32),
                                   bias(1, 3, 23, 40))),
        Case("additive_float32_decode", (x(2, 4, 2, 64), x(2, 1, 70, 64), x(2, 1, 70, 64),
                                         bias(2, 1, 2, 70).float()), {"causal": True}),
        # Bands: a sliding window (Mistral's), one off the diagonal on both sides (CANN's
        # sparse mode 4), a window over padded keys in decoding.
        Case("sliding_window_gqa", (x(1, 4, 45, 32), x(1, 2, 45, 32), x(1, 2, 45, 32), None),
             {"causal": True, "window_left": 7}),
        Case("band_off_diagonal", (x(1, 2, 30, 16), x(1, 2, 50, 16), x(1, 2, 50, 16), None),
             {"window_left": 4, "window_right": -2}),
        Case("window_padding_decode", (x(2, 2, 3, 64), x(2, 2, 40, 64), x(2, 2, 40, 64),
                                       padding(2, 1, 1, 40, (40, 35))),
             {"causal": True, "window_left": 9}),
    ]
    return cases


def _sweep(kind: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
           generator: torch.Generator) -> list[Case]:
    """q, k and v drawn from the kind as ``(1, 2, S, D)``: S the shape's leading size (at
    most 130), D its last (at most 64; 16 for 1-D shapes); one plain and one causal case.
    Two kinds take their attention meaning: ``long_rows`` is a long context (3 queries
    over 65537 keys, one head, D = 16) and ``masked_rows`` is causal with ``Sq > Sk`` (the
    first queries see no key, the next ones part of the keys: -inf inputs would only make
    every score NaN)."""
    def draw(source: str, *size: int) -> torch.Tensor:
        return generate(source, size, dtype, device=device, generator=generator)

    if kind == "long_rows":
        q, k, v = draw("normal", 1, 1, 3, 16), draw("normal", 1, 1, LONG_ROW, 16), \
            draw("normal", 1, 1, LONG_ROW, 16)
        return [Case("", (q, k, v, None)), Case("causal", (q, k, v, None), {"causal": True})]
    seq, dim = min(shape[0], 130), (min(shape[-1], 64) if len(shape) > 1 else 16)
    if kind == "masked_rows":
        keys = max(1, seq // 2)
        return [Case("causal", (draw("normal", 1, 2, seq, dim), draw("normal", 1, 2, keys, dim),
                                draw("normal", 1, 2, keys, dim), None), {"causal": True})]
    q, k, v = (draw(kind, 1, 2, seq, dim) for _ in range(3))
    return [Case("", (q, k, v, None)), Case("causal", (q, k, v, None), {"causal": True})]


def _expand_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t.repeat_interleave(heads // t.shape[1], dim=1)


def visible_keys(sq: int, sk: int, limits: Limits, device: torch.device | str | None = None,
                 rows: slice | None = None) -> torch.Tensor | None:
    """``(Sq, Sk)`` bool, True where query ``i`` sees key ``j`` within the ``limits``
    (`key_limits`); only the query rows ``rows`` when given; None when nothing is
    hidden."""
    before, after = limits
    if before is None and after is None:
        return None
    first, stop = (0, sq) if rows is None else (rows.start, rows.stop)
    shift = (torch.arange(sk, device=device)[None, :]
             - torch.arange(first, stop, device=device)[:, None] - (sk - sq))
    seen = torch.ones_like(shift, dtype=torch.bool)
    if before is not None:
        seen &= shift >= -before
    if after is not None:
        seen &= shift <= after
    return seen


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, limits: Limits,
            scale: float | None, compute_dtype: torch.dtype, rows: slice | None = None,
            softcap: float | None = None, slopes: list[torch.Tensor] | None = None
            ) -> torch.Tensor:
    """Scaled scores in ``compute_dtype``, soft-capped (``softcap * tanh(s / softcap)``)
    when asked, plus an additive ``mask``, keys a boolean mask or the ``limits``
    (`key_limits`) hide at -inf; of the query rows ``rows`` only when given. ``slopes``
    receives the cap's derivative ``1 - tanh^2`` (1 without a cap)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    sq = q.shape[2]
    rows = slice(0, sq) if rows is None else rows
    q = q[:, :, rows].to(compute_dtype)
    k = _expand_heads(k, q.shape[1]).to(compute_dtype)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        tanh = torch.tanh(scores / softcap)
        scores = softcap * tanh
        if slopes is not None:
            slopes.append(1 - tanh * tanh)
    elif slopes is not None:
        slopes.append(torch.ones_like(scores))
    if mask is not None:
        mask = mask[:, :, rows] if mask.shape[2] > 1 else mask
        scores = scores.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool \
            else scores + mask.to(compute_dtype)
    seen = visible_keys(sq, k.shape[2], limits, q.device, rows)
    if seen is not None:
        scores = scores.masked_fill(~seen, -math.inf)
    return scores


# The torch backend's score matrices hold at most this many elements at a time.
REFERENCE_CHUNK_ELEMENTS = 2**24


def _query_chunks(q: torch.Tensor, sk: int) -> list[slice]:
    """Query-row slices whose score matrices (every batch and head) hold at most
    `REFERENCE_CHUNK_ELEMENTS`: the torch backend's memory stays bounded in Sq x Sk."""
    b, h, sq = q.shape[:3]
    rows = max(1, REFERENCE_CHUNK_ELEMENTS // max(1, b * h * sk))
    return [slice(start, min(sq, start + rows)) for start in range(0, sq, rows)]


def _probabilities(scores: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``exp(scores - lse)``, 0 in the rows that see no key (lse -inf, where the difference
    is NaN); a NaN the inputs put in a row's scores or lse spreads over the row, as in the
    kernels."""
    return torch.where(lse == -math.inf, 0.0, torch.exp(scores - lse))


def _attention_scale(opdef: OpDef, inputs: Sequence[torch.Tensor | None], attrs: Attrs,
                     golden: torch.Tensor, output: str) -> torch.Tensor:
    """The magnitudes the output's rounding errors scale with, in float64. ``P @ V``
    rounds terms of size ``sum_j p_j |v_j|``; a score error ``e_j`` (relative to
    ``|scale| sum_d |q_d k_jd|``) moves ``out`` by ``sum_j p_j e_j (v_j - out)`` and
    ``lse`` by ``sum_j p_j e_j``. Rows that see no key get 1."""
    q, k, v, mask = inputs[:4]
    scores = _scores(q, k, mask, limits_of(attrs), attrs["scale"], torch.float64,
                     softcap=attrs["softcap"])
    lse = torch.logsumexp(scores, -1, keepdim=True)
    p = _probabilities(scores, lse)
    scale = abs(q.shape[-1] ** -0.5 if attrs["scale"] is None else attrs["scale"])
    magnitude = torch.matmul(q.abs(), _expand_heads(k, q.shape[1]).abs().transpose(-1, -2))
    weighted = p * magnitude * scale
    if output == "lse":
        result = lse[..., 0].abs() + weighted.sum(-1)
    else:
        values = _expand_heads(v, q.shape[1])
        out = torch.matmul(p, values)
        spread = (values[:, :, None, :, :] - out[:, :, :, None, :]).abs()
        result = torch.matmul(p, values.abs()) \
            + (weighted[..., None] * spread).sum(-2)
    return torch.where(torch.isfinite(result) & (result > 0), result,
                       torch.ones_like(result))


def _torch_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: torch.Tensor | None, causal: bool, scale: float | None,
                     window_left: int | None = None, window_right: int | None = None,
                     softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """torch SDPA (the bottom-right causal mask and the window given explicitly, combined
    with ``mask``) and logsumexp of the scores in the inputs' dtype; with a soft cap,
    which SDPA has not, the eager softmax of the capped scores in the inputs' dtype."""
    if softcap is not None:
        out, lse = reference(q, k, v, mask, compute_dtype=q.dtype, causal=causal, scale=scale,
                             window_left=window_left, window_right=window_right,
                             softcap=softcap)
        return out, lse.float()
    heads = q.shape[1]
    keys, values = _expand_heads(k, heads), _expand_heads(v, heads)
    combined = mask.to(q.dtype) if mask is not None and mask.dtype != torch.bool else mask
    limits = key_limits(causal, window_left, window_right)
    visible = visible_keys(q.shape[2], k.shape[2], limits, q.device)
    if visible is not None:
        combined = visible if combined is None else (
            combined & visible if combined.dtype == torch.bool
            else combined.masked_fill(~visible, -math.inf))
    out = torch.nn.functional.scaled_dot_product_attention(q, keys, values,
                                                           attn_mask=combined, scale=scale)
    scores = _scores(q, k, mask, limits, scale, q.dtype)
    lse = torch.logsumexp(scores.float(), -1)
    # SDPA gives NaN for a query that sees no key; opforge gives 0.
    return torch.where((lse == -math.inf)[..., None], 0.0, out).to(q.dtype), lse


CANCELLING_TERMS = KnownLimitation(
    "Elements whose exact value cancels (an output sum p v near zero; a gradient the "
    "softmax Jacobian annihilates, e.g. dS = 0 exactly for a query that sees one key) are "
    "rounding noise for opforge and torch alike, so relative-error ratios to torch's peer "
    "are luck there. opforge rounds P (and dS) to the input dtype for the tensor-core "
    "products, as FlashAttention does, while torch's peer may keep them in float32 (SDPA's "
    "math path on a GPU). Every element stays within the dtype's eps bound of its terms' "
    "magnitude (the error scale).",
    failures=("max_rel ratio*", "mean_rel ratio*", "small_value ratio*"))
OVERFLOWING_SCORES = KnownLimitation(
    "Scores accumulate in float32: inputs near the dtype's maximum give q.k beyond float32's "
    "range (Inf, then NaN or 0 in the softmax) where the float64 golden is finite; torch's "
    "attention overflows alike on some backends.", case="large_*",
    failures=("*NaN/Inf*", "max_rel ratio*", "mean_rel ratio*", "rmse ratio*",
              "small_value ratio*"))
SUBNORMAL_MEANS = KnownLimitation(
    "Inputs near the smallest normal number: the scores are ~0 and every output is a mean "
    "of subnormal values, whose division by the row sum rounds with a bias (error balance "
    "up to 0.3) while each element stays within 1.2 eps; relative to a cancelling "
    "element's tiny golden that is a large relative error.", case="tiny_*",
    failures=("eb ratio*", "max_rel ratio*", "mean_rel ratio*"))
RECOMPUTED_EXPONENTS = KnownLimitation(
    "The backward recomputes P = exp(S - lse) in float32: with outliers of 1e4 in q and k "
    "the scores reach ~1e7, where the float32 rounding of S and lse (eps |S| ~ 1) is an "
    "O(1) error in the exponent. FlashAttention's backward shares this; torch's autograd "
    "differentiates the stored softmax instead.", case="outliers_*",
    failures=("max_rel ratio*", "mean_rel ratio*", "rmse ratio*", "small_value ratio*"))

def _bench_case(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                generator: torch.Generator) -> Case:
    """Causal self-attention with q, k and v of ``shape = (B, H, S, D)``."""
    q, k, v = (generate("normal", shape, dtype, device=device, generator=generator)
               for _ in range(3))
    return Case("causal", (q, k, v, None), {"causal": True})


ATTENTION = OpDef(
    name="attention", doc="Flash-style scaled dot-product attention [B, H, S, D] with GQA "
                          "and bottom-right causal masking; out and the float32 lse.",
    inputs=(TensorArg("q"), TensorArg("k"), TensorArg("v"), MASK),
    outputs=(OutputArg("out"), OutputArg("lse")), attrs=ATTRS,
    infer_shape=_infer_shape, infer_dtype=_infer_dtype, check=_check, cost=_cost,
    tiling=_tiling, grid=_grid, workspace=_workspace, kernel_costs=_kernel_costs,
    samples=_samples, error_scale=_attention_scale,
    precision=PrecisionSpec("benchmark_ratio", "L0", _torch_attention, sweep=_sweep,
                            known_limitations=(CANCELLING_TERMS, OVERFLOWING_SCORES,
                                               SUBNORMAL_MEANS)),
    bench=BenchSpec(shapes=((4, 32, 1024, 128), (4, 32, 4096, 128), (4, 16, 4096, 64)),
                    cpu_shapes=((1, 4, 128, 64), (1, 4, 512, 64)), case=_bench_case,
                    metric="TFLOP/s"))


def _check_backward(inputs: Specs, attrs: Attrs) -> None:
    dout, q, k, v, out, lse, grad_lse, mask = inputs
    op = "attention_backward"
    check_scalar(op, "scale", attrs["scale"], inputs)
    check_softcap(op, attrs, inputs)
    _same_dtype(op, q, (("k", k), ("v", v), ("dout", dout), ("out", out)))
    check_statistics(op, q, [("lse", lse), ("grad_lse", grad_lse)])
    if any(is_unknown_rank(t.shape) for t in inputs if t is not None):
        return
    b, h, _, sq, sk, _, dv = _shapes(q, k, v, op)
    _check_mask(op, q, mask, (b, h, sq, sk))
    for name, spec, shape in (("dout", dout, (b, h, sq, dv)), ("out", out, (b, h, sq, dv)),
                              ("lse", lse, (b, h, sq)), ("grad_lse", grad_lse, (b, h, sq))):
        if spec is not None and tuple(spec.shape) != shape:
            raise ShapeError("has the wrong shape", op=op, param=name, expected=shape,
                             got=tuple(spec.shape))


def _backward_shapes(inputs: Specs, attrs: Attrs) -> list[tuple[int, ...]]:
    return [tuple(inputs[i].shape) for i in (1, 2, 3)]


def _backward_dtypes(inputs: Specs, attrs: Attrs) -> list[torch.dtype]:
    return [inputs[i].dtype for i in (1, 2, 3)]


def _backward_sides(inputs: Specs, attrs: Attrs) -> dict[str, Cost]:
    """Per visible pair, the query side computes S, dP and dQ (2D + Dv multiply-adds) and the
    key side S, dV, dP and dK (2D + 2Dv); the query side reads q, dout, out, lse and every
    key and value once and writes dq and delta, the key side reads q, dout, lse, delta and
    every key and value, and writes dk and dv; each reads the mask."""
    b, h, hkv, sq, sk, d, dv = _shapes(*inputs[1:4], "attention_backward")
    pairs = b * h * _visible_pairs(sq, sk, limits_of(attrs))
    item = inputs[1].itemsize
    statistics = 2 * b * h * sq * 4 + _mask_bytes(inputs[7])
    keys = b * hkv * sk * (d + dv) * item
    return {"_attention_query_side_kernel": Cost(
                2 * pairs * (2 * d + dv), b * h * sq * (2 * d + 2 * dv) * item + keys + statistics),
            "_attention_key_side_kernel": Cost(
                2 * pairs * (2 * d + 2 * dv), b * h * sq * (d + dv) * item + statistics + 2 * keys)}


def _backward_kernel_costs(tiling: Tiling, grid: tuple[int, ...], inputs: Specs,
                           outputs: Specs, attrs: Attrs) -> dict[str, Cost]:
    """The dQ and dK/dV kernels' costs (`_backward_sides`), whatever the tiling."""
    return _backward_sides(inputs, attrs)


def _backward_cost(inputs: Specs, outputs: Specs, attrs: Attrs) -> Cost:
    """The two kernels' products (S and dP recomputed on each side: 4D + 3Dv multiply-adds
    per visible pair); every input read once and the gradients written once (the kernels
    each read the keys, the values and the mask: the sum of their bytes counts those
    twice)."""
    b, h, hkv, sq, sk, d, dv = _shapes(*inputs[1:4], "attention_backward")
    item = inputs[1].itemsize
    query_side = b * h * sq * (2 * d + 2 * dv) * item + 2 * b * h * sq * 4
    key_side = b * hkv * sk * 2 * (d + dv) * item + _mask_bytes(inputs[7])
    flops = sum(cost.flops for cost in _backward_sides(inputs, attrs).values())
    return Cost(flops=flops, bytes_moved=query_side + key_side)


def _backward_tiling(inputs: Specs, outputs: Specs, attrs: Attrs, hardware: HardwareProfile
                     ) -> list[Tiling]:
    _, _, _, sq, sk, d, dv = _shapes(*inputs[1:4], "attention_backward")
    return _tiles(sq, sk, d, dv, inputs[1].itemsize, hardware, backward=True)


def _backward_grid(tiling: Tiling, inputs: Specs, outputs: Specs, attrs: Attrs,
                   hardware: HardwareProfile) -> tuple[int, ...]:
    """The dQ kernel's grid; the dK/dV kernel runs over key blocks and key/value heads."""
    return _grid(tiling, inputs[1:4], outputs, attrs, hardware)


def _backward_workspace(tiling: Tiling, grid: tuple[int, ...], inputs: Specs, outputs: Specs,
                        attrs: Attrs) -> int:
    """float32 ``delta`` per query row."""
    b, h, sq = inputs[1].shape[:3]
    return 4 * b * h * sq


def _backward_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: torch.Tensor | None, causal: bool, scale: float | None,
                     window_left: int | None, window_right: int | None,
                     generator: torch.Generator, with_grad_lse: bool = False,
                     softcap: float | None = None) -> tuple[torch.Tensor | None, ...]:
    """(dout, q, k, v, out, lse, grad_lse, mask): out and lse from the float64 forward
    rounded to their dtypes, dout drawn like q."""
    out, lse = reference(q.double(), k.double(), v.double(), mask, compute_dtype=torch.float64,
                         causal=causal, scale=scale, window_left=window_left,
                         window_right=window_right, softcap=softcap)
    dout = torch.randn(out.shape, generator=generator).to(q.device, q.dtype)
    statistics = statistics_dtype(q.dtype)
    grad_lse = torch.randn(lse.shape, generator=generator).to(q.device, statistics) \
        if with_grad_lse else None
    return dout, q, k, v, out.to(q.dtype), lse.to(statistics), grad_lse, mask


def _backward_samples(dtype: torch.dtype, device: torch.device, generator: torch.Generator
                      ) -> list[Case]:
    cases = []
    for case in _samples(dtype, device, generator):
        attrs = ATTENTION.bind_attrs(case.attrs)
        cases.append(Case(case.name, _backward_inputs(*case.inputs, **attrs,
                                                      generator=generator), case.attrs))
    q, k, v = (random_input((1, 2, 21, 32), dtype, device, generator, scale=1.0)
               for _ in range(3))
    cases.append(Case("with_grad_lse", _backward_inputs(q, k, v, None, True, None, None,
                                                        None, generator, True),
                      {"causal": True}))
    return cases


def _backward_sweep(kind: str, shape: tuple[int, ...], dtype: torch.dtype,
                    device: torch.device, generator: torch.Generator) -> list[Case]:
    """The forward's sweep cases with dout normal, out and lse from the float64 forward."""
    return [Case(case.name, _backward_inputs(*case.inputs, **ATTENTION.bind_attrs(case.attrs),
                                             generator=generator), case.attrs)
            for case in _sweep(kind, shape, dtype, device, generator)]


def _backward_scale(opdef: OpDef, inputs: Sequence[torch.Tensor | None], attrs: Attrs,
                    golden: torch.Tensor, output: str) -> torch.Tensor:
    """The gradient formulas evaluated on magnitudes (``|dP| + |delta|`` in ``dS``), in
    float64: what each gradient's rounding errors are relative to."""
    wide = [t if t is None or t.dtype == torch.bool else t.to(torch.float64) for t in inputs]
    grads = _backward_terms(*wide, compute_dtype=torch.float64, magnitudes=True, **attrs)
    result = grads[("grad_q", "grad_k", "grad_v").index(output)]
    return torch.where(result > 0, result, torch.ones_like(result))


def _torch_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                              v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                              grad_lse: torch.Tensor | None, mask: torch.Tensor | None,
                              causal: bool, scale: float | None,
                              window_left: int | None = None, window_right: int | None = None,
                              softcap: float | None = None) -> tuple[torch.Tensor, ...]:
    """torch.autograd through SDPA and logsumexp in the inputs' dtype"""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with torch.enable_grad():
        out, lse = _torch_attention(*leaves, mask, causal, scale, window_left, window_right,
                                    softcap)
        grads = [dout] if grad_lse is None else [dout, grad_lse]
        return torch.autograd.grad((out, lse)[:len(grads)], leaves, grads)


ATTENTION_BACKWARD = OpDef(
    name="attention_backward", doc="Gradients of attention by recomputation from the saved "
                                   "lse; valid on one key block at a time.",
    inputs=(TensorArg("dout"), TensorArg("q"), TensorArg("k"), TensorArg("v"),
            TensorArg("out"), TensorArg("lse", dtypes=STATISTICS_DTYPES),
            TensorArg("grad_lse", dtypes=STATISTICS_DTYPES, optional=True), MASK),
    outputs=(OutputArg("grad_q"), OutputArg("grad_k"), OutputArg("grad_v")),
    attrs=ATTRS, infer_shape=_backward_shapes, infer_dtype=_backward_dtypes,
    check=_check_backward, cost=_backward_cost, tiling=_backward_tiling, grid=_backward_grid,
    workspace=_backward_workspace, kernel_costs=_backward_kernel_costs,
    samples=_backward_samples, error_scale=_backward_scale,
    precision=PrecisionSpec("benchmark_ratio", "L0", _torch_attention_backward,
                            sweep=_backward_sweep, known_limitations=(
                                CANCELLING_TERMS, OVERFLOWING_SCORES, SUBNORMAL_MEANS,
                                RECOMPUTED_EXPONENTS, SHARED_ROW_STATISTIC)))


# ---------------------------------------------------------------------------------------------
# References


@ATTENTION.reference
def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              *, compute_dtype: torch.dtype, causal: bool, scale: float | None,
              window_left: int | None = None, window_right: int | None = None,
              softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax(q k^T scale) v`` (the scores soft-capped first with ``softcap``) and the
    row log-sum-exp in ``compute_dtype``, the score matrix of a bounded chunk of query rows
    at a time (`_query_chunks`)."""
    limits = key_limits(causal, window_left, window_right)
    values = _expand_heads(v, q.shape[1]).to(compute_dtype)
    out = values.new_empty((*q.shape[:3], v.shape[3]))
    lse = values.new_empty(q.shape[:3])
    for rows in _query_chunks(q, k.shape[2]):
        scores = _scores(q, k, mask, limits, scale, compute_dtype, rows, softcap)
        lse[:, :, rows] = _undefined_as_nan(torch.logsumexp(scores, -1))
        out[:, :, rows] = torch.matmul(_probabilities(scores, lse[:, :, rows, None]), values)
    return out, lse


def _undefined_as_nan(lse: torch.Tensor) -> torch.Tensor:
    """A row with a +inf score (an overflowed q.k, or an infinite input) has no softmax:
    its out is NaN (inf / inf) and so is its lse here, as in the kernels, where the online
    maximum turns ``s - m`` into inf - inf. logsumexp alone would say +inf."""
    return torch.where(lse == math.inf, math.nan, lse)


def _backward_terms(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, grad_lse: torch.Tensor | None,
                    mask: torch.Tensor | None, *, compute_dtype: torch.dtype, causal: bool,
                    scale: float | None, window_left: int | None = None,
                    window_right: int | None = None, softcap: float | None = None,
                    magnitudes: bool = False) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) from the given ``out`` and ``lse``, as the kernels compute them, a
    bounded chunk of query rows at a time (dK and dV summed over the chunks; the score
    gradient through the soft cap's slope); ``magnitudes``: every term by its absolute
    value."""
    heads, group = q.shape[1], q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dout, q, out, lse = (t.to(compute_dtype) for t in (dout, q, out, lse))
    keys = _expand_heads(k, heads).to(compute_dtype)
    values = _expand_heads(v, heads).to(compute_dtype)
    if magnitudes:
        delta = (dout * out).abs().sum(-1) + (0 if grad_lse is None else grad_lse.abs())
        terms = [t.abs() for t in (dout, q, keys, values)]
    else:
        delta = (dout * out).sum(-1) - (0 if grad_lse is None else grad_lse.to(compute_dtype))
        terms = [dout, q, keys, values]
    dout_terms, q_terms, key_terms, value_terms = terms
    term_scale = abs(scale) if magnitudes else scale
    grad_q = torch.empty_like(q)
    grad_k, grad_v = torch.zeros_like(keys), torch.zeros_like(values)
    for rows in _query_chunks(q, k.shape[2]):
        slopes: list[torch.Tensor] = []
        p = _probabilities(_scores(q, k, mask, key_limits(causal, window_left, window_right),
                                   scale, compute_dtype, rows, softcap, slopes),
                           lse[:, :, rows, None])
        if magnitudes:
            # A score error e |scale| sum_d |q_d k_d| moves p_j by p_j (e_j - sum p e):
            # weight p by 1 + that magnitude, the first-order amplification of the scores'
            # rounding.
            spread = torch.matmul(q_terms[:, :, rows], key_terms.transpose(-1, -2)) * abs(scale)
            p = p * (1 + spread + (p * spread).sum(-1, keepdim=True))
        products = torch.matmul(dout_terms[:, :, rows], value_terms.transpose(-1, -2))
        ds = p * slopes[0] * (products + delta[:, :, rows, None] if magnitudes
                              else products - delta[:, :, rows, None])
        grad_q[:, :, rows] = torch.matmul(ds, key_terms) * term_scale
        grad_k += torch.matmul(ds.transpose(-1, -2), q_terms[:, :, rows]) * term_scale
        grad_v += torch.matmul(p.transpose(-1, -2), dout_terms[:, :, rows])

    def per_kv_head(t: torch.Tensor) -> torch.Tensor:
        return t.unflatten(1, (heads // group, group)).sum(2)

    return grad_q, per_kv_head(grad_k), per_kv_head(grad_v)


@ATTENTION_BACKWARD.reference
def backward_reference(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, grad_lse: torch.Tensor | None,
                       mask: torch.Tensor | None, *, compute_dtype: torch.dtype, causal: bool,
                       scale: float | None, window_left: int | None = None,
                       window_right: int | None = None, softcap: float | None = None
                       ) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) in ``compute_dtype`` from the saved ``out`` and ``lse``."""
    return _backward_terms(dout, q, k, v, out, lse, grad_lse, mask,
                           compute_dtype=compute_dtype, causal=causal, scale=scale,
                           window_left=window_left, window_right=window_right,
                           softcap=softcap)


# ---------------------------------------------------------------------------------------------
# Kernels

if triton is not None:
    LN2 = tl.constexpr(0.6931471805599453)
    LOG2E = tl.constexpr(LOG2_E)
    NEG_INF = tl.constexpr(float("-inf"))
    POS_INF = tl.constexpr(float("inf"))

    @triton.jit
    def _key_ranges(first_query, last_query, Sk, offset, before, after, BAND: tl.constexpr,
                    BLOCK_N: tl.constexpr):
        """(start, full_start, full_end, end) of the keys the queries ``first_query`` to
        ``last_query`` see: the key blocks in [full_start, full_end) are seen entirely by
        every query of the block (no mask); [start, min(full_start, end)) and
        [max(full_end, full_start), end) need the mask. With ``BAND``, query ``i`` sees
        keys ``i + offset - before`` to ``i + offset + after`` (`_reach`). Bounds clamp to
        0 before a division: integer division truncates toward zero."""
        start = 0
        full_start = 0
        full_end = (Sk // BLOCK_N) * BLOCK_N
        end = Sk
        if BAND:
            end = tl.minimum(tl.maximum(last_query + offset + after + 1, 0), Sk)
            start = (tl.maximum(first_query + offset - before, 0) // BLOCK_N) * BLOCK_N
            # A last block's rows past Sq see what the last query sees, no more.
            last_diagonal = tl.minimum(last_query + offset, Sk - 1)
            full_start = tl.maximum(
                tl.cdiv(tl.maximum(last_diagonal - before, 0), BLOCK_N) * BLOCK_N, start)
            full_end = tl.minimum(
                full_end, (tl.maximum(first_query + offset + after + 1, 0) // BLOCK_N) * BLOCK_N)
        return start, full_start, full_end, end

    @triton.jit
    def _query_ranges(first_key, last_key, Sq, offset, before, after, BAND: tl.constexpr,
                      BLOCK_Q: tl.constexpr):
        """`_key_ranges` seen from the keys: (start, full_start, full_end, end) of the
        queries that see the keys ``first_key`` to ``last_key``; [full_start, full_end)
        see all of them. Queries past ``Sq`` read lse +inf (P = 0): the full range may run
        to ``Sq`` unmasked."""
        start = 0
        full_start = 0
        full_end = Sq
        end = Sq
        if BAND:
            end = tl.minimum(tl.maximum(last_key - offset + before + 1, 0), Sq)
            start = (tl.maximum(first_key - offset - after, 0) // BLOCK_Q) * BLOCK_Q
            full_start = tl.maximum(
                tl.cdiv(tl.maximum(last_key - offset - after, 0), BLOCK_Q) * BLOCK_Q, start)
            reach = first_key - offset + before + 1  # queries below it see first_key
            full_end = tl.where(reach >= Sq, Sq,
                                (tl.maximum(reach, 0) // BLOCK_Q) * BLOCK_Q)
        return start, full_start, full_end, end

    @triton.jit
    def _two_ranges(step, first_start, first_steps, second_start, BLOCK: tl.constexpr):
        """The first column of loop step ``step`` over two block ranges: ``first_steps``
        blocks from ``first_start``, then blocks from ``second_start`` (a band's masked
        blocks lie on both sides of its unmasked ones: one loop, one inlined body)."""
        return tl.where(step < first_steps, first_start + step * BLOCK,
                        second_start + (step - first_steps) * BLOCK)

    @triton.jit
    def _rows_of(cu_ptr, index, total, VARLEN: tl.constexpr):
        """(first row, rows) of sequence ``index`` of packed sequences, from the cumulative
        lengths at ``cu_ptr`` clamped to the ``total`` rows (lengths the host did not check
        read and write nothing out of bounds); without ``VARLEN``, all ``total`` rows."""
        if VARLEN:
            # Clamped in the lengths' own dtype (int32 or int64), then narrowed.
            first = tl.load(cu_ptr + index)  # integer index
            last = tl.load(cu_ptr + index + 1)  # integer index
            start = tl.minimum(tl.maximum(first, 0), total)
            end = tl.minimum(tl.maximum(last, start), total)
            return start.to(tl.int64), (end - start).to(tl.int32)
        else:
            return 0, total

    @triton.jit
    def _sequence(cu_q_ptr, cu_k_ptr, batch, Sq, Sk, VARLEN: tl.constexpr):
        """(first query row, queries, first key row, keys) of batch entry ``batch``: with
        ``VARLEN`` a packed sequence (`_rows_of`), else all ``Sq`` and ``Sk`` rows."""
        q_start, queries = _rows_of(cu_q_ptr, batch, Sq, VARLEN)
        k_start, keys = _rows_of(cu_k_ptr, batch, Sk, VARLEN)
        return q_start, queries, k_start, keys

    @triton.jit
    def _heavy_first(index, blocks, BAND: tl.constexpr):
        """The query block that program slot ``index`` takes: under a causal mask the last
        blocks see the most keys, so with a band they go first and the light ones fill the
        tail of the grid (programs start in index order); without it, in order."""
        if BAND:
            return blocks - 1 - index
        else:
            return index

    @triton.jit
    def _visible(rows, cols, Sk, offset, before, after, BAND: tl.constexpr):
        """Which (query, key) pairs are seen; ``rows`` and ``cols`` already broadcast to
        the tile's orientation (queries x keys, or keys x queries on the key side)."""
        visible = cols < Sk
        if BAND:
            diagonal = rows + offset
            visible = visible & (cols <= diagonal + after) & (cols >= diagonal - before)
        return visible

    @triton.jit
    def _score_bias(mask_rows, row_ok, cols, Sk, stride_mn, MASK: tl.constexpr,
                    TRANSPOSED: tl.constexpr):
        """The mask's term of a tile of log2-domain scores: 0 where a boolean mask (MASK 1)
        shows the key and -inf where it hides it, or an additive mask (MASK 2) times
        log2(e). ``mask_rows`` points at each query's row of the mask, ``row_ok`` says the
        query exists; queries x keys, or keys x queries when ``TRANSPOSED``."""
        if TRANSPOSED:
            ptrs = mask_rows[None, :] + cols[:, None] * stride_mn
            ok = row_ok[None, :] & (cols < Sk)[:, None]
        else:
            ptrs = mask_rows[:, None] + cols[None, :] * stride_mn
            ok = row_ok[:, None] & (cols < Sk)[None, :]
        if MASK == 1:
            seen = tl.load(ptrs, mask=ok, other=0) != 0  # boolean mask: compared, not computed
            bias = tl.where(seen, 0.0, NEG_INF)
        else:
            bias = widen(tl.load(ptrs, mask=ok, other=0.0)) * LOG2E
        return bias

    @triton.jit
    def _rows_block(base, desc, first, stride_row, stride_col, limit, width,
                    TRANSPOSED: tl.constexpr, DESCRIPTORS: tl.constexpr, UPCAST: tl.constexpr,
                    WIDE: tl.constexpr,
                    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
        """Rows [first, first + BLOCK_ROWS) x BLOCK_COLS columns of a ``limit x width``
        matrix as a dot operand, ``[BLOCK_ROWS, BLOCK_COLS]`` or ``TRANSPOSED``: by tensor
        descriptor (TMA copies; rows past limit and columns past width read 0) or by
        masked pointer loads (straight into the transposed layout when asked)."""
        if DESCRIPTORS:
            block = desc.load([first, 0])  # dot operand, kept in its dtype
            if UPCAST:
                block = widen(block)
            if TRANSPOSED:
                block = tl.trans(block)
        else:
            rows = first + tl.arange(0, BLOCK_ROWS)
            if WIDE:
                # Beyond 2^31 elements (a long sequence of packed rows H x D apart, a view
                # of long strides) the rows' offsets take 64 bits.
                rows = rows.to(tl.int64)
            cols = tl.arange(0, BLOCK_COLS)
            if TRANSPOSED:
                block = dot_operand(base + rows[None, :] * stride_row + cols[:, None]
                                    * stride_col,
                                    (rows < limit)[None, :] & (cols < width)[:, None], UPCAST)
            else:
                block = dot_operand(base + rows[:, None] * stride_row + cols[None, :]
                                    * stride_col,
                                    (rows < limit)[:, None] & (cols < width)[None, :], UPCAST)
        return block

    @triton.jit
    def _capped(scores, SOFTCAP: tl.constexpr):
        """``SOFTCAP * tanh(scores / SOFTCAP)`` (scores and cap in the log2 domain) and its
        slope ``1 - tanh^2``. tanh of ``|y| >= 1/8`` from one exp2 of ``-2|y|`` (±inf gives
        ±cap, no overflow, NaN kept); below, where ``1 - exp`` would cancel, its odd series
        to ``y^7`` (the next term is 1e-9 of it): no expm1 or tanh on every backend. (An odd
        rational tanh on one path spilled more at sm_90: 32 sample variants against 25.)"""
        y = scores * (1.0 / SOFTCAP)
        e = tl.exp2(tl.abs(y) * (-2.0 * LOG2E))
        t = (1.0 - e) / (1.0 + e)
        y2 = y * y
        series = y * (1.0 - y2 * (1.0 / 3.0 - y2 * (2.0 / 15.0 - y2 * (17.0 / 315.0))))
        t = tl.where(tl.abs(y) < 0.125, series, tl.where(y < 0, -t, t))
        return SOFTCAP * t, 1.0 - t * t

    @triton.jit
    def _forward_step(acc, m_i, l_i, q, k_base, v_base, k_desc, v_desc, stride_kn,
                      stride_kd, stride_vn, stride_vd, rows, first_col, Sk, offset, before,
                      after, D, DV, qk_scale, mask_rows, row_ok, stride_mn, MASK: tl.constexpr,
                      SOFTCAP: tl.constexpr,
                      BAND: tl.constexpr, MASKED: tl.constexpr,
                      UPCAST: tl.constexpr, PRECISION: tl.constexpr, WIDE: tl.constexpr,
                      DESCRIPTORS: tl.constexpr, FOLD_SCALE: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
        """One key block of the online softmax: scores in the log2 domain (scale * log2(e)
        applied in float32, then exp2), float32 running max ``m_i`` and sum ``l_i``. With
        ``FOLD_SCALE`` (a positive scale, which commutes with the max) the block's max is
        taken of the raw products and scaled once per row, and each score's scaling and
        subtraction of the max are one FMA: one float32 operation less per score, the
        unit that bounds the loop beside the tensor cores (a ``MASK``, added to the scaled
        scores, rules the fold out)."""
        keys_t = _rows_block(k_base, k_desc, first_col, stride_kn, stride_kd, Sk, D, True,
                             DESCRIPTORS, UPCAST, WIDE, BLOCK_N, BLOCK_D)
        values = _rows_block(v_base, v_desc, first_col, stride_vn, stride_vd, Sk, DV, False,
                             DESCRIPTORS, UPCAST, WIDE, BLOCK_N, BLOCK_DV)
        scores = tl.dot(q, keys_t, input_precision=PRECISION)
        if FOLD_SCALE:
            fold = qk_scale
        else:
            scores = scores * qk_scale
            fold = 1.0
        if SOFTCAP != 0:  # the launcher folds no scale then
            scores, _ = _capped(scores, SOFTCAP)
        if MASK != 0:
            scores += _score_bias(mask_rows, row_ok, first_col + tl.arange(0, BLOCK_N), Sk,
                                  stride_mn, MASK, False)
        if MASKED:
            cols = first_col + tl.arange(0, BLOCK_N)
            scores = tl.where(_visible(rows[:, None], cols[None, :], Sk, offset, before,
                                       after, BAND), scores, NEG_INF)
        m_new = tl.maximum(m_i, tl.max(scores, 1) * fold)
        # A row with no visible key yet keeps max -inf; 0 avoids -inf - -inf.
        m_safe = tl.where(m_new == NEG_INF, 0.0, m_new)
        p = tl.exp2(scores * fold - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(as_dot_operand(p, v_base, UPCAST), values,
                                            input_precision=PRECISION)
        return acc, m_new, l_i

    @triton.jit
    def _forward_keys(acc, m_i, l_i, q, k_base, v_base, k_desc, v_desc, stride_kn,
                      stride_kd, stride_vn, stride_vd, rows, start, end, second_start,
                      second_end, Sk, offset, before, after, D, DV, qk_scale, mask_rows,
                      row_ok, stride_mn, MASK: tl.constexpr, SOFTCAP: tl.constexpr,
                      BAND: tl.constexpr,
                      MASKED: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                      WIDE: tl.constexpr, DESCRIPTORS: tl.constexpr,
                      WARP_SPECIALIZE: tl.constexpr, FOLD_SCALE: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
        """The online softmax over the key blocks in [start, end); when ``MASKED``, those in
        [second_start, second_end) too with a ``BAND`` (its masked blocks on both edges),
        else only those (the tail past the last full block). ``WARP_SPECIALIZE`` asks
        Triton to split the loop into producer (TMA copies) and consumer warps; the keyword
        exists only in Triton versions that have it, so the other loops never name it."""
        if WARP_SPECIALIZE:
            for first_col in tl.range(start, end, BLOCK_N, warp_specialize=True):
                acc, m_i, l_i = _forward_step(
                    acc, m_i, l_i, q, k_base, v_base, k_desc, v_desc, stride_kn, stride_kd,
                    stride_vn, stride_vd, rows, first_col, Sk, offset, before, after, D, DV,
                    qk_scale, mask_rows, row_ok, stride_mn, MASK, SOFTCAP, BAND, MASKED, UPCAST,
                    PRECISION, WIDE, DESCRIPTORS, FOLD_SCALE, BLOCK_N, BLOCK_D, BLOCK_DV)
        elif MASKED and BAND:
            first_steps = tl.cdiv(tl.maximum(end - start, 0), BLOCK_N)
            steps = first_steps + tl.cdiv(tl.maximum(second_end - second_start, 0), BLOCK_N)
            for step in range(0, steps):
                first_col = _two_ranges(step, start, first_steps, second_start, BLOCK_N)
                acc, m_i, l_i = _forward_step(
                    acc, m_i, l_i, q, k_base, v_base, k_desc, v_desc, stride_kn, stride_kd,
                    stride_vn, stride_vd, rows, first_col, Sk, offset, before, after, D, DV,
                    qk_scale, mask_rows, row_ok, stride_mn, MASK, SOFTCAP, BAND, MASKED, UPCAST,
                    PRECISION, WIDE, DESCRIPTORS, FOLD_SCALE, BLOCK_N, BLOCK_D, BLOCK_DV)
        else:
            if MASKED:  # no band: only the tail past the last full block
                start = second_start
                end = second_end
            for first_col in range(start, end, BLOCK_N):
                acc, m_i, l_i = _forward_step(
                    acc, m_i, l_i, q, k_base, v_base, k_desc, v_desc, stride_kn, stride_kd,
                    stride_vn, stride_vd, rows, first_col, Sk, offset, before, after, D, DV,
                    qk_scale, mask_rows, row_ok, stride_mn, MASK, SOFTCAP, BAND, MASKED, UPCAST,
                    PRECISION, WIDE, DESCRIPTORS, FOLD_SCALE, BLOCK_N, BLOCK_D, BLOCK_DV)
        return acc, m_i, l_i

    @triton.jit
    def _attention_forward_kernel(
            q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr, lse_ptr, cu_q_ptr, cu_k_ptr, Sq, Sk, H,
            GROUP, head_offset, heads, keys_per_split, qk_scale, before, after, stride_qb,
            stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
            stride_vb, stride_vh, stride_vn, stride_vd, stride_mb, stride_mh, stride_mm,
            stride_mn, D, DV, MASK: tl.constexpr, SOFTCAP: tl.constexpr, BAND: tl.constexpr,
            UPCAST: tl.constexpr,
            PRECISION: tl.constexpr,
            WIDE: tl.constexpr, DESCRIPTORS: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
            EXACT_HEAD: tl.constexpr, PACK: tl.constexpr, FOLD_SCALE: tl.constexpr,
            VARLEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
        """Per block of ``BLOCK_M`` rows and one slice of the keys (``program_id(2)``; one
        slice holding every key the block sees unless the keys are split; slices count
        from the block's first visible key block): out and lse of the slice, into
        ``out``/``lse`` or, split, into the float32 partials of slice ``program_id(2)``
        (laid out ``[slices, heads, Sq, DV]`` and ``[slices, heads, Sq]``). A program's
        rows are the queries of one head, or with ``PACK`` > 1 (GQA decoding) the queries
        of ``PACK`` heads that share a key/value head, query-major (row ``r``: query
        ``r // PACK`` of head ``r % PACK`` of the group): each key block is then read once
        for all of them. With ``VARLEN`` the batch entries are packed sequences (rows
        ``cu[b]`` to ``cu[b + 1]`` of ``[T, H, D]`` tensors, batch strides 0): out is
        written ``[T, H, DV]`` and lse ``[H, T]``."""
        if EXACT_HEAD:
            # The blocks are as wide as the heads: head widths as constants fold the
            # column masks away (fewer registers: the pointer kernels spill less).
            D = BLOCK_D
            DV = BLOCK_DV
        # program_id(1): one head, or one group of PACK heads, of one batch entry.
        group_index = (tl.program_id(1) + head_offset).to(tl.int64)
        batch = group_index // (H // PACK)
        first_head = (group_index % (H // PACK)) * PACK
        total_q = Sq
        q_start, Sq, k_start, Sk = _sequence(cu_q_ptr, cu_k_ptr, batch, Sq, Sk, VARLEN)
        q_base = q_ptr + batch * stride_qb + q_start * stride_qm
        k_base = k_ptr + batch * stride_kb + k_start * stride_kn \
            + (first_head // GROUP) * stride_kh
        v_base = v_ptr + batch * stride_vb + k_start * stride_vn \
            + (first_head // GROUP) * stride_vh
        k_desc, v_desc = descriptor_pair(k_base, Sk, D, stride_kn, v_base, Sk, DV, stride_vn,
                                         DESCRIPTORS, BLOCK_N, BLOCK_D, BLOCK_N, BLOCK_DV)
        # Output rows: head slot (slice, batch, head), then query.
        slot_base = tl.program_id(2) * heads + batch * H + first_head
        offset = Sk - Sq
        dims = tl.arange(0, BLOCK_D)
        value_dims = tl.arange(0, BLOCK_DV)
        blocks = tl.cdiv(Sq * PACK, BLOCK_M)
        for index in range(tl.program_id(0), blocks, tl.num_programs(0)):
            block = _heavy_first(index, blocks, BAND)
            first_row = block * BLOCK_M
            rows = first_row + tl.arange(0, BLOCK_M)
            if WIDE:
                rows = rows.to(tl.int64)
            queries = rows // PACK
            members = rows % PACK
            row_mask = rows < Sq * PACK
            q = dot_operand(q_base + (first_head + members)[:, None] * stride_qh
                            + queries[:, None] * stride_qm + dims[None, :] * stride_qd,
                            row_mask[:, None] & (dims < D)[None, :], UPCAST)
            mask_rows = mask_ptr + batch * stride_mb + (first_head + members) * stride_mh \
                + queries * stride_mm
            acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
            m_i = tl.full([BLOCK_M], NEG_INF, dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            start, full_start, full_end, end = _key_ranges(
                first_row // PACK, (first_row + BLOCK_M - 1) // PACK, Sk, offset, before,
                after, BAND, BLOCK_N)
            # The slice's share of each range (slices start on key-block boundaries).
            split_start = start + tl.program_id(2) * keys_per_split
            split_end = split_start + keys_per_split
            acc, m_i, l_i = _forward_keys(acc, m_i, l_i, q, k_base, v_base, k_desc, v_desc,
                                          stride_kn, stride_kd, stride_vn, stride_vd, queries,
                                          tl.maximum(full_start, split_start),
                                          tl.minimum(full_end, split_end), 0, 0, Sk, offset,
                                          before, after, D, DV, qk_scale, mask_rows, row_mask,
                                          stride_mn, MASK, SOFTCAP, BAND, False, UPCAST, PRECISION,
                                          WIDE, DESCRIPTORS, WARP_SPECIALIZE, FOLD_SCALE,
                                          BLOCK_N, BLOCK_D, BLOCK_DV)
            acc, m_i, l_i = _forward_keys(acc, m_i, l_i, q, k_base, v_base, k_desc, v_desc,
                                          stride_kn, stride_kd, stride_vn, stride_vd, queries,
                                          split_start,
                                          tl.minimum(tl.minimum(full_start, end), split_end),
                                          tl.maximum(tl.maximum(full_end, full_start),
                                                     split_start),
                                          tl.minimum(end, split_end), Sk, offset, before,
                                          after, D, DV, qk_scale, mask_rows, row_mask,
                                          stride_mn, MASK, SOFTCAP, BAND, True, UPCAST, PRECISION,
                                          WIDE, DESCRIPTORS, False, FOLD_SCALE, BLOCK_N,
                                          BLOCK_D, BLOCK_DV)
            # Rows that see no key have l_i 0 exactly; a NaN l_i (NaN in the inputs) stays.
            seen = l_i != 0
            out = acc / tl.where(seen, l_i, 1.0)[:, None]
            lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * LN2, NEG_INF)
            if VARLEN:
                out_rows = (q_start + queries) * H + first_head + members
                lse_rows = (first_head + members) * total_q + q_start + queries
            else:
                out_rows = (slot_base + members) * Sq + queries
                lse_rows = out_rows
            out_ptrs = out_ptr + out_rows[:, None] * DV + value_dims[None, :]
            out_mask = row_mask[:, None] & (value_dims < DV)[None, :]
            tl.store(out_ptrs, rounded_for(out, out_ptr), mask=out_mask)
            tl.store(lse_ptr + lse_rows, rounded_for(lse, lse_ptr), mask=row_mask)

    @triton.jit
    def _attention_merge_kernel(partial_out_ptr, partial_lse_ptr, out_ptr, lse_ptr, R, SPLITS,
                                DV, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr):
        """out and lse of ``R`` query rows (every head's, flattened) from their key slices'
        float32 (out, lse), merged in slice order by log-sum-exp: weights ``exp(lse_s -
        max)``, rounded once into out."""
        value_dims = tl.arange(0, BLOCK_DV)
        for block in range(tl.program_id(0), tl.cdiv(R, BLOCK_M), tl.num_programs(0)):
            rows = (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
            row_mask = rows < R
            mask = row_mask[:, None] & (value_dims < DV)[None, :]
            m = tl.full([BLOCK_M], NEG_INF, dtype=tl.float32)
            total = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
            for split in range(0, SPLITS):
                slots = split * R + rows
                lse_s = tl.load(partial_lse_ptr + slots, mask=row_mask,
                                other=NEG_INF)  # float32 statistic
                out_s = tl.load(partial_out_ptr + slots[:, None] * DV + value_dims[None, :],
                                mask=mask, other=0.0)  # float32 partial
                m_new = tl.maximum(m, lse_s)
                # A row no slice has seen yet keeps max -inf; 0 avoids -inf - -inf.
                m_safe = tl.where(m_new == NEG_INF, 0.0, m_new)
                alpha = tl.exp(m - m_safe)
                weight = tl.exp(lse_s - m_safe)
                total = total * alpha + weight
                acc = acc * alpha[:, None] + weight[:, None] * out_s
                m = m_new
            seen = total != 0
            out = acc / tl.where(seen, total, 1.0)[:, None]
            lse = tl.where(seen, m + tl.log(tl.where(seen, total, 1.0)), NEG_INF)
            out_ptrs = out_ptr + rows[:, None] * DV + value_dims[None, :]
            tl.store(out_ptrs, rounded_for(out, out_ptr), mask=mask)
            tl.store(lse_ptr + rows, lse, mask=row_mask)  # float32 statistic

    @triton.jit
    def _query_side_step(dq, q, dout, lse2, delta, k_base, v_base, k_desc, v_desc,
                         stride_kn, stride_kd, stride_vn, stride_vd, rows, first_col, Sk,
                         offset, before, after, D, DV, qk_scale, like_ptr, mask_rows, row_ok,
                         stride_mn, MASK: tl.constexpr, SOFTCAP: tl.constexpr, BAND: tl.constexpr,
                         MASKED: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                         WIDE: tl.constexpr, DESCRIPTORS: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
        """dQ of one key block: P from lse, dS = P (dP - delta)."""
        cols = first_col + tl.arange(0, BLOCK_N)
        keys = _rows_block(k_base, k_desc, first_col, stride_kn, stride_kd, Sk, D, False,
                           DESCRIPTORS, UPCAST, WIDE, BLOCK_N, BLOCK_D)
        values_t = _rows_block(v_base, v_desc, first_col, stride_vn, stride_vd, Sk, DV,
                               True, DESCRIPTORS, UPCAST, WIDE, BLOCK_N, BLOCK_DV)
        scores = tl.dot(q, tl.trans(keys), input_precision=PRECISION) * qk_scale
        if SOFTCAP != 0:
            scores, slope = _capped(scores, SOFTCAP)
        if MASK != 0:
            scores += _score_bias(mask_rows, row_ok, cols, Sk, stride_mn, MASK, False)
        p = tl.exp2(scores - lse2[:, None])
        if SOFTCAP != 0:
            p = p * slope  # only dS takes p here: the cap's slope folded in
        if MASKED:
            p = tl.where(_visible(rows[:, None], cols[None, :], Sk, offset, before, after,
                                  BAND), p, 0.0)
        dp = tl.dot(dout, values_t, input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        return dq + tl.dot(as_dot_operand(ds, like_ptr, UPCAST), keys,
                           input_precision=PRECISION)

    @triton.jit
    def _query_side_keys(dq, q, dout, lse2, delta, k_base, v_base, k_desc, v_desc,
                         stride_kn, stride_kd, stride_vn, stride_vd, rows, start, end,
                         second_start, second_end, Sk, offset, before, after, D, DV, qk_scale,
                         like_ptr, mask_rows, row_ok, stride_mn, MASK: tl.constexpr,
                         SOFTCAP: tl.constexpr,
                         BAND: tl.constexpr, MASKED: tl.constexpr, UPCAST: tl.constexpr,
                         PRECISION: tl.constexpr, WIDE: tl.constexpr,
                         DESCRIPTORS: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
        """dQ over the key blocks in [start, end); when ``MASKED``, those in [second_start,
        second_end) too with a ``BAND``, else only those (as `_forward_keys`)."""
        if MASKED and BAND:
            first_steps = tl.cdiv(tl.maximum(end - start, 0), BLOCK_N)
            steps = first_steps + tl.cdiv(tl.maximum(second_end - second_start, 0), BLOCK_N)
            for step in range(0, steps):
                dq = _query_side_step(
                    dq, q, dout, lse2, delta, k_base, v_base, k_desc, v_desc, stride_kn,
                    stride_kd, stride_vn, stride_vd, rows,
                    _two_ranges(step, start, first_steps, second_start, BLOCK_N), Sk, offset,
                    before, after, D, DV, qk_scale, like_ptr, mask_rows, row_ok, stride_mn,
                    MASK, SOFTCAP, BAND, MASKED, UPCAST, PRECISION, WIDE, DESCRIPTORS, BLOCK_N,
                    BLOCK_D, BLOCK_DV)
        else:
            if MASKED:  # no band: only the tail past the last full block
                start = second_start
                end = second_end
            for first_col in range(start, end, BLOCK_N):
                dq = _query_side_step(
                    dq, q, dout, lse2, delta, k_base, v_base, k_desc, v_desc, stride_kn,
                    stride_kd, stride_vn, stride_vd, rows, first_col, Sk, offset, before,
                    after, D, DV, qk_scale, like_ptr, mask_rows, row_ok, stride_mn, MASK, SOFTCAP,
                    BAND, MASKED, UPCAST, PRECISION, WIDE, DESCRIPTORS, BLOCK_N, BLOCK_D,
                    BLOCK_DV)
        return dq

    @triton.jit
    def _attention_query_side_kernel(
            dout_ptr, q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, grad_lse_ptr, delta_ptr, dq_ptr,
            mask_ptr, cu_q_ptr, cu_k_ptr, Sq, Sk, H, GROUP, head_offset, qk_scale, scale,
            before, after, stride_db, stride_dh, stride_dm, stride_dd, stride_qb, stride_qh,
            stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd, stride_vb,
            stride_vh, stride_vn, stride_vd, stride_ob, stride_oh, stride_om, stride_od,
            stride_mb, stride_mh, stride_mm, stride_mn, D, DV, MASK: tl.constexpr,
            SOFTCAP: tl.constexpr,
            BAND: tl.constexpr, HAS_GRAD_LSE: tl.constexpr, UPCAST: tl.constexpr,
            PRECISION: tl.constexpr, WIDE: tl.constexpr, DESCRIPTORS: tl.constexpr,
            EXACT_HEAD: tl.constexpr, VARLEN: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
        """Per query block: ``delta = rowsum(dout * out) - grad_lse`` (stored for the key
        side), then dQ, the keys and values streamed (by tensor descriptor when
        ``DESCRIPTORS``). With ``VARLEN`` (packed sequences, as in the forward) the
        statistics are ``[H, T]`` and dq ``[T, H, D]``."""
        if EXACT_HEAD:
            # The blocks are as wide as the heads: head widths as constants fold the
            # column masks away (fewer registers: the pointer kernels spill less).
            D = BLOCK_D
            DV = BLOCK_DV
        head = (tl.program_id(1) + head_offset).to(tl.int64)
        batch, h = head // H, head % H
        total_q = Sq
        q_start, Sq, k_start, Sk = _sequence(cu_q_ptr, cu_k_ptr, batch, Sq, Sk, VARLEN)
        q_base = q_ptr + batch * stride_qb + h * stride_qh + q_start * stride_qm
        dout_base = dout_ptr + batch * stride_db + h * stride_dh + q_start * stride_dm
        out_base = out_ptr + batch * stride_ob + h * stride_oh + q_start * stride_om
        k_base = k_ptr + batch * stride_kb + (h // GROUP) * stride_kh + k_start * stride_kn
        v_base = v_ptr + batch * stride_vb + (h // GROUP) * stride_vh + k_start * stride_vn
        k_desc, v_desc = descriptor_pair(k_base, Sk, D, stride_kn, v_base, Sk, DV, stride_vn,
                                         DESCRIPTORS, BLOCK_N, BLOCK_D, BLOCK_N, BLOCK_DV)
        offset = Sk - Sq
        dims = tl.arange(0, BLOCK_D)
        value_dims = tl.arange(0, BLOCK_DV)
        blocks = tl.cdiv(Sq, BLOCK_M)
        for index in range(tl.program_id(0), blocks, tl.num_programs(0)):
            block = _heavy_first(index, blocks, BAND)
            first_row = block * BLOCK_M
            rows = first_row + tl.arange(0, BLOCK_M)
            if WIDE:
                rows = rows.to(tl.int64)
            row_mask = rows < Sq
            q_mask = row_mask[:, None] & (dims < D)[None, :]
            v_mask = row_mask[:, None] & (value_dims < DV)[None, :]
            q = dot_operand(q_base + rows[:, None] * stride_qm + dims[None, :] * stride_qd,
                            q_mask, UPCAST)
            dout = dot_operand(dout_base + rows[:, None] * stride_dm
                               + value_dims[None, :] * stride_dd, v_mask, UPCAST)
            out = widen(tl.load(out_base + rows[:, None] * stride_om
                                + value_dims[None, :] * stride_od, mask=v_mask, other=0.0))
            delta = tl.sum(widen(dout) * out, 1)
            if VARLEN:
                statistics = h * total_q + q_start + rows
            else:
                statistics = head * Sq + rows
            if HAS_GRAD_LSE:
                delta -= tl.load(grad_lse_ptr + statistics, mask=row_mask)  # float32 statistic
            tl.store(delta_ptr + statistics, delta, mask=row_mask)  # float32 statistic
            lse2 = tl.load(lse_ptr + statistics, mask=row_mask, other=0.0)  # float32 statistic
            # A query that sees no key (lse -inf) has P = 0: +inf makes exp2(s - lse) 0
            # even where a mask put s at -inf.
            lse2 = tl.where(lse2 == NEG_INF, POS_INF, lse2 * LOG2E)
            mask_rows = mask_ptr + batch * stride_mb + h * stride_mh + rows * stride_mm
            dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
            start, full_start, full_end, end = _key_ranges(
                first_row, first_row + BLOCK_M - 1, Sk, offset, before, after, BAND, BLOCK_N)
            dq = _query_side_keys(dq, q, dout, lse2, delta, k_base, v_base, k_desc, v_desc,
                                  stride_kn, stride_kd, stride_vn, stride_vd, rows, full_start,
                                  full_end, 0, 0, Sk, offset, before, after, D, DV, qk_scale,
                                  q_ptr, mask_rows, row_mask, stride_mn, MASK, SOFTCAP, BAND, False,
                                  UPCAST, PRECISION, WIDE, DESCRIPTORS, BLOCK_N, BLOCK_D,
                                  BLOCK_DV)
            dq = _query_side_keys(dq, q, dout, lse2, delta, k_base, v_base, k_desc, v_desc,
                                  stride_kn, stride_kd, stride_vn, stride_vd, rows, start,
                                  tl.minimum(full_start, end),
                                  tl.maximum(full_end, full_start), end, Sk, offset, before,
                                  after, D, DV, qk_scale, q_ptr, mask_rows, row_mask,
                                  stride_mn, MASK, SOFTCAP, BAND, True, UPCAST, PRECISION, WIDE,
                                  DESCRIPTORS, BLOCK_N, BLOCK_D, BLOCK_DV)
            if VARLEN:
                dq_ptrs = dq_ptr + ((q_start + rows)[:, None] * H + h) * D + dims[None, :]
            else:
                dq_ptrs = dq_ptr + head * Sq * D + rows[:, None] * D + dims[None, :]
            tl.store(dq_ptrs, rounded_for(dq * scale, dq_ptr), mask=q_mask)

    @triton.jit
    def _key_side_step(dk, dv, keys, values, q_base, dout_base, q_desc, dout_desc, lse_base,
                       delta_base, stride_qm, stride_qd, stride_dm, stride_dd, cols, first_row,
                       Sq, Sk, offset, before, after, D, DV, qk_scale, like_ptr, mask_base,
                       stride_mm, stride_mn, MASK: tl.constexpr, SOFTCAP: tl.constexpr,
                       BAND: tl.constexpr,
                       MASKED: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                       WIDE: tl.constexpr, DESCRIPTORS: tl.constexpr, BLOCK_Q: tl.constexpr,
                       BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
        """dK and dV of one key block over one query block, transposed: ``S^T = K Q^T``
        (keys x queries), so that ``P^T`` and ``dS^T`` leave their products in the layout
        of the next product's left operand; a transpose of a computed tile would cost a
        round trip through shared memory per step. Rows past Sq read lse = +inf, so their
        P is exactly 0 without a mask."""
        rows = first_row + tl.arange(0, BLOCK_Q)
        row_mask = rows < Sq
        q_t = _rows_block(q_base, q_desc, first_row, stride_qm, stride_qd, Sq, D, True,
                          DESCRIPTORS, UPCAST, WIDE, BLOCK_Q, BLOCK_D)
        dout = _rows_block(dout_base, dout_desc, first_row, stride_dm, stride_dd, Sq, DV,
                           False, DESCRIPTORS, UPCAST, WIDE, BLOCK_Q, BLOCK_DV)
        lse2 = tl.load(lse_base + rows, mask=row_mask, other=POS_INF)  # float32 statistic
        lse2 = tl.where(lse2 == NEG_INF, POS_INF, lse2 * LOG2E)  # no key seen: P = 0
        delta = tl.load(delta_base + rows, mask=row_mask, other=0.0)  # float32 statistic
        scores_t = tl.dot(keys, q_t, input_precision=PRECISION) * qk_scale
        if SOFTCAP != 0:
            scores_t, slope_t = _capped(scores_t, SOFTCAP)
        if MASK != 0:
            scores_t += _score_bias(mask_base + rows * stride_mm, row_mask, cols, Sk,
                                    stride_mn, MASK, True)
        p_t = tl.exp2(scores_t - lse2[None, :])
        if MASKED:
            p_t = tl.where(_visible(rows[None, :], cols[:, None], Sk, offset, before, after,
                                    BAND), p_t, 0.0)
        dv += tl.dot(as_dot_operand(p_t, like_ptr, UPCAST), dout, input_precision=PRECISION)
        dp_t = tl.dot(values, tl.trans(dout), input_precision=PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        if SOFTCAP != 0:
            ds_t = ds_t * slope_t
        dk += tl.dot(as_dot_operand(ds_t, like_ptr, UPCAST), tl.trans(q_t),
                     input_precision=PRECISION)
        return dk, dv

    @triton.jit
    def _key_side_queries(dk, dv, keys, values, q_base, dout_base, q_desc, dout_desc,
                          lse_base, delta_base, stride_qm, stride_qd, stride_dm, stride_dd,
                          cols, start, end, second_start, second_end, Sq, Sk, offset, before,
                          after, D, DV, qk_scale, like_ptr, mask_base, stride_mm, stride_mn,
                          MASK: tl.constexpr, SOFTCAP: tl.constexpr, BAND: tl.constexpr,
                          MASKED: tl.constexpr,
                          UPCAST: tl.constexpr, PRECISION: tl.constexpr, WIDE: tl.constexpr,
                          DESCRIPTORS: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_DV: tl.constexpr):
        """dK and dV of one key block over the query blocks in [start, end), and when
        ``MASKED`` then those in [second_start, second_end) (a band's edges: without one no
        query block needs the mask, queries past Sq having P = 0)."""
        if MASKED:
            first_steps = tl.cdiv(tl.maximum(end - start, 0), BLOCK_Q)
            steps = first_steps + tl.cdiv(tl.maximum(second_end - second_start, 0), BLOCK_Q)
            for step in range(0, steps):
                dk, dv = _key_side_step(
                    dk, dv, keys, values, q_base, dout_base, q_desc, dout_desc, lse_base,
                    delta_base, stride_qm, stride_qd, stride_dm, stride_dd, cols,
                    _two_ranges(step, start, first_steps, second_start, BLOCK_Q), Sq, Sk,
                    offset, before, after, D, DV, qk_scale, like_ptr, mask_base, stride_mm,
                    stride_mn, MASK, SOFTCAP, BAND, MASKED, UPCAST, PRECISION, WIDE, DESCRIPTORS,
                    BLOCK_Q, BLOCK_D, BLOCK_DV)
        else:
            for first_row in range(start, end, BLOCK_Q):
                dk, dv = _key_side_step(
                    dk, dv, keys, values, q_base, dout_base, q_desc, dout_desc, lse_base,
                    delta_base, stride_qm, stride_qd, stride_dm, stride_dd, cols, first_row,
                    Sq, Sk, offset, before, after, D, DV, qk_scale, like_ptr, mask_base,
                    stride_mm, stride_mn, MASK, SOFTCAP, BAND, MASKED, UPCAST, PRECISION, WIDE,
                    DESCRIPTORS, BLOCK_Q, BLOCK_D, BLOCK_DV)
        return dk, dv

    @triton.jit
    def _attention_key_side_kernel(
            dout_ptr, q_ptr, k_ptr, v_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, mask_ptr,
            cu_q_ptr, cu_k_ptr, Sq, Sk, H, HKV, GROUP, head_offset, qk_scale, scale, before,
            after, stride_db, stride_dh, stride_dm, stride_dd, stride_qb, stride_qh, stride_qm,
            stride_qd, stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh,
            stride_vn, stride_vd, stride_mb, stride_mh, stride_mm, stride_mn, D, DV,
            MASK: tl.constexpr, SOFTCAP: tl.constexpr, BAND: tl.constexpr, UPCAST: tl.constexpr,
            PRECISION: tl.constexpr, WIDE: tl.constexpr, DESCRIPTORS: tl.constexpr,
            EXACT_HEAD: tl.constexpr, VARLEN: tl.constexpr, BLOCK_K: tl.constexpr,
            BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
        """Per block of ``BLOCK_K`` keys of one key/value head: dK and dV summed over the
        ``BLOCK_Q`` query blocks of every query head in its group, in a fixed order, the
        queries and their output gradients streamed (by tensor descriptor when
        ``DESCRIPTORS``). With ``VARLEN`` (packed sequences, as in the forward) dk and dv
        are ``[T, HKV, D]``."""
        if EXACT_HEAD:
            # The blocks are as wide as the heads: head widths as constants fold the
            # column masks away (fewer registers: the pointer kernels spill less).
            D = BLOCK_D
            DV = BLOCK_DV
        kv_head = (tl.program_id(1) + head_offset).to(tl.int64)
        batch, hkv = kv_head // HKV, kv_head % HKV
        total_q = Sq
        q_start, Sq, k_start, Sk = _sequence(cu_q_ptr, cu_k_ptr, batch, Sq, Sk, VARLEN)
        k_base = k_ptr + batch * stride_kb + hkv * stride_kh + k_start * stride_kn
        v_base = v_ptr + batch * stride_vb + hkv * stride_vh + k_start * stride_vn
        offset = Sk - Sq
        dims = tl.arange(0, BLOCK_D)
        value_dims = tl.arange(0, BLOCK_DV)
        for block in range(tl.program_id(0), tl.cdiv(Sk, BLOCK_K), tl.num_programs(0)):
            first_col = block * BLOCK_K
            cols = first_col + tl.arange(0, BLOCK_K)
            if WIDE:
                cols = cols.to(tl.int64)
            k_mask = (cols < Sk)[:, None] & (dims < D)[None, :]
            v_mask = (cols < Sk)[:, None] & (value_dims < DV)[None, :]
            keys = dot_operand(k_base + cols[:, None] * stride_kn + dims[None, :] * stride_kd,
                               k_mask, UPCAST)
            values = dot_operand(v_base + cols[:, None] * stride_vn
                                 + value_dims[None, :] * stride_vd, v_mask, UPCAST)
            dk = tl.zeros([BLOCK_K, BLOCK_D], dtype=tl.float32)
            dv = tl.zeros([BLOCK_K, BLOCK_DV], dtype=tl.float32)
            start, full_start, full_end, end = _query_ranges(
                first_col, first_col + BLOCK_K - 1, Sq, offset, before, after, BAND, BLOCK_Q)
            for g in range(0, GROUP):
                if VARLEN:
                    statistics = (hkv * GROUP + g) * total_q + q_start
                else:
                    statistics = (batch * H + hkv * GROUP + g) * Sq
                q_base = q_ptr + batch * stride_qb + (hkv * GROUP + g) * stride_qh \
                    + q_start * stride_qm
                dout_base = dout_ptr + batch * stride_db + (hkv * GROUP + g) * stride_dh \
                    + q_start * stride_dm
                mask_base = mask_ptr + batch * stride_mb + (hkv * GROUP + g) * stride_mh
                q_desc, dout_desc = descriptor_pair(q_base, Sq, D, stride_qm, dout_base, Sq, DV,
                                                    stride_dm, DESCRIPTORS, BLOCK_Q, BLOCK_D,
                                                    BLOCK_Q, BLOCK_DV)
                if BAND:
                    dk, dv = _key_side_queries(
                        dk, dv, keys, values, q_base, dout_base, q_desc, dout_desc,
                        lse_ptr + statistics, delta_ptr + statistics, stride_qm, stride_qd,
                        stride_dm, stride_dd, cols, start, tl.minimum(full_start, end),
                        tl.maximum(full_end, full_start), end, Sq, Sk, offset, before, after,
                        D, DV, qk_scale, q_ptr, mask_base, stride_mm, stride_mn, MASK, SOFTCAP,
                        BAND,
                        True, UPCAST, PRECISION, WIDE, DESCRIPTORS, BLOCK_Q, BLOCK_D,
                        BLOCK_DV)
                dk, dv = _key_side_queries(dk, dv, keys, values, q_base, dout_base, q_desc,
                                           dout_desc, lse_ptr + statistics,
                                           delta_ptr + statistics, stride_qm, stride_qd,
                                           stride_dm, stride_dd, cols, full_start, full_end,
                                           0, 0, Sq, Sk, offset, before, after, D, DV,
                                           qk_scale, q_ptr, mask_base, stride_mm, stride_mn,
                                           MASK, SOFTCAP, BAND, False, UPCAST, PRECISION, WIDE,
                                           DESCRIPTORS, BLOCK_Q, BLOCK_D, BLOCK_DV)
            # dk and dv rows: [T, HKV, D] packed, else [B, HKV, Sk, D] (a scalar base, so
            # that the per-row offsets stay 32-bit).
            if VARLEN:
                dk_base = dk_ptr + (k_start * HKV + hkv) * D
                dv_base = dv_ptr + (k_start * HKV + hkv) * DV
                dk_row = HKV * D
                dv_row = HKV * DV
            else:
                dk_base = dk_ptr + kv_head * Sk * D
                dv_base = dv_ptr + kv_head * Sk * DV
                dk_row = D
                dv_row = DV
            dk_ptrs = dk_base + cols[:, None] * dk_row + dims[None, :]
            tl.store(dk_ptrs, rounded_for(dk * scale, dk_ptr), mask=k_mask)
            dv_ptrs = dv_base + cols[:, None] * dv_row + value_dims[None, :]
            tl.store(dv_ptrs, rounded_for(dv, dv_ptr), mask=v_mask)


# ---------------------------------------------------------------------------------------------
# Launchers


def _scale_of(attrs: Attrs, d: int) -> float:
    return d ** -0.5 if attrs["scale"] is None else attrs["scale"]


def _head_chunks(heads: int) -> list[tuple[int, int]]:
    """(first head, count) of launches whose grid's second dim stays under the limit."""
    return [(start, min(MAX_PROGRAMS, heads - start))
            for start in range(0, heads, MAX_PROGRAMS)]


def _launch_options(plan: object, inputs: Sequence[torch.Tensor], *blocks: str
                    ) -> dict[str, object]:
    """Compile-time arguments of a kernel: the shared ones, and the tiling's ``blocks``
    (with the head dims' blocks); ``BAND`` comes with `band_arguments`."""
    chosen = {name: plan.tiling.blocks[name] for name in (*blocks, "BLOCK_D", "BLOCK_DV")}
    # 16-bit operands take the matrix unit whatever the precision asks of float32 ones
    # (and the interpreter's float32 copies of them are exact in tf32 too): "ieee" is
    # the precision every backend accepts (triton-ascend rejects "tf32").
    return {"UPCAST": backends.interpreter_enabled(),
            "PRECISION": "ieee",
            "WIDE": wide_offsets(*inputs), **chosen, **launch_options(plan.tiling)}


def softcap_argument(attrs: Attrs) -> float:
    """The kernels' ``SOFTCAP``: the cap in the log2 domain their scores are in (0: none)."""
    return 0.0 if attrs["softcap"] is None else attrs["softcap"] * LOG2_E


def band_arguments(attrs: Attrs, sq: int, sk: int) -> tuple[tuple[int, int], bool]:
    """The kernels' ``(before, after)`` arguments and their ``BAND`` (`_reach`)."""
    band, before, after = _reach(limits_of(attrs), sq, sk)
    return (before, after), band


def _mask_arguments(mask: torch.Tensor | None, like: torch.Tensor,
                    full: tuple[int, int, int, int]) -> tuple[object, ...]:
    """(pointer, its four strides over ``(B, H, Sq, Sk)``, 0 on broadcast dims) of a mask,
    and its kind (`_mask_kind`); no mask: ``like``'s pointer, never read."""
    if mask is None:
        return like, (0, 0, 0, 0), 0
    return mask, mask.expand(full).stride(), _mask_kind(mask)


def _exact_head(options: dict[str, object], d: int, dv: int) -> bool:
    """Whether the head dims fill their blocks (64, 128, 256 do): the pointer kernels then
    take them as constants. The descriptor kernels have no column masks to fold, and the
    constants cost them registers (`attention_tuning.py --compile-only`)."""
    return (d, dv) == (options["BLOCK_D"], options["BLOCK_DV"])


# Forward variants: (keys and values by tensor descriptor, warp-specialized key loop).
FORWARD_VARIANTS = {"flash": (False, False), "flash_tma": (True, False),
                    "flash_tma_ws": (True, True)}


@ATTENTION.launcher("triton")
def launch(plan: object, inputs: Sequence[torch.Tensor | None],
           outputs: Sequence[torch.Tensor], workspace: torch.Tensor | None) -> None:
    """One program per ``BLOCK_M`` queries of one head (persistently), heads in
    ``program_id(1)``, slices of the keys in ``program_id(2)`` when the tiling splits them
    (then the merge kernel combines the slices from the workspace). The tiling's variant
    may read keys and values by tensor descriptor (and warp-specialize the key loop);
    inputs that descriptors cannot address take the pointer kernel."""
    q, k, v, mask = inputs
    out, lse = outputs
    b, h, hkv, sq, sk, d, dv = _shapes(q, k, v, "attention")
    mask, mask_strides, mask_kind = _mask_arguments(mask, q, (b, h, sq, sk))
    if sk == 0:
        out.zero_()
        lse.fill_(-math.inf)
    if sk == 0 or sq == 0:
        return
    options = _launch_options(plan, (q, k, v, out), "BLOCK_M", "BLOCK_N")
    descriptors, warp_specialize = FORWARD_VARIANTS[plan.tiling.variant]
    # Descriptor coordinates are int32: tensors past 2^31 elements take the pointer kernel.
    if descriptors and (options["WIDE"] or not descriptors_usable(k, v)):
        descriptors = warp_specialize = False
    if descriptors:
        use_scratch_allocator(k.device)
    keys_per_split, splits = _key_slices(plan.tiling,
                                         _block_keys(plan.tiling, plan.attrs, h, hkv, sq, sk))
    reach, band = band_arguments(plan.attrs, sq, sk)
    rows = b * h * sq
    targets = (out, lse)
    if splits > 1:
        # narrow, not indexing: a CPU-only torch cannot index a fake CUDA tensor, and the
        # compiled-call test traces this launcher on fake ones.
        partials = workspace.narrow(0, 0, 4 * splits * rows * (dv + 1)).view(torch.float32)
        targets = partials.split(splits * rows * dv)
    qk_scale = _scale_of(plan.attrs, d) * LOG2_E
    pack = _pack(plan.tiling, h, hkv)
    for first, count in _head_chunks(b * h // pack):
        _attention_forward_kernel[(plan.grid[0], count, splits)](
            q, k, v, mask, *targets, None, None, sq, sk, h, h // hkv, first, b * h, keys_per_split,
            qk_scale, *reach, *q.stride(), *k.stride(), *v.stride(), *mask_strides, d, dv,
            MASK=mask_kind, BAND=band, DESCRIPTORS=descriptors, WARP_SPECIALIZE=warp_specialize,
            EXACT_HEAD=_exact_head(options, d, dv) and not descriptors, PACK=pack,
            SOFTCAP=softcap_argument(plan.attrs),
            FOLD_SCALE=qk_scale > 0 and mask_kind == 0 and plan.attrs["softcap"] is None,
            VARLEN=False, **options)
    if splits > 1:
        # Warps for the merge's float32 tiles (4 spill them at Dv = 128 on sm_90).
        warps = gpu_warps(MERGE_ROWS * options["BLOCK_DV"], plan.hardware)
        _attention_merge_kernel[(max(1, min(cdiv(rows, MERGE_ROWS), MAX_PROGRAMS)),)](
            *targets, out, lse, rows, splits, dv, BLOCK_M=MERGE_ROWS,
            BLOCK_DV=options["BLOCK_DV"], **({"num_warps": warps} if warps else {}))


@ATTENTION_BACKWARD.launcher("triton")
def launch_backward(plan: object, inputs: Sequence[torch.Tensor | None],
                    outputs: Sequence[torch.Tensor], workspace: torch.Tensor | None) -> None:
    """The query-side kernel (delta, then dQ; ``BLOCK_M`` queries held, ``BLOCK_N`` keys
    streamed) over query blocks, then the key-side kernel (dK, dV; ``BLOCK_K`` keys held,
    ``BLOCK_Q`` queries streamed) over key blocks and key/value heads."""
    dout, q, k, v, out, lse, grad_lse, mask = inputs
    grad_q, grad_k, grad_v = outputs
    b, h, hkv, sq, sk, d, dv = _shapes(q, k, v, "attention_backward")
    mask, mask_strides, mask_kind = _mask_arguments(mask, q, (b, h, sq, sk))
    if sq == 0 or sk == 0:
        for grad in outputs:
            grad.zero_()
        return
    lse = lse.contiguous()
    grad_lse = None if grad_lse is None else grad_lse.contiguous()
    delta = workspace.narrow(0, 0, 4 * b * h * sq).view(torch.float32)  # narrow: see above
    tensors = (q, k, v, dout, out, grad_q, grad_k, grad_v)
    # The streamed blocks (keys and values for dQ, queries and dout for dK/dV) by tensor
    # descriptor when the tiling's variant asks and the tensors allow.
    query_side = _launch_options(plan, tensors, "BLOCK_M", "BLOCK_N")
    key_side = _launch_options(plan, tensors, "BLOCK_K", "BLOCK_Q")
    descriptors = (FORWARD_VARIANTS[plan.tiling.variant][0] and not query_side["WIDE"]
                   and descriptors_usable(q, k, v, dout))
    if descriptors:
        use_scratch_allocator(q.device)
    query_side["DESCRIPTORS"] = key_side["DESCRIPTORS"] = descriptors
    query_side["EXACT_HEAD"] = key_side["EXACT_HEAD"] = (_exact_head(query_side, d, dv)
                                                         and not descriptors)
    scale = _scale_of(plan.attrs, d)
    reach, band = band_arguments(plan.attrs, sq, sk)
    for first, count in _head_chunks(b * h):
        _attention_query_side_kernel[(plan.grid[0], count)](
            dout, q, k, v, out, lse, lse if grad_lse is None else grad_lse, delta, grad_q,
            mask, None, None, sq, sk, h, h // hkv, first, scale * LOG2_E, scale, *reach,
            *dout.stride(), *q.stride(), *k.stride(), *v.stride(), *out.stride(),
            *mask_strides, d, dv, MASK=mask_kind, BAND=band, HAS_GRAD_LSE=grad_lse is not None,
            SOFTCAP=softcap_argument(plan.attrs), VARLEN=False, **query_side)
    key_blocks = max(1, min(cdiv(sk, plan.tiling.blocks["BLOCK_K"]), MAX_PROGRAMS))
    for first, count in _head_chunks(b * hkv):
        _attention_key_side_kernel[(key_blocks, count)](
            dout, q, k, v, lse, delta, grad_k, grad_v, mask, None, None, sq, sk, h, hkv, h // hkv,
            first, scale * LOG2_E, scale, *reach, *dout.stride(), *q.stride(), *k.stride(),
            *v.stride(), *mask_strides, d, dv, MASK=mask_kind, BAND=band, VARLEN=False,
            SOFTCAP=softcap_argument(plan.attrs), **key_side)


# ---------------------------------------------------------------------------------------------
# Backward


def _setup_context(ctx: object, inputs: tuple[object, ...], output: tuple[torch.Tensor, ...]
                   ) -> None:
    q, k, v, mask, *attrs = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, mask)
    ctx.attrs = attrs


@ATTENTION.autograd(_setup_context)
def backward(ctx: object, grad_out: torch.Tensor | None, grad_lse: torch.Tensor | None
             ) -> tuple[torch.Tensor | None, ...]:
    """dq, dk, dv through `attention_backward` (a gradient of lse joins through delta); the
    mask gets none."""
    q, k, v, out, lse, mask = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    grad_q, grad_k, grad_v = ATTENTION_BACKWARD(
        grad_out, q, k, v, out, lse, grad_lse, mask, *ctx.attrs)
    return grad_q, grad_k, grad_v, None, *[None] * len(ctx.attrs)


register_op(ATTENTION_BACKWARD)
register_op(ATTENTION)


ATTENTION_LAYOUTS = ("BNSD", "BSND", "BSH", "SBH", "TND")


def check_sinks(sinks: object, heads: int, q: torch.Tensor, op: str) -> None:
    """``sinks`` is a float tensor ``(heads,)`` on q's device.

    Raises:
        ShapeError: not one value per query head. DtypeError: not a float tensor, or on
            another device.
    """
    if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point() \
            or sinks.device != q.device:
        raise DtypeError("sinks must be a float tensor on the queries' device", op=op,
                         param="sinks", expected=f"float tensor on {q.device}",
                         got=type(sinks).__name__ if not isinstance(sinks, torch.Tensor)
                         else f"{sinks.dtype} on {sinks.device}")
    if tuple(sinks.shape) != (heads,):
        raise ShapeError("sinks holds one logit per query head", op=op, param="sinks",
                         expected=(heads,), got=tuple(sinks.shape))


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor,
               head_major: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention whose softmax also holds, per head, one logit that attends to no value
    (gpt-oss's sinks): ``lse' = logaddexp(lse, sink)`` and ``out' = out * exp(lse -
    lse')``, the product in float32 rounded once (out itself was rounded once by the
    kernel). Differentiable in out, lse and sinks (the kernels' backward takes the
    gradient reaching lse).

    Args:
        out: ``(B, H, S, Dv)`` with ``lse`` ``(B, H, S)`` (``head_major``), or ``(T, H,
            Dv)`` with ``lse`` ``(H, T)``.
        sinks: ``(H,)``.
    """
    sink = sinks.to(lse.dtype)[:, None].expand_as(lse)
    # A query that sees no key has lse' = sink and out 0, kept out of logaddexp and exp
    # there: with a -inf sink (no sink) their -inf - -inf would be NaN, forward or back.
    seen = lse != -math.inf
    total = torch.where(seen, torch.logaddexp(torch.where(seen, lse, 0.0), sink), sink)
    kept = torch.exp(torch.where(seen, lse - total, -math.inf))
    kept = kept[..., None] if head_major else kept.transpose(0, 1)[..., None]
    return (out.to(kept.dtype) * kept).to(out.dtype), total


def _to_bnsd(t: torch.Tensor, layout: str, heads: int | None, name: str) -> torch.Tensor:
    """A view of ``t`` in ``layout`` as ``(B, N, S, D)`` (no copy)."""
    if t.dim() != (4 if layout in ("BNSD", "BSND") else 3):
        raise ShapeError(f"must be {'4' if layout in ('BNSD', 'BSND') else '3'}-D in layout "
                         f"{layout}", op="attention", param=name, expected=layout,
                         got=tuple(t.shape))
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.transpose(1, 2)
    if heads is None or heads < 1 or t.shape[-1] % heads:
        raise ShapeError(f"layout {layout} needs a head count dividing the last dim",
                         op="attention", param=name, expected="H = heads x D",
                         got=(tuple(t.shape), heads))
    if layout == "SBH":
        t = t.transpose(0, 1)
    return t.unflatten(-1, (heads, -1)).transpose(1, 2)


def _from_bnsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    """`_to_bnsd` undone on an output ``(B, N, S, D)``."""
    if layout == "BNSD":
        return t
    t = t.transpose(1, 2)
    if layout == "BSND":
        return t
    t = t.flatten(-2)
    return t.transpose(0, 1) if layout == "SBH" else t


@ATTENTION.exported
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              scale: float | None = None, return_lse: bool = False, *,
              attn_mask: torch.Tensor | None = None, layout: str = "BNSD",
              heads: int | None = None, cu_seqlens_q: torch.Tensor | None = None,
              cu_seqlens_k: torch.Tensor | None = None, max_seqlen_q: int | None = None,
              max_seqlen_k: int | None = None, window_left: int | None = None,
              window_right: int | None = None, sinks: torch.Tensor | None = None,
              softcap: float | None = None
              ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention, flash-style on the Triton backend (no ``Sq x Sk``
    matrix in memory); the torch backend (the CPU development path) holds the score
    matrices of a chunk of query rows at a time (at most 2**24 elements).

    Args:
        q: ``(B, H, Sq, D)``; k: ``(B, Hkv, Sk, D)``; v: ``(B, Hkv, Sk, Dv)``, one float
            dtype, ``H`` a multiple of ``Hkv`` (grouped-query attention), ``D, Dv <= 256``
            (in ``layout``: see below).
        causal: query ``i`` sees keys ``j <= i + Sk - Sq`` (aligned to the bottom-right as
            in FlashAttention and KV-cache decoding; torch's SDPA ``is_causal`` aligns
            top-left, the same only when ``Sq == Sk``).
        scale: score scale, ``1 / sqrt(D)`` when None.
        window_left, window_right: a band around each query's diagonal key ``i + Sk -
            Sq``: query ``i`` sees keys ``i + Sk - Sq - window_left <= j <= i + Sk - Sq +
            window_right`` (None: unbounded on that side; negative values shift the band
            off the diagonal). With ``causal``, keys after the diagonal stay hidden. A
            sliding window of ``W`` keys (Mistral's, transformers' ``sliding_window``) is
            ``causal=True, window_left=W - 1``; CANN's band (``sparse_mode`` 4) is
            ``window_left=pre_tokens, window_right=next_tokens``. The kernels skip the key
            blocks outside the band: the work is ``O(Sq * W)``, not ``O(Sq * Sk)``.
        return_lse: also return the float32 (for float64 inputs float64) natural-log
            log-sum-exp of each query's scaled scores, ``(B, H, Sq)`` in every layout but
            ``"TND"``'s ``(H, T)`` (``-inf`` for a query that sees no key). A NaN or +inf
            score (a NaN input, an overflowed ``q.k``) makes its row's out and lse NaN.
        attn_mask: broadcastable to ``(B, H, Sq, Sk)`` (a lower rank is aligned to the
            right, as in torch): bool, True where the query sees the key (torch SDPA's
            convention), or float (q's dtype or float32), added to the scaled scores
            (``-inf`` hides a key). Combined with ``causal``. The kernels read it per tile
            (broadcast dims are not expanded in memory); it gets no gradient. A query
            whose keys are all hidden (by the mask, ``causal`` or the window) gets
            ``out = 0`` and ``lse = -inf`` (torch's SDPA gives NaN there).
        layout: ``"BNSD"`` (the shapes above), ``"BSND"`` (``(B, S, N, D)``, as Hugging
            Face models hold them), ``"BSH"`` (``(B, S, N * D)``) or ``"SBH"``
            (``(S, B, N * D)``); ``out`` comes back in the same layout. Views, no copies.
            ``"TND"``: packed sequences ``(T, N, D)`` with ``cu_seqlens_q`` /
            ``cu_seqlens_k``, run by `opforge.attention_varlen` (lse ``(N, T)``, no
            ``attn_mask``).
        heads: the query head count ``N``, needed by ``"BSH"`` and ``"SBH"`` (the key and
            value heads follow from q's head dim).
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k: the packing of ``"TND"``
            (see `opforge.attention_varlen`).
        softcap: the scaled scores become ``softcap * tanh(scores / softcap)`` before any
            mask is added (Gemma 2's attention soft cap), in the kernels, forward and
            backward; None: none.
        sinks: ``(H,)``, per query head one more logit in each softmax's denominator,
            attending to no value (gpt-oss's attention sinks): ``out`` scales by ``exp(lse
            - lse')`` with ``lse' = logaddexp(lse, sink)``, the lse returned; it gets a
            gradient. Applied after the kernel: one more pass over ``out`` (rounded once
            more) each way.

    Returns:
        ``out`` (``(B, H, Sq, Dv)`` in BNSD) in q's dtype, or ``(out, lse)``.
        Differentiable in q, k, v (and through lse).

    Raises:
        ShapeError: a rank that does not fit the layout, mismatched batch/lengths/head
            dims, heads not grouped, a head dim above 256, a mask that does not broadcast,
            a packed layout without ``heads``. DtypeError: q, k, v of different or
            unsupported dtypes; a float mask of another dtype. AttrError: an unknown layout;
            ``"TND"`` without both lengths or with a mask or ``heads``; packing arguments
            in another layout; a ``softcap`` that is not positive. ShapeError, DtypeError:
            ``sinks`` not a float ``(H,)`` on q's device.
            IndexRangeError: ``"TND"`` lengths that do not cover the tokens.
    """
    if layout not in ATTENTION_LAYOUTS:
        raise AttrError("unknown layout", op="attention", param="layout",
                        expected=" | ".join(ATTENTION_LAYOUTS), got=layout)
    if layout != "TND":
        # Four reads on every call: the packing arguments, named only on the rare error.
        if cu_seqlens_q is not None or cu_seqlens_k is not None or max_seqlen_q is not None \
                or max_seqlen_k is not None:
            given = next(name for name, value in (
                ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
                ("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k))
                if value is not None)
            raise AttrError("belongs to layout TND (packed sequences)", op="attention",
                            param=given, expected="layout='TND'", got=layout)
    else:
        for name, value in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
                            ("attn_mask", attn_mask), ("heads", heads)):
            if (value is None) == name.startswith("cu_"):
                raise AttrError("TND takes both cumulative lengths, and no attn_mask or "
                                "heads", op="attention", param=name,
                                expected="a tensor" if name.startswith("cu_") else None,
                                got=None if value is None else type(value).__name__)
        from opforge.ops.attention_varlen import attention_varlen  # it imports this module

        return attention_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, max_seqlen_q, max_seqlen_k,
            return_lse, window_left=window_left, window_right=window_right, sinks=sinks,
            softcap=softcap)
    if layout in ("BSH", "SBH"):
        head_dim = q.shape[-1] // heads if heads else None
        kv_heads = k.shape[-1] // head_dim if head_dim else None
        q = _to_bnsd(q, layout, heads, "q")
        k, v = (_to_bnsd(t, layout, kv_heads, name) for t, name in ((k, "k"), (v, "v")))
    else:
        q, k, v = (_to_bnsd(t, layout, None, name) for t, name in ((q, "q"), (k, "k"),
                                                                      (v, "v")))
    if attn_mask is not None and 0 < attn_mask.dim() < 4:
        attn_mask = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    if sinks is not None and q.dim() == 4:
        check_sinks(sinks, q.shape[1], q, "attention")  # else the operator raises
    out, lse = ATTENTION(q, k, v, attn_mask, causal, scale, window_left, window_right,
                         softcap)
    if sinks is not None:
        out, lse = with_sinks(out, lse, sinks, head_major=True)
    out = _from_bnsd(out, layout)
    return (out, lse) if return_lse else out


@ATTENTION_BACKWARD.exported
def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, causal: bool = False,
                       scale: float | None = None, grad_lse: torch.Tensor | None = None,
                       attn_mask: torch.Tensor | None = None, window_left: int | None = None,
                       window_right: int | None = None, softcap: float | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of `attention`, recomputed from the saved ``out`` and ``lse``.

    With ``out`` and ``lse`` of the attention over all keys, ``k``/``v`` may be any block
    of those keys: the result is that block's share of dq and its dk, dv (ring attention
    sums the dq shares). ``causal`` then applies to the block's own positions
    (``Sk - Sq`` offset). ``grad_lse``: the gradient reaching ``lse``, if any.
    ``attn_mask``, ``window_left``, ``window_right``, ``softcap``: the forward's (the mask
    4-D, each dim 1 or full).

    Raises:
        ShapeError: shapes that do not match the forward's. DtypeError: dtypes differ, or
            ``lse``/``grad_lse`` are not float32 (float64 for float64 inputs). AttrError: a
            ``softcap`` that is not positive.
    """
    return ATTENTION_BACKWARD(dout, q, k, v, out, lse, grad_lse, attn_mask, causal,
                scale, window_left, window_right, softcap)
