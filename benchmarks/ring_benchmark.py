"""Ring attention vs the barrier baseline on CPUs with gloo: time split and overlap.

    torchrun --nproc-per-node 2 benchmarks/ring_benchmark.py [--seq 4096] [--repeats 5]

Per forward step, rank by rank (one thread each), for the ring (`ring_attention`) and
the baseline (`gathered_attention`):

- compute: seconds inside the attention kernels;
- waiting: seconds blocked on communication (ring: waiting for the next block after the
  current one is done; baseline: all-gather plus barrier);
- the transfer time alone (the blocks sent round the ring with no compute), from which
  the overlap: the share of the ring's transfer time hidden behind compute.

Also measures the compute rate (FLOP/s of one rank's attention) and the link rate (bytes/s
of one block transfer), the defaults of `opforge.distributed.scaling_model`, and prints
its projection for 8..256 ranks. Rank 0 writes ``ring_<date>_<time>.{csv,md}`` under
``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import opforge
from opforge.distributed import (
    Ring,
    gathered_attention,
    ring_attention,
    scaling_model,
    shard_sequence,
)
from opforge.profiler.results import environment, write_results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get(
        "OUT", "benchmarks/results")),
        help="output directory (default: $OUT, else benchmarks/results)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    full = [torch.randn(1, args.heads, args.seq, args.dim, generator=generator)
            for _ in range(3)]
    layout = "zigzag" if args.causal else "contiguous"
    q, k, v = (shard_sequence(t, 2, layout) for t in full)
    rows: list[dict[str, object]] = []
    with opforge.use_backend("torch"):
        for _ in range(args.repeats + 1):  # the first round warms up
            dist.barrier()
            timings: dict[str, float] = {}
            start = time.perf_counter()
            ring_attention(q, k, v, causal=args.causal, layout=layout, timings=timings)
            ring_total = time.perf_counter() - start
            dist.barrier()
            start = time.perf_counter()
            keys_start = time.perf_counter()
            gathered = [torch.empty_like(k) for _ in range(world)]
            dist.all_gather(gathered, k)
            dist.all_gather(gathered, v)
            dist.barrier()
            gather_wait = time.perf_counter() - keys_start
            compute_start = time.perf_counter()
            gathered_attention(q, k, v, causal=args.causal, layout=layout)
            baseline_total = time.perf_counter() - start
            # gathered_attention gathers again: its compute share is measured alone.
            baseline_compute = time.perf_counter() - compute_start - gather_wait
            dist.barrier()
            ring = Ring(None, datetime.timedelta(seconds=60))
            start = time.perf_counter()
            block = [k, v]
            for _ in range(world - 1):
                block, works = ring.start(block)
                ring.finish(works)
            transfers = time.perf_counter() - start
            rows.append({"ring_total": ring_total, "ring_compute": timings["compute"],
                         "ring_wait": timings.get("wait", 0.0), "transfers": transfers,
                         "baseline_total": baseline_total,
                         "baseline_compute": max(baseline_compute, 0.0),
                         "baseline_wait": gather_wait})
    rows = rows[1:]
    medians = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
    summary = torch.tensor([medians[key] for key in medians])
    dist.all_reduce(summary, op=dist.ReduceOp.MAX)
    medians = dict(zip(medians, summary.tolist()))
    flops = 4 * args.heads * args.seq * args.seq * args.dim * (0.5 if args.causal else 1)
    compute_rate = flops / world / medians["ring_compute"]
    block_bytes = 2 * args.heads * (args.seq // world) * args.dim * 4
    link_rate = block_bytes * (world - 1) / max(medians["transfers"], 1e-9)
    overlap = 1 - medians["ring_wait"] / max(medians["transfers"], 1e-9)
    if rank == 0:
        env = environment(torch.device("cpu"))
        lines = [f"# Ring attention vs barrier baseline — {env['date']}", "",
                 f"{world} ranks (gloo, one thread each), S={args.seq}, H={args.heads}, "
                 f"D={args.dim}, causal={args.causal}, layout={layout}, fp32, median of "
                 f"{args.repeats} forward steps, the slowest rank's figure.", "",
                 "| scheme | step s | compute s | waiting s |", "|---|---:|---:|---:|",
                 f"| ring | {medians['ring_total']:.4f} | {medians['ring_compute']:.4f} | "
                 f"{medians['ring_wait']:.4f} |",
                 f"| barrier baseline | {medians['baseline_total']:.4f} | "
                 f"{medians['baseline_compute']:.4f} | {medians['baseline_wait']:.4f} |", "",
                 f"- transfers alone (W-1 block hops): {medians['transfers']:.4f} s; "
                 f"overlap: {overlap:.0%} of it hidden behind compute",
                 f"- waiting, ring vs baseline: {medians['ring_wait']:.4f} s vs "
                 f"{medians['baseline_wait']:.4f} s "
                 f"({1 - medians['ring_wait'] / max(medians['baseline_wait'], 1e-9):.0%} "
                 f"lower)",
                 f"- measured compute rate {compute_rate:.3g} FLOP/s a rank, link "
                 f"{link_rate:.3g} B/s", "",
                 "Projection (`scaling_model`, these rates, S=131072, H=32, D=128, bf16):",
                 "", "| ranks | ring s | barrier s | ring speed-up | barrier speed-up |",
                 "|---:|---:|---:|---:|---:|"]
        for ranks in (8, 16, 32, 64, 128, 256):
            p = scaling_model(ranks, 131072, compute_flops=compute_rate, link_bytes=link_rate)
            lines.append(f"| {ranks} | {p.ring_s:.3g} | {p.barrier_s:.3g} | "
                         f"{p.ring_speedup:.1f} | {p.barrier_speedup:.1f} |")
        text = "\n".join(lines) + "\n"
        flat = [{**env, "world": world, "seq": args.seq, **{k: f"{v:.6f}" for k, v in
                                                              medians.items()},
                 "compute_rate": compute_rate, "link_rate": link_rate, "overlap": overlap}]
        write_results(args.out, "ring", flat, text)
        print(text)
    dist.barrier()  # no rank closes its connections while a peer still receives
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
