"""Attention block-size sweep on a GPU: which (BLOCK_M, BLOCK_N, warps, stages) the tiling
of `opforge.ops.attention` should pick for each head dim.

For bf16 ``B=4, H=16, S=4096`` (non-causal) at head dims 64, 128 and 256, each candidate
configuration is forced as the only tiling, the plan caches are cleared, and the forward
and the backward (``attention_backward`` alone, from a saved out and lse) are timed with
``triton.testing.do_bench`` (median), in TFLOP/s by FlashAttention's convention (forward
4 B H S² D, backward 2.5 times that) next to torch SDPA. A configuration that fails to
compile (too much shared memory) is reported and skipped.

Usage (GPU machine)::

    PYTHONPATH=src:benchmarks python benchmarks/attention_tuning.py --out DIR
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from triton.testing import do_bench

import opforge
from opforge.core.opdef import Tiling
from opforge.ops import attention
from opforge.profiler.results import environment, write_results

# (BLOCK_M, BLOCK_N, warps, stages)
FORWARD = ((128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 32, 4, 3),
           (64, 64, 4, 3), (64, 128, 4, 3), (128, 64, 8, 2), (64, 32, 4, 2))
BACKWARD = ((64, 64, 4, 2), (64, 64, 8, 2), (32, 64, 4, 2), (64, 32, 4, 2), (32, 32, 4, 2),
            (128, 64, 8, 2), (64, 128, 8, 2), (64, 64, 4, 3))
HEAD_DIMS = (64, 128, 256)


def forced(config: tuple[int, int, int, int], d: int) -> Tiling:
    block_m, block_n, warps, stages = config
    block_d = max(16, 1 << (d - 1).bit_length())
    return Tiling("flash", {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_D": block_d,
                            "BLOCK_DV": block_d}, 0, double_buffered=False,
                  options={"warps": warps, "stages": stages})


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get(
        "OUT", "benchmarks/results")))
    parser.add_argument("--seq", type=int, default=4096)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    original = attention._tiles
    rows = []
    b, h, s = 4, 16, args.seq
    for d in HEAD_DIMS:
        q, k, v, dout = (torch.randn(b, h, s, d, device=device, dtype=torch.bfloat16)
                         for _ in range(4))
        flops = 4 * b * h * s * s * d
        out, lse = opforge.attention(q, k, v, return_lse=True)
        sdpa = functools.partial(torch.nn.functional.scaled_dot_product_attention, q, k, v)
        sdpa_us = do_bench(sdpa, warmup=25, rep=100, return_mode="median") * 1e3
        rows.append({"head_dim": d, "pass": "forward", "config": "torch SDPA",
                     "us": round(sdpa_us, 1), "tflops": round(flops / sdpa_us / 1e6, 1)})
        for kind, configs, work in (("forward", FORWARD, flops),
                                    ("backward", BACKWARD, 2.5 * flops)):
            for config in configs:
                attention._tiles = (lambda *a, config=config, d=d, **kw: [forced(config, d)])
                opforge.clear_caches()
                name = "BM{} BN{} w{} s{}".format(*config)
                try:
                    call = (functools.partial(opforge.attention, q, k, v)
                            if kind == "forward" else
                            functools.partial(opforge.attention_backward, dout, q, k, v, out,
                                              lse))
                    call()
                    torch.cuda.synchronize()
                    us = do_bench(call, warmup=25, rep=100, return_mode="median") * 1e3
                    row = {"head_dim": d, "pass": kind, "config": name, "us": round(us, 1),
                           "tflops": round(work / us / 1e6, 1)}
                except Exception as error:  # too much shared memory, say: reported
                    row = {"head_dim": d, "pass": kind, "config": name, "us": None,
                           "tflops": None, "error": f"{type(error).__name__}: {error}"[:200]}
                print(row, flush=True)
                rows.append(row)
        attention._tiles = original
    env = environment(device)
    lines = ["# Attention block-size sweep", "", f"{env['date']} · {env['device']} · torch "
             f"{env['torch']} · triton {env['triton']} · bf16 B={b} H={h} S={s}", "",
             "| D | pass | config | µs | TFLOP/s |", "|---|---|---|---:|---:|"]
    lines += [f"| {r['head_dim']} | {r['pass']} | {r['config']} | {r['us']} | "
              f"{r['tflops'] if r.get('tflops') else r.get('error', '')} |" for r in rows]
    flat = [{**env, "error": "", **r} for r in rows]
    write_results(args.out, "attention_tuning", flat, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
