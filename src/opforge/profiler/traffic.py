"""What a call's kernels ask of memory, counted on the CPU by Triton's interpreter.

Every load and store a kernel makes goes through the interpreter's builder: `counting`
wraps it and adds up, per kernel, the bytes of the elements each access reaches (masked
lanes touch nothing) and the distinct addresses among them. Three figures per call:

* ``least``: what the operator must move, its inputs read once and its outputs written
  once (`OpDef.cost`: the bytes the roofline judges a kernel by);
* ``planned``: what the plan's kernels move by the operator's own account
  (`OpDef.kernel_costs`: intermediates written by one kernel and read by the next, such as
  a split reduction's partials; the whole ``least`` for a one-kernel call);
* ``footprint``: the distinct bytes each kernel touches, summed over the kernels, as
  measured. A kernel's second look at bytes it already touched is not in it (on a GPU
  that look is served by L1/L2, once the tile is small enough to stay there), a
  workspace the operator's account forgets is.
* ``requested``: every byte every access reaches, as measured: the traffic of a device
  without caches. Above ``footprint`` by the passes a kernel makes over its data (a row
  too long for the chip read twice) and by the tiles a matmul or attention re-reads.

The interpreter runs the kernels the plan would launch on the hardware it is tiled for
(``use_hardware("h200")`` on any machine), so a kernel that makes an extra pass, or an
intermediate that grows past its inputs, shows on a CPU.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from opforge.core import backends
from opforge.core.hardware import use_hardware
from opforge.core.opdef import Case, OpDef
from opforge.core.plan import plan as make_plan
from opforge.core.plan import set_run_observer

# Addresses kept per kernel before they are made unique (bounds memory on long runs).
_COMPACT_AT = 1 << 22


class _Addresses:
    """Distinct element addresses of one element size, made unique in amortised steps."""

    __slots__ = ("arrays", "limit", "pending")

    def __init__(self) -> None:
        self.arrays: list[np.ndarray] = []
        self.pending = 0  # addresses added since the last unique
        self.limit = _COMPACT_AT

    def add(self, addresses: np.ndarray) -> None:
        self.arrays.append(addresses)
        self.pending += addresses.size
        if self.pending > self.limit:
            self.distinct()
            # Amortised: the next compaction waits for as many new addresses as are kept.
            self.limit = max(_COMPACT_AT, self.arrays[0].size)

    def distinct(self) -> int:
        if self.pending:
            self.arrays = [np.unique(np.concatenate(self.arrays))]
            self.pending = 0
        return self.arrays[0].size if self.arrays else 0


@dataclass
class KernelTraffic:
    """One kernel's accesses over the launches of one call (bytes)."""

    kernel: str
    launches: int = 0
    read: int = 0
    written: int = 0
    _touched: dict[int, _Addresses] = field(default_factory=dict, repr=False)

    def _touch(self, addresses: np.ndarray, itemsize: int) -> None:
        self._touched.setdefault(itemsize, _Addresses()).add(addresses)

    @property
    def requested(self) -> int:
        return self.read + self.written

    @property
    def footprint(self) -> int:
        """Distinct bytes touched: distinct element addresses times their element size
        (a float32 table read and a bfloat16 table written are both counted)."""
        return sum(size * touched.distinct() for size, touched in self._touched.items())


@dataclass(frozen=True)
class CallTraffic:
    """The traffic of one call (see the module docstring for the four figures)."""

    op: str
    case: str
    variant: str
    least: int
    planned: int
    kernels: tuple[KernelTraffic, ...]

    @property
    def requested(self) -> int:
        return sum(k.requested for k in self.kernels)

    @property
    def footprint(self) -> int:
        return sum(k.footprint for k in self.kernels)


_counters = threading.local()  # .kernels: {name: KernelTraffic}, .current: the running one


def _interpreter_classes() -> tuple[type, type]:
    # Every interpreted launch runs a GridExecutor (Triton 3.2's ``kernel[grid]`` makes one
    # without going through ``run``).
    from triton.runtime.interpreter import GridExecutor, InterpreterBuilder

    return InterpreterBuilder, GridExecutor


def _account(pointers: Any, mask: Any, written: bool) -> None:
    counter = getattr(_counters, "current", None)
    if counter is None:
        return
    addresses = np.asarray(pointers.data)
    itemsize = max(1, pointers.get_element_ty().primitive_bitwidth // 8)
    reached = addresses[np.asarray(mask.data, dtype=bool)] if mask is not None else addresses
    reached = reached.reshape(-1).astype(np.uint64, copy=False)
    if written:
        counter.written += reached.size * itemsize
    else:
        counter.read += reached.size * itemsize
    counter._touch(reached, itemsize)


@contextlib.contextmanager
def counting() -> Iterator[dict[str, KernelTraffic]]:
    """Count the memory accesses of the interpreted kernels launched in the block, in
    this thread, per kernel name (the dict fills as kernels run).

    Raises:
        RuntimeError: Triton's interpreter is not on (``TRITON_INTERPRET=1`` must be set
            before opforge is imported) or Triton is not installed.
    """
    if not backends.interpreter_enabled():
        raise RuntimeError("memory traffic is counted by Triton's interpreter: set "
                           "TRITON_INTERPRET=1 before importing opforge")
    builder, executor = _interpreter_classes()
    load, store = builder.create_masked_load, builder.create_masked_store
    atomic, compare_swap, run = (builder.create_atomic_rmw, builder.create_atomic_cas,
                                 executor.__call__)

    def counted_load(self: Any, ptrs: Any, mask: Any, *args: Any) -> Any:
        _account(ptrs, mask, written=False)
        return load(self, ptrs, mask, *args)

    def counted_store(self: Any, ptrs: Any, value: Any, mask: Any, *args: Any) -> Any:
        _account(ptrs, mask, written=True)
        return store(self, ptrs, value, mask, *args)

    def counted_atomic(self: Any, op: Any, ptr: Any, value: Any, mask: Any, *args: Any) -> Any:
        _account(ptr, mask, written=False)  # a read-modify-write: both ways
        _account(ptr, mask, written=True)
        return atomic(self, op, ptr, value, mask, *args)

    def counted_swap(self: Any, ptr: Any, *args: Any) -> Any:
        _account(ptr, None, written=False)
        _account(ptr, None, written=True)
        return compare_swap(self, ptr, *args)

    kernels: dict[str, KernelTraffic] = {}

    def counted_run(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(_counters, "kernels", None) is not kernels:
            return run(self, *args, **kwargs)  # another thread's launch
        name = self.fn.__name__
        counter = kernels.setdefault(name, KernelTraffic(name))
        counter.launches += 1
        by_plan = getattr(_counters, "plan_launches", None)
        if by_plan is not None:
            by_plan[name] = by_plan.get(name, 0) + 1
        outer, _counters.current = getattr(_counters, "current", None), counter
        try:
            return run(self, *args, **kwargs)
        finally:
            _counters.current = outer

    patches = ((builder, "create_masked_load", counted_load),
               (builder, "create_masked_store", counted_store),
               (builder, "create_atomic_rmw", counted_atomic),
               (builder, "create_atomic_cas", counted_swap),
               (executor, "__call__", counted_run))
    _counters.kernels = kernels
    with contextlib.ExitStack() as stack:
        for owner, name, patched in patches:
            stack.enter_context(_patched(owner, name, patched))
        try:
            yield kernels
        finally:
            _counters.kernels = None


@contextlib.contextmanager
def _patched(owner: type, name: str, value: Any) -> Iterator[None]:
    original = owner.__dict__[name]
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def planned_bytes(plan: Any, launches: dict[str, int]) -> int:
    """The bytes the plan's kernels move by the operator's account: `OpDef.kernel_costs`
    (the cost of one launch of each kernel) times the ``launches`` each made, else the
    whole call's `OpDef.cost`."""
    if plan.backend == "triton" and plan.op.kernel_costs is not None and plan.tiling:
        costs = plan.op.kernel_costs(plan.tiling, plan.grid, plan.inputs, plan.outputs,
                                     plan.attrs)
        if costs:
            return sum(cost.bytes_moved * launches.get(name, 0)
                       for name, cost in costs.items())
    return plan.cost.bytes_moved


@contextlib.contextmanager
def _launches_by_run(runs: list[tuple[Any, dict[str, int]]]) -> Iterator[None]:
    """Each plan run in the block, in this thread, appended to ``runs`` with the launches
    made by its own launcher: a composite's steps are runs of their own, unless the
    composite has no `OpDef.kernel_costs` (its whole `OpDef.cost`, steps included, is then
    its account). The observer in place before is still called for every run."""
    @contextlib.contextmanager
    def observed(run_plan: Any) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if previous is not None:
                stack.enter_context(previous(run_plan))
            if getattr(_counters, "kernels", None) is None:  # another thread's run
                yield
                return
            launches: dict[str, int] = {}
            whole = getattr(_counters, "whole_account", False)
            if not whole:
                runs.append((run_plan, launches))
            saved = getattr(_counters, "plan_launches", None)
            _counters.plan_launches = launches
            _counters.whole_account = whole or run_plan.op.kernel_costs is None
            try:
                yield
            finally:
                _counters.plan_launches, _counters.whole_account = saved, whole

    previous = set_run_observer(observed)
    try:
        yield
    finally:
        set_run_observer(previous)


def audit(op: OpDef, case: Case, hardware: str | None = None) -> CallTraffic:
    """The traffic of ``op`` on ``case`` (a call's inputs and attributes) run on the
    Triton backend under the interpreter, tiled for ``hardware`` (a profile name; the
    machine's own when ``None``).

    Raises:
        RuntimeError: the interpreter is off (see `counting`).
        OpError: the case is not a valid call.
    """
    with contextlib.ExitStack() as stack:
        if hardware is not None:
            stack.enter_context(use_hardware(hardware))
        stack.enter_context(backends.use_backend("triton"))
        planned = make_plan(op, *case.inputs, **case.attrs)
        inputs = [t.clone() if i in op.mutated_inputs else t for i, t in
                  enumerate(case.inputs)]
        runs: list[tuple[Any, dict[str, int]]] = []
        with counting() as kernels, _launches_by_run(runs):
            planned.run(*inputs)
    variant = planned.tiling.variant if planned.tiling else "-"
    return CallTraffic(op.name, case.name, variant, planned.cost.bytes_moved,
                       sum(planned_bytes(run, launches) for run, launches in runs),
                       tuple(kernels.values()))


def bench_cases(op: OpDef, dtype: torch.dtype, shapes: Sequence[tuple[int, ...]] | None,
                all_sizes: bool = False) -> list[Case]:
    """The calls ``opforge bench`` makes of ``op`` on the CPU: at those of ``shapes`` of
    the form it takes (matmul one number, a norm two), else its first CPU size (every one
    with ``all_sizes``)."""
    from opforge.profiler.bench import case_at

    spec = op.bench
    if spec is None:
        return []
    ranks = {len(shape) for shape in (*spec.cpu_shapes, *spec.shapes)}
    sizes = [s for s in shapes if len(s) in ranks] if shapes else (
        spec.cpu_shapes if all_sizes else spec.cpu_shapes[:1])
    cases = []
    for shape in sizes:
        case = case_at(op, spec, tuple(shape), dtype, torch.device("cpu"))
        label = "x".join(str(d) for d in shape)
        cases.append(Case(f"{label} {case.name}".strip(), case.inputs, case.attrs))
    return cases


def gradient_calls(op: OpDef, case: Case) -> list[tuple[OpDef, Case]]:
    """The operator calls the backward of ``op`` on ``case`` makes (``rms_norm``'s:
    one ``rms_norm_backward``), with their inputs, for a gradient of ones on its first
    output; empty for an operator without a backward. The calls run on the torch
    backend: only their arguments are kept."""
    from opforge.core.registry import list_ops

    if op.backward_fn is None:
        return []
    leaves = [t.detach().requires_grad_() if isinstance(t, torch.Tensor)
              and t.is_floating_point() and i not in op.mutated_inputs else t
              for i, t in enumerate(case.inputs)]
    wanted = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
    with backends.use_backend("torch"):
        result = op(*leaves, *op.bind_attrs(case.attrs).values())
        first = result[0] if isinstance(result, tuple) else result
        calls: list[tuple[OpDef, Case]] = []
        entries = {other: other.call for other in list_ops()}

        def recorder(other: OpDef, entry: Any) -> Any:
            def call(*args: Any) -> Any:
                count = len(other.inputs)
                inputs = tuple(a.detach() if isinstance(a, torch.Tensor) else a
                               for a in args[:count])
                attrs = dict(zip(other.attr_names, args[count:]))
                calls.append((other, Case(f"{case.name} gradient", inputs, attrs)))
                return entry(*args)
            return call

        for other, entry in entries.items():
            other.call = recorder(other, entry)
        try:
            torch.autograd.grad(first, wanted, torch.ones_like(first), allow_unused=True)
        finally:
            for other, entry in entries.items():
                other.call = entry
    return calls


def audit_ops(ops: Sequence[OpDef], dtype: torch.dtype, hardware: str | None,
              shapes: Sequence[tuple[int, ...]] | None = None, all_sizes: bool = False
              ) -> list[CallTraffic]:
    """`audit` of each operator at its bench sizes (`bench_cases`), and of the gradient
    operators its backward calls there."""
    results = []
    for op in ops:
        for case in bench_cases(op, dtype, shapes, all_sizes):
            results.append(audit(op, case, hardware))
            results += [audit(other, call, hardware)
                        for other, call in gradient_calls(op, case)]
    return results


def traffic_markdown(results: Sequence[CallTraffic], hardware: str | None, dtype: str,
                     env: dict[str, str]) -> str:
    """The audit as Markdown: one row per call, its figures in units of its least."""
    lines = ["# Memory traffic per call", "",
             f"{env['date']} · tiled for {hardware or 'this machine'} · {dtype} · torch "
             f"{env['torch']} · triton {env['triton']} · counted by Triton's interpreter.",
             "", "| op | case | variant | least MB | planned | footprint | requested | "
             "kernels (launches) |", "|---|---|---|---:|---:|---:|---:|---|"]
    for r in results:
        ratios = " | ".join(f"{v / r.least:.2f}" if r.least else "-"
                            for v in (r.planned, r.footprint, r.requested))
        kernels = ", ".join(f"{k.kernel} ({k.launches})" for k in r.kernels)
        lines.append(f"| {r.op} | {r.case} | {r.variant} | {r.least / 1e6:.3f} | {ratios} | "
                     f"{kernels} |")
    return "\n".join(lines) + "\n"
