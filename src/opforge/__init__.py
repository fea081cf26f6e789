"""opforge: define an accelerator operator once, call it three ways, verify and profile it.

    import opforge
    y = opforge.gelu(x)                                    # functional (autograd, compile)
    p = opforge.plan("broadcast_add", a, b); p.run(a, b)   # two-phase, Aclnn style
    torch.ops.opforge.sigmoid(x)                           # the registered torch operator

Set ``TRITON_INTERPRET=1`` before importing opforge to run the Triton kernels on the CPU.
"""

from opforge.core import registry as _registry
from opforge.core.autotune import autotuning, set_autotune, tuning_records
from opforge.core.backends import device_side_checks, use_backend
from opforge.core.errors import (
    AttrError,
    DeviceError,
    DtypeError,
    IndexRangeError,
    OpError,
    ShapeError,
    UnsupportedError,
)
from opforge.core.hardware import HardwareProfile, calibrate, profile_for, use_hardware
from opforge.core.opdef import OpDef, TensorSpec, Tiling
from opforge.core.plan import (
    Plan,
    cache_stats,
    clear_caches,
    plan,
    set_plan_cache,
    set_poison,
    workspace_stats,
)
from opforge.core.registry import get_op, list_ops
from opforge.hf import patch, unpatch
from opforge.profiler import profile

__version__ = "0.1.0"

# Every operator's functional, defined in its module (`OpDef.exported`).
_exported = _registry.functionals()
globals().update(_exported)

# Subpackages a user reaches as attributes after ``import opforge``, as ``torch.nn`` after
# ``import torch``; imported on first use (``opforge.distributed`` imports
# torch.distributed's collectives).
_LAZY_MODULES = ("compat", "distributed", "moe", "nn", "precision", "profiler")


def __getattr__(name: str) -> object:
    if name in _LAZY_MODULES:
        import importlib

        return importlib.import_module(f"opforge.{name}")
    raise AttributeError(f"module 'opforge' has no attribute {name!r}")

__all__ = [
    "AttrError",
    "DeviceError",
    "DtypeError",
    "HardwareProfile",
    "IndexRangeError",
    "OpDef",
    "OpError",
    "Plan",
    "ShapeError",
    "TensorSpec",
    "Tiling",
    "UnsupportedError",
    "autotuning",
    "cache_stats",
    "calibrate",
    "clear_caches",
    "device_side_checks",
    "get_op",
    "list_ops",
    "patch",
    "plan",
    "profile",
    "profile_for",
    "set_autotune",
    "set_plan_cache",
    "set_poison",
    "tuning_records",
    "unpatch",
    "use_backend",
    "use_hardware",
    "workspace_stats",
    *sorted(_exported),
]
