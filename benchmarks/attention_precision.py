"""Attention error against float64 as the sequence grows: opforge vs torch SDPA vs naive.

Runs `opforge.precision.attention_study.attention_error_growth` for fp16 and bf16 over a
range of lengths, in two settings: ``plain`` (non-causal, standard normal q, k, v) and
``peaked`` (causal, q scaled by 4, so each query's softmax concentrates on few keys), and
writes ``attention_precision_<date>_<time>.{csv,md}`` and a ``.png`` (relative RMS error
vs S, one panel per dtype and setting) under ``--out``.

Usage::

    PYTHONPATH=src python benchmarks/attention_precision.py --device cpu \
        --seq-lens 128,256,512,1024,2048            # the Triton kernel under the interpreter
    PYTHONPATH=src python benchmarks/attention_precision.py --device cuda \
        --seq-lens 128,512,2048,8192,16384
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from opforge.precision.attention_study import (
    IMPLEMENTATIONS,
    StudyRow,
    attention_error_growth,
    growth,
)
from opforge.profiler.results import environment, write_results

SETTINGS = {"plain": {"causal": False, "query_scale": 1.0},
            "peaked": {"causal": True, "query_scale": 4.0}}


def markdown(results: dict[str, list[StudyRow]], env: dict[str, str], heads: int,
             head_dim: int) -> str:
    lines = ["# Attention error vs sequence length", "",
             f"{env['date']} · {env['device']} · torch {env['torch']} · triton "
             f"{env['triton']} · B=1, H={heads}, D={head_dim}", ""]
    for setting, rows in results.items():
        lines += [f"## {setting}: {SETTINGS[setting]}", "",
                  "| dtype | S | " + " | ".join(f"{i} rel RMS / max" for i in IMPLEMENTATIONS)
                  + " |", "|---|---|" + "---|" * len(IMPLEMENTATIONS)]
        for dtype in sorted({r.dtype for r in rows}):
            for seq_len in sorted({r.seq_len for r in rows}):
                cells = []
                for impl in IMPLEMENTATIONS:
                    row = next(r for r in rows if (r.dtype, r.seq_len, r.impl)
                               == (dtype, seq_len, impl))
                    cells.append(f"{row.rel_rms:.3e} / {row.max_rel:.3e}")
                lines.append(f"| {dtype} | {seq_len} | " + " | ".join(cells) + " |")
        lines += ["", "Growth of the relative RMS error from the shortest to the longest S:",
                  ""]
        for dtype in sorted({r.dtype for r in rows}):
            lines.append(f"- {dtype}: " + ", ".join(
                f"{impl} ×{growth(rows, impl, dtype):.3f}" for impl in IMPLEMENTATIONS))
        lines.append("")
    return "\n".join(lines)


def plot(results: dict[str, list[StudyRow]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = sorted({r.dtype for rows in results.values() for r in rows})
    figure, axes = plt.subplots(len(results), len(dtypes), figsize=(5 * len(dtypes),
                                                                    3.6 * len(results)),
                                squeeze=False)
    for i, (setting, rows) in enumerate(results.items()):
        for j, dtype in enumerate(dtypes):
            axis = axes[i][j]
            for impl in IMPLEMENTATIONS:
                mine = sorted((r for r in rows if r.impl == impl and r.dtype == dtype),
                              key=lambda r: r.seq_len)
                axis.plot([r.seq_len for r in mine], [r.rel_rms for r in mine], "o-",
                          label=impl)
            axis.set_xscale("log", base=2)
            axis.set_yscale("log")
            axis.set_title(f"{setting}, {dtype}")
            axis.set_xlabel("sequence length S")
            axis.set_ylabel("relative RMS error vs float64")
            axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seq-lens", default="128,256,512,1024,2048")
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get(
        "OUT", "benchmarks/results")),
        help="output directory (default: $OUT, else benchmarks/results)")
    args = parser.parse_args(argv)
    seq_lens = [int(s) for s in args.seq_lens.split(",")]
    results = {}
    for setting, options in SETTINGS.items():
        results[setting] = attention_error_growth(
            seq_lens, device=args.device, heads=args.heads, head_dim=args.head_dim,
            progress=lambda r, s=setting: print(s, r, flush=True), **options)
    env = environment(torch.device(args.device))
    text = markdown(results, env, args.heads, args.head_dim)
    flat = [{**env, "setting": s, **asdict(r)} for s, rows in results.items() for r in rows]
    csv_path, md_path = write_results(args.out, "attention_precision", flat, text)
    plot(results, md_path.with_suffix(".png"))
    print(text)
    print(f"wrote {csv_path}, {md_path} and its .png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
