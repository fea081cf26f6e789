"""Roofline verdicts: how far a kernel is from the device's ceilings, and what bounds it.

A kernel that moved ``bytes`` and did ``flops`` in ``seconds`` uses
``flops / seconds / peak(dtype)`` of the compute roof and
``bytes / seconds / bandwidth`` of the memory roof. As the Ascend roofline tools classify:
at 80% or more of a roof it is **compute-bound** or **memory-bound**; below 80% of both it
is **latency-bound** (launch overhead, too few blocks to fill the cores, dependent memory
accesses, pipeline stalls), and its arithmetic intensity against the ridge point says which
roof it would meet first. The roofline percentage is the larger of the two utilisations.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from opforge.core.hardware import HardwareProfile

BOUND_THRESHOLD = 0.8
COMPUTE, MEMORY, LATENCY, UNKNOWN = "compute-bound", "memory-bound", "latency-bound", "unknown"
# Below this a call's time is taken as mostly launch and dispatch. On the CPU, views that
# move no data (aten::t, aten::permute, aten::reshape) took 4-10 us each under the profiler
# in this project's profiles; the GPU and NPU figures are chosen thresholds, not
# measurements of those devices.
LAUNCH_FLOOR_US = {"cuda": 8.0, "npu": 15.0, "cpu": 20.0}


@dataclass(frozen=True)
class Verdict:
    """A kernel (or a group of calls) against the roofline.

    Attributes:
        bound: `COMPUTE`, `MEMORY`, `LATENCY` or `UNKNOWN` (no cost known).
        tflops: achieved TFLOP/s (``None`` without a cost).
        gbs: achieved GB/s (``None`` without a cost).
        compute_util: fraction of the compute roof for the kernel's dtype.
        memory_util: fraction of the memory bandwidth.
        intensity: FLOPs per byte (``inf`` when no byte moves).
        ridge: the hardware's ridge point for the kernel's dtype (FLOP/byte).
    """

    bound: str
    tflops: float | None = None
    gbs: float | None = None
    compute_util: float | None = None
    memory_util: float | None = None
    intensity: float | None = None
    ridge: float | None = None

    @property
    def roofline_pct(self) -> float | None:
        """The larger of the two utilisations, in percent."""
        if self.compute_util is None or self.memory_util is None:
            return None
        return 100.0 * max(self.compute_util, self.memory_util)

    @property
    def memory_side(self) -> bool:
        """Whether the kernel meets the memory roof before the compute roof."""
        return self.intensity is not None and self.ridge is not None \
            and self.intensity < self.ridge


def judge(flops: float | None, bytes_moved: float | None, seconds: float,
          hardware: HardwareProfile, dtype: torch.dtype = torch.float32) -> Verdict:
    """The verdict for ``flops`` and ``bytes_moved`` done in ``seconds`` on ``hardware``.

    ``dtype`` picks the compute roof (bf16/fp16 tensor cores, fp32 otherwise). A kernel
    without a known cost (``None``) or without a duration gets `UNKNOWN`.
    """
    if flops is None or bytes_moved is None or seconds <= 0:
        return Verdict(UNKNOWN)
    peak = hardware.peak(dtype)
    compute_util = flops / seconds / peak
    memory_util = bytes_moved / seconds / hardware.memory_bandwidth
    if max(compute_util, memory_util) >= BOUND_THRESHOLD:
        bound = COMPUTE if compute_util >= memory_util else MEMORY
    else:
        bound = LATENCY
    intensity = flops / bytes_moved if bytes_moved else math.inf
    return Verdict(bound, flops / seconds / 1e12, bytes_moved / seconds / 1e9, compute_util,
                   memory_util, intensity, peak / hardware.memory_bandwidth)


def advice(verdict: Verdict, hardware: HardwareProfile, avg_us: float,
           block_num: int | None) -> str:
    """One line on what to do about a kernel with this verdict.

    Args:
        verdict: the kernel's verdict (aggregated over its calls).
        hardware: the profile it was judged against.
        avg_us: its average duration per call.
        block_num: its grid size (programs launched), when known.
    """
    if verdict.bound == UNKNOWN:
        return ("no cost known: declare FLOPs and bytes (an OpDef's cost) to place it on "
                "the roofline")
    pct = verdict.roofline_pct or 0.0
    if verdict.bound == COMPUTE:
        return (f"at {pct:.0f}% of the compute roof: only fewer FLOPs or a faster dtype "
                "(tensor cores) make it faster")
    if verdict.bound == MEMORY:
        return (f"at {pct:.0f}% of the bandwidth: move fewer bytes (fuse it with its "
                "neighbours, store a narrower dtype)")
    cpu = hardware.device_type == "cpu"
    if verdict.tflops == 0 and verdict.gbs == 0:
        return (f"moves no data ({avg_us:.1f} us a call): a view or metadata call whose time "
                "is dispatch overhead; make fewer calls")
    floor = LAUNCH_FLOOR_US.get(hardware.device_type, LAUNCH_FLOOR_US["cuda"])
    if avg_us < floor:
        batch = ("batch more work into each call" if cpu else "replay the step as a graph "
                 "(plan.run with out= and workspace= is capturable)")
        return f"launch-bound ({avg_us:.1f} us a call): fuse it with its neighbours or {batch}"
    if block_num is not None and 0 < block_num < hardware.core_count:
        return (f"{block_num} blocks on {hardware.core_count} cores: split the work into "
                "more programs (smaller blocks, split-K, a persistent grid)")
    if verdict.memory_side:
        fix = ("larger contiguous blocks per call, fewer passes over the data, more threads"
               if cpu else "check coalescing and vector width, and read each input once "
               "(larger tiles, fewer passes)")
        return f"{100 * (verdict.memory_util or 0):.0f}% of the bandwidth: {fix}"
    fix = ("vectorised float32 loops, larger matrix blocks, more threads" if cpu else
           "feed the tensor cores (bf16/fp16 dot operands), larger tiles and more pipeline "
           "stages")
    return f"{100 * (verdict.compute_util or 0):.0f}% of the compute roof: {fix}"


def plot(points: Sequence[tuple[str, float, float, float, str]], hardware: HardwareProfile,
         dtypes: Sequence[torch.dtype], path: Path, title: str) -> Path:
    """Draw kernels against the roofs of ``hardware`` into ``path`` (PNG).

    Args:
        points: ``(label, intensity FLOP/byte, achieved FLOP/s, share of time, bound)``
            per kernel; the marker's area follows the share of time.
        dtypes: compute dtypes whose roofs are drawn.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {COMPUTE: "tab:red", MEMORY: "tab:blue", LATENCY: "tab:orange"}
    figure, axes = plt.subplots(figsize=(8, 5.5), dpi=110)
    finite = [p for p in points if 0 < p[1] < math.inf and p[2] > 0]
    low = min([p[1] for p in finite] + [hardware.ridge_point(torch.float32) / 1e3, 1e-2])
    high = max([p[1] for p in finite] + [hardware.ridge_point(d) * 1e2 for d in dtypes])
    xs = [low * (high / low) ** (i / 200) for i in range(201)]
    for dtype in dict.fromkeys(dtypes):
        peak = hardware.peak(dtype)
        axes.plot(xs, [min(peak, hardware.memory_bandwidth * x) for x in xs],
                  label=f"roof {str(dtype).removeprefix('torch.')}: "
                        f"{peak / 1e12:.3g} TFLOP/s, {hardware.memory_bandwidth / 1e9:.0f} GB/s")
    for bound, colour in colours.items():
        chosen = [p for p in finite if p[4] == bound]
        if chosen:
            axes.scatter([p[1] for p in chosen], [p[2] for p in chosen],
                         s=[20 + 400 * p[3] for p in chosen], c=colour, alpha=0.6,
                         edgecolors="black", linewidths=0.5, label=bound)
    for label, x, y, _, _ in sorted(finite, key=lambda p: -p[3])[:6]:
        axes.annotate(label[:32], (x, y), fontsize=7, xytext=(4, 4),
                      textcoords="offset points")
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("arithmetic intensity (FLOP / byte)")
    axes.set_ylabel("achieved FLOP/s")
    axes.set_title(title, fontsize=10)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=7, loc="lower right")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path
