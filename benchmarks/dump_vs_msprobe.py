"""Step time of opforge's dump beside MindStudio Probe's (msprobe) on one model, one run.

A residual MLP of 6 blocks of width 256 (batch 64) trains with SGD; each configuration
runs in its own process (msprobe's debugger is one per process), warms up for 2 steps and
times ``--steps`` steps, each dumped and written:

- none: no dump;
- opforge statistics: `opforge.precision.dump` in statistics mode (module entries);
- msprobe L0 statistics: msprobe's module-level statistics dump;
- opforge API tensor: tensor mode with ``apis=True``, ``parameters=True`` and
  ``output_grads=True`` (every torch call inside the modules);
- msprobe L1 tensor: msprobe's API-level tensor dump.

Run it with an interpreter that has mindstudio-probe (``make msprobe-fixtures`` builds
``.venv-msprobe``) and opforge on its path::

    PYTHONPATH=src .venv-msprobe/bin/python benchmarks/dump_vs_msprobe.py [--steps 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

CONFIGS = ("none", "opforge statistics", "msprobe L0 statistics", "opforge API tensor",
           "msprobe L1 tensor")
WIDTH, BLOCKS, BATCH = 256, 6, 64


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(WIDTH, WIDTH)
        self.fc2 = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


def run(config: str, steps: int, folder: Path) -> list[float]:
    """Seconds per step of ``config``, in this process."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(Block() for _ in range(BLOCKS)))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    batch = torch.randn(BATCH, WIDTH)

    def timed(begin: Callable[[], object], finish: Callable[[], object]) -> list[float]:
        """Steps with the dump begun before the forward and finished after the backward
        (written), two warm-up steps left out."""
        times = []
        for step in range(steps + 2):
            start = time.perf_counter()
            begin()
            model(batch).square().mean().backward()
            finish()
            optimizer.step()
            optimizer.zero_grad()
            if step >= 2:
                times.append(time.perf_counter() - start)
        return times

    if config == "none":
        return timed(lambda: None, lambda: None)
    if config.startswith("msprobe"):
        from msprobe.pytorch import PrecisionDebugger

        task, level = ("statistics", "L0") if "L0" in config else ("tensor", "L1")
        path = folder / "config.json"
        path.write_text(json.dumps({"task": task, "dump_path": str(folder / "dump"),
                                    "rank": [], "step": [], "level": level,
                                    "async_dump": False, task: {
                                        "scope": [], "list": [], "data_mode": ["all"],
                                        "summary_mode": "statistics"}}))
        debugger = PrecisionDebugger(config_path=str(path))
        return timed(lambda: debugger.start(model=model),
                     lambda: (debugger.stop(), debugger.step()))
    from opforge.precision.dump import dump

    options = {"apis": True, "parameters": True, "output_grads": True} \
        if "API" in config else {}
    mode = "tensor" if "tensor" in config else "statistics"
    with dump(model, folder / "dump", mode=mode, **options) as dumper:
        return timed(lambda: None, dumper.step)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--config", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    if args.config:  # one configuration, in its own process
        with tempfile.TemporaryDirectory() as folder:
            print(json.dumps(run(args.config, args.steps, Path(folder))))
        return 0
    medians = {}
    for config in CONFIGS:
        result = subprocess.run([sys.executable, __file__, "--config", config, "--steps",
                                 str(args.steps)], capture_output=True, text=True, check=True)
        medians[config] = statistics.median(json.loads(result.stdout.strip().splitlines()[-1]))
    import msprobe  # noqa: F401 - the version goes into the results

    from opforge.profiler.results import environment, write_results

    env = environment(torch.device("cpu"))
    rows = [{"config": config, "step_s_median": round(seconds, 4),
             "vs_none": round(seconds / medians["none"], 2)}
            for config, seconds in medians.items()]
    version = getattr(sys.modules["msprobe"], "__version__", "26.2.0")
    lines = ["# opforge dump beside msprobe's, one training step", "",
             f"{env['date']}: {env['machine']}, {env['cpu_count']} CPUs, torch {env['torch']}, "
             f"mindstudio-probe {version}. Residual MLP, {BLOCKS} blocks of width {WIDTH}, "
             f"batch {BATCH}, SGD; median of {args.steps} steps per configuration, each in "
             "its own process.", "",
             "| configuration | step s (median) | x no dump |", "|---|---|---|"]
    lines += [f"| {r['config']} | {r['step_s_median']} | {r['vs_none']} |" for r in rows]
    lines += ["", f"opforge statistics / msprobe L0 statistics: "
              f"{medians['opforge statistics'] / medians['msprobe L0 statistics']:.2f}; "
              f"opforge API tensor / msprobe L1 tensor: "
              f"{medians['opforge API tensor'] / medians['msprobe L1 tensor']:.2f}."]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    write_results(args.out, "dump_vs_msprobe", rows, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
