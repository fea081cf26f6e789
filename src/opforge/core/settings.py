"""The environment opforge reads, read once, and a per-thread slot for the settings key.

A plan depends on the call's tensors and attributes and on three settings: the backend
(`use_backend`, ``OPFORGE_BACKEND``), the hardware profile (`use_hardware`,
``OPFORGE_HARDWARE``) and autotuning (`autotuning`, ``OPFORGE_AUTOTUNE``). Reading two
environment variables and three thread-local stacks on every call cost about 2 µs of a
20 µs call, so `plan` keeps the three as one tuple per thread (`cached_key`), which the
context managers drop (`changed`) when they enter and exit. The environment is read on
first use; `reload_environment` reads it again (a test, or a program that sets a variable
after its first opforge call).
"""

from __future__ import annotations

import os
import threading
from typing import Any

VARIABLES = ("OPFORGE_BACKEND", "OPFORGE_HARDWARE")
# The reading in force (None: read on first use); replaced whole, never mutated, so a
# thread reading it never sees half a reading.
_environment: list[dict[str, str] | None] = [None]
_generation = [0]  # bumped by reload_environment: every thread's key is stale then
_local = threading.local()


def environment(name: str) -> str:
    """The value of one of `VARIABLES` as first read ("" when unset)."""
    reading = _environment[0]
    if reading is None:
        reading = _environment[0] = {v: os.environ.get(v, "") for v in VARIABLES}
    return reading[name]


def reload_environment() -> None:
    """Read ``OPFORGE_BACKEND`` and ``OPFORGE_HARDWARE`` again, for every thread."""
    _environment[0] = None
    _generation[0] += 1


def cached_key() -> tuple[Any, ...] | None:
    """This thread's settings key, or ``None`` when it must be computed again."""
    key = getattr(_local, "key", None)
    return key if key is not None and key[0] == _generation[0] else None


def store_key(*settings: Any) -> tuple[Any, ...]:
    """Keep ``settings`` as this thread's key (tagged with the environment's generation)."""
    key = _local.key = (_generation[0], *settings)
    return key


def changed() -> None:
    """This thread's settings changed (a context manager entered or exited)."""
    _local.key = None
