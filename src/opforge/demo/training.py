"""One training run of the tiny MoE language model, with opforge's tools around it.

`train` builds the model of ``examples/tiny_moe_lm`` from a seed, trains it with AdamW in
the run's precision and records what the report and the precision study need: the loss of
every step, the validation loss at intervals, the loss scale, the anomaly monitor's
alerts, optionally a profile of a few steps and statistics dumps of chosen steps.

Precision settings (`RunConfig`): ``float32`` runs without autocast; ``bfloat16`` and
``float16`` run the forward pass under ``torch.autocast`` (float32 master weights, each
opforge operator's autocast policy: matmuls in the low dtype, norms and softmax statistics
in float32); ``loss_scaling`` adds dynamic loss scaling (``torch.amp.GradScaler``: the
loss is multiplied by a scale that halves on Inf/NaN gradients, whose step is then
skipped, and doubles after 2000 clean steps).
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from opforge.precision.dump import dump
from opforge.precision.monitor import Alert, Monitor, Peak

EXAMPLE_ENV = "OPFORGE_EXAMPLE_DIR"
MODEL_SIZES = ("dim", "layers", "heads", "hidden", "experts", "k")


def example_dir() -> Path:
    """``examples/tiny_moe_lm`` of the repository (or ``$OPFORGE_EXAMPLE_DIR``).

    Raises:
        FileNotFoundError: the example is not there (an installed package without its
            repository).
    """
    root = Path(os.environ.get(EXAMPLE_ENV) or
                Path(__file__).resolve().parents[3] / "examples" / "tiny_moe_lm")
    if not (root / "model.py").exists():
        raise FileNotFoundError(f"the tiny MoE language model is not at {root}: the demo "
                                f"needs the repository's examples/ (install opforge from a "
                                f"clone with pip install -e, or set "
                                f"{EXAMPLE_ENV}=<clone>/examples/tiny_moe_lm)")
    return root


def load_example() -> ModuleType:
    """The example's ``model.py`` as a module (``tiny_moe_lm_model``)."""
    name = "tiny_moe_lm_model"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, example_dir() / "model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class RunConfig:
    """What one run trains and how.

    Attributes:
        name: the run's label in reports.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"`` (the autocast dtype).
        loss_scaling: dynamic loss scaling.
        naive_softmax: the model's softmaxes without the max subtracted.
        steps, batch, seq, lr, seed: the training budget and data.
        model: `TinyMoELM` keyword arguments (dim, layers, heads, hidden, experts, k).
        eval_every: steps between validation losses.
    """

    name: str = "float32"
    dtype: str = "float32"
    loss_scaling: bool = False
    naive_softmax: bool = False
    steps: int = 400
    batch: int = 32
    seq: int = 64
    lr: float = 3e-3
    seed: int = 0
    model: dict[str, int] = field(default_factory=dict)
    eval_every: int = 50


@dataclass
class RunResult:
    """What a run measured."""

    config: RunConfig
    device: str
    losses: list[float]
    val_losses: list[tuple[int, float]]
    loss_scales: list[float]
    skipped_steps: int
    alerts: list[Alert]
    monitor_summary: str
    seconds: float
    tokens_per_second: float
    expert_load: list[list[int]]
    sample: str = ""
    profile: Any = None
    parameters: int = 0
    vocab: int = 0
    peaks: dict[str, Peak] = field(default_factory=dict)

    @property
    def first_nonfinite(self) -> int | None:
        """The first step whose loss was NaN or Inf (``None``: none)."""
        return next((i for i, v in enumerate(self.losses) if not math.isfinite(v)), None)

    @property
    def final_loss(self) -> float:
        """Mean training loss of the last 10% of the steps (at least one)."""
        tail = self.losses[-max(1, len(self.losses) // 10):]
        return sum(tail) / len(tail)


def resolve_device(device: torch.device | str | None) -> torch.device:
    """``device``, or CUDA when it is available, else the CPU."""
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def _autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager[Any]:
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


@torch.no_grad()
def _validation_loss(model: Any, data: Any, config: RunConfig, device: torch.device,
                     dtype: torch.dtype, batches: int = 4) -> float:
    generator = torch.Generator().manual_seed(config.seed + 1)
    model.eval()
    total = 0.0
    for _ in range(batches):
        inputs, targets = data.batch(config.batch, generator, "val", device)
        with _autocast(device, dtype):
            total += float(model.loss(model(inputs), targets))
    model.train()
    return total / batches


def train(config: RunConfig, *, device: torch.device | str | None = None,
          monitor_log: Path | None = None, profile_dir: Path | None = None,
          profile_steps: tuple[int, int] = (10, 3), dump_dir: Path | None = None,
          dump_steps: Sequence[int] = (), sample_chars: int = 0, detailed_monitor: bool = False,
          on_step: Callable[[int, float], None] | None = None) -> RunResult:
    """Train the tiny MoE language model once.

    Raises:
        ValueError: ``config.model`` names a size outside `MODEL_SIZES`.

    Args:
        config: the run.
        device: where it trains (the Triton backend on a GPU, the torch backend on the CPU);
            default: CUDA when available, else the CPU.
        monitor_log: JSONL file for the monitor's alerts.
        profile_dir: profile ``profile_steps = (first, count)`` steps into this directory.
        dump_dir: statistics dumps of the steps in ``dump_steps`` (for `opforge compare`).
        sample_chars: characters of text to generate after training (0: none).
        detailed_monitor: the monitor's detailed statistics (their peaks: `Monitor.peaks`).
        on_step: called with (step, loss) after each step (a progress bar).
    """
    from opforge.profiler import profile

    unknown = sorted(set(config.model) - set(MODEL_SIZES))
    if unknown:
        raise ValueError(f"unknown model size(s) {', '.join(unknown)}; the model takes "
                         f"{', '.join(MODEL_SIZES)}")
    example = load_example()
    device = resolve_device(device)
    dtype = getattr(torch, config.dtype)
    torch.manual_seed(config.seed)
    data = example.CharData(example.TEXT, config.seq)
    model = example.TinyMoELM(data.vocab, max_seq=config.seq,
                              naive_softmax=config.naive_softmax, **config.model).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    scaler = torch.amp.GradScaler(device.type, enabled=config.loss_scaling)
    generator = torch.Generator().manual_seed(config.seed)
    losses: list[float] = []
    scales: list[float] = []
    val: list[tuple[int, float]] = []
    # The steps the optimizer took (a loss-scaled step with Inf/NaN gradients is skipped;
    # counting the scale's decreases misses the skips once the scale has reached 0).
    taken = [0]
    optimizer.register_step_post_hook(lambda *args: taken.__setitem__(0, taken[0] + 1))
    load = None
    with contextlib.ExitStack() as stack:
        monitor = stack.enter_context(Monitor(model, log_path=monitor_log,
                                              detailed=detailed_monitor))
        prof = None
        if profile_dir is not None:
            first, count = profile_steps
            prof = stack.enter_context(profile(
                profile_dir, schedule=torch.profiler.schedule(
                    wait=max(0, first - 1), warmup=min(1, first), active=count, repeat=1)))
        # A loss-scaled run's gradients are dumped unscaled, to compare with float32's.
        dumper = (stack.enter_context(dump(
            model, dump_dir, steps=list(dump_steps),
            grad_scale=scaler.get_scale if config.loss_scaling else None))
            if dump_dir is not None else None)
        start = time.perf_counter()
        for step in range(config.steps):
            inputs, targets = data.batch(config.batch, generator, "train", device)
            with _autocast(device, dtype):
                loss = model.loss(model(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scale = scaler.get_scale() if config.loss_scaling else 1.0
            monitor.step(loss_scale=scale if config.loss_scaling else None)
            scaler.step(optimizer)
            scaler.update()
            value = float(loss.detach())
            losses.append(value)
            scales.append(scale)
            if prof is not None:
                prof.step()
            if dumper is not None:
                dumper.step()
            if step + 1 == config.steps:
                load = model.expert_load()  # the last training step's, before validation
            if (step + 1) % config.eval_every == 0 or step + 1 == config.steps:
                # Validation is not a training call: the monitor and the dump skip it.
                with monitor.paused(), (dumper.paused() if dumper is not None
                                        else contextlib.nullcontext()):
                    val.append((step + 1, _validation_loss(model, data, config, device,
                                                           dtype)))
            if on_step is not None:
                on_step(step, value)
        seconds = time.perf_counter() - start
    skipped = config.steps - taken[0]
    sample = ""
    if sample_chars:
        model.eval()
        prompt = data.encode("And God said")
        ids = model.generate(prompt.to(device), sample_chars,
                             torch.Generator().manual_seed(config.seed))
        sample = data.decode(ids.cpu())
    return RunResult(config, str(device), losses, val, scales, skipped, list(monitor.alerts),
                     monitor.summary(), seconds,
                     config.steps * config.batch * config.seq / max(seconds, 1e-9),
                     load, sample, prof.result if prof is not None else None,
                     sum(p.numel() for p in model.parameters()), data.vocab,
                     dict(monitor.peaks))
