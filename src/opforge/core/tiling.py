"""Arithmetic shared by operator tilings: block sizes, persistent grids, on-chip budgets."""

from __future__ import annotations

from opforge.core.hardware import HardwareProfile

# Ascend binds programs to physical cores and rejects grids above UINT16_MAX; GPUs accept
# more, but a persistent loop over tiles makes the extra programs useless anyway.
MAX_PROGRAMS = 65535
# Programs per core in a persistent grid: enough to hide latency on GPUs (several resident
# programs per SM), harmless on Ascend (programs beyond the core count run in rounds).
PROGRAMS_PER_CORE = 8


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def persistent_grid(tiles: int, hardware: HardwareProfile) -> int:
    """Programs for ``tiles`` units of work: each program loops over
    ``range(pid, tiles, num_programs)``; at least 1 so that a grid is never empty."""
    return max(1, min(tiles, hardware.core_count * PROGRAMS_PER_CORE, MAX_PROGRAMS))
