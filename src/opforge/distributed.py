"""Sequence-parallel attention over ``torch.distributed``: each rank holds a shard of the
sequence (dim 2 of ``[B, H, S, D]``), key/value blocks travel round a ring of ranks, and
the partial results merge by the log-sum-exp rule in float32 (float64 for float64 inputs):
the distributed form of the online softmax. Works on any backend torch.distributed has
(gloo on CPUs, NCCL on GPUs, HCCL on NPUs); launch with ``torchrun``.

Layouts (``shard_sequence``): ``"contiguous"`` gives rank r the r-th of W equal chunks;
``"zigzag"`` cuts the sequence into 2W chunks and gives rank r chunks r and 2W-1-r, in that
order, which balances causal work (every rank holds one early and one late chunk).

``ring_attention`` runs W steps. At step s a rank attends its queries to the key/value
block of rank ``(r - s) mod W`` while the next block is already on its way (``isend`` /
``irecv`` posted before the block's attention): transfers overlap compute. Each block is
one call of `opforge.attention` with ``return_lse``; with the causal mask only the
visible part of a block is computed (a whole block, its diagonal, or half of it in the
zigzag layout). The backward sends key/value blocks round the same ring together with
their dK/dV accumulators, adds each rank's share from `opforge.attention_backward` (given
the merged out and lse), and returns the accumulators to their owners with one final hop.

`gathered_attention` is the barrier-synchronised baseline: all-gather K and V, barrier,
local attention.

Every collective here waits at most the call's ``timeout`` (60 s by default) and fails
with ``TimeoutError`` whether a peer stalled or died, on every backend: no rank waits
forever for another.
"""

from __future__ import annotations

import datetime
import functools
import math
import struct
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from opforge.core.errors import AttrError, OpError, ShapeError
from opforge.core.plan import plan
from opforge.functional import attention, attention_backward
from opforge.ops._statistics import statistics_dtype

LAYOUTS = ("contiguous", "zigzag")
DEFAULT_TIMEOUT = datetime.timedelta(seconds=60)


def _group_info(group: dist.ProcessGroup | None) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _check_layout(layout: str, op: str, param: str) -> None:
    """Raises AttrError for a layout that is not contiguous or zigzag."""
    if layout not in LAYOUTS:
        raise AttrError("is not a known layout", op=op, param=param,
                        expected=f"one of {LAYOUTS}", got=repr(layout))


def _chunks(length: int, world: int, mode: str, op: str) -> int:
    """Chunk length of a sequence of ``length`` cut for ``world`` ranks.

    Raises:
        ShapeError: the length does not divide evenly (W chunks, 2W for zigzag).
        AttrError: an unknown mode.
    """
    _check_layout(mode, op, "mode")
    parts = world * (2 if mode == "zigzag" else 1)
    if length % parts:
        raise ShapeError("sequence length must divide evenly among the ranks", op=op,
                         param="sequence", expected=f"a multiple of {parts} ({mode}, "
                         f"{world} ranks); pad the sequence", got=length)
    return length // parts


def _check_dim(x: torch.Tensor, dim: int, op: str) -> int:
    """``dim`` of ``x``, or AttrError (a 0-d tensor has no dim to cut)."""
    if not -x.dim() <= dim < x.dim():
        raise AttrError("is out of range", op=op, param="dim",
                        expected=f"a dim of a {x.dim()}-D tensor", got=dim)
    return dim


def _dtype_code(dtype: torch.dtype) -> int:
    # The same number on every rank (a checksum of the name): dtypes compare across ranks.
    return zlib.crc32(str(dtype).encode())


def _lost_peer(what: str, timeout: datetime.timedelta, error: RuntimeError) -> TimeoutError:
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return TimeoutError(f"{what} did not complete within {timeout} (a peer stalled or "
                        f"died): {reason}")


def _posted(post: Callable[[], Any], timeout: datetime.timedelta, what: str) -> Any:
    """``post()``, which starts an asynchronous collective or transfer and returns its
    work; a backend that already knows its peer is gone raises here (gloo's ``isend`` to
    a closed connection).

    Raises:
        TimeoutError: the backend refused to start it (its RuntimeError is the cause).
    """
    try:
        return post()
    except RuntimeError as error:
        raise _lost_peer(what, timeout, error) from error


def _wait(work: Any, timeout: datetime.timedelta, what: str) -> None:
    """Wait for an asynchronous collective, at most ``timeout``.

    Raises:
        TimeoutError: it did not complete in time, or the backend reported its failure (a
            peer that stalled or died: gloo raises its own RuntimeError, kept as the
            ``__cause__``), so that callers see one error type.
    """
    try:
        finished = work.wait(timeout)
    except RuntimeError as error:
        raise _lost_peer(what, timeout, error) from error
    if not finished:
        raise TimeoutError(f"{what} did not complete within {timeout}")


def _collective(post: Callable[[], Any], timeout: datetime.timedelta, what: str) -> None:
    """Start a collective with ``post()`` and wait for it, at most ``timeout`` in all: one
    `TimeoutError` whether the peer was gone when it started or stopped answering."""
    _wait(_posted(post, timeout, what), timeout, what)


def _padded(shape: torch.Size, dims: int) -> list[int]:
    """``shape`` as exactly ``dims`` entries (-1 for missing dims, cut past ``dims``): a
    spec of the same length on every rank, whatever its tensors."""
    return [*shape, *[-1] * (dims - len(shape))][:dims]


def _agree(local: OpError | None, spec: list[int], device: torch.device,
           group: dist.ProcessGroup | None, timeout: datetime.timedelta, op: str,
           param: str, what: str) -> None:
    """Raise on every rank of ``group`` when one rank's own check failed (``local``) or
    the ranks' ``spec`` differ (a list of ints of the same length on every rank; ``what``
    names its entries, ``param`` the argument they describe), so that
    no rank goes on to a transfer its peers will not make. One MAX all-reduce of
    (spec, -spec) gives every rank the largest and smallest value of each entry: equal
    everywhere exactly when the ranks agree.

    Raises:
        the ``local`` error; ShapeError: another rank's check failed, or the specs
            differ. TimeoutError: the all-reduce did not finish within ``timeout``.
    """
    flagged = [1, *[0] * len(spec)] if local is not None else [0, *spec]  # same length
    both = torch.tensor([*flagged, *(-value for value in flagged)], dtype=torch.int64,
                        device=device)
    _collective(lambda: dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group,
                                        async_op=True), timeout,
          f"the ranks' check of {what}")
    if local is not None:
        raise local
    highest = both[:len(flagged)].tolist()
    lowest = [-value for value in both[len(flagged):].tolist()]
    if highest[0]:
        raise ShapeError("another rank's arguments failed their checks", op=op, param=param,
                         expected="valid arguments on every rank", got="an error on a peer")
    if highest != lowest:
        raise ShapeError(f"the ranks' {what} differ", op=op, param=param,
                         expected=f"the same on every rank: {lowest[1:]}",
                         got=f"up to {highest[1:]}")


def _pieces(rank: int, world: int, mode: str) -> tuple[int, ...]:
    """The chunk numbers rank ``rank`` holds, in order."""
    return (rank, 2 * world - 1 - rank) if mode == "zigzag" else (rank,)


def shard_sequence(x: torch.Tensor, dim: int, mode: str | None = None,
                   group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """This rank's shard of the full tensor ``x`` along ``dim`` (``mode`` contiguous by
    default, or zigzag). A copy.

    Raises:
        ShapeError: the length along ``dim`` does not divide evenly.
    """
    mode = mode or "contiguous"
    rank, world = _group_info(group)
    size = _chunks(x.shape[_check_dim(x, dim, "shard_sequence")], world, mode,
                   "shard_sequence")
    return torch.cat([x.narrow(dim, piece * size, size) for piece in _pieces(rank, world,
                                                                          mode)], dim)


def _reorder(gathered: list[torch.Tensor], dim: int, mode: str) -> torch.Tensor:
    """The full tensor from every rank's shard (rank order)."""
    world = len(gathered)
    if mode == "contiguous":
        return torch.cat(gathered, dim)
    halves = [shard.chunk(2, dim) for shard in gathered]
    ordered = [halves[r][0] for r in range(world)] + [halves[r][1]
                                                       for r in reversed(range(world))]
    return torch.cat(ordered, dim)


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, shard: torch.Tensor, dim: int, mode: str,
                group: dist.ProcessGroup | None, timeout: datetime.timedelta
                ) -> torch.Tensor:
        ctx.dim, ctx.mode, ctx.group, ctx.timeout = dim, mode, group, timeout
        gathered = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
        _collective(lambda: dist.all_gather(gathered, shard.contiguous(), group=group,
                                            async_op=True),
              timeout, "the all-gather of the shards")
        return _reorder(gathered, dim, mode)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # Every rank's loss may use the whole tensor: its shard's gradient is the sum of
        # all ranks' gradients for that shard.
        total = grad.contiguous().clone()
        _collective(lambda: dist.all_reduce(total, group=ctx.group, async_op=True), ctx.timeout,
              "the all-reduce of the gradients")
        return shard_sequence(total, ctx.dim, ctx.mode, ctx.group), None, None, None, None


# Dims of a shard whose shape the ranks compare before gathering (a fixed-length check).
MAX_SHARD_DIMS = 8


def unshard_sequence(shard: torch.Tensor, dim: int, mode: str | None = None,
                     group: dist.ProcessGroup | None = None,
                     timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> torch.Tensor:
    """The full tensor gathered from every rank's shard (inverse of `shard_sequence`),
    differentiably: the gradient of a shard is the sum over ranks of the gradients of
    its slice. The ranks first compare their shards' shapes and dtypes (one small
    all-reduce): every rank raises, before any gather, when one rank's shard is invalid
    or the shards differ. Each collective waits at most ``timeout``.

    Raises:
        AttrError: an unknown mode or a dim out of range. ShapeError: a zigzag shard of
            odd length, more than `MAX_SHARD_DIMS` dims, or shards that differ across the
            ranks (or a peer's error). TimeoutError: a peer did not answer in time.
    """
    mode = mode or "contiguous"
    local = None
    try:
        if shard.dim() > MAX_SHARD_DIMS:
            raise ShapeError("has too many dims to compare across the ranks",
                             op="unshard_sequence", param="shard",
                             expected=f"at most {MAX_SHARD_DIMS} dims", got=shard.dim())
        _chunks(shard.shape[_check_dim(shard, dim, "unshard_sequence")], 1, mode,
                "unshard_sequence")
    except OpError as error:
        local = error
    _agree(local, [shard.dim(), *_padded(shard.shape, MAX_SHARD_DIMS),
                   _dtype_code(shard.dtype)], shard.device, group, timeout,
           "unshard_sequence", "shard", "shards (dims, shape, dtype)")
    return _Unshard.apply(shard, dim, mode, group, timeout)


# ---------------------------------------------------------------------------------------------
# Which part of a key/value block a rank's queries see


@dataclass(frozen=True)
class _Block:
    """One (query rows, key rows, causal) piece of a block's attention; ``None`` slices
    mean all rows."""

    rows: slice
    keys: slice
    causal: bool


def _visible(rank: int, source: int, world: int, chunk: int, causal: bool, layout: str
             ) -> list[_Block]:
    """The pieces of rank ``source``'s key block that rank ``rank``'s queries see."""
    everything = slice(None)
    if not causal:
        return [_Block(everything, everything, False)]
    if layout == "contiguous":
        if source < rank:
            return [_Block(everything, everything, False)]
        return [_Block(everything, everything, True)] if source == rank else []
    if source == rank:
        return [_Block(everything, everything, True)]
    if source < rank:  # its first chunk precedes both of ours, its second follows both
        return [_Block(everything, slice(0, chunk), False)]
    # its chunks both fall between our first and our second
    return [_Block(slice(chunk, 2 * chunk), everything, False)]


def _merge(out: torch.Tensor, lse: torch.Tensor, rows: slice, block_out: torch.Tensor,
           block_lse: torch.Tensor) -> None:
    """Fold a block's (out, lse) into the running (out, lse) of ``rows`` (float32, float64
    for float64 inputs), in place: the log-sum-exp rule."""
    old_out, old_lse = out[:, :, rows], lse[:, :, rows]
    new_lse = torch.logaddexp(old_lse, block_lse)
    # Rows that have seen no key yet keep lse -inf: exp(-inf - -inf) is NaN, use 0.
    keep = torch.nan_to_num(torch.exp(old_lse - new_lse), nan=0.0)
    take = torch.nan_to_num(torch.exp(block_lse - new_lse), nan=0.0)
    out[:, :, rows] = old_out * keep[..., None] + block_out.to(out.dtype) * take[..., None]
    lse[:, :, rows] = new_lse


class Ring:
    """Point-to-point ring of a group: `start` sends tensors to the next rank and receives
    as many from the previous one, asynchronously; `finish` waits, within the timeout."""

    def __init__(self, group: dist.ProcessGroup | None, timeout: datetime.timedelta) -> None:
        self.group, self.timeout = group, timeout
        rank, world = _group_info(group)
        ranks = dist.get_process_group_ranks(group) if group is not None else list(
            range(world))
        self.next, self.previous = ranks[(rank + 1) % world], ranks[(rank - 1) % world]

    def start(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[object]]:
        # Dense buffers: gloo and NCCL refuse to receive into a permuted layout (a
        # [B, S, H, D] shard viewed as [B, H, S, D]).
        received = [torch.empty_like(t, memory_format=torch.contiguous_format)
                    for t in tensors]
        works = []
        for out, into in zip(tensors, received):
            dense = out.contiguous()
            works.append(_posted(functools.partial(dist.isend, dense, self.next,
                                                   group=self.group),
                                 self.timeout, "ring transfer"))
            works.append(_posted(functools.partial(dist.irecv, into, self.previous,
                                                   group=self.group),
                                 self.timeout, "ring transfer"))
        return received, works

    def finish(self, works: list[object]) -> None:
        """Wait for the transfers; a peer that died or stalls raises within the timeout."""
        for work in works:
            _wait(work, self.timeout, "ring transfer")


class _Timed:
    """Adds the wall time of a ``with`` block to ``timings[name]`` (when given)."""

    def __init__(self, timings: dict[str, float] | None, name: str) -> None:
        self.timings, self.name = timings, name

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        if self.timings is not None:
            self.timings[self.name] = self.timings.get(self.name, 0.0) + \
                time.perf_counter() - self.start


def _ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float | None, layout: str, ring: Ring, world: int, rank: int,
                  timings: dict[str, float] | None) -> tuple[torch.Tensor, torch.Tensor]:
    chunk = q.shape[2] // (2 if layout == "zigzag" else 1)
    wide = statistics_dtype(q.dtype)
    out = torch.zeros(*q.shape[:3], v.shape[3], dtype=wide, device=q.device)
    lse = torch.full(q.shape[:3], -math.inf, dtype=wide, device=q.device)
    block = [k, v]
    for step in range(world):
        works = []
        if step + 1 < world:
            incoming, works = ring.start(block)
        source = (rank - step) % world
        try:
            with _Timed(timings, "compute"):
                for piece in _visible(rank, source, world, chunk, causal, layout):
                    part_out, part_lse = attention(
                        q[:, :, piece.rows], block[0][:, :, piece.keys],
                        block[1][:, :, piece.keys], piece.causal, scale, return_lse=True)
                    _merge(out, lse, piece.rows, part_out, part_lse)
        except BaseException:
            # Transfers left posted would desynchronise the pair for the next call.
            if works:
                ring.finish(works)
            raise
        if works:
            with _Timed(timings, "wait"):
                ring.finish(works)
            block = incoming
    return out.to(q.dtype), lse


def _ring_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float | None,
                   layout: str, ring: Ring, world: int, rank: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    chunk = q.shape[2] // (2 if layout == "zigzag" else 1)
    wide = statistics_dtype(q.dtype)
    grad_q = torch.zeros_like(q, dtype=wide)
    travelling = [k, v, torch.zeros(k.shape, dtype=wide, device=k.device),
                  torch.zeros(v.shape, dtype=wide, device=v.device)]
    for step in range(world):
        source = (rank - step) % world
        block_k, block_v, grad_k, grad_v = travelling
        for piece in _visible(rank, source, world, chunk, causal, layout):
            dq, dk, dv = attention_backward(
                dout[:, :, piece.rows], q[:, :, piece.rows], block_k[:, :, piece.keys],
                block_v[:, :, piece.keys], out[:, :, piece.rows], lse[:, :, piece.rows],
                piece.causal, scale)
            grad_q[:, :, piece.rows] += dq.to(wide)
            grad_k[:, :, piece.keys] += dk.to(wide)
            grad_v[:, :, piece.keys] += dv.to(wide)
        # Pass the block and its accumulators on; after the last step one more hop brings
        # each accumulator home (a one-rank ring is home already).
        if world > 1:
            incoming, works = ring.start(travelling if step + 1 < world else [grad_k, grad_v])
            ring.finish(works)
            travelling = incoming
    grad_k, grad_v = travelling[-2:]
    return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                causal: bool, scale: float | None, layout: str,
                group: dist.ProcessGroup | None, timeout: datetime.timedelta,
                timings: dict[str, float] | None) -> torch.Tensor:
        rank, world = _group_info(group)
        ring = Ring(group, timeout)
        out, lse = _ring_forward(q, k, v, causal, scale, layout, ring, world, rank, timings)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.settings = (causal, scale, layout, ring, world, rank)
        return out

    @staticmethod
    def backward(ctx: object, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        grads = _ring_backward(dout.contiguous(), q, k, v, out, lse, *ctx.settings)
        return (*grads, None, None, None, None, None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   group: dist.ProcessGroup | None = None, causal: bool = False,
                   scale: float | None = None, layout: str | None = None,
                   timeout: datetime.timedelta = DEFAULT_TIMEOUT,
                   timings: dict[str, float] | None = None) -> torch.Tensor:
    """Attention of this rank's query shard against the whole sequence, whose key/value
    shards live on the ranks of ``group``.

    Args:
        q, k, v: this rank's shards ``[B, H, S/W, D]`` (as `shard_sequence` cuts them;
            GQA as in `opforge.attention`).
        causal: causal over global positions.
        layout: ``"contiguous"`` or ``"zigzag"``, as `shard_sequence` cut the shards;
            None: contiguous, for non-causal attention only (which does not depend on
            it); causal attention must name it.
        timeout: how long each collective (the ranks' check, each transfer) may take
            before ``TimeoutError`` (a dead or stalled peer never hangs the others).
        timings: if given, accumulates seconds of ``compute`` and ``wait``.

    Returns:
        This rank's output shard, differentiable in q, k, v (the backward runs the ring
        again).

    Raises:
        ShapeError: the shard lengths differ (here or across the ranks), a zigzag shard
            is odd, or attention's own shape checks. DtypeError: as `opforge.attention`.
        AttrError: an unknown layout, or none given with ``causal`` (it must be the one
            the shards were cut with).
        All before any transfer, on every rank alike, so that the group stays usable.
        TimeoutError: a collective did not complete within ``timeout`` (see `_wait`).
    """
    layout = _layout(layout, causal, "ring_attention")
    _check_shards(q, k, v, causal, scale, layout, group, "ring_attention", timeout)
    return _RingAttention.apply(q, k, v, causal, scale, layout, group, timeout, timings)


def _layout(layout: str | None, causal: bool, op: str) -> str:
    """The layout to use: causal attention must be told the shards' layout (contiguous
    shards read as zigzag ones give wrong results); non-causal attention does not
    depend on it."""
    if layout is None:
        if causal:
            raise AttrError("must be given for causal attention: the layout the shards were "
                            "cut with by shard_sequence (zigzag balances the causal work)",
                            op=op, param="layout", expected=f"one of {LAYOUTS}", got=None)
        return "contiguous"
    _check_layout(layout, op, "layout")
    return layout


def _check_shards(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float | None, layout: str, group: dist.ProcessGroup | None,
                  op: str, timeout: datetime.timedelta) -> None:
    """This rank's shards against attention's rules, then every rank's shapes, dtype,
    causal flag, layout and scale against the others' (one small all-reduce, waited for
    at most ``timeout``): a rank whose check fails raises, and so do all the others,
    before any block travels. (Ranks that disagree on the attributes would make the same
    transfers and return wrong results without a word.)"""
    local: OpError | None = None
    try:
        plan("attention", q, k, v, causal=causal, scale=scale)
        if k.shape[2] != q.shape[2]:
            raise ShapeError("key shards must have the query shards' length", op=op,
                             param="k", expected=q.shape[2], got=k.shape[2])
        if layout == "zigzag" and q.shape[2] % 2:
            raise ShapeError("a zigzag shard holds two equal chunks", op=op, param="q",
                             expected="an even shard length", got=q.shape[2])
    except OpError as error:
        local = error
    # The scale's float64 bits, so that ranks compare it exactly.
    scale_bits = -1 if scale is None else struct.unpack("<q", struct.pack("<d", scale))[0]
    spec = [*(size for t in (q, k, v) for size in _padded(t.shape, 4)),
            _dtype_code(q.dtype), int(causal), LAYOUTS.index(layout), scale_bits]
    _agree(local, spec, q.device, group, timeout, op, "q",
           "shards and attributes (q, k, v shapes, dtype, causal, layout, scale bits)")


@dataclass(frozen=True)
class HierarchicalGroups:
    """The groups of a two-level layout: ``intra`` holds this rank's node (ranks
    ``node * local_world_size ...``), ``inter`` the node leaders (local rank 0 of every
    node; None on the other ranks)."""

    intra: dist.ProcessGroup
    inter: dist.ProcessGroup | None
    node: int
    local_rank: int


def hierarchical_groups(local_world_size: int,
                        timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> HierarchicalGroups:
    """Build intra-node and inter-node (leader) groups from the world, nodes of
    ``local_world_size`` consecutive ranks. Every rank must call it (group creation is
    collective). The flat ring over the world stays the default of `ring_attention`;
    pass ``groups.intra`` to run a ring inside a node. The groups' own collectives, and
    their creation, wait at most ``timeout``.

    Raises:
        AttrError: the world size is not a multiple of ``local_world_size``.
        TimeoutError: a rank did not join a group within ``timeout``.
    """
    world = dist.get_world_size()
    if local_world_size < 1 or world % local_world_size:
        raise AttrError("must divide the world size", op="hierarchical_groups",
                        param="local_world_size", expected=f"a divisor of {world}",
                        got=local_world_size)
    rank = dist.get_rank()
    node, local_rank = divmod(rank, local_world_size)
    def group(ranks: list[int]) -> dist.ProcessGroup:
        try:
            return dist.new_group(ranks, timeout=timeout)
        except RuntimeError as error:  # the store barrier of group creation timed out
            raise TimeoutError(f"the creation of the group of ranks {ranks} did not "
                               f"complete within {timeout}: {error}") from error

    intra = None
    for first in range(0, world, local_world_size):
        created = group(list(range(first, first + local_world_size)))
        if first == node * local_world_size:
            intra = created
    leaders = group(list(range(0, world, local_world_size)))
    return HierarchicalGroups(intra, leaders if local_rank == 0 else None, node, local_rank)


class _Shift(torch.autograd.Function):
    """Send to the next rank of ``group`` and receive from the previous one; the gradient
    goes round the other way."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor, group: dist.ProcessGroup,
                timeout: datetime.timedelta) -> torch.Tensor:
        ctx.group, ctx.timeout = group, timeout
        ring = Ring(group, timeout)
        (received,), works = ring.start([x])
        ring.finish(works)
        return received

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        ring = Ring(ctx.group, ctx.timeout)
        ring.next, ring.previous = ring.previous, ring.next
        (received,), works = ring.start([grad.contiguous()])
        ring.finish(works)
        return received, None, None


class _Broadcast(torch.autograd.Function):
    """Broadcast from ``source`` (a global rank) within ``group``; the gradients of every
    rank are summed back onto the source (the others' inputs get none)."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor, source: int, group: dist.ProcessGroup,
                timeout: datetime.timedelta) -> torch.Tensor:
        ctx.source, ctx.group, ctx.timeout = source, group, timeout
        out = x.detach().clone().contiguous()
        _collective(lambda: dist.broadcast(out, source, group=group, async_op=True), timeout,
              "the broadcast of a node block")
        return out

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        total = grad.contiguous().clone()
        _collective(lambda: dist.reduce(total, ctx.source, group=ctx.group, async_op=True),
                    ctx.timeout,
              "the reduce of a node block's gradient")
        if dist.get_rank() != ctx.source:
            total = torch.zeros_like(total)
        return total, None, None, None


def hierarchical_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           groups: HierarchicalGroups, causal: bool = False,
                           scale: float | None = None,
                           timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> torch.Tensor:
    """The two-level scheme over `hierarchical_groups`, for contiguous shards: each node
    gathers its ranks' K/V into one node block, node blocks go round the ring of node
    leaders (one transfer per node and step instead of one per rank), each leader
    broadcasts the block it received inside its node, and every rank attends its queries
    to each node block and merges by log-sum-exp. Differentiable (the transfers run in
    reverse in the backward). Transfers do not overlap compute here: the flat
    `ring_attention` stays the default.

    Raises:
        ShapeError: the shard lengths differ (here or across the ranks), or attention's own
            shape checks. DtypeError: as `opforge.attention`. All before any transfer.
        TimeoutError: a collective did not complete within ``timeout``.
    """
    _check_shards(q, k, v, causal, scale, "contiguous", None, "hierarchical_attention",
                  timeout)
    local_size = dist.get_world_size(groups.intra)
    nodes = dist.get_world_size() // local_size
    leader = groups.node * local_size
    chunk, width = q.shape[2], k.shape[3]
    # K and V travel as one tensor along one chain of transfers, so that every rank runs
    # the reverse transfers of the backward in the same order.
    # The shards were compared across every rank above: gathered without a second check.
    block = _Unshard.apply(torch.cat([k, v], -1), 2, "contiguous", groups.intra, timeout)
    out = lse = None
    unused = []
    for step in range(nodes):
        if step:
            if groups.inter is not None:
                block = _Shift.apply(block, groups.inter, timeout)
            block = _Broadcast.apply(block, leader, groups.intra, timeout)
        source = (groups.node - step) % nodes
        if causal and source > groups.node:
            unused.append(block)
            continue
        keys, values = block[..., :width], block[..., width:]
        if causal and source == groups.node:
            end = (groups.local_rank + 1) * chunk
            keys, values = keys[:, :, :end], values[:, :, :end]
        part_out, part_lse = attention(q, keys, values, causal and source == groups.node,
                                       scale, return_lse=True)
        if out is None:
            out, lse = part_out.to(part_lse.dtype), part_lse
            continue
        merged = torch.logaddexp(lse, part_lse)
        out = out * torch.exp(lse - merged)[..., None] \
            + part_out.to(out.dtype) * torch.exp(part_lse - merged)[..., None]
        lse = merged
    if unused:
        # Blocks this rank does not attend to still carry (zero) gradients, so that its
        # reverse transfers pair with its neighbours'.
        out = out + torch.nan_to_num(sum(b.sum() for b in unused) * 0.0, nan=0.0)
    return out.to(q.dtype)


def gathered_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       group: dist.ProcessGroup | None = None, causal: bool = False,
                       scale: float | None = None, layout: str | None = None,
                       timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> torch.Tensor:
    """The barrier-synchronised baseline (for comparison): all-gather K and V, barrier,
    then this rank's queries against the whole sequence (a causal rank attends to the
    keys before its chunks' ends, which the bottom-right mask aligns). Each collective
    waits at most ``timeout``.

    Raises:
        AttrError: an unknown layout, or none given with ``causal``. ShapeError, DtypeError,
            TimeoutError: as `ring_attention`.
    """
    layout = _layout(layout, causal, "gathered_attention")
    _check_shards(q, k, v, causal, scale, layout, group, "gathered_attention", timeout)
    rank, world = _group_info(group)
    # The shards were compared across the ranks above: gathered without a second check.
    keys, values = (_Unshard.apply(t, 2, layout, group, timeout) for t in (k, v))
    _collective(lambda: dist.barrier(group=group, async_op=True), timeout,
                "the barrier after the gather")
    if not causal:
        return attention(q, keys, values, False, scale)
    chunk = q.shape[2] // len(_pieces(rank, world, layout))
    parts = []
    for index, piece in enumerate(_pieces(rank, world, layout)):
        end = (piece + 1) * chunk
        rows = q[:, :, index * chunk:(index + 1) * chunk]
        parts.append(attention(rows, keys[:, :, :end], values[:, :, :end], True, scale))
    return torch.cat(parts, 2)



# Measured on this project's 2-core CI machine class with benchmarks/ring_benchmark.py
# (gloo over loopback, one thread a rank, fp32; compute 1.1e10 to 1.2e10 FLOP/s, link
# 3.7e8 to 7e8 B/s over three runs): see docs/distributed.md.
MEASURED_COMPUTE_FLOPS = 1.1e10
MEASURED_LINK_BYTES = 5.0e8


@dataclass(frozen=True)
class Projection:
    """`scaling_model`'s estimate for one world size: seconds per forward for the ring
    and the barrier baseline, and their speed-ups over one rank."""

    world: int
    ring_s: float
    barrier_s: float
    ring_speedup: float
    barrier_speedup: float


def scaling_model(world: int, seq: int, heads: int = 32, dim: int = 128, batch: int = 1,
                  causal: bool = False, dtype_bytes: int = 2,
                  compute_flops: float = MEASURED_COMPUTE_FLOPS,
                  link_bytes: float = MEASURED_LINK_BYTES,
                  latency_s: float = 20e-6) -> Projection:
    """Project the forward time of sequence-parallel attention on ``world`` ranks.

    Work: ``4 B H S² D`` FLOP (halved when causal; zigzag keeps it even across ranks)
    at ``compute_flops`` per rank. A key/value shard is ``2 B H (S/W) D dtype_bytes``
    bytes, moved at ``link_bytes`` per second plus ``latency_s`` per message.

    - ring: W blocks of ``work / W²`` each; the first is local, each later one waits for
      its transfer only where the transfer is slower than the block:
      ``c + (W - 1) max(c, t)``.
    - barrier: all-gather of the other W - 1 shards (ring all-gather: W - 1 transfers in
      sequence), then all the rank's work: ``(W - 1) t + W c``.
    """
    work = 4 * batch * heads * seq * seq * dim * (0.5 if causal else 1.0)
    block = work / world**2 / compute_flops
    transfer = 2 * batch * heads * (seq / world) * dim * dtype_bytes / link_bytes + latency_s
    single = work / compute_flops
    ring = block + (world - 1) * max(block, transfer)
    barrier = (world - 1) * transfer + world * block
    return Projection(world, ring, barrier, single / ring, single / barrier)
