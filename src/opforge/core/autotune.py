"""Measured tiling choice: time the candidates that fit on the call's own tensors, keep the
fastest.

An operator's tiling lists its candidates in order of preference, and `plan` takes the
first that fits on chip: block sizes from tables and rules, the same on every device of a
profile. With autotuning on, the first plan of a tiling bucket (the power-of-two buckets of
the input shapes, with the attributes and the hardware profile) on the Triton backend runs
each fitting candidate, up to `max_candidates`, on the tensors of that call, and keeps the
fastest for the bucket. Candidates that fail to compile or launch (too much shared memory,
a Triton without warp specialization) are skipped and recorded.

The choice is kept in the plan's tiling cache and in a JSON file keyed by operator, bucket,
attributes, hardware profile, device name and Triton version, so that a later process on
the same machine takes it without timing again (a stored choice that is no longer among
the candidates, after a change of the tiling, is timed again).

Nothing is timed (the first fitting candidate is taken, as without autotuning) when only
one candidate fits; for an operator that updates an input in place from what it holds (each
timing run would update it again; one that only overwrites, such as a cache scatter, is
timed, see `TensorArg.write_only`, unless it shares memory with another input); for fake
or meta tensors; during CUDA graph capture; and while torch.compile traces.

Settings: `set_autotune` / the `autotuning` block (innermost wins, per thread), else
``OPFORGE_AUTOTUNE`` (``1``/``true``/``yes``/``on``, or ``0``/``false``/``no``/``off``;
default off; read on first use and again by ``set_autotune(None)``);
``OPFORGE_AUTOTUNE_CACHE`` the file (default ``$OPFORGE_CACHE_DIR/autotune.json``, else
``~/.cache/opforge/autotune.json``; empty: no file); ``OPFORGE_AUTOTUNE_MAX`` the number of
candidates timed (a positive integer, default 12). The tuning runs are marked
``opforge::autotune`` for the profiler, which leaves them out of the operator's time, as it
does torch.compile's compilations.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from opforge.core import settings
from opforge.core.errors import OpError
from opforge.core.opdef import Tiling

DEFAULT_MAX_CANDIDATES = 12
# do_bench budget per candidate (ms): the bucket's first call pays it once per candidate.
WARMUP_MS, REP_MS = 10, 40
# Timed runs per candidate off the GPU (the interpreter: a check of the mechanism).
HOST_RUNS = 3

_state = threading.local()
_lock = threading.Lock()
_stored: dict[str, Any] | None = None  # the file's entries, read on first use


@dataclass
class TuningRecord:
    """One bucket's choice.

    Attributes:
        op: operator name.
        key: the bucket (operator, input buckets, attributes, hardware, device, Triton).
        choice: `describe` of the chosen tiling.
        timings_us: per candidate (`describe`), its time in µs, or the error that
            excluded it.
        source: ``"measured"`` (timed by this process) or ``"file"`` (the choices file's).
    """

    op: str
    key: str
    choice: str
    timings_us: dict[str, float | str] = field(default_factory=dict)
    source: str = "measured"


_records: dict[str, TuningRecord] = {}  # by key, in the order the buckets were chosen
_bucket_locks: dict[str, threading.Lock] = {}
_ON, _OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")
_environment: list[bool] = []  # OPFORGE_AUTOTUNE, once read


def environment_setting() -> bool:
    """``OPFORGE_AUTOTUNE`` read now: on or off.

    Raises:
        ValueError: the value is not an on/off word.
    """
    text = os.environ.get("OPFORGE_AUTOTUNE", "").strip().lower()
    if text not in _ON + _OFF:
        raise ValueError(f"OPFORGE_AUTOTUNE={os.environ['OPFORGE_AUTOTUNE']!r}: expected one "
                         f"of {', '.join(_ON)} (on) or {', '.join(_OFF[1:])} (off)")
    return text in _ON


def autotune_enabled() -> bool:
    """Whether plans time their tiling candidates: the innermost `autotuning` block or
    `set_autotune` of this thread, else ``OPFORGE_AUTOTUNE``.

    Raises:
        ValueError: ``OPFORGE_AUTOTUNE`` is not an on/off word.
    """
    stack = getattr(_state, "stack", None)
    if stack:
        return stack[-1]
    if not _environment:
        _environment.append(environment_setting())
    return _environment[0]


def _outside_compilation(what: str) -> None:
    # A setting entered while torch.compile traces would apply to the tracing only.
    if torch.compiler.is_compiling():
        raise RuntimeError(f"opforge.{what} inside a torch.compile'd function would only "
                           "apply while tracing: call it around the compiled call")


def set_autotune(enabled: bool | None) -> None:
    """Turn autotuning on or off for this thread (``None``: back to ``OPFORGE_AUTOTUNE``,
    read again).

    Raises:
        RuntimeError: called inside a function being compiled by torch.compile.
        ValueError: with ``None``, ``OPFORGE_AUTOTUNE`` is not an on/off word.
    """
    _outside_compilation("set_autotune")
    if enabled is None:
        _environment[:] = [environment_setting()]
        settings.reload_environment()  # every thread's key holds the old reading
    _state.stack = [] if enabled is None else [bool(enabled)]
    settings.changed()


@contextlib.contextmanager
def autotuning(enabled: bool = True) -> Iterator[None]:
    """Autotuning on (or off) inside the block, for this thread.

    Raises:
        RuntimeError: entered inside a function being compiled by torch.compile (it would
            apply only while tracing; torch.compile then runs that function eagerly, and
            ``fullgraph=True`` reports the error).
    """
    _outside_compilation("autotuning")
    stack = getattr(_state, "stack", None)
    if stack is None:
        stack = _state.stack = []
    stack.append(bool(enabled))
    settings.changed()
    try:
        yield
    finally:
        stack.pop()
        settings.changed()


def max_candidates() -> int:
    """Candidates timed per bucket (``OPFORGE_AUTOTUNE_MAX``, default 12).

    Raises:
        ValueError: the variable is set but not a positive integer.
    """
    text = os.environ.get("OPFORGE_AUTOTUNE_MAX", "").strip()
    if not text:
        return DEFAULT_MAX_CANDIDATES
    if not (text.isascii() and text.isdigit() and int(text) > 0):
        raise ValueError(f"OPFORGE_AUTOTUNE_MAX={os.environ['OPFORGE_AUTOTUNE_MAX']!r}: "
                         "expected a positive integer")
    return int(text)


def cache_path() -> Path | None:
    """The choices file: ``OPFORGE_AUTOTUNE_CACHE`` (``None`` when set empty), else
    ``autotune.json`` in ``$OPFORGE_CACHE_DIR`` or ``~/.cache/opforge``."""
    text = os.environ.get("OPFORGE_AUTOTUNE_CACHE")
    if text is None:
        root = os.environ.get("OPFORGE_CACHE_DIR") or Path.home() / ".cache" / "opforge"
        return Path(root) / "autotune.json"
    return Path(text) if text else None


def tuning_records() -> list[TuningRecord]:
    """Each bucket's choice this process made or read, in the order they were made."""
    with _lock:
        return list(_records.values())


def stored_count() -> int:
    """How many bucket choices the file holds."""
    with _lock:
        return len(_read_file(fresh=True))


def clear_tuning() -> None:
    """Forget this process's choices and the file's entries read so far. Plans and tilings
    keep the choices they were made with: `opforge.clear_caches` drops them, and with the
    file deleted too every bucket is timed again."""
    global _stored
    with _lock:
        _records.clear()
        _stored = None


def describe(tiling: Tiling) -> str:
    """A tiling in one line: ``flash BLOCK_M=128 BLOCK_N=64 warps=8 stages=3``."""
    parts = [tiling.variant, *(f"{name}={value}" for name, value in tiling.blocks.items())]
    parts += [f"{name}={value}" for name, value in tiling.options.items() if value is not None]
    return " ".join(parts)


def tunable(tensors: Sequence[Any], reruns_alike: bool) -> bool:
    """Whether a plan for ``tensors`` may time its candidates now (see the module doc);
    ``reruns_alike``: the operator leaves its inputs as they were, or overwrites them
    alike on every run (`OpDef.reruns_alike`)."""
    if not reruns_alike or torch.compiler.is_compiling():
        return False
    present = [t for t in tensors if isinstance(t, torch.Tensor)]
    if not present:
        return False
    device = present[0].device
    if device.type == "meta" or any(type(t) not in (torch.Tensor, torch.nn.Parameter)
                                    for t in present):
        return False  # fake tensors and other subclasses: no data to time on
    return not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def bucket_key(op: str, bucket: str, device: torch.device, hardware: str) -> str:
    """The file's key of one bucket: operator, bucket, hardware profile, device, Triton."""
    try:
        import triton
        version = triton.__version__
    except ImportError:  # pragma: no cover
        version = "none"
    return f"{op} | {bucket} | {hardware} | {_device_name(device)} | triton {version}"


def _read_file(fresh: bool = False) -> dict[str, Any]:
    """The file's entries (read once, or again with ``fresh``); a missing, unreadable or
    malformed file reads as empty, and entries of the wrong form are left out."""
    global _stored
    if _stored is None or fresh:
        path = cache_path()
        try:
            loaded = json.loads(path.read_text()) if path is not None else {}
        except (OSError, ValueError):
            loaded = {}  # missing or unreadable: time again, rewrite it
        entries = loaded if isinstance(loaded, dict) else {}
        _stored = {key: entry for key, entry in entries.items() if _well_formed(entry)}
    return _stored


def _well_formed(entry: Any) -> bool:
    return (isinstance(entry, dict) and isinstance(entry.get("choice"), str)
            and isinstance(entry.get("timings_us"), dict)
            and all(isinstance(name, str) and isinstance(value, (int, float, str))
                    for name, value in entry["timings_us"].items()))


def _write_file(key: str, record: TuningRecord) -> None:
    """Add one choice to the file: read again first, so that choices other processes
    wrote since are kept; written whole to a temporary file, then renamed."""
    path = cache_path()
    entries = _read_file(fresh=path is not None)
    entries[key] = {"choice": record.choice, "timings_us": record.timings_us}
    if path is None:
        return
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps(entries, indent=1, sort_keys=True))
        os.replace(partial, path)  # readers never see half a file
    except OSError:
        # A read-only or odd path: the choice still holds for this process.
        with contextlib.suppress(OSError):
            partial.unlink()


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _seconds(run: Callable[[], Any], device: torch.device) -> float:
    """Median seconds of ``run`` on a GPU (do_bench); elsewhere the best of a few runs,
    each waited for (an accelerator's launch returns before the work is done)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(run, warmup=WARMUP_MS, rep=REP_MS)) * 1e-3
    best = math.inf
    for _ in range(HOST_RUNS):
        _synchronize(device)
        start = time.perf_counter()
        run()
        _synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def choose(op: str, key: str, candidates: Sequence[Tiling],
           prepare: Callable[[Tiling], Callable[[], Any]], device: torch.device) -> Tiling:
    """The fastest of ``candidates`` (fitting ones, in preference order; at most
    `max_candidates` distinct ones are timed), or the choice already made for ``key`` (by
    this process, or stored in the file).

    ``prepare(tiling)`` runs the call once with that tiling (compiling its kernels) and
    returns a function that runs it again. A candidate whose ``prepare`` or run raises is
    skipped, except for an `OpError`: the inputs themselves are invalid, and that error is
    raised as every candidate would raise it. When every candidate fails, the first is
    returned (its error then reaches the caller from the real run). One thread tunes a
    bucket at a time; another planning it meanwhile waits for the choice."""
    with _lock:
        bucket_lock = _bucket_locks.setdefault(key, threading.Lock())
    with bucket_lock:
        known = _known_choice(op, key, candidates)
        if known is not None:
            return known
        return _measure(op, key, candidates, prepare, device)


def _known_choice(op: str, key: str, candidates: Sequence[Tiling]) -> Tiling | None:
    """The candidate this process or the file chose for ``key``, if it is still one."""
    with _lock:
        record = _records.get(key)
        if record is None:
            stored = _read_file().get(key)
            if stored is not None:
                record = TuningRecord(op, key, stored["choice"], dict(stored["timings_us"]),
                                      "file")
        match = None if record is None else next(
            (t for t in candidates if describe(t) == record.choice), None)
        if match is not None:
            _records.setdefault(key, record)
        return match


def _measure(op: str, key: str, candidates: Sequence[Tiling],
             prepare: Callable[[Tiling], Callable[[], Any]], device: torch.device) -> Tiling:
    distinct = list({describe(t): t for t in reversed(candidates)}.values())[::-1]
    timed = distinct[:max_candidates()]
    timings: dict[str, float | str] = {}
    best, best_seconds = timed[0], math.inf
    # The profiler leaves this scope out of the operator's time, as a compilation.
    with torch.profiler.record_function(f"opforge::autotune {op}"):
        for tiling in timed:
            name = describe(tiling)
            try:
                seconds = _seconds(prepare(tiling), device)
            except OpError:
                raise
            except Exception as error:  # a variant that does not compile or launch here
                message = str(error).splitlines()[0][:160] if str(error) else ""
                timings[name] = type(error).__name__ + (f": {message}" if message else "")
                continue
            timings[name] = round(seconds * 1e6, 3)
            if seconds < best_seconds:
                best, best_seconds = tiling, seconds
    record = TuningRecord(op, key, describe(best), timings)
    with _lock:
        _records.pop(key, None)
        _records[key] = record
        if best_seconds < math.inf:
            _write_file(key, record)
    return best
