"""Softmax and LogSoftmax: both tiling variants, rows of a million columns, the inputs that
break the naive formula, masked rows, gradients, the module, and the errors."""

from __future__ import annotations

import contextlib
import dataclasses
import math

import pytest
import torch

import opforge
import opforge.nn
from opforge.core.hardware import get_profile
from opforge.core.opdef import Case
from opforge.precision.metrics import compare_tensors

from .conftest import DEVICE, assert_golden

SOFTMAX = opforge.get_op("softmax")
LOG_SOFTMAX = opforge.get_op("log_softmax")
FORWARD = {"softmax": SOFTMAX, "log_softmax": LOG_SOFTMAX}
# A device with 16 KiB on chip cannot hold these rows: they are split over programs. The
# CPU profile keeps them whole.
SMALL = dataclasses.replace(get_profile("h200"), name="small", onchip_bytes=16 * 1024)
PROFILES = {"small": "split", "cpu": "rows"}


def _profile(name: str) -> object:
    return SMALL if name == "small" else name


def _x(*shape: int, dtype: torch.dtype = torch.float32, scale: float = 3.0,
       seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator) * scale).to(DEVICE, dtype)


def _run(opdef, *inputs, **attrs):
    return opforge.plan(opdef, *inputs, **attrs).run(*inputs)


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("name", FORWARD)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_both_variants_match_the_golden(profile, name, dtype):
    x = _x(3, 7001, dtype=dtype)
    x[0, :5000] = float("-inf")      # the first chunks of a row hold only -inf
    x[1, 3] = 80.0                   # a dominant column
    with opforge.use_backend("triton"), opforge.use_hardware(_profile(profile)):
        plan = opforge.plan(FORWARD[name], x)
        assert plan.tiling.variant == PROFILES[profile]
        if profile == "small":
            assert plan.grid[1] > 1 and plan.workspace_bytes > 0   # a row over programs
        out = plan.run(x)
    assert_golden(FORWARD[name], Case("long", (x,)), out)


@pytest.mark.parametrize("name", FORWARD)
def test_a_million_columns(name):
    """A row of 2^20 columns goes through the online multi-block variant on a GPU
    profile, forward and backward."""
    x = _x(1, 1 << 20)
    with opforge.use_backend("triton"), opforge.use_hardware("h200"):
        plan = opforge.plan(FORWARD[name], x)
        assert plan.tiling.variant == "split"
        y = plan.run(x)
        grad = _x(1, 1 << 20, scale=1.0, seed=1)
        backward = opforge.get_op(f"{name}_backward")
        dx = _run(backward, grad, y)
    assert_golden(FORWARD[name], Case("million", (x,)), y)
    assert_golden(backward, Case("million", (grad, y)), dx)
    if name == "softmax":
        assert torch.allclose(y.double().sum(-1), torch.ones(1, dtype=torch.float64),
                              atol=1e-5)


@pytest.mark.parametrize("name", FORWARD)
def test_the_torch_backend_sums_a_long_non_last_dim_accurately(name):
    """10^5 elements along dim 0: torch's own float32 softmax adds them serially (1250
    eps off); the torch backend's reference sums the exponentials in float64, forward and
    backward."""
    x, grad = _x(100000, 2, scale=4.0), _x(100000, 2, scale=1.0, seed=1)
    with opforge.use_backend("torch"):
        y = opforge.get_op(name).torch_op(x, 0)
        dx = _run(opforge.get_op(f"{name}_backward"), grad, y, dim=0)
    assert_golden(FORWARD[name], Case("long_dim0", (x,), {"dim": 0}), y)
    assert_golden(opforge.get_op(f"{name}_backward"), Case("long_dim0", (grad, y), {"dim": 0}),
                  dx)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", FORWARD)
@pytest.mark.parametrize("pattern", ["around_1e4", "mixed_+-1e4"])
def test_inputs_that_break_the_naive_formula(pattern, name, dtype, backend):
    """exp(1e4) overflows every float format: the naive exp(x) / sum(exp(x)) returns
    inf/inf = NaN for every element of these rows (checked below). opforge subtracts the
    row max and must stay within the dtype's max_eps bound (32 eps in float32, 1 eps in
    float16/bfloat16) and no worse than torch's own operator on the same inputs."""
    big = min(1e4, torch.finfo(dtype).max / 8)
    x = _x(7, 1000, scale=1.0).double()
    if pattern == "around_1e4":
        x += big
    else:
        x[:, 0::2] += big
        x[:, 1::2] -= big
    x = x.to(dtype)
    naive = torch.exp(x.float()) / torch.exp(x.float()).sum(-1, keepdim=True)
    assert naive[:, 0::2].isnan().all()
    out = _run(FORWARD[name], x)
    case = Case(pattern, (x,))
    ours = assert_golden(FORWARD[name], case, out)
    golden = (torch.log_softmax if name == "log_softmax" else torch.softmax)(x.double(), -1)
    theirs = compare_tensors((torch.log_softmax if name == "log_softmax" else torch.softmax)(
        x, -1), golden).max_abs
    assert compare_tensors(out, golden).max_abs <= max(theirs, 1e-30) * 1.01 + \
        torch.finfo(dtype).eps * (2.0 if name == "log_softmax" else 0.5), (ours, theirs)


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("name", FORWARD)
def test_masked_and_special_rows_behave_as_torch(profile, name):
    """Rows of only -inf give NaN (as torch's do), a NaN poisons its row, +inf gives
    what torch gives."""
    x = _x(5, 3001)
    x[0] = float("-inf")
    x[1, 2000:] = float("-inf")
    x[2, 17] = float("nan")
    x[3, 5] = float("inf")
    with opforge.use_backend("triton"), opforge.use_hardware(_profile(profile)):
        out = _run(FORWARD[name], x)
    expected = (torch.log_softmax if name == "log_softmax" else torch.softmax)(x.double(), -1)
    assert torch.equal(out.isnan(), expected.isnan())
    assert out[0].isnan().all() and out[2].isnan().all()
    finite = expected.isfinite()
    assert torch.allclose(out.double()[finite], expected[finite], rtol=1e-5, atol=1e-30)
    if name == "softmax":
        assert (out[1, 2000:] == 0).all()
    else:
        assert (out[1, 2000:] == float("-inf")).all()


@pytest.mark.parametrize("name", FORWARD)
@pytest.mark.parametrize("dim", [0, 1, 2, -1])
def test_any_dim_and_autograd(name, dim, backend):
    x = _x(4, 7, 33).requires_grad_()
    weights = _x(4, 7, 33, seed=2)
    function = getattr(opforge, name)
    reference = getattr(torch, name)
    (gx,) = torch.autograd.grad((function(x, dim) * weights).sum(), x)
    wide = x.detach().double().requires_grad_()
    (expected,) = torch.autograd.grad((reference(wide, dim) * weights.double()).sum(), wide)
    scale = expected.abs().max()
    assert (gx.double() - expected).abs().max() <= 64 * 2.0**-23 * scale


def test_gradcheck_in_float64():
    x = _x(3, 9).double().requires_grad_()
    assert torch.autograd.gradcheck(lambda t: opforge.softmax(t, 0), (x,))
    assert torch.autograd.gradcheck(lambda t: opforge.log_softmax(t, -1), (x,))


def test_split_variant_is_deterministic():
    x = _x(2, 50001)
    with opforge.use_backend("triton"), opforge.use_hardware(SMALL):
        first = opforge.softmax(x)
        second = opforge.softmax(x)
    assert torch.equal(first, second)


def test_module_is_a_drop_in_for_torch():
    x = _x(2, 3, 5)
    for dim in (None, 0, 1, -1):
        ours, theirs = opforge.nn.Softmax(dim), torch.nn.Softmax(dim)
        assert ours.state_dict().keys() == theirs.state_dict().keys()
        with pytest.warns(UserWarning) if dim is None else contextlib.nullcontext():
            expected = theirs(x)
        assert torch.allclose(ours(x), expected, rtol=1e-6, atol=1e-7)
        assert ours.extra_repr() == theirs.extra_repr()


def test_errors_come_before_any_kernel():
    with pytest.raises(opforge.AttrError, match="dim"):
        opforge.softmax(_x(3, 4), 2)
    with pytest.raises(opforge.DtypeError):
        opforge.log_softmax(torch.ones(3, dtype=torch.int32))
    with pytest.raises(opforge.ShapeError, match="grad"):
        torch.ops.opforge.softmax_backward(_x(3, 4), _x(3, 5), -1)


def test_scalar_and_empty_inputs(backend):
    assert opforge.softmax(torch.tensor(3.0)).item() == 1.0
    assert opforge.log_softmax(torch.tensor(3.0)).item() == 0.0
    assert opforge.softmax(torch.empty(0, 5)).shape == (0, 5)
    assert math.isnan(opforge.softmax(torch.tensor([float("-inf")]))[0].item())
