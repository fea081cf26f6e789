"""Every validation path: a typed error naming the operator, the parameter, what was
expected and what was given, raised before any kernel runs."""

from __future__ import annotations

import math
import pickle

import pytest
import torch

import opforge
from opforge.compat import torch_npu
from opforge.core.errors import INFERSHAPE_ERROR, PARAM_INVALID, PARAM_NULLPTR, TILING_ERROR
from opforge.core.hardware import HardwareProfile


@pytest.fixture(autouse=True)
def no_kernel_runs(monkeypatch):
    """A bad input must be rejected in plan: no launcher or reference may be reached."""
    def refuse(*args, **kwargs):
        raise AssertionError("a kernel ran for an invalid call")
    for op in opforge.list_ops():
        for backend in list(op.launchers):
            monkeypatch.setitem(op.launchers, backend, refuse)
    monkeypatch.setattr("opforge.core.plan.run_reference", refuse)


def _raises(error_type, call, *fragments, code=None):
    with pytest.raises(error_type) as caught:
        call()
    text = str(caught.value)
    for fragment in fragments:
        assert fragment in text, (fragment, text)
    if code is not None:
        assert caught.value.code == code
    return caught.value


def test_wrong_dtype():
    error = _raises(opforge.DtypeError, lambda: opforge.sigmoid(torch.ones(3, dtype=torch.int32)),
                    "sigmoid.x", "int32", "float32", code=PARAM_INVALID)
    assert (error.op, error.param, error.got) == ("sigmoid", "x", "int32")
    assert isinstance(error, TypeError)


def test_non_broadcastable_names_both_shapes():
    error = _raises(opforge.ShapeError,
                    lambda: opforge.broadcast_add(torch.ones(3, 2), torch.ones(4)),
                    "(3, 2)", "(4,)", "dim -1", code=INFERSHAPE_ERROR)
    assert error.op == "broadcast_add"


def test_too_many_dims():
    _raises(opforge.ShapeError, lambda: opforge.broadcast_add(torch.ones([1] * 9),
                                                              torch.ones(1)),
            "broadcast_add.a", "at most 8 dims", "9")


@pytest.mark.parametrize("call, fragments", [
    (lambda x: opforge.gelu(x, "fast"), ("gelu.approximate", "'fast'", "none")),
    (lambda x: opforge.broadcast_add(x, x, math.inf), ("broadcast_add.alpha", "finite")),
    (lambda x: opforge.plan("broadcast_add", x, x, alpha="2"), ("alpha", "wrong type", "str")),
    (lambda x: opforge.plan("sigmoid", x, beta=1.0), ("unknown attribute", "beta")),
    (lambda x: opforge.reduce_sum(x, 2), ("reduce_sum.dims", "out of range", "[-2, 1]")),
    (lambda x: opforge.reduce_sum(x, (0, -2)), ("reduce_sum.dims", "more than once")),
    (lambda x: opforge.plan("reduce_sum", x, keepdim=1), ("keepdim", "bool")),
])
def test_bad_attributes(call, fragments):
    _raises(opforge.AttrError, lambda: call(torch.ones(2, 3)), *fragments, code=PARAM_INVALID)


@pytest.mark.parametrize("call, error_type, fragments", [
    (lambda x: opforge.moe_gating_top_k(x, k=2.5), opforge.AttrError,
     ("moe_gating_top_k.k", "wrong type", "float 2.5")),
    (lambda x: opforge.softmax(x, dim="1"), opforge.AttrError, ("softmax.dim", "int", "str")),
    (lambda x: opforge.reduce_sum(x, [0.5]), opforge.AttrError, ("reduce_sum.dims", "[0.5]")),
    (lambda x: opforge.gelu(x, None), opforge.AttrError, ("gelu.approximate", "None")),
    (lambda x: opforge.sigmoid(x.tolist()), opforge.DtypeError, ("sigmoid.x", "not a tensor")),
    (lambda x: torch_npu.npu_rms_norm(x, x[0], epsilon="small"),
     opforge.AttrError, ("rms_norm.eps", "str")),
])
def test_badly_typed_arguments_through_the_functional_api(call, error_type, fragments):
    # The dispatcher's schema check rejects these before opforge runs; the functional API
    # must still give the typed error that plan gives.
    _raises(error_type, lambda: call(torch.ones(2, 8)), *fragments, code=PARAM_INVALID)


def test_tensors_on_different_devices():
    _raises(opforge.DeviceError,
            lambda: opforge.broadcast_add(torch.ones(3), torch.ones(3, device="meta")),
            "broadcast_add.b", "cpu", "meta")


def test_missing_and_extra_inputs():
    _raises(opforge.OpError, lambda: opforge.plan("sigmoid"), "sigmoid.x", "missing",
            code=PARAM_NULLPTR)
    _raises(opforge.OpError, lambda: opforge.plan("sigmoid", torch.ones(2), torch.ones(2)),
            "too many")
    _raises(opforge.DtypeError, lambda: opforge.plan("sigmoid", [1.0, 2.0]), "not a tensor")


def test_gradient_pair_must_match():
    _raises(opforge.ShapeError,
            lambda: opforge.plan("sigmoid_backward", torch.ones(3), torch.ones(4)),
            "sigmoid_backward.y", "(3,)", "(4,)")


def test_unknown_operator():
    _raises(opforge.OpError, lambda: opforge.plan("softplus", torch.ones(1)), "softplus",
            "broadcast_add")


def test_run_with_another_signature():
    plan = opforge.plan("broadcast_add", torch.ones(3, 1), torch.ones(4))
    _raises(opforge.ShapeError, lambda: plan.run(torch.ones(3, 2), torch.ones(4)),
            "broadcast_add.a", "(3, 1)", "(3, 2)")
    _raises(opforge.DtypeError,
            lambda: plan.run(torch.ones(3, 1), torch.ones(4, dtype=torch.float16)),
            "broadcast_add.b", "float32", "float16")
    _raises(opforge.DeviceError,
            lambda: plan.run(torch.ones(3, 1, device="meta"), torch.ones(4)),
            "broadcast_add.a", "meta")
    _raises(opforge.OpError, lambda: plan.run(torch.ones(3, 1)), "presence")
    _raises(opforge.OpError, lambda: plan.run(torch.ones(3, 1), torch.ones(4), torch.ones(4)),
            "more tensors")
    _raises(opforge.ShapeError, lambda: plan.run(torch.ones(3, 1), torch.ones(4),
                                                 out=torch.empty(4, 3)), "out", "(3, 4)")
    _raises(opforge.OpError, lambda: plan.run(torch.ones(3, 1), torch.ones(4),
                                              out=[torch.empty(3, 4)] * 2), "number")


def test_workspace_too_small():
    x = torch.ones(4097, 3)
    with opforge.use_backend("triton"):
        plan = opforge.plan("reduce_sum", x, dims=(0,))
    assert plan.workspace_bytes > 0
    _raises(opforge.OpError,
            lambda: plan.run(x, workspace=torch.empty(plan.workspace_bytes - 1,
                                                      dtype=torch.uint8)),
            "workspace", f">= {plan.workspace_bytes} bytes")


def test_no_tiling_fits(monkeypatch):
    tiny = HardwareProfile("tiny", "cpu", 1e9, {torch.float32: 1e9}, onchip_bytes=64,
                           core_count=1)
    with opforge.use_hardware(tiny), opforge.use_backend("triton"):
        error = _raises(opforge.UnsupportedError,
                        lambda: opforge.plan("gelu", torch.ones(1000)), "gelu.tiling",
                        "on-chip memory of 64 B", code=TILING_ERROR)
    assert isinstance(error, NotImplementedError)


def test_errors_pickle_with_their_fields():
    try:
        opforge.broadcast_add(torch.ones(3, 2), torch.ones(4))
    except opforge.ShapeError as error:
        copy = pickle.loads(pickle.dumps(error))
        assert (type(copy), str(copy), copy.op, copy.code) == (
            type(error), str(error), error.op, error.code)


def test_errors_are_raised_under_compile():
    compiled = torch.compile(lambda a, b: opforge.broadcast_add(a, b), fullgraph=True)
    with pytest.raises(Exception) as caught:
        compiled(torch.ones(3, 2), torch.ones(4))
    assert "cannot be broadcast" in str(caught.value)


def test_a_tensor_given_for_an_attribute_is_named_by_shape_not_data():
    """A weight passed where layer_norm takes ``normalized_shape`` (torch's argument
    order mistaken): the typed error names the tensor by shape and dtype (its repr would
    print the data), as a list holding tensors by its length."""
    x, weight = torch.randn(4, 32), torch.randn(32)
    with pytest.raises(opforge.AttrError) as caught:
        opforge.layer_norm(x, weight)
    assert caught.value.param == "normalized_shape"
    assert caught.value.got == "Tensor of shape (32,), torch.float32"
    with pytest.raises(opforge.AttrError, match="list of 32 items, tensors among them"):
        opforge.reduce_sum(x, list(weight))
