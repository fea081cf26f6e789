"""Sequence-parallel attention on the CPU with gloo, checked against one process.

    torchrun --nproc-per-node 4 examples/ring_attention.py [--seq 1024] [--causal]

Every rank builds the same full q, k, v (a fixed seed), keeps its shard
(`opforge.distributed.shard_sequence`), runs `ring_attention` forward and backward, and
compares its output shard and gradients with single-process `opforge.attention` on the
full tensors. Rank 0 prints the largest differences and the time split.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import opforge
from opforge.distributed import ring_attention, shard_sequence


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, args.heads, args.seq, args.dim, generator=generator)
                     for _ in range(4))
    layout = "zigzag" if args.causal else "contiguous"
    with opforge.use_backend("torch"):
        shards = [shard_sequence(t, 2, layout).requires_grad_() for t in (q, k, v)]
        timings: dict[str, float] = {}
        out = ring_attention(*shards, causal=args.causal, layout=layout, timings=timings)
        grads = torch.autograd.grad(out, shards, shard_sequence(dout, 2, layout))
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        expected = opforge.attention(*full, causal=args.causal)
        expected_grads = torch.autograd.grad(expected, full, dout)
    errors = [(out - shard_sequence(expected.detach(), 2, layout)).abs().max()]
    errors += [(g - shard_sequence(e, 2, layout)).abs().max()
               for g, e in zip(grads, expected_grads)]
    worst = torch.stack(errors)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    ok = bool((worst < 1e-4).all())
    if rank == 0:
        names = ("out", "dq", "dk", "dv")
        print(f"ring attention, {world} ranks, S={args.seq}, causal={args.causal}, "
              f"layout={layout}")
        print("max |ring - single process|: " + ", ".join(
            f"{name} {value:.2e}" for name, value in zip(names, worst.tolist())))
        print(f"rank 0 forward: compute {timings.get('compute', 0) * 1e3:.1f} ms, "
              f"waiting {timings.get('wait', 0) * 1e3:.1f} ms")
        print("check: " + ("PASS" if ok else "FAIL"))
    dist.barrier()  # no rank closes its connections while a peer still receives
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
