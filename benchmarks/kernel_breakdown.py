"""Device time of every kernel in one forward + backward, per implementation.

For each case of `gpu_bench.training_cases` (softmax, log_softmax, rms_norm, layer_norm,
swiglu, silu_mul, cross_entropy at one size) and each implementation (opforge, torch eager,
torch.compile, Liger-Kernel when installed), ``torch.profiler`` records ``--iterations``
forward + backward steps after a warm-up; the report lists each kernel's device time per
step, so a slow pair shows which of its kernels (the main pass, a partials' sum, a copy)
takes the time. ``--warps 4,8,16,32`` then profiles opforge's row kernels (the norms,
softmax and cross_entropy) with each ``num_warps`` in turn, in place of the one their
tiling chooses.

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

import torch
from torch.profiler import ProfilerActivity, profile

import opforge
from gpu_bench import parse_shape, training_cases, training_step
from opforge.core import tiling
from opforge.ops import cross_entropy, softmax
from opforge.profiler.results import environment, write_results

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


def warps_rows(cases: Sequence[object], warps: Sequence[int], iterations: int
               ) -> tuple[list[str], list[dict[str, object]]]:
    """opforge's forward + backward of each case with every row kernel at each of
    ``warps``: (markdown lines, CSV rows)."""
    lines = ["## opforge's row kernels by num_warps", "",
             "| op | num_warps | kernel | µs per step |", "|---|---:|---|---:|"]
    rows: list[dict[str, object]] = []
    for count in warps:
        with ExitStack() as stack:
            for module in ROW_KERNEL_MODULES:
                stack.enter_context(unittest.mock.patch.object(
                    module, "gpu_warps", lambda *_, count=count: count))
            opforge.clear_caches()
            for case in cases:
                function: Callable[..., torch.Tensor] = case.impls[0][1]
                try:
                    times = kernel_times(training_step(function, case.leaves), iterations)
                except Exception as error:  # a count a kernel cannot take: reported
                    lines.append(f"| {case.op} | {count} | error: {type(error).__name__} | |")
                    continue
                for kernel, us, _ in times:
                    lines.append(f"| {case.op} | {count} | `{kernel[:60]}` | {us:.1f} |")
                    rows.append({"op": case.op, "impl": f"opforge num_warps={count}",
                                 "kernel": kernel, "us_per_step": round(us, 2),
                                 "launches": 0})
    opforge.clear_caches()
    return [*lines, ""], rows


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
    if args.warps:
        sweep_lines, sweep_rows = warps_rows(
            [case for case in cases if case.op not in ("swiglu", "silu_mul")],
            [int(count) for count in args.warps.split(",")], args.iterations)
        lines += sweep_lines
        rows += sweep_rows
    env = environment(device)
    text = "\n".join(lines) + "\n" + "".join(f"- {k}: {v}\n" for k, v in env.items())
    csv_path, md_path = write_results(args.out, "kernel_breakdown",
                                      [{**env, **row} for row in rows], text)
    print(f"wrote {csv_path} and {md_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
