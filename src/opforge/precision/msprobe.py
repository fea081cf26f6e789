"""Read MindStudio Probe (msprobe) PyTorch dumps as opforge dump steps, so that
``opforge compare`` takes an Ascend run's own dump on either side.

Layout: ``dump_path/step<N>/rank<R>/`` (``proc<pid>/`` outside ``torch.distributed``: rank
0) holding ``dump.json``, ``construct.json``, ``stack.json`` and, in tensor mode,
``dump_tensor_data/<data_name>.pt``.

Entries, from ``dump.json``'s keys (the call counter ``n`` restarts each step):

- ``Module.<path>.<Class>.forward.<n>``: ``input_args[i]`` -> ``(<path>, n, forward,
  input, i)`` (nested lists and ``input_kwargs`` values in order after them),
  ``output[j]`` -> ``(forward, output, j)``, ``parameters[name]`` -> ``(<path>.<name>, n,
  forward, parameter, 0)``, the parameters first (a divergent weight, not the output it
  makes, is where a divergence starts);
- ``Module.<path>.<Class>.backward.<n>``: msprobe names a backward's records from the
  backward's side (its ``input`` is the gradient reaching the module's outputs, its
  ``output`` the gradient it gives its inputs); opforge names a gradient by the forward
  tensor it belongs to: ``input[j]`` -> ``(backward, output, j)``, ``output[i]`` ->
  ``(backward, local_input, i)``: the module's own share of input ``i``'s gradient, not the
  whole gradient of that tensor that opforge's ``(backward, input, i)`` holds (they differ
  wherever the input feeds something else too, a residual connection);
- ``Module.<path>.<Class>.parameters_grad.<n>``: ``{name: [record]}`` ->
  ``(<path>.<name>, n, backward, parameter, 0)``;
- API entries (level L1 or mix), ``<Kind>.<api>.<n>.forward`` / ``.backward`` (``Torch.
  matmul.1.forward``, ``Functional.linear.0.backward``): module ``<Kind>.<api>``, call
  ``n``, the same io rules. Two runs of one model call the same APIs in the same order,
  so the per-API counter aligns them; ``construct.json`` gives each API call the module it
  ran in, which `api_scopes` reports beside a divergent API.

Records that are not floating-point tensors (scalars, ``None``, index tensors) are not
entries. Statistics are msprobe's Max, Min, Mean and Norm; a NaN among them sets the
entry's NaN flag, an infinite Max or Min its Inf flag.

Fail-closed: a ``dump.json`` that is missing, not JSON, or not msprobe's; a record without
the statistics a comparison needs; a key that repeats; in tensor mode a ``.pt`` file that
is missing, truncated, not a tensor, or of another shape or dtype than its record: each is
a `DumpError`. ``.pt`` files load with ``weights_only=True``; torch_npu's NPU-tensor rebuild
function is mapped to torch's CPU one (the storages mapped to the CPU); nothing else is
ever unpickled.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from opforge.precision.dump import COMPARED_DTYPES, DumpError, StepDump, entry_key

DUMP_JSON = "dump.json"
CONSTRUCT_JSON = "construct.json"
TENSOR_FOLDER = "dump_tensor_data"
FORMAT = "msprobe"
NPU_REBUILD = "torch_npu.utils.storage._rebuild_npu_tensor"
_KEY = re.compile(r"(?P<scope>.+)\.(?P<phase>forward|backward|parameters_grad)\.(?P<call>\d+)")
_API_KEY = re.compile(r"(?P<scope>[A-Za-z_]+\.[^.]+)\.(?P<call>\d+)\.(?P<phase>forward|backward)")
_STEP = re.compile(r"step(\d+)")
_RANK = re.compile(r"rank(\d+)|proc\d+")
_STATISTICS = ("Max", "Min", "Mean", "Norm")


def is_msprobe_dump(path: Path) -> bool:
    """Whether ``path`` is an msprobe dump root or one of its step folders (a
    ``dump.json`` in it, or in ``step*/rank*|proc*`` below it)."""
    return (path / DUMP_JSON).is_file() or any(
        (folder / DUMP_JSON).is_file() for folder in path.glob("step*/*"))


def step_folders(run: Path) -> dict[tuple[int, int], Path]:
    """``(rank, step) -> folder`` of a dump root, or of one ``step<N>/rank<R>|proc<pid>``
    folder given directly.

    Raises:
        DumpError: no step folder, or two process folders of one step (``proc<pid>``: runs
            of several processes outside ``torch.distributed`` cannot be told apart).
    """
    candidates = [run] if (run / DUMP_JSON).is_file() else sorted(
        folder for folder in run.glob("step*/*") if folder.is_dir())
    found: dict[tuple[int, int], Path] = {}
    for folder in candidates:
        step, rank = _STEP.fullmatch(folder.parent.name), _RANK.fullmatch(folder.name)
        if step is None or rank is None:
            if folder is run:
                raise DumpError(f"{run}: an msprobe step folder must be step<N>/rank<R> or "
                                "step<N>/proc<pid>")
            continue
        place = (int(rank[1] or 0), int(step[1]))
        if place in found:
            raise DumpError(f"{folder} and {found[place]}: two dumps of rank {place[0]} step "
                            f"{place[1]} (several processes outside torch.distributed)")
        found[place] = folder
    if not found:
        raise DumpError(f"{run}: no step<N>/rank<R>|proc<pid> folders with a {DUMP_JSON} "
                        "(not an msprobe dump)")
    return found


def _load_json(path: Path, what: str) -> Any:
    if not path.is_file():
        raise DumpError(f"{path}: missing ({what})")
    try:
        # msprobe writes NaN as a bare literal, which Python's reader takes.
        return json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as error:
        raise DumpError(f"{path}: not readable JSON ({error})") from None


def _rebuild_npu_tensor(storage: Any, storage_offset: int, size: tuple[int, ...],
                        stride: tuple[int, ...], requires_grad: bool, backward_hooks: Any,
                        npu_storage_info: Any = None) -> torch.Tensor:
    """torch_npu's rebuild of a saved NPU tensor, on the CPU storage it was mapped to."""
    return torch._utils._rebuild_tensor_v2(storage, storage_offset, size, stride,
                                           requires_grad, backward_hooks)


def load_tensor(path: Path) -> torch.Tensor:
    """A ``.pt`` file msprobe saved: one tensor, unpickled with ``weights_only=True``.

    Raises:
        DumpError: missing, unreadable, truncated, refused by the safe unpickler, or not
            one tensor.
    """
    if not path.is_file():
        raise DumpError(f"{path}: missing (a tensor of the dump)")
    try:
        with torch.serialization.safe_globals([(_rebuild_npu_tensor, NPU_REBUILD)]):
            tensor = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises several types for damaged archives
        raise DumpError(f"{path}: not a readable tensor file ({type(error).__name__}: "
                        f"{str(error).splitlines()[0] if str(error) else ''})") from None
    if not isinstance(tensor, torch.Tensor):
        raise DumpError(f"{path}: holds a {type(tensor).__name__}, not a tensor")
    return tensor


def _records(value: Any) -> Iterator[Any]:
    """The records of an ``input_args``/``output``/``input`` value in order, nested lists
    and tuples flattened, a dict's values (``input_kwargs``) in their order."""
    if isinstance(value, list):
        for item in value:
            yield from _records(item)
    elif isinstance(value, dict) and "type" not in value:
        for item in value.values():
            yield from _records(item)
    else:
        yield value


def _is_float_tensor(record: Any) -> bool:
    return (isinstance(record, dict) and record.get("type") == "torch.Tensor"
            and isinstance(record.get("dtype"), str)
            and record["dtype"].removeprefix("torch.") in COMPARED_DTYPES)


def _statistics(record: dict[str, Any], where: str) -> dict[str, float]:
    values = {name: record.get(name) for name in _STATISTICS}
    bad = next((name for name, value in values.items()
                if not isinstance(value, (int, float)) or isinstance(value, bool)), None)
    if bad is not None:
        raise DumpError(f"{where}: statistic {bad} is {values[bad]!r}, not a number")
    numbers = {name: float(value) for name, value in values.items()}
    nan = any(math.isnan(v) for v in numbers.values())
    inf = not nan and any(math.isinf(numbers[name]) for name in ("Max", "Min"))
    return {"min": numbers["Min"], "max": numbers["Max"], "mean": numbers["Mean"],
            "norm": numbers["Norm"], "nan": int(nan), "inf": int(inf)}


def _entry(record: dict[str, Any], module: str, call: int, phase: str, io: str, index: int,
           where: str) -> dict[str, Any]:
    shape = record.get("shape")
    if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise DumpError(f"{where}: shape {shape!r} is not a list of sizes")
    entry = {"module": module, "call": call, "phase": phase, "io": io, "index": index,
             "shape": shape, "dtype": record["dtype"].removeprefix("torch."),
             "stats": _statistics(record, where), "data_name": record.get("data_name")}
    entry["key"] = entry_key(entry)
    return entry


def _module_entries(key: str, value: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """The entries of one ``dump.json`` item (rules in the module docstring)."""
    match = _API_KEY.fullmatch(key) if not key.startswith("Module.") else None
    if match is not None:
        scope = match["scope"]
    else:
        match = _KEY.fullmatch(key)
        if match is None or not key.startswith("Module."):
            raise DumpError(f"{where}: key {key!r} is not an msprobe module or API key")
        # Module.<path>.<Class>: the path without the class name.
        scope = match["scope"].removeprefix("Module.").rsplit(".", 1)[0]
    call, phase = int(match["call"]), match["phase"]
    if not isinstance(value, dict):
        raise DumpError(f"{where}: {key} is not an object")
    sides: list[tuple[str, str, str, Any]]  # (module, phase, io, value)
    if phase == "parameters_grad":
        sides = [(f"{scope}.{name}", "backward", "parameter", records)
                 for name, records in value.items()]
    elif phase == "forward":
        # Parameters first: a divergent weight, not the output it makes, is the origin.
        sides = [(f"{scope}.{name}", "forward", "parameter", record)
                 for name, record in (value.get("parameters") or {}).items()]
        sides += [(scope, "forward", "input", [value.get("input_args", []),
                                               value.get("input_kwargs", {})]),
                  (scope, "forward", "output", value.get("output", []))]
    else:
        sides = [(scope, "backward", "local_input", value.get("output", [])),
                 (scope, "backward", "output", value.get("input", []))]
    entries = []
    for module, side_phase, io, records in sides:
        tensors = [r for r in _records(records) if _is_float_tensor(r)]
        entries += [_entry(record, module, call, side_phase, io, index,
                           f"{where}: {key} {io} {index}")
                    for index, record in enumerate(tensors)]
    return entries


def read_step(folder: Path) -> StepDump:
    """One msprobe step folder as a `StepDump` (its manifest in opforge's entry format,
    with ``"format": "msprobe"``), tensors loaded in tensor mode.

    Raises:
        DumpError: see the module docstring.
    """
    dump_path = folder / DUMP_JSON
    dump = _load_json(dump_path, "msprobe's dump.json")
    if not isinstance(dump, dict) or not isinstance(dump.get("data"), dict) or \
            dump.get("framework") != "pytorch":
        raise DumpError(f"{dump_path}: not an msprobe PyTorch dump (no 'data', or framework "
                        f"{dump.get('framework') if isinstance(dump, dict) else None!r})")
    if dump.get("task") not in ("statistics", "tensor"):
        raise DumpError(f"{dump_path}: task {dump.get('task')!r}; compare reads statistics "
                        "and tensor dumps")
    mode = dump["task"]
    entries = [entry for key, value in dump["data"].items()
               for entry in _module_entries(key, value, str(dump_path))]
    if not entries:
        raise DumpError(f"{dump_path}: no floating-point tensors recorded")
    keys: set[str] = set()
    for entry in entries:
        if entry["key"] in keys:
            raise DumpError(f"{dump_path}: entry {entry['key']} appears twice")
        keys.add(entry["key"])
    tensors = None
    if mode == "tensor":
        tensors = {entry["key"]: _tensor_of(folder, entry) for entry in entries}
    manifest = {"format": FORMAT, "mode": mode, "level": dump.get("level"),
                "entries": entries}
    return StepDump(folder, manifest, tensors)


def _tensor_of(folder: Path, entry: dict[str, Any]) -> torch.Tensor:
    name = entry.get("data_name")
    if not isinstance(name, str) or not name or name in (".", "..") or \
            re.search(r"[/\\\0]", name):
        raise DumpError(f"{folder}: entry {entry['key']} has no tensor file name in a "
                        f"tensor dump (data_name {name!r})")
    path = folder / TENSOR_FOLDER / name
    tensor = load_tensor(path)
    if list(tensor.shape) != entry["shape"] or \
            str(tensor.dtype).removeprefix("torch.") != entry["dtype"]:
        raise DumpError(f"{path}: a {str(tensor.dtype).removeprefix('torch.')} tensor of "
                        f"shape {list(tensor.shape)}, its record says {entry['dtype']} "
                        f"{entry['shape']}")
    return tensor


def api_scopes(folder: Path) -> dict[str, str]:
    """The module each API call ran in, from ``construct.json``: ``"Functional.linear.3.
    forward" -> "layers.1.fc2"`` (the module's path); empty when the dump has no APIs
    (level L0) or no ``construct.json``."""
    path = folder / CONSTRUCT_JSON
    if not path.is_file():
        return {}
    construct = _load_json(path, "msprobe's construct.json")
    if not isinstance(construct, dict):
        return {}
    scopes = {}
    for key, parent in construct.items():
        match = _KEY.fullmatch(parent) if isinstance(parent, str) else None
        if not key.startswith("Module.") and match is not None:
            scopes[key] = match["scope"].removeprefix("Module.").rsplit(".", 1)[0]
    return scopes
