"""``with opforge.profile(out_dir) as prof:`` — a profiling session and its report files.

The session runs `torch.profiler.profile` (``torch_npu.profiler.profile`` when torch_npu is
importable: the same calls, the NPU as the device) with opforge's additions:

- every `Plan.run` leaves an ``opforge::<op>#n`` annotation and a record of the plan
  (input and output shapes and dtypes, backend, tiling, grid, FLOPs, bytes);
- every ``nn.Module`` call leaves an ``nn.Module: <Class>`` scope (the framework layer),
  unless ``with_modules=False``;
- each trace the schedule completes is saved under ``out_dir/.kineto/``; on exit the
  session parses them and writes the report files (see `opforge.profiler.report`).
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from opforge.core import plan as plan_module
from opforge.core.hardware import HardwareProfile, get_profile, profile_for
from opforge.core.opdef import dtype_name
from opforge.profiler import report, timeline
from opforge.profiler.tables import ProfileMeta

RAW_DIR = ".kineto"
# torch's profiler cannot nest (a second session crashes the interpreter): the sessions
# open in this process, innermost last.
_open_sessions: list[Profile] = []


def _profiler_backend() -> tuple[Any, str, str]:
    """(profiler module, device type, name) — torch_npu's profiler when it is importable."""
    try:
        import torch_npu  # noqa: F401
        from torch_npu import profiler as npu_profiler

        return npu_profiler, "npu", "torch_npu.profiler"
    except ImportError:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        return torch.profiler, device, "torch.profiler"


def _activities(module: Any, device: str) -> list[Any]:
    activity = module.ProfilerActivity
    chosen = [activity.CPU]
    if device == "cuda":
        chosen.append(activity.CUDA)
    elif device == "npu":
        chosen.append(activity.NPU)
    return chosen


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence the profiler's warnings about what the session does on purpose: a whole-run
    schedule has no warm-up, and each cycle's events are saved when the cycle ends."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*warmup.*")
        warnings.filterwarnings("ignore", message=".*clears events at the end of each cycle.*")
        yield


def _tensor_record(spec: Any) -> dict[str, Any] | None:
    if spec is None:
        return None
    return {"shape": [int(d) for d in spec.shape], "dtype": dtype_name(spec.dtype)}


def kernel_costs(plan: Any) -> dict[str, list[float]]:
    """{kernel name: [FLOPs, bytes]} of the plan's Triton kernels when the operator declares
    them (several kernels a call); empty otherwise."""
    if plan.backend != "triton" or plan.op.kernel_costs is None or plan.tiling is None:
        return {}
    costs = plan.op.kernel_costs(plan.tiling, plan.grid, plan.inputs, plan.outputs,
                                 plan.attrs)
    return {name: [float(cost.flops), float(cost.bytes_moved)]
            for name, cost in costs.items()}


class Profile:
    """``with opforge.profile(out_dir) as prof:``: profile the block and write the report
    files into ``out_dir``; call ``prof.step()`` at the end of each step.

    Args:
        out_dir: the directory of the files (created): ``trace_view.json``,
            ``kernel_details.csv``, ``operator_details.csv``, ``op_statistic.csv``,
            ``step_trace_time.csv``, ``roofline.png``, ``report.html`` and
            ``profile_meta.json`` (default ``./opforge_profile``).
        schedule: a ``torch.profiler.schedule(wait=, warmup=, active=, repeat=)``: which
            steps are recorded. Default: every step.
        record_shapes: record input shapes (needed for the cost of torch's operators).
        with_stack: record Python frames (the framework layer's call stacks); costly.
        with_modules: record each ``nn.Module`` call as a scope.
        profile_memory: record every allocation and release (``operator_memory.csv``, the
            peak in the summary).
        hardware: judge the kernels against this profile, or the shipped profile of this
            name (``"h100"``, ...), instead of the device's (its calibrated figures when
            ``opforge calibrate`` has run, else the datasheet's).

    Raises:
        AttrError: ``hardware`` names no shipped profile (at construction, before the
            block runs).

    A session may be entered again: each block gets a fresh report, written over the
    previous one in ``out_dir``.

    Attributes:
        out_dir: where the report files go.
        result: the parsed `report.Report` once the block has ended (``None`` before,
            and for a nested session: inside another profiler, which torch cannot nest,
            the session warns and records nothing itself; the outer one records the
            block). A block that raises an ``Exception`` gets the report of what ran
            before it, marked so in its notes, and the exception propagates.
    """

    def __init__(self, out_dir: str | os.PathLike[str] = "opforge_profile", *,
                 schedule: Callable[[int], Any] | None = None, record_shapes: bool = True,
                 with_stack: bool = False, with_modules: bool = True,
                 profile_memory: bool = False,
                 hardware: HardwareProfile | str | None = None) -> None:
        self.out_dir = Path(out_dir)
        self.result: report.Report | None = None
        self._schedule = schedule
        self._record_shapes = record_shapes
        self._with_stack = with_stack
        self._with_modules = with_modules
        self._profile_memory = profile_memory
        self._hardware = get_profile(hardware) if isinstance(hardware, str) else hardware
        self._records: dict[int, dict[str, Any]] = {}
        self._sequence = itertools.count(1)
        self._lock = threading.Lock()
        self._traces: list[Path] = []
        self._module_scopes = threading.local()
        self._handles: list[Any] = []
        self._previous_observer: Any = None
        self._profiler: Any = None
        self._module, self._device, self._source = _profiler_backend()

    # -- opforge's records -----------------------------------------------------------------

    def _observe(self, plan: Any) -> contextlib.AbstractContextManager[Any]:
        if self._source == "torch.profiler" and not torch._C._autograd._profiler_enabled():
            # A schedule's wait steps record nothing: keep no record either, so that a
            # long run profiled in a few steps holds only those steps' records. (Whether
            # torch_npu's profiler sets this flag is unknown: there every call is kept.)
            return contextlib.nullcontext()
        sequence = next(self._sequence)
        tiling = plan.tiling
        record = {
            "op": plan.op.name,
            "inputs": [_tensor_record(s) for s in plan.inputs],
            "outputs": [_tensor_record(s) for s in plan.outputs],
            "backend": plan.backend,
            "tiling": "" if tiling is None else
            f"{tiling.variant} " + " ".join(f"{k}={v}" for k, v in tiling.blocks.items()),
            "grid": [int(g) for g in plan.grid],
            "flops": float(plan.cost.flops),
            "bytes": float(plan.cost.bytes_moved),
            "kernels": kernel_costs(plan),
        }
        with self._lock:
            self._records[sequence] = record
        return torch.profiler.record_function(f"opforge::{plan.op.name}#{sequence}")

    def _enter_module(self, module: torch.nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            return
        scope = torch.profiler.record_function(f"nn.Module: {type(module).__name__}")
        scope.__enter__()
        stack = getattr(self._module_scopes, "stack", None)
        if stack is None:
            stack = self._module_scopes.stack = []
        stack.append(scope)

    def _exit_module(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        stack = getattr(self._module_scopes, "stack", None)
        if stack and not torch.compiler.is_compiling():
            stack.pop().__exit__(None, None, None)

    def _save_trace(self, profiler: Any) -> None:
        raw = self.out_dir / RAW_DIR
        raw.mkdir(parents=True, exist_ok=True)
        path = raw / f"trace_{len(self._traces)}.json"
        profiler.export_chrome_trace(str(path))
        self._traces.append(path)

    # -- the session -----------------------------------------------------------------------

    @property
    def nested(self) -> bool:
        """Whether this session found another profiler recording, and records nothing
        itself (that profiler records the block)."""
        return self._profiler is None and self in _open_sessions

    def __enter__(self) -> Profile:
        self.result = None
        if _open_sessions or torch._C._autograd._profiler_enabled():
            warnings.warn(f"opforge.profile({str(self.out_dir)!r}): another profiler is "
                          "already recording; this block is recorded by it, and no report "
                          "is written here", RuntimeWarning, stacklevel=2)
            _open_sessions.append(self)
            return self
        _open_sessions.append(self)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for stale in (self.out_dir / RAW_DIR).glob("trace_*.json"):
            stale.unlink()
        # A session entered again starts over: the previous block's traces and records
        # are not this block's.
        self._traces, self._records = [], {}
        self._sequence = itertools.count(1)
        with _quiet():
            schedule = self._schedule or self._module.schedule(wait=0, warmup=0,
                                                               active=1 << 30)
        self._profiler = self._module.profile(
            activities=_activities(self._module, self._device), schedule=schedule,
            on_trace_ready=self._save_trace, record_shapes=self._record_shapes,
            with_stack=self._with_stack, profile_memory=self._profile_memory)
        self._previous_observer = plan_module.set_run_observer(self._observe)
        if self._with_modules:
            hooks = torch.nn.modules.module
            self._handles = [hooks.register_module_forward_pre_hook(self._enter_module),
                             hooks.register_module_forward_hook(self._exit_module,
                                                                always_call=True)]
        with _quiet():
            self._profiler.__enter__()
        return self

    def step(self) -> None:
        """Mark the end of a training step (advances the schedule)."""
        if self._profiler is None:
            return
        with _quiet():
            self._profiler.step()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        _open_sessions.remove(self)
        if self._profiler is None:
            return
        try:
            with _quiet():
                self._profiler.__exit__(kind, error, trace)
        finally:
            plan_module.set_run_observer(self._previous_observer)
            for handle in self._handles:
                handle.remove()
            self._handles = []
        if kind is None:
            self.result = self.build()
        elif issubclass(kind, Exception):
            # What ran before the failure (an out-of-memory in step 5, say) is what the
            # user needs to see; the block's exception still propagates, and a report that
            # cannot be built from the cut-off traces must not replace it.
            try:
                self.result = self.build(failure=f"{kind.__name__}: {error}")
            except Exception as build_error:  # the block's error wins
                warnings.warn(f"opforge.profile({str(self.out_dir)!r}): no report for the "
                              f"failed block ({type(build_error).__name__}: {build_error})",
                              RuntimeWarning, stacklevel=2)

    def build(self, failure: str | None = None) -> report.Report:
        """Parse the saved traces and write the report files into `out_dir`; ``failure``
        (the block's exception, in words) marks the report as covering the block up to
        it."""
        parsed = timeline.parse(timeline.load_traces(self._traces), self._records)
        device = (torch.device(self._device, 0) if parsed.device_kernels
                  else torch.device("cpu"))
        hardware = self._hardware or profile_for(device)
        meta = ProfileMeta(
            device=str(device), hardware=ProfileMeta.describe(hardware),
            torch=torch.__version__,
            created=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            steps=len(timeline.step_rows(parsed)), source=self._source)
        if failure is not None:
            meta.notes.append(f"the profiled block raised {failure}: this report covers "
                              "what ran before it")
        if parsed.compile_us:
            meta.notes.append(
                f"torch.compile compiled for {parsed.compile_us / 1e3:.1f} ms inside the "
                "profile; the operators it ran on fake tensors are left out (profile after a "
                "warm-up step)")
        if parsed.autotune_us:
            meta.notes.append(
                f"opforge autotuned new tiling buckets for {parsed.autotune_us / 1e3:.1f} ms "
                "inside the profile; the candidate runs are left out of the operators' times "
                "(profile after a warm-up step)")
        core = device.type.upper()
        result = report.Report(meta, timeline.kernel_rows(parsed, core),
                               timeline.operator_rows(parsed), timeline.step_rows(parsed),
                               timeline.memory_rows(parsed))
        result.write(self.out_dir, parsed)
        return result


profile = Profile
