"""The operator registry: `list_ops` and `get_op` over the modules of `opforge.ops`."""

from __future__ import annotations

import importlib
import pkgutil
import threading
from collections.abc import Callable
from typing import Any

from opforge.core.errors import OpError
from opforge.core.opdef import OpDef

_registry: dict[str, OpDef] = {}
_lock = threading.Lock()
_loaded = False


def add(opdef: OpDef) -> None:
    """Record ``opdef`` under its name (called by `opforge.library.register_op`).

    Raises:
        ValueError: another operator already has this name.
    """
    with _lock:
        existing = _registry.get(opdef.name)
        if existing is not None and existing is not opdef:
            raise ValueError(f"operator {opdef.name!r} is registered twice")
        _registry[opdef.name] = opdef


def _load_all() -> None:
    global _loaded
    if _loaded:
        return
    import opforge.ops as package

    for module in pkgutil.iter_modules(package.__path__):
        if not module.name.startswith("_"):
            importlib.import_module(f"{package.__name__}.{module.name}")
    _loaded = True


def list_ops() -> list[OpDef]:
    """Every registered operator, sorted by name."""
    _load_all()
    return [_registry[name] for name in sorted(_registry)]


def get_op(name: str) -> OpDef:
    """The operator called ``name``.

    Raises:
        OpError: no such operator; the message lists the known names.
    """
    found = _registry.get(name)  # registered: no module scan (torch.compile traces this)
    if found is not None:
        return found
    _load_all()
    try:
        return _registry[name]
    except KeyError:
        raise OpError("unknown operator", param="op", expected=", ".join(sorted(_registry)),
                      got=repr(name)) from None


def functionals() -> dict[str, Callable[..., Any]]:
    """Every exported functional (`OpDef.exported`) by its name."""
    return {op.functional.__name__: op.functional for op in list_ops()
            if op.functional is not None}
