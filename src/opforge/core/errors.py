"""Typed errors raised by `plan` before any kernel runs.

Every error names the operator, the parameter, what was expected and what was given, and
carries an Aclnn-like return code so that logs read like those of the CANN runtime:

=========  ==============================================================
161001     a required input is missing (``ACLNN_ERR_PARAM_NULLPTR``)
161002     an input or attribute is invalid (``ACLNN_ERR_PARAM_INVALID``)
561001     shape inference failed (``ACLNN_ERR_INNER_INFERSHAPE_ERROR``)
561002     no tiling fits the hardware (``ACLNN_ERR_INNER_TILING_ERROR``)
561003     no kernel for this call (``ACLNN_ERR_INNER_FIND_KERNEL_ERROR``)
=========  ==============================================================

Each subclass also derives from the matching built-in exception (``ValueError``,
``TypeError``, ``IndexError``, ``NotImplementedError``) so that generic handlers keep working.
"""

from __future__ import annotations

from typing import Any

PARAM_NULLPTR = 161001
PARAM_INVALID = 161002
INFERSHAPE_ERROR = 561001
TILING_ERROR = 561002
FIND_KERNEL_ERROR = 561003


class OpError(Exception):
    """Base class of every opforge operator error.

    Attributes:
        op: operator name (``"broadcast_add"``) or ``None`` outside an operator.
        param: the offending input or attribute name.
        expected: what the operator accepts, in words.
        got: what it was given, in words.
        code: Aclnn-like return code (see the module docstring).
    """

    default_code = PARAM_INVALID

    def __init__(
        self,
        message: str,
        *,
        op: str | None = None,
        param: str | None = None,
        expected: Any = None,
        got: Any = None,
        code: int | None = None,
    ) -> None:
        self.op = op
        self.param = param
        self.expected = expected
        self.got = got
        self.code = self.default_code if code is None else code
        self.detail = message
        super().__init__(self._format())

    def _format(self) -> str:
        where = ".".join(p for p in (self.op, self.param) if p)
        text = f"[{self.code}] {where}: {self.detail}" if where else f"[{self.code}] {self.detail}"
        if self.expected is not None or self.got is not None:
            text += f" (expected {self.expected}, got {self.got})"
        return text

    def __reduce__(self) -> tuple[Any, ...]:
        # Keep keyword-only fields across pickling (torch.compile workers, multiprocessing).
        return (_rebuild, (type(self), self.detail, self.op, self.param, self.expected,
                           self.got, self.code))


def _rebuild(cls: type[OpError], detail: str, op: str | None, param: str | None,
             expected: Any, got: Any, code: int) -> OpError:
    return cls(detail, op=op, param=param, expected=expected, got=got, code=code)


class ShapeError(OpError, ValueError):
    """Shapes that cannot be broadcast, have the wrong rank, or differ from a plan's."""

    default_code = INFERSHAPE_ERROR


class DtypeError(OpError, TypeError):
    """A dtype the operator does not accept, or that differs from a plan's."""


class DeviceError(OpError, ValueError):
    """Tensors on different devices, or on a device other than a plan's."""


class AttrError(OpError, ValueError):
    """An unknown attribute, or a value of the wrong type, out of range or not a choice."""


class IndexRangeError(OpError, IndexError):
    """An index tensor holds a value outside the range the operator allows."""


class UnsupportedError(OpError, NotImplementedError):
    """A backend cannot run this call (dtype, size, device, on-chip memory) and was chosen
    explicitly, or no tiling variant fits the hardware profile."""

    default_code = FIND_KERNEL_ERROR


__all__ = [
    "FIND_KERNEL_ERROR",
    "INFERSHAPE_ERROR",
    "PARAM_INVALID",
    "PARAM_NULLPTR",
    "TILING_ERROR",
    "AttrError",
    "DeviceError",
    "DtypeError",
    "IndexRangeError",
    "OpError",
    "ShapeError",
    "UnsupportedError",
]
