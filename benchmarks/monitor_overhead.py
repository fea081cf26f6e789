"""Step-time overhead of `opforge.precision.Monitor` and of a statistics-mode
`opforge.precision.dump` on a small transformer training step.

A 6-layer, width-256 encoder (4 heads, feed-forward 1024, vocabulary 1000) trained with
AdamW on batch 16 x 128 tokens; each repeat times one step without either, one with the
monitor and one inside a statistics dump, interleaved, so that all see the same machine
state. Writes CSV + Markdown under ``--out``.

Usage::

    python benchmarks/monitor_overhead.py [--steps 24] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from pathlib import Path

import torch

from opforge.precision import Monitor
from opforge.precision.dump import dump
from opforge.profiler.results import environment, write_results

VOCAB, WIDTH, LAYERS, HEADS, FFN, BATCH, TOKENS = 1000, 256, 6, 4, 1024, 16, 128


class TinyTransformer(torch.nn.Module):
    """Embedding, `LAYERS` encoder layers, a vocabulary head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.layers = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(WIDTH, HEADS, FFN, dropout=0.0, batch_first=True)
            for _ in range(LAYERS))
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        for layer in self.layers:
            hidden = layer(hidden)
        return self.head(hidden)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               tokens: torch.Tensor, monitor: Monitor | None) -> None:
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB),
                                             tokens[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    if monitor is not None:
        monitor.step()
    optimizer.zero_grad()


def monitor_own_time(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     tokens: torch.Tensor, steps: int) -> float:
    """Milliseconds per step spent inside the monitor's statistics (`Monitor._record`,
    called by its hooks) and its step analysis (`Monitor._analyze`): the part of the
    overhead that is the monitor's own work rather than hook dispatch or machine noise."""
    spent = [0.0]

    def timed(method):
        def wrapper(self, *args):
            start = time.perf_counter()
            try:
                return method(self, *args)
            finally:
                spent[0] += time.perf_counter() - start
        return wrapper

    monitor = Monitor(model)
    monitor._record = timed(Monitor._record).__get__(monitor)
    monitor._analyze = timed(Monitor._analyze).__get__(monitor)
    with monitor:
        train_step(model, optimizer, tokens, monitor)
        spent[0] = 0.0
        for _ in range(steps):
            train_step(model, optimizer, tokens, monitor)
    return spent[0] / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24, help="timed steps per mode")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    torch.manual_seed(0)
    model = TinyTransformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, VOCAB, (BATCH, TOKENS + 1))
    monitor = Monitor(model)
    scratch = Path(tempfile.mkdtemp(prefix="opforge-dump-"))
    modes = ("without monitor", "with monitor", "statistics dump")
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for repeat in range(args.steps + 1):  # the first repeat warms every mode up
        for mode in modes:
            context = {"with monitor": monitor,
                       "statistics dump": dump(model, scratch / f"{repeat}", "statistics"),
                       }.get(mode, contextlib.nullcontext())
            with context:
                start = time.perf_counter()
                train_step(model, optimizer, tokens,
                           monitor if mode == "with monitor" else None)
                if mode == "statistics dump":
                    context.step()  # writes the step's manifest
                elapsed = time.perf_counter() - start
            if repeat:
                times[mode].append(elapsed)
    own_ms = monitor_own_time(model, optimizer, tokens, args.steps)
    base = statistics.median(times["without monitor"])
    rows = []
    for mode, samples in times.items():
        median = statistics.median(samples)
        rows.append({"mode": mode, "step_ms_median": round(median * 1e3, 2),
                     "step_ms_min": round(min(samples) * 1e3, 2),
                     "overhead_pct": round((median / base - 1) * 100, 2)})
    env = environment(torch.device("cpu"))
    config = (f"{LAYERS} layers, width {WIDTH}, {HEADS} heads, ffn {FFN}, batch {BATCH} x "
              f"{TOKENS} tokens, AdamW, {args.steps} steps per mode, torch threads "
              f"{torch.get_num_threads()}")
    lines = ["# Monitor and statistics-dump overhead on a transformer training step", "",
             f"{env['date']} — {env['machine']}, {env['cpu_count']} CPUs, torch "
             f"{env['torch']}. {config}. Alerts raised: {len(monitor.alerts)}.", "",
             "| mode | step ms (median) | step ms (min) | overhead |", "|---|---|---|---|"]
    lines += [f"| {r['mode']} | {r['step_ms_median']} | {r['step_ms_min']} | "
              f"{r['overhead_pct']:+.1f}% |" for r in rows]
    by_min = (min(times["with monitor"]) / min(times["without monitor"]) - 1) * 100
    lines += ["", f"Monitor overhead by the fastest steps: {by_min:+.1f}%. Time inside the "
              f"monitor's statistics and step analysis: {own_ms:.1f} ms per step "
              f"({own_ms / (base * 1e3) * 100:.1f}% of the median step without it); the rest "
              "of the median difference is hook dispatch and run-to-run noise."]
    for row in rows:
        row["monitor_own_ms"] = round(own_ms, 2)
    text = "\n".join(lines) + "\n"
    flat = [{**env, "config": config, **row} for row in rows]
    csv_path, md_path = write_results(args.out, "monitor_overhead", flat, text)
    print(text)
    print(f"wrote {csv_path} and {md_path}")


if __name__ == "__main__":
    main()
