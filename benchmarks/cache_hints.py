"""Whether a load's or a store's cache hint changes a streaming kernel's bandwidth.

opforge's row kernels and a peer's softmax compiled for sm_90 differ only in the peer's
hints (a ``.ca`` load, a ``.cs`` store: ``LDG.E.128.STRONG.SM`` and ``STG.E.EF.128``), and
the peer's forward ran at 65 µs where opforge's took 80 (bf16 8192 x 8192, H200,
results/gpu_2026-12-04). This times two kernels, each with every hint pair: a copy, and a
one-row-a-program softmax of opforge's shape (16 warps, the whole row in registers),
beside ``torch``'s own copy; each figure is the median of ``triton.testing.do_bench``,
with the bytes the kernel must move over that time.

Usage (on the GPU machine, from the repository root)::

    PYTHONPATH=src:benchmarks python benchmarks/cache_hints.py [--shape 8192x8192]

Writes ``<out>/cache_hints_<date>_<time>.{csv,md}``. With ``--device cpu`` (the Triton
interpreter, which ignores hints) every variant runs once on a small shape and is checked
against torch, so a script error shows without a GPU.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import triton
import triton.language as tl

from opforge.profiler.results import write_report

# (name, load cache modifier, load eviction policy, store cache modifier)
HINTS = (
    ("none", "", "", ""),
    ("load .ca", ".ca", "", ""),
    ("load evict_first", "", "evict_first", ""),
    ("store .cs", "", "", ".cs"),
    ("load .ca, store .cs", ".ca", "", ".cs"),
    ("load evict_first, store .cs", "", "evict_first", ".cs"),
)
COPY_BLOCK = 2048


@triton.jit
def _copy_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, LOAD_CACHE: tl.constexpr,
                 LOAD_EVICT: tl.constexpr, STORE_CACHE: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask, cache_modifier=LOAD_CACHE,
                eviction_policy=LOAD_EVICT)
    tl.store(y_ptr + offsets, x, mask=mask, cache_modifier=STORE_CACHE)


@triton.jit
def _softmax_kernel(x_ptr, y_ptr, N, BLOCK: tl.constexpr, LOAD_CACHE: tl.constexpr,
                    LOAD_EVICT: tl.constexpr, STORE_CACHE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * N + cols, mask=mask, other=-float("inf"),
                cache_modifier=LOAD_CACHE, eviction_policy=LOAD_EVICT).to(tl.float32)
    e = tl.exp2((x - tl.max(x, axis=0)) * 1.4426950408889634)
    y = e * (1.0 / tl.sum(e, axis=0))
    tl.store(y_ptr + row * N + cols, y.to(y_ptr.dtype.element_ty), mask=mask,
             cache_modifier=STORE_CACHE)


def launchers(x: torch.Tensor, y: torch.Tensor) -> dict[str, object]:
    """kernel name -> (hints -> a launch of it from ``x`` into ``y``)."""
    rows, cols = x.shape
    block = triton.next_power_of_2(cols)
    warps = max(4, min(16, block // 512))

    def copy(hints: tuple[str, str, str]) -> None:
        _copy_kernel[(triton.cdiv(x.numel(), COPY_BLOCK),)](
            x, y, x.numel(), COPY_BLOCK, *hints, num_warps=4)

    def softmax(hints: tuple[str, str, str]) -> None:
        _softmax_kernel[(rows,)](x, y, cols, block, *hints, num_warps=warps)

    return {"copy": copy, "softmax": softmax}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="8192x8192")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    rows, cols = (int(n) for n in args.shape.split("x"))
    device = torch.device(args.device)
    if device.type == "cpu":
        rows, cols = min(rows, 4), min(cols, 256)
    x = torch.randn(rows, cols, device=device).to(torch.bfloat16)
    y = torch.empty_like(x)
    moved = 2 * x.numel() * x.element_size()
    expected = {"copy": x, "softmax": torch.softmax(x.float(), -1).to(x.dtype)}
    results = []

    def record(kernel: str, hint: str, run: object) -> None:
        if device.type == "cpu":
            run()
            us = float("nan")
        else:
            us = triton.testing.do_bench(run, return_mode="median") * 1e3
        torch.testing.assert_close(y, expected[kernel], rtol=2e-2, atol=1e-2)
        results.append({"kernel": kernel, "hints": hint, "us": round(us, 2),
                        "tb_per_s": round(moved / us / 1e6, 3)})
        print(results[-1], flush=True)

    record("copy", "torch copy_", lambda: y.copy_(x))
    for kernel, launch in launchers(x, y).items():
        for name, *hints in HINTS:
            y.zero_()
            record(kernel, name, lambda launch=launch, hints=tuple(hints): launch(hints))
    lines = [f"# Cache hints on streaming kernels, bf16 {rows}x{cols}", "",
             "| kernel | hints | µs | TB/s |", "|---|---|---:|---:|"]
    lines += [f"| {r['kernel']} | {r['hints']} | {r['us']} | {r['tb_per_s']} |"
              for r in results]
    lines += ["", "TB/s: the bytes the kernel must move (its input read once, its output "
              "written once) over the median time.", ""]
    write_report(args.out, "cache_hints", results, lines, device)


if __name__ == "__main__":
    main()
