"""The call path: an eager call runs its held plan without the dispatcher, and every call
that needs what lives there (a mode, a transform, a subclass, tracing, autocast) still goes
through ``torch.ops.opforge``; settings changes reach the plan cache; a first call may be a
compiled one; subpackages are attributes of ``import opforge``."""

from __future__ import annotations

import dataclasses
import gc
import subprocess
import sys
import types
import weakref
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import opforge
from opforge.core import plan as plan_module
from opforge.core.hardware import get_profile
from opforge.core.opdef import Case
from opforge.core.plan import allocate

from .conftest import DEVICE, assert_golden


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


def test_a_backward_fills_no_zeros_for_the_statistics(backend):
    """rstd, mean and lse have no gradient: the formulas get None, not a zeros kernel."""
    x = torch.randn(4, 24, device=DEVICE, requires_grad=True)
    weight = torch.randn(24, device=DEVICE, requires_grad=True)
    target = torch.randint(0, 24, (4,), device=DEVICE)
    for loss in (opforge.rms_norm(x, weight).square().sum(),
                 opforge.layer_norm(x, 24, weight, None).square().sum(),
                 opforge.cross_entropy(x, target)):
        with Recorder() as recorder:
            loss.backward()
        assert not [name for name in recorder.seen if "zeros" in name or "fill" in name]


def test_add_rms_norm_with_only_its_sum_used_gets_the_sum_s_gradient(backend):
    x, residual = (torch.randn(3, 16, device=DEVICE, requires_grad=True) for _ in range(2))
    weight = torch.randn(16, device=DEVICE, requires_grad=True)
    upstream = torch.randn(3, 16, device=DEVICE)
    total = opforge.add_rms_norm(x, residual, weight)[1]
    grads = torch.autograd.grad(total, (x, residual), upstream)
    assert all(torch.equal(grad, upstream) for grad in grads)


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


class _FakeCompiled:
    """A compiled kernel's launch interface, recording each launch."""

    function, packed_metadata = "function", "metadata"

    def __init__(self) -> None:
        self.launched: list[tuple] = []

    def launch_metadata(self, grid, stream, *values):
        return None

    def run(self, *arguments):
        self.launched.append(arguments)


class _FakeKernel:
    """A JIT function taking (x, n, BLOCK=8): ``run`` launches its compiled kernel."""

    def __init__(self, compiled: _FakeCompiled) -> None:
        import inspect

        self.compiled, self.runs, self.pre_run_hooks = compiled, 0, []
        self.params = [types.SimpleNamespace(name=name, default=default)
                       for name, default in (("x", inspect.Parameter.empty),
                                             ("n", inspect.Parameter.empty), ("BLOCK", 8))]

    def run(self, *arguments, grid, warmup, **keywords):
        self.runs += 1
        return self.compiled


class _FakeDriver:
    device = 0

    def get_current_device(self):
        return self.device

    def get_current_stream(self, device):
        return 1000 + device


def test_a_replay_launches_the_compiled_kernel_after_its_first_run(monkeypatch):
    """After one launch through the kernel's run, a held launch calls the compiled
    kernel's launcher with the call's tensors, every parameter (defaults filled in), the
    grid padded to three and the current stream; on another current device it goes
    through run again."""
    from opforge.core import launches

    driver = _FakeDriver()
    hooks = types.SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None)
    monkeypatch.setattr(launches, "_LAUNCH_API", (types.SimpleNamespace(runtime=hooks),
                                                  types.SimpleNamespace(active=driver)))
    compiled = _FakeCompiled()
    kernel = _FakeKernel(compiled)
    launch = launches._Launch(kernel, [None, 7], {"grid": (4,), "warmup": False,
                                                  "num_warps": 4}, [(0, 0, None)])
    first, second, third = (torch.full((2,), float(i)) for i in range(3))
    launch.run([first])
    assert kernel.runs == 1 and not compiled.launched
    launch.run([second])
    assert kernel.runs == 1
    (arguments,) = compiled.launched
    assert arguments[:8] == (4, 1, 1, 1000, "function", "metadata", None, None)
    assert arguments[8:9] == (None,) and arguments[9] is second and arguments[10:] == (7, 8)
    driver.device = 1
    launch.run([third])
    assert kernel.runs == 2 and len(compiled.launched) == 1


def test_a_kernel_with_pre_run_hooks_or_a_grid_function_is_not_launched_directly(monkeypatch):
    from opforge.core import launches

    monkeypatch.setattr(launches, "_LAUNCH_API", (
        types.SimpleNamespace(runtime=types.SimpleNamespace(launch_enter_hook=None,
                                                            launch_exit_hook=None)),
        types.SimpleNamespace(active=_FakeDriver())))
    hooked = _FakeKernel(_FakeCompiled())
    hooked.pre_run_hooks = [print]
    for kernel, grid in ((hooked, (4,)), (_FakeKernel(_FakeCompiled()), lambda meta: (4,))):
        launch = launches._Launch(kernel, [None, 7], {"grid": grid, "warmup": False},
                                  [(0, 0, None)])
        for _ in range(3):
            launch.run([torch.zeros(2)])
        assert kernel.runs == 3 and not kernel.compiled.launched


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


def test_empty_slots_do_not_stop_holding(fresh_plans):
    """layer_norm_backward without affine has two empty outputs, both at address 0 (torch
    gives every empty tensor that address): its layout is recorded all the same, not
    refused as aliased, and each call takes its own tensors."""
    from opforge.core.launches import HeldLaunches

    x = torch.randn(8, 64, device=DEVICE)
    _, mean, rstd = torch.ops.opforge.layer_norm(x, None, None, [64])
    with opforge.use_backend("triton"):
        plan = opforge.plan("layer_norm_backward", x, x, mean, rstd, None, None,
                            normalized_shape=[64])
        held = HeldLaunches(plan.op.launchers["triton"])
        scratch = torch.empty(plan.workspace_bytes, dtype=torch.uint8, device=DEVICE)
        for _ in range(2):
            grad = torch.randn(8, 64, device=DEVICE)
            outputs = [torch.full(spec.shape, float("nan"), device=DEVICE)
                       for spec in plan.outputs]
            inputs = (grad, x, mean, rstd, None, None)
            held(plan, inputs, outputs, scratch)
            assert [o.data_ptr() for o in outputs[1:]] == [0, 0]
            assert_golden(plan.op, Case("no_affine", inputs, {"normalized_shape": [64]}),
                          tuple(outputs))
    # Recorded, not refused as aliased (a refused layout is not kept; Triton 3.2's
    # interpreter, whose launches no recording sees, keeps it as not held).
    assert len(held.layouts) == 1


def test_a_held_view_of_the_workspace_follows_its_storage(fresh_plans):
    """A replay keeps its last view of the workspace while that tensor lives: a workspace
    whose storage was swapped (``set_``) is viewed again, and the old storage is never
    written; a workspace given once is not kept alive by the plan."""
    x = torch.randn(6, 40, device=DEVICE)
    target = torch.randint(0, 40, (6,), device=DEVICE)
    with opforge.use_backend("triton"):
        plan = opforge.plan("cross_entropy", x, target)
        outputs = [torch.empty(spec.shape, dtype=spec.dtype, device=DEVICE)
                   for spec in plan.outputs]
        workspace = torch.empty(plan.workspace_bytes, dtype=torch.uint8, device=DEVICE)
        for _ in range(2):  # recorded, then replayed (its view made and kept)
            plan.run(x, target, out=outputs, workspace=workspace)
        old = torch.empty(0, dtype=torch.uint8, device=DEVICE).set_(
            workspace.untyped_storage()).fill_(7)
        workspace.set_(torch.empty_like(workspace).untyped_storage())
        plan.run(x, target, out=outputs, workspace=workspace)
        assert (old == 7).all()
        assert_golden(plan.op, Case("mean", (x, target), {}), tuple(outputs))
        given = weakref.ref(workspace)
        del workspace
        gc.collect()
        assert given() is None


def test_the_pool_hands_out_one_view_per_size_until_its_buffer_grows():
    from opforge.core.workspace import WorkspacePool

    pool = WorkspacePool()
    first = pool.get(100, torch.device("cpu"))
    assert pool.get(100, torch.device("cpu")) is first
    assert pool.get(64, torch.device("cpu")).data_ptr() == first.data_ptr()
    grown = pool.get(1 << 20, torch.device("cpu"))
    again = pool.get(100, torch.device("cpu"))
    assert again is not first and again.data_ptr() == grown.data_ptr()
    assert pool.stats.requests == 5 and pool.stats.allocations == 2


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


def test_repeated_runs_with_out_check_again_what_changed_in_place(backend):
    """From the third `run` on the same tensor objects the checks of their metadata are
    skipped while nothing those checks read has changed: a tensor changed in place since
    (resized, given another dtype) gets its typed error, and the operator's value checks
    run on every call."""
    x = torch.randn(6, 40, device=DEVICE)
    target = torch.randint(0, 40, (6,), device=DEVICE)
    plan = opforge.plan("cross_entropy", x, target, reduction="none")
    outs = [torch.empty(spec.shape, dtype=spec.dtype, device=DEVICE) for spec in plan.outputs]
    case = Case("none", (x, target), {"reduction": "none"})
    for _ in range(3):
        assert_golden(plan.op, case, plan.run(x, target, out=outs))
    target[2] = 40
    with pytest.raises(opforge.IndexRangeError):
        plan.run(x, target, out=outs)
    target[2] = 39
    outs[0].resize_(7)
    with pytest.raises(opforge.ShapeError):
        plan.run(x, target, out=outs)
    outs[0].resize_(6)
    logits = x.data
    x.data = logits.double()
    with pytest.raises(opforge.DtypeError):
        plan.run(x, target, out=outs)
    x.data = logits
    assert_golden(plan.op, Case("none", (x, target), {"reduction": "none"}),
                  plan.run(x, target, out=outs))


def test_repeated_runs_with_out_take_the_same_objects_in_the_same_roles(backend):
    """The same tensor objects split otherwise between inputs and outs after the replay
    is armed get the checked path's errors; a workspace given to a plan that needs none
    is ignored on every call, as the checked path ignores it."""
    x, weight = torch.randn(4, 32, device=DEVICE), torch.randn(32, device=DEVICE)
    plan = opforge.plan("rms_norm", x, weight)
    y, rstd = (torch.empty(spec.shape, dtype=spec.dtype, device=DEVICE)
               for spec in plan.outputs)
    for _ in range(3):
        plan.run(x, weight, out=[y, rstd])
    with pytest.raises(opforge.OpError, match="more tensors"):
        plan.run(x, weight, y, out=rstd)
    with pytest.raises(opforge.ShapeError):
        plan.run(x, out=[weight, y, rstd])
    assert plan.workspace_bytes == 0
    for _ in range(3):
        assert plan.run(x, weight, out=[y, rstd], workspace="scratch") == (y, rstd)
    assert_golden(plan.op, Case("roles", (x, weight), {}), (y, rstd))


def test_repeated_runs_into_an_out_overlapping_the_input_go_through_a_buffer(backend):
    """An out that overlaps its input one element further on is written through a fresh
    buffer on every call, the repeated ones included (a direct launch would read elements
    another program has already overwritten); so is an out moved onto such memory
    (``set_``) after calls that wrote it directly."""
    size = 1 << 14
    memory = torch.randn(size + 1, device=DEVICE)
    x = memory[:size]
    shifted = memory[1:]
    plan = opforge.plan("gelu", x)
    buffers = []
    with mock.patch.object(plan_module, "allocate",
                           side_effect=lambda spec: buffers.append(spec) or allocate(spec)):
        for _ in range(4):
            before = x.clone()
            plan.run(x, out=shifted)
            assert_golden(plan.op, Case("shifted", (before,), {}), shifted)
    # One a call, and one when the second call finds the objects need it: the later calls
    # are not checked twice.
    assert len(buffers) == 4 + 1
    out = torch.empty(size, device=DEVICE)
    other = torch.randn(size + 1, device=DEVICE)
    source = other[:size]
    for _ in range(3):
        plan.run(source, out=out)
    out.set_(other.untyped_storage(), 1, (size,), (1,))
    before = source.clone()
    plan.run(source, out=out)
    assert_golden(plan.op, Case("moved", (before,), {}), out)


def test_a_repeated_run_with_out_replays_the_held_launches_on_its_tensors(monkeypatch,
                                                                          fresh_plans):
    """The compiled-kernel path (no interpreter lock; kernel launches recorded by a
    stand-in ``run``): from the third `run(out=)` on the same objects the layout's held
    launches are replayed, one launch a call, each on the call's own tensors; other objects
    go through the checked path again."""
    from opforge.core import backends
    from opforge.ops.softmax import _softmax_rows_kernel

    if not hasattr(type(_softmax_rows_kernel), "run"):
        pytest.skip("Triton 3.2's interpreter launches past run: no launch is held there")
    launched: list[list[int]] = []

    def run(kernel, *arguments, **keywords):
        launched.append([a.data_ptr() for a in arguments if isinstance(a, torch.Tensor)])

    monkeypatch.setattr(type(_softmax_rows_kernel), "run", run)
    monkeypatch.setattr(backends, "_triton_refusal", lambda device: None)
    monkeypatch.setattr(backends, "interpreter_enabled", lambda: False)
    x, out, other = torch.randn(8, 256), torch.empty(8, 256), torch.empty(8, 256)
    with opforge.use_backend("triton"):
        plan = opforge.plan("gelu", x)
        for call in range(5):
            launched.clear()
            plan.run(x, out=out)
            assert len(launched) == 1 and {x.data_ptr(), out.data_ptr()} <= set(launched[0])
            assert (call >= 1) == (plan._checked is not None)
        assert plan._checked[2]  # the held launches, replayed
        launched.clear()
        plan.run(x, out=other)
        assert len(launched) == 1 and other.data_ptr() in launched[0]
