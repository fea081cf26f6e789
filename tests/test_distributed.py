"""Ring attention over gloo with 2 and 4 spawned ranks: forward and backward equal
single-process attention (causal and not, both layouts), the sharding helpers round-trip,
the barrier baseline agrees, and uneven lengths are rejected."""

from __future__ import annotations

import datetime
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import opforge
from opforge.distributed import (
    gathered_attention,
    hierarchical_attention,
    hierarchical_groups,
    ring_attention,
    shard_sequence,
    unshard_sequence,
)

SEQ, HEADS, DIM = 24, 2, 8


def _full_inputs() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(1, HEADS, SEQ, DIM, generator=generator) for _ in range(4)]


def _teardown() -> None:
    """Wait for every rank before closing the connections: a rank that tears down while
    a peer's last receive is in flight aborts that peer."""
    dist.barrier()
    dist.destroy_process_group()


def _worker(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    try:
        with opforge.use_backend("torch"):
            q, k, v, dout = _full_inputs()
            for causal in (False, True):
                for layout in ("contiguous", "zigzag"):
                    expected = [t.clone().requires_grad_() for t in (q, k, v)]
                    full = opforge.attention(*expected, causal=causal)
                    full_grads = torch.autograd.grad(full, expected, dout)
                    shards = [shard_sequence(t, 2, layout).requires_grad_()
                              for t in (q, k, v)]
                    out = ring_attention(*shards, causal=causal, layout=layout)
                    grads = torch.autograd.grad(out, shards, shard_sequence(dout, 2, layout))
                    torch.testing.assert_close(out, shard_sequence(full.detach(), 2, layout),
                                               rtol=1e-5, atol=1e-6)
                    for mine, whole in zip(grads, full_grads):
                        torch.testing.assert_close(mine, shard_sequence(whole, 2, layout),
                                                   rtol=1e-4, atol=1e-5)
                    baseline = gathered_attention(*(s.detach() for s in shards),
                                                  causal=causal, layout=layout)
                    torch.testing.assert_close(baseline, out.detach(), rtol=1e-5, atol=1e-6)
                    assert torch.equal(unshard_sequence(shards[0].detach(), 2, layout), q)
    except BaseException:
        raise  # no teardown: its barrier would wait for the ranks still working
    else:
        _teardown()


@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_equals_single_process_attention(world):
    with tempfile.TemporaryDirectory() as directory:
        mp.spawn(_worker, args=(world, os.path.join(directory, "init")), nprocs=world,
                 join=True)


def _uneven_worker(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        with pytest.raises(opforge.ShapeError, match="divide evenly"):
            shard_sequence(torch.zeros(1, 1, 10, 4), 2, "zigzag")
        with pytest.raises(opforge.ShapeError):
            ring_attention(torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 3, 4),
                           torch.zeros(1, 1, 3, 4), causal=True)
    except BaseException:
        raise  # no teardown: its barrier would wait for the ranks still working
    else:
        _teardown()


def test_uneven_lengths_are_rejected():
    with tempfile.TemporaryDirectory() as directory:
        mp.spawn(_uneven_worker, args=(2, os.path.join(directory, "init")), nprocs=2,
                 join=True)


def _stalled_worker(rank: int, world: int, init_file: str, results: str) -> None:
    import time

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=30))
    q = torch.zeros(1, 1, 4, 8)
    if rank == 1:  # a rank that stalls: never joins the ring
        time.sleep(8)
        os._exit(0)
    start = time.perf_counter()
    try:
        with opforge.use_backend("torch"):
            ring_attention(q, q, q, timeout=datetime.timedelta(seconds=2))
        outcome = "no error"
    except (TimeoutError, RuntimeError) as error:
        outcome = f"{type(error).__name__} after {time.perf_counter() - start:.1f}s"
    with open(results, "w") as handle:
        handle.write(outcome)
    os._exit(0)  # the peer never finished its side: skip the collective teardown


def test_a_stalled_rank_makes_the_others_fail_within_the_timeout():
    with tempfile.TemporaryDirectory() as directory:
        results = os.path.join(directory, "results")
        mp.spawn(_stalled_worker, args=(2, os.path.join(directory, "init"), results),
                 nprocs=2, join=True)
        with open(results) as handle:
            outcome = handle.read()
    kind, _, seconds = outcome.partition(" after ")
    assert kind in ("TimeoutError", "RuntimeError"), outcome
    assert float(seconds.rstrip("s")) < 7.0, outcome


def _hierarchy_worker(rank: int, world: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        groups = hierarchical_groups(2)
        assert (groups.node, groups.local_rank) == divmod(rank, 2)
        assert dist.get_world_size(groups.intra) == 2
        assert (groups.inter is not None) == (rank % 2 == 0)
        # A ring inside each node over that node's half of the sequence.
        q, k, v, _ = _full_inputs()
        node_part = [t[:, :, groups.node * SEQ // 2:(groups.node + 1) * SEQ // 2]
                     for t in (q, k, v)]
        with opforge.use_backend("torch"):
            shards = [shard_sequence(t, 2, "contiguous", groups.intra) for t in node_part]
            out = ring_attention(*shards, group=groups.intra)
            expected = opforge.attention(*node_part)
        torch.testing.assert_close(out, shard_sequence(expected, 2, "contiguous",
                                                       groups.intra), rtol=1e-5, atol=1e-6)
        if groups.inter is not None:
            total = torch.tensor([float(rank)])
            dist.all_reduce(total, group=groups.inter)
            assert total.item() == 2.0  # leaders 0 and 2
        with pytest.raises(ValueError):
            hierarchical_groups(3)
    except BaseException:
        raise  # no teardown: its barrier would wait for the ranks still working
    else:
        _teardown()


def test_hierarchical_groups_run_a_ring_inside_each_node():
    with tempfile.TemporaryDirectory() as directory:
        mp.spawn(_hierarchy_worker, args=(4, os.path.join(directory, "init")), nprocs=4,
                 join=True)


def _two_level_worker(rank: int, world: int, init_file: str, local: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    try:
        groups = hierarchical_groups(local)
        q, k, v, dout = _full_inputs()
        with opforge.use_backend("torch"):
            for causal in (False, True):
                full = [t.clone().requires_grad_() for t in (q, k, v)]
                expected = opforge.attention(*full, causal=causal)
                expected_grads = torch.autograd.grad(expected, full, dout)
                shards = [shard_sequence(t, 2).requires_grad_() for t in (q, k, v)]
                out = hierarchical_attention(*shards, groups, causal=causal)
                grads = torch.autograd.grad(out, shards, shard_sequence(dout, 2))
                torch.testing.assert_close(out, shard_sequence(expected.detach(), 2),
                                           rtol=1e-5, atol=1e-6)
                for mine, whole in zip(grads, expected_grads):
                    torch.testing.assert_close(mine, shard_sequence(whole, 2), rtol=1e-4,
                                               atol=1e-5)
    except BaseException:
        raise  # no teardown: its barrier would wait for the ranks still working
    else:
        _teardown()


@pytest.mark.parametrize("local", [1, 2, 4])
def test_two_level_attention_equals_single_process_attention(local):
    """4 ranks as 4 nodes of 1, 2 nodes of 2 and 1 node of 4: forward and backward."""
    with tempfile.TemporaryDirectory() as directory:
        mp.spawn(_two_level_worker, args=(4, os.path.join(directory, "init"), local),
                 nprocs=4, join=True)
