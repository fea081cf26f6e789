"""Liger-Kernel's implementations as ``opforge bench`` peers, when the package is installed."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from opforge.core.opdef import Case


def liger_peer(module: str, function: str, arguments: Callable[[Case], tuple[Any, ...]]
               ) -> Callable[[Case], Callable[[], Any] | None]:
    """A `BenchSpec` peer factory: ``liger_kernel.ops.<module>.<function>.apply`` on
    ``arguments(case)``; ``None`` when Liger-Kernel is not installed or lacks it."""
    def factory(case: Case) -> Callable[[], Any] | None:
        try:
            apply = getattr(importlib.import_module(f"liger_kernel.ops.{module}"), function).apply
        except (ImportError, AttributeError):
            return None
        args = arguments(case)
        return lambda: apply(*args)
    return factory
