"""Device time of every kernel in one forward + backward, per implementation.

For each case of `gpu_bench.training_cases` (softmax, log_softmax, rms_norm, layer_norm,
swiglu, silu_mul, cross_entropy at one size) and each implementation (opforge, torch eager,
torch.compile, Liger-Kernel when installed), ``torch.profiler`` records ``--iterations``
forward + backward steps after a warm-up; the report lists each kernel's device time per
step, so a slow pair shows which of its kernels (the main pass, a partials' sum, a copy)
takes the time. ``--warps 4,8,16,32`` then profiles opforge's row kernels (the norms,
softmax and cross_entropy) with each ``num_warps`` in turn, in place of the one their
tiling chooses; ``--programs-per-core 2,4,8,100000`` every case with its persistent
grids at each count of programs a core (8 by default; a count past the blocks gives one
block a program, as torch's and Liger's elementwise kernels launch).

Usage (on the GPU machine, from the repository root)::

    PYTHONPATH=src:benchmarks python benchmarks/kernel_breakdown.py [--out DIR]

Writes ``<out>/kernel_breakdown_<date>_<time>.{csv,md}``.
"""

from __future__ import annotations

import argparse
import os
import sys
import unittest.mock
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

import opforge
from gpu_bench import parse_shape, training_cases, training_step
from opforge.core import tiling
from opforge.ops import cross_entropy, reduce_sum, softmax
from opforge.profiler.results import write_report

# The modules whose tilings choose num_warps with gpu_warps (the row kernels; the norms'
# through `tiling.rows_then_looped`).
ROW_KERNEL_MODULES = (tiling, softmax, cross_entropy)


def kernel_times(step: object, iterations: int) -> list[tuple[str, float, int]]:
    """(kernel name, device µs per step, launches per step) of ``step``, slowest first."""
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iterations):
            step()
        torch.cuda.synchronize()
    kernels = [event for event in prof.key_averages()
               if str(event.device_type).endswith("CUDA") and event.self_device_time_total > 0]
    kernels.sort(key=lambda event: -event.self_device_time_total)
    return [(event.key, event.self_device_time_total / iterations, event.count // iterations)
            for event in kernels]


def sweep_rows(setting: str, values: Sequence[int],
               patches: Callable[[int], list[Any]], cases: Sequence[object],
               iterations: int) -> tuple[list[str], list[dict[str, object]]]:
    """opforge's forward + backward of each case with ``setting`` at each of ``values``
    (``patches(value)``: the mock patches that apply it): (markdown lines, CSV rows)."""
    lines = [f"## opforge's kernels by {setting}", "",
             f"| op | {setting} | kernel | µs per step |", "|---|---:|---|---:|"]
    rows: list[dict[str, object]] = []
    for value in values:
        with ExitStack() as stack:
            for patch in patches(value):
                stack.enter_context(patch)
            opforge.clear_caches()  # plans hold their tiling and grid
            for case in cases:
                function: Callable[..., torch.Tensor] = case.impls[0][1]
                try:
                    times = kernel_times(training_step(function, case.leaves), iterations)
                except Exception as error:  # a value a kernel cannot take: reported
                    lines.append(f"| {case.op} | {value} | error: {type(error).__name__} | |")
                    continue
                for kernel, us, _ in times:
                    lines.append(f"| {case.op} | {value} | `{kernel[:60]}` | {us:.1f} |")
                    rows.append({"op": case.op, "impl": f"opforge {setting}={value}",
                                 "kernel": kernel, "us_per_step": round(us, 2),
                                 "launches": 0})
    opforge.clear_caches()
    return [*lines, ""], rows


def warps_patches(count: int) -> list[Any]:
    """Every row kernel's tiling at ``count`` warps."""
    return [unittest.mock.patch.object(module, "gpu_warps", lambda *_, count=count: count)
            for module in ROW_KERNEL_MODULES]


def programs_patches(count: int) -> list[Any]:
    """Persistent grids of ``count`` programs a core (up to one block a program): the
    elementwise, gated, rope and cross_entropy kernels and the norms' forwards
    (`tiling.persistent_grid`), softmax's and reduce_sum's (which size by the count
    themselves)."""
    return [unittest.mock.patch.object(module, "PROGRAMS_PER_CORE", count)
            for module in (tiling, softmax, reduce_sum)]


def main(argv: Sequence[str] | None = None) -> int:
    """Profile every implementation of every case; write the report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path,
                        default=Path(os.environ.get("OUT", "benchmarks/results")))
    parser.add_argument("--shape", type=parse_shape, default=(8192, 8192))
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                        default="bfloat16")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--warps", default="",
                        help="comma-separated num_warps for opforge's row kernels")
    parser.add_argument("--programs-per-core", default="",
                        help="comma-separated programs a core for opforge's persistent "
                             "grids (a count past the blocks gives one block a program)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel_breakdown.py needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    rows = []
    lines = [f"# Kernels of one forward + backward, {args.dtype} {args.shape[0]}x"
             f"{args.shape[1]}", ""]
    cases = training_cases(args.shape, getattr(torch, args.dtype), device, True)
    for case in cases:
        lines += [f"## {case.op}", "", "| implementation | kernel | µs per step | launches |",
                  "|---|---|---:|---:|"]
        for impl, function in case.impls:
            try:
                times = kernel_times(training_step(function, case.leaves), args.iterations)
            except Exception as error:  # reported; the next implementation still runs
                lines.append(f"| {impl} | error: {type(error).__name__}: "
                             f"{str(error)[:200]} | | |")
                continue
            total = sum(us for _, us, _ in times)
            lines.append(f"| {impl} | **all** | **{total:.1f}** | |")
            for kernel, us, launches in times:
                lines.append(f"| {impl} | `{kernel[:90]}` | {us:.1f} | {launches} |")
                rows.append({"op": case.op, "impl": impl, "kernel": kernel,
                             "us_per_step": round(us, 2), "launches": launches})
            print(f"{case.op:14} {impl:14} {total:9.1f} us", flush=True)
        lines.append("")
    row_cases = [case for case in cases if case.op not in ("swiglu", "silu_mul")]
    for setting, text, patches, swept in (
            ("num_warps", args.warps, warps_patches, row_cases),
            ("programs a core", args.programs_per_core, programs_patches, cases)):
        if text:
            sweep_lines, sweep_results = sweep_rows(
                setting, [int(value) for value in text.split(",")], patches, swept,
                args.iterations)
            lines += sweep_lines
            rows += sweep_results
    write_report(args.out, "kernel_breakdown", rows, lines, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
