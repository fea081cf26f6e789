"""Two-phase execution: `plan` (validate, infer, tile, size workspace) then `Plan.run`.

Like Aclnn's ``GetWorkspaceSize`` / ``Xxx`` pair, `plan` does everything that depends only
on the signature of a call — input dtypes, shapes and devices, attribute values — and `run`
only launches. A plan is reusable for every call with the same signature, and `plan` keeps
a bounded LRU cache keyed by that signature, so a repeated signature never re-plans.
Tilings are cached separately under power-of-two shape buckets, so that nearby shapes share
one tiling (and one compiled kernel).
"""

from __future__ import annotations

import contextlib
import os
import threading
import types
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from opforge.core import autotune, backends, registry, settings
from opforge.core.errors import (
    TILING_ERROR,
    DeviceError,
    DtypeError,
    OpError,
    ShapeError,
    UnsupportedError,
)
from opforge.core.hardware import HardwareProfile, hardware_setting, profile_for
from opforge.core.launches import HeldLaunches, replay, trace_launches, tracing
from opforge.core.opdef import Attrs, Cost, OpDef, TensorSpec, Tiling, bucket_specs, dtype_name
from opforge.core.shapes import contiguous_strides
from opforge.core.workspace import WorkspacePool

_POISON = {"enabled": os.environ.get("OPFORGE_POISON", "0") not in ("", "0")}
workspace_pool = WorkspacePool()
# Reentrant: a launcher may run other operators (a composite operator).
_interpreter_lock = threading.RLock()
workspace_pool.poison = _POISON["enabled"]


def set_poison(enabled: bool) -> None:
    """Fill every output and fresh workspace that opforge allocates with NaN (or the
    largest integer) before a kernel writes it, so that unwritten elements fail the tests.
    Also enabled by ``OPFORGE_POISON=1``."""
    _POISON["enabled"] = enabled
    workspace_pool.poison = enabled


RunObserver = Callable[["Plan"], contextlib.AbstractContextManager[Any]]
_observer: list[RunObserver | None] = [None]


def set_run_observer(observer: RunObserver | None) -> RunObserver | None:
    """Wrap every `Plan.run` in ``observer(plan)`` (a context manager), e.g. the profiler's
    record of an operator call; ``None`` removes it. Returns the previous observer."""
    previous = _observer[0]
    _observer[0] = observer
    return previous


def _poisoned(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.is_floating_point():
        tensor.fill_(float("nan"))
    elif tensor.dtype != torch.bool:
        tensor.fill_(torch.iinfo(tensor.dtype).max)
    return tensor


def allocate(spec: TensorSpec) -> torch.Tensor:
    """A contiguous tensor for ``spec`` (poisoned when `set_poison` is on)."""
    # NOTE: torch.empty_strided with the strides given takes 1.1 µs, torch.empty 1.6.
    tensor = torch.empty_strided(spec.shape, contiguous_strides(spec.shape),
                                 dtype=spec.dtype, device=spec.device)
    return _poisoned(tensor) if _POISON["enabled"] else tensor


# ---------------------------------------------------------------------------------------------
# Validation shared by plan and by the fake implementation of the torch operator


@dataclass(frozen=True)
class Signature:
    """A validated call: input specs, attribute values and the output specs they imply."""

    inputs: tuple[TensorSpec | None, ...]
    attrs: dict[str, Any]
    outputs: tuple[TensorSpec, ...]
    device: torch.device


# Bytes a given workspace's first byte must be aligned to.
WORKSPACE_ALIGNMENT = 16


def validate(opdef: OpDef, tensors: Sequence[Any], attrs: Attrs) -> Signature:
    """Check a call against the operator's prototype and infer its outputs.

    Works on real, meta and fake tensors (symbolic sizes included).

    Raises:
        OpError: missing or extra inputs; DtypeError, DeviceError, AttrError, ShapeError
        from the prototype, `OpDef.check` and `OpDef.infer_shape`.
    """
    bound = opdef.bind_inputs(tensors)
    present = [(arg, t) for arg, t in zip(opdef.inputs, bound) if t is not None]
    device = present[0][1].device if present else torch.device("cpu")
    for arg, tensor in present[1:]:
        if tensor.device != device:
            raise DeviceError("is on another device than the first input", op=opdef.name,
                              param=arg.name, expected=str(device), got=str(tensor.device))
    for arg, tensor in present:
        _check_dense(tensor, opdef.name, arg.name)
    values = opdef.bind_attrs(attrs)
    specs = tuple(None if t is None else TensorSpec.of(t) for t in bound)
    opdef.check(specs, values)
    shapes = opdef.infer_shape(specs, values)
    dtypes = opdef.infer_dtype(specs, values)
    outputs = tuple(TensorSpec(tuple(s), d, device) for s, d in zip(shapes, dtypes))
    return Signature(specs, values, outputs, device)


# ---------------------------------------------------------------------------------------------
# Plans


class Plan:
    """A validated, tiled call of one operator, reusable for every call with its signature.

    Attributes:
        op: the `OpDef`.
        inputs: input specs (``None`` for an absent optional input).
        attrs: attribute values, defaults filled in.
        outputs: output specs (shape, dtype, device).
        backend: ``"triton"`` or ``"torch"``.
        hardware: the `HardwareProfile` the tiling was made for.
        tiling: the chosen `Tiling` (``None`` on the torch backend when no variant fits).
        grid: launch grid for ``tiling`` (``()`` without one).
        workspace_bytes: scratch bytes `run` needs (0 on the torch backend).
        cost: FLOPs and bytes moved.
    """

    __slots__ = ("_allocations", "_checked", "_declined", "_direct", "_empty", "_held",
                 "_launcher", "_mutated", "_output_bytes", "_seen", "_steps",
                 "attrs", "backend", "cost", "grid", "hardware", "inputs", "op", "outputs",
                 "tiling", "workspace_bytes")

    def __init__(self, op: OpDef, signature: Signature, backend: str,
                 hardware: HardwareProfile, tiling: Tiling | None, grid: tuple[int, ...],
                 workspace_bytes: int, cost: Cost) -> None:
        self.op = op
        self.inputs = signature.inputs
        self.attrs = signature.attrs
        self.outputs = signature.outputs
        self.backend = backend
        self.hardware = hardware
        self.tiling = tiling
        self.grid = grid
        self.workspace_bytes = workspace_bytes
        self.cost = cost
        # Nothing to launch when no output has an element, unless the operator writes
        # into inputs: those writes need not depend on the outputs' sizes.
        self._mutated = op.mutated_inputs
        self._empty = not self._mutated and not any(spec.numel for spec in self.outputs)
        self._steps: dict[str, Plan] = {}  # a composite operator's steps, see run_step
        # What `run_planned` does per call, decided once: the launch function, the
        # outputs' allocation arguments, and whether nothing else runs around them.
        self._direct = not self._mutated
        self._held: HeldLaunches | None = None
        if backend == "torch" and "torch" not in op.launchers:
            self._launcher = run_reference
        else:
            self._launcher = op.launchers[backend]
            holds = op.held_launches
            if self._direct and backend != "torch" and (
                    holds(self.attrs) if callable(holds) else holds):
                self._launcher = self._held = HeldLaunches(self._launcher)
            if backends.interpreter_enabled():
                self._launcher = _locked(self._launcher)
                self._held = None  # replays must take the interpreter's lock too
        # `run` with ``out``: the last call's tensor identities, the armed replay's
        # identities, descriptions and held launches, and the identities last found to
        # need a buffer for an out (`_remember`).
        self._seen: tuple[int, ...] = ()
        self._checked: tuple[tuple[int, ...], list[Any], list[Any] | None] | None = None
        self._declined: tuple[int, ...] = ()
        self._output_bytes = tuple(spec.numel * spec.itemsize for spec in self.outputs)
        self._allocations = tuple((spec.shape, contiguous_strides(spec.shape), spec.dtype,
                                   spec.device) for spec in self.outputs)

    def __repr__(self) -> str:
        ins = ", ".join("None" if s is None else str(s) for s in self.inputs)
        outs = ", ".join(str(s) for s in self.outputs)
        variant = self.tiling.variant if self.tiling else "-"
        return (f"Plan({self.op.name}({ins}) -> [{outs}], backend={self.backend}, "
                f"tiling={variant}, grid={self.grid}, workspace={self.workspace_bytes} B)")

    @property
    def steps(self) -> Mapping[str, Plan]:
        """A composite operator's step plans by name, as its runs have made them."""
        return types.MappingProxyType(self._steps)

    def run_step(self, name: str, op: str | OpDef, *tensors: torch.Tensor | None,
                 out: torch.Tensor | Sequence[torch.Tensor] | None = None,
                 **attrs: Any) -> Any:
        """Run step ``name`` of a composite operator: another operator that this plan's
        launcher applies to ``tensors`` (its inputs or intermediates), into ``out`` when
        given. The step is planned on its first run and kept with this plan: its
        signature follows from this plan's, so later runs skip the plan-cache lookup and
        the input checks (a decode call is bound by such host costs). A step without a
        ``workspace=`` takes its scratch from the pool, which may hand it the buffer this
        plan's own workspace views: a launcher keeps nothing in its workspace across a
        step (work on one stream runs in order, so scratch used before or after a step
        is safe)."""
        found = self._steps.get(name)
        if found is None:
            found = self._steps[name] = plan(op, *tensors, **attrs)
        if tracing():
            results = found.traced(tensors, out)
            if results is None:
                raise UnsupportedError("cannot be traced into a compiled graph",
                                       op=found.op.name, param="step",
                                       expected="a traceable plan", got=name)
            return results[0] if len(results) == 1 else tuple(results)
        return found._observed(tensors, out, None)

    def _check_inputs(self, tensors: Sequence[Any]) -> Sequence[torch.Tensor | None]:
        specs = self.inputs
        if len(tensors) != len(specs):
            if len(tensors) > len(specs):
                raise OpError("run was given more tensors than the plan has inputs",
                              op=self.op.name, param="inputs", expected=len(specs),
                              got=len(tensors))
            tensors = [*tensors, *[None] * (len(specs) - len(tensors))]
        for index, spec in enumerate(specs):
            tensor = tensors[index]
            if spec is None or tensor is None:
                if spec is not tensor:
                    raise ShapeError("presence differs from the plan's", op=self.op.name,
                                     param=self.op.inputs[index].name,
                                     expected="None" if spec is None else spec,
                                     got="None" if tensor is None else TensorSpec.of(tensor))
            else:
                if not _matches(tensor, spec):
                    _raise_mismatch(tensor, spec, self.op.name, self.op.inputs[index].name)
        return tensors

    def _outputs(self, out: torch.Tensor | Sequence[torch.Tensor] | None,
                 inputs: Sequence[torch.Tensor | None]
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(buffers the kernel writes, tensors returned to the caller). An ``out`` that
        overlaps an input is written through a fresh buffer (a kernel would overwrite
        elements other programs have yet to read), unless it is that input itself and the
        operator is `OpDef.inplace_out`."""
        if out is None:
            fresh = [allocate(spec) for spec in self.outputs]
            return fresh, fresh
        given = [out] if isinstance(out, torch.Tensor) else (
            list(out) if isinstance(out, (list, tuple)) else [out])
        for tensor in given:
            if not isinstance(tensor, torch.Tensor):
                raise OpError("out must be a tensor or a sequence of tensors",
                              op=self.op.name, param="out", expected="torch.Tensor",
                              got=", ".join(type(t).__name__ for t in given))
        if len(given) != len(self.outputs):
            raise OpError("out has the wrong number of tensors", op=self.op.name, param="out",
                          expected=len(self.outputs), got=len(given))
        # Kernels write contiguous outputs, or any layout whose elements are distinct where
        # the operator says its launchers honour strides; else a strided `out` is filled
        # through a copy. An out overlapping an input goes through a fresh buffer too.
        # The common call (contiguous outs of their own memory) costs a few attribute reads
        # per tensor: this runs on every `run(out=)`, beside a launch of a few µs.
        spans: list[tuple[int, int]] | None = None  # the inputs'
        out_spans: list[tuple[int, int]] = []
        names = self.op.outputs
        targets = []
        for index, tensor in enumerate(given):
            spec = self.outputs[index]
            if not _matches(tensor, spec):
                _raise_mismatch(tensor, spec, self.op.name, names[index].name)
            nbytes = self._output_bytes[index]  # the tensor's: it has the spec's shape and dtype
            contiguous = tensor.is_contiguous()  # distinct elements by construction
            if not nbytes:  # no element to write or to overlap anything
                out_spans.append((0, 0))
                targets.append(tensor if contiguous or self.op.strided_out else allocate(spec))
                continue
            if contiguous:
                start = tensor.data_ptr()
                end = start + nbytes
                distinct = True
            else:
                distinct = _distinct_elements(tensor)
                if not distinct and _repeated_offsets(tensor):
                    raise OpError("has elements that share memory (an expanded or "
                                  "overlapping view)", op=self.op.name,
                                  param=names[index].name,
                                  expected="an out whose elements are distinct",
                                  got=f"shape {tuple(tensor.shape)}, strides {tensor.stride()}")
                start, end = _span(tensor)
            for earlier, (other_start, other_end) in enumerate(out_spans):
                if start < other_end and other_start < end and \
                        _share_elements(tensor, given[earlier]):
                    raise OpError(f"shares memory with out {names[earlier].name}",
                                  op=self.op.name, param=names[index].name,
                                  expected="outs of their own memory",
                                  got=f"storage offsets {tensor.storage_offset()} and "
                                      f"{given[earlier].storage_offset()} of one storage")
            out_spans.append((start, end))
            if spans is None:
                spans = _spans(inputs)
            direct = contiguous or (self.op.strided_out and distinct)
            if direct:
                for input_start, input_end in spans:
                    if start < input_end and input_start < end:
                        direct = not self._overlaps_an_input(tensor, (start, end), inputs)
                        break
            targets.append(tensor if direct else allocate(spec))
        return targets, given

    def _overlaps_an_input(self, out: torch.Tensor, span: tuple[int, int],
                           inputs: Sequence[torch.Tensor | None]) -> bool:
        """Whether ``out`` (its memory range ``span``, which meets an input's) overlaps an
        input other than as the very same elements of an in-place operator's input."""
        start, end = span
        for t in inputs:
            if t is None or not t.numel():
                continue
            input_start, input_end = _span(t)
            if start < input_end and input_start < end and not (
                    self.op.inplace_out and t.data_ptr() == out.data_ptr()
                    and t.dtype == out.dtype and t.shape == out.shape
                    and t.stride() == out.stride()):
                return True
        return False

    def run(self, *tensors: torch.Tensor | None,
            out: torch.Tensor | Sequence[torch.Tensor] | None = None,
            workspace: torch.Tensor | None = None) -> Any:
        """Execute the plan.

        Args:
            tensors: the inputs, in prototype order (``None`` for absent optionals); shapes,
                dtypes and devices must equal the plan's.
            out: preallocated output(s) matching `outputs`; allocated when omitted. One
                the kernels cannot write directly (strided for an operator without
                `OpDef.strided_out`, or overlapping an input) is filled through a buffer.
            workspace: a uint8 (or any) tensor of at least `workspace_bytes` bytes on the
                plan's device, starting on a `WORKSPACE_ALIGNMENT`-byte boundary (any
                fresh tensor does) and sharing no memory with the inputs and outputs;
                taken from the pool when omitted. With ``out`` written directly and
                ``workspace`` given, `run` allocates neither outputs nor scratch, so it
                can be captured in a CUDA graph (a composite operator's intermediates come
                from the graph's memory pool), and does not synchronise, but for a range
                check that reads device indices on the host (skipped during capture and
                inside `opforge.device_side_checks`, see `backends.host_reads_allowed`).

        Returns:
            The output tensor for a single-output operator, else a tuple.

        Raises:
            ShapeError, DtypeError, DeviceError: a tensor does not match the plan.
            OpError: wrong number of inputs or outputs, an ``out`` or ``workspace`` that is
                not a tensor, an ``out`` whose elements share memory (an expanded view), or
                a workspace that is too small, misaligned or overlaps an input or output.

        Calls with ``out`` on the same tensor objects (a decode loop's held buffers, every
        input given, ``workspace`` given where the plan needs one) skip these checks from
        the third call on, while each tensor's address, shape, strides, dtype and device,
        all that the checks read, stay as they were: only the operator's value checks run
        before the launches held for that layout (an 8 x 256 unary call on the CPU,
        launches stubbed: 3.4 µs a call against 6.1 checked; docs/architecture.md).
        """
        if out is None or _observer[0] is not None:
            return self._observed(self._check_inputs(tensors), out, workspace)
        outs = tuple(out) if isinstance(out, (list, tuple)) else (out,)
        slots = (*tensors, *outs, workspace)
        identities = (len(tensors), *map(id, slots))  # which are inputs counts too
        checked = self._checked
        if checked is not None and checked[0] == identities and \
                _described(slots) == checked[1]:
            if self.op.check_values is not None:
                self.op.check_values(self, tensors)
            if checked[2] is None or not replay(checked[2], slots):
                self._launcher(self, tensors, outs, workspace)
            return outs[0] if len(outs) == 1 else outs
        if identities != self._seen or identities == self._declined:
            self._seen = identities
            return self._observed(self._check_inputs(tensors), out, workspace)
        described = _described(slots)  # what the checks about to run will have read
        results = self._observed(self._check_inputs(tensors), out, workspace)
        self._remember(identities, described, tensors, outs, workspace)
        return results

    def _remember(self, identities: tuple[int, ...], described: list[Any],
                  tensors: Sequence[torch.Tensor | None], outs: Sequence[torch.Tensor],
                  workspace: torch.Tensor | None) -> None:
        """After the second checked `run` in a row with ``out`` on the same tensor objects
        (``described`` as they were before its checks): arm the replay of later ones
        (`run`) when its launches take its tensors as given: every input, outputs written
        in place (none through a buffer: an ``out`` that overlaps an input, or strided
        where the kernels write contiguous rows), a workspace that is exactly the plan's
        flat bytes where it needs one, none where it does not."""
        if not self._direct or self._empty or len(tensors) != len(self.inputs) or \
                not described:
            return
        if workspace is None:
            if self.workspace_bytes:  # taken from the pool on each call
                return
        elif not self.workspace_bytes or workspace.dtype is not torch.uint8 or \
                workspace.dim() != 1 or workspace.numel() != self.workspace_bytes:
            return  # ignored by the checked path, or the launcher got a view of it
        slots = (*tensors, *outs, workspace)
        if _described(slots) != described:  # changed while the checks ran (a thread)
            return
        targets, _ = self._outputs(outs, tensors)
        if any(target is not given for target, given in zip(targets, outs)):
            self._declined = identities  # not asked again for these objects
            return
        launches = self._held.held_for(slots) if self._held is not None else None
        self._checked = (identities, described, launches)

    def run_planned(self, tensors: Sequence[torch.Tensor | None]) -> Any:
        """`run` into fresh outputs without the input checks, for a caller that got this
        plan from `plan` with these very tensors, one per prototype input (the torch
        operator's implementation, the functional): the plan-cache key it matched, or the
        validation it was built by, already covered their presence, shapes, dtypes and
        devices."""
        if not self._direct or _observer[0] is not None:
            return self._observed(tensors, None, None)
        # The common call: no in-place inputs, no observer: check the values, allocate and
        # launch (each skipped step is a fraction of a microsecond of a ~10 µs call).
        if self.op.check_values is not None:
            self.op.check_values(self, tensors)
        outputs = [torch.empty_strided(shape, strides, dtype=dtype, device=device)
                   for shape, strides, dtype, device in self._allocations]
        if _POISON["enabled"]:
            for tensor in outputs:
                _poisoned(tensor)
        if not self._empty:
            scratch = (workspace_pool.get(self.workspace_bytes, outputs[0].device)
                       if self.workspace_bytes else None)
            self._launcher(self, tensors, outputs, scratch)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def traced(self, tensors: Sequence[torch.Tensor | None],
               out: torch.Tensor | Sequence[torch.Tensor] | None = None
               ) -> list[torch.Tensor] | None:
        """`run_planned` (into ``out`` when given: a composite's step) as torch operators
        and Triton launches made through `torch.library.wrap_triton`, for a compiler that
        traces the call (AOTAutograd's functionalisation, under whose mode this runs): the
        outputs, or ``None`` for a call that stays one opaque operator (the torch backend,
        an operator that writes into its inputs, checks their values on the host, or
        whose launcher is not held: one that reads data on the host)."""
        if self._held is None or self.op.check_values is not None:
            return None
        if out is None:
            outputs = [allocate(spec) for spec in self.outputs]
        else:
            outputs = [out] if isinstance(out, torch.Tensor) else list(out)
        if not self._empty:
            scratch = None
            if self.workspace_bytes:
                scratch = torch.empty(self.workspace_bytes, dtype=torch.uint8,
                                      device=outputs[0].device)
                if workspace_pool.poison:  # as the pool's fresh buffers
                    scratch.fill_(0xFF)
            trace_launches(self._held.launcher, (self, tensors, outputs, scratch))
        return outputs

    def _observed(self, inputs: Sequence[torch.Tensor | None],
                  out: torch.Tensor | Sequence[torch.Tensor] | None,
                  workspace: torch.Tensor | None) -> Any:
        observer = _observer[0]
        if observer is None:
            results = self._execute(inputs, out, workspace)
        else:
            with observer(self):
                results = self._execute(inputs, out, workspace)
        return results[0] if len(results) == 1 else tuple(results)

    def _execute(self, inputs: Sequence[torch.Tensor | None],
                 out: torch.Tensor | Sequence[torch.Tensor] | None,
                 workspace: torch.Tensor | None) -> list[torch.Tensor]:
        for index in self._mutated:
            _check_writable(inputs[index], self.op.name, self.op.inputs[index].name)
        if self.op.check_values is not None:
            self.op.check_values(self, inputs)
        targets, results = self._outputs(out, inputs)
        scratch = (self._workspace(workspace, [*inputs, *targets]) if self.workspace_bytes
                   else None)
        if not self._empty:
            self._launcher(self, inputs, targets, scratch)
        for target, result in zip(targets, results):
            if target is not result:
                result.copy_(target)
        return results

    def _workspace(self, workspace: torch.Tensor | None,
                   tensors: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
        """The scratch bytes: from the pool, or the given ``workspace`` once it is checked
        to be a large enough, aligned, contiguous tensor on the plan's device that shares
        no memory with ``tensors`` (the inputs and outputs: scratch writes would corrupt
        them)."""
        if self.workspace_bytes == 0:
            return None
        device = self.outputs[0].device
        if workspace is None:
            return workspace_pool.get(self.workspace_bytes, device)
        if not isinstance(workspace, torch.Tensor):
            raise OpError("workspace must be a tensor", op=self.op.name, param="workspace",
                          expected="torch.Tensor", got=type(workspace).__name__)
        nbytes = workspace.numel() * workspace.element_size()
        if nbytes < self.workspace_bytes or workspace.device != device:
            raise OpError("workspace is too small or on another device", op=self.op.name,
                          param="workspace",
                          expected=f">= {self.workspace_bytes} bytes on {device}",
                          got=f"{nbytes} bytes on {workspace.device}")
        if not workspace.is_contiguous():
            raise OpError("workspace must be contiguous", op=self.op.name, param="workspace",
                          expected="a contiguous tensor", got=f"strides {workspace.stride()}")
        # The usual workspace is flat bytes of the plan's size: no views to make.
        scratch = workspace if nbytes == self.workspace_bytes and workspace.dim() == 1 and \
            workspace.dtype is torch.uint8 else \
            workspace.view(torch.uint8).reshape(-1)[: self.workspace_bytes]
        start = scratch.data_ptr()
        if start % WORKSPACE_ALIGNMENT:
            # Launchers view the scratch as float32 or int64, and kernels assume aligned
            # vector access: the pool's buffers are aligned, a slice of one may not be.
            raise OpError("workspace is not aligned", op=self.op.name, param="workspace",
                          expected=f"a first byte on a {WORKSPACE_ALIGNMENT}-byte boundary",
                          got=f"address % {WORKSPACE_ALIGNMENT} = "
                              f"{start % WORKSPACE_ALIGNMENT}")
        end = start + self.workspace_bytes
        for other_start, other_end in _spans(tensors):
            if other_start < other_end and start < other_end and other_start < end:
                raise OpError("workspace shares memory with an input or output",
                              op=self.op.name, param="workspace",
                              expected="scratch memory of its own",
                              got=f"bytes {start}..{end} overlap {other_start}..{other_end}")
        return scratch


def _described(tensors: Sequence[Any]) -> list[Any]:
    """What `Plan.run`'s checks read of ``tensors``: each one's address, strides, shape,
    dtype and device (flat, ``None`` for an absent one; ``[]`` when an object is not a
    strided tensor, which the checks then report)."""
    described: list[Any] = []
    try:
        for tensor in tensors:
            if tensor is None:
                described.append(None)
            else:
                described += (tensor.data_ptr(), tensor.stride(), tensor.shape, tensor.dtype,
                              tensor.device)
    except (AttributeError, RuntimeError, NotImplementedError, TypeError):
        return []
    return described


def _locked(launcher: Callable[..., None]) -> Callable[..., None]:
    """``launcher`` holding the interpreter's lock: the interpreter patches
    triton.language globally while a kernel runs, and two threads interpreting at once
    corrupt each other."""
    def run(*args: Any) -> None:
        with _interpreter_lock:
            launcher(*args)
    return run


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """The byte addresses ``[start, end)`` a non-empty tensor's elements lie within."""
    start = end = tensor.data_ptr()
    if tensor.is_contiguous():
        return start, end + tensor.nbytes
    for size, stride in zip(tensor.shape, tensor.stride()):
        reach = (size - 1) * stride * tensor.element_size()
        start, end = (start + reach, end) if reach < 0 else (start, end + reach)
    return start, end + tensor.element_size()


def _spans(tensors: Sequence[torch.Tensor | None]) -> list[tuple[int, int]]:
    """`_span` of each tensor given (an empty contiguous one spans nothing)."""
    spans = []
    for tensor in tensors:
        if tensor is not None:
            if tensor.is_contiguous():  # inline: `_span` would read contiguity again
                start = tensor.data_ptr()
                spans.append((start, start + tensor.nbytes))
            elif tensor.numel():
                spans.append(_span(tensor))
    return spans


def _check_writable(tensor: torch.Tensor | None, op: str, name: str) -> None:
    """An input the operator updates in place must accept the update: torch forbids it on
    an inference tensor outside ``torch.inference_mode``.

    Raises:
        OpError: ``tensor`` is such an inference tensor.
    """
    if tensor is not None and tensor.is_inference() and not torch.is_inference_mode_enabled():
        raise OpError("is an inference tensor, which cannot be updated in place outside "
                      "torch.inference_mode", op=op, param=name,
                      expected="a tensor made outside torch.inference_mode (or call the "
                               "operator inside it)", got="an inference tensor")


def _overwrites_what_it_reads(opdef: OpDef, tensors: Sequence[Any]) -> bool:
    """Whether an input the operator updates in place shares memory with another input
    (one viewing rows of a cache the call overwrites): a second run would read what the
    first wrote, so autotuning's repeated runs must not happen."""
    mutated = set(opdef.mutated_inputs)
    written = [_span(tensors[i]) for i in mutated if tensors[i] is not None and tensors[i].numel()]
    read = [_span(t) for i, t in enumerate(tensors)
            if i not in mutated and isinstance(t, torch.Tensor) and t.numel()]
    return any(start < other_end and other_start < end
               for start, end in written for other_start, other_end in read)


def _distinct_elements(tensor: torch.Tensor) -> bool:
    """Whether no two elements of ``tensor`` share memory, by a sufficient test: ordered
    by stride, each dim steps past everything the smaller-strided dims span (true of any
    permuted or sliced dense layout). A layout it cannot vouch for goes through a copy."""
    span = 1
    for size, stride in sorted((d for d in zip(tensor.shape, tensor.stride()) if d[0] > 1),
                               key=lambda d: d[1]):
        if stride < span:
            return False
        span = stride * size
    return True


def _offsets(tensor: torch.Tensor) -> torch.Tensor:
    """The byte address of every element (a layout `_distinct_elements` cannot vouch
    for: rare, and small enough to list)."""
    offsets = torch.zeros((), dtype=torch.int64)
    for size, stride in zip(tensor.shape, tensor.stride()):
        offsets = offsets.unsqueeze(-1) + torch.arange(size) * stride
    return offsets.reshape(-1) * tensor.element_size() + tensor.data_ptr()


# Elements whose addresses `_repeated_offsets` lists (8 bytes each) before it gives up.
MAX_LISTED_ELEMENTS = 1 << 24


def _repeated_offsets(tensor: torch.Tensor) -> bool:
    """Whether two elements of ``tensor`` lie at one address, or may (a layout too large
    to list whose elements no sufficient test shows distinct)."""
    if any(size > 1 and stride == 0 for size, stride in zip(tensor.shape, tensor.stride())):
        return True  # expanded
    if tensor.numel() > MAX_LISTED_ELEMENTS:
        return True
    return bool(tensor.numel()) and torch.unique(_offsets(tensor)).numel() < tensor.numel()


def _share_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` have an element at one address, or may (spans that meet,
    too large to list)."""
    if not a.numel() or not b.numel():
        return False
    (start_a, end_a), (start_b, end_b) = _span(a), _span(b)
    if start_a >= end_b or start_b >= end_a:
        return False
    if max(a.numel(), b.numel()) > MAX_LISTED_ELEMENTS:
        return True
    return bool(torch.isin(_offsets(a), _offsets(b)).any())


def _check_dense(tensor: torch.Tensor, op: str, name: str) -> None:
    """Kernels address elements through strides: a sparse (or other non-strided) layout
    is refused before any of them runs.

    Raises:
        OpError: ``tensor`` is not of the strided layout.
    """
    if tensor.layout != torch.strided:
        raise OpError("must be a dense tensor", op=op, param=name,
                      expected="torch.strided layout (call .to_dense())",
                      got=str(tensor.layout))


def _matches(tensor: Any, spec: TensorSpec) -> bool:
    """Whether ``tensor`` is a dense tensor of ``spec`` (the common case, in one
    expression: a dtype is a singleton)."""
    try:
        return tensor.dtype is spec.dtype and tensor.shape == spec.shape and \
            tensor.layout is torch.strided and tensor.device == spec.device
    except AttributeError:
        return False


def _raise_mismatch(tensor: Any, spec: TensorSpec, op: str, name: str) -> None:
    """Raises the typed error for a tensor that is not of ``spec`` (a plan's input or
    output): not a tensor, not dense, another dtype, shape or device."""
    if not isinstance(tensor, torch.Tensor):
        raise DtypeError("is not a tensor", op=op, param=name, expected="torch.Tensor",
                         got=type(tensor).__name__)
    _check_dense(tensor, op, name)
    if tensor.dtype != spec.dtype:
        raise DtypeError("dtype differs from the plan's", op=op, param=name,
                         expected=dtype_name(spec.dtype), got=dtype_name(tensor.dtype))
    if tensor.shape != spec.shape:
        raise ShapeError("shape differs from the plan's", op=op, param=name,
                         expected=tuple(spec.shape), got=tuple(tensor.shape))
    raise DeviceError("device differs from the plan's", op=op, param=name,
                      expected=str(spec.device), got=str(tensor.device))


def run_reference(plan: Plan, inputs: Sequence[torch.Tensor | None],
                  outputs: Sequence[torch.Tensor], workspace: torch.Tensor | None) -> None:
    """The torch backend: the operator's reference at float32 (float64 for float64 inputs),
    rounded once into the outputs (and into the mutated inputs, whole)."""
    wide = any(t is not None and t.dtype == torch.float64 for t in inputs)
    assert plan.op.reference_fn is not None, f"{plan.op.name} has no reference"
    results = plan.op.reference_fn(*inputs, compute_dtype=torch.float64 if wide
                                   else torch.float32, **plan.attrs)
    mutated = [inputs[i] for i in plan.op.mutated_inputs]
    for target, value in zip([*outputs, *mutated],
                             results if isinstance(results, tuple) else (results,)):
        target.copy_(value)


# ---------------------------------------------------------------------------------------------
# Caches


@dataclass
class CacheStats:
    """Plan and tiling cache counters."""

    plan_hits: int = 0
    plan_misses: int = 0
    tiling_hits: int = 0
    tiling_misses: int = 0
    plans_cached: int = 0
    capacity: int = 0


class _Caches:
    def __init__(self, capacity: int) -> None:
        self.plans: OrderedDict[tuple[Any, ...], Plan] = OrderedDict()
        self.calls: dict[tuple[Any, ...], Plan] = {}  # `plan_for_call`'s keys
        self.tilings: OrderedDict[tuple[Any, ...], Tiling | None] = OrderedDict()
        self.capacity = capacity
        self.stats = CacheStats(capacity=capacity)
        self.lock = threading.Lock()
        self.enabled = True

    def put(self, store: OrderedDict[tuple[Any, ...], Any], key: tuple[Any, ...],
            value: Any) -> None:
        with self.lock:
            store[key] = value
            store.move_to_end(key)
            while len(store) > self.capacity:
                store.popitem(last=False)
            self.stats.plans_cached = len(self.plans)


_caches = _Caches(int(os.environ.get("OPFORGE_PLAN_CACHE_SIZE", "1024")))


def cache_stats() -> CacheStats:
    """A snapshot of the plan and tiling cache counters."""
    with _caches.lock:
        return CacheStats(**vars(_caches.stats))


def workspace_stats() -> Any:
    """A snapshot of the workspace pool counters (requests, allocations, bytes held)."""
    return type(workspace_pool.stats)(**vars(workspace_pool.stats))


def clear_caches() -> None:
    """Drop every cached plan and tiling, release the workspace pool, reset counters."""
    with _caches.lock:
        _caches.plans.clear()
        _caches.calls.clear()
        _caches.tilings.clear()
        _caches.stats = CacheStats(capacity=_caches.capacity)
    workspace_pool.clear()


def set_plan_cache(enabled: bool) -> None:
    """Turn the plan and tiling caches on or off (off: every call plans from scratch)."""
    _caches.enabled = enabled


def _freeze(value: Any) -> Any:
    """An attribute value as a cache key: hashable, and typed, so that values that compare
    equal but validate differently (``2`` and ``2.0``, ``1`` and ``True``) never share a
    plan."""
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(item) for item in value)
    return type(value), value


def _choose_tiling(opdef: OpDef, signature: Signature, hardware: HardwareProfile,
                   tune: Callable[[list[Tiling], str], Tiling] | None = None) -> Tiling | None:
    """The first candidate that fits on chip, or with ``tune`` (autotuning) the one it
    picks among the fitting ones; cached per bucket."""
    bucketed = bucket_specs(signature.inputs)
    key = (opdef, tuple(bucketed), tuple(signature.attrs.items()), hardware.name,
           tune is not None)
    if _caches.enabled:
        with _caches.lock:
            if key in _caches.tilings:
                _caches.stats.tiling_hits += 1
                _caches.tilings.move_to_end(key)
                return _caches.tilings[key]
            _caches.stats.tiling_misses += 1
    bucketed_out = bucket_specs(signature.outputs)
    candidates = opdef.tiling(bucketed, bucketed_out, signature.attrs, hardware)
    fitting = [t for t in candidates
               if t.onchip_bytes <= hardware.onchip_limit(t.double_buffered)]
    chosen = fitting[0] if fitting else None
    if tune is not None and len(fitting) > 1:
        bucket = ", ".join("None" if s is None else str(s) for s in bucketed)
        attrs = ", ".join(f"{name}={value!r}" for name, value in signature.attrs.items())
        chosen = tune(fitting, f"({bucket}) {{{attrs}}}")
    if _caches.enabled:
        _caches.put(_caches.tilings, key, chosen)
    return chosen


def _tuner(opdef: OpDef, signature: Signature, backend: str, hardware: HardwareProfile,
           tensors: Sequence[Any]) -> Callable[[list[Tiling], str], Tiling]:
    """Autotuning's choice among fitting tilings: each candidate's plan runs on
    ``tensors`` into its own outputs, outside the run observer (a profile shows the call,
    not its tuning)."""
    def prepare(tiling: Tiling) -> Callable[[], Any]:
        candidate = _assemble(opdef, signature, backend, hardware, tiling)
        inputs = candidate._check_inputs(tensors)
        outputs = candidate._execute(inputs, None, None)
        return lambda: candidate._execute(inputs, outputs, None)

    def tune(fitting: list[Tiling], bucket: str) -> Tiling:
        key = autotune.bucket_key(opdef.name, bucket, signature.device, hardware.name)
        return autotune.choose(opdef.name, key, fitting, prepare, signature.device)

    return tune


def _tiling_refusal(opdef: OpDef, signature: Signature, hardware: HardwareProfile) -> str:
    candidates = opdef.tiling(bucket_specs(signature.inputs), bucket_specs(signature.outputs),
                              signature.attrs, hardware)
    needs = ", ".join(f"{t.variant} needs {t.onchip_bytes} B"
                      f"{' (double-buffered)' if t.double_buffered else ''}"
                      for t in candidates)
    return (f"no tiling fits the {hardware.name} on-chip memory of {hardware.onchip_bytes} B "
            f"(half when double-buffered): {needs}")


def _assemble(opdef: OpDef, signature: Signature, backend: str, hardware: HardwareProfile,
              tiling: Tiling | None) -> Plan:
    grid = (opdef.grid(tiling, signature.inputs, signature.outputs, signature.attrs, hardware)
            if tiling is not None else ())
    workspace = (opdef.workspace(tiling, grid, signature.inputs, signature.outputs,
                                 signature.attrs)
                 if tiling is not None and backend != "torch" else 0)
    cost = opdef.cost(signature.inputs, signature.outputs, signature.attrs)
    return Plan(opdef, signature, backend, hardware, tiling, grid, workspace, cost)


def _build(opdef: OpDef, tensors: Sequence[Any], attrs: Attrs) -> Plan:
    signature = validate(opdef, tensors, attrs)
    hardware = profile_for(signature.device)
    backend = backends.select_backend(opdef, signature.inputs, signature.attrs,
                                      signature.device)
    tune = (_tuner(opdef, signature, backend, hardware, tensors)
            if backend != "torch" and autotune.autotune_enabled()
            and autotune.tunable(tensors, opdef.reruns_alike)
            and not _overwrites_what_it_reads(opdef, tensors) else None)
    tiling = _choose_tiling(opdef, signature, hardware, tune) if opdef.launchers else None
    if tiling is None and backend != "torch":
        reason = _tiling_refusal(opdef, signature, hardware)
        if backends.requested_backend() == "triton":
            raise UnsupportedError(reason, op=opdef.name, param="tiling",
                                   expected="a variant that fits on chip",
                                   got=", ".join(str(s) for s in signature.inputs if s),
                                   code=TILING_ERROR)
        backends.warn_fallback(opdef.name, reason)
        backend = "torch"
    return _assemble(opdef, signature, backend, hardware, tiling)


def settings_key() -> tuple[Any, ...]:
    """This thread's backend, autotuning and hardware settings as one hashable key (kept
    until a setting changes: `opforge.core.settings`)."""
    key = settings.cached_key()
    if key is None:
        key = settings.store_key(backends.requested_backend(), autotune.autotune_enabled(),
                                 hardware_setting())
    return key


def plan_for_call(opdef: OpDef, args: Sequence[Any]) -> Plan:
    """`plan` for a call given as the torch operator's arguments (tensors, then attribute
    values in prototype order, trailing defaults omitted) whose tensors are plain strided
    ones: the functional's path. Its cache is a plain dict keyed by the settings, each
    tensor's shape, dtype and device and each attribute's type and value, built in one
    pass (`plan`'s keyword key costs about 2 µs more).

    Raises:
        OpError and its subclasses, as `plan`.
    """
    count = len(opdef.inputs)
    # One flat list (each tensor's three fields, or None), then the frozen attributes:
    # 0.3 µs less than nested tuples for two tensors.
    described: list[Any] = [opdef, settings_key()]
    for tensor in args[:count]:
        if tensor is None:
            described.append(None)
        else:
            described += (tensor.shape, tensor.dtype, tensor.device)
    for value in args[count:]:
        described.append(_freeze(value) if type(value) in (list, tuple)
                         else (type(value), value))
    try:
        key = tuple(described)
        found = _caches.calls.get(key)
    except TypeError:  # an unhashable attribute: let validation report it
        key, found = None, None
    if found is not None and _caches.enabled:
        _caches.stats.plan_hits += 1  # unlocked: a counter, not state
        return found
    built = plan(opdef, *args[:count], **dict(zip(opdef.attr_names, args[count:])))
    if key is not None and _caches.enabled:
        if len(_caches.calls) >= _caches.capacity:
            _caches.calls.clear()
        _caches.calls[key] = built
    return built


def plan(op: str | OpDef, *tensors: torch.Tensor | None, **attrs: Any) -> Plan:
    """Phase one of a call: validate, infer output specs, choose backend and tiling, size
    the workspace. Cached by signature (operator, input shapes/dtypes/devices, attributes,
    backend setting, autotuning setting, hardware profile). With autotuning on
    (`opforge.core.autotune`), the first plan of a tiling bucket on the Triton backend
    runs the fitting tilings on ``tensors`` and keeps the fastest.

    Args:
        op: an operator name (``"broadcast_add"``) or an `OpDef`.
        tensors: inputs in prototype order; ``None`` in the place of an absent optional.
        attrs: attribute values by name; defaults fill the rest.

    Returns:
        A `Plan`; call ``plan.run(*tensors)`` to execute it.

    Raises:
        OpError and its subclasses for any invalid input (see `opforge.core.errors`).
    """
    opdef = registry.get_op(op) if isinstance(op, str) else op
    described = [(t.shape, t.dtype, t.device, t.layout) if isinstance(t, torch.Tensor) else t
                 for t in tensors]
    key = (opdef, settings_key(), tuple(described),
           tuple(sorted((k, _freeze(v)) for k, v in attrs.items())) if attrs else ())
    if _caches.enabled:
        try:
            with _caches.lock:
                cached = _caches.plans.get(key)
                if cached is not None:
                    _caches.stats.plan_hits += 1
                    _caches.plans.move_to_end(key)
                    return cached
                _caches.stats.plan_misses += 1
        except TypeError:  # an unhashable argument: let validation report it
            key = ()
    built = _build(opdef, tensors, attrs)
    if _caches.enabled and key:
        _caches.put(_caches.plans, key, built)
    return built
