"""Held launches: the kernel launches a launcher makes for one plan, recorded once per
layout of its tensors and replayed.

A launcher turns a plan and its tensors into kernel launches: views, strides, int64-offset
switches, grid, constexprs and launch options. For a given plan all of that depends only
on the tensors' strides and pointer alignment, so it is worked out once: the first call of
each layout runs the launcher with the kernels' ``run`` replaced by a recorder and torch's
operators watched by a dispatch mode. When the launcher did nothing but launch (views
aside), each recorded launch is kept with its tensor arguments mapped back to the call's
inputs, outputs and workspace; later calls of that layout make the launches straight away.
A launcher that ran any other operator (an allocation, a copy, a sort) keeps running as it
is for that layout. On the CPU, with the launches stubbed, the softmax launcher costs 4.8 µs
and its replay about 1.5 µs.

A replay's first launch goes through the kernel's ``run`` (Triton's binder, specialisation
key and cache lookup, about 4 µs of the 5.6 µs a ``kernel[grid](...)`` costs) and keeps
the compiled kernel it returns; later launches call that compiled kernel's launcher as
``run`` itself does, with the same arguments (Triton 3.3 and later: every parameter in
signature order, defaults filled in). The specialisation cannot change between replays of
one layout: the plan fixes every scalar, the layout the strides and the pointers'
alignment. A kernel with pre-run hooks, a grid function, another current device or a
Triton without this launcher keeps going through ``run``.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Layouts recorded per plan; a plan that sees more runs its launcher for the rest.
MAX_LAYOUTS = 16
# Argument types a replay can hold as they are.
_CONSTANT_TYPES = (int, float, bool, str, type(None), torch.dtype)
_recording = threading.Lock()
# .active: this thread is inside a recording or tracing pass; .tracing: a tracing one.
_recorder = threading.local()
_MISSING = object()


class _Effects(TorchDispatchMode):
    """Records whether any operator other than a view ran inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.effects: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        if not func.is_view:
            self.effects.append(str(func))
        return func(*args, **(kwargs or {}))


def _kernel_classes() -> list[type]:
    """The classes whose ``run`` a kernel launch goes through (compiled and interpreted):
    each that defines ``run`` itself (Triton 3.2's interpreter launches ``kernel[grid]``
    through another path, which no recording sees)."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:  # pragma: no cover - no triton, no Triton launcher
        return []
    classes: list[type] = [JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction
        classes.append(InterpretedFunction)
    except ImportError:  # pragma: no cover - a Triton without an interpreter
        pass
    return [cls for cls in classes if "run" in cls.__dict__]


@contextlib.contextmanager
def _launches_redirected(handler: Callable[[Any, tuple[Any, ...], dict[str, Any]], None]
                         ) -> Iterator[None]:
    """Within the block, each kernel launch this thread makes (``kernel[grid](...)``, that
    is ``kernel.run(*args, grid=..., warmup=..., **kwargs)``) goes to ``handler(kernel,
    args, kwargs)`` instead; other threads' launches, and any a handler makes itself, are
    made as usual. Composite steps run their launchers as they are (`HeldLaunches`)."""
    thread = threading.get_ident()
    with _recording:
        originals = [(cls, cls.__dict__["run"]) for cls in _kernel_classes()]
        handling = [False]

        def redirected(original: Callable[..., Any]) -> Callable[..., Any]:
            def run(kernel: Any, *kernel_args: Any, **kwargs: Any) -> Any:
                if threading.get_ident() != thread or handling[0]:
                    return original(kernel, *kernel_args, **kwargs)
                handling[0] = True
                try:
                    handler(kernel, kernel_args, kwargs)
                finally:
                    handling[0] = False
                return None
            return run

        for cls, original in originals:
            cls.run = redirected(original)
        _recorder.active = True
        try:
            yield
        finally:
            _recorder.active = False
            for cls, original in originals:
                cls.run = original


def _recorded(launcher: Callable[..., None], args: Sequence[Any]
              ) -> tuple[list[tuple[Any, tuple[Any, ...], dict[str, Any]]], list[str]]:
    """Run ``launcher(*args)`` with the kernels' launches recorded instead of made, and
    the non-view operators it ran."""
    launches: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []
    with _launches_redirected(lambda *launch: launches.append(launch)), _Effects() as watched:
        launcher(*args)
    return launches, watched.effects


def trace_launches(launcher: Callable[..., None], args: Sequence[Any]) -> None:
    """Run ``launcher(*args)`` with each kernel launch made through
    `torch.library.wrap_triton`: under a compiler's tracing mode, the launch becomes a node
    of the traced graph (the compiled program makes it), beside the torch operators the
    launcher runs."""
    from torch.library import wrap_triton

    def launch(kernel: Any, kernel_args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if kwargs.get("warmup"):  # a compilation ahead of time, no launch
            return
        options = {name: value for name, value in kwargs.items()
                   if name not in ("grid", "warmup")}
        wrap_triton(kernel)[kwargs["grid"]](*kernel_args, **options)

    if tracing():  # a composite's step: the launches are redirected already
        launcher(*args)
        return
    with _launches_redirected(launch):
        _recorder.tracing = True
        try:
            launcher(*args)
        finally:
            _recorder.tracing = False


def tracing() -> bool:
    """Whether this thread runs a launcher under `trace_launches` (a composite's steps are
    traced into the same graph)."""
    return getattr(_recorder, "tracing", False)


def _triton_launch_api() -> tuple[Any, Any] | None:
    """(Triton's knobs, its active driver) where a compiled kernel takes every parameter
    and the knobs' launch hooks (Triton 3.3 and later), else None."""
    try:
        from triton import knobs
        from triton.runtime import driver
    except ImportError:
        return None
    return knobs, driver


_LAUNCH_API = _triton_launch_api()


def _direct_launch(kernel: Any, compiled: Any, count: int, keywords: dict[str, Any]
                   ) -> Callable[[list[Any]], bool] | None:
    """A launcher of ``compiled`` (what ``kernel.run`` returned) for a call of ``count``
    positional arguments and ``keywords``: given this call's positional arguments, it
    launches and returns True, or returns False where ``kernel.run`` must launch instead
    (another current device). None where the compiled kernel cannot be launched directly
    (see the module docstring)."""
    if _LAUNCH_API is None or compiled is None or getattr(kernel, "pre_run_hooks", True):
        return None
    if hasattr(compiled, "result"):  # a compilation future
        compiled = compiled.result()
    grid = keywords.get("grid")
    if not (isinstance(grid, tuple) and 1 <= len(grid) <= 3 and all(
            hasattr(compiled, name) for name in ("run", "function", "packed_metadata",
                                                 "launch_metadata"))):
        return None
    tail = []
    for param in kernel.params[count:]:
        if param.name in keywords:
            tail.append(keywords[param.name])
        elif param.default is not inspect.Parameter.empty:
            tail.append(param.default)
        else:
            return None
    knobs, driver = _LAUNCH_API
    active = driver.active
    device = active.get_current_device()
    sizes = (*grid, 1, 1)[:3]
    launch, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
    describe = compiled.launch_metadata
    runtime = knobs.runtime

    def run(arguments: list[Any]) -> bool:
        if active.get_current_device() != device:
            return False
        stream = active.get_current_stream(device)
        values = (*arguments, *tail)
        launch(*sizes, stream, function, metadata, describe(grid, stream, *values),
               runtime.launch_enter_hook, runtime.launch_exit_hook, *values)
        return True

    return run


class _Launch:
    """One recorded kernel launch: its constant arguments, where each tensor argument
    comes from (a slot of the call: an input, an output or the workspace, or a view of one
    at a byte offset in another dtype), and its compiled kernel's launcher once known."""

    __slots__ = ("arguments", "direct", "kernel", "keywords", "tensors")

    def __init__(self, kernel: Any, arguments: list[Any], keywords: dict[str, Any],
                 tensors: list[tuple[int, int, Callable[[torch.Tensor], torch.Tensor] | None]]
                 ) -> None:
        self.kernel, self.arguments, self.keywords = kernel, arguments, keywords
        self.tensors = tensors
        # None: not tried yet; False: launches go through the kernel's run.
        self.direct: Callable[[list[Any]], bool] | bool | None = None

    def run(self, slots: Sequence[torch.Tensor | None]) -> None:
        arguments = self.arguments.copy()
        for position, slot, view in self.tensors:
            tensor = slots[slot]
            arguments[position] = tensor if view is None else view(tensor)
        direct = self.direct
        if direct and direct(arguments):
            return
        compiled = self.kernel.run(*arguments, **self.keywords)
        if direct is None:
            self.direct = _direct_launch(self.kernel, compiled, len(arguments),
                                         self.keywords) or False


def _byte_view(offset: int, nbytes: int, dtype: torch.dtype
               ) -> Callable[[torch.Tensor], torch.Tensor]:
    # The last view made, while the tensor it was made of lives: a plan's calls mostly
    # reuse one workspace (the pool's, or the caller's), and its view costs 1.8 µs to make
    # again against 0.2 to find. The address tells a tensor whose storage was swapped
    # (``set_``); the weak reference keeps no memory past its tensor's life.
    last: list[Any] = [None, 0, None]

    def forget(ref: weakref.ref) -> None:
        if last[0] is ref:
            last[:] = None, 0, None

    def view(tensor: torch.Tensor) -> torch.Tensor:
        address = tensor.data_ptr()
        ref, known, made = last
        if ref is not None and ref() is tensor and address == known:
            return made
        base = tensor
        # The usual slot is a workspace, already flat bytes: two view operators, not four.
        if tensor.dtype is not torch.uint8 or tensor.dim() != 1:
            tensor = tensor.reshape(-1).view(torch.uint8)
        made = tensor[offset:offset + nbytes].view(dtype)
        last[:] = weakref.ref(base, forget), address, made
        return made
    return view


def _source(argument: torch.Tensor, slots: Sequence[torch.Tensor | None]
            ) -> tuple[int, Callable[[torch.Tensor], torch.Tensor] | None] | None:
    """Which slot a kernel's tensor argument is (a kernel reads only its address and
    dtype), or a contiguous view into: ``None`` for a tensor of its own (a temporary)."""
    address = argument.data_ptr()
    for index, slot in enumerate(slots):
        if slot is None:
            continue
        if slot.data_ptr() == address and slot.dtype == argument.dtype:
            return index, None
    if not argument.numel():
        # A kernel reads no element of an empty tensor: an empty view of any contiguous
        # slot, in the argument's dtype, stands for it (a composite's unused output).
        for index, slot in enumerate(slots):
            if slot is not None and slot.is_contiguous():
                return index, _byte_view(0, 0, argument.dtype)
        return None
    for index, slot in enumerate(slots):
        if slot is None or not slot.is_contiguous() or not argument.is_contiguous():
            continue
        offset = address - slot.data_ptr()
        nbytes = argument.numel() * argument.element_size()
        if offset >= 0 and offset + nbytes <= slot.numel() * slot.element_size():
            return index, _byte_view(offset, nbytes, argument.dtype)
    return None


def _held(launches: Sequence[tuple[Any, tuple[Any, ...], dict[str, Any]]],
          slots: Sequence[torch.Tensor | None]) -> list[_Launch] | None:
    held = []
    for kernel, arguments, keywords in launches:
        if not all(isinstance(v, _CONSTANT_TYPES) or (isinstance(v, tuple) and all(
                isinstance(item, int) for item in v)) for v in keywords.values()):
            return None  # a grid or option the replay cannot hold as it is
        constants: list[Any] = []
        tensors = []
        for position, argument in enumerate(arguments):
            if isinstance(argument, torch.Tensor):
                source = _source(argument, slots)
                if source is None:
                    return None
                tensors.append((position, *source))
                constants.append(None)
            elif isinstance(argument, _CONSTANT_TYPES):
                constants.append(argument)
            else:
                return None  # a tensor descriptor, or another object holding tensors
        held.append(_Launch(kernel, constants, dict(keywords), tensors))
    return held


class HeldLaunches:
    """A plan's launcher with its launches held per layout (see the module docstring).

    Args:
        launcher: ``launcher(plan, inputs, outputs, workspace)``, which writes every
            output from the inputs without reading host state other than the plan's
            (a launcher that reads data on the host runs an operator, and is not held).
    """

    __slots__ = ("launcher", "layouts")

    def __init__(self, launcher: Callable[..., None]) -> None:
        self.launcher = launcher
        self.layouts: dict[tuple[Any, ...], list[_Launch] | None] = {}

    def __call__(self, plan: Any, inputs: Sequence[torch.Tensor | None],
                 outputs: Sequence[torch.Tensor], workspace: torch.Tensor | None) -> None:
        if getattr(_recorder, "active", False):
            # A composite's step inside another plan's recording pass: its launches are
            # that pass's to record (its outputs were allocated: not replayable there).
            self.launcher(plan, inputs, outputs, workspace)
            return
        slots = (*inputs, *outputs, workspace)
        key = _layout(slots)
        held = self.layouts.get(key, _MISSING)
        if held is _MISSING:
            # Empty tensors (torch gives each the address 0) hold nothing to confuse.
            present = [t.data_ptr() for t in slots if t is not None and t.numel()]
            if len(self.layouts) >= MAX_LAYOUTS or len(set(present)) < len(present):
                # Slots that share an address (an out that is an input, one tensor given
                # twice) cannot tell which slot a launch argument came from: not held,
                # and the layout waits for a call without them.
                self.launcher(plan, inputs, outputs, workspace)
                return
            launches, effects = _recorded(self.launcher, (plan, inputs, outputs, workspace))
            # No launch recorded: the kernels ran by a path the recorder does not see, and
            # wrote this call's outputs; replaying nothing would leave the next unwritten.
            held = None if effects or not launches else _held(launches, slots)
            self.layouts[key] = held
            if not launches:
                return
        if held is None:
            self.launcher(plan, inputs, outputs, workspace)
            return
        for launch in held:
            launch.run(slots)

    def held_for(self, slots: Sequence[torch.Tensor | None]) -> list[_Launch] | None:
        """The launches held for the layout of ``slots`` (inputs, outputs, workspace), for
        a caller that replays them on tensors of that very layout (`replay`); ``None``
        where that layout runs the launcher or has not been seen."""
        held = self.layouts.get(_layout(slots))
        return held if isinstance(held, list) else None


def replay(launches: Sequence[_Launch], slots: Sequence[torch.Tensor | None]) -> bool:
    """Make ``launches`` (`HeldLaunches.held_for` of this layout) on ``slots``; ``False``
    without a launch inside another launcher's recording pass, whose recorder must see
    the launcher run."""
    if getattr(_recorder, "active", False):
        return False
    for launch in launches:
        launch.run(slots)
    return True


def _layout(slots: Sequence[torch.Tensor | None]) -> tuple[Any, ...]:
    """What a held launch depends on in its tensors: each slot's strides and alignment (flat,
    ``None`` for an absent slot)."""
    layout: list[Any] = []
    for tensor in slots:
        if tensor is None:
            layout.append(None)
        else:
            layout += (tensor.stride(), tensor.data_ptr() % 16)
    return tuple(layout)
