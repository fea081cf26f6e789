"""Training anomaly monitor: finds where in a model NaN, Inf, overflow and spikes start.

    with opforge.precision.Monitor(model, log_path="anomalies.jsonl") as mon:
        for batch in data:
            loss = model(batch).sum(); loss.backward(); optimizer.step()
            mon.step()                      # before zero_grad: it reads the gradient norm
            optimizer.zero_grad()
    print(mon.summary())

Forward hooks record statistics of every module's input and output tensors; tensor hooks on
the inputs record the gradients each module's backward produces (module full-backward hooks
would break in-place operations downstream). Statistics (min, max, mean, L2 norm, NaN and
Inf counts, shares of values near the float16/bfloat16 overflow and underflow limits) stay
on the device until `Monitor.step`, which moves all of the step's records to the host in
one transfer. Records keep their execution order, so the first record of a step that holds
a NaN is where the NaN appeared — the origin — and that is the module an alert names.

Alert kinds: ``nan``, ``inf`` (float32/64 tensors), ``overflow`` (Inf in a float16/bfloat16
tensor, or values within a factor 2 of its largest finite value), ``spike`` (a tensor's norm
over (1 + spike_threshold) x its running mean), ``grad_norm`` (the parameters' total
gradient norm over (1 + spike_threshold) x its running mean, or over ``grad_norm_limit``),
``loss_scale`` (the loss scale passed to `Monitor.step` fell below ``min_loss_scale``).
Each goes to the callbacks, the JSONL log and `Monitor.alerts`; under torch.distributed it
carries the rank. Hooks never change a value and never raise into the training loop.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("opforge")

# Columns of one statistics record.
STATS = ("min", "max", "mean", "norm", "nan", "inf", "near_overflow", "near_underflow")
_LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Alert:
    """One anomaly, at the module where it first appeared in a step.

    Attributes:
        kind: ``nan``, ``inf``, ``overflow``, ``spike``, ``grad_norm`` or ``loss_scale``.
        module: dotted module path (``""`` for the root model; ``"<parameters>"`` and
            ``"<loss_scale>"`` for the step-level rules).
        phase: ``forward`` or ``backward`` (``step`` for step-level rules).
        io: ``input`` or ``output`` (for backward: the gradient of that tensor).
        step: completed `Monitor.step` calls before the anomaly, from 0.
        rank: the torch.distributed rank, or ``None`` outside a process group.
        value: the statistic that fired (a count, a norm, a scale).
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


def tensor_stats(tensor: torch.Tensor) -> torch.Tensor:
    """The `STATS` of ``tensor`` as a float32 vector on its device (no synchronisation).

    min/max/mean/norm are over the finite values; the near-overflow share counts finite
    values above half the largest finite value of the low-precision dtype (the tensor's
    own, float16 otherwise), the near-underflow share nonzero values below its smallest
    normal value.
    """
    values = tensor.detach()
    values = values.float() if values.is_floating_point() else values.to(torch.float32)
    limits = torch.finfo(tensor.dtype if tensor.dtype in _LOW_PRECISION else torch.float16)
    finite = values.isfinite()
    count = max(values.numel(), 1)
    clean = torch.where(finite, values, torch.zeros((), device=values.device))
    magnitude = clean.abs()
    big = torch.finfo(torch.float32).max
    lowest = torch.where(finite, values, torch.full((), big, device=values.device)).min() \
        if values.numel() else torch.zeros((), device=values.device)
    highest = torch.where(finite, values, torch.full((), -big, device=values.device)).max() \
        if values.numel() else torch.zeros((), device=values.device)
    return torch.stack([
        lowest,
        highest,
        clean.sum() / count,
        clean.norm(),
        values.isnan().sum().float(),
        values.isinf().sum().float(),
        (magnitude > limits.max / 2).sum().float() / count,
        ((magnitude > 0) & (magnitude < limits.tiny)).sum().float() / count,
    ])


@dataclass
class _Record:
    module: str
    phase: str
    io: str
    dtype: torch.dtype
    stats: torch.Tensor


class Monitor:
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
    """

    def __init__(self, model: torch.nn.Module, *, modules: Sequence[str] | None = None,
                 spike_threshold: float = 9.0, warmup: int = 3, momentum: float = 0.9,
                 grad_norm_limit: float | None = None, min_loss_scale: float = 1.0,
                 callbacks: Iterable[Callable[[Alert], None]] = (),
                 log_path: str | Path | None = None) -> None:
        self.model = model
        self.modules = tuple(modules) if modules else None
        self.spike_threshold = spike_threshold
        self.warmup = warmup
        self.momentum = momentum
        self.grad_norm_limit = grad_norm_limit
        self.min_loss_scale = min_loss_scale
        self.callbacks = list(callbacks)
        self.log_path = Path(log_path) if log_path else None
        self.alerts: list[Alert] = []
        self.steps = 0
        self.rank = _rank()
        self._records: list[_Record] = []
        self._handles: list[Any] = []
        self._means: dict[tuple[str, str, str], float] = {}
        self._seen: dict[tuple[str, str, str], int] = {}
        self._grad_norm_mean: float | None = None
        self._active = False
        self._failed = False

    # -- hooks ---------------------------------------------------------------------------

    def __enter__(self) -> Monitor:
        for name, module in self.model.named_modules():
            if self.modules is None or any(part in name for part in self.modules):
                self._handles.append(module.register_forward_hook(self._forward_hook(name)))
        self._active = True
        return self

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

    def _record(self, module: str, phase: str, io: str, tensor: torch.Tensor) -> None:
        if tensor.is_floating_point() and tensor.numel():
            self._records.append(_Record(module, phase, io, tensor.dtype, tensor_stats(tensor)))

    def _forward_hook(self, name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
            def body() -> None:
                for tensor in _tensors(inputs):
                    self._record(name, "forward", "input", tensor)
                    self._watch_grad(name, "input", tensor)
                for tensor in _tensors(output):
                    self._record(name, "forward", "output", tensor)
                    # The gradient of an output is the gradient of the next module's input,
                    # produced by that module's backward: only the model's own output
                    # gradient (the loss's) is recorded here.
                    if module is self.model:
                        self._watch_grad(name, "output", tensor)
            self._guarded(body)
        return hook

    def _watch_grad(self, name: str, io: str, tensor: torch.Tensor) -> None:
        if tensor.requires_grad:
            def hook(grad: torch.Tensor) -> None:
                self._guarded(lambda: self._record(name, "backward", io, grad))
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
        grads = [p.grad.detach().float().norm() for p in self.model.parameters()
                 if p.grad is not None]
        return torch.stack(grads).norm() if grads else None

    def _analyze(self, loss_scale: float | None = None) -> None:
        records, self._records = self._records, []
        grad_norm = self._grad_norm()
        rows: list[list[float]] = []
        norm_value: float | None = None
        if records or grad_norm is not None:
            parts = [torch.stack([r.stats for r in records]).reshape(-1)] if records else []
            if grad_norm is not None:
                parts.append(grad_norm.reshape(1).to(parts[0].device if parts else
                                                     grad_norm.device))
            # The step's only host synchronisation: every record and the gradient norm.
            flat = torch.cat(parts).cpu().tolist()
            width = len(STATS)
            rows = [flat[i * width:(i + 1) * width] for i in range(len(records))]
            norm_value = flat[-1] if grad_norm is not None else None
        self._anomalies(records, rows)
        if norm_value is not None:
            self._grad_norm_rule(norm_value)
        if loss_scale is not None and loss_scale < self.min_loss_scale:
            self._emit(Alert("loss_scale", "<loss_scale>", "step", "-", self.steps, self.rank,
                             float(loss_scale), f"loss scale {loss_scale:g} fell below "
                             f"{self.min_loss_scale:g}"))

    def _anomalies(self, records: list[_Record], rows: list[list[float]]) -> None:
        stat = {name: i for i, name in enumerate(STATS)}
        first: dict[str, tuple[_Record, float]] = {}
        spike: tuple[_Record, float, float] | None = None
        for record, row in zip(records, rows):
            low = record.dtype in _LOW_PRECISION
            if row[stat["nan"]]:
                first.setdefault("nan", (record, row[stat["nan"]]))
            if row[stat["inf"]]:
                first.setdefault("overflow" if low else "inf", (record, row[stat["inf"]]))
            elif low and row[stat["near_overflow"]]:
                first.setdefault("overflow", (record, row[stat["near_overflow"]]))
            key = (record.module, record.phase, record.io)
            norm = row[stat["norm"]]
            mean = self._means.get(key)
            seen = self._seen.get(key, 0)
            if (spike is None and mean is not None and seen >= self.warmup
                    and math.isfinite(norm) and norm > (1 + self.spike_threshold) * mean):
                spike = (record, norm, mean)
            if math.isfinite(norm):
                self._means[key] = norm if mean is None else (
                    self.momentum * mean + (1 - self.momentum) * norm)
                self._seen[key] = seen + 1
        for kind, (record, count) in first.items():
            what = {"nan": "NaN values", "inf": "Inf values",
                    "overflow": f"values at the {record.dtype} overflow limit"}[kind]
            self._emit(Alert(kind, record.module, record.phase, record.io, self.steps,
                             self.rank, float(count),
                             f"first {what} in the {record.phase} {record.io} of "
                             f"{record.module or '<model>'}"))
        if spike is not None:
            record, norm, mean = spike
            self._emit(Alert("spike", record.module, record.phase, record.io, self.steps,
                             self.rank, norm, f"norm {norm:.4g} is over "
                             f"{1 + self.spike_threshold:g}x its running mean {mean:.4g}"))

    def _grad_norm_rule(self, norm: float) -> None:
        mean = self._grad_norm_mean
        over_limit = self.grad_norm_limit is not None and norm > self.grad_norm_limit
        exploded = (mean is not None and self.steps >= self.warmup
                    and norm > (1 + self.spike_threshold) * mean)
        if over_limit or exploded or not math.isfinite(norm):
            reference = self.grad_norm_limit if over_limit else mean
            self._emit(Alert("grad_norm", "<parameters>", "step", "-", self.steps, self.rank,
                             norm, f"total gradient norm {norm:.4g} (reference "
                             f"{reference if reference is not None else float('nan'):.4g})"))
        if math.isfinite(norm):
            self._grad_norm_mean = norm if mean is None else (
                self.momentum * mean + (1 - self.momentum) * norm)

    def _emit(self, alert: Alert) -> None:
        self.alerts.append(alert)
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with self.log_path.open("a") as log:
                log.write(json.dumps(asdict(alert)) + "\n")
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


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    return []
