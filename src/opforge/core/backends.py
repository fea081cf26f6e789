"""Backend selection: which implementation of an operator runs a call.

``torch``  the operator's reference at float32 (float64 for float64 inputs): any device.
``triton`` the operator's Triton kernels: cuda/xpu/npu tensors, or CPU tensors when
           ``TRITON_INTERPRET=1`` (Triton's interpreter).
``auto``   ``triton`` for accelerator tensors, ``torch`` on the CPU.

The setting comes from `use_backend` (innermost wins, per thread), else ``OPFORGE_BACKEND``
(read once: `opforge.core.settings.reload_environment`), else ``auto``. A backend may
decline a call (dtype, size) and say why: under ``auto`` the call falls back to ``torch``
and the reason is logged once; a backend chosen explicitly raises `UnsupportedError`
instead. float64 inputs always run on ``torch``: the kernels
compute in float32, and gradcheck and goldens need float64.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
import threading
from collections.abc import Iterator, Sequence

import torch

from opforge.core import settings
from opforge.core.errors import UnsupportedError
from opforge.core.opdef import Attrs, OpDef, TensorSpec

BACKENDS = ("auto", "torch", "triton")
ACCELERATOR_TYPES = ("cuda", "xpu", "npu")

logger = logging.getLogger("opforge")
_state = threading.local()
_logged: set[tuple[str, str]] = set()
_logged_lock = threading.Lock()


def capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on ``device``'s current stream: a host read of
    device data (the range check of an index tensor, say) cannot run then, so kernels that
    take indices also skip the out-of-range ones themselves."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def host_reads_allowed(device: torch.device) -> bool:
    """Whether a check may read device data on the host now (one synchronisation per
    call): not while a CUDA graph is captured on ``device``'s stream, nor inside
    `device_side_checks`. Kernels that take indices skip the out-of-range ones themselves
    then."""
    return not getattr(_state, "device_side", 0) and not capturing(device)


@contextlib.contextmanager
def device_side_checks() -> Iterator[None]:
    """Inside the block (this thread), operators whose kernels skip out-of-range indices
    themselves leave the range check to them instead of reading the indices on the host
    (their checks ask `host_reads_allowed`): no synchronisation, so the host
    runs ahead of the device (a decode loop), and a bad index writes nothing instead of
    raising `IndexRangeError`. Operators whose kernels cannot skip still check (the README
    says which operator is which).

    Raises:
        RuntimeError: entered inside a function being compiled by torch.compile (it would
            apply only while tracing).
    """
    if torch.compiler.is_compiling():
        raise RuntimeError("opforge.device_side_checks inside a torch.compile'd function "
                           "would only apply while tracing: enter it around the compiled "
                           "call")
    _state.device_side = getattr(_state, "device_side", 0) + 1
    try:
        yield
    finally:
        _state.device_side -= 1


class HostRead:
    """A device value on its way to the host. The copy is queued on the current stream
    behind the work already there, and `value` waits for that copy alone: kernels queued
    between the two keep the device busy while the host waits, where a plain ``.item()``
    would drain the queue and leave the device idle until the host launches again. A CPU
    tensor is read at once.

    Args:
        tensor: the value to read (small: a reduction's result).
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        self._event = None
        if tensor.device.type == "cuda":
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(tensor.device))
            tensor = host
        self._host = tensor

    def value(self) -> torch.Tensor:
        """The tensor on the host, once its copy has landed."""
        if self._event is not None:
            self._event.synchronize()
        return self._host


@functools.cache
def triton_available() -> bool:
    """True when the ``triton`` package can be imported."""
    return importlib.util.find_spec("triton") is not None


@functools.cache
def interpreter_enabled() -> bool:
    """True when Triton kernels run in the interpreter (``TRITON_INTERPRET=1``). Read once:
    Triton decides it when the kernels are defined, at import."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _check_name(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; expected one of {', '.join(BACKENDS)}")
    return name


def requested_backend() -> str:
    """The backend setting in force: `use_backend`, else ``OPFORGE_BACKEND``, else auto.

    Raises:
        ValueError: ``OPFORGE_BACKEND`` names no backend.
    """
    stack = getattr(_state, "stack", None)
    if stack:
        return stack[-1]
    return _check_name(settings.environment("OPFORGE_BACKEND") or "auto")


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[str]:
    """Run the block with backend ``name`` (``auto``, ``torch``, ``triton``) in this thread.

    The backend is read when an operator runs, so a compiled function's operators run on
    the backend in force around the compiled call. Inside a compiled function the block
    would only be seen while tracing: it raises there, so that torch.compile runs that
    function eagerly, where the block applies (``fullgraph=True`` reports the error).

    Raises:
        ValueError: unknown backend name.
        RuntimeError: entered inside a function being compiled by torch.compile.
    """
    if torch.compiler.is_compiling():
        raise RuntimeError("opforge.use_backend inside a torch.compile'd function would only "
                           "apply while tracing: enter it around the compiled call")
    stack = getattr(_state, "stack", None)
    if stack is None:
        stack = _state.stack = []
    stack.append(_check_name(name))
    settings.changed()
    try:
        yield name
    finally:
        stack.pop()
        settings.changed()


def _triton_refusal(device: torch.device) -> str | None:
    if not triton_available():
        return "the triton package is not installed"
    if device.type == "cpu" and not interpreter_enabled():
        return "CPU tensors need TRITON_INTERPRET=1 to run Triton kernels"
    if device.type not in ("cpu", *ACCELERATOR_TYPES):
        return f"Triton does not target {device.type} tensors"
    return None


def select_backend(opdef: OpDef, inputs: Sequence[TensorSpec | None], attrs: Attrs,
                   device: torch.device) -> str:
    """Resolve the backend for one call (see the module docstring).

    Raises:
        UnsupportedError: an explicitly requested backend cannot run the call.
    """
    requested = requested_backend()
    if any(s is not None and s.dtype == torch.float64 for s in inputs):
        return "torch"
    if requested == "torch":
        return "torch"
    if requested == "auto" and device.type not in ACCELERATOR_TYPES:
        return "torch"
    reason = _triton_refusal(device)
    if reason is None and "triton" not in opdef.launchers:
        reason = "the operator has no Triton kernel"
    if reason is None and "triton" in opdef.decliners:
        reason = opdef.decliners["triton"](inputs, attrs)
    if reason is None:
        return "triton"
    if requested == "triton":
        raise UnsupportedError(f"the triton backend cannot run this call: {reason}",
                               op=opdef.name, param="backend", expected="a supported call",
                               got=", ".join(str(s) for s in inputs if s is not None))
    warn_fallback(opdef.name, reason)
    return "torch"


def warn_fallback(op: str, reason: str) -> None:
    """Log, once per (operator, reason), that a call falls back to the torch backend."""
    with _logged_lock:
        first = (op, reason) not in _logged
        _logged.add((op, reason))
    if first:
        logger.warning("opforge.%s: falling back to the torch backend: %s", op, reason)
