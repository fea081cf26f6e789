"""Dynamic-shape replay: host cost per call of opforge's plan cache and workspace pool.

Replays a deterministic, seeded sequence of operator calls whose shapes change from call to
call, as an LLM serving loop sees them: activations of shape ``(batch * seq, hidden)`` with
``seq`` drawn from a fixed set of lengths. Every step runs the chain

    y = broadcast_add(x, bias, alpha) -> gelu(y) -> sigmoid(y)
      -> (n, rstd) = rms_norm(y, w) -> (g, gw) = rms_norm_backward(n, y, rstd, w)
      -> reduce_sum(g, dims=(0,))

(six calls; ``w`` is the bias vector), so ``--calls 1000`` is 166 steps. The same
sequence is timed, side by side and interleaved repeat by repeat, in these modes:

* opforge ``plan(...).run(...)`` with the plan/tiling caches and the workspace pool, from a
  cold start (``clear_caches()`` before each repeat) and again warm (caches kept);
* opforge ``plan(...).run(...)`` with the caches off (``set_plan_cache(False)``);
* the functional API (``torch.ops.opforge.*``), caches on, cold start;
* torch eager (``torch.add(alpha=)``, ``F.gelu``, ``torch.sigmoid``, ``x.sum(0)``);
* the plan phase alone (``opforge.plan(...)``, no run): cold, warm and uncached.

On the CPU the default backend is opforge's ``torch`` backend with small tensors, so that
host overhead and not kernel time dominates. With ``TRITON_INTERPRET=1`` set, a shorter run
on the ``triton`` backend (Triton's interpreter) follows, the one that exercises the
workspace pool (``reduce_sum`` over dim 0 splits the reduction and needs scratch memory).
On a GPU the default backend is ``triton``.

Usage::

    python benchmarks/replay.py [--calls 1000] [--out benchmarks/results]
    TRITON_INTERPRET=1 python benchmarks/replay.py            # + a 200-call triton run
    TRITON_INTERPRET=1 python benchmarks/replay.py --backend triton --calls 100 --repeats 3

Writes ``<out>/replay_<date>_<time>.csv`` and ``.md`` and prints the Markdown to stdout.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional

import opforge
from opforge.profiler.results import environment, write_results

BATCHES = (1, 2, 4)
ALPHA = 0.5
GELU_APPROXIMATE = "none"
REDUCE_DIMS = (0,)
CALLS_PER_STEP = 6
RMS_EPS = 1e-6
# Environment variables that change what opforge does, recorded with the results.
OPFORGE_ENV = ("TRITON_INTERPRET", "OPFORGE_BACKEND", "OPFORGE_PLAN_CACHE_SIZE",
               "OPFORGE_HARDWARE", "OPFORGE_POISON")

Step = Callable[[torch.Tensor, torch.Tensor], None]


# ---------------------------------------------------------------------------------------------
# The call sequence


@dataclass(frozen=True)
class Workload:
    """The replayed sequence: one ``(x, bias)`` pair per step, plus how it was drawn."""

    lengths: tuple[int, ...]
    shapes: tuple[tuple[int, int], ...]
    inputs: tuple[tuple[torch.Tensor, torch.Tensor], ...]

    @property
    def calls(self) -> int:
        """Operator calls in one replay."""
        return CALLS_PER_STEP * len(self.inputs)


def make_workload(calls: int, seed: int, hidden: int, max_seq: int, n_lengths: int,
                  dtype: torch.dtype, device: torch.device) -> Workload:
    """Draw ``calls / CALLS_PER_STEP`` steps of shape ``(batch * seq, hidden)`` from a
    seeded generator.

    One tensor per distinct row count is shared by the steps that use it: the plan cache
    keys on shapes, not on storage, and sharing keeps memory small for long replays.
    """
    rng = random.Random(seed)
    lengths = tuple(sorted(rng.sample(range(1, max_seq + 1), n_lengths)))
    steps = max(1, calls // CALLS_PER_STEP)
    shapes = tuple((rng.choice(BATCHES), rng.choice(lengths)) for _ in range(steps))
    generator = torch.Generator().manual_seed(seed)
    by_rows: dict[int, torch.Tensor] = {}
    for batch, seq in shapes:
        rows = batch * seq
        if rows not in by_rows:
            by_rows[rows] = torch.randn(rows, hidden, generator=generator).to(device, dtype)
    bias = torch.randn(hidden, generator=generator).to(device, dtype)
    inputs = tuple((by_rows[batch * seq], bias) for batch, seq in shapes)
    return Workload(lengths, shapes, inputs)


# ---------------------------------------------------------------------------------------------
# One step in each mode


def step_plan_run(x: torch.Tensor, bias: torch.Tensor) -> None:
    """The chain through opforge's two-phase API: plan (cached or not), then run."""
    y = opforge.plan("broadcast_add", x, bias, alpha=ALPHA).run(x, bias)
    y = opforge.plan("gelu", y, approximate=GELU_APPROXIMATE).run(y)
    y = opforge.plan("sigmoid", y).run(y)
    normed, rstd = opforge.plan("rms_norm", y, bias, eps=RMS_EPS).run(y, bias)
    grad, _ = opforge.plan("rms_norm_backward", normed, y, rstd, bias,
                           eps=RMS_EPS).run(normed, y, rstd, bias)
    opforge.plan("reduce_sum", grad, dims=REDUCE_DIMS).run(grad)


def step_functional(x: torch.Tensor, bias: torch.Tensor) -> None:
    """The chain through the functional API (``torch.ops.opforge.*``, dispatcher included)."""
    y = opforge.broadcast_add(x, bias, ALPHA)
    y = opforge.gelu(y, GELU_APPROXIMATE)
    y = opforge.sigmoid(y)
    normed, rstd = torch.ops.opforge.rms_norm(y, bias, RMS_EPS)
    grad, _ = torch.ops.opforge.rms_norm_backward(normed, y, rstd, bias, RMS_EPS)
    opforge.reduce_sum(grad, REDUCE_DIMS)


def step_eager(x: torch.Tensor, bias: torch.Tensor) -> None:
    """The same chain in torch eager; ``torch.add(alpha=)`` is ``a + alpha * b`` in one op."""
    y = torch.add(x, bias, alpha=ALPHA)
    y = functional.gelu(y, approximate=GELU_APPROXIMATE)
    y = torch.sigmoid(y)
    normed = functional.rms_norm(y, y.shape[-1:], bias, RMS_EPS)
    # RMSNorm's backward in eager ops (what autograd would run), from the saved rstd.
    rstd = torch.rsqrt(y.square().mean(-1, keepdim=True) + RMS_EPS)
    x_hat = y * rstd
    g = normed * bias
    grad = rstd * (g - x_hat * (g * x_hat).mean(-1, keepdim=True))
    (normed * x_hat).sum(0)
    grad.sum(REDUCE_DIMS)


def step_plan_only(x: torch.Tensor, bias: torch.Tensor) -> None:
    """The plan phase of the chain alone (Aclnn's GetWorkspaceSize). Every intermediate of
    the chain has the shape and dtype of ``x``, so planning on ``x`` gives the same
    signatures, and the same cache keys, as `step_plan_run`."""
    opforge.plan("broadcast_add", x, bias, alpha=ALPHA)
    opforge.plan("gelu", x, approximate=GELU_APPROXIMATE)
    opforge.plan("sigmoid", x)
    rstd = x[:, 0].float()  # a float32 row vector, as rms_norm's rstd (a small copy)
    opforge.plan("rms_norm", x, bias, eps=RMS_EPS)
    opforge.plan("rms_norm_backward", x, x, rstd, bias, eps=RMS_EPS)
    opforge.plan("reduce_sum", x, dims=REDUCE_DIMS)


@dataclass(frozen=True)
class Mode:
    """A way of running the replay.

    Attributes:
        name: label in the report.
        phase: ``"plan+run"`` or ``"plan"`` (plan phase only).
        step: runs one step of the chain.
        caching: opforge's plan/tiling caches on or off; ``None`` for torch eager.
        cold: drop caches and the workspace pool (`opforge.clear_caches`) before each repeat.
    """

    name: str
    phase: str
    step: Step
    caching: bool | None
    cold: bool

    def prepare(self) -> None:
        """Put opforge's global cache state where this mode needs it."""
        if self.caching is None:
            return
        opforge.set_plan_cache(self.caching)
        if self.cold:
            opforge.clear_caches()


# Order matters: each "warm" mode follows the cold mode that fills the caches it reuses.
MODES = (
    Mode("opforge plan+run, cache+pool, cold", "plan+run", step_plan_run, True, True),
    Mode("opforge plan+run, cache+pool, warm", "plan+run", step_plan_run, True, False),
    Mode("opforge plan+run, no cache", "plan+run", step_plan_run, False, True),
    Mode("opforge functional, cache+pool, cold", "plan+run", step_functional, True, True),
    Mode("torch eager", "plan+run", step_eager, None, False),
    Mode("plan only, cache, cold", "plan", step_plan_only, True, True),
    Mode("plan only, cache, warm", "plan", step_plan_only, True, False),
    Mode("plan only, no cache", "plan", step_plan_only, False, True),
)


# ---------------------------------------------------------------------------------------------
# Measurement


@dataclass
class ModeResult:
    """Timings and counters of one mode: µs per call over repeats, counters of the last
    repeat (every repeat of a mode replays the same sequence from the same cache state)."""

    mode: str
    phase: str
    caching: bool | None
    us_per_call: list[float] = field(default_factory=list)
    plan_hits: int = 0
    plan_misses: int = 0
    tiling_hits: int = 0
    tiling_misses: int = 0
    ws_requests: int = 0
    ws_allocations: int = 0
    ws_bytes_held: int = 0

    @property
    def median(self) -> float:
        """Median over repeats of µs per call."""
        return statistics.median(self.us_per_call)

    @property
    def mean(self) -> float:
        """Mean over repeats of µs per call."""
        return statistics.fmean(self.us_per_call)


@dataclass
class Section:
    """All modes measured on one backend."""

    backend: str
    device: str
    calls: int
    repeats: int
    results: list[ModeResult]

    def eager_median(self) -> float:
        """Median µs per call of torch eager, the baseline of the overhead column."""
        return next(r.median for r in self.results if r.caching is None)


def _synchronizer(device: torch.device) -> Callable[[], None]:
    # CUDA launches return before the kernel ends: the replay's wall time must include the
    # queue draining, or a fast host loop would be credited with the GPU's work.
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def time_replay(step: Step, workload: Workload, sync: Callable[[], None]) -> int:
    """Nanoseconds of one replay of the whole sequence, garbage collector paused (a
    collection landing in one mode's repeat would be charged to that mode)."""
    sync()
    collecting = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter_ns()
        for x, bias in workload.inputs:
            step(x, bias)
        sync()
        return time.perf_counter_ns() - start
    finally:
        if collecting:
            gc.enable()


def run_section(backend: str, workload: Workload, repeats: int, device: torch.device
                ) -> Section:
    """Time every mode ``repeats`` times, interleaved (mode by mode inside each repeat) so
    that drift in machine speed affects all modes alike. One untimed pass of every mode
    first takes one-time costs out: Triton compilation, lazy initialisation, allocator."""
    sync = _synchronizer(device)
    results = [ModeResult(m.name, m.phase, m.caching) for m in MODES]
    with opforge.use_backend(backend):
        for repeat in range(-1, repeats):
            for mode, result in zip(MODES, results):
                mode.prepare()
                caches, pool = opforge.cache_stats(), opforge.workspace_stats()
                elapsed = time_replay(mode.step, workload, sync)
                if repeat < 0:
                    continue
                result.us_per_call.append(elapsed / 1e3 / workload.calls)
                after, pool_after = opforge.cache_stats(), opforge.workspace_stats()
                result.plan_hits = after.plan_hits - caches.plan_hits
                result.plan_misses = after.plan_misses - caches.plan_misses
                result.tiling_hits = after.tiling_hits - caches.tiling_hits
                result.tiling_misses = after.tiling_misses - caches.tiling_misses
                result.ws_requests = pool_after.requests - pool.requests
                result.ws_allocations = pool_after.allocations - pool.allocations
                result.ws_bytes_held = pool_after.bytes_held
            done = "warm-up pass" if repeat < 0 else f"repeat {repeat + 1}/{repeats}"
            print(f"  [{backend}] {done} done", file=sys.stderr)
    opforge.set_plan_cache(True)
    return Section(backend, str(device), workload.calls, repeats, results)


# ---------------------------------------------------------------------------------------------
# Environment and report


def configuration(args: argparse.Namespace, workload: Workload) -> dict[str, Any]:
    """Everything that determines the replayed sequence and how it was measured."""
    rows = sorted({b * s for b, s in workload.shapes})
    return {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "calls": workload.calls,
        "steps": len(workload.shapes),
        "chain": f"broadcast_add(x, bias, alpha={ALPHA}) -> gelu(approximate="
                 f"{GELU_APPROXIMATE!r}) -> sigmoid -> rms_norm(eps={RMS_EPS}) -> "
                 f"rms_norm_backward -> reduce_sum(dims={REDUCE_DIMS})",
        "seed": args.seed,
        "hidden": args.hidden,
        "dtype": args.dtype,
        "batches": list(BATCHES),
        "seq_lengths": list(workload.lengths),
        "distinct_row_counts": len(rows),
        "rows_range": [rows[0], rows[-1]],
        "repeats": args.repeats,
        "triton_calls": args.triton_calls,
        "triton_repeats": args.triton_repeats,
        "plan_cache_capacity": opforge.cache_stats().capacity,
        "env": {name: os.environ[name] for name in OPFORGE_ENV if name in os.environ},
    }


def _cell(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items()) or "(none set)"
    if isinstance(value, list):
        return ", ".join(str(v) for v in value)
    return f"`{value}`" if isinstance(value, str) else str(value)


def _rate(hits: int, misses: int, caching: bool | None) -> str:
    if caching is None:
        return "-"
    if not caching:
        return "off"
    total = hits + misses
    return f"{hits / total:.1%} ({hits}/{total})" if total else "-"


def csv_rows(sections: Sequence[Section], env: dict[str, str], config: dict[str, Any]
             ) -> list[dict[str, Any]]:
    """One flat row per (backend, mode), environment and configuration repeated so that
    CSVs from several runs concatenate."""
    rows = []
    for section in sections:
        eager = section.eager_median()
        for r in section.results:
            rows.append({
                **env,
                "backend": section.backend,
                "calls": section.calls,
                "repeats": section.repeats,
                "mode": r.mode,
                "phase": r.phase,
                "us_per_call_median": round(r.median, 3),
                "us_per_call_mean": round(r.mean, 3),
                "us_per_call_min": round(min(r.us_per_call), 3),
                "us_over_eager_median": (round(r.median - eager, 3) if r.phase == "plan+run"
                                         else ""),
                "plan_hits": r.plan_hits,
                "plan_misses": r.plan_misses,
                "tiling_hits": r.tiling_hits,
                "tiling_misses": r.tiling_misses,
                "ws_requests": r.ws_requests,
                "ws_allocations": r.ws_allocations,
                "ws_bytes_held": r.ws_bytes_held,
                "config": json.dumps(config, separators=(",", ":")),
            })
    return rows


def markdown(sections: Sequence[Section], env: dict[str, str], config: dict[str, Any]) -> str:
    """The report: environment, configuration, one table per backend, how to read it."""
    lines = [f"# opforge dynamic-shape replay — {env['date']}", "",
             "| | |", "|---|---|"]
    lines += [f"| {key} | {value} |" for key, value in env.items()]
    lines += ["", "Configuration:", "", "| | |", "|---|---|"]
    lines += [f"| {key} | {_cell(value)} |" for key, value in config.items()]
    for section in sections:
        eager = section.eager_median()
        lines += ["", f"## backend={section.backend} on {section.device}: "
                      f"{section.calls} calls, median and mean of {section.repeats} repeats",
                  "",
                  "| mode | phase | µs/call median | µs/call mean | over eager µs "
                  "| plan cache hits | tiling cache hits | workspace allocs / requests |",
                  "|---|---|---:|---:|---:|---:|---:|---:|"]
        for r in section.results:
            over = f"{r.median - eager:+.1f}" if r.phase == "plan+run" else "-"
            workspace = "-" if r.caching is None else f"{r.ws_allocations} / {r.ws_requests}"
            lines.append(
                f"| {r.mode} | {r.phase} | {r.median:.1f} | {r.mean:.1f} | {over} "
                f"| {_rate(r.plan_hits, r.plan_misses, r.caching)} "
                f"| {_rate(r.tiling_hits, r.tiling_misses, r.caching)} | {workspace} |")
        if section.backend == "torch":
            lines += ["", "The torch backend needs no workspace, so its workspace requests "
                          "are 0 by design; the triton run exercises the pool."]
        elif section.device == "cpu":
            lines += ["", "Triton's interpreter runs these kernels on the CPU, at milliseconds "
                          "to a tenth of a second a launch: only the plan-only times and the "
                          "counters of this table are meaningful."]
    lines += [
        "", "How to read it:", "",
        "* µs/call: wall time of one whole replay divided by its calls (host time; on a GPU "
        "the replay ends with a synchronize). Median and mean are over the repeats.",
        "* over eager: µs per call above torch eager running the same chain — opforge's "
        "overhead per call (on the torch backend this includes the reference's float32 "
        "copy into the output).",
        "* cold: `clear_caches()` before each repeat, so misses are those of a first pass "
        "over this sequence; warm: the same replay again with the caches kept.",
        "* no cache: `set_plan_cache(False)` turns off the plan and tiling caches (every "
        "call plans from scratch); the workspace pool still serves `run`.",
        "* tiling cache: consulted only when a plan misses, hence `-` in warm rows; "
        "tilings are keyed by power-of-two shape buckets, so nearby shapes share one.",
        "* plan only: `opforge.plan(...)` alone, the Aclnn-style GetWorkspaceSize phase.",
        "* workspace allocs / requests: `workspace_stats()` counters of the replay; "
        "requests come from `rms_norm_backward` (its grad_weight partials) and from "
        "`reduce_sum` over dim 0 when the triton backend splits the reduction. Without the "
        "pool every request would be an allocation: 1 - allocs / requests is the share the "
        "pool saves.",
    ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line; rejects a CPU triton run without the interpreter."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1000,
                        help=f"operator calls per replay ({CALLS_PER_STEP} per step; "
                             "default 1000)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results",
                        help="directory for replay_<date>_<time>.{csv,md}")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", choices=("torch", "triton"), default=None,
                        help="opforge backend (default: torch on cpu, triton on cuda)")
    parser.add_argument("--repeats", type=int, default=15, help="timed replays per mode")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=64, help="hidden size (columns)")
    parser.add_argument("--max-seq", type=int, default=128, help="largest sequence length")
    parser.add_argument("--lengths", type=int, default=50,
                        help="distinct sequence lengths drawn from 1..max-seq")
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"),
                        default="float32")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: see README)")
    parser.add_argument("--triton-calls", type=int, default=200,
                        help="calls of the extra triton run on cpu with TRITON_INTERPRET=1 "
                             "(0: skip)")
    parser.add_argument("--triton-repeats", type=int, default=3)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.backend is None:
        args.backend = "torch" if device.type == "cpu" else "triton"
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if args.backend == "triton" and device.type == "cpu" and not interpreted:
        parser.error("--backend triton on the cpu runs Triton's interpreter: set "
                     "TRITON_INTERPRET=1 before starting (it must precede importing opforge)")
    if args.lengths > args.max_seq:
        parser.error("--lengths must not exceed --max-seq")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the replay sections, write the results, print the Markdown."""
    args = parse_args(argv)
    # Small tensors: an intra-op thread pool costs more to wake than the op takes, and its
    # wake-up jitter would swamp the host overhead this benchmark measures.
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    runs = [(args.backend, args.calls, args.repeats)]
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if (device.type == "cpu" and args.backend == "torch" and interpreted
            and args.triton_calls > 0):
        runs.append(("triton", args.triton_calls, args.triton_repeats))
    workloads = [make_workload(calls, args.seed, args.hidden, args.max_seq, args.lengths,
                               dtype, device) for _, calls, _ in runs]
    sections = []
    for (backend, _, repeats), workload in zip(runs, workloads):
        print(f"replay: backend={backend}, {workload.calls} calls, {repeats} repeats",
              file=sys.stderr)
        sections.append(run_section(backend, workload, repeats, device))
    env = environment(device)
    config = configuration(args, workloads[0])
    text = markdown(sections, env, config)
    csv_path, md_path = write_results(args.out, "replay", csv_rows(sections, env, config),
                                      text)
    print(text)
    print(f"wrote {csv_path} and {md_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
