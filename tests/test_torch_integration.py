"""torch.ops.opforge.*: opcheck, autograd (gradcheck and golden), torch.compile (static and
dynamic shapes), torch.export and autocast."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

import opforge
from opforge.core.opdef import Attr, AutocastPolicy, Case, OpDef, OutputArg, TensorArg
from opforge.library import register_op, schema_for
from opforge.ops._elementwise import (
    elementwise_cost,
    elementwise_grid,
    elementwise_tiling,
    same_dtype,
    same_shape,
)
from opforge.precision.metrics import compare_tensors
from opforge.precision.verify import EPS_BOUNDS

from .conftest import DEVICE, assert_golden


def _sample_inputs(name: str):
    op = opforge.get_op(name)
    generator = torch.Generator().manual_seed(0)
    return [case for case in op.samples(torch.float32, DEVICE, generator)
            if all(t is None or t.numel() for t in case.inputs)][:2]


@pytest.mark.parametrize("name", [op.name for op in opforge.list_ops()])
def test_opcheck(name, backend):
    op = opforge.get_op(name)
    for case in _sample_inputs(name):
        inputs = [None if t is None else t.clone().requires_grad_(
                      op.backward_fn is not None and t.is_floating_point())
                  for t in case.inputs]
        attrs = op.bind_attrs(case.attrs)
        args = (*inputs, *(list(v) if isinstance(v, tuple) else v for v in attrs.values()))
        torch.library.opcheck(op.torch_op, args)


@pytest.mark.parametrize("name", [op.name for op in opforge.list_ops() if op.backward_fn])
def test_each_input_alone_gets_its_gradient(name):
    """The dispatcher drops trailing attributes equal to their defaults; a backward that
    reads ``ctx.needs_input_grad`` must still see one flag per prototype argument. Each
    floating input alone gets the gradient it gets when all inputs require one."""
    op = opforge.get_op(name)
    for case in _sample_inputs(name):
        attrs = list(op.bind_attrs(case.attrs).values())
        inputs = [t.double() if t is not None and t.is_floating_point()
                  and torch.float64 in arg.dtypes else t
                  for t, arg in zip(case.inputs, op.inputs, strict=True)]
        floating = [i for i, t in enumerate(inputs) if t is not None and t.is_floating_point()]

        def gradients(wanted, inputs=inputs, attrs=attrs):
            leaves = [t.detach().requires_grad_(i in wanted) if t is not None else None
                      for i, t in enumerate(inputs)]
            out = op.torch_op(*leaves, *attrs)
            first = out[0] if isinstance(out, tuple) else out
            weights = torch.linspace(-1, 1, first.numel(), dtype=first.dtype)
            loss = (first * weights.view(first.shape)).sum()
            return torch.autograd.grad(loss, [leaves[i] for i in wanted], allow_unused=True)

        together = dict(zip(floating, gradients(floating)))
        for index in floating:
            (alone,) = gradients([index])
            assert (alone is None) == (together[index] is None), (name, index)
            if alone is not None:
                assert torch.equal(alone, together[index]), (name, index)


def test_schema_is_derived_from_the_opdef():
    assert schema_for(opforge.get_op("broadcast_add")) == (
        "(Tensor a, Tensor b, float alpha=1.0) -> Tensor")
    assert schema_for(opforge.get_op("reduce_sum")) == (
        "(Tensor x, int[]? dims=None, bool keepdim=False, float scale=1.0) -> Tensor")
    assert schema_for(opforge.get_op("gelu")) == '(Tensor x, str approximate="none") -> Tensor'


def _double(*shape, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator, dtype=torch.float64) * 2).requires_grad_()


@pytest.mark.parametrize("function, inputs", [
    (lambda a, b: opforge.broadcast_add(a, b, -0.7), (_double(3, 1, 4), _double(5, 1, seed=1))),
    (opforge.sigmoid, (_double(4, 5),)),
    (lambda x: opforge.gelu(x, "none"), (_double(17),)),
    (lambda x: opforge.gelu(x, "tanh"), (_double(17),)),
    (lambda x: opforge.reduce_sum(x, (0, 2), True, 1.5), (_double(2, 3, 4),)),
    (lambda x: opforge.reduce_sum(x), (_double(3, 2),)),
], ids=["broadcast_add", "sigmoid", "gelu", "gelu_tanh", "reduce_sum", "reduce_sum_all"])
def test_gradcheck_float64(function, inputs):
    assert torch.autograd.gradcheck(function, inputs)


def _torch_attention(q, k, v):
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    return torch.softmax(scores, -1) @ v


@pytest.mark.parametrize("ours, theirs, shapes", [
    (lambda x, w: opforge.rms_norm(x, w),
     lambda x, w: torch.nn.functional.rms_norm(x, (7,), w, 1e-6), ((5, 7), (7,))),
    (lambda x, w, b: opforge.layer_norm(x, 7, w, b),
     lambda x, w, b: torch.nn.functional.layer_norm(x, (7,), w, b), ((5, 7), (7,), (7,))),
    (lambda q, k, v: opforge.attention(q, k, v), _torch_attention,
     ((1, 2, 5, 8), (1, 2, 6, 8), (1, 2, 6, 8))),
], ids=["rms_norm", "layer_norm", "attention"])
def test_float64_gradients_are_float64_exact(ours, theirs, shapes):
    """The statistics a float64 forward saves (rstd, mean, lse) are float64, so that its
    gradients agree with torch's float64 autograd to float64 rounding, not float32's."""
    inputs = [_double(*shape, seed=index) for index, shape in enumerate(shapes)]
    upstream = torch.randn(ours(*inputs).shape, dtype=torch.float64)
    mine = torch.autograd.grad(ours(*inputs), inputs, upstream)
    reference = torch.autograd.grad(theirs(*inputs), inputs, upstream)
    for got, want in zip(mine, reference):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_saved_statistics_are_not_differentiable(backend, compiled):
    """A norm's rstd/mean outputs (what torch_npu.npu_rms_norm returns beside y) never
    require grad, eager or compiled: a loss on them fails loudly instead of getting a
    gradient of zero, and y's gradient is unchanged."""
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    x.requires_grad_()
    weight = torch.ones(16, device=DEVICE, requires_grad=True)
    calls = {"rms_norm": (lambda: torch.ops.opforge.rms_norm(x, weight), (1,)),
             "add_rms_norm": (lambda: torch.ops.opforge.add_rms_norm(x, x, weight), (1,)),
             "layer_norm": (lambda: torch.ops.opforge.layer_norm(x, weight, None, [16]),
                            (1, 2))}
    for name, (call, statistics) in calls.items():
        outputs = (torch.compile(call, backend="aot_eager", fullgraph=True) if compiled
                   else call)()
        assert outputs[0].requires_grad, name
        for index in statistics:
            assert not outputs[index].requires_grad, (name, index)
            with pytest.raises(RuntimeError, match="does not require grad"):
                torch.autograd.grad(outputs[index].sum(), x)
        (grad,) = torch.autograd.grad(outputs[0].sum() + sum(outputs[i].sum()
                                                             for i in statistics), x)
        (expected,) = torch.autograd.grad(call()[0].sum(), x)
        torch.testing.assert_close(grad, expected)


def test_saved_statistics_must_have_the_forward_dtype():
    x, weight = torch.randn(3, 4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
    _, rstd = opforge.plan("rms_norm", x, weight).run(x, weight)
    assert rstd.dtype == torch.float64
    with pytest.raises(opforge.DtypeError, match="float64 for inputs of float64"):
        opforge.plan("rms_norm_backward", x, x, rstd.float(), weight)
    with pytest.raises(opforge.DtypeError, match="float32 for inputs of float32"):
        opforge.plan("rms_norm_backward", x.float(), x.float(), rstd, weight.float())
    q = torch.randn(1, 1, 3, 4)
    out, lse = opforge.attention(q, q, q, return_lse=True)
    with pytest.raises(opforge.DtypeError) as raised:
        opforge.attention_backward(out, q, q, q, out, lse.double())
    assert raised.value.param == "lse"


@pytest.mark.parametrize("a_shape, b_shape", [((33, 1, 7), (5, 1)), ((4, 6), (4, 6))],
                         ids=["broadcast", "same_shape"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_broadcast_add_backward_against_golden(dtype, a_shape, b_shape, backend):
    """grad_a sums the upstream gradient over a's broadcast dims, grad_b does the same
    times alpha: also when nothing is broadcast (alpha is still applied)."""
    generator = torch.Generator().manual_seed(5)
    a = torch.randn(a_shape, generator=generator).to(DEVICE, dtype).requires_grad_()
    b = torch.randn(b_shape, generator=generator).to(DEVICE, dtype).requires_grad_()
    out_shape = torch.broadcast_shapes(a_shape, b_shape)
    grad = torch.randn(out_shape, generator=generator).to(DEVICE, dtype)
    opforge.broadcast_add(a, b, 0.5).backward(grad)
    wide = grad.double().cpu()

    def summed(values: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        padded = (1,) * (len(out_shape) - len(shape)) + shape
        dims = [i for i, (p, o) in enumerate(zip(padded, out_shape)) if p == 1 and o != 1]
        dims += list(range(len(out_shape) - len(shape)))
        return values.sum(sorted(set(dims)), keepdim=True).reshape(shape) if dims else values

    golden_a, golden_b = summed(wide, a_shape), 0.5 * summed(wide, b_shape)
    scale_a, scale_b = summed(wide.abs(), a_shape), 0.5 * summed(wide.abs(), b_shape)
    assert a.grad.dtype == dtype and b.grad.dtype == dtype
    for got, golden, scale in [(a.grad, golden_a, scale_a), (b.grad, golden_b, scale_b)]:
        assert compare_tensors(got, golden, scale=scale).max_eps <= EPS_BOUNDS[dtype]


@pytest.mark.parametrize("name, approximate", [("sigmoid", None), ("gelu", "none"),
                                               ("gelu", "tanh")])
def test_unary_backward_runs_the_backward_operator(name, approximate, backend):
    generator = torch.Generator().manual_seed(6)
    x = (torch.randn(1000, generator=generator) * 4).to(DEVICE).requires_grad_()
    grad = torch.randn(1000, generator=generator).to(DEVICE)
    if name == "gelu":
        opforge.gelu(x, approximate).backward(grad)
        case = Case("grad", (grad, x.detach()), {"approximate": approximate})
    else:
        opforge.sigmoid(x).backward(grad)
        case = Case("grad", (grad, torch.sigmoid(x.detach().double()).float()), {})
    backward_op = opforge.get_op(f"{name}_backward")
    # sigmoid's gradient comes from its rounded output; judge it on that input.
    assert_golden(backward_op, case, x.grad)


def _model(a, b):
    hidden = opforge.broadcast_add(a, b, 0.5)
    return opforge.reduce_sum(opforge.gelu(hidden, "tanh") * opforge.sigmoid(hidden), -1)


def test_compile_fullgraph_matches_eager(backend):
    a, b = torch.randn(8, 16), torch.randn(16)
    compiled = torch.compile(_model, fullgraph=True)
    torch.testing.assert_close(compiled(a, b), _model(a, b), rtol=0, atol=0)


def test_compile_dynamic_shapes():
    torch._dynamo.reset()
    compiled = torch.compile(_model, fullgraph=True, dynamic=True)
    for rows, cols in [(3, 5), (7, 9), (2, 33)]:
        a, b = torch.randn(rows, cols), torch.randn(cols)
        torch.testing.assert_close(compiled(a, b), _model(a, b), rtol=0, atol=0)


def test_compile_backward():
    a = torch.randn(6, 4, requires_grad=True)
    b = torch.randn(4, requires_grad=True)
    compiled = torch.compile(_model, fullgraph=True)
    compiled(a, b).sum().backward()
    grads = (a.grad.clone(), b.grad.clone())
    a.grad = b.grad = None
    _model(a, b).sum().backward()
    torch.testing.assert_close(grads, (a.grad, b.grad), rtol=0, atol=0)


def _block(x, w, gamma):
    """A transformer-ish block over the row operators and matmul."""
    hidden = opforge.layer_norm(x, x.shape[-1], gamma, gamma)
    scores = opforge.softmax(opforge.matmul(hidden, w), -1)
    normed, total = opforge.add_rms_norm(scores, opforge.log_softmax(scores, 0), None)
    return opforge.rms_norm(normed + total, None)


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_row_operators_and_matmul(dynamic, backend):
    torch._dynamo.reset()
    generator = torch.Generator().manual_seed(3)
    compiled = torch.compile(_block, fullgraph=True, dynamic=dynamic)
    for rows in (5, 9):
        x = torch.randn(rows, 12, generator=generator).requires_grad_()
        w = torch.randn(12, 7, generator=generator).requires_grad_()
        gamma = torch.randn(12, generator=generator).requires_grad_()
        out = compiled(x, w, gamma)
        out.sum().backward()
        grads = [t.grad.clone() for t in (x, w, gamma)]
        for t in (x, w, gamma):
            t.grad = None
        expected = _block(x, w, gamma)
        expected.sum().backward()
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        torch.testing.assert_close(grads, [t.grad for t in (x, w, gamma)], rtol=0, atol=0)


def test_export():
    class Block(torch.nn.Module):
        def forward(self, a, b):
            return _model(a, b)

    a, b = torch.randn(4, 8), torch.randn(8)
    exported = torch.export.export(Block(), (a, b))
    targets = {str(node.target) for node in exported.graph.nodes if node.op == "call_function"}
    assert {"opforge.broadcast_add.default", "opforge.gelu.default"} <= targets
    torch.testing.assert_close(exported.module()(a, b), _model(a, b), rtol=0, atol=0)


def test_autocast_keeps_dtype_for_keep_policy_ops():
    x = torch.randn(4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert opforge.gelu(x).dtype == torch.float32
        assert opforge.broadcast_add(x, x.to(torch.bfloat16)).dtype == torch.float32


def _toy(name: str, policy: AutocastPolicy) -> OpDef:
    toy = OpDef(name=name, doc="x * factor", inputs=(TensorArg("x"),),
                outputs=(OutputArg("out"),), attrs=(Attr("factor", "float", 2.0),),
                infer_shape=same_shape, infer_dtype=same_dtype, cost=elementwise_cost(1),
                tiling=elementwise_tiling, grid=elementwise_grid, samples=lambda *a: [],
                autocast=policy)
    toy.reference(lambda x, *, compute_dtype, factor: x.to(compute_dtype) * factor)
    register_op(toy, namespace="opforge_test")
    return toy


FP32_TOY = _toy("scale_fp32", AutocastPolicy.FP32)
LOWER_TOY = _toy("scale_lower", AutocastPolicy.LOWER)


@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_autocast_policies(autocast_dtype):
    low = torch.randn(5).to(autocast_dtype)
    full = torch.randn(5)
    with torch.autocast("cpu", dtype=autocast_dtype):
        assert FP32_TOY.torch_op(low, 2.0).dtype == torch.float32
        assert LOWER_TOY.torch_op(full, 2.0).dtype == autocast_dtype
    assert FP32_TOY.torch_op(low, 2.0).dtype == autocast_dtype  # outside autocast: as given
    assert "scale_fp32" not in {op.name for op in opforge.list_ops()}
    # torch's autocast never casts float64: neither does the lower-precision policy.
    wide = torch.randn(5, dtype=torch.float64)
    with torch.autocast("cpu", dtype=autocast_dtype):
        assert LOWER_TOY.torch_op(wide, 2.0).dtype == torch.float64
        assert opforge.matmul(wide[:, None], wide[None]).dtype == torch.float64


@pytest.mark.parametrize("bias", [True, False])
def test_linear_under_autocast_gives_the_dtype_torch_linear_gives(bias):
    from opforge import nn

    ours = nn.Linear(8, 4, bias=bias)
    theirs = torch.nn.Linear(8, 4, bias=bias)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(3, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, expected = ours(x), theirs(x)
    assert y.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), expected.float(), rtol=2e-2, atol=2e-2)


def test_use_backend_inside_a_compiled_function_applies_or_says_why():
    """The backend is read when an operator runs: a use_backend block inside a compiled
    function would only be seen while tracing. It makes torch.compile run that function
    eagerly, where the block applies (fullgraph=True names the problem instead)."""
    seen = []

    def record(*args, **kwargs):
        seen.append(opforge.core.backends.requested_backend())
        return reference(*args, **kwargs)

    opdef = opforge.get_op("gelu")
    reference = opdef.reference_fn

    def f(x):
        with opforge.use_backend("torch"):
            return opforge.gelu(x) + 1

    x = torch.randn(3, 4)
    with mock.patch.object(opdef, "reference_fn", record):
        torch.testing.assert_close(torch.compile(f, backend="aot_eager")(x),
                                   torch.nn.functional.gelu(x) + 1)
        assert seen == ["torch"]
        torch._dynamo.reset()  # dynamo remembers that f runs eagerly
        with pytest.raises(Exception, match="use_backend inside a torch"):
            torch.compile(f, backend="aot_eager", fullgraph=True)(x)


def test_device_side_checks_inside_a_compiled_function_say_why():
    """Like use_backend, the setting is read when an operator runs: entered while
    torch.compile traces it raises (fullgraph=True names it)."""
    def f(x):
        with opforge.device_side_checks():
            return x + 1

    torch._dynamo.reset()
    with pytest.raises(Exception, match="device_side_checks inside a torch"):
        torch.compile(f, backend="aot_eager", fullgraph=True)(torch.randn(3))


def test_nn_modules_drop_in_for_torch():
    from opforge import nn

    x = torch.randn(4, 9)
    model = torch.nn.Sequential(torch.nn.Linear(9, 9), nn.GELU("tanh"), nn.Sigmoid())
    reference = torch.nn.Sequential(model[0], torch.nn.GELU("tanh"), torch.nn.Sigmoid())
    assert "approximate='tanh'" in repr(model)
    ours, theirs = model(x), reference(x)
    stats = compare_tensors(ours, theirs.double())
    assert stats.max_rel < 1e-5
    ours.sum().backward()
    assert model[0].weight.grad is not None


def test_rms_norm_module_answers_to_hugging_face_s_variance_epsilon():
    norm = opforge.nn.RMSNorm(8, eps=1e-5)
    assert norm.variance_epsilon == 1e-5
    norm.variance_epsilon = 1e-3
    x = torch.randn(2, 8)
    torch.testing.assert_close(norm(x), torch.nn.functional.rms_norm(x, (8,), norm.weight,
                                                                     1e-3))
    assert "variance_epsilon" not in norm.state_dict()


def test_dynamic_shapes_compile_once():
    """The fake implementation takes symbolic sizes: three shapes, one graph."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(_model, backend=counter, fullgraph=True, dynamic=True)
    for rows, cols in [(3, 5), (7, 9), (2, 33)]:
        a, b = torch.randn(rows, cols), torch.randn(cols)
        torch.testing.assert_close(compiled(a, b), _model(a, b), rtol=0, atol=0)
    assert counter.frame_count == 1


def test_a_forward_only_operator_compiles_and_refuses_only_a_backward():
    """An inference operator whose input requires grad (parameters in an eval loop) runs
    eagerly and compiled; only computing a gradient through it raises, in both modes."""
    grad = torch.randn(4, 3, requires_grad=True)
    indices = torch.tensor([0, 1, 1, 2])
    eager = opforge.embedding_dense_grad(grad, indices, 5)
    compiled = torch.compile(lambda g, i: opforge.embedding_dense_grad(g, i, 5),
                             fullgraph=True, backend="aot_eager")
    result = compiled(grad, indices)
    torch.testing.assert_close(result, eager, rtol=0, atol=0)
    for output in (eager, result):
        with pytest.raises(opforge.UnsupportedError, match="has no backward"):
            output.sum().backward()
    assert grad.grad is None


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_forward_mode_and_torch_func_transforms_are_refused_not_silently_wrong(backend):
    """Forward-mode AD would drop the tangents (a zero or missing derivative), and
    torch.func's grad cannot run the operators' autograd: both raise UnsupportedError;
    vmap (with a backward through it) and plain calls inside a dual level work."""
    x, t = torch.randn(3, 4), torch.randn(3, 4)
    with opforge.use_backend(backend):
        with pytest.raises(opforge.UnsupportedError, match="forward-mode"):
            torch.func.jvp(opforge.sigmoid, (x,), (t,))
        with torch.autograd.forward_ad.dual_level():
            dual = torch.autograd.forward_ad.make_dual(x, t)
            with pytest.raises(opforge.UnsupportedError, match="forward-mode"):
                opforge.sigmoid(dual)
            torch.testing.assert_close(opforge.sigmoid(x), torch.sigmoid(x))
        with pytest.raises(opforge.UnsupportedError, match=r"torch\.func transforms"):
            torch.func.grad(lambda v: opforge.sigmoid(v).sum())(x)
        leaf = x.clone().requires_grad_()
        batched = torch.func.vmap(opforge.sigmoid)(leaf)
        torch.testing.assert_close(batched, torch.sigmoid(x))
        (grad,) = torch.autograd.grad(batched.sum(), leaf)
        torch.testing.assert_close(grad, torch.sigmoid(x) * (1 - torch.sigmoid(x)))
