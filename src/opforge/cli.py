"""The ``opforge`` command: ``ops``, ``verify``, ``compile-check``, ``compare``,
``doctor``, ``calibrate``, ``profile``, ``analyse``, ``bench``, ``traffic``, ``demo``."""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import traceback
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

console = Console(width=160)


def _accelerator_present() -> bool:
    import torch

    return torch.cuda.is_available() or (hasattr(torch, "npu") and torch.npu.is_available())


def _triton_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def _ensure_interpreter(backends: Sequence[str], device: str | None) -> None:
    """Triton kernels on CPU tensors (no accelerator, or ``--device cpu``) run in
    Triton's interpreter, which must be switched on before the kernels are defined:
    re-run this command with it on. (``TRITON_INTERPRET=0`` set by the user is left
    alone: the Triton cases are then reported as skipped.)"""
    on_cpu = device == "cpu" or (device is None and not _accelerator_present())
    if "triton" in backends and os.environ.get("TRITON_INTERPRET") is None and on_cpu \
            and _triton_installed():
        os.environ["TRITON_INTERPRET"] = "1"
        os.execv(sys.executable, [sys.executable, "-m", "opforge", *sys.argv[1:]])


def cmd_ops(args: argparse.Namespace) -> int:
    import opforge
    from opforge.core.opdef import dtype_name

    table = Table(title="opforge operators", show_lines=True)
    for column in ("name", "inputs", "attributes", "dtypes", "backends", "autocast",
                   "precision standard"):
        table.add_column(column)
    for op in opforge.list_ops():
        inputs = ", ".join(a.name + ("?" if a.optional else "") for a in op.inputs)
        attrs = "\n".join(a.describe() for a in op.attrs) or "-"
        dtypes = ", ".join(dtype_name(d) for d in op.inputs[0].dtypes)
        spec = op.precision
        standard = f"{spec.category} {spec.level}" + (
            f"\n{len(spec.known_limitations)} known limitation(s)"
            if spec.known_limitations else "")
        table.add_row(op.name, inputs, attrs, dtypes, ", ".join(op.backends),
                      op.autocast.value, standard)
    console.print(table)
    return 0


def _error(message: str) -> int:
    """Print ``error: <message>`` on one line (no wrapping, no markup read from the
    message) and return the exit code of bad input, 2."""
    console.print(f"[red]error:[/] {_shown(message)}", soft_wrap=True)
    return 2


def _shown(text: object) -> str:
    """``text`` for a rich line: its markup escaped, and bytes no terminal can show (a
    path's surrogate escapes) as backslash escapes."""
    from rich.markup import escape

    return escape(str(text).encode("utf-8", "backslashreplace").decode("utf-8"))


def _figure(value: object) -> str:
    """A measured error, or ``-`` for none (every case skipped, no peer)."""
    number = float(value)
    return "-" if number != number else f"{number:.3g}"


def _device_problem(device: str) -> str | None:
    """Why ``device`` cannot run opforge's kernels here, in words (None: it can)."""
    import torch

    from opforge.core.backends import ACCELERATOR_TYPES

    try:
        kind = torch.device(device).type
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as error:  # torch's words for a missing device
        return f"device {device!r} is not usable here: {str(error).splitlines()[0]}"
    if kind not in ("cpu", *ACCELERATOR_TYPES):
        return f"device {device!r} holds no data opforge can compute on"
    return None


def _writable_directory(path: Path) -> str | None:
    """Create ``path`` (a directory) if needed; why that failed, or None."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return f"{path}: cannot be a directory here ({error.strerror or error})"
    if not os.access(path, os.W_OK):
        return f"{path}: not writable"
    return None


def _verify_outputs_problem(report: str | None, certificate: str | None) -> str | None:
    """Checked before the cases run (they take minutes): the report directory and the
    certificate's, and the certificate's name (Markdown; its plot is the .png twin)."""
    if certificate is not None and Path(certificate).suffix != ".md":
        return (f"--certificate {certificate}: name the Markdown file (.md); its plot is "
                "written next to it as .png")
    for directory in ([Path(report or "reports/verify")] if report or certificate else []) + (
            [Path(certificate).parent] if certificate else []):
        problem = _writable_directory(directory)
        if problem is not None:
            return problem
    return None


def cmd_verify(args: argparse.Namespace) -> int:
    import torch
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    import opforge
    from opforge.precision.verify import DTYPES, summarize, verify, write_report

    backends = ["torch", "triton"] if args.backend == "all" else [args.backend]
    # A name or dtype given twice is verified once.
    ops = ([opforge.get_op(name) for name in dict.fromkeys(args.ops)] if args.ops
           else opforge.list_ops())
    dtypes = ([getattr(torch, d) for d in dict.fromkeys(args.dtype)] if args.dtype
              else list(DTYPES))
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    problem = _device_problem(device)
    if problem is not None:
        return _error(problem)
    problem = _verify_outputs_problem(args.report, args.certificate)
    if problem is not None:
        return _error(problem)
    if args.backend == "all" and not _triton_installed():
        # An install without the triton extra has one backend to verify; asked for by
        # name, the triton backend's cases are reported as skipped (a non-zero exit).
        console.print("Triton is not installed: verifying the torch backend")
        backends = ["torch"]
    case_sets = ["samples", "sweep"] if args.cases == "all" else [args.cases]
    with Progress("[progress.description]{task.description}", BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                  transient=True, disable=args.quiet) as bar:
        task = bar.add_task("verify", total=None)

        def advance(total: int, result: object) -> None:
            if result is None:
                bar.update(task, total=total)
            else:
                bar.update(task, advance=1, description=f"verify {result.op} "
                                                        f"{result.backend} {result.dtype}")

        with warnings.catch_warnings():
            # The sweep overflows on purpose (inputs near the dtype's maximum); numpy,
            # under the interpreter and the references, then warns for every such case.
            # The results report it.
            warnings.filterwarnings("ignore", category=RuntimeWarning)
            results = verify(ops, dtypes, backends, device=device, seed=args.seed,
                             case_sets=case_sets, progress=advance)
    table = Table(title=f"opforge verify ({device}) — error vs the float64 golden, "
                        "opforge / torch")
    for column in ("op", "backend", "dtype", "standard", "cases", "pass", "warn", "known",
                   "fail", "max rel", "max eps", "status"):
        table.add_column(column, justify="left" if column in ("op", "backend", "dtype",
                                                              "standard", "status")
                         else "right")
    styles = {"pass": "[green]pass[/]", "FAIL": "[red]FAIL[/]", "known": "[yellow]known[/]",
              "warning": "[yellow]warning[/]", "skip": "[yellow]skip[/]"}
    rows = summarize(results)
    for row in rows:
        table.add_row(str(row["op"]), str(row["backend"]), str(row["dtype"]),
                      str(row["category"]), str(row["cases"]), str(row["pass"]),
                      str(row["warning"]), str(row["known"]),
                      str(int(row["fail"]) + int(row["error"])),
                      f"{_figure(row['max_rel'])} / {_figure(row['peer_max_rel'])}",
                      f"{_figure(row['max_eps'])} / {_figure(row['peer_max_eps'])}",
                      styles[str(row["status"])])
    console.print(table)
    for r in results:
        if r.status in ("fail", "error"):
            reason = "; ".join(r.reasons) or r.detail.splitlines()[0]
            console.print(f"[red]{r.op} / {r.case} / {r.backend} / {r.dtype}: {r.status}: "
                          f"{escape(reason)}")  # a reason names its output in brackets
    for row in rows:
        if row["status"] == "skip":
            console.print(f"[yellow]{row['op']} {row['backend']} skipped: {row['detail']}")
    if args.report or args.certificate:
        path = write_report(results, args.report or "reports/verify", ops, device, args.seed,
                            case_sets, certificate=args.certificate)
        console.print(f"report: {path}" + (f", certificate: {args.certificate}"
                                           if args.certificate else ""))
    counts = {s: sum(r.status == s for r in results)
              for s in ("pass", "warning", "known", "skip")}
    failed = sum(r.status in ("fail", "error") for r in results)
    console.print(f"{counts['pass']} passed, {counts['warning']} warnings, {counts['known']} "
                  f"known limitations, {failed} failed, {counts['skip']} skipped")
    # A case that could not run was not verified: a run that skipped some is no success.
    return 1 if failed or counts["skip"] else 0


def _backend_rows(backends: object) -> list[tuple[str, str]]:
    """The backend setting and what each kind of tensor gets under it (the doctor's
    rows); a bad ``OPFORGE_BACKEND`` is reported, not raised."""
    import torch

    try:
        setting = backends.requested_backend()
    except ValueError as error:
        return [("backend setting", f"invalid: {error}")]
    cpu = "torch"
    if setting == "triton":
        refusal = backends._triton_refusal(torch.device("cpu"))
        cpu = "triton" if refusal is None else f"triton, refused: {refusal}"
    return [("backend setting", setting), ("backend for cpu tensors", cpu),
            ("backend for accelerator tensors", "torch" if setting == "torch" else "triton")]


def _autotune_rows() -> list[tuple[str, str]]:
    """Whether plans time their tiling candidates, and where the choices are kept."""
    from opforge.core import autotune

    path = autotune.cache_path()
    stored = "none (OPFORGE_AUTOTUNE_CACHE is empty)" if path is None else str(path)
    if path is not None and path.exists():
        stored += f" ({autotune.stored_count()} choices)"
    try:
        setting = str(autotune.environment_setting())
    except ValueError as error:
        setting = f"invalid: {error}"
    return [("autotuning (OPFORGE_AUTOTUNE)", setting), ("  choices file", stored)]


def cmd_doctor(args: argparse.Namespace) -> int:
    import platform

    import torch

    from opforge.core import backends
    from opforge.core.hardware import profile_for

    triton_version = "not installed"
    if backends.triton_available():
        import triton

        triton_version = triton.__version__
    devices = ["cpu"] + [f"cuda:{i} ({torch.cuda.get_device_name(i)})"
                         for i in range(torch.cuda.device_count())]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    profile = profile_for(device)
    table = Table(title="opforge doctor", show_header=False)
    rows = [
        ("python", platform.python_version()),
        ("torch", torch.__version__),
        ("triton", triton_version),
        ("devices", ", ".join(devices)),
        *_backend_rows(backends),
        ("Triton interpreter (TRITON_INTERPRET)", str(backends.interpreter_enabled())),
        *_autotune_rows(),
        (f"hardware profile ({device})", f"{profile.name} ({profile.source})"),
        ("  memory bandwidth", f"{profile.memory_bandwidth / 1e9:.1f} GB/s"),
        ("  peak fp32 / bf16", f"{profile.peak(torch.float32) / 1e12:.2f} / "
                               f"{profile.peak(torch.bfloat16) / 1e12:.2f} TFLOP/s"),
        ("  on-chip per core", f"{profile.onchip_bytes // 1024} KiB"),
        ("  cores", str(profile.core_count)),
    ]
    for key, value in rows:
        table.add_row(key, value)
    console.print(table)
    return 0


def cmd_compile_check(args: argparse.Namespace) -> int:
    import torch

    import opforge
    from opforge.aot import compile_variants, parse_target, record_variants

    ops = [opforge.get_op(name) for name in args.ops] if args.ops else opforge.list_ops()
    dtypes = [getattr(torch, d) for d in args.dtype] if args.dtype else [
        torch.float32, torch.float16, torch.bfloat16]
    try:
        target, hardware = parse_target(args.target)
    except ValueError as error:
        return _error(str(error))
    if args.shapes:
        skipped = [op.name for op in ops if op.bench is None or not any(
            len(shape) == len(size) for shape in args.shapes
            for size in (*op.bench.cpu_shapes, *op.bench.shapes))]
        if skipped:
            console.print(f"{', '.join(skipped)}: no bench sizes of the form of "
                          f"{', '.join('x'.join(map(str, s)) for s in args.shapes)}: skipped "
                          "(a gradient operator is checked with its forward's: name the "
                          "forward)")
    if target.backend == "npu":
        return _lower_for_npu(ops, dtypes, target, hardware, args.target, args.quiet,
                              args.shapes)
    results = compile_variants(record_variants(ops, dtypes, hardware, args.candidates,
                                               target.arch, args.shapes), target)
    table = Table(title=f"opforge compile-check for {args.target}, tiled for {hardware.name} "
                        "(no device needed)")
    for column in ("kernel", "variant", "operators", "status", "s", "regs", "stack B",
                   "shared B"):
        table.add_column(column)
    for r in results:
        if args.quiet and r.ok and not r.spills:
            continue
        status = f"[red]FAIL[/] {r.error}" if not r.ok else \
            "[yellow]spills[/]" if r.spills else "[green]ok[/]"
        table.add_row(r.variant.name, r.variant.describe(), ", ".join(sorted(r.variant.ops)),
                      status, f"{r.seconds:.2f}", *(str(v) if v is not None else "-"
                                                    for v in (r.registers, r.stack_bytes,
                                                              r.shared_bytes)))
    console.print(table)
    failed = sum(not r.ok for r in results)
    spilled = sum(r.ok and r.spills for r in results)
    console.print(f"{len(results) - failed} passed ({spilled} of them spill registers to "
                  f"the stack), {failed} failed")
    return 1 if failed else 0


def _lower_for_npu(ops: Sequence[Any], dtypes: Sequence[Any], target: Any, hardware: Any,
                   name: str, quiet: bool, shapes: Sequence[tuple[int, ...]] | None) -> int:
    """compile-check for an Ascend target: each launch through triton-ascend's launcher,
    then lowered as far as this machine can (see `opforge.aot`)."""
    from opforge.aot import lower_npu_launches, record_npu_launches

    try:
        launches, refused = record_npu_launches(ops, dtypes, hardware, target, shapes)
    except RuntimeError as error:
        return _error(str(error))
    results = [*refused, *lower_npu_launches(launches, target)]
    table = Table(title=f"opforge compile-check for {name} ({target.arch}, triton-ascend), "
                        f"tiled for {hardware.name} (no device needed)")
    for column in ("kernel", "variant", "operators", "reached", "status", "s"):
        table.add_column(column, overflow="fold")
    for r in results:
        if quiet and r.ok and "tried again" not in r.error:
            continue
        status = "[green]ok[/]" if r.ok else "[red]FAIL[/]"
        table.add_row(r.kernel, r.description, ", ".join(sorted(r.ops)), r.reached or "-",
                      f"{status} {_shown(r.error)}", f"{r.seconds:.2f}")
    console.print(table)
    failed = sum(not r.ok for r in results)
    binaries = sum(r.reached == "binary" for r in results)
    console.print(f"{len(results) - failed} passed ({binaries} to a binary, the others to "
                  f"triton-ascend's linalg IR), {failed} failed")
    return 1 if failed else 0


def _run_steps(run: Path) -> dict[tuple[int, int], Callable[[], object]]:
    """``(rank, step) -> reader`` of an opforge dump or an msprobe dump (its root or one
    step folder)."""
    from opforge.precision import msprobe
    from opforge.precision.dump import read_step, step_folders, step_number

    if msprobe.is_msprobe_dump(run):
        return {place: functools.partial(msprobe.read_step, folder)
                for place, folder in msprobe.step_folders(run).items()}
    return {step_number(folder): functools.partial(read_step, folder)
            for folder in step_folders(run)}


def _write_compare_csv(path: Path, compared: Sequence[tuple[str, object, object, object]]
                       ) -> None:
    """Every compared entry of every step as a row of msprobe's comparison columns."""
    import csv

    from opforge.precision.dump import CSV_COLUMNS, csv_rows

    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(CSV_COLUMNS)
        for name, a, b, results in compared:
            writer.writerows(csv_rows(name, a, b, results))


def cmd_compare(args: argparse.Namespace) -> int:
    import torch

    from opforge.precision import msprobe
    from opforge.precision.dump import (
        DumpError,
        compare_steps,
        first_divergence,
        growth_point,
        plot_errors,
        unmatched,
    )

    run_a, run_b = Path(args.run_a), Path(args.run_b)
    try:
        steps_a, steps_b = _run_steps(run_a), _run_steps(run_b)
        if steps_a.keys() != steps_b.keys() and not args.intersection:
            raise DumpError(f"the runs hold different steps: "
                            f"{[f'rank{r}/step{s}' for r, s in sorted(steps_a)]} vs "
                            f"{[f'rank{r}/step{s}' for r, s in sorted(steps_b)]}")
        places = sorted(steps_a.keys() & steps_b.keys(), key=lambda place: place[::-1])
        if not places:
            raise DumpError("the runs share no step")
        tolerance = getattr(torch, args.dtype) if args.dtype else None
        compared, left_out = [], [0, 0]
        for rank, step in places:
            a, b = steps_a[rank, step](), steps_b[rank, step]()
            compared.append((f"rank{rank}/step{step}", a, b,
                             compare_steps(a, b, tolerance, intersection=args.intersection)))
            left_out = [total + count for total, count in zip(left_out, unmatched(a, b),
                                                              strict=True)]
    except DumpError as error:
        return _error(str(error))
    if args.csv:
        try:
            _write_compare_csv(Path(args.csv), compared)
        except OSError as error:
            return _error(f"--csv {args.csv}: {error.strerror or error}")
        console.print(f"csv: {_shown(args.csv)}")
    if args.intersection:
        console.print(f"--intersection: compared the entries both runs hold; left out "
                      f"{left_out[0]} of the reference only and {left_out[1]} of the other "
                      "run only")
    diverged = [item for item in compared if first_divergence(item[3]) is not None]
    # The earliest step that diverged on any rank, not rank 0's first (places are sorted
    # by step, then rank).
    name, step_a, _, results = diverged[0] if diverged else compared[0]
    first, growth = first_divergence(results), growth_point(results)
    table = Table(title=f"opforge compare {_shown(run_a)} (reference) vs {_shown(run_b)}: "
                        f"{name}")
    for column in ("#", "entry", "dtype", "cosine", "max abs", "max rel", "<1‰", "<5‰", ""):
        table.add_column(column)
    window = range(len(results)) if first is None else range(max(0, first - 10),
                                                             min(len(results), first + 10))
    for index in window:
        r = results[index]
        mark = ("[red]first divergence[/]" if index == first else
                "[yellow]error starts to grow[/]" if index == growth else "")
        table.add_row(str(index), _shown(r.key), r.dtype, f"{r.cosine:.6f}", f"{r.max_abs:.3g}",
                      f"{r.max_rel:.3g}", f"{r.thousandth_ratio:.4f}",
                      f"{r.five_thousandths_ratio:.4f}", mark)
    console.print(table)
    if args.plot:
        plot = Path(args.plot)
        plot = plot if plot.suffix else plot.with_suffix(".png")  # what matplotlib writes
        try:
            plot.parent.mkdir(parents=True, exist_ok=True)
            plot_errors(results, plot)
        except (OSError, ValueError) as error:  # exit 1 means "diverged": bad input is 2
            return _error(f"--plot {plot}: {getattr(error, 'strerror', None) or error}")
        console.print(f"plot: {_shown(plot)}")
    if first is None:
        console.print(f"no divergence in {len(compared)} step(s): the runs agree within the "
                      "standard of their lower-precision dtype")
        return 0
    # The module an API call ran in: the dump's own record (opforge), or construct.json's.
    call, phase = results[first].key.split("#")[1].split(".")[:2]
    scope = next((e.get("scope") for e in step_a.manifest["entries"]
                  if e["key"] == results[first].key), None) or msprobe.api_scopes(
        step_a.folder).get(f"{results[first].module}.{call}.{phase}")
    console.print(f"[red]diverged[/] at {name}: first divergent module "
                  f"{_shown(results[first].module or '<model>')}"
                  f"{f' (in {_shown(scope)})' if scope else ''} "
                  f"({_shown(results[first].key)}); error starts to grow at "
                  f"{_shown(results[growth].key) if growth is not None else '-'}")
    return 1


def cmd_calibrate(args: argparse.Namespace) -> int:
    import torch

    from opforge.core.hardware import calibrate, calibration_path

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    entry = calibrate(device)
    console.print(f"{device}: copy {entry['memory_bandwidth'] / 1e9:.1f} GB/s; matmul "
                  + ", ".join(f"{k} {v / 1e12:.2f} TFLOP/s"
                              for k, v in entry["peak_flops"].items()))
    console.print(f"cached in {calibration_path()}")
    return 0


def _is_interpreter(word: str) -> bool:
    """Whether ``word`` names a Python interpreter (``python``, ``python3.11``,
    ``/usr/bin/python3``, this one), not a script whose name starts with "python"."""
    import re

    return (re.fullmatch(r"python(\d+(\.\d+)?t?)?(\.exe)?", Path(word).name) is not None
            or Path(word).resolve() == Path(sys.executable).resolve())


def _is_python_source(path: Path) -> bool:
    try:
        compile(path.read_text(), str(path), "exec")
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return False
    return True


def _module_exists(name: str) -> bool:
    """Whether ``python -m name`` would find the module (the current directory first, as
    ``-m`` puts it on the path)."""
    import importlib.util

    sys.path.insert(0, os.getcwd())
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a missing parent package of a dotted name
        return False
    finally:
        sys.path.pop(0)


def _script(command: Sequence[str]) -> tuple[str, str, list[str]]:
    """(``"path"`` or ``"module"``, target, argv) of ``[python] script.py args``,
    ``[python] -m module args`` or ``command args`` (a Python console script found on
    ``PATH``, such as ``opforge``).

    Raises:
        ValueError: no script given, or none of that name (nor a Python command on PATH).
    """
    import shutil

    words = list(command)
    if words and words[0] == "--":
        words = words[1:]
    if words and _is_interpreter(words[0]):
        words = words[1:]
    if not words:
        raise ValueError("give the script to run, e.g. `opforge profile -- python train.py`")
    if words[0] == "-m":
        if len(words) < 2:
            raise ValueError("-m needs a module name")
        if not _module_exists(words[1]):
            raise ValueError(f"no module named {words[1]!r}")
        return "module", words[1], [words[1], *words[2:]]
    if Path(words[0]).is_file():
        return "path", words[0], words
    # A command by name, as a shell would find it; it runs in this interpreter, so it
    # must be Python source (console scripts are).
    found = shutil.which(words[0]) if os.sep not in words[0] else None
    if found is None:
        raise ValueError(f"no script {words[0]!r}, nor a command of that name on PATH")
    if not _is_python_source(Path(found)):
        raise ValueError(f"{found} is not a Python script: opforge profile runs the script "
                         "in its own interpreter")
    return "path", found, [found, *words[1:]]


def _exit_status(code: object) -> int:
    """The status Python exits with for ``sys.exit(code)``; like Python, print a message
    given instead of a number to stderr."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def cmd_profile(args: argparse.Namespace) -> int:
    import runpy

    import opforge

    try:
        kind, target, argv = _script(args.script)
    except ValueError as error:
        return _error(f"opforge profile: {error}")
    problem = _writable_directory(Path(args.out))
    if problem is not None:
        return _error(f"opforge profile: --out {problem}")
    # A bad --hardware is refused here, before the script runs.
    session = opforge.profile(args.out, with_stack=args.with_stack,
                              profile_memory=args.memory, hardware=args.hardware)
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = argv
    sys.path.insert(0, str(Path(target).resolve().parent) if kind == "path" else os.getcwd())
    status = 0
    try:
        with session:
            try:
                if kind == "path":
                    runpy.run_path(target, run_name="__main__")
                else:
                    runpy.run_module(target, run_name="__main__", alter_sys=True)
            except SystemExit as exit_:
                status = _exit_status(exit_.code)
    except Exception:  # the script's error: shown as Python shows it
        traceback.print_exc()
        status = 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    if session.result is None:
        console.print("no profile written: another profiler was already recording, or the "
                      "failed script's traces could not be read (see the warning)")
        return status or 1
    session.result.print_summary(console)
    console.print(f"profile written to {Path(args.out).resolve()}: open report.html, and "
                  "trace_view.json in https://ui.perfetto.dev")
    return status


def cmd_analyse(args: argparse.Namespace) -> int:
    from opforge.core.hardware import get_profile
    from opforge.profiler import analyse

    try:
        report = analyse(args.directory,
                         get_profile(args.hardware) if args.hardware else None)
    except (FileNotFoundError, ValueError, KeyError) as error:
        return _error(str(error))
    report.print_summary(console, top=args.top)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import torch

    from opforge.profiler import bench

    problem = (_device_problem(args.device) if args.device else None) or \
        _writable_directory(Path(args.out))
    if problem is not None:
        return _error(problem)
    try:
        results, files = bench.run(args.ops or None, device=args.device,
                                   dtype=getattr(torch, args.dtype), out_dir=args.out,
                                   shapes=args.shapes, compile=not args.no_compile,
                                   progress=not args.quiet)
    except ValueError as error:
        return _error(str(error))
    table = Table(title="opforge bench (MB: the least the operator must move; planned: "
                        "opforge's kernels by its account, in units of it)")
    for column in ("op", "shape", "impl", "ms", "MB", "planned", "GB/s", "TFLOP/s",
                   "vs torch", "error"):
        table.add_column(column, overflow="fold")
    for r in results:
        planned = (r.planned_bytes / r.bytes_moved if r.planned_bytes is not None
                   and r.bytes_moved else None)
        table.add_row(r.op, r.shape, r.impl, *("" if v is None else f"{v:.{d}f}" for v, d in (
            (r.ms, 4), (r.bytes_moved / 1e6 if r.ms is not None else None, 3), (planned, 2),
            (r.gbs, 1), (r.tflops, 3), (r.speedup, 2))), r.error[:60])
    console.print(table)
    for r in results:
        if r.ms is None and r.impl == "opforge":
            console.print(f"{r.op} {r.shape}: {r.error}", markup=False, highlight=False,
                          soft_wrap=True)
    for path in files:
        console.print(f"wrote {path}")
    if all(r.ms is None for r in results):
        return 2
    return 1 if any(r.error and r.impl == "opforge" for r in results) else 0


def cmd_traffic(args: argparse.Namespace) -> int:
    import torch

    import opforge
    from opforge.core.hardware import get_profile
    from opforge.profiler.bench import shape_form
    from opforge.profiler.results import environment, write_results
    from opforge.profiler.traffic import audit_ops, traffic_markdown

    get_profile(args.hardware)  # an unknown name is an AttrError: one error line
    ops = [opforge.get_op(name) for name in args.ops] if args.ops else [
        op for op in opforge.list_ops() if op.bench is not None]
    without = [op.name for op in ops if op.bench is None]
    if without:
        return _error(f"{', '.join(without)}: no bench sizes (a gradient operator is "
                      "audited with its forward's: name the forward)")
    results = audit_ops(ops, getattr(torch, args.dtype), args.hardware,
                        args.shapes or None, all_sizes=args.all_sizes)
    audited = {r.op for r in results}
    for op in ops:
        if op.name not in audited:
            console.print(f"{op.name}: takes sizes of {shape_form(op.bench)}, not "
                          f"{', '.join('x'.join(map(str, s)) for s in args.shapes)}: skipped")
    table = Table(title=f"Memory traffic per call, tiled for {args.hardware} "
                        "(counted by Triton's interpreter), in units of the least")
    for column in ("op", "case", "variant", "least MB", "planned", "footprint",
                   "requested", "kernels (launches)"):
        table.add_column(column, overflow="fold")
    for r in results:
        table.add_row(r.op, r.case, r.variant, f"{r.least / 1e6:.3f}",
                      *(f"{value / r.least:.2f}" if r.least else "-"
                        for value in (r.planned, r.footprint, r.requested)),
                      ", ".join(f"{k.kernel} ({k.launches})" for k in r.kernels))
    console.print(table)
    if args.out:
        problem = _writable_directory(Path(args.out))
        if problem is not None:
            return _error(problem)
        rows = [{"op": r.op, "case": r.case, "variant": r.variant, "kernel": k.kernel,
                 "launches": k.launches, "read_bytes": k.read, "written_bytes": k.written,
                 "footprint_bytes": k.footprint, "call_least_bytes": r.least,
                 "call_planned_bytes": r.planned} for r in results for k in r.kernels]
        env = environment(torch.device("cpu"))
        paths = write_results(Path(args.out), "traffic", rows, traffic_markdown(
            results, args.hardware, args.dtype, env))
        for path in paths:
            console.print(f"wrote {path}")
    return 0


def _shapes(text: str) -> list[tuple[int, ...]]:
    """``1024x4096,4096x4096`` as shapes (argparse type: a malformed size is a usage
    error)."""
    try:
        shapes = [tuple(int(d) for d in size.split("x")) for size in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not sizes like 1024x4096,4096x4096"
                                         ) from None
    if any(d <= 0 for shape in shapes for d in shape):
        raise argparse.ArgumentTypeError(f"{text!r}: sizes must be positive")
    return shapes


def _count(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``minimum`` (and at most ``maximum``),
    else a usage error."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(
                f"{text!r} is not an integer >= {minimum}"
                + (f" and <= {maximum}" if maximum is not None else ""))
        return value
    return parse


def _demo_problem(args: argparse.Namespace) -> str | None:
    """What makes a demo command fail before it trains, in words (``None``: nothing): a
    device this machine lacks, a model the sizes cannot build, an output that cannot be
    written."""
    import torch

    from opforge.demo import load_example

    try:
        device = torch.device(args.device) if args.device else None
    except RuntimeError as error:
        return f"--device {args.device}: {error}"
    if device is not None and device.type == "cuda" and not torch.cuda.is_available():
        return "--device cuda: no CUDA device on this machine"
    if device is not None and device.type not in ("cpu", "cuda"):
        return f"--device {args.device}: the demo runs on cpu or cuda"
    try:
        example = load_example()
    except FileNotFoundError as error:
        return str(error)
    try:
        with torch.device("meta"):
            example.TinyMoELM(64, max_seq=16, **(args.model or {}))
    except (ValueError, AssertionError, RuntimeError) as error:
        return f"--model {args.model}: {error}"
    writable = [Path(args.out)] + ([Path(args.doc).parent] if args.study and args.doc else [])
    for path in writable:
        # Made now, not after training: permission bits do not stop root, the file system
        # may (/proc).
        try:
            path.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=path):
                pass
        except OSError as error:
            return f"{path}: not a writable directory ({error.strerror or error})"
    return None


def _model_sizes(text: str) -> dict[str, int]:
    """``dim=64,layers=1`` as a dict (argparse type: a malformed item is a usage error)."""
    from opforge.demo.training import MODEL_SIZES

    sizes = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        key = key.strip()
        if key not in MODEL_SIZES or not value.strip().isdigit():
            raise argparse.ArgumentTypeError(
                f"{item!r} is not NAME=INTEGER with NAME one of {', '.join(MODEL_SIZES)}")
        sizes[key] = int(value)
    return sizes


def cmd_demo(args: argparse.Namespace) -> int:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from opforge import demo

    problem = _demo_problem(args)
    if problem is not None:
        return _error(f"opforge demo: {problem}")
    model = args.model or {}
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/"
               "{task.total}"), TimeElapsedColumn(), TextColumn("loss {task.fields[loss]}"))
    if args.study:
        runs = demo.STUDY_RUNS
        with Progress(*columns, console=console, disable=args.quiet) as bar:
            tasks = {run.name: bar.add_task(run.name, total=args.study_steps, loss="-")
                     for run in runs}

            def study_step(name: str, step: int, loss: float) -> None:
                bar.update(tasks[name], completed=step + 1, loss=f"{loss:.3f}")

            result = demo.run_study(Path(args.out) / "study", steps=args.study_steps,
                                    batch=args.batch, model=model, device=args.device,
                                    dump_every=args.dump_every,
                                    doc=Path(args.doc) if args.doc else None,
                                    on_step=study_step)
        console.print(result.markdown, markup=False, highlight=False)
        for path in result.files:
            console.print(f"wrote {path}")
        return 0
    with Progress(*columns, console=console, disable=args.quiet) as bar:
        task = bar.add_task("training", total=args.steps, loss="-")
        run, index = demo.run_demo(
            args.out, steps=args.steps, batch=args.batch, dtype=args.dtype, device=args.device,
            model=model, profile_steps=(args.profile_from, args.profile_steps),
            on_step=lambda step, loss: bar.update(task, completed=step + 1,
                                                  loss=f"{loss:.3f}"))
    val = run.val_losses[-1][1] if run.val_losses else float("nan")
    console.print(f"trained {run.config.steps} steps on {run.device} in {run.seconds:.1f} s: "
                  f"loss {run.losses[0]:.3f} -> {run.final_loss:.3f} (validation {val:.3f}); "
                  f"monitor: {len(run.alerts)} alert(s)")
    if run.profile is not None:
        top = run.profile.by_name()[:3]
        console.print("profile: " + "; ".join(
            f"{s.type} {s.ratio:.0f}% of kernel time, {s.verdict.bound}" for s in top))
    console.print(f"sample: {run.sample[:120]!r}", markup=False)
    console.print(f"report: {index.resolve()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="opforge", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("ops", help="list operators: inputs, attributes, dtypes, backends")
    verify = sub.add_parser("verify", help="check operators against the float64 golden")
    verify.add_argument("ops", nargs="*", help="operator names (default: all)")
    verify.add_argument("--dtype", action="append",
                        choices=["float32", "float16", "bfloat16"],
                        help="dtype to check (repeatable; default: all three)")
    verify.add_argument("--backend", default="all", choices=["all", "torch", "triton"],
                        help="all: torch and triton (torch alone where Triton is not "
                             "installed)")
    verify.add_argument("--device", default=None, help="cpu or cuda (default: cuda if any)")
    verify.add_argument("--seed", type=_count(0, 2**63 - 1), default=0)
    verify.add_argument("--cases", default="all", choices=["all", "samples", "sweep"],
                        help="the operators' own samples, the precision.cases sweep, or both")
    verify.add_argument("--report", default=None,
                        help="directory for verify.md, verify.json and verify.png")
    verify.add_argument("--certificate", default=None,
                        help="also write the report as this Markdown file, with its .png plot")
    verify.add_argument("--quiet", action="store_true", help="no progress bar")
    check = sub.add_parser("compile-check",
                           help="compile every kernel variant for a GPU target, no GPU needed")
    check.add_argument("ops", nargs="*", help="operator names (default: all)")
    check.add_argument("--target", default="cuda:90",
                       help="cuda:<cc> (default cuda:90), or ascend910b (with triton-ascend "
                            "installed: lowered through its linalg IR, to a binary with CANN)")
    check.add_argument("--candidates", action="store_true",
                       help="every tiling candidate autotuning could time, not only the "
                            "first that fits")
    check.add_argument("--dtype", action="append",
                       choices=["float32", "float16", "bfloat16"])
    check.add_argument("--shapes", default=None, type=_shapes,
                       help="compile the kernels opforge bench's calls launch at these sizes "
                            "(and their backward's), e.g. 4096x16384, instead of the "
                            "samples'")
    check.add_argument("--quiet", action="store_true",
                       help="list only the variants that failed or spill, then the totals")
    compare = sub.add_parser("compare", help="find where two dumped runs diverge")
    compare.add_argument("run_a", help="reference run: an opforge dump (precision.dump) or "
                                       "an msprobe dump (its dump_path or a step folder)")
    compare.add_argument("run_b", help="run to check (either kind)")
    compare.add_argument("--intersection", action="store_true",
                         help="compare only the steps and entries both runs hold (and say "
                              "how many were left out) instead of refusing runs that differ")
    compare.add_argument("--csv", default=None,
                         help="also write every compared entry to this CSV, in msprobe's "
                              "comparison columns")
    compare.add_argument("--dtype", default=None, choices=["float16", "bfloat16"],
                         help="judge every entry with at least this dtype's tolerance (the "
                              "compute dtype of an autocast run)")
    compare.add_argument("--plot", default="reports/compare.png",
                         help="PNG of error against depth ('' for none)")
    sub.add_parser("doctor", help="versions, devices, backend, hardware profile")
    calibrate = sub.add_parser("calibrate", help="measure copy bandwidth and matmul rate")
    calibrate.add_argument("--device", default=None)
    profile = sub.add_parser(
        "profile", help="run a script under the profiler: opforge profile -- python x.py")
    profile.add_argument("--out", default="opforge_profile",
                         help="directory of the profile files (default ./opforge_profile)")
    profile.add_argument("--hardware", default=None,
                         help="judge against this hardware profile (h100, h200, a100, "
                              "ascend910b, cpu)")
    profile.add_argument("--with-stack", action="store_true", help="record Python frames")
    profile.add_argument("--memory", action="store_true",
                         help="record allocations (operator_memory.csv, the peak)")
    profile.add_argument("script", nargs=argparse.REMAINDER,
                         help="-- python script.py [args] (or -m module [args], or a Python "
                              "command on PATH: -- opforge demo)")
    analyse = sub.add_parser("analyse", help="summary and verdicts of a profile directory")
    analyse.add_argument("directory")
    analyse.add_argument("--hardware", default=None,
                         help="re-judge against this hardware profile")
    analyse.add_argument("--top", type=_count(1), default=15, help="kernels to list")
    bench = sub.add_parser("bench", help="operators against torch eager, torch.compile, "
                                         "Liger-Kernel over a sweep of sizes")
    bench.add_argument("ops", nargs="*", help="operator names (default: all with a sweep)")
    bench.add_argument("--device", default=None, help="cpu or cuda (default: cuda if any)")
    bench.add_argument("--dtype", default="bfloat16",
                       choices=["float32", "float16", "bfloat16"])
    bench.add_argument("--shapes", default=None, type=_shapes,
                       help="sizes instead of the operators' sweeps, e.g. 1024x4096,4096x4096 "
                            "(each operator takes its own form: matmul one number, 256; an "
                            "operator given another form reports it and the others run)")
    bench.add_argument("--out", default="bench_results", help="directory of the results")
    bench.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    bench.add_argument("--quiet", action="store_true", help="no progress bar")
    traffic = sub.add_parser("traffic", help="bytes each kernel moves against the least "
                                             "the operator must move (Triton's interpreter)")
    traffic.add_argument("ops", nargs="*",
                         help="operator names (default: all with bench sizes; a forward's "
                              "gradient operators are audited with it)")
    traffic.add_argument("--hardware", default="h200",
                         help="the hardware profile the kernels are tiled for (default h200)")
    traffic.add_argument("--dtype", default="bfloat16",
                         choices=["float32", "float16", "bfloat16"])
    traffic.add_argument("--shapes", default=None, type=_shapes,
                         help="sizes instead of the first of each operator's CPU bench "
                              "sizes, e.g. 256x8192")
    traffic.add_argument("--all-sizes", action="store_true",
                         help="every CPU bench size, not only the first (slow: matmul)")
    traffic.add_argument("--out", default=None, help="directory for the CSV and Markdown")
    demo = sub.add_parser("demo", help="train the tiny MoE language model with the monitor "
                                       "and profiler on; write reports/index.html")
    demo.add_argument("--out", default="reports", help="report directory (default reports)")
    demo.add_argument("--steps", type=_count(1), default=400)
    demo.add_argument("--batch", type=_count(1), default=32)
    demo.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    demo.add_argument("--device", default=None, help="cpu or cuda (default: cuda if any)")
    demo.add_argument("--model", default=None, type=_model_sizes,
                      help="model sizes, e.g. dim=64,layers=1,heads=2,hidden=64,experts=4,k=2")
    demo.add_argument("--profile-from", type=_count(0), default=10,
                      help="first profiled step, from 0 (past the last step: no profile)")
    demo.add_argument("--profile-steps", type=_count(1), default=3, help="steps profiled")
    demo.add_argument("--study", action="store_true",
                      help="the precision study instead: five precision settings")
    demo.add_argument("--study-steps", type=_count(1), default=400)
    demo.add_argument("--dump-every", type=_count(1), default=10,
                      help="steps between the study's statistics dumps")
    demo.add_argument("--doc", default=None,
                      help="also write the study's Markdown here (docs/precision-study.md)")
    demo.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "verify" and argv is None:
        _ensure_interpreter(["torch", "triton"] if args.backend == "all" else [args.backend],
                            args.device)
    if args.command == "profile" and argv is None:
        # A profiled opforge command (verify) cannot restart itself with the interpreter
        # on without ending the profile: the profile command starts with it on (CPU
        # tensors still go to the torch backend unless a backend is chosen).
        _ensure_interpreter(["triton"], None)
    if args.command == "traffic" and argv is None:
        _ensure_interpreter(["triton"], "cpu")
    if (args.command == "compile-check" and argv is None
            and os.environ.get("TRITON_INTERPRET", "0") != "0"):
        # Compiling needs real JITFunctions, which Triton only makes without the interpreter.
        del os.environ["TRITON_INTERPRET"]
        os.execv(sys.executable, [sys.executable, "-m", "opforge", *sys.argv[1:]])
    handler = {"ops": cmd_ops, "verify": cmd_verify, "doctor": cmd_doctor,
               "calibrate": cmd_calibrate, "compile-check": cmd_compile_check,
               "compare": cmd_compare, "profile": cmd_profile, "analyse": cmd_analyse,
               "bench": cmd_bench, "traffic": cmd_traffic, "demo": cmd_demo}[args.command]
    from opforge.core.errors import OpError

    try:
        return handler(args)
    except OpError as error:
        return _error(str(error))


if __name__ == "__main__":
    sys.exit(main())
