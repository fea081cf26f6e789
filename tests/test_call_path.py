"""The call path: an eager call runs its held plan without the dispatcher, and every call
that needs what lives there (a mode, a transform, a subclass, tracing, autocast) still goes
through ``torch.ops.opforge``; settings changes reach the plan cache; a first call may be a
compiled one; subpackages are attributes of ``import opforge``."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import opforge
from opforge.core.hardware import get_profile

from .conftest import DEVICE


class Recorder(TorchDispatchMode):
    """The operators a block dispatches."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def _dispatched(call) -> list[str]:
    with Recorder() as recorder:
        call()
    return [name for name in recorder.seen if name.startswith("opforge.")]


def test_a_dispatch_mode_sees_the_operator(backend):
    """A mode lives in the dispatcher: the eager entry must not run the plan past it."""
    x = torch.randn(4, 8, device=DEVICE)
    assert _dispatched(lambda: opforge.softmax(x)) == ["opforge.softmax.default"]
    weight = torch.randn(8, device=DEVICE, requires_grad=True)
    assert _dispatched(lambda: opforge.rms_norm(x, weight)) == ["opforge.rms_norm.default"]


def test_eager_calls_equal_dispatched_calls_forward_and_backward(backend):
    x = torch.randn(6, 33, device=DEVICE, requires_grad=True)
    weight = torch.randn(33, device=DEVICE, requires_grad=True)
    upstream = torch.randn(6, 33, device=DEVICE)
    eager = opforge.rms_norm(x, weight)
    eager_grads = torch.autograd.grad(eager, (x, weight), upstream)
    dispatched = torch.ops.opforge.rms_norm(x, weight, 1e-6)[0]
    dispatched_grads = torch.autograd.grad(dispatched, (x, weight), upstream)
    assert torch.equal(eager, dispatched)
    assert all(torch.equal(a, b) for a, b in zip(eager_grads, dispatched_grads))


def test_statistics_saved_for_backward_never_require_grad(backend):
    from opforge.compat.torch_npu import npu_rms_norm

    x = torch.randn(5, 16, device=DEVICE, requires_grad=True)
    _, rstd = npu_rms_norm(x, torch.ones(16, device=DEVICE))
    assert not rstd.requires_grad


def test_a_parameter_takes_the_eager_entry_and_gets_its_gradient(backend):
    weight = torch.nn.Parameter(torch.randn(16, device=DEVICE))
    x = torch.randn(3, 16, device=DEVICE)
    hits = opforge.cache_stats().plan_hits
    for _ in range(2):
        opforge.rms_norm(x, weight).sum().backward()
    assert opforge.cache_stats().plan_hits > hits
    plain = weight.detach().requires_grad_()
    expected = torch.autograd.grad(torch.nn.functional.rms_norm(x, (16,), plain, 1e-6).sum(),
                                   plain)
    torch.testing.assert_close(weight.grad / 2, expected[0], rtol=1e-5, atol=1e-5)


def test_profiles_of_one_name_plan_apart():
    """The settings key holds a use_hardware profile's contents, not only its name: two
    profiles named "cpu" with other core counts get their own grids."""
    x = torch.randn(1 << 20, device=DEVICE)
    cpu = get_profile("cpu")
    grids = []
    for cores in (1, 64):
        with opforge.use_hardware(dataclasses.replace(cpu, core_count=cores)):
            grids.append(opforge.plan("sigmoid", x).grid)
    assert grids[0] != grids[1]


def test_bad_attribute_types_are_typed_errors_on_every_path():
    x = torch.randn(4, 8, device=DEVICE)
    for call in (lambda: opforge.softmax(x, 1.5), lambda: opforge.gelu(x, None)):
        with pytest.raises(opforge.AttrError):
            call()
        with Recorder(), pytest.raises(opforge.AttrError):
            call()


def _fresh_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, env={"TRITON_INTERPRET": "1",
                                            **{k: v for k, v in __import__("os").environ.items()
                                               if k != "TRITON_INTERPRET"}})


def test_subpackages_are_attributes_of_the_package():
    done = _fresh_python("import opforge\n"
                         "print(opforge.nn.LayerNorm, opforge.moe.MoEGate.__name__, "
                         "opforge.distributed.ring_attention.__name__)")
    assert done.returncode == 0, done.stderr
    assert "ring_attention" in done.stdout


def test_the_first_call_of_a_process_may_be_a_compiled_one():
    done = _fresh_python(
        "import torch, opforge\n"
        "f = torch.compile(lambda t: opforge.softmax(t, -1) * 2, fullgraph=True)\n"
        "x = torch.randn(4, 8)\n"
        "assert torch.allclose(f(x), torch.softmax(x, -1) * 2)\n"
        "print('ok')")
    assert done.returncode == 0, done.stderr[-3000:]


# An operator that updates its inputs runs its launcher on every call: none held.
@pytest.mark.parametrize("name", [op.name for op in opforge.list_ops() if not op.mutated_inputs])
def test_held_launches_take_each_call_s_own_tensors(name, fresh_plans):
    """A plan replays the launches it recorded for a layout with the new call's tensors:
    a plan made and run on one draw, then run on another draw of the same layout, equals
    a fresh plan's run on that draw."""
    op = opforge.get_op(name)
    first, second = (op.samples(torch.float32, DEVICE, torch.Generator().manual_seed(seed))[0]
                     for seed in (0, 1))
    with opforge.use_backend("triton"):
        held = opforge.plan(op, *first.inputs, **first.attrs)
        held.run(*first.inputs)
        replayed = held.run(*second.inputs)
        opforge.clear_caches()
        fresh = opforge.plan(op, *second.inputs, **second.attrs).run(*second.inputs)
    for a, b in zip(*(r if isinstance(r, tuple) else (r,) for r in (replayed, fresh)),
                    strict=True):
        assert torch.equal(a.nan_to_num(), b.nan_to_num()), name


@pytest.mark.parametrize("name", [op.name for op in opforge.list_ops()])
def test_no_launch_passes_a_function_as_an_argument(name, launches):
    """triton-ascend's launcher refuses a function given as a constexpr ("Callable
    constexpr ... is not supported"): a kernel that applies an operator's own math has it
    bound as a global (`bind_functions`), so no launch of any operator passes one."""
    op = opforge.get_op(name)
    with opforge.use_backend("triton"):
        for case in op.samples(torch.float32, DEVICE, torch.Generator().manual_seed(0))[:3]:
            inputs = [t.clone() if i in op.mutated_inputs else t
                      for i, t in enumerate(case.inputs)]
            opforge.plan(op, *inputs, **case.attrs).run(*inputs)
    assert launches, name
    for kernel, keywords in launches:
        passed = [key for key, value in keywords.items() if callable(value)]
        assert not passed, f"{name}: {kernel} is given {passed}"


def test_a_launcher_whose_kernels_the_recorder_does_not_see_is_not_held():
    """Triton 3.2's interpreter launches ``kernel[grid]`` past ``run``: a recording of such
    a launcher holds no launch, and an empty replay would leave the next call's outputs
    unwritten. Emulated by a launcher that writes its output by raw memory copies."""
    import ctypes

    from opforge.core.launches import HeldLaunches

    def launcher(plan, inputs, outputs, workspace):
        (x,), (out,) = inputs, outputs
        ctypes.memmove(out.data_ptr(), x.data_ptr(), x.numel() * x.element_size())

    held = HeldLaunches(launcher)
    for seed in (0, 1):
        x, out = torch.randn(4, 4, generator=torch.Generator().manual_seed(seed)), \
            torch.full((4, 4), float("nan"))
        held(None, (x,), (out,), None)
        assert torch.equal(out, x)


def test_a_layout_first_seen_aliased_is_not_held_for_calls_without_the_alias(backend):
    """matmul(a, a) first, then matmul(a, b) of the same layout: a replay recorded from the
    aliased call would map both operands to a; out=x then out=y likewise."""
    a, b = torch.randn(8, 8, device=DEVICE), torch.randn(8, 8, device=DEVICE)
    opforge.clear_caches()
    opforge.matmul(a, a)
    torch.testing.assert_close(opforge.matmul(a, b), a @ b, rtol=1e-5, atol=1e-5)
    x, y = torch.randn(4, 16, device=DEVICE), torch.empty(4, 16, device=DEVICE)
    plan = opforge.plan("softmax", x, dim=-1)
    plan.run(x.clone(), out=x.clone())  # the same tensor as input and out: not held
    inputs = x.clone()
    plan.run(inputs, out=x)
    plan.run(inputs, out=y)
    torch.testing.assert_close(y, torch.softmax(inputs, -1))


def test_the_eager_entry_bumps_the_version_of_updated_inputs(backend):
    """A cache saved for a backward and then updated by mla_prolog is autograd's usual
    error on both paths, never a gradient of the overwritten values."""
    op = opforge.get_op("mla_prolog")
    case = op.samples(torch.float32, DEVICE, torch.Generator().manual_seed(0))[0]
    for entry in (op, opforge.get_op("mla_prolog").torch_op):
        inputs = [t.clone() for t in case.inputs]
        weight = torch.ones(inputs[10].shape, device=DEVICE, requires_grad=True)
        saved = (inputs[10] * weight).sum()
        entry(*inputs)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            saved.backward()


@pytest.mark.parametrize("args, words", [
    ((torch.randn(4, 8), -1, 5), "at most 2 argument"),
    ((torch.randn(4, 8),), "missing value for argument 'weight'"),
], ids=["one_too_many", "a_tensor_missing"])
def test_calls_the_schema_refuses_are_refused_on_the_eager_entry(args, words):
    op = opforge.get_op("softmax" if len(args) == 3 else "rms_norm")
    with pytest.raises(RuntimeError, match=words):
        op(*args)


def test_meta_tensors_traces_and_negative_views_take_the_dispatcher():
    """What the eager entry cannot run itself: meta tensors (the fake implementation gives
    their outputs), torch.jit.trace (the trace records the operator), a negative view (the
    dispatcher materialises it before the kernel reads memory)."""
    meta = torch.empty(4, 8, device="meta")
    assert opforge.softmax(meta).device.type == "meta"
    assert opforge.matmul(meta, torch.empty(8, 3, device="meta")).shape == (4, 3)
    x = torch.randn(4, 8)
    traced = torch.jit.trace(lambda t: opforge.softmax(t), (x,), check_trace=False)
    assert "opforge::softmax" in [node.kind() for node in traced.graph.nodes()]
    other = torch.randn(4, 8)
    torch.testing.assert_close(traced(other), torch.softmax(other, -1))
    negative = torch._neg_view(x)
    with opforge.use_backend("triton"):
        torch.testing.assert_close(opforge.softmax(negative), torch.softmax(-x, -1))
