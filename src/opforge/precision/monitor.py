"""Training anomaly monitor: finds where in a model NaN, Inf, overflow and spikes start.

    with opforge.precision.Monitor(model, log_path="anomalies.jsonl") as mon:
        for batch in data:
            loss = model(batch).sum(); loss.backward(); optimizer.step()
            mon.step()                      # before zero_grad: it reads the gradient norm
            optimizer.zero_grad()
    print(mon.summary())

Forward hooks record statistics of every module's input and output tensors; tensor hooks on
them record their gradients (module full-backward hooks would break in-place operations
downstream). Statistics (max |x| and the L2 norm; with ``detailed=True`` also min, max,
mean, NaN and Inf counts and the shares of values near the float16/bfloat16 overflow and
underflow limits) stay on the device until `Monitor.step`, which moves all of the step's
records to the host in one transfer. Records keep their execution order, so the first
forward record of a step that holds a NaN is where the NaN appeared, and a bad gradient is
traced to the module whose output gradient was clean and whose input gradient is not
(`_origin`): that origin is the module an alert names.

Alert kinds: ``nan``, ``inf`` (float32/64 tensors), ``overflow`` (Inf in a float16/bfloat16
tensor, or values within a factor 2 of its largest finite value), ``spike`` (a tensor's norm
over (1 + spike_threshold) x its running mean), ``grad_norm`` (the parameters' total
gradient norm over (1 + spike_threshold) x its running mean, or over ``grad_norm_limit``),
``loss_scale`` (the loss scale passed to `Monitor.step` fell below ``min_loss_scale``),
and with an ``optimizer``: ``update`` (a parameter's update-to-weight ratio ``|dw| / |w|``
over (1 + spike_threshold) x its running mean, or not finite) and ``optimizer_state`` (NaN
or Inf in a parameter's optimizer state: Adam's moments, a momentum buffer). The
optimizer's step hooks measure them (a copy of each parameter is held across the step for
``dw``); `Monitor.optimizer_stats` keeps the last step's figures per parameter.
Each goes to the callbacks, the JSONL log and `Monitor.alerts`; under torch.distributed it
carries the rank. Hooks never change a value and never raise into the training loop.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("opforge")

# Columns of one statistics record. The first two are all the alert rules need and cost
# one pass over a float32 tensor (a dot product); the others take several passes and are
# computed only with ``detailed=True``.
STATS = ("norm", "max_abs", "min", "max", "mean", "nan", "inf", "near_overflow",
         "near_underflow")
FAST_STATS = 2
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _strict(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with its non-finite floats as strings, for strict JSON."""
    def name(value: float) -> str:
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    return {key: name(value) if isinstance(value, float) and not math.isfinite(value)
            else value for key, value in record.items()}


@dataclass(frozen=True)
class Alert:
    """One anomaly, at the module where it first appeared in a step.

    Attributes:
        kind: ``nan``, ``inf``, ``overflow``, ``spike``, ``grad_norm``, ``loss_scale``,
            ``update`` or ``optimizer_state``.
        module: dotted module path (``""`` for the root model; ``"<parameters>"`` and
            ``"<loss_scale>"`` for the step-level rules).
        phase: ``forward`` or ``backward`` (``step`` for step-level rules).
        io: ``input`` or ``output`` (for backward: the gradient of that tensor).
        step: completed `Monitor.step` calls before the anomaly, from 0.
        rank: the torch.distributed rank, or ``None`` outside a process group.
        value: the statistic that fired (a count, a norm, a scale). In the JSONL log a
            non-finite value is the string ``"NaN"``, ``"Infinity"`` or ``"-Infinity"``
            (strict JSON has no such numbers; Python's ``float()`` reads the strings).
        detail: one line for people.
    """

    kind: str
    module: str
    phase: str
    io: str
    step: int
    rank: int | None
    value: float
    detail: str


def _rank() -> int | None:
    distributed = torch.distributed
    if distributed.is_available() and distributed.is_initialized():
        return distributed.get_rank()
    return None


def _limits(dtype: torch.dtype) -> torch.finfo:
    return torch.finfo(dtype if dtype in _LOW_PRECISION else torch.float16)


def _stat_scalars(tensor: torch.Tensor, detailed: bool) -> list[torch.Tensor]:
    """The `STATS` of ``tensor`` as 0-d tensors on its device, in float32 (float64 for a
    float64 tensor), the first as the sum of squares: its square root is taken on the host
    (`_norm`), which saves a device op per record. For float32/float64 tensors ``max_abs``
    is that same sum (the norm bounds max |x| and is NaN or Inf alike), which saves the
    min/max pass that only the 16-bit overflow rule needs."""
    flat = tensor.detach().reshape(-1)
    wide = flat if flat.dtype in (torch.float32, torch.float64) else flat.float()
    squares = torch.dot(wide, wide)
    if flat.dtype in _LOW_PRECISION:
        lowest, highest = torch.aminmax(flat)
        max_abs = torch.maximum(-lowest, highest).float()
    else:
        max_abs = squares
    if not detailed:
        return [squares, max_abs]
    limits = _limits(tensor.dtype)
    magnitude = wide.abs()
    count = wide.numel()
    return [
        squares, max_abs, wide.amin(), wide.amax(), wide.sum() / count,
        wide.isnan().sum().to(wide.dtype),
        wide.isinf().sum().to(wide.dtype),
        ((magnitude > limits.max / 2) & magnitude.isfinite()).sum().to(wide.dtype) / count,
        ((magnitude > 0) & (magnitude < limits.tiny)).sum().to(wide.dtype) / count,
    ]


def _norm(squares: float) -> float:
    """The L2 norm from the sum of squares read back (NaN stays NaN)."""
    return math.sqrt(squares) if squares >= 0 else squares


def tensor_stats(tensor: torch.Tensor, detailed: bool = False) -> torch.Tensor:
    """The `STATS` of a floating-point ``tensor`` with at least one element, as a vector on
    its device (float32; float64 for a float64 tensor), without a synchronisation: the
    first two, or all nine with ``detailed``.

    ``norm`` is sqrt(x . x), one dot product in float32 (float64 for float64 tensors): NaN
    when the tensor holds a NaN, Inf when it holds an Inf or a finite value whose square
    overflows (|x| > 1.8e19 in float32, 1.3e154 in float64). ``max_abs`` is max |x| for
    float16/bfloat16 tensors, whose overflow rule needs it; for wider dtypes it repeats the
    norm, an upper bound, rather than pay a second pass. With ``detailed``: min, max,
    mean, the NaN and Inf counts, the share of finite values above half the largest finite
    value of the low-precision dtype (the tensor's own, float16 otherwise) and the share of
    nonzero values below its smallest normal.
    """
    squares, max_abs, *rest = _stat_scalars(tensor, detailed)
    norm = squares.sqrt()
    return torch.stack([norm, norm if max_abs is squares else max_abs, *rest])


@dataclass(frozen=True)
class Peak:
    """The largest value a detailed statistic reached over the run, and where.

    ``near_overflow`` is over every record; ``near_underflow`` over the gradients (the
    backward records), where values vanish: the share of a gradient's nonzero values below
    the smallest normal of its low-precision dtype (float16's for float32 tensors: values
    that float16 would make subnormal or zero, the ones loss scaling lifts)."""

    value: float
    module: str
    phase: str
    io: str
    step: int


@dataclass
class _Record:
    module: str
    call: int                   # the module's call number in the step, from 0
    phase: str
    io: str
    index: int                  # the tensor's position among the call's inputs or outputs
    dtype: torch.dtype
    stats: list[torch.Tensor]
    graph: bool = True          # recorded with gradients enabled (not an eval pass)

    @property
    def key(self) -> tuple[str, bool, int, str, str, int]:
        """What the spike history is kept by: one tensor of one call, step after step.
        Calls with and without gradients are counted apart, so an eval pass in a step
        does not shift the training calls' numbers."""
        return (self.module, self.graph, self.call, self.phase, self.io, self.index)


class Pausable:
    """A recorder whose hooks record only while ``_active``: `paused` stops them for a
    block (a validation pass between training steps, which is not a training call)."""

    _active: bool

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Record nothing inside the block; the calls in it do not count."""
        active, self._active = self._active, False
        try:
            yield
        finally:
            self._active = active


class Monitor(Pausable):
    """Context manager that watches a model's activations and gradients (see the module
    docstring).

    Args:
        model: the module to watch (every submodule, the root included).
        modules: only watch modules whose dotted path contains one of these strings.
        spike_threshold: a norm over (1 + threshold) x its running mean is a spike.
        warmup: steps of history before spike and gradient-norm rules apply.
        momentum: weight of the history in the running means.
        grad_norm_limit: an absolute limit on the total gradient norm (``None``: only the
            relative rule applies).
        min_loss_scale: a loss scale passed to `step` below this is a collapse.
        callbacks: called with each `Alert` (their exceptions are logged, not raised).
        log_path: JSONL file that receives each alert.
        detailed: also record min, max and mean, count NaN/Inf values and measure the
            near-overflow/underflow shares of every tensor (several extra passes per
            tensor; without it a NaN, Inf or overflow is still detected, from max |x|);
            the largest shares and where they occurred are kept in `peaks`.
        optimizer: also watch this optimizer's steps: each parameter's update-to-weight
            ratio and the norms of its state tensors (call `step` after
            ``optimizer.step()``).
    """

    def __init__(self, model: torch.nn.Module, *, modules: Sequence[str] | None = None,
                 spike_threshold: float = 9.0, warmup: int = 3, momentum: float = 0.9,
                 grad_norm_limit: float | None = None, min_loss_scale: float = 1.0,
                 callbacks: Iterable[Callable[[Alert], None]] = (),
                 log_path: str | Path | None = None, detailed: bool = False,
                 optimizer: torch.optim.Optimizer | None = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.optimizer_stats: dict[str, dict[str, float]] = {}
        # (parameter name, statistic name, device scalar) of the optimizer step, and the
        # parameters' values before it.
        self._optimizer_records: list[tuple[str, str, torch.Tensor]] = []
        self._before: dict[int, torch.Tensor] = {}
        self.modules = tuple(modules) if modules else None
        self.spike_threshold = spike_threshold
        self.warmup = warmup
        self.momentum = momentum
        self.grad_norm_limit = grad_norm_limit
        self.min_loss_scale = min_loss_scale
        self.callbacks = list(callbacks)
        self.log_path = Path(log_path) if log_path else None
        self.detailed = detailed
        self.alerts: list[Alert] = []
        self.steps = 0
        self.rank = _rank()
        self._records: list[_Record] = []
        # The tensors recorded this step (weakly, with their version and statistics): a
        # module's input is usually the previous module's output, and one reduction per
        # tensor is enough; the second record shares the first one's statistics.
        self._recorded: dict[int, tuple[weakref.ref[torch.Tensor], int, torch.Tensor]] = {}
        self._handles: list[Any] = []
        self._calls: dict[tuple[str, bool], int] = {}
        self._means: dict[tuple[str, int, str, str, int], float] = {}
        self._seen: dict[tuple[str, int, str, str, int], int] = {}
        self._grad_norm_mean: float | None = None
        self.peaks: dict[str, Peak] = {}
        self._active = False
        self._failed = False

    # -- hooks ---------------------------------------------------------------------------

    def __enter__(self) -> Monitor:
        self._handles = hook_modules(self.model, self.modules, self._forward_hook)
        if self.optimizer is not None:
            self._handles += [self.optimizer.register_step_pre_hook(self._before_update),
                              self.optimizer.register_step_post_hook(self._after_update)]
        self._active = True
        return self

    def _watched_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        names = {id(p): name for name, p in self.model.named_parameters()}
        for group in self.optimizer.param_groups:
            for parameter in group["params"]:
                if parameter.grad is not None and id(parameter) in names:
                    yield names[id(parameter)], parameter

    def _before_update(self, optimizer: object, args: object, kwargs: object) -> None:
        def body() -> None:
            self._before = {id(p): p.detach().clone() for _, p in self._watched_parameters()}
        self._guarded(body)

    def _after_update(self, optimizer: object, args: object, kwargs: object) -> None:
        def body() -> None:
            for name, parameter in self._watched_parameters():
                before = self._before.pop(id(parameter), None)
                weight = parameter.detach()
                if before is not None:
                    ratio = torch.linalg.vector_norm((weight - before).float()) / \
                        torch.linalg.vector_norm(before.float()).clamp_min(1e-30)
                    self._optimizer_records.append((name, "update_ratio", ratio))
                for state_name, value in self.optimizer.state.get(parameter, {}).items():
                    if isinstance(value, torch.Tensor) and value.is_floating_point() \
                            and value.shape == parameter.shape:
                        self._optimizer_records.append(
                            (name, f"{state_name}_norm", torch.linalg.vector_norm(
                                value.detach(), dtype=torch.float32)))
            self._before.clear()
        self._guarded(body)

    def __exit__(self, *exc: object) -> None:
        try:
            if self._records:
                self._analyze()
        finally:
            self._active = False
            for handle in self._handles:
                handle.remove()
            self._handles.clear()

    def _guarded(self, body: Callable[[], None]) -> None:
        # A monitor must never break training: the first failure is logged and the
        # monitor stops recording.
        if not self._active or self._failed:
            return
        try:
            body()
        except Exception:  # reported once, never raised into the loop
            self._failed = True
            logger.exception("opforge monitor: recording failed; monitoring stops")

    def _record(self, module: str, call: int, phase: str, io: str, index: int,
                tensor: torch.Tensor, graph: bool = True) -> None:
        if not tensor.is_floating_point() or not tensor.numel():
            return
        # Inference tensors (made under torch.inference_mode) have no version counter, so
        # nothing tells whether they changed in place since: measure them every time.
        version = None if tensor.is_inference() else tensor._version
        seen = self._recorded.get(id(tensor))
        if (version is not None and seen is not None and seen[0]() is tensor
                and seen[1] == version):
            stats = seen[2]
        else:
            stats = _stat_scalars(tensor, self.detailed)
            if version is not None:
                self._recorded[id(tensor)] = (weakref.ref(tensor), version, stats)
        self._records.append(_Record(module, call, phase, io, index, tensor.dtype, stats,
                                     graph))

    def _forward_hook(self, name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
            def body() -> None:
                graph = torch.is_grad_enabled()
                call = self._calls.get((name, graph), 0)
                self._calls[name, graph] = call + 1
                # A forward hook that fires during a backward pass is an activation
                # checkpoint's recomputation: its values were recorded by the forward it
                # repeats. Its gradient hooks are still needed: a reentrant checkpoint
                # backpropagates through the recomputed graph.
                recomputed = torch._C._current_graph_task_id() != -1
                for io, values in (("input", inputs), ("output", output)):
                    for index, tensor in enumerate(_tensors(values)):
                        if not recomputed:
                            self._record(name, call, "forward", io, index, tensor, graph)
                        self._watch_grad(name, call, io, index, tensor)
            self._guarded(body)
        return hook

    def _watch_grad(self, name: str, call: int, io: str, index: int,
                    tensor: torch.Tensor) -> None:
        # The gradients of both inputs and outputs are recorded: a module whose output
        # gradient is finite and whose input gradient is not made the bad value itself
        # (see `_origin`).
        if tensor.requires_grad:
            def hook(grad: torch.Tensor) -> None:
                self._guarded(lambda: self._record(name, call, "backward", io, index, grad))
            tensor.register_hook(hook)

    # -- steps and rules -----------------------------------------------------------------

    def step(self, loss_scale: float | None = None) -> list[Alert]:
        """Close a training step: move its statistics to the host (one transfer), apply
        the alert rules, and return the step's alerts."""
        before = len(self.alerts)
        try:
            self._analyze(loss_scale)
        except Exception:  # never raised into the training loop
            logger.exception("opforge monitor: analysis failed for step %d", self.steps)
        self.steps += 1
        return self.alerts[before:]

    def _grad_norm(self) -> torch.Tensor | None:
        grads = [p.grad.detach() for p in self.model.parameters() if p.grad is not None]
        if not grads:
            return None
        # Accumulated in float32 at least: a float16 norm overflows at 65504 although every
        # gradient is finite, and loss-scaled float16 gradients get there at once.
        norms = [torch.linalg.vector_norm(g, dtype=torch.promote_types(g.dtype, torch.float32))
                 for g in grads]
        return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))

    def _analyze(self, loss_scale: float | None = None) -> None:
        records, self._records = self._records, []
        optimizer_records, self._optimizer_records = self._optimizer_records, []
        self._recorded.clear()
        self._calls.clear()
        grad_norm = self._grad_norm()
        rows: list[list[float]] = []
        norm_value: float | None = None
        optimizer_values: list[float] = []
        if records or grad_norm is not None or optimizer_records:
            # A model split over devices has statistics on each: gather them on one.
            stats = [s for r in records for s in r.stats]
            stats += [value for _, _, value in optimizer_records]
            if grad_norm is not None:
                stats.append(grad_norm)
            device = stats[0].device
            # The step's only host synchronisation: every record, the optimizer's figures
            # and the gradient norm.
            flat = torch.stack([s.to(device, torch.float64) for s in stats]).cpu().tolist()
            width = len(STATS) if self.detailed else FAST_STATS
            rows = [flat[i * width:(i + 1) * width] for i in range(len(records))]
            for row, record in zip(rows, records):
                row[0] = _norm(row[0])
                if record.stats[1] is record.stats[0]:
                    row[1] = row[0]
            start = len(records) * width
            optimizer_values = flat[start:start + len(optimizer_records)]
            norm_value = flat[-1] if grad_norm is not None else None
        self._anomalies(records, rows)
        if optimizer_records:
            self._optimizer_rules(optimizer_records, optimizer_values)
        if norm_value is not None:
            self._grad_norm_rule(norm_value)
        if loss_scale is not None and loss_scale < self.min_loss_scale:
            self._emit(Alert("loss_scale", "<loss_scale>", "step", "-", self.steps, self.rank,
                             float(loss_scale), f"loss scale {loss_scale:g} fell below "
                             f"{self.min_loss_scale:g}"))

    def _anomalies(self, records: list[_Record], rows: list[list[float]]) -> None:
        stat = {name: i for i, name in enumerate(STATS)}
        kinds = [_kind(record, row) for record, row in zip(records, rows)]
        for kind in dict.fromkeys(k for k in kinds if k is not None):
            origin = _origin(records, [k == kind for k in kinds])
            record, row = records[origin], rows[origin]
            if kind == "overflow":
                value = row[stat["max_abs"]]
                if self.detailed and math.isinf(value):
                    value = row[stat["inf"]]
            else:
                value = row[stat[kind]] if self.detailed else 1.0
            what = {"nan": "NaN values", "inf": "Inf values",
                    "overflow": f"values at the {record.dtype} overflow limit"}[kind]
            self._emit(Alert(kind, record.module, record.phase, record.io, self.steps,
                             self.rank, float(value),
                             f"first {what} in the {record.phase} {record.io} of "
                             f"{record.module or '<model>'}"))
        spike: tuple[_Record, float, float] | None = None
        for record, row in zip(records, rows):
            if self.detailed:
                self._track_peaks(record, row, stat)
            norm, mean = row[stat["norm"]], self._means.get(record.key)
            if (spike is None and mean is not None
                    and self._seen.get(record.key, 0) >= self.warmup
                    and math.isfinite(norm) and norm > (1 + self.spike_threshold) * mean):
                spike = (record, norm, mean)
            if math.isfinite(norm):
                self._means[record.key] = norm if mean is None else (
                    self.momentum * mean + (1 - self.momentum) * norm)
        # Warm-up counts steps: a key seen twice in one step (a second backward) is one.
        for key in {r.key for r, row in zip(records, rows) if math.isfinite(row[stat["norm"]])}:
            self._seen[key] = self._seen.get(key, 0) + 1
        if spike is not None:
            record, norm, mean = spike
            self._emit(Alert("spike", record.module, record.phase, record.io, self.steps,
                             self.rank, norm, f"norm {norm:.4g} is over "
                             f"{1 + self.spike_threshold:g}x its running mean {mean:.4g}"))

    def _optimizer_rules(self, records: list[tuple[str, str, torch.Tensor]],
                         values: list[float]) -> None:
        """The step's figures into `optimizer_stats`; the first non-finite state and the
        first update ratio that spikes (after the warm-up) or is not finite, alerted."""
        self.optimizer_stats = {}
        state_alert = update_alert = None
        for (name, statistic, _), value in zip(records, values, strict=True):
            self.optimizer_stats.setdefault(name, {})[statistic] = value
            if statistic != "update_ratio":
                if state_alert is None and not math.isfinite(value):
                    state_alert = Alert("optimizer_state", name, "step", statistic,
                                        self.steps, self.rank, value,
                                        f"{statistic.removesuffix('_norm')} of {name} holds "
                                        f"{'NaN' if math.isnan(value) else 'Inf'}")
                continue
            key = (name, 0, "step", "update", 0)
            mean = self._means.get(key)
            if update_alert is None and (not math.isfinite(value) or (
                    mean is not None and self._seen.get(key, 0) >= self.warmup
                    and value > (1 + self.spike_threshold) * mean)):
                update_alert = Alert("update", name, "step", "update", self.steps, self.rank,
                                     value, f"update-to-weight ratio {value:.4g} of {name} ("
                                     + (f"running mean {mean:.4g})" if mean is not None
                                        else "no history yet)"))
            if math.isfinite(value):
                self._means[key] = value if mean is None else (
                    self.momentum * mean + (1 - self.momentum) * value)
                self._seen[key] = self._seen.get(key, 0) + 1
        for alert in (state_alert, update_alert):
            if alert is not None:
                self._emit(alert)

    def _track_peaks(self, record: _Record, row: list[float], stat: dict[str, int]) -> None:
        for name in ("near_overflow", "near_underflow"):
            if name == "near_underflow" and record.phase != "backward":
                continue
            value = row[stat[name]]
            best = self.peaks.get(name)
            if math.isfinite(value) and (best is None or value > best.value):
                self.peaks[name] = Peak(value, record.module, record.phase, record.io,
                                        self.steps)

    def _grad_norm_rule(self, norm: float) -> None:
        mean = self._grad_norm_mean
        over_limit = self.grad_norm_limit is not None and norm > self.grad_norm_limit
        exploded = (mean is not None and self.steps >= self.warmup
                    and norm > (1 + self.spike_threshold) * mean)
        if over_limit or exploded or not math.isfinite(norm):
            reference = self.grad_norm_limit if over_limit else mean
            self._emit(Alert("grad_norm", "<parameters>", "step", "-", self.steps, self.rank,
                             norm, f"total gradient norm {norm:.4g} (" + (
                                 f"reference {reference:.4g})" if reference is not None
                                 else "no history yet)")))
        if math.isfinite(norm):
            self._grad_norm_mean = norm if mean is None else (
                self.momentum * mean + (1 - self.momentum) * norm)

    def _emit(self, alert: Alert) -> None:
        self.alerts.append(alert)
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with self.log_path.open("a") as log:
                log.write(json.dumps(_strict(asdict(alert)), allow_nan=False) + "\n")
        for callback in self.callbacks:
            try:
                callback(alert)
            except Exception:  # a user callback must not stop training
                logger.exception("opforge monitor: alert callback failed")

    def summary(self) -> str:
        """A table of the alerts: kind, step, module, phase, io, value, detail."""
        if not self.alerts:
            return f"opforge monitor: no anomalies in {self.steps} steps"
        header = "| kind | step | rank | module | phase | io | value | detail |"
        lines = [header, "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {a.kind} | {a.step} | {a.rank if a.rank is not None else '-'} | "
                  f"{a.module or '<model>'} | {a.phase} | {a.io} | {a.value:.4g} | {a.detail} |"
                  for a in self.alerts]
        return "\n".join(lines)


def _kind(record: _Record, row: list[float]) -> str | None:
    """The NaN/Inf/overflow rule a record breaks, if any (NaN first)."""
    max_abs = row[STATS.index("max_abs")]
    if math.isnan(max_abs):
        return "nan"
    if record.dtype in _LOW_PRECISION:
        limit = _limits(record.dtype).max / 2
        return "overflow" if math.isinf(max_abs) or max_abs > limit else None
    return "inf" if math.isinf(max_abs) else None


def _origin(records: Sequence[_Record], hit: Sequence[bool]) -> int:
    """Index of the record that names where a kind of anomaly (``hit``, one flag per record,
    at least one set) started in a step.

    Records are in execution order, so a forward anomaly starts at its first record. In
    the backward the first bad gradient may be the output gradient of a module that only
    received it: the bad value was made by the module that consumed that output. The
    origin is therefore the module call whose recorded output gradients are all clean and
    one of whose input gradients is bad, the first such input gradient in backward order
    (an inner module's input gradient precedes its parent's, so the innermost one). When
    no call qualifies, the gradient was bad when it reached the model (the loss's): the
    origin is the outermost module among the records of the first bad gradient tensor.
    """
    hits = [i for i, flag in enumerate(hit) if flag]
    if records[hits[0]].phase != "backward":
        return hits[0]
    backward = [i for i in hits if records[i].phase == "backward"]
    tainted = {(records[i].module, records[i].call) for i in backward
               if records[i].io == "output"}
    first = records[backward[0]]
    outermost = min((i for i in backward if records[i].stats is first.stats),
                    key=lambda i: records[i].module.count(".") + bool(records[i].module))
    return next((i for i in backward if records[i].io == "input"
                 and (records[i].module, records[i].call) not in tainted), outermost)


def hook_modules(model: torch.nn.Module, filters: Sequence[str] | None,
                 make_hook: Callable[[str], Callable[..., None]]) -> list[Any]:
    """Register ``make_hook(path)`` as the forward hook of every submodule of ``model``
    (the root included) whose dotted path contains one of ``filters`` (all when ``None``);
    returns the handles."""
    return [module.register_forward_hook(make_hook(name))
            for name, module in model.named_modules()
            if filters is None or any(part in name for part in filters)]


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    return []
