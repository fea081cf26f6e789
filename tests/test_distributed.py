"""Sequence-parallel attention over gloo with 2 and 4 spawned ranks: the ring and the
two-level scheme equal single-process attention forward and backward (causal and not,
both layouts), the sharding helpers round-trip, the barrier baseline agrees, uneven
lengths are rejected and a stalled rank fails the others within the timeout."""

from __future__ import annotations

import datetime
import os
import tempfile
import time
from collections.abc import Callable

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
TIMEOUT = datetime.timedelta(seconds=60)


def _full_inputs() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(1, HEADS, SEQ, DIM, generator=generator) for _ in range(4)]


def _rank_main(rank: int, world: int, init_file: str, body: Callable[..., None],
               args: tuple[object, ...]) -> None:
    """One spawned rank: join the gloo group (bounded timeout), run ``body(rank, *args)``
    on the torch backend, and on success wait for every rank before closing the
    connections (a rank that tears down while a peer's last receive is in flight aborts
    that peer; on failure there is no barrier, which would wait for ranks still
    working). After the barrier, a marker file says that every check of this rank
    passed."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=TIMEOUT)
    torch.set_num_threads(1)
    with opforge.use_backend("torch"):
        body(rank, *args)
    dist.barrier()
    open(f"{init_file}.passed{rank}", "w").close()
    dist.destroy_process_group()


def _spawn(world: int, body: Callable[..., None], *args: object) -> None:
    """Run ``body`` on ``world`` ranks. A rank killed by a signal fails the test unless
    every rank had already passed its checks and the final barrier: gloo sometimes aborts
    a rank while closing its connections (``terminate called without an active
    exception``), which is gloo's teardown, not what these tests check. An exception in a
    rank always fails the test."""
    with tempfile.TemporaryDirectory() as directory:
        init_file = os.path.join(directory, "init")
        try:
            mp.spawn(_rank_main, args=(world, init_file, body, args), nprocs=world,
                     join=True)
        except mp.ProcessExitedException:
            if not all(os.path.exists(f"{init_file}.passed{rank}") for rank in range(world)):
                raise


def _check_against_one_process(run: Callable[..., torch.Tensor], causal: bool,
                               layout: str = "contiguous") -> torch.Tensor:
    """``run(q, k, v)`` on this rank's shards: its output and gradients are the shards
    of single-process attention's. Returns the output."""
    q, k, v, dout = _full_inputs()
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = opforge.attention(*full, causal=causal)
    expected_grads = torch.autograd.grad(expected, full, dout)
    shards = [shard_sequence(t, 2, layout).requires_grad_() for t in (q, k, v)]
    out = run(*shards)
    grads = torch.autograd.grad(out, shards, shard_sequence(dout, 2, layout))
    torch.testing.assert_close(out, shard_sequence(expected.detach(), 2, layout),
                               rtol=1e-5, atol=1e-6)
    for mine, whole in zip(grads, expected_grads):
        torch.testing.assert_close(mine, shard_sequence(whole, 2, layout), rtol=1e-4,
                                   atol=1e-5)
    return out.detach()


def _ring_body(rank: int) -> None:
    q = _full_inputs()[0]
    for causal in (False, True):
        for layout in ("contiguous", "zigzag"):
            def run(*shards, causal=causal, layout=layout):
                return ring_attention(*shards, causal=causal, layout=layout)

            out = _check_against_one_process(run, causal, layout)
            shards = [shard_sequence(t, 2, layout) for t in _full_inputs()[:3]]
            baseline = gathered_attention(*shards, causal=causal, layout=layout)
            torch.testing.assert_close(baseline, out, rtol=1e-5, atol=1e-6)
            assert torch.equal(unshard_sequence(shards[0], 2, layout), q)


@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_equals_single_process_attention(world):
    _spawn(world, _ring_body)


def _uneven_body(rank: int) -> None:
    with pytest.raises(opforge.ShapeError, match="divide evenly"):
        shard_sequence(torch.zeros(1, 1, 10, 4), 2, "zigzag")
    with pytest.raises(opforge.ShapeError, match="two equal chunks"):
        ring_attention(torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 3, 4),
                       torch.zeros(1, 1, 3, 4), causal=True, layout="zigzag")
    with pytest.raises(opforge.AttrError):
        ring_attention(*[torch.zeros(1, 1, 4, 4)] * 3, layout="striped")
    # Causal attention must be told how the shards were cut.
    for attend in (ring_attention, gathered_attention):
        with pytest.raises(opforge.AttrError, match="must be given for causal"):
            attend(*[torch.zeros(1, 1, 4, 4)] * 3, causal=True)
    with pytest.raises(opforge.AttrError, match="not a known layout"):
        unshard_sequence(torch.zeros(1, 1, 4, 4), 2, "contigous")
    with pytest.raises(opforge.AttrError, match="out of range"):
        shard_sequence(torch.zeros(1, 1, 4, 4), 5)
    # A 0-d tensor has no dim to cut.
    for cut in (shard_sequence, unshard_sequence):
        with pytest.raises(opforge.AttrError, match="out of range"):
            cut(torch.tensor(3.0), 0)


def test_uneven_lengths_and_bad_layouts_are_rejected():
    _spawn(2, _uneven_body)


def _robust_body(rank: int) -> None:
    """Errors are raised on every rank before any transfer, and the group stays usable;
    permuted shards travel."""
    q, k, v, _ = _full_inputs()
    shards = [shard_sequence(t, 2, "zigzag") for t in (q, k, v)]
    expected = ring_attention(*shards, causal=True, layout="zigzag")
    # An error on every rank (v of another head count), then on one rank only (its
    # shards are longer): typed errors everywhere, no transfer left half-done.
    with pytest.raises(opforge.ShapeError):
        ring_attention(shards[0], shards[1], shards[2][:, :1], causal=True, layout="zigzag")
    longer = [torch.cat([t, t[:, :, :2]], 2) for t in shards] if rank == 1 else shards
    with pytest.raises(opforge.ShapeError, match="differ"):
        ring_attention(*longer, causal=True, layout="zigzag")
    # Ranks that disagree on the causal flag, the layout or the scale would make the same
    # transfers and return wrong results: all raise instead.
    for attrs in ({"causal": rank == 0, "layout": "zigzag"},
                  {"causal": True, "layout": ("zigzag", "contiguous")[rank]},
                  {"causal": True, "layout": "zigzag", "scale": 0.5 if rank else None}):
        with pytest.raises(opforge.ShapeError, match="differ"):
            ring_attention(*shards, **attrs)
    # Shards of another length on one rank, and an invalid one on one rank: every rank
    # raises before the gather (gloo aborted a rank on the mismatched gather before).
    with pytest.raises(opforge.ShapeError, match="differ"):
        unshard_sequence(torch.zeros(2, 3 + rank), 1)
    with pytest.raises(opforge.OpError):
        unshard_sequence(torch.zeros(2, 3), 1 if rank else 7)
    bad_dtype = shards[2].double() if rank == 0 else shards[2]
    with pytest.raises(opforge.OpError):
        ring_attention(shards[0], shards[1], bad_dtype, causal=True, layout="zigzag")
    # [B, S, H, D] activations viewed as [B, H, S, D]: the ring's buffers are dense.
    permuted = [t.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
                for t in shards]
    assert not permuted[1].is_contiguous()
    out = ring_attention(*permuted, causal=True, layout="zigzag")
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    grads = torch.autograd.grad(out.sum(), permuted)
    assert all(torch.isfinite(g).all() for g in grads)


def test_the_ring_survives_bad_input_and_takes_permuted_shards():
    _spawn(2, _robust_body)


def _causal_zigzag_ring(*shards: torch.Tensor) -> torch.Tensor:
    return ring_attention(*shards, causal=True, layout="zigzag")


def _one_rank_body(rank: int) -> None:
    _check_against_one_process(_causal_zigzag_ring, True, "zigzag")


def test_a_one_rank_ring_is_single_process_attention():
    _spawn(1, _one_rank_body)


def _stalled_ring(rank: int, timeout: datetime.timedelta) -> None:
    q = torch.zeros(1, 1, 4, 8)
    if rank == 1:  # a rank that stalls: never joins the ring
        time.sleep(8)
        os._exit(0)
    ring_attention(q, q, q, timeout=timeout)


def _stalled_node_backward(rank: int, timeout: datetime.timedelta) -> None:
    """One node of both ranks: the forward runs on both, then rank 1 stalls before the
    backward, whose gradients go back through the node's gather and broadcast."""
    shards = [torch.randn(1, 2, 4, 8).requires_grad_() for _ in range(3)]
    out = hierarchical_attention(*shards, hierarchical_groups(2), causal=True,
                                 timeout=timeout)
    if rank == 1:
        time.sleep(8)
        os._exit(0)
    out.sum().backward()


def _stalled_unshard(rank: int, timeout: datetime.timedelta) -> None:
    if rank == 1:
        time.sleep(8)
        os._exit(0)
    unshard_sequence(torch.zeros(2, 4), 1, timeout=timeout)


def _dead_ring_peer(rank: int, timeout: datetime.timedelta) -> None:
    """Rank 1 dies after the forward: gloo refuses rank 0's next send at once."""
    shards = [torch.randn(1, 1, 4, 8).requires_grad_() for _ in range(3)]
    out = ring_attention(*shards, timeout=timeout)
    if rank == 1:
        os._exit(0)
    time.sleep(1.5)
    out.sum().backward()


def _stalled_gather_barrier(rank: int, timeout: datetime.timedelta) -> None:
    """Rank 1 checks and gathers, then stalls instead of entering the barrier."""
    if rank == 1:
        def stall(*args: object, **kwargs: object) -> None:
            time.sleep(8)
            os._exit(0)

        dist.barrier = stall
    q = torch.zeros(1, 1, 4, 8)
    gathered_attention(q, q, q, timeout=timeout)


def _stalled_worker(rank: int, world: int, init_file: str, results: str,
                    body: Callable[[int, datetime.timedelta], None]) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=30))
    start = time.perf_counter()
    try:
        with opforge.use_backend("torch"):
            body(rank, datetime.timedelta(seconds=2))
        outcome = "no error"
    except Exception as error:  # the kind is the outcome: only TimeoutError passes
        outcome = f"{type(error).__name__} after {time.perf_counter() - start:.1f}s"
    with open(results, "w") as handle:
        handle.write(outcome)
    os._exit(0)  # the peer never finished its side: skip the collective teardown


@pytest.mark.parametrize("body", [_stalled_ring, _stalled_node_backward, _stalled_unshard,
                                  _stalled_gather_barrier, _dead_ring_peer],
                         ids=["ring", "node_backward", "unshard", "gather_barrier",
                              "dead_peer"])
def test_a_stalled_rank_makes_the_others_fail_within_the_timeout(body):
    with tempfile.TemporaryDirectory() as directory:
        results = os.path.join(directory, "results")
        mp.spawn(_stalled_worker, args=(2, os.path.join(directory, "init"), results, body),
                 nprocs=2, join=True)
        with open(results) as handle:
            outcome = handle.read()
    kind, _, seconds = outcome.partition(" after ")
    assert kind == "TimeoutError", outcome
    assert float(seconds.rstrip("s")) < 7.0, outcome


def _hierarchy_body(rank: int) -> None:
    groups = hierarchical_groups(2)
    assert (groups.node, groups.local_rank) == divmod(rank, 2)
    assert dist.get_world_size(groups.intra) == 2
    assert (groups.inter is not None) == (rank % 2 == 0)
    # A ring inside each node over that node's half of the sequence.
    q, k, v, _ = _full_inputs()
    node_part = [t[:, :, groups.node * SEQ // 2:(groups.node + 1) * SEQ // 2]
                 for t in (q, k, v)]
    shards = [shard_sequence(t, 2, "contiguous", groups.intra) for t in node_part]
    out = ring_attention(*shards, group=groups.intra)
    expected = opforge.attention(*node_part)
    torch.testing.assert_close(out, shard_sequence(expected, 2, "contiguous", groups.intra),
                               rtol=1e-5, atol=1e-6)
    if groups.inter is not None:
        total = torch.tensor([float(rank)])
        dist.all_reduce(total, group=groups.inter)
        assert total.item() == 2.0  # leaders 0 and 2
    with pytest.raises(opforge.AttrError):
        hierarchical_groups(3)


def test_hierarchical_groups_run_a_ring_inside_each_node():
    _spawn(4, _hierarchy_body)


def _two_level_body(rank: int, local: int) -> None:
    groups = hierarchical_groups(local)
    for causal in (False, True):
        def run(*shards, causal=causal):
            return hierarchical_attention(*shards, groups, causal=causal)

        _check_against_one_process(run, causal)


@pytest.mark.parametrize("local", [1, 2, 4])
def test_two_level_attention_equals_single_process_attention(local):
    """4 ranks as 4 nodes of 1, 2 nodes of 2 and 1 node of 4: forward and backward."""
    _spawn(4, _two_level_body, local)
