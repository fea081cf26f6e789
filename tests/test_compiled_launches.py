"""Compiled calls on a CUDA device: traced into their plans' Triton kernel launches, which
the compiled program makes itself (`Plan.traced`), or kept as one opaque operator where
the plan says why.

On a CPU, `tests/compiled_trace.py` traces each operator's sample as AOTAutograd does
(fake CUDA tensors) in a process with compiled kernels, and the tests compare its launches
with the eager call's. On a GPU, compiled calls run and are compared with eager ones.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import opforge
from opforge.library import TRACE_VARIABLE

from .conftest import DEVICE

# Operators whose compiled call stays one opaque node, and the plan's reason.
OPAQUE = {
    "attention_varlen": "checks its cumulative lengths on the host",
    "attention_varlen_backward": "checks its cumulative lengths on the host",
    "cross_entropy": "checks its targets' range on the host",
    "cross_entropy_backward": "checks its targets' range on the host",
    "embedding_dense_grad": "checks its indices' range on the host",
    "fused_linear_cross_entropy": "checks its targets on the host, class blocks by composite steps",
    "fused_linear_cross_entropy_backward": "checks its targets on the host, class blocks by steps",
    "mla_prolog": "writes its caches in place",
}
OPS = [op.name for op in opforge.list_ops()]
TRACED = sorted(set(OPS) - set(OPAQUE))


def _traced(*arguments: str) -> dict[str, dict[str, Any]]:
    """`tests/compiled_trace.py`'s records by operator, run with compiled kernels and
    without ``OPFORGE_TRACE_COMPILED`` in the environment (it sets it itself)."""
    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", TRACE_VARIABLE)}
    done = subprocess.run([sys.executable, "-m", "tests.compiled_trace", *arguments],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = {}
    for line in done.stdout.splitlines():
        record = json.loads(line)
        found[record["op"]] = record
    return found


@pytest.fixture(scope="module")
def traces() -> dict[str, dict[str, Any]]:
    return _traced()


def test_compiled_calls_stay_opaque_by_default():
    for name, record in _traced("--default", "softmax", "rms_norm_backward").items():
        for case in record["cases"]:
            if case["backend"] == "triton" and not case["empty"]:
                assert not case["traced"] and f"opforge.{name}.default" in case["opaque"]


def _comparable(launch: dict[str, Any], arguments: bool = True) -> tuple[Any, ...]:
    """A launch as Inductor makes it: a grid of three dims."""
    return launch["kernel"], (*launch["grid"], 1, 1)[:3], launch["options"], \
        launch["arguments"] if arguments else None


# A CPU-only torch cannot copy or index a fake CUDA tensor (a device guard it lacks): a
# launcher that does traces on a GPU, and its sample is not compared here.
CPU_BUILD_LIMIT = "PyTorch is not linked with support for cuda devices"


@pytest.mark.parametrize("name", OPS)
def test_a_compiled_call_launches_what_the_eager_call_launches(name, traces):
    record = traces[name]
    assert "error" not in record, record.get("error")
    compared = 0
    for case in record["cases"]:
        where = f"{name}/{case['case']}"
        if name in OPAQUE or case["backend"] != "triton":
            assert not case["traced"] and f"opforge.{name}.default" in case["opaque"], where
        elif case["empty"]:
            assert not case["traced"] and not case["opaque"], where  # nothing to launch
        elif case["refusal"]:
            assert CPU_BUILD_LIMIT in case["refusal"], f"{where}: {case['refusal']}"
        else:
            assert not case["opaque"], where
            full = not case["empty_input"]
            assert [_comparable(t, full) for t in case["traced"]] == \
                [_comparable(e, full) for e in case["eager"]], where
            compared += 1
    assert compared or name in OPAQUE, "no sample traced"


@pytest.mark.parametrize("name", TRACED)
def test_a_compiled_call_copies_no_input(name, traces):
    # Triton's analysis of the kernel marks what it writes; the compiled program copies
    # each such argument first, so an input marked (a dummy pointer) costs a copy a call.
    for case in traces[name]["cases"]:
        for traced, eager in zip(case["traced"], case["eager"]):
            assert not set(traced["cloned"]) & set(eager["inputs"]), \
                f"{case['case']}: {traced['kernel']}"


def _sample(op: opforge.OpDef, dtype: torch.dtype) -> tuple[list[Any], list[Any]]:
    case = op.samples(dtype, DEVICE, torch.Generator(device=DEVICE).manual_seed(0))[0]
    return list(case.inputs), [case.attrs.get(attr.name, attr.default) for attr in op.attrs]


def _calling(op: opforge.OpDef, attrs: list[Any]) -> Any:
    return lambda *tensors: op(*tensors, *attrs)


def _mismatches(got: Any, want: Any) -> str | None:
    """Where ``got`` differs from ``want`` bit for bit (NaNs alike), or None."""
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    try:
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)
    except (AssertionError, ValueError) as error:
        return str(error).splitlines()[0]
    return None


def _with_gradients(function: Any, inputs: list[Any]) -> tuple[torch.Tensor, ...]:
    """``function``'s outputs and the gradients of their sum into its floating inputs."""
    leaves = [t.detach().requires_grad_() if isinstance(t, torch.Tensor)
              and t.is_floating_point() else t for t in inputs]
    outputs = function(*leaves)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    wanted = [o for o in outputs if o.requires_grad]
    grads = torch.autograd.grad(wanted, [t for t in leaves if isinstance(t, torch.Tensor)
                                         and t.requires_grad],
                                [torch.ones_like(o) for o in wanted], allow_unused=True)
    return (*outputs, *(g for g in grads if g is not None))


# The GPU tests go over the operators in a few shards (each failure named in its message):
# parallel workers share the compiles, and a CPU run skips a few tests, not one per operator.
SHARDS = 4
# On Hopper their launchers test the tensors' addresses for tensor descriptors (TMA
# alignment), which a traced call has not: such a call stays opaque.
DESCRIPTOR_READERS = {"matmul", "attention", "attention_backward"}
needs_cuda = pytest.mark.skipif(DEVICE.type != "cuda",
                                reason="compiles Triton launches for a GPU")


def _compiled_against_eager(label: str, name: str, run: Any, function: Any,
                            inputs: list[Any]) -> list[str]:
    """What fails when ``run(function, inputs)`` runs ``function`` compiled instead of
    eagerly: a call left to the operator (the compiled code calls it), or a result not
    bit for bit the eager one."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    got, code = run_and_get_code(run, torch.compile(function, fullgraph=True), inputs)
    failures = []
    if "torch.ops.opforge" in "\n".join(code) and name not in DESCRIPTOR_READERS:
        failures.append(f"{label}: the compiled code calls an operator")
    mismatch = _mismatches(got, run(function, inputs))
    if mismatch:
        failures.append(f"{label}: {mismatch}")
    return failures


def _called(function: Any, inputs: list[Any]) -> Any:
    return function(*inputs)


@needs_cuda
@pytest.mark.parametrize("shard", range(SHARDS))
@pytest.mark.parametrize("gradients", [False, True], ids=["forward", "forward+backward"])
def test_compiled_calls_on_a_gpu_equal_eager_calls(shard, gradients, monkeypatch):
    # With gradients, the backward runs the graph AOTAutograd compiled for it: the
    # backward operators' launches, traced too.
    monkeypatch.setenv(TRACE_VARIABLE, "1")
    failures = []
    for name in TRACED[shard::SHARDS]:
        op = opforge.get_op(name)
        if gradients and op.backward_fn is None:
            continue
        for dtype in (torch.float32,) if gradients else (torch.float32, torch.bfloat16):
            inputs, attrs = _sample(op, dtype)
            failures += _compiled_against_eager(
                f"{name} {dtype}", name, _with_gradients if gradients else _called,
                _calling(op, attrs), inputs)
    assert not failures, "\n".join(failures)
