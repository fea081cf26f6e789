"""``reports/index.html``: what the demo run did, measured, found and generated."""

from __future__ import annotations

import html
import math
import os
from collections.abc import Sequence
from pathlib import Path

from opforge.demo.training import RunResult
from opforge.precision.verify import Certificate
from opforge.profiler.report import embedded_image, html_page, html_table

SECTIONS = ("run", "loss", "monitor", "profile", "certificate", "sample")
_STATUS_ORDER = ("error", "fail", "warning", "known", "pass", "skip")


def _moving_average(values: Sequence[float], window: int = 20) -> list[float]:
    return [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
            for i in range(len(values))]


def plot_losses(runs: Sequence[RunResult], path: Path, title: str) -> Path:
    """Training loss per step (a light line, and its 20-step moving average) and the
    validation losses (markers) of each run; a cross where a run's loss became non-finite.
    With several runs, a second panel shows each run's moving average minus the first's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 2 if len(runs) > 1 else 1
    figure, axes = plt.subplots(panels, 1, figsize=(8, 4.5 + 2.2 * (panels - 1)), dpi=110,
                                squeeze=False, sharex=True,
                                gridspec_kw={"height_ratios": [2, 1][:panels]})
    top = axes[0][0]
    reference = _moving_average(runs[0].losses)
    for run in runs:
        # Steps are numbered from 0, as the monitor's alerts, the dumps and the profile
        # number them; a validation point sits at the step it followed.
        steps = list(range(len(run.losses)))
        line, = top.plot(steps, run.losses, alpha=0.25, linewidth=0.8)
        colour = line.get_color()
        smooth = _moving_average(run.losses)
        top.plot(steps, smooth, color=colour, label=f"{run.config.name} (train)")
        if run.val_losses:
            top.plot([s - 1 for s, _ in run.val_losses], [v for _, v in run.val_losses], "o",
                     color=colour, markersize=4)
        if run.first_nonfinite is not None:
            last = next((v for v in reversed(run.losses[:run.first_nonfinite])
                         if math.isfinite(v)), run.losses[0])
            top.plot([run.first_nonfinite], [last], "x", color=colour, markersize=10,
                     markeredgewidth=2, label=f"{run.config.name}: loss non-finite")
        if panels == 2 and run is not runs[0]:
            axes[1][0].plot(steps, [a - b for a, b in zip(smooth, reference)], color=colour,
                            label=run.config.name)
    top.set_ylabel("cross-entropy (nats per character)")
    top.set_title(title + " (dots: validation)", fontsize=10)
    top.grid(True, alpha=0.3)
    top.legend(fontsize=7)
    if panels == 2:
        bottom = axes[1][0]
        bottom.axhline(0.0, color="black", linewidth=0.8)
        bottom.set_ylabel(f"minus {runs[0].config.name}", fontsize=9)
        bottom.grid(True, alpha=0.3)
        bottom.legend(fontsize=7)
    axes[-1][0].set_xlabel("step")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path


def certificate_by_op(certificate: Certificate) -> list[list[str]]:
    """One row per operator: cases, pass, known, fail (+ error), and the worst status over
    its backends and dtypes."""
    ops: dict[str, list[int]] = {}
    worst: dict[str, str] = {}
    for row in certificate.rows:
        counts = ops.setdefault(row["op"], [0, 0, 0, 0])
        for i, column in enumerate(("cases", "pass", "known", "fail")):
            counts[i] += int(row[column])
        counts[3] += int(row["error"])
        status = row["status"]
        current = worst.get(row["op"], "skip")
        worst[row["op"]] = min(status, current, key=lambda s: _STATUS_ORDER.index(s)
                               if s in _STATUS_ORDER else 0)
    return [[op, *map(str, counts), worst[op]] for op, counts in ops.items()]


def _run_section(run: RunResult) -> str:
    c = run.config
    model = ", ".join(f"{k} {v}" for k, v in c.model.items()) or "defaults"
    first, final = run.losses[0], run.final_loss
    val = run.val_losses[-1][1] if run.val_losses else float("nan")
    return html_table(None, [
        ["device", run.device],
        ["precision", f"{c.dtype}{' + dynamic loss scaling' if c.loss_scaling else ''}"
                      f"{' + naive softmax' if c.naive_softmax else ''}"],
        ["model", f"{run.parameters:,} parameters ({model})"],
        ["training", f"{c.steps} steps of {c.batch} x {c.seq} characters, AdamW lr {c.lr}, "
                     f"seed {c.seed}"],
        ["time", f"{run.seconds:.1f} s, {run.tokens_per_second:,.0f} characters/s"],
        ["loss", f"{first:.3f} at the first step (uniform guessing over {run.vocab} "
                 f"characters is ln {run.vocab} = {math.log(max(run.vocab, 1)):.3f}), "
                 f"{final:.3f} over the last 10% of steps; validation {val:.3f}"],
    ])


def write_index(run: RunResult, out_dir: Path, certificate: Certificate | None,
                certificate_path: Path | None) -> Path:
    """Write ``out_dir/index.html`` (and ``loss.png``) for the demo run ``run``, whose
    profile, if any, was written to ``out_dir/profile``."""
    esc = html.escape
    out_dir.mkdir(parents=True, exist_ok=True)
    loss_png = plot_losses([run], out_dir / "loss.png",
                           f"tiny MoE LM on {run.device}: {run.config.steps} steps")
    load_rows = [[f"block {i}", " / ".join(map(str, load)),
                  f"{max(load) / max(1, sum(load) / len(load)):.2f}"]
                 for i, load in enumerate(run.expert_load)]
    monitor = (f"<p>{esc(run.monitor_summary)}</p>" if not run.alerts else
               html_table(["kind", "step", "module", "phase", "io", "value", "detail"],
                          [[a.kind, str(a.step), a.module or "<model>", a.phase, a.io,
                            f"{a.value:.4g}", a.detail] for a in run.alerts]))
    monitor += ("<p>The monitor watched every module's activations and gradients for NaN, "
                "Inf, overflow and spikes, and the total gradient norm, at every step. "
                "Expert load in the last step (tokens per expert; max/mean 1.00 is a "
                "perfect balance, kept by the router's bias update):</p>"
                + html_table(["", "tokens per expert", "max / mean"], load_rows))
    profile_html = "<p>(not profiled)</p>"
    if run.profile is not None:
        sections = dict((key, body) for key, _, body in run.profile.html_sections(
            out_dir / "profile" / "roofline.png", top=10))
        profile_html = (
            sections["summary"] + sections["top-kernels"] + sections["verdicts"]
            + sections["roofline"] + "<h3>Advice</h3>" + sections["advice"]
            + '<p>Full profile: <a href="profile/report.html">profile/report.html</a>; '
              'timeline: <code>profile/trace_view.json</code> (open it in '
              "https://ui.perfetto.dev); tables: <code>profile/kernel_details.csv</code>, "
              "<code>op_statistic.csv</code>, <code>operator_details.csv</code>, "
              "<code>step_trace_time.csv</code>.</p>")
    if certificate is not None:
        link = os.path.relpath(certificate_path, out_dir) if certificate_path else ""
        cert_html = (f"<p>{esc(certificate.provenance)}</p><p><b>{esc(certificate.totals)}"
                     f"</b></p>" + html_table(
                         ["operator", "cases", "pass", "known limitation", "fail + error",
                          "worst status"], certificate_by_op(certificate))
                     + f"<p>Per backend and dtype, with the known limitations and their "
                       f"reasons: <code>{esc(link)}</code> (regenerate with "
                       "<code>make certificate</code>).</p>")
    else:
        cert_html = "<p>(no certificate found)</p>"
    intro = (
        "<p>This page is what <code>opforge demo</code> produced (<code>make run</code> "
        "runs it with its defaults): "
        "a small character-level language model whose every layer is an opforge operator "
        "(embedding, RMSNorm, attention with RoPE, a mixture of GELU experts routed by "
        "<code>moe_gating_top_k</code>, softmax cross-entropy) trained on the Book of "
        "Genesis (King James Version, public domain) with the anomaly monitor on every step "
        "and the profiler on a few. Below: the run, its loss, what the monitor found, where "
        "the time went and what bounds each kernel, the precision certificate of the "
        "operators, and text the model wrote.</p>")
    sections = [
        ("run", "The run", _run_section(run)),
        ("loss", "Loss", embedded_image(loss_png, "loss curve")),
        ("monitor", "Anomaly monitor", monitor),
        ("profile", "Profile (steps "
                    f"{run.profile.steps[0].step}-{run.profile.steps[-1].step})"
         if run.profile is not None and run.profile.steps else "Profile", profile_html),
        ("certificate", "Precision certificate", cert_html),
        ("sample", "Generated text", f"<pre>{esc(run.sample)}</pre>"),
    ]
    path = out_dir / "index.html"
    path.write_text(html_page("opforge demo: a tiny MoE language model", sections, intro))
    return path
