"""Matmul block-size sweep on a GPU: which variant (pointer loads or tensor descriptors) and
(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) the tiling of `opforge.ops.matmul` should pick,
against cuBLAS on the same shapes.

Shapes: bf16 squares (4096, 8192) and MlaProlog's DeepSeek-V3 products (the query
down-projection at T = 16 and 1024 tokens, the up-projection and the per-head absorption
of ``W_uk`` as a batched product at T = 1024; a decode step's query path after the
down-projection is MlaProlog's own kernel). Each configuration is forced as the only tiling (plan
caches cleared), timed with `opforge.profiler.bench.time_call` (do_bench's median on a
GPU) and checked against the default tiling's result (relative max difference), so that
a fast wrong kernel shows; one that fails to compile (shared memory) is reported and
skipped.

Usage (GPU machine)::

    PYTHONPATH=src:benchmarks python benchmarks/matmul_tuning.py --out DIR

``--compile-only cuda:90`` (no GPU, no ``TRITON_INTERPRET``) compiles every configuration
for the target and reports registers and spill bytes instead; ``--device cpu`` with
``TRITON_INTERPRET=1`` and ``--scale 64`` is a smoke run of the script (shapes divided by
the scale, timings meaningless).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from unittest import mock

import torch

import opforge
from attention_tuning import (
    compiled_columns,
    relative_difference,
    write_compile_report,
    write_sweep_report,
)
from opforge import aot
from opforge.core.opdef import Tiling
from opforge.ops import matmul
from opforge.ops.matmul import MATMUL
from opforge.profiler.bench import time_call

# (variant, BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): the default of 2026-11-30 first (its
# warps from the generic rule, 16 for a 128 x 128 tile), then the usual Hopper shapes (two
# warpgroups on 128 x 256), fewer warps, shorter K blocks, narrow tiles for skinny M; then
# the best-known shapes again with operand blocks by tensor descriptor (TMA), with and
# without a warp-specialized K loop.
POINTER_SHAPES = ((128, 128, 64, 16, 4), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4),
                  (128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (128, 256, 64, 8, 4),
                  (128, 128, 32, 4, 4), (64, 256, 32, 4, 4), (64, 128, 64, 4, 4),
                  (16, 128, 128, 4, 4), (16, 256, 64, 4, 4))
DESCRIPTOR_SHAPES = ((128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (16, 128, 128, 4, 4))
CONFIGS = (*(("tiles", *shape) for shape in POINTER_SHAPES),
           *((variant, *shape) for variant in ("tiles_tma", "tiles_tma_ws")
             for shape in DESCRIPTOR_SHAPES))
# K slices forced on the decode-sized shapes (the grid's rule picks its own otherwise).
SLICE_COUNTS = (1, 2, 4, 8, 16, 32)
# (label, a shape, b shape).
SHAPES = (("square 4096", (4096, 4096), (4096, 4096)),
          ("square 8192", (8192, 8192), (8192, 8192)),
          ("MLA down T1024", (1024, 7168), (7168, 1536)),
          ("MLA up T1024", (1024, 1536), (1536, 24576)),
          ("MLA absorb T1024", (128, 1024, 128), (128, 128, 512)),
          ("MLA down T16", (16, 7168), (7168, 1536)))


def forced(config: Sequence[object]) -> Tiling:
    """The tiling of one sweep configuration."""
    variant, block_m, block_n, block_k, warps, stages = config
    return Tiling(variant, {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k}, 0,
                  double_buffered=False, options={"warps": warps, "stages": stages})


def label(config: Sequence[object]) -> str:
    """``M128 N256 K64 w8 s3`` (``+ tma``, ``+ tma ws`` for the descriptor variants)."""
    variant, block_m, block_n, block_k, warps, stages = config
    suffix = {"tiles": "", "tiles_tma": " tma", "tiles_tma_ws": " tma ws"}[variant]
    return f"M{block_m} N{block_n} K{block_k} w{warps} s{stages}{suffix}"


def flops(a_shape: Sequence[int], b_shape: Sequence[int]) -> float:
    """2 M N K per batch entry."""
    batch = a_shape[0] if len(a_shape) == 3 else 1
    return 2.0 * batch * a_shape[-2] * a_shape[-1] * b_shape[-1]


def compile_rows(target_text: str) -> list[dict[str, object]]:
    """Every configuration compiled for a GPU target without the GPU: registers and spills
    of the bf16 kernels of a 256 x 256 x 256 product (the 2-D and the batched launch share
    them; on an H200 profile its 4 tiles cut K into slices where it has 8 blocks, so the
    K-slice sum shows too)."""
    target, hardware = aot.parse_target(target_text)
    a = torch.randn(256, 256, dtype=torch.bfloat16)
    rows = []
    for config in CONFIGS:
        with mock.patch.object(MATMUL, "tiling", lambda *args, config=config: [forced(config)]
                               ), mock.patch.object(matmul, "descriptors_usable",
                                                    lambda *tensors: True), \
                aot.recorded_launches(hardware) as recorder:
            opforge.matmul(a, a)
        for result in aot.compile_variants(recorder.variants.values(), target):
            rows.append({"config": label(config), "kernel": result.variant.name,
                         **compiled_columns(result)})
            print(rows[-1], flush=True)
    return rows


def timed_rows(device: torch.device, scale: int) -> list[dict[str, object]]:
    """cuBLAS, then every configuration, per shape; for the decode-sized (T = 16) shapes
    also the chosen tiling with its K slices forced (1 = unsplit), to check the rule
    that decides them."""
    rows = []
    for name, a_shape, b_shape in SHAPES:
        a_shape = tuple(max(1, size // scale) for size in a_shape)
        b_shape = (*a_shape[:-2], a_shape[-1], max(1, b_shape[-1] // scale))
        a = torch.randn(a_shape, device=device, dtype=torch.bfloat16)
        b = torch.randn(b_shape, device=device, dtype=torch.bfloat16)
        work = flops(a_shape, b_shape)
        opforge.clear_caches()
        expected = opforge.matmul(a, b)
        cublas_us = time_call(functools.partial(torch.matmul, a, b), device) * 1e6
        shape = f"{name} ({'x'.join(map(str, a_shape))} @ {'x'.join(map(str, b_shape))})"
        rows.append({"shape": shape, "config": "torch.matmul (cuBLAS)",
                     "us": round(cublas_us, 1), "tflops": round(work / cublas_us / 1e6, 1),
                     "of_cublas": 1.0})
        variants = [(label(config), mock.patch.object(
            MATMUL, "tiling", lambda *args, config=config: [forced(config)]))
            for config in CONFIGS]
        if "T16" in name:
            variants += [(f"chosen, {slices} K slice{'s' if slices > 1 else ''}",
                          mock.patch.object(matmul, "work_splits",
                                            lambda *args, slices=slices, **kwargs: slices))
                         for slices in SLICE_COUNTS]
        for config, patch in variants:
            opforge.clear_caches()
            try:
                with patch:
                    call = functools.partial(opforge.matmul, a, b)
                    us = time_call(call, device) * 1e6
                    diff = relative_difference((call(),), (expected,))
                row = {"shape": shape, "config": config, "us": round(us, 1),
                       "tflops": round(work / us / 1e6, 1),
                       "of_cublas": round(cublas_us / us, 3), "diff": diff}
            except Exception as error:  # too much shared memory, say: reported
                row = {"shape": shape, "config": config, "us": None, "tflops": None,
                       "error": f"{type(error).__name__}: {error}"[:200]}
            print(row, flush=True)
            rows.append(row)
    opforge.clear_caches()
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get(
        "OUT", "benchmarks/results")),
        help="output directory (default: $OUT, else benchmarks/results)")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run on the interpreter")
    parser.add_argument("--scale", type=int, default=1, help="divide every size by this")
    parser.add_argument("--compile-only", metavar="TARGET",
                        help="compile every configuration for TARGET (cuda:90) without a GPU "
                             "and report registers and spills instead of timing")
    args = parser.parse_args(argv)
    if args.compile_only:
        write_compile_report(args.out, "matmul_compile",
                             f"Matmul configurations compiled for {args.compile_only} (bf16)",
                             {"config": "config", "kernel": "kernel"},
                             compile_rows(args.compile_only))
        return 0
    device = torch.device(args.device)
    rows = timed_rows(device, args.scale)
    write_sweep_report(args.out, "matmul_tuning", "Matmul block-size sweep", "bf16", device,
                       {"shape": "shape", "config": "config"}, rows,
                       extra={"of cuBLAS": "of_cublas"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
