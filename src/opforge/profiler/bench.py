"""``opforge bench``: each operator against its peers over a sweep of sizes.

For every operator that declares a `BenchSpec`, at each size of its sweep, the runner plans
the call once and times, side by side in one run:

- ``opforge``: `Plan.run` (phase two of the call: the kernel and its launch);
- ``torch``: the operator's torch peer (`PrecisionSpec.peer`) in eager mode;
- ``torch.compile``: the same peer compiled (skipped with ``compile=False``);
- any extra peer the operator declares (Liger-Kernel when installed).

Each result carries the achieved GB/s and TFLOP/s from the operator's declared cost (the
same FLOPs and bytes for every implementation) and the speed-up over torch eager. On a GPU
the time is Triton's ``do_bench`` median (the L2 cache flushed between calls); on the CPU
the median of timed calls after a warm-up. Results go to ``bench_<date>_<time>.csv`` and
``.md`` plus one PNG per operator (achieved rate against size, the hardware's ceiling
drawn).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from opforge.core.hardware import HardwareProfile, median_seconds, profile_for
from opforge.core.opdef import BenchSpec, Case, OpDef
from opforge.core.plan import plan
from opforge.core.registry import get_op, list_ops
from opforge.profiler.results import environment, write_results
from opforge.profiler.traffic import planned_bytes

CPU_BUDGET_S = 0.2
CPU_MAX_REPEATS = 50


@dataclass
class BenchResult:
    """One implementation of one operator at one size."""

    op: str
    shape: str
    dtype: str
    impl: str
    ms: float | None
    gbs: float | None
    tflops: float | None
    speedup: float | None
    flops: float
    bytes_moved: float
    error: str = ""
    planned_bytes: float | None = None  # opforge's kernels, by the operator's account


def benchmarked_ops() -> list[str]:
    """Names of the operators that declare a `BenchSpec`."""
    return [op.name for op in list_ops() if op.bench is not None]


def time_call(fn: Callable[[], Any], device: torch.device) -> float:
    """Median seconds of one call of ``fn`` (after a warm-up call)."""
    fn()
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn)) * 1e-3
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    repeats = int(min(CPU_MAX_REPEATS, max(3, CPU_BUDGET_S / once)))
    return median_seconds(fn, device, repeats)


def shape_form(spec: BenchSpec) -> str:
    """The sizes an operator's sweep takes, in words: ``"1 number, like 256"``."""
    ranks = sorted({len(shape) for shape in (*spec.cpu_shapes, *spec.shapes)})
    numbers = " or ".join(str(rank) for rank in ranks)
    example = "x".join(str(d) for d in spec.cpu_shapes[0])
    return f"{numbers} number{'s' if ranks != [1] else ''}, like {example}"


def case_at(opdef: OpDef, spec: BenchSpec, shape: tuple[int, ...], dtype: torch.dtype,
          device: torch.device) -> Case:
    generator = torch.Generator().manual_seed(0)
    if spec.case is not None:
        return spec.case(shape, dtype, device, generator)
    from opforge.precision.verify import default_sweep

    build = opdef.precision.sweep or default_sweep(opdef)
    return build("normal", shape, dtype, device, generator)[0]


def _implementations(opdef: OpDef, spec: BenchSpec, case: Case, compile: bool
                     ) -> list[tuple[str, Callable[[], Any]]]:
    planned = plan(opdef, *case.inputs, **case.attrs)
    impls: list[tuple[str, Callable[[], Any]]] = [
        ("opforge", lambda: planned.run(*case.inputs))]
    peer = opdef.precision.peer
    if peer is not None:
        attrs = dict(planned.attrs)
        impls.append(("torch", lambda: peer(*case.inputs, **attrs)))
        if compile:
            compiled = torch.compile(peer, dynamic=False)
            impls.append(("torch.compile", lambda: compiled(*case.inputs, **attrs)))
    for name, factory in spec.peers.items():
        fn = factory(case)
        if fn is not None:
            impls.append((name, fn))
    return impls


def bench_op(name: str, *, device: torch.device, dtype: torch.dtype,
             shapes: Sequence[tuple[int, ...]] | None = None, compile: bool = True,
             advance: Callable[[str], None] | None = None) -> list[BenchResult]:
    """Benchmark one operator over its sweep (or ``shapes``).

    A size the operator cannot take (another number of dimensions than its sweep's, or
    inputs its plan refuses) gives one result with no time and the error, naming the form
    of size the operator takes; the other sizes still run.

    Raises:
        OpError: unknown operator; ValueError: the operator declares no `BenchSpec`.
    """
    opdef = get_op(name)
    spec = opdef.bench
    if spec is None:
        raise ValueError(f"{name} has no benchmark sweep; operators with one: "
                         f"{', '.join(benchmarked_ops())}")
    sweep = shapes or (spec.cpu_shapes if device.type == "cpu" else spec.shapes)
    results = []
    ranks = {len(s) for s in (*spec.cpu_shapes, *spec.shapes)}
    for shape in sweep:
        label = "x".join(str(d) for d in shape)
        refused = f"{name} takes sizes of {shape_form(spec)}, not {label}"
        try:
            if len(shape) in ranks:
                case = case_at(opdef, spec, tuple(shape), dtype, device)
                planned = plan(opdef, *case.inputs, **case.attrs)
                cost = planned.cost
                # Each kernel of the account launched once: true of every benchmarked
                # operator but a composite (its steps, its kernels once a block of
                # classes), whose account `opforge traffic` counts launch by launch.
                planned_moved = planned_bytes(planned, defaultdict(lambda: 1))
                refused = ""
        except Exception as failure:  # reported with the size it failed for
            refused += f": {type(failure).__name__}: {failure}"
        if refused:
            results.append(BenchResult(name, label, str(dtype).removeprefix("torch."),
                                       "opforge", None, None, None, None, 0.0, 0.0,
                                       refused[:300]))
            continue
        baseline = None
        for impl, fn in _implementations(opdef, spec, case, compile):
            if advance is not None:
                advance(f"{name} {label} {impl}")
            try:
                seconds: float | None = time_call(fn, device)
                error = ""
            except Exception as failure:  # a peer that cannot run this size is reported
                seconds, error = None, f"{type(failure).__name__}: {failure}"[:200]
            if impl == "torch":
                baseline = seconds
            results.append(BenchResult(
                name, label, str(dtype).removeprefix("torch."), impl,
                None if seconds is None else seconds * 1e3,
                None if seconds is None else cost.bytes_moved / seconds / 1e9,
                None if seconds is None else cost.flops / seconds / 1e12, None,
                float(cost.flops), float(cost.bytes_moved), error,
                float(planned_moved) if impl == "opforge" and seconds is not None
                and not planned.steps else None))
        for result in results:
            if result.shape == label and result.ms and baseline:
                result.speedup = baseline * 1e3 / result.ms
    return results


def plot_op(results: Sequence[BenchResult], spec: BenchSpec, hardware: HardwareProfile,
            dtype: torch.dtype, path: Path) -> Path:
    """Achieved rate against size for each implementation, the hardware's ceiling drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r.shape for r in results))
    figure, axes = plt.subplots(figsize=(7, 4.5), dpi=110)
    gbs = spec.metric == "GB/s"
    for impl in dict.fromkeys(r.impl for r in results):
        points = [(shapes.index(r.shape), r.gbs if gbs else r.tflops) for r in results
                  if r.impl == impl and r.ms is not None]
        if points:
            axes.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=impl)
    ceiling = hardware.memory_bandwidth / 1e9 if gbs else hardware.peak(dtype) / 1e12
    axes.axhline(ceiling, color="black", linestyle="--",
                 label=f"{hardware.name} ceiling ({hardware.source}): {ceiling:.3g} "
                       f"{spec.metric}")
    axes.set_xticks(range(len(shapes)), shapes, rotation=20, fontsize=8)
    axes.set_xlabel("size")
    axes.set_ylabel(f"achieved {spec.metric}")
    axes.set_title(f"{results[0].op} ({results[0].dtype})")
    axes.set_yscale("log")
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path


def _markdown(results: Sequence[BenchResult], env: dict[str, str]) -> str:
    lines = ["# opforge bench", "", ", ".join(f"{k}: {v}" for k, v in env.items()), "",
             "GB/s is the least the operator must move (MB: inputs read once, outputs "
             "written once) over the time; `planned` is what opforge's kernels move by the "
             "operator's account, in units of that least (`opforge traffic` measures it).",
             "", "| op | shape | impl | ms | MB | planned | GB/s | TFLOP/s | "
             "speed-up vs torch | error |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        def cell(value: float | None, digits: int) -> str:
            return "" if value is None else f"{value:.{digits}f}"
        planned = (r.planned_bytes / r.bytes_moved if r.planned_bytes is not None
                   and r.bytes_moved else None)
        lines.append(f"| {r.op} | {r.shape} | {r.impl} | {cell(r.ms, 4)} | "
                     f"{cell(r.bytes_moved / 1e6, 3)} | {cell(planned, 2)} | {cell(r.gbs, 1)} | "
                     f"{cell(r.tflops, 3)} | {cell(r.speedup, 2)} | {r.error} |")
    return "\n".join(lines) + "\n"


def run(ops: Sequence[str] | None = None, *, device: str | torch.device | None = None,
        dtype: torch.dtype = torch.bfloat16, out_dir: str | Path = "bench_results",
        shapes: Sequence[tuple[int, ...]] | None = None, compile: bool = True,
        progress: bool = True) -> tuple[list[BenchResult], list[Path]]:
    """Benchmark ``ops`` (default: every operator with a `BenchSpec`) and write the results.

    Returns:
        The results and the files written (CSV, Markdown, one PNG per operator).
    """
    from rich.progress import Progress

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    names = list(ops) if ops else benchmarked_ops()
    specs = {name: get_op(name).bench for name in names}
    without = [name for name, spec in specs.items() if spec is None]
    if without:
        raise ValueError(f"{', '.join(without)}: no benchmark sweep; operators with one: "
                         f"{', '.join(benchmarked_ops())}")
    steps = sum(len(shapes or (s.cpu_shapes if device.type == "cpu" else s.shapes))
                * (2 + compile + len(s.peers)) for s in specs.values() if s is not None)
    results: list[BenchResult] = []
    files: list[Path] = []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hardware = profile_for(device)
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("bench", total=max(steps, 1))

        def advance(label: str) -> None:
            bar.update(task, advance=1, description=label)

        for name in names:
            op_results = bench_op(name, device=device, dtype=dtype, shapes=shapes,
                                  compile=compile, advance=advance)
            results.extend(op_results)
            spec = specs[name]
            assert spec is not None
            if any(r.ms is not None for r in op_results):
                files.append(plot_op(op_results, spec, hardware, dtype,
                                     out / f"bench_{name}.png"))
    env = environment(device)
    rows = [asdict(r) for r in results]
    csv_path, md_path = write_results(out, "bench", rows, _markdown(results, env))
    return results, [csv_path, md_path, *files]
