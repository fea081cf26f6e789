"""The precision study: one model and seed, trained in five precision settings.

Runs (`STUDY_RUNS`): float32 (the reference), bfloat16, float16 with dynamic loss scaling,
float16 without it, and float16 with loss scaling whose softmaxes are the naive formula
(no max subtracted). Every run uses the same initial weights and the same batches; each
dumps the statistics of every module's activations and gradients at fixed steps. The
study reports the loss curves, where each run first leaves float32 (the first dumped step
at which an entry is out of the run-compare tolerance of its dtype, and that entry, as
``opforge compare`` finds it), the monitor's alerts, and the loss scale's history.
Every statement of the written findings is computed from these measurements.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from opforge.demo.report import plot_losses
from opforge.demo.training import RunConfig, RunResult, resolve_device, train
from opforge.precision.dump import (
    DumpError,
    compare_steps,
    first_divergence,
    growth_point,
    read_step,
)

STUDY_RUNS = (
    RunConfig("float32", "float32"),
    RunConfig("bfloat16", "bfloat16"),
    RunConfig("float16 + loss scaling", "float16", loss_scaling=True),
    RunConfig("float16, no loss scaling", "float16"),
    RunConfig("float16 + loss scaling, naive softmax", "float16", loss_scaling=True,
              naive_softmax=True),
)


@dataclass
class Divergence:
    """Where a run first left the reference, among the dumped steps."""

    step: int | None
    entry: str = ""
    growth_entry: str = ""
    cosine: float = 1.0
    norm_error: float = 0.0
    compared_steps: int = 0
    error: str = ""


@dataclass
class StudyResult:
    """The runs, where each left float32, the dumped steps, the Markdown and the files."""

    runs: list[RunResult]
    divergences: dict[str, Divergence]
    dump_steps: list[int]
    markdown: str
    files: list[Path]


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def divergence(reference: Path, run: Path, steps: Sequence[int],
               tolerance: torch.dtype | None = None) -> Divergence:
    """The first of ``steps`` at which the dump of ``run`` diverges from ``reference``,
    each entry judged with at least ``tolerance``'s tolerance (the run's compute dtype)."""
    compared = 0
    for step in steps:
        try:
            results = compare_steps(read_step(reference / "rank0" / f"step{step}"),
                                    read_step(run / "rank0" / f"step{step}"), tolerance)
        except DumpError as error:
            return Divergence(None, compared_steps=compared, error=str(error))
        compared += 1
        first = first_divergence(results)
        if first is not None:
            growth = growth_point(results)
            return Divergence(step, results[first].key,
                              results[growth].key if growth is not None else "",
                              results[first].cosine, results[first].norm_error, compared)
    return Divergence(None, compared_steps=compared)


def _alert_text(run: RunResult) -> str:
    if not run.alerts:
        return "none"
    kinds: dict[str, int] = {}
    for alert in run.alerts:
        kinds[alert.kind] = kinds.get(alert.kind, 0) + 1
    first = run.alerts[0]
    return (", ".join(f"{k} ×{n}" for k, n in kinds.items())
            + f"; first: {first.kind} at step {first.step} in "
              f"{first.module or '<model>'} ({first.phase} {first.io})")


def _underflow_text(run: RunResult) -> str:
    peak = run.peaks.get("near_underflow")
    if peak is None:
        return "-"
    return f"{100 * peak.value:.1f}% of `{peak.module or '<model>'}` ({peak.io}), step {peak.step}"


def _number(value: float) -> str:
    return f"{value:.3f}" if math.isfinite(value) else str(value)


def findings(runs: Sequence[RunResult], divergences: dict[str, Divergence]) -> list[str]:
    """Statements computed from the measurements, one per run against float32."""
    reference = runs[0]
    finite = [r for r in runs[1:] if r.first_nonfinite is None]
    lines = []
    if finite:
        widest = max(finite, key=lambda r: abs(r.final_loss - reference.final_loss))
        alerted = [r.config.name for r in runs if r.alerts]
        lines.append(
            f"{len(finite)} of {len(runs) - 1} low-precision runs finished with a finite "
            f"loss, all within {abs(widest.final_loss - reference.final_loss):.3f} of "
            f"float32's final loss (the widest: {widest.config.name}). Monitor alerts came "
            + (f"from {', '.join(alerted)} only." if alerted else "from no run."))
    for run in runs[1:]:
        name = run.config.name
        if run.first_nonfinite is not None:
            text = (f"**{name}**: the training loss became non-finite at step "
                    f"{run.first_nonfinite} and stayed so for "
                    f"{sum(not math.isfinite(v) for v in run.losses)} of "
                    f"{len(run.losses)} steps.")
        else:
            diff = run.final_loss - reference.final_loss
            text = (f"**{name}**: final training loss {_number(run.final_loss)} against "
                    f"float32's {_number(reference.final_loss)} ({diff:+.3f}, "
                    f"{100 * diff / reference.final_loss:+.1f}%).")
        if run.config.loss_scaling:
            text += (f" The loss scale skipped {run.skipped_steps} step(s) and ended at "
                     f"{run.loss_scales[-1]:g} (lowest {min(run.loss_scales):g}).")
        found = divergences.get(name)
        if found is not None and found.error:
            text += f" Its dumps could not be compared: {found.error}."
        elif found is not None and found.step is not None:
            text += (f" Its activation/gradient statistics first left the run-compare "
                     f"tolerance at dumped step {found.step}, in `{found.entry}` (cosine "
                     f"{found.cosine:.6f}, norm {100 * found.norm_error:.2f}% off)"
                     + (f"; the error started to grow at `{found.growth_entry}`."
                        if found.growth_entry and found.growth_entry != found.entry else "."))
            if found.compared_steps > 1:
                text += (f" At the {found.compared_steps - 1} dumped step(s) before, from the "
                         "same initial weights, every entry was within tolerance: the "
                         "difference grew as the weights of the two runs drifted apart.")
        elif found is not None:
            text += (f" Its statistics stayed within the run-compare tolerance at all "
                     f"{found.compared_steps} dumped steps.")
        text += (f" Gradient nearest underflow: {_underflow_text(run)} (float32: "
                 f"{_underflow_text(reference)}).")
        text += f" Monitor alerts: {_alert_text(run)}."
        lines.append(text)
    return lines


def render(runs: Sequence[RunResult], divergences: dict[str, Divergence],
           dump_steps: Sequence[int], plot_name: str) -> str:
    """The study as Markdown."""
    first = runs[0]
    c = first.config
    model = ", ".join(f"{k} {v}" for k, v in c.model.items()) or "the example's defaults"
    lines = [
        "# Precision study: a tiny MoE language model in five precision settings", "",
        f"Measured by `opforge demo --study` on "
        f"{datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}: device {first.device}, "
        f"torch {torch.__version__}; {c.steps} steps of {c.batch} x {c.seq} characters, "
        f"model: {model} ({first.parameters:,} parameters), AdamW lr {c.lr}, seed {c.seed}. "
        "Every run starts from the same weights and sees the same batches. The low-precision "
        "runs use `torch.autocast` (float32 master weights; opforge's matmuls run in the "
        "low dtype, its norms and softmax statistics in float32). Statistics of every "
        "module's activations and gradients were dumped at steps "
        f"{', '.join(map(str, dump_steps))} and compared with the float32 run's as "
        "`opforge compare --dtype <the run's dtype>` does: each entry is judged by the "
        "cosine and norm tolerance of the run's compute dtype (or of the entry's dtype when "
        "that is lower), because under autocast a float32 tensor such as the residual "
        "stream carries the errors of the low-precision products that fed it.",
        "",
        "| run | final train loss | last validation loss | first non-finite step | "
        "skipped steps | first divergence from float32 | gradient nearest underflow | "
        "monitor alerts | time (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        found = divergences.get(run.config.name)
        if found is None:
            where = "(reference)"
        elif found.error:
            where = f"not comparable: {found.error[:80]}"
        elif found.step is None:
            where = f"none in {found.compared_steps} dumped steps"
        else:
            where = f"step {found.step}: `{found.entry}`"
        val = run.val_losses[-1][1] if run.val_losses else float("nan")
        lines.append(
            f"| {run.config.name} | {_number(run.final_loss)} | {_number(val)} | "
            f"{'-' if run.first_nonfinite is None else run.first_nonfinite} | "
            f"{run.skipped_steps if run.config.loss_scaling else '-'} | {where} | "
            f"{_underflow_text(run)} | {_alert_text(run)} | {run.seconds:.0f} |")
    lines += ["", f"![loss curves]({plot_name})", "",
              "An entry is `<module>#<call>.<phase>.<io>.<index>`: a module's forward input "
              "or output, or in the backward the gradient it produced for its input (`<model>` "
              "is the whole model); the gradients of loss-scaled runs are compared unscaled. "
              "Monitor alerts name the module where a NaN, Inf, overflow or spike first "
              "appeared in a step; `<model>`'s backward output is the gradient of the loss "
              "with respect to the logits, which the loss (computed outside the modules) "
              "produces. *Gradient nearest underflow*: the largest share, over all steps "
              "and modules, of a gradient's nonzero values below the smallest normal number "
              "of its low-precision dtype — for a float32 gradient, float16's (6.1e-05): the "
              "values float16 would make subnormal or zero; for a float16 or bfloat16 "
              "gradient, its own subnormals. A loss-scaled run's gradients are measured "
              "scaled, as its backward computes them.", "", "## Findings", "",
              *[f"- {line}" for line in findings(runs, divergences)], ""]
    return "\n".join(lines)


def run_study(out_dir: Path, *, steps: int = 400, batch: int = 32,
              model: dict[str, int] | None = None, dump_every: int = 10,
              device: torch.device | str | None = None, doc: Path | None = None,
              runs: Sequence[RunConfig] = STUDY_RUNS,
              on_step: Callable[[str, int, float], None] | None = None) -> StudyResult:
    """Train every run of ``runs`` and write ``study.md``, ``study.json`` and
    ``loss_curves.png`` into ``out_dir`` (and the Markdown to ``doc``, with its plot next
    to it, when given). The first run is the reference."""
    out_dir.mkdir(parents=True, exist_ok=True)
    device = resolve_device(device)
    dump_steps = sorted({*range(0, steps, dump_every), steps - 1})
    results: list[RunResult] = []
    for config in runs:
        config = dataclasses.replace(config, steps=steps, batch=batch, model=dict(model or {}))

        def step_hook(step: int, loss: float, name: str = config.name) -> None:
            if on_step is not None:
                on_step(name, step, loss)

        results.append(train(config, device=device,
                             monitor_log=out_dir / f"{_slug(config.name)}_alerts.jsonl",
                             dump_dir=out_dir / "dumps" / _slug(config.name),
                             dump_steps=dump_steps, detailed_monitor=True,
                             on_step=step_hook))
    reference = out_dir / "dumps" / _slug(runs[0].name)
    divergences = {run.config.name: divergence(reference,
                                                out_dir / "dumps" / _slug(run.config.name),
                                                dump_steps, getattr(torch, run.config.dtype))
                   for run in results[1:]}
    plot = plot_losses(results, out_dir / "loss_curves.png",
                       "tiny MoE LM: the same model and seed in five precision settings")
    markdown = render(results, divergences, dump_steps, plot.name)
    files = [plot, out_dir / "study.md", out_dir / "study.json"]
    (out_dir / "study.md").write_text(markdown)
    (out_dir / "study.json").write_text(json.dumps({
        "runs": [{"config": dataclasses.asdict(r.config), "losses": r.losses,
                  "val_losses": r.val_losses, "loss_scales": r.loss_scales,
                  "skipped_steps": r.skipped_steps, "seconds": r.seconds,
                  "alerts": [dataclasses.asdict(a) for a in r.alerts],
                  "peaks": {k: dataclasses.asdict(v) for k, v in r.peaks.items()}}
                 for r in results],
        "divergences": {k: dataclasses.asdict(v) for k, v in divergences.items()},
        "dump_steps": dump_steps}, indent=1))
    if doc is not None:
        doc.parent.mkdir(parents=True, exist_ok=True)
        doc_plot = doc.with_suffix(".png")
        doc_plot.write_bytes(plot.read_bytes())
        doc.write_text(render(results, divergences, dump_steps, doc_plot.name))
        files += [doc, doc_plot]
    return StudyResult(results, divergences, dump_steps, markdown, files)
