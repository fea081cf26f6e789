"""Dump a model's activations and gradients, and compare two dumps to find where two runs
diverge.

    with opforge.precision.dump(model, "runs/fp32", mode="tensor") as d:
        for batch in data:
            model(batch).sum().backward()
            d.step()

    $ opforge compare runs/fp32 runs/bf16

Layout: ``<path>/rank<R>/step<N>/`` holds ``manifest.json`` (entries in call order: module
path, call number, phase, io, index, shape, dtype, and min/max/mean/norm with NaN/Inf
flags, read back in one transfer per step) and, in ``tensor`` mode,
``tensors.safetensors``. No pickle anywhere. Files are written to a temporary name and
renamed; the manifest, written last, records the tensor file's size and SHA-256, so a
crash or a truncated copy never reads as a valid step.

An entry is one tensor: a module's forward input or output, or the gradient its backward
produces for an input (recorded by tensor hooks, as in `Monitor`). Its key,
``<module>#<call>.<phase>.<io>.<index>``, matches entries of two runs of the same model.
Asked for, a dump also records the modules' parameters (``<module>.<name>#<call>.forward.
parameter.0``) and, at `Dump.step`, their gradients (``...#0.backward.parameter.0``), the
gradients of module outputs (``backward.output``), every torch function called inside the
dumped modules (``apis``: ``Functional.linear#3.forward.input.1``, counted per function
and step, caught by a torch function mode, so ``from torch import relu`` is caught too),
only some of it (``data_mode``, ``apis`` names) and the call stack of each forward entry.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from opforge.precision.metrics import Metrics, compare_tensors
from opforge.precision.monitor import Pausable, _rank, _tensors, hook_modules
from opforge.precision.standards import THRESHOLDS

logger = logging.getLogger("opforge")

MODES = ("statistics", "tensor")
MANIFEST = "manifest.json"
TENSORS = "tensors.safetensors"
FORMAT = "opforge-dump/1"
_LOW = (torch.float16, torch.bfloat16)


class DumpError(RuntimeError):
    """A dump is missing, truncated or does not line up with the one it is compared to."""


def _write_atomic(path: Path, data: bytes) -> None:
    temporary = path.with_name(path.name + ".tmp")
    with temporary.open("wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def summary_stats(tensor: torch.Tensor) -> torch.Tensor:
    """(min, max, mean, norm) of a floating-point ``tensor`` as a vector on its device
    (float32; float64 for a float64 tensor), without a synchronisation. All four propagate
    NaN and Inf (the mean of +Inf and -Inf is NaN); the norm is one dot product, Inf for
    finite float32 values above 1.8e19 (see `opforge.precision.monitor.tensor_stats`). An
    empty tensor gives four zeros."""
    if not tensor.numel():
        return torch.zeros(4, device=tensor.device)
    flat = tensor.detach().reshape(-1)
    wide = flat if flat.dtype in (torch.float32, torch.float64) else flat.float()
    return torch.stack([wide.amin(), wide.amax(), wide.sum() / wide.numel(),
                        torch.dot(wide, wide).sqrt()])


def _step_statistics(row: Sequence[float]) -> dict[str, float]:
    """Manifest statistics from `summary_stats`: ``nan``/``inf`` say whether the tensor
    held any."""
    lowest, highest, mean, norm = row
    has_nan = math.isnan(lowest) or math.isnan(highest)
    has_inf = not has_nan and (math.isinf(lowest) or math.isinf(highest))
    return {"min": lowest, "max": highest, "mean": mean, "norm": norm,
            "nan": int(has_nan), "inf": int(has_inf)}


DATA_MODES = ("all", "forward", "backward", "input", "output")


def api_name(func: Callable[..., Any]) -> str | None:
    """msprobe-style name of a torch function: ``Functional.linear``, ``Torch.relu``,
    ``Tensor.add``; None for what is not an API call (attribute getters)."""
    name = getattr(func, "__name__", None)
    qualname = getattr(func, "__qualname__", "") or ""
    module = getattr(func, "__module__", "") or ""
    if name is None or name in ("__get__", "__set__"):
        return None
    if qualname.startswith(("TensorBase.", "Tensor.")):
        return f"Tensor.{name}"
    if module in ("torch._C._nn", "torch.nn.functional"):
        return f"Functional.{name}"
    if module == "torch" or module.startswith("torch.") or qualname.startswith(
            "_VariableFunctionsClass."):
        return f"Torch.{name}"
    return None


class _ApiCalls(TorchFunctionMode):
    """Hands every torch function call to `Dump._api_call` (the mode is off while its
    handler runs, so the dump's own arithmetic is not recorded)."""

    def __init__(self, dump: Dump) -> None:
        super().__init__()
        self.dump = dump

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        self.dump._api_call(func, args, kwargs, result)
        return result


# Frames inside torch's and opforge's own packages are not the caller's: compared by the
# packages' folders, since a user's project folder may itself be named torch or opforge.
_LIBRARY_FOLDERS = tuple(os.path.realpath(folder) + os.sep for folder in (
    os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__))))


class Dump(Pausable):
    """Context manager that records a model's tensors step by step (see the module
    docstring). Use `dump` to create one.

    Args:
        model: the module whose submodules are hooked (the root included).
        path: the run's folder; ``rank<R>`` below it (rank 0 outside torch.distributed).
        mode: ``statistics`` (manifest only) or ``tensor`` (also every tensor).
        steps: step numbers to write (``None``: every step).
        modules: only modules whose dotted path contains one of these strings.
        grad_scale: the loss scale of a loss-scaled run (e.g. ``scaler.get_scale``), read
            once per step: gradients are recorded divided by it, in float32, so that they
            compare with an unscaled run's (the manifest keeps their own dtype).
        parameters: also record each module's own parameters at each call and, at
            `step` (after the backward, before ``zero_grad``), their gradients.
        output_grads: also record the gradient reaching each module output (and each API
            output).
        apis: also record every torch function called inside the dumped modules: True for
            all, or names (``"Functional.linear"``, ``"Torch.matmul"``, ``"Tensor.add"``)
            whose calls to keep.
        data_mode: msprobe's selection: ``"all"``, or any of ``"forward"``,
            ``"backward"``, ``"input"``, ``"output"`` (parameters count as inputs).
        stacks: give each forward entry the call stack that made it (frames outside torch
            and opforge, ``file:line function``, file names only unless
            ``absolute_paths``).

    Raises:
        ValueError: unknown mode or data mode.
    """

    def __init__(self, model: torch.nn.Module, path: str | Path, mode: str = "statistics",
                 steps: Sequence[int] | None = None,
                 modules: Sequence[str] | None = None,
                 grad_scale: Callable[[], float] | None = None, *, parameters: bool = False,
                 output_grads: bool = False, apis: bool | Sequence[str] = False,
                 data_mode: Sequence[str] = ("all",), stacks: bool = False,
                 absolute_paths: bool = False) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown dump mode {mode!r}; expected one of {', '.join(MODES)}")
        unknown = [m for m in data_mode if m not in DATA_MODES]
        if unknown or not data_mode:
            raise ValueError(f"unknown data mode {unknown or data_mode!r}; expected some of "
                             f"{', '.join(DATA_MODES)}")
        wanted = set(data_mode)
        everything = "all" in wanted
        self._phases = {p for p in PHASES if everything or p in wanted} or set(PHASES)
        self._ios = {i for i in ("input", "output") if everything or i in wanted} or \
            {"input", "output"}
        self.parameters = parameters
        self.output_grads = output_grads
        self.apis = None if apis is True else set(apis) if apis else set()
        self.stacks = stacks
        self.absolute_paths = absolute_paths
        self.model = model
        self.mode = mode
        self.steps = set(steps) if steps is not None else None
        self.modules = tuple(modules) if modules else None
        rank = _rank()
        self.folder = Path(path) / f"rank{rank or 0}"
        self.step_index = 0
        self._entries: list[dict[str, Any]] = []
        self._stats: list[torch.Tensor] = []
        self._tensors: dict[str, torch.Tensor] = {}
        self._calls: dict[str, int] = {}
        self._handles: list[Any] = []
        self._active = False
        self._failed_step: int | None = None
        self.grad_scale = grad_scale
        self._scale: float | None = None
        self._watched: list[tuple[str, torch.nn.Module]] = []
        self._scopes: list[str] = []  # dumped modules' forwards under way, innermost last
        self._busy = False  # the dump's own work: not API calls of the model
        self._api_mode: _ApiCalls | None = None

    def __enter__(self) -> Dump:
        self._handles = hook_modules(self.model, self.modules, self._hook)
        self._watched = [(name, module) for name, module in self.model.named_modules()
                         if self.modules is None or any(p in name for p in self.modules)]
        if self.apis is None or self.apis:
            self._handles += [module.register_forward_pre_hook(self._enter_module(name))
                              for name, module in self._watched]
            self._api_mode = _ApiCalls(self)
            self._api_mode.__enter__()
        self._active = True
        return self

    def __exit__(self, *exc: object) -> None:
        self._active = False
        if self._api_mode is not None:
            self._api_mode.__exit__(None, None, None)
            self._api_mode = None
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._write()

    def _enter_module(self, name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, inputs: tuple[Any, ...]) -> None:
            self._scopes.append(name)
        return hook

    def _kept(self, phase: str, io: str) -> bool:
        return phase in self._phases and ("input" if io == "parameter" else io) in self._ios

    def _stack(self) -> list[str]:
        frames = [f for f in traceback.extract_stack()[:-3]
                  if not os.path.realpath(f.filename).startswith(_LIBRARY_FOLDERS)]
        return [f"{f.filename if self.absolute_paths else Path(f.filename).name}:{f.lineno} "
                f"{f.name}" for f in frames]

    def _api_call(self, func: Callable[..., Any], args: Any, kwargs: Any,
                  result: Any) -> None:
        if not self._scopes or self._busy:
            return
        name = api_name(func)
        outputs = [t for t in _tensors(result) if t.is_floating_point()]
        if name is None or not outputs or (self.apis is not None and name not in self.apis):
            return

        def body() -> None:
            call = self._calls.get(name, 0)
            self._calls[name] = call + 1
            self._record_call(name, call, [*_tensors(args), *_tensors(kwargs)], outputs,
                              grads_of_inputs=False, scope=self._scopes[-1])
        self._guarded(body)

    def _wanted(self) -> bool:
        return (self._active and self._failed_step != self.step_index
                and (self.steps is None or self.step_index in self.steps))

    def _guarded(self, body: Callable[[], None]) -> None:
        # A dump must never break training. A step with a failed record would not line up
        # with another run's, so it is logged and not written.
        if not self._wanted():
            return
        try:
            body()
        except Exception:  # reported, never raised into the loop
            self._failed_step = self.step_index
            logger.exception("opforge dump: recording failed; step %d is not written",
                             self.step_index)

    def _hook(self, name: str) -> Any:
        def hook(module: torch.nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
            def body() -> None:
                # A forward hook that fires during a backward pass is an activation
                # checkpoint's recomputation of a forward already recorded. (A reentrant
                # checkpoint's backward then has no entries inside it, and a comparison
                # with a run without checkpoints names the first missing one.)
                if torch._C._current_graph_task_id() != -1:
                    return
                call = self._calls.get(name, 0)
                self._calls[name] = call + 1
                if self.parameters and self._kept("forward", "parameter"):
                    for parameter_name, parameter in module.named_parameters(recurse=False):
                        self._add(_joined(name, parameter_name), call, "forward",
                                  "parameter", 0, parameter)
                self._record_call(name, call, _tensors(inputs), _tensors(output),
                                  grads_of_inputs=True)
            if self._api_mode is not None and self._scopes:
                self._scopes.pop()
            self._guarded(body)
        return hook

    def _record_call(self, name: str, call: int, inputs: Sequence[torch.Tensor],
                     outputs: Sequence[torch.Tensor], grads_of_inputs: bool,
                     scope: str | None = None) -> None:
        """A call's forward inputs and outputs, and hooks for the gradients asked for;
        an API call's entries name the module it ran in (``scope``)."""
        extra: dict[str, Any] = {}
        if self.stacks:
            extra["stack"] = self._stack()
        if scope is not None:
            extra["scope"] = scope
        for io, values in (("input", inputs), ("output", outputs)):
            for index, tensor in enumerate(values):
                if self._kept("forward", io):
                    self._add(name, call, "forward", io, index, tensor, extra=extra)
                gradient = grads_of_inputs if io == "input" else self.output_grads
                if gradient and tensor.requires_grad and self._kept("backward", io):
                    tensor.register_hook(self._grad_hook(name, call, index, io))

    def _grad_hook(self, name: str, call: int, index: int, io: str = "input") -> Any:
        def hook(grad: torch.Tensor) -> None:
            def body() -> None:
                dtype = grad.dtype
                value = grad
                if self.grad_scale is not None and grad.is_floating_point():
                    if self._scale is None:
                        self._scale = float(self.grad_scale())
                    value = grad.float() / self._scale
                self._add(name, call, "backward", io, index, value, dtype)
            self._guarded(body)
        return hook

    def _add(self, module: str, call: int, phase: str, io: str, index: int,
             tensor: torch.Tensor, dtype: torch.dtype | None = None,
             extra: dict[str, Any] | None = None) -> None:
        if not tensor.is_floating_point():
            return
        self._busy = True
        try:
            key = f"{module}#{call}.{phase}.{io}.{index}"
            stats = summary_stats(tensor)
            entry = {"key": key, "module": module, "call": call, "phase": phase, "io": io,
                     "index": index, "shape": list(tensor.shape),
                     "dtype": str(dtype or tensor.dtype).removeprefix("torch.")}
            self._entries.append({**entry, **(extra or {})})
            self._stats.append(stats)
            if self.mode == "tensor":
                self._tensors[key] = tensor.detach().to("cpu").contiguous().clone()
        finally:
            self._busy = False

    def _parameter_gradients(self) -> None:
        """Each watched module's own parameters' gradients (msprobe's parameters_grad)."""
        def body() -> None:
            for name, module in self._watched:
                for parameter_name, parameter in module.named_parameters(recurse=False):
                    if parameter.grad is not None:
                        self._add(_joined(name, parameter_name), 0, "backward", "parameter",
                                  0, parameter.grad)
        if self.parameters and self._kept("backward", "parameter"):
            self._guarded(body)

    def step(self) -> None:
        """Write the current step (if wanted and fully recorded) and start the next one;
        with ``parameters``, the parameters' gradients are recorded first (call it after
        the backward, before ``zero_grad``)."""
        self._parameter_gradients()
        self._write()
        self.step_index += 1
        self._calls.clear()
        self._scale = None

    def _write(self) -> None:
        from safetensors.torch import save

        if not self._entries or self._failed_step == self.step_index:
            self._entries, self._stats, self._tensors = [], [], {}
            return
        folder = self.folder / f"step{self.step_index}"
        folder.mkdir(parents=True, exist_ok=True)
        # One transfer for the whole step's statistics.
        rows = torch.stack([s.to(self._stats[0].device) for s in self._stats]).cpu().tolist()
        for entry, row in zip(self._entries, rows):
            entry["stats"] = _step_statistics(row)
        manifest: dict[str, Any] = {"format": FORMAT, "mode": self.mode,
                                    "step": self.step_index, "rank": _rank(),
                                    "entries": self._entries}
        if self.mode == "tensor":
            data = save(self._tensors)
            _write_atomic(folder / TENSORS, data)
            manifest["tensors"] = {"file": TENSORS, "bytes": len(data),
                                   "sha256": hashlib.sha256(data).hexdigest()}
        _write_atomic(folder / MANIFEST, json.dumps(manifest, indent=1).encode())
        self._entries, self._stats, self._tensors = [], [], {}


def dump(model: torch.nn.Module, path: str | Path, mode: str = "statistics",
         steps: Sequence[int] | None = None, modules: Sequence[str] | None = None,
         grad_scale: Callable[[], float] | None = None, **options: Any) -> Dump:
    """A `Dump` of ``model`` into ``path`` (use as a context manager); ``options`` are
    `Dump`'s keyword-only arguments (``parameters``, ``output_grads``, ``apis``,
    ``data_mode``, ``stacks``, ``absolute_paths``)."""
    return Dump(model, path, mode, steps, modules, grad_scale, **options)


def _joined(module: str, name: str) -> str:
    return f"{module}.{name}" if module else name


# ---------------------------------------------------------------------------------------------
# Reading and comparing


@dataclass
class StepDump:
    """One step of one rank, read back and checked."""

    folder: Path
    manifest: dict[str, Any]
    tensors: dict[str, torch.Tensor] | None


PHASES = ("forward", "backward")
# "parameter": a parameter's value (forward) or gradient (backward), as msprobe dumps them;
# "local_input": the share of an input's gradient that one module's backward gives (msprobe's
# full backward hooks), where "input" is the tensor's whole gradient (tensor hooks: the
# shares of every consumer, a residual's included).
IOS = ("input", "output", "parameter", "local_input")
# The dtypes a comparison has a standard for (`THRESHOLDS["run_compare"]`).
COMPARED_DTYPES = {str(d).removeprefix("torch."): d for d in THRESHOLDS["run_compare"]}
_STAT_NUMBERS = ("min", "max", "mean", "norm")
_STAT_FLAGS = ("nan", "inf")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_LARGEST = sys.float_info.max


def _count(value: Any) -> bool:
    """A JSON integer >= 0 (``true`` is not one)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _number(value: Any) -> bool:
    """A JSON number a float holds (an integer beyond float's range is not one)."""
    if isinstance(value, float):
        return True
    return isinstance(value, int) and not isinstance(value, bool) and abs(value) <= _LARGEST


def _text(value: Any) -> bool:
    """A JSON string that can be printed: UTF-8 encodable (JSON admits lone surrogates,
    ``"\\udcff"``, which no terminal can show)."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _brief(value: Any) -> str:
    """A value of a manifest for an error message, at most 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:57]}..."


def entry_key(entry: dict[str, Any]) -> str:
    """The key an entry's fields give it: ``<module>#<call>.<phase>.<io>.<index>``."""
    return f"{entry['module']}#{entry['call']}.{entry['phase']}.{entry['io']}.{entry['index']}"


def _entry_problem(entry: Any) -> str | None:
    """What makes ``entry`` unusable for `compare_steps`, or ``None``."""
    if not isinstance(entry, dict):
        return "is not an object"
    checks = {"key": _text(entry.get("key")), "module": _text(entry.get("module")),
              "call": _count(entry.get("call")), "index": _count(entry.get("index")),
              "phase": entry.get("phase") in PHASES, "io": entry.get("io") in IOS,
              "shape": isinstance(entry.get("shape"), list)
              and all(_count(size) for size in entry["shape"]),
              "dtype": isinstance(entry.get("dtype"), str)
              and entry["dtype"] in COMPARED_DTYPES,
              "stats": isinstance(entry.get("stats"), dict)}
    wrong = next((name for name, ok in checks.items() if not ok), None)
    if wrong == "dtype":
        return (f"dtype {entry.get('dtype')!r} is not one a comparison has a standard for "
                f"({', '.join(COMPARED_DTYPES)})")
    if wrong is not None:
        return f"field {wrong!r} is missing or invalid: {_brief(entry.get(wrong))}"
    stats = entry["stats"]
    wrong = next((name for name in _STAT_NUMBERS if not _number(stats.get(name))), None) or \
        next((name for name in _STAT_FLAGS
              if not (_count(stats.get(name)) and stats[name] <= 1)), None)
    if wrong is not None:
        return (f"stats need numbers {', '.join(_STAT_NUMBERS)} (within float's range) and "
                f"0/1 flags {', '.join(_STAT_FLAGS)}: {wrong} is {_brief(stats.get(wrong))}")
    if entry["key"] != entry_key(entry):
        return f"key {entry['key']!r} is not its fields' {entry_key(entry)!r}"
    return None


def _check_manifest(manifest: Any, path: Path) -> None:
    """Raise `DumpError` naming the first field of ``manifest`` that `compare_steps` could
    not use as it stands: every field it reads is checked for its type and its domain
    (dtypes with a standard, phases, counts), keys are unique and their fields' own, the
    entry list is not empty, and the tensor file is a name in the step's folder."""
    def fail(what: str) -> None:
        raise DumpError(f"{path}: malformed manifest: {what}")

    if not isinstance(manifest, dict):
        fail("not a JSON object")
    if manifest.get("mode") not in MODES:
        fail(f"mode {manifest.get('mode')!r}, expected one of {', '.join(MODES)}")
    entries = manifest.get("entries")
    if not isinstance(entries, list) or not entries:
        fail("no entries (a list of at least one)")
    seen: set[str] = set()
    for number, entry in enumerate(entries):
        problem = _entry_problem(entry)
        if problem is not None:
            key = entry.get("key") if isinstance(entry, dict) else None
            fail(f"entry {number}{f' ({key})' if _text(key) else ''} {problem}")
        if entry["key"] in seen:
            fail(f"entry {number}: key {entry['key']} appears twice")
        seen.add(entry["key"])
    info = manifest.get("tensors")
    if manifest["mode"] == "tensor" and not (
            isinstance(info, dict) and _text(info.get("file"))
            and info["file"] not in ("", ".", "..") and not re.search(r"[/\\\0]", info["file"])
            and _count(info.get("bytes")) and isinstance(info.get("sha256"), str)
            and _SHA256.fullmatch(info["sha256"])):
        fail("a tensor-mode manifest needs tensors.file (a file name in the step's folder), "
             "tensors.bytes and tensors.sha256 (64 hex digits)")


def _read_bytes(path: Path, what: str) -> bytes:
    if not path.is_file():
        raise DumpError(f"{path}: {'missing' if not path.exists() else 'not a file'} "
                        f"({what})")
    try:
        return path.read_bytes()
    except OSError as error:
        raise DumpError(f"{path}: cannot be read ({error.strerror or error})") from None


def read_step(folder: Path) -> StepDump:
    """Read ``folder`` (a ``step<N>``, normally below ``rank<R>``): the manifest, and the
    tensors it vouches for.

    Raises:
        DumpError: no manifest, one that is not a readable file, of another format, or
            with a field `compare_steps` could not use (see `_check_manifest`), or a
            tensor file that is missing, differs from the manifest's size or SHA-256, is
            not a safetensors file, or whose tensors are not the entries' (one missing,
            one more, another shape, not floating point).
    """
    from safetensors.torch import load

    manifest_path = folder / MANIFEST
    raw = _read_bytes(manifest_path, "an incomplete or missing dump")
    try:
        manifest = json.loads(raw)
    except (ValueError, RecursionError) as error:  # RecursionError: nesting too deep
        raise DumpError(f"{manifest_path}: not valid JSON ({error})") from None
    if isinstance(manifest, dict) and manifest.get("format") != FORMAT:
        raise DumpError(f"{manifest_path}: format {manifest.get('format')!r}, "
                        f"expected {FORMAT!r}")
    _check_manifest(manifest, manifest_path)
    tensors = None
    if manifest["mode"] == "tensor":
        info = manifest["tensors"]
        path = folder / info["file"]
        data = _read_bytes(path, "the manifest's tensor file")
        if len(data) != info["bytes"] or hashlib.sha256(data).hexdigest() != info["sha256"]:
            raise DumpError(f"{path}: {len(data)} bytes, the manifest vouches for "
                            f"{info['bytes']} bytes with another checksum (truncated or "
                            "modified)")
        try:
            tensors = load(data)
        except Exception as error:  # safetensors raises its own error types
            raise DumpError(f"{path}: not a safetensors file ({error})") from None
        _check_tensors(tensors, manifest["entries"], path)
    return StepDump(folder, manifest, tensors)


def _check_tensors(tensors: dict[str, torch.Tensor], entries: Sequence[dict[str, Any]],
                   path: Path) -> None:
    """The tensor file holds exactly the entries' tensors, each of its entry's shape and
    of a compared dtype (a loss-scaled gradient is float32 whatever its entry's dtype)."""
    for entry in entries:
        tensor = tensors.get(entry["key"])
        if tensor is None:
            raise DumpError(f"{path}: no tensor for entry {entry['key']}")
        if list(tensor.shape) != entry["shape"]:
            raise DumpError(f"{path}: tensor {entry['key']} has shape {list(tensor.shape)}, "
                            f"its entry {entry['shape']}")
        if tensor.dtype not in COMPARED_DTYPES.values():
            raise DumpError(f"{path}: tensor {entry['key']} is {tensor.dtype}, not one of "
                            f"{', '.join(COMPARED_DTYPES)}")
    if len(tensors) != len(entries):
        extra = next(key for key in tensors if key not in {e["key"] for e in entries})
        raise DumpError(f"{path}: tensor {extra} has no entry in the manifest")


_STEP_FOLDER = re.compile(r"rank(\d+)/step(\d+)")


def step_number(folder: Path) -> tuple[int, int]:
    """(rank, step) of a ``rank<R>/step<N>`` folder."""
    match = _STEP_FOLDER.fullmatch(f"{folder.parent.name}/{folder.name}")
    if match is None:
        raise DumpError(f"{folder}: not a rank<R>/step<N> folder")
    return int(match[1]), int(match[2])


def step_folders(run: Path) -> list[Path]:
    """Every ``rank<R>/step<N>`` folder of a run, sorted by rank then step; other folders
    (a ``step3_old`` copy) are not steps and are left out.

    Raises:
        DumpError: the run has none.
    """
    folders = sorted((p for p in run.glob("rank*/step*") if p.is_dir() and
                      _STEP_FOLDER.fullmatch(f"{p.parent.name}/{p.name}")), key=step_number)
    if not folders:
        raise DumpError(f"{run}: no rank*/step* folders (not an opforge dump)")
    return folders


@dataclass
class EntryComparison:
    """One matched entry of two dumps."""

    key: str
    module: str
    phase: str
    io: str
    dtype: str
    cosine: float
    max_abs: float
    max_rel: float
    thousandth_ratio: float
    five_thousandths_ratio: float
    diverged: bool
    norm_error: float = 0.0
    euclidean: float = 0.0


def _lower_precision(*dtypes: str | torch.dtype | None) -> torch.dtype:
    # Precision is the mantissa, not the width: bfloat16 (eps 2^-7) is below float16
    # (2^-10), whichever is named first.
    chosen = [getattr(torch, d) if isinstance(d, str) else d for d in dtypes if d is not None]
    return max(chosen, key=lambda d: torch.finfo(d).eps)


def _compare_statistics(entry_a: dict[str, Any], entry_b: dict[str, Any]) -> Metrics:
    # Statistics mode has no elements to compare: compare the statistics themselves, as a
    # 4-vector (min, max, mean, norm), with NaN/Inf counts as the special values.
    def vector(entry: dict[str, Any]) -> torch.Tensor:
        stats = entry["stats"]
        special = math.nan if stats["nan"] else (math.inf if stats["inf"] else 0.0)
        return torch.tensor([stats["min"], stats["max"], stats["mean"], stats["norm"],
                             special], dtype=torch.float64)
    return compare_tensors(vector(entry_b), vector(entry_a), dtype=torch.float64)


def compare_steps(a: StepDump, b: StepDump, tolerance: torch.dtype | None = None,
                  intersection: bool = False) -> list[EntryComparison]:
    """Compare two dumps of one step entry by entry, in ``a``'s call order; ``a`` is the
    reference. Entries are matched by key (module, call, phase, io, index), not by
    position: the order in which gradient hooks fire depends on whether a module returns
    its input itself, which a change of dtype can alter. Each entry is judged by the
    tolerance of the lower-precision dtype of its two sides, or of ``tolerance`` when that
    is lower: the compute dtype of a run under autocast, whose float32 tensors (a residual
    stream, a norm's output) carry its errors. An entry with elements none of which is
    finite on both sides has NaN cosine and errors: nothing could be compared. With
    ``intersection``, entries of one run only are left out instead (`unmatched` counts
    them); the two runs must still share at least one.

    Raises:
        DumpError: the modes differ, or the entries do not line up (a key in one run only,
            named, or other shapes).
    """
    if a.manifest["mode"] != b.manifest["mode"]:
        raise DumpError(f"{a.folder} is a {a.manifest['mode']} dump, {b.folder} a "
                        f"{b.manifest['mode']} dump")
    entries_a, entries_b = a.manifest["entries"], b.manifest["entries"]
    by_key_b = {e["key"]: e for e in entries_b}
    keys_a = {e["key"] for e in entries_a}
    only_a = next((e["key"] for e in entries_a if e["key"] not in by_key_b), None)
    only_b = next((e["key"] for e in entries_b if e["key"] not in keys_a), None)
    if intersection:
        entries_a = [e for e in entries_a if e["key"] in by_key_b]
        if not entries_a:
            raise DumpError(f"{a.folder} and {b.folder} share no entry (first of the "
                            f"reference: {only_a}; of the other run: {only_b})")
    elif only_a is not None or only_b is not None:
        raise DumpError(f"{a.folder} and {b.folder} do not line up: {len(entries_a)} vs "
                        f"{len(entries_b)} entries; first only in the reference: {only_a}; "
                        f"first only in the other run: {only_b}")
    results = []
    for entry_a in entries_a:
        entry_b = by_key_b[entry_a["key"]]
        if entry_a["shape"] != entry_b["shape"]:
            raise DumpError(f"{entry_a['key']}: shape {entry_a['shape']} vs "
                            f"{entry_b['shape']}")
        dtype = _lower_precision(entry_a["dtype"], entry_b["dtype"], tolerance)
        if a.tensors is not None and b.tensors is not None:
            metrics = compare_tensors(b.tensors[entry_b["key"]], a.tensors[entry_a["key"]],
                                      dtype=dtype)
        else:
            metrics = _compare_statistics(entry_a, entry_b)
        norm_a, norm_b = entry_a["stats"]["norm"], entry_b["stats"]["norm"]
        norm_error = abs(norm_b - norm_a) / max(abs(norm_a), torch.finfo(torch.float32).tiny)
        diverged = _diverged(metrics, norm_error, entry_a["stats"], entry_b["stats"], dtype)
        if metrics.count == 0 and math.prod(entry_a["shape"]):
            # Metrics of no elements default to agreement (cosine 1, errors 0).
            metrics = dataclasses.replace(metrics, cosine=math.nan, max_abs=math.nan,
                                          max_rel=math.nan, thousandth_ratio=math.nan,
                                          five_thousandths_ratio=math.nan)
        results.append(EntryComparison(
            entry_a["key"], entry_a["module"], entry_a["phase"], entry_a["io"],
            str(dtype).removeprefix("torch."), metrics.cosine, metrics.max_abs,
            metrics.max_rel, metrics.thousandth_ratio, metrics.five_thousandths_ratio,
            diverged, norm_error, metrics.euclidean))
    return results


# msprobe's comparison columns ("NPU": the run checked, "Bench": the reference), then the
# step: a CSV that msprobe users' tools read.
CSV_COLUMNS = ("NPU Name", "Bench Name", "NPU Dtype", "Bench Dtype", "NPU Tensor Shape",
               "Bench Tensor Shape", "Cosine", "EucDist", "MaxAbsErr", "MaxRelativeErr",
               "One Thousandth Err Ratio", "Five Thousandths Err Ratio", "NPU max", "NPU min",
               "NPU mean", "NPU l2norm", "Bench max", "Bench min", "Bench mean",
               "Bench l2norm", "Result", "Err_message", "Data_name", "Step")


def csv_rows(step: str, a: StepDump, b: StepDump, results: Sequence[EntryComparison]
             ) -> Iterator[list[object]]:
    """One row of `CSV_COLUMNS` per compared entry of one step (``a`` the reference)."""
    by_key_a = {e["key"]: e for e in a.manifest["entries"]}
    by_key_b = {e["key"]: e for e in b.manifest["entries"]}
    for result in results:
        entry_a, entry_b = by_key_a[result.key], by_key_b[result.key]
        stats_a, stats_b = entry_a["stats"], entry_b["stats"]
        special = stats_a["nan"] + stats_a["inf"] != stats_b["nan"] + stats_b["inf"]
        message = ("NaN/Inf differ" if special else
                   f"cosine {result.cosine:.6g}, norm error {result.norm_error:.3g}"
                   if result.diverged else "")
        yield [result.key, result.key, entry_b["dtype"], entry_a["dtype"], entry_b["shape"],
               entry_a["shape"], result.cosine, result.euclidean, result.max_abs,
               result.max_rel, result.thousandth_ratio, result.five_thousandths_ratio,
               stats_b["max"], stats_b["min"], stats_b["mean"], stats_b["norm"],
               stats_a["max"], stats_a["min"], stats_a["mean"], stats_a["norm"],
               "diverged" if result.diverged else "pass", message,
               entry_b.get("data_name") or "", step]


def unmatched(a: StepDump, b: StepDump) -> tuple[int, int]:
    """(entries only in ``a``, entries only in ``b``)."""
    keys_a = {e["key"] for e in a.manifest["entries"]}
    keys_b = {e["key"] for e in b.manifest["entries"]}
    return len(keys_a - keys_b), len(keys_b - keys_a)


def _diverged(metrics: Metrics, norm_error: float, stats_a: dict[str, float],
              stats_b: dict[str, float], dtype: torch.dtype) -> bool:
    limits = THRESHOLDS["run_compare"][dtype]
    if metrics.nan_inf_mismatch or (stats_a["nan"] + stats_a["inf"]) != (
            stats_b["nan"] + stats_b["inf"]):
        return True
    return metrics.cosine < limits["min_cosine"] or norm_error > limits["norm_rtol"]


def first_divergence(results: Sequence[EntryComparison]) -> int | None:
    """Index of the first diverged entry in call order, or ``None``."""
    return next((i for i, r in enumerate(results) if r.diverged), None)


def growth_point(results: Sequence[EntryComparison], factor: float = 10.0) -> int | None:
    """Where the error starts to grow on the way to the first divergence: the first entry,
    up to that one, whose ``1 - cosine`` is ``factor`` times the largest before it (and
    above 1e-9). ``None`` when the runs do not diverge."""
    end = first_divergence(results)
    if end is None:
        return None
    worst = 0.0
    for index, result in enumerate(results[:end + 1]):
        error = 1.0 - result.cosine
        if error > 1e-9 and error > factor * worst:
            return index
        worst = max(worst, error)
    return end


@contextlib.contextmanager
def _plot_figure(path: Path) -> Iterator[Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(10, 4))
    try:
        yield axis
        figure.tight_layout()
        figure.savefig(path, dpi=100)
    finally:
        plt.close(figure)


def plot_errors(results: Sequence[EntryComparison], path: Path) -> None:
    """PNG of ``1 - cosine`` and max relative error against call order (depth)."""
    with _plot_figure(path) as axis:
        depth = range(len(results))
        axis.semilogy(depth, [max(1 - r.cosine, 1e-12) for r in results], label="1 - cosine")
        axis.semilogy(depth, [max(r.max_rel, 1e-12) for r in results], label="max rel error")
        for index, result in enumerate(results):
            if result.diverged:
                axis.axvline(index, color="red", alpha=0.3)
                break
        axis.set_xlabel("entry in call order (forward, then backward)")
        axis.set_ylabel("error")
        axis.legend()
