"""What every benchmark writes: the run's environment, and its CSV + Markdown results
(``opforge bench`` and the scripts under ``benchmarks/``)."""

from __future__ import annotations

import csv
import datetime
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import opforge


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def environment(device: torch.device) -> dict[str, str]:
    """Date, machine, device and versions of this run."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    described = (f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda"
                 else str(device))
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": platform.processor() or _cpu_model() or platform.machine(),
        "cpu_count": str(os.cpu_count()),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "triton": triton_version,
        "opforge": opforge.__version__,
        "device": described,
        "torch_threads": str(torch.get_num_threads()),
    }


def write_results(out: Path, prefix: str, rows: Sequence[dict[str, Any]],
                  text: str) -> tuple[Path, Path]:
    """Write ``<prefix>_<date>_<time>.csv`` (``rows``) and ``.md`` (``text``) under ``out``;
    returns both paths. Date and time: a second run on the same day must not overwrite the
    first."""
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{prefix}_{datetime.datetime.now():%Y-%m-%d_%H%M%S}"
    csv_path = out / f"{stem}.csv"
    with csv_path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    md_path = out / f"{stem}.md"
    md_path.write_text(text)
    return csv_path, md_path


def write_report(out: Path, prefix: str, rows: Sequence[dict[str, Any]],
                 lines: Sequence[str], device: torch.device) -> tuple[Path, Path]:
    """`write_results` of a benchmark's ``rows`` and Markdown ``lines``, each CSV row and
    the report's closing list carrying the run's `environment` on ``device``; prints the
    two paths."""
    env = environment(device)
    text = "\n".join([*lines, *(f"- {k}: {v}" for k, v in env.items())]) + "\n"
    paths = write_results(out, prefix, [{**env, **row} for row in rows], text)
    print("wrote " + " and ".join(str(path) for path in paths))
    return paths
