"""The functional API: torch-style signatures over the ``torch.ops.opforge.*`` operators.

Each operator module defines its functional beside the operator (`OpDef.exported`); this
module serves them all by name (``opforge.functional.softmax`` is ``opforge.softmax``).
Each validates through the operator's `plan` (typed errors before any kernel), supports
autograd, and works inside ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from opforge.core.registry import functionals


def __getattr__(name: str) -> Callable[..., Any]:
    found = functionals().get(name)
    if found is None:
        raise AttributeError(f"module 'opforge.functional' has no attribute {name!r}")
    return found


def __dir__() -> list[str]:
    return sorted({*globals(), *functionals()})
