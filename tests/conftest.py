"""Test set-up: Triton's interpreter on machines without a GPU (it must be on before the
kernels are defined), a fresh torch.compile cache, NaN-poisoned outputs, hypothesis
profiles, and the golden check."""

from __future__ import annotations

import importlib.util
import inspect
import os
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Inductor's FX-graph and AOTAutograd caches key on the traced graph, not on an operator's
# Python autograd formula: a cache left by an earlier version of the code replays that
# version's backward graph. Each test run compiles into its own directory.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="opforge-inductor-"))
# Autotuning choices (when a test turns it on) go to a file of the run's own.
os.environ.setdefault("OPFORGE_AUTOTUNE_CACHE",
                      os.path.join(tempfile.mkdtemp(prefix="opforge-autotune-"), "choices.json"))

import pytest
from hypothesis import HealthCheck, settings

import opforge
from opforge.core.opdef import Case, OpDef, Tiling
from opforge.precision.metrics import compare_tensors
from opforge.precision.verify import EPS_BOUNDS, golden_of, rounded_range

settings.register_profile("ci", max_examples=12, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=40, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BACKENDS = ("torch", "triton")
# Without Triton (an install of opforge without the `triton` extra) the torch backend is
# what runs: tests of the Triton kernels, launches or compiler skip with this reason.
TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not TRITON, reason="Triton is not installed")
# On-device tensor descriptors came after Triton 3.2 (what triton-ascend ships).
DESCRIPTORS = TRITON and hasattr(importlib.import_module("triton.language"),
                                 "make_tensor_descriptor")
needs_descriptors = pytest.mark.skipif(not DESCRIPTORS,
                                       reason="this Triton has no tl.make_tensor_descriptor")
LOW_PRECISION = (torch.float32, torch.float16, torch.bfloat16)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without Triton, every test that names it (a backend it asks for, its kernels, its
    compiler, the `launches` fixture) skips with `needs_triton`'s reason; the rest run on
    the torch backend."""
    if TRITON:
        return
    for item in items:
        function = getattr(item, "function", None)
        try:
            source = inspect.getsource(function) if function is not None else ""
        except (OSError, TypeError):
            source = ""
        if "triton" in source.lower() or "launches" in getattr(item, "fixturenames", ()):
            item.add_marker(needs_triton)


@pytest.fixture(autouse=True)
def poison_outputs():
    """Every output and fresh workspace opforge allocates starts as NaN."""
    opforge.set_poison(True)
    yield
    opforge.set_poison(False)


@pytest.fixture
def setenv(monkeypatch):
    """``setenv(name, value)``: `monkeypatch.setenv` for the variables opforge reads once
    (`opforge.core.settings`), read again at once and again after the test."""
    from opforge.core import settings

    def set_variable(name: str, value: str) -> None:
        monkeypatch.setenv(name, value)
        settings.reload_environment()

    yield set_variable
    monkeypatch.undo()
    settings.reload_environment()


@pytest.fixture
def fresh_plans(monkeypatch):
    """Plans made for the test alone: a plan holds its tiling, launcher and launches, so a
    test that patches what they come from drops the caches before and (after the patches
    are undone) after it."""
    opforge.clear_caches()
    yield
    monkeypatch.undo()
    opforge.clear_caches()


@pytest.fixture
def replace_launcher(monkeypatch):
    """``replace_launcher(op, backend, launcher)`` for the test: a plan holds the launcher
    it was built with, so the plan caches are dropped when one is replaced and again when
    it is restored."""
    def replace(op: OpDef, backend: str, launcher: object) -> None:
        monkeypatch.setitem(op.launchers, backend, launcher)
        opforge.clear_caches()

    yield replace
    monkeypatch.undo()
    opforge.clear_caches()


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Run the test once per backend (the triton one skipped without Triton)."""
    if request.param == "triton" and not TRITON:
        pytest.skip("Triton is not installed")
    with opforge.use_backend(request.param):
        yield request.param


@pytest.fixture
def launches(monkeypatch):
    """The Triton kernel launches of the test, in order, as ``(kernel name, keyword
    arguments)`` (the constexprs and launch options): the kernels still run."""
    recorded: list[tuple[str, dict[str, object]]] = []
    if opforge.core.backends.interpreter_enabled():
        # Every interpreted launch runs a GridExecutor (Triton 3.2's `kernel[grid]` makes
        # one without going through `run`).
        from triton.runtime import interpreter

        launcher_type, attribute = interpreter.GridExecutor, "__call__"
    else:
        from triton.runtime import jit

        launcher_type, attribute = jit.JITFunction, "run"
    real = getattr(launcher_type, attribute)

    def launch(self, *args, **kwargs):
        recorded.append((self.fn.__name__, {k: v for k, v in kwargs.items()
                                            if k not in ("grid", "warmup")}))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(launcher_type, attribute, launch)
    return recorded


def assert_golden(opdef: OpDef, case: Case, outputs: object) -> float:
    """Assert that ``outputs`` match the float64 golden of ``case`` within the dtype's
    bound (max_eps, see opforge.precision.metrics) with NaN/Inf where the golden has them
    (a golden beyond the output dtype's range is the Inf it rounds to).
    Returns the worst max_eps."""
    goldens, scales = golden_of(opdef, case)
    outputs = list(outputs) if isinstance(outputs, tuple) else [outputs]
    worst = 0.0
    for out, golden, scale in zip(outputs, goldens, scales, strict=True):
        if not out.dtype.is_floating_point:  # indices: exactly the golden's
            assert torch.equal(out.cpu(), golden.to(out.dtype)), (
                f"{opdef.name}/{case.name}: integer output differs from the golden")
            continue
        stats = compare_tensors(out, rounded_range(golden, out.dtype), scale=scale)
        bound = EPS_BOUNDS[out.dtype]
        assert stats.nan_inf_mismatch == 0, (
            f"{opdef.name}/{case.name}: {stats.nan_inf_mismatch} NaN/Inf mismatches")
        assert stats.max_eps <= bound, (
            f"{opdef.name}/{case.name} {out.dtype}: max_eps {stats.max_eps:.3g} > {bound} "
            f"at {stats.worst_index} (max abs {stats.max_abs:.3g})")
        worst = max(worst, stats.max_eps)
    return worst


def force_attention_tiles(monkeypatch: pytest.MonkeyPatch, pack: int, splits: int,
                          block_q: int = 16) -> None:
    """Attention's tilings forced to 16-wide blocks (``block_q`` streamed queries on the
    key side), the GQA packing of decoding when ``pack`` > 1 (forward only) and ``splits``
    key slices: many blocks of every kind on small inputs."""
    from opforge.ops import attention

    def tiles(sq, sk, d, dv, item, hardware, backward, group=1):
        return [Tiling("flash", {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_D": 16, "BLOCK_DV": 16,
                                 "BLOCK_K": 16, "BLOCK_Q": block_q}, 0, double_buffered=False,
                       options={"pack_gqa": True} if pack > 1 and not backward else {})]

    monkeypatch.setattr(attention, "_tiles", tiles)
    monkeypatch.setattr(attention, "_key_splits", lambda *args: splits)
