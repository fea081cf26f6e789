"""From a torch.profiler (Kineto) trace to opforge's three layers, kernels, operators, steps.

The trace is the Chrome-format JSON that ``export_chrome_trace`` writes: complete events
(``"ph": "X"``) with a category. opforge sorts them into layers:

- **framework**: Python functions (``with_stack``), ``nn.Module`` scopes, profiler steps and
  other ``record_function`` annotations;
- **operators**: torch's operators (``cpu_op``) and opforge's (the ``opforge::<op>#<n>``
  annotation that `Plan.run` leaves, merged into the dispatcher's ``opforge::<op>`` event
  when the call came through ``torch.ops``, whatever autograd shims and Python frames lie
  between them), with the plan's record: shapes, dtypes, backend, tiling, grid and cost;
- **runtime**: kernel launches (``cuda_runtime``, ``cuda_driver``);
- **kernels**: device kernels and copies. A kernel belongs to the operator that launched it
  (its ``External id``, else its launch's ``correlation``). On a machine without device
  kernels (the CPU), the operator calls are the kernels: each outermost operator that calls
  no opforge operator, and each opforge operator that calls no other one.

Host events nest by time on their thread. Times are microseconds since the first event.
"""

from __future__ import annotations

import bisect
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opforge.profiler.costs import TORCH_DTYPE_NAMES, aten_cost, composite
from opforge.profiler.tables import KernelRow, MemoryRow, OperatorRow, StepRow

OPFORGE_PREFIX = "opforge::"
_SEQUENCED = re.compile(r"^(opforge::[\w.]+)#(\d+)$")
_KERNEL_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
_RUNTIME_CATEGORIES = {"cuda_runtime", "cuda_driver", "runtime"}
# Collective and point-to-point kernels (NCCL, HCCL, gloo, c10d); whole words only, so
# that an operator like broadcast_add is not taken for a broadcast.
_COMMUNICATION = re.compile(r"nccl|gloo|hccl|c10d::|all_?reduce|all_?gather|reduce_?scatter|"
                            r"all_?to_?all|\b(?:i?send|i?recv|broadcast)\b", re.IGNORECASE)
_WRAPPERS = ("autograd::", "torch::autograd", "Optimizer.")
# torch.compile's timers around a compilation (``dynamo_timed`` events, recorded as
# operators, and their ``..._data: compile_id=`` annotations) and opforge's autotuning of a
# new tiling bucket (``opforge::autotune <op>``): what runs inside (operators on fake
# tensors, candidate kernels timed) is compile-time work, not the run's.
_AUTOTUNE = re.compile(r"^opforge::autotune ")
_COMPILATION = re.compile(r"\(dynamo_timed\)$|^(?:dynamo|entire_frame_compile|backend_compile)$"
                          r"|compile_id=|" + _AUTOTUNE.pattern)


@dataclass(eq=False)
class Event:
    """One complete event of the trace, placed in its layer and in the host call tree."""

    name: str
    cat: str
    ts: float
    dur: float
    pid: Any
    tid: Any
    args: dict[str, Any]
    layer: str
    parent: Event | None = None
    children: list[Event] = field(default_factory=list)
    record: Mapping[str, Any] | None = None
    kernels: list[Event] = field(default_factory=list)
    owner: Event | None = None

    @property
    def end(self) -> float:
        return self.ts + self.dur

    @property
    def compiling(self) -> bool:
        """Whether the event runs inside a torch.compile compilation."""
        return any(_COMPILATION.search(e.name) for e in (self, *self.ancestors()))

    def ancestors(self) -> Iterable[Event]:
        node = self.parent
        while node is not None:
            yield node
            node = node.parent

    def subtree(self) -> Iterable[Event]:
        stack = [self]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children)


def _layer(event: Mapping[str, Any]) -> str:
    cat = str(event.get("cat", "")).lower()
    name = str(event.get("name", ""))
    if _COMPILATION.search(name):
        return "framework"
    if cat in _KERNEL_CATEGORIES:
        return "kernel"
    if cat in _RUNTIME_CATEGORIES:
        return "runtime"
    if cat == "cpu_op" or (cat == "user_annotation" and name.startswith(OPFORGE_PREFIX)):
        return "operator"
    return "framework"


def _nest(events: Sequence[Event]) -> None:
    """Parent links by time containment on each host thread."""
    threads: dict[tuple[Any, Any], list[Event]] = {}
    for event in events:
        threads.setdefault((event.pid, event.tid), []).append(event)
    for thread in threads.values():
        thread.sort(key=lambda e: (e.ts, -e.dur))
        stack: list[Event] = []
        for event in thread:
            while stack and event.ts >= stack[-1].end - 1e-6:
                stack.pop()
            if stack:
                event.parent = stack[-1]
                stack[-1].children.append(event)
            stack.append(event)


def _operator_parent(event: Event) -> Event | None:
    return next((a for a in event.ancestors() if a.layer == "operator"), None)


@dataclass(frozen=True)
class MemoryEvent:
    """One allocation (``bytes`` > 0) or release (< 0) that ``profile_memory`` recorded."""

    ts: float
    bytes: int
    addr: int
    total_allocated: int
    total_reserved: int
    device: str
    pid: Any
    tid: Any


# c10::DeviceType codes of the profiler's memory events.
_DEVICE_TYPES = {0: "CPU", 1: "CUDA", 20: "NPU"}


@dataclass
class Timeline:
    """A parsed profile: every event by layer, and the kernels with their owners."""

    events: list[Event]
    kernels: list[Event]
    device_kernels: bool
    memory: list[MemoryEvent] = field(default_factory=list)

    @property
    def operators(self) -> list[Event]:
        """The run's operator calls (not those of a torch.compile compilation)."""
        return [e for e in self.events if e.layer == "operator" and not e.compiling]

    @property
    def compile_us(self) -> float:
        """Time spent compiling with torch.compile inside the profile."""
        return _length(_union((e.ts, e.end) for e in self.events
                              if _COMPILATION.search(e.name) and not _AUTOTUNE.search(e.name)))

    @property
    def autotune_us(self) -> float:
        """Time spent autotuning new tiling buckets inside the profile."""
        return _length(_union((e.ts, e.end) for e in self.events if _AUTOTUNE.search(e.name)))

    @property
    def steps(self) -> list[Event]:
        # Host annotations only: a GPU trace repeats each step on the device's rows.
        return sorted((e for e in self.events if e.cat == "user_annotation"
                       and e.name.startswith("ProfilerStep#")), key=lambda e: e.ts)


def parse(traces: Sequence[Mapping[str, Any]], records: Mapping[int, Mapping[str, Any]]
          ) -> Timeline:
    """Build the `Timeline` of one or more Kineto traces (in time order).

    Args:
        traces: the loaded JSON of ``export_chrome_trace`` files.
        records: opforge's plan records by sequence number (the ``#n`` of an
            ``opforge::<op>#n`` annotation).
    """
    # Device-side copies of the host annotations (``gpu_user_annotation``) share their
    # External ids and would take the host events' place: they are left out.
    raw = [e for trace in traces for e in trace.get("traceEvents", [])
           if e.get("ph") == "X" and isinstance(e.get("ts"), int | float)
           and e.get("cat") not in ("Trace", "gpu_user_annotation")]
    start = min((float(e["ts"]) for e in raw), default=0.0)
    memory = sorted((_memory_event(e, start) for trace in traces
                     for e in trace.get("traceEvents", [])
                     if e.get("ph") == "i" and e.get("name") == "[memory]"),
                    key=lambda m: m.ts)
    events = [Event(str(e.get("name", "")), str(e.get("cat", "")), float(e["ts"]) - start,
                    float(e.get("dur", 0.0)), e.get("pid"), e.get("tid"),
                    dict(e.get("args") or {}), _layer(e)) for e in raw]
    for event in events:
        match = _SEQUENCED.match(event.name)
        if match:
            event.name = match.group(1)
            event.record = records.get(int(match.group(2)))
    host = [e for e in events if e.layer != "kernel"]
    _nest(host)
    by_external: dict[Any, Event] = {}
    for event in host:
        external = event.args.get("External id")
        if external is not None and event.layer in ("operator", "framework"):
            by_external.setdefault(external, event)
    events = _merge_annotations(events, by_external)
    device = [e for e in events if e.layer == "kernel"]
    if device:
        kernels = _own_device_kernels(device, events, by_external)
    else:
        kernels = _cpu_kernels(events)
    for kernel in kernels:
        if kernel.owner is not None:
            kernel.owner.kernels.append(kernel)
    return Timeline(events, sorted(kernels, key=lambda k: k.ts), bool(device), memory)


def _is_wrapper(event: Event) -> bool:
    """Autograd nodes, custom-op autograd shims and optimizer steps: operator events that
    only call other operators (their names have no ``namespace::``)."""
    return event.name.startswith(_WRAPPERS) or "::" not in event.name


def _memory_event(event: Mapping[str, Any], start: float) -> MemoryEvent:
    args = event.get("args") or {}
    code = int(args.get("Device Type", 0))
    return MemoryEvent(float(event["ts"]) - start, int(args.get("Bytes", 0)),
                       int(args.get("Addr", 0)), int(args.get("Total Allocated", 0)),
                       int(args.get("Total Reserved", 0)), _DEVICE_TYPES.get(code, str(code)),
                       event.get("pid"), event.get("tid"))


def _callees(event: Event, layers: Sequence[str]) -> Iterable[Event]:
    """The events of ``layers`` that ``event`` calls: its children, and the first such
    events below its framework children (Python frames with ``with_stack``, annotations);
    compilations are not looked into."""
    for child in event.children:
        if child.layer in layers:
            yield child
        elif child.layer == "framework" and not _COMPILATION.search(child.name):
            yield from _callees(child, layers)


def _compile_time(event: Event) -> float:
    """Host µs of the compilations ``event`` runs (its autotuning; through framework
    frames): time that is not the call's own."""
    return sum(child.dur if _COMPILATION.search(child.name)
               else _compile_time(child) if child.layer == "framework" else 0.0
               for child in event.children)


def _merge_annotations(events: list[Event], by_external: dict[Any, Event]) -> list[Event]:
    """Fold each ``opforge::<op>#n`` annotation into the dispatcher's ``opforge::<op>``
    event around it (through autograd shims and, with ``with_stack``, the Python frames
    between them): one operator, carrying the plan's record."""
    dropped = set()
    for event in events:
        if event.record is None or event.cat != "user_annotation":
            continue
        target = event.parent
        while target is not None and (target.cat == "python_function" or (
                target.layer == "operator" and _is_wrapper(target))):
            target = target.parent
        if (target is None or target.layer != "operator" or target.name != event.name
                or target.record is not None):
            continue
        target.record = event.record
        parent = event.parent
        assert parent is not None
        parent.children.remove(event)
        for child in event.children:
            child.parent = parent
            parent.children.append(child)
        external = event.args.get("External id")
        if external is not None:
            by_external[external] = parent if parent.layer == "operator" else target
        dropped.add(id(event))
    return [e for e in events if id(e) not in dropped]


def _own_device_kernels(kernels: Sequence[Event], events: Sequence[Event],
                        by_external: Mapping[Any, Event]) -> list[Event]:
    """Give each kernel its launching operator; drop those a compilation launched."""
    launches = {e.args.get("correlation"): e for e in events
                if e.layer == "runtime" and e.args.get("correlation") is not None}
    kept = []
    for kernel in kernels:
        origin = by_external.get(kernel.args.get("External id"))
        if origin is None:
            launch = launches.get(kernel.args.get("correlation"))
            origin = launch.parent if launch is not None else None
        if origin is not None and origin.compiling:
            continue
        if origin is not None and origin.layer != "operator":
            origin = _operator_parent(origin)
        kernel.owner = origin
        kept.append(kernel)
    return kept


def _has_opforge_below(event: Event) -> bool:
    return any(e.record is not None for e in event.subtree() if e is not event)


def _cpu_kernels(events: Sequence[Event]) -> list[Event]:
    """On the CPU, each outermost operator that calls no opforge operator is a kernel, and
    so is each opforge operator that calls no other one; wrappers (autograd nodes, optimizer
    steps) are looked through, compilations skipped."""
    kernels: list[Event] = []

    def visit(event: Event) -> None:
        if _COMPILATION.search(event.name):
            return
        if (event.layer == "operator" and not _is_wrapper(event)
                and not _has_opforge_below(event)):
            kernel = Event(event.name, event.cat, event.ts, event.dur - _compile_time(event),
                           event.pid, event.tid, event.args, "kernel", record=event.record,
                           owner=event)
            kernels.append(kernel)
            return
        for child in event.children:
            visit(child)

    for event in events:
        if event.parent is None and event.layer != "kernel":
            visit(event)
    return kernels


# ---------------------------------------------------------------------------------------------
# Rows of the report files


def _shape_text(shapes: Iterable[Sequence[int]]) -> str:
    return ";".join(",".join(str(d) for d in shape) for shape in shapes)


def _recorded_tensors(event: Event) -> tuple[list[list[int]], list[str]]:
    dims = event.args.get("Input Dims") or []
    types = event.args.get("Input type") or []
    chosen = [(list(d), TORCH_DTYPE_NAMES[t]) for d, t in zip(dims, types)
              if t in TORCH_DTYPE_NAMES]
    return [d for d, _ in chosen], [t for _, t in chosen]


def _cost(event: Event) -> tuple[float, float, str] | None:
    """(FLOPs, bytes, output shapes) of an operator call, when known. A `composite` torch
    operator costs what the operators it called cost (nothing when it called none: it was
    a view), unknown when one of them has no known cost; its output is its last callee's
    (a padded convolution's, not its padding's; a copying reshape's view of the copy)."""
    if event.record is not None:
        return (float(event.record["flops"]), float(event.record["bytes"]),
                _shape_text(o["shape"] for o in event.record["outputs"]))
    types = event.args.get("Input type") or []
    if composite(event.name, types):
        parts = [_cost(callee) for callee in _callees(event, ("operator",))]
        known = [part for part in parts if part is not None]
        if len(known) < len(parts):
            return None
        shapes = [p[2] for p in known if p[2]]
        return (sum((p[0] for p in known), 0.0), sum((p[1] for p in known), 0.0),
                shapes[-1] if shapes else "")
    cost = aten_cost(event.name, event.args.get("Input Dims") or [], types,
                     event.args.get("Concrete Inputs") or [])
    if cost is None:
        return None
    return cost.flops, cost.bytes_moved, _shape_text(cost.output_shapes)


def _inputs(event: Event) -> tuple[str, str]:
    if event.record is not None:
        inputs = [i for i in event.record["inputs"] if i is not None]
        return (_shape_text(i["shape"] for i in inputs),
                ";".join(i["dtype"] for i in inputs))
    dims, types = _recorded_tensors(event)
    return _shape_text(dims), ";".join(types)


def _kernel_count(event: Event) -> int:
    return sum(len(e.kernels) for e in event.subtree())


def kernel_rows(timeline: Timeline, core: str) -> list[KernelRow]:
    """`KernelRow`s in time order, with the wait since the previous kernel on the stream.

    A kernel gets a cost from the nearest operator around it that has one (opforge's
    record, or a cost derived for torch's operator), when that operator launched only this
    kernel, or when the operator's record gives the kernel's own cost by its name (an
    opforge operator that launches several)."""
    rows = []
    last_end: dict[Any, float] = {}
    for kernel in timeline.kernels:
        costed = None
        for op in ([kernel.owner, *kernel.owner.ancestors()] if kernel.owner else []):
            if op.layer == "operator" and _cost(op) is not None:
                costed = op
                break
        cost = None
        if costed is not None:
            own = (costed.record or {}).get("kernels", {}).get(kernel.name)
            if own is not None:
                cost = (own[0], own[1], _cost(costed)[2])
            elif _kernel_count(costed) == 1:
                cost = _cost(costed)
        describing = costed or kernel.owner
        shapes, dtypes = _inputs(describing) if describing is not None else ("", "")
        grid = kernel.args.get("grid")
        if grid is not None:
            blocks: int | None = math.prod(int(g) for g in grid)
        elif kernel.record is not None and kernel.record["backend"] != "torch":
            blocks = math.prod(kernel.record["grid"]) if kernel.record["grid"] else None
        else:
            blocks = None
        stream = (kernel.pid, kernel.tid)
        wait = max(0.0, kernel.ts - last_end[stream]) if stream in last_end else 0.0
        last_end[stream] = max(last_end.get(stream, 0.0), kernel.end)
        rows.append(KernelRow(
            kernel.name, kernel.owner.name if kernel.owner is not None else kernel.name, core,
            kernel.ts, kernel.dur, wait, blocks, shapes, dtypes, cost[2] if cost else "",
            cost[0] if cost else None, cost[1] if cost else None))
    return rows


def _call_stack(event: Event) -> str:
    frames = [a.name for a in event.ancestors()
              if a.layer == "framework" and not a.name.startswith("ProfilerStep#")]
    return ";".join(reversed(frames))


def operator_rows(timeline: Timeline) -> list[OperatorRow]:
    """One `OperatorRow` per operator call, in time order."""
    rows = []
    for op in sorted(timeline.operators, key=lambda e: e.ts):
        children = sum(c.dur for c in _callees(op, ("operator", "runtime")))
        own = op.dur - _compile_time(op)
        device_self = sum(k.dur for k in op.kernels)
        device_total = sum(k.dur for e in op.subtree() for k in e.kernels)
        cost = _cost(op)
        record = op.record or {}
        shapes, _ = _inputs(op)
        rows.append(OperatorRow(
            op.name, shapes, _call_stack(op), max(0.0, own - children), own,
            device_self, device_total, record.get("backend", ""), record.get("tiling", ""),
            "x".join(str(g) for g in record.get("grid", ())), cost[0] if cost else None,
            cost[1] if cost else None))
    return rows


def _operator_at(timeline: Timeline) -> Callable[[Any, Any, float], str]:
    """``at(pid, tid, ts)``: the innermost operator running on that thread at ``ts``."""
    threads: dict[tuple[Any, Any], list[Event]] = {}
    for event in timeline.events:
        if event.layer == "operator":
            threads.setdefault((event.pid, event.tid), []).append(event)
    starts = {}
    for key, ops in threads.items():
        ops.sort(key=lambda e: e.ts)
        starts[key] = [e.ts for e in ops]

    def at(pid: Any, tid: Any, ts: float) -> str:
        ops = threads.get((pid, tid), [])
        index = bisect.bisect_right(starts.get((pid, tid), []), ts) - 1
        node: Event | None = ops[index] if index >= 0 else None
        # The last operator to start may have ended: its ancestors may still run.
        while node is not None and not (node.ts <= ts < node.end and node.layer == "operator"):
            node = node.parent
        return node.name if node is not None else ""
    return at


def memory_rows(timeline: Timeline) -> list[MemoryRow]:
    """One `MemoryRow` per allocation, paired with its release (same device and address),
    named after the operator that made it."""
    at = _operator_at(timeline)
    open_blocks: dict[tuple[str, int], MemoryEvent] = {}
    pairs: list[tuple[MemoryEvent, MemoryEvent | None]] = []
    for event in timeline.memory:
        key = (event.device, event.addr)
        if event.bytes > 0:
            open_blocks[key] = event
        elif key in open_blocks:
            pairs.append((open_blocks.pop(key), event))
    pairs += [(alloc, None) for alloc in open_blocks.values()]
    rows = []
    for alloc, release in sorted(pairs, key=lambda pair: pair[0].ts):
        rows.append(MemoryRow(
            at(alloc.pid, alloc.tid, alloc.ts) or "(outside operators)", alloc.bytes / 1024,
            alloc.ts, release.ts if release else None,
            release.ts - alloc.ts if release else None, alloc.total_allocated / 2**20,
            alloc.total_reserved / 2**20,
            release.total_allocated / 2**20 if release else None,
            release.total_reserved / 2**20 if release else None, alloc.device))
    return rows


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for lo, hi in sorted(intervals):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def _length(intervals: Iterable[tuple[float, float]]) -> float:
    return sum(hi - lo for lo, hi in intervals)


def _clip(intervals: Iterable[tuple[float, float]], lo: float, hi: float
          ) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


def step_rows(timeline: Timeline) -> list[StepRow]:
    """The time split of each profiler step (the whole profile when it has no steps):
    kernel time, communication time, their overlap and the time no kernel runs."""
    spans = [(s.name.removeprefix("ProfilerStep#"), s.ts, s.end) for s in timeline.steps
             if any(s.ts <= k.ts < s.end for k in timeline.kernels)]
    if not spans:
        end = max((e.end for e in timeline.events), default=0.0)
        spans = [("0", 0.0, end)]
    rows = []
    for name, lo, hi in spans:
        compute = _union(_clip(((k.ts, k.end) for k in timeline.kernels
                                if not _COMMUNICATION.search(k.name)), lo, hi))
        comm = _union(_clip(((k.ts, k.end) for k in timeline.kernels
                             if _COMMUNICATION.search(k.name)), lo, hi))
        busy = _length(_union([*compute, *comm]))
        overlapped = _length(compute) + _length(comm) - busy
        first = min((a for a, _ in [*compute, *comm]), default=hi)
        rows.append(StepRow(name, _length(compute), _length(comm) - overlapped, overlapped,
                            _length(comm), hi - lo - busy, hi - lo, 0.0, first - lo))
    return rows


def load_traces(paths: Sequence[Path]) -> list[dict[str, Any]]:
    """Load Kineto traces; an unreadable file raises `ValueError` naming it."""
    traces = []
    for path in paths:
        try:
            traces.append(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as error:
            raise ValueError(f"cannot read the profiler trace {path}: {error}") from error
    return traces
