"""Arithmetic shared by operator tilings: block sizes, persistent grids, on-chip budgets."""

from __future__ import annotations

from typing import Any

from opforge.core.hardware import HardwareProfile
from opforge.core.opdef import Tiling

# Ascend binds programs to physical cores and rejects grids above UINT16_MAX; GPUs accept
# more, but a persistent loop over tiles makes the extra programs useless anyway.
MAX_PROGRAMS = 65535
# Programs per core in a persistent grid: enough to hide latency on GPUs (several resident
# programs per SM), harmless on Ascend (programs beyond the core count run in rounds).
PROGRAMS_PER_CORE = 8
# Largest element offset that int32 index arithmetic in a kernel holds.
INT32_LIMIT = 2**31 - 1
# Elements of a "rows" tile (BLOCK_M whole rows), and the largest block a "looped" one
# streams a row in.
ROWS_TILE = 4096
LOOP_BLOCK = 4096


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def persistent_grid(tiles: int, hardware: HardwareProfile, per_core: int | None = None
                    ) -> int:
    """Programs for ``tiles`` units of work, ``per_core`` a core at most
    (`PROGRAMS_PER_CORE` when ``None``, read at each call): each program loops over
    ``range(pid, tiles, num_programs)``; at least 1 so that a grid is never empty."""
    per_core = PROGRAMS_PER_CORE if per_core is None else per_core
    return max(1, min(tiles, hardware.core_count * per_core, MAX_PROGRAMS))


def work_splits(programs: int, steps: int, hardware: HardwareProfile, min_steps: int = 4,
                busy_share: float = 1.0) -> int:
    """Slices of a loop of ``steps`` block steps (a long reduction: an inner dimension, a
    sequence of keys) when ``programs`` programs leave cores idle (skinny or decoding shapes):
    each slice becomes a program of its own and a second kernel combines the slices'
    float32 partials. Enough slices for two programs a core, each at least ``min_steps``
    steps long; 1 on the CPU (the interpreter pays per block operation, not per idle core)
    and when the programs fill ``busy_share`` of the cores or more."""
    if hardware.device_type == "cpu" or not 0 < programs < busy_share * hardware.core_count:
        return 1
    return max(1, min(cdiv(2 * hardware.core_count, programs), steps // min_steps))


def split_steps(steps: int, splits: int) -> tuple[int, int]:
    """(block steps a slice holds, slices that hold any) of ``steps`` steps cut into at
    most ``splits`` slices of whole steps; no steps is one (empty) slice, so that a grid
    keeps a program."""
    per_split = cdiv(steps, max(1, splits))
    return per_split, cdiv(steps, per_split) if steps else 1


# Values a thread keeps live, by default: fewer warps spill registers on wide rows.
VALUES_PER_THREAD = 16


def gpu_warps(elements: int, hardware: HardwareProfile,
              values_per_thread: int = VALUES_PER_THREAD) -> int | None:
    """Warps for a program that keeps ``elements`` values live, on a CUDA GPU: about
    ``values_per_thread`` values a thread, from 4 to 32 warps. ``None`` elsewhere:
    triton-ascend has no warps and the interpreter ignores them."""
    if hardware.device_type != "cuda":
        return None
    return max(4, min(32, next_power_of_2(elements) // (32 * values_per_thread)))


def launch_options(tiling: object) -> dict[str, int]:
    """The GPU-only launch options of a tiling: ``num_warps`` from its ``warps`` option and
    ``num_stages`` from ``stages``, which tilings set for CUDA profiles only, so that
    kernels planned for other devices never receive them (the interpreter ignores them)."""
    options = getattr(tiling, "options", {})
    chosen = {"num_warps": options.get("warps"), "num_stages": options.get("stages")}
    return {key: value for key, value in chosen.items() if value is not None}


def grid_stride_wide(elements: int, programs: int, block: int) -> bool:
    """Whether a grid-stride loop over ``elements`` element offsets, ``programs`` programs
    of ``block`` elements stepping ``programs * block``, needs int64 offsets: its offset
    reaches ``elements + programs * block`` before the loop test stops it, and an int32
    one wrapped past 2^31 is negative, which an ``offset < elements`` mask lets through."""
    return elements + programs * block > INT32_LIMIT


def wide_offsets(*tensors: Any) -> bool:
    """Whether a kernel addressing these tensors through their strides needs int64 element
    offsets (its ``WIDE`` switch): when the reach of some tensor, 1 + sum of (size - 1) *
    |stride| over its dims, exceeds `INT32_LIMIT` (one element of margin over the largest
    offset). A contiguous tensor's
    reach is its element count (the common case, without a loop over dims)."""
    for tensor in tensors:
        if tensor.is_contiguous():
            reach = tensor.numel()
        else:
            reach = 1 + sum((size - 1) * abs(stride)
                            for size, stride in zip(tensor.shape, tensor.stride()))
        if reach > INT32_LIMIT:
            return True
    return False


# Warps a one-row tile may take at a kernel's larger values a thread: a thread holds
# 65536 / threads registers, 255 at 8 warps but 128 at 16.
ONE_ROW_MAX_WARPS = 8


def one_row_values_per_thread(block_m: int, block_n: int, values_per_thread: int,
                              one_row: int | None) -> int:
    """`gpu_warps`' values a thread for a tile of ``block_m`` rows of ``block_n``:
    ``one_row`` for a tile of one row where a kernel asks for it and it leaves the
    program at most `ONE_ROW_MAX_WARPS` warps, else ``values_per_thread``: past that
    register cap a row kernel keeping a few row streams at 32 values a thread spills;
    tiles of several rows keep the default (the asking kernels' NOTEs give the cases
    measured)."""
    if one_row is None or block_m != 1 or block_n // (32 * one_row) > ONE_ROW_MAX_WARPS:
        return values_per_thread
    return one_row


def rows_then_looped(rows: int, cols: int, per_element: int, hardware: HardwareProfile,
                     values_per_thread: int = VALUES_PER_THREAD,
                     one_row: int | None = None) -> list[Tiling]:
    """Row-reduction candidates: ``rows`` (``BLOCK_M`` whole rows of ``cols`` in one
    tile), then ``looped`` (one row streamed in blocks of ``BLOCK_N``) with blocks from
    `LOOP_BLOCK` (or the hardware's tile limit) down to 16; ``per_element``: on-chip bytes
    an element takes; ``values_per_thread``: `gpu_warps`'; ``one_row``: values a thread
    of a ``rows`` tile of one row (`one_row_values_per_thread`)."""
    block_n = next_power_of_2(max(cols, 1))
    block_m = max(1, min(next_power_of_2(max(rows, 1)), ROWS_TILE // block_n))
    candidates = [Tiling("rows", {"BLOCK_M": block_m, "BLOCK_N": block_n},
                         block_m * block_n * per_element, double_buffered=False,
                         options={"warps": gpu_warps(
                             block_m * block_n, hardware,
                             one_row_values_per_thread(block_m, block_n,
                                                       values_per_thread, one_row))})]
    block = min(LOOP_BLOCK, hardware.max_tile_elements, block_n)
    while block >= 16:
        candidates.append(Tiling("looped", {"BLOCK_M": 1, "BLOCK_N": block},
                                 block * per_element,
                                 options={"warps": gpu_warps(block, hardware,
                                                             values_per_thread)}))
        block //= 2
    return candidates
