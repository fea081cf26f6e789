"""``opforge demo``: train the tiny MoE language model with the monitor and profiler on, and
write ``reports/index.html``; ``opforge demo --study``: the precision study.

The model lives in ``examples/tiny_moe_lm/model.py`` (loaded from the repository, see
`training.example_dir`); `training` runs it, `report` writes the page, `study` compares
precision settings.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from opforge.demo.report import SECTIONS, write_index
from opforge.demo.study import STUDY_RUNS, StudyResult, run_study
from opforge.demo.training import (
    RunConfig,
    RunResult,
    example_dir,
    load_example,
    resolve_device,
    train,
)
from opforge.precision.verify import read_certificate


def default_certificate() -> Path:
    """The repository's committed ``docs/precision-certificate.md``."""
    return example_dir().parents[1] / "docs" / "precision-certificate.md"


def run_demo(out_dir: str | Path = "reports", *, steps: int = 400, batch: int = 32,
             dtype: str = "float32", device: str | torch.device | None = None,
             model: dict[str, int] | None = None, profile_steps: tuple[int, int] = (10, 3),
             sample_chars: int = 300, certificate: Path | None = None,
             on_step: Callable[[int, float], None] | None = None
             ) -> tuple[RunResult, Path]:
    """Train the demo model once and write the report.

    Args:
        out_dir: where ``index.html``, ``loss.png``, ``profile/`` (and the monitor's
            ``monitor.jsonl`` when it alerts) go.
        steps, batch, dtype, model: the run (`RunConfig`); float16 adds loss scaling.
        device: default CUDA when available, else the CPU.
        profile_steps: ``(first step, count)`` profiled (steps from 0); a window that
            starts after the last step profiles nothing.
        sample_chars: characters generated for the report.
        certificate: the precision certificate summarised (default: the committed one).

    Returns:
        The run's result and the path of ``index.html``.
    """
    out = Path(out_dir)
    config = RunConfig("demo", dtype, loss_scaling=dtype == "float16", steps=steps,
                       batch=batch, model=dict(model or {}))
    # The log is this run's alerts: a previous run's would read as this one's.
    (out / "monitor.jsonl").unlink(missing_ok=True)
    run = train(config, device=resolve_device(device), monitor_log=out / "monitor.jsonl",
                profile_dir=out / "profile" if profile_steps[0] < steps else None,
                profile_steps=profile_steps, sample_chars=sample_chars, on_step=on_step)
    path = certificate or default_certificate()
    parsed = read_certificate(path) if path.exists() else None
    return run, write_index(run, out, parsed, path if parsed else None)


__all__ = ["SECTIONS", "STUDY_RUNS", "RunConfig", "RunResult", "StudyResult",
           "default_certificate", "example_dir", "load_example", "run_demo", "run_study",
           "train"]
