"""Instructions a value of the elementwise and gated kernels compiled for sm_90 (no GPU
needed), against the issue slots a memory-bound kernel has for it.

A kernel that moves ``B`` bytes a value at the copy bandwidth ``W`` on ``S`` SMs of four
32-lane schedulers at clock ``f`` may spend ``128 S f B / W`` instructions a value before
issue, not memory, limits it: at the H200's measured copy bandwidth (4.22 TB/s,
results/gpu_2026-12-04), 132 SMs and 1.98 GHz, ``7.9 B``, so 32 for a bf16 unary forward
(2 bytes read, 2 written). Counted here: the SASS instructions of the variant a bf16 call
of ``--shape`` launches (``cuobjdump -sass`` of the cubin ``opforge compile-check``
builds), over the values a thread holds in one step of the kernel's loop (``BLOCK`` over
32 lanes times ``num_warps``); the prologue is counted too, so each figure is a bound from
above. Each kernel is compiled twice: as a GPU gets it, rounding to bf16 with the
hardware's ``cvt.rn``, and with the integer rounding the interpreter needs
(`opforge.ops._math.INTEGER_BF16_ROUNDING`), which GPU builds used before 2026-12-05.

Usage::

    python benchmarks/instruction_budget.py [--shape 8192x8192] [--out DIR]

Writes ``<out>/instruction_budget_<date>_<time>.{csv,md}``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import torch

import opforge
from opforge.aot import KernelVariant, parse_target, recorded_launches, sass_instructions
from opforge.core.plan import plan
from opforge.ops import _math
from opforge.profiler.results import write_report

COPY_BYTES_PER_S = 4.22e12  # H200 dst.copy_(src), results/gpu_2026-12-04
SMS, CLOCK_HZ, LANES_PER_SM = 132, 1.98e9, 128
# Operator -> its inputs from x (rows, cols) and w (cols,), bf16: elementwise and gated
# kernels. A value is one step of the kernel's loop index: an element of x, or of one
# half of x for swiglu (its gate and up pair), hence the pairs' half below.
CALLS = {
    "sigmoid": lambda x, w: (x,), "silu": lambda x, w: (x,), "gelu": lambda x, w: (x,),
    "broadcast_add": lambda x, w: (x, w), "sigmoid_backward": lambda x, w: (x, x),
    "silu_backward": lambda x, w: (x, x), "gelu_backward": lambda x, w: (x, x),
    "swiglu": lambda x, w: (x,), "swiglu_backward": lambda x, w: (x[:, : x.shape[1] // 2], x),
    "silu_mul": lambda x, w: (x, x), "silu_mul_backward": lambda x, w: (x, x, x),
}
HALF_OF_X = ("swiglu", "swiglu_backward")


@contextlib.contextmanager
def integer_rounding(enabled: bool) -> Iterator[None]:
    """Kernels compiled in the block round to bf16 in integer operations (the
    interpreter's form) when ``enabled``, else with the GPU's conversion; each setting
    compiles into a cache of its own (Triton's key does not see the switch)."""
    with tempfile.TemporaryDirectory() as cache, \
            mock.patch.dict(os.environ, {"TRITON_CACHE_DIR": cache}), \
            mock.patch.object(_math, "INTEGER_BF16_ROUNDING", _math.tl.constexpr(enabled)):
        yield


def budget(bytes_per_value: float) -> float:
    """Instructions a value a kernel moving ``bytes_per_value`` may issue at copy speed."""
    return LANES_PER_SM * SMS * CLOCK_HZ * bytes_per_value / COPY_BYTES_PER_S


def values_per_thread(variant: KernelVariant) -> int:
    """Values a thread holds in one loop step: the block over the program's lanes."""
    return variant.constexprs["BLOCK"] // (32 * variant.options.get("num_warps", 4))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="8192x8192")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    rows, cols = (int(n) for n in args.shape.split("x"))
    # Meta tensors: launches are recorded, nothing is allocated or run.
    x = torch.empty(rows, cols, dtype=torch.bfloat16, device="meta")
    w = torch.empty(cols, dtype=torch.bfloat16, device="meta")
    target, _ = parse_target("cuda:90")
    hardware = opforge.core.hardware.get_profile("h200")
    results = []
    for name, inputs_of in CALLS.items():
        inputs = inputs_of(x, w)
        with recorded_launches(hardware) as recorder:
            called = plan(opforge.get_op(name), *inputs)
            called.run(*inputs)
        moved = called.cost.bytes_moved / (x.numel() // (2 if name in HALF_OF_X else 1))
        (variant,) = recorder.variants.values()
        counts = {}
        for label, integer in (("cvt.rn", False), ("integer", True)):
            with integer_rounding(integer):
                counts[label] = sass_instructions(variant, target) / values_per_thread(variant)
        results.append({"op": name, "kernel": variant.name, "bytes_per_value": round(moved, 2),
                        "budget": round(budget(moved), 1),
                        "instructions_per_value": round(counts["cvt.rn"], 1),
                        "with_integer_rounding": round(counts["integer"], 1)})
        print(results[-1], flush=True)
    lines = [f"# Instructions a value, sm_90, bf16 {args.shape} (H200 tilings)", "",
             "| op | kernel | bytes a value | budget at copy speed | instructions a value "
             "| with integer bf16 rounding |", "|---|---|---:|---:|---:|---:|"]
    lines += [f"| {r['op']} | `{r['kernel']}` | {r['bytes_per_value']} | {r['budget']} | "
              f"{r['instructions_per_value']} | {r['with_integer_rounding']} |"
              for r in results]
    lines += ["", "Budget: 128 lanes x 132 SMs x 1.98 GHz x bytes a value / 4.22 TB/s. "
              "Instructions: the compiled kernel's SASS over the values a thread holds in "
              "one loop step (prologue included: a bound from above).", ""]
    write_report(args.out, "instruction_budget", results, lines, torch.device("cpu"))


if __name__ == "__main__":
    main()
