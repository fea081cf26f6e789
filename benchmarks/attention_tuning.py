"""Attention block-size sweep on a GPU: which (BLOCK_M, BLOCK_N, warps, stages) the tiling
of `opforge.ops.attention` should pick for each head dim.

For bf16 ``B=4, H=16, S=4096`` (non-causal) at head dims 64, 128 and 256, each candidate
configuration is forced as the only tiling, the plan caches are cleared, and the forward
and the backward (``attention_backward`` alone, from a saved out and lse) are timed with
`opforge.profiler.bench.time_call` (do_bench's median on a GPU), in TFLOP/s by
FlashAttention's convention (forward 4 B H S² D, backward 2.5 times that) next to torch
SDPA's FlashAttention and cuDNN
backends (their backward timed alone, from a kept autograd graph). A configuration that
fails to compile (too much shared memory) and a backend that refuses the shape are
reported and skipped; each configuration's result is compared with the default tiling's
(relative max difference) so that a fast wrong kernel shows. ``BLOCK_M`` rows are held
and ``BLOCK_N`` streamed in every kernel: queries held in the forward and for dQ, keys held
for dK and dV.

Usage (GPU machine)::

    PYTHONPATH=src:benchmarks python benchmarks/attention_tuning.py --out DIR

``--device cpu --seq 32`` with ``TRITON_INTERPRET=1`` is a smoke run of the script itself
(the Triton kernels in the interpreter, the timings meaningless). ``--compile-only cuda:90``
(no GPU, no ``TRITON_INTERPRET``) compiles every configuration for the target and reports
each kernel's registers and spill bytes: a first screen of the configurations before GPU
time is spent on them.
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
from torch.nn.attention import SDPBackend, sdpa_kernel

import opforge
from opforge import aot
from opforge.core.opdef import Tiling
from opforge.ops import attention
from opforge.profiler.bench import time_call
from opforge.profiler.results import environment, write_results

# Forward: (variant, (BLOCK_M queries held, BLOCK_N keys streamed), warps, stages): the
# pointer kernel's best of the first sweep, then the tensor-descriptor variants (TMA copies,
# with and without a warp-specialized key loop; Triton's warp specialization pass rejects
# 4 warps at these blocks, see --compile-only).
FORWARD = (("flash", (128, 64), 4, 3), ("flash", (128, 64), 8, 3), ("flash", (64, 64), 4, 3),
           ("flash", (128, 64), 8, 2), ("flash_tma", (128, 64), 4, 3),
           ("flash_tma", (128, 64), 8, 3), ("flash_tma", (128, 128), 8, 3),
           ("flash_tma", (128, 64), 8, 2), ("flash_tma_ws", (128, 128), 8, 2),
           ("flash_tma_ws", (128, 64), 8, 2))
# Backward: (variant, (dQ: BLOCK_M queries held, BLOCK_N keys streamed), (dK/dV: BLOCK_K
# keys held, BLOCK_Q queries streamed), warps, stages): the first sweep's winners, large
# held blocks with short streamed ones, deeper pipelines, the small key blocks that keep
# head dim 256's float32 dK and dV in registers, and those at 8 warps (sm_90, D 256: the
# key side's 688 B of spill at 4 warps is none at 8, the query side's 472 B 120 B); then
# the streamed blocks by tensor descriptor.
BACKWARD_BLOCKS = (((64, 64), (64, 64), 4, 2), ((64, 64), (64, 64), 4, 3),
                   ((128, 32), (128, 32), 4, 3), ((128, 32), (64, 64), 8, 3),
                   ((128, 64), (64, 64), 8, 2), ((64, 32), (32, 64), 4, 2),
                   ((64, 32), (32, 64), 4, 3), ((64, 32), (32, 32), 4, 2),
                   ((64, 32), (32, 64), 8, 2))
BACKWARD = (tuple(("flash", *config) for config in BACKWARD_BLOCKS)
            + tuple(("flash_tma", *config) for config in BACKWARD_BLOCKS
                    if config[2:] != (4, 3)))
HEAD_DIMS = (64, 128, 256)
SDPA_BACKENDS = {"SDPA flash": SDPBackend.FLASH_ATTENTION,
                 "SDPA cuDNN": SDPBackend.CUDNN_ATTENTION}


def forced(config: tuple, d: int) -> Tiling:
    """The tiling of one sweep configuration (forward or backward)."""
    variant, query_side, *rest = config
    key_side = rest.pop(0) if len(rest) == 3 else None
    warps, stages = rest
    block_d = max(16, 1 << (d - 1).bit_length())
    blocks = {"BLOCK_M": query_side[0], "BLOCK_N": query_side[1], "BLOCK_D": block_d,
              "BLOCK_DV": block_d}
    if key_side is not None:
        blocks.update(BLOCK_K=key_side[0], BLOCK_Q=key_side[1])
    return Tiling(variant, blocks, 0, double_buffered=False,
                  options={"warps": warps, "stages": stages})


def label(config: tuple) -> str:
    """``flash M128 N64 w4 s3`` (forward) or ``flash M64 N32 K32 Q64 w4 s2`` (backward)."""
    variant, query_side, *rest = config
    sides = f"M{query_side[0]} N{query_side[1]}"
    if len(rest) == 3:
        key_side = rest.pop(0)
        sides += f" K{key_side[0]} Q{key_side[1]}"
    return f"{variant} {sides} w{rest[0]} s{rest[1]}"


def sdpa_rows(name: str, backend: SDPBackend, q: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor, dout: torch.Tensor, flops: float) -> list[dict[str, object]]:
    """One SDPA backend's forward and backward (alone, ``retain_graph``) rows."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    try:
        with sdpa_kernel([backend]):
            forward = functools.partial(torch.nn.functional.scaled_dot_product_attention,
                                        q, k, v)
            forward_us = time_call(forward, q.device) * 1e6
            out = torch.nn.functional.scaled_dot_product_attention(*leaves)
        backward = functools.partial(torch.autograd.grad, out, leaves, dout,
                                     retain_graph=True)
        backward_us = time_call(backward, q.device) * 1e6
    except RuntimeError as error:  # the backend refuses the shape: reported
        return [{"head_dim": q.shape[-1], "pass": "both", "config": name, "us": None,
                 "tflops": None, "error": str(error).splitlines()[0][:200]}]
    return [{"head_dim": q.shape[-1], "pass": kind, "config": name, "us": round(us, 1),
             "tflops": round(work / us / 1e6, 1)}
            for kind, us, work in (("forward", forward_us, flops),
                                   ("backward", backward_us, 2.5 * flops))]


def relative_difference(results: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]
                        ) -> float:
    """Largest ``max |result - expected| / max |expected|`` over the outputs: a forced
    configuration is checked against the default tiling's result before its speed counts."""
    return max(float((r.float() - e.float()).abs().max() / e.float().abs().max())
               for r, e in zip(results, expected))


def compile_rows(target_text: str, head_dims: Sequence[int]) -> list[dict[str, object]]:
    """Every configuration compiled for a GPU target without the GPU (`opforge.aot`):
    registers and spill stack per kernel. The tensor-descriptor variants are compiled as
    such (the launcher would take the pointer kernel for CPU tensors)."""
    target, hardware = aot.parse_target(target_text)
    rows = []
    for d in head_dims:
        q = torch.randn(1, 2, 256, d, dtype=torch.bfloat16)
        lse = torch.zeros(1, 2, 256)
        for kind, configs in (("forward", FORWARD), ("backward", BACKWARD)):
            for config in configs:
                attention._tiles = (lambda *a, config=config, d=d, **kw: [forced(config, d)])
                with aot.recorded_launches(hardware) as recorder, mock.patch.object(
                        attention, "descriptors_usable", lambda *tensors: True):
                    if kind == "forward":
                        opforge.attention(q, q, q)
                    else:
                        opforge.attention_backward(q, q, q, q, q, lse)
                for result in aot.compile_variants(recorder.variants.values(), target):
                    row = {"head_dim": d, "pass": kind, "config": label(config),
                           "kernel": result.variant.name, **compiled_columns(result)}
                    print(row, flush=True)
                    rows.append(row)
    return rows


def compiled_columns(result: aot.CompileResult) -> dict[str, object]:
    """What a compile report shows of one compiled kernel."""
    return {"registers": result.registers, "spill_bytes": result.stack_bytes,
            "shared_bytes": result.shared_bytes,
            "error": "" if result.ok else result.error[:200]}


def write_compile_report(out: Path, prefix: str, title: str, keys: dict[str, str],
                         rows: Sequence[dict[str, object]]) -> None:
    """CSV and Markdown of compiled configurations: the ``keys`` columns (header: row
    key), then registers, spill bytes (or the compile error) and shared memory."""
    env = environment(torch.device("cpu"))
    lines = [f"# {title}", "",
             f"{env['date']} · no GPU · torch {env['torch']} · triton {env['triton']}", "",
             "| " + " | ".join(keys) + " | registers | spill bytes | shared bytes |",
             "|" + "---|" * len(keys) + "---:|---:|---:|"]
    lines += ["| " + " | ".join(str(r[key]) for key in keys.values())
              + f" | {r['registers']} | {r['error'] or r['spill_bytes']} | {r['shared_bytes']} |"
              for r in rows]
    write_results(out, prefix, rows, "\n".join(lines) + "\n")
    print("\n".join(lines))


def write_sweep_report(out: Path, prefix: str, title: str, setting: str,
                       device: torch.device, keys: dict[str, str],
                       rows: Sequence[dict[str, object]],
                       extra: dict[str, str] | None = None) -> None:
    """CSV and Markdown of timed configurations: the ``keys`` columns (header: row key),
    µs, TFLOP/s (or the error), the ``extra`` columns, and the difference from the
    default tiling's result."""
    extra = extra or {}
    env = environment(device)
    lines = [f"# {title}", "", f"{env['date']} · {env['device']} · torch {env['torch']} · "
             f"triton {env['triton']} · {setting}", "",
             "| " + " | ".join([*keys, "µs", "TFLOP/s", *extra,
                                "max diff / max vs default tiling"]) + " |",
             "|" + "---|" * len(keys) + "---:|" * (3 + len(extra))]
    lines += ["| " + " | ".join([*(str(r[key]) for key in keys.values()), str(r["us"]),
                                 str(r.get("error", "") if r.get("tflops") is None
                                     else r["tflops"]),
                                 *(str(r.get(key) or "") for key in extra.values()),
                                 format(r["diff"], ".2g") if "diff" in r else ""]) + " |"
              for r in rows]
    flat = [{**env, "error": "", "diff": None, **dict.fromkeys(extra.values()), **r}
            for r in rows]
    write_results(out, prefix, flat, "\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get(
        "OUT", "benchmarks/results")),
        help="output directory (default: $OUT, else benchmarks/results)")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--head-dims", default=",".join(map(str, HEAD_DIMS)),
                        help="comma-separated head dims to sweep")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run on the interpreter")
    parser.add_argument("--compile-only", metavar="TARGET",
                        help="compile every configuration for TARGET (cuda:90) without a GPU "
                             "and report registers and spills instead of timing")
    args = parser.parse_args(argv)
    head_dims = [int(text) for text in args.head_dims.split(",")]
    original = attention._tiles
    if args.compile_only:
        rows = compile_rows(args.compile_only, head_dims)
        attention._tiles = original
        write_compile_report(args.out, "attention_compile",
                             f"Attention configurations compiled for {args.compile_only}",
                             {"D": "head_dim", "pass": "pass", "config": "config",
                              "kernel": "kernel"}, rows)
        return 0
    device = torch.device(args.device)
    rows = []
    b, h, s = 4, 16, args.seq
    for d in head_dims:
        q, k, v, dout = (torch.randn(b, h, s, d, device=device, dtype=torch.bfloat16)
                         for _ in range(4))
        flops = 4 * b * h * s * s * d
        out, lse = opforge.attention(q, k, v, return_lse=True)
        expected = {"forward": (out,),
                    "backward": opforge.attention_backward(dout, q, k, v, out, lse)}
        for name, backend in SDPA_BACKENDS.items():
            rows += sdpa_rows(name, backend, q, k, v, dout, flops)
        for kind, configs, work in (("forward", FORWARD, flops),
                                    ("backward", BACKWARD, 2.5 * flops)):
            for config in configs:
                attention._tiles = (lambda *a, config=config, d=d, **kw: [forced(config, d)])
                opforge.clear_caches()
                name = label(config)
                try:
                    call = (functools.partial(opforge.attention, q, k, v)
                            if kind == "forward" else
                            functools.partial(opforge.attention_backward, dout, q, k, v, out,
                                              lse))
                    with opforge.use_backend("triton"):
                        us = time_call(call, device) * 1e6
                        results = call()
                    results = (results,) if kind == "forward" else results
                    row = {"head_dim": d, "pass": kind, "config": name, "us": round(us, 1),
                           "tflops": round(work / us / 1e6, 1),
                           "diff": relative_difference(results, expected[kind])}
                except Exception as error:  # too much shared memory, say: reported
                    row = {"head_dim": d, "pass": kind, "config": name, "us": None,
                           "tflops": None, "error": f"{type(error).__name__}: {error}"[:200]}
                print(row, flush=True)
                rows.append(row)
        attention._tiles = original
    write_sweep_report(args.out, "attention_tuning", "Attention block-size sweep",
                       f"bf16 B={b} H={h} S={s}", device,
                       {"D": "head_dim", "pass": "pass", "config": "config"}, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
