"""RMSNorm and Add-RMSNorm: both variants, values near the float16 maximum, gradients
(deterministic weight gradient), the torch_npu signatures, the module and the errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import opforge
import opforge.nn
from opforge.compat import torch_npu
from opforge.core.hardware import get_profile
from opforge.core.opdef import Case

from .conftest import DEVICE, assert_golden

RMS_NORM = opforge.get_op("rms_norm")
ADD_RMS_NORM = opforge.get_op("add_rms_norm")
BACKWARD = opforge.get_op("rms_norm_backward")
# 16 KiB on chip cannot hold these rows: the looped variant takes them.
SMALL = dataclasses.replace(get_profile("h200"), name="small", onchip_bytes=16 * 1024)
PROFILES = {"small": "looped", "cpu": "rows"}


def _x(*shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0,
       seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator) * scale).to(DEVICE, dtype)


def _profile(name: str) -> object:
    return SMALL if name == "small" else name


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_both_variants_forward_and_backward(profile, dtype):
    x, residual = _x(5, 3001, dtype=dtype), _x(5, 3001, dtype=dtype, seed=1)
    weight, grad = _x(3001, dtype=dtype, seed=2), _x(5, 3001, dtype=dtype, seed=3)
    with opforge.use_backend("triton"), opforge.use_hardware(_profile(profile)):
        plan = opforge.plan(RMS_NORM, x, weight)
        assert plan.tiling.variant == PROFILES[profile]
        y, rstd = plan.run(x, weight)
        fused = opforge.plan(ADD_RMS_NORM, x, residual, weight).run(x, residual, weight)
        backward = opforge.plan(BACKWARD, grad, x, rstd, weight)
        assert backward.workspace_bytes == 4 * backward.grid[0] * 3001
        grads = backward.run(grad, x, rstd, weight)
    assert_golden(RMS_NORM, Case("rows", (x, weight)), (y, rstd))
    assert_golden(ADD_RMS_NORM, Case("rows", (x, residual, weight)), fused)
    assert_golden(BACKWARD, Case("rows", (grad, x, rstd, weight)), grads)


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rows_whose_squares_overflow_or_underflow_float32(profile, dtype, backend):
    """One call, four rows, eps 0: ordinary values, values near 1e30 (their float32 sum of
    squares overflows: rstd 0 and y 0 before), near 1e-25 (their squares underflow: rstd
    Inf and y Inf before), and a row of 1e-25 with 1e30 in its last column. Each is
    summed again scaled by a power of two and matches the float64 golden within the
    dtype's bound, y and rstd, on both variants."""
    x = _x(4, 3001, dtype=torch.float32)
    x[1] *= 1e30
    x[2] *= 1e-25
    x[3] *= 1e-25
    x[3, -1] = 1e30
    x = x.to(dtype)
    with opforge.use_hardware(_profile(profile)):
        plan = opforge.plan(RMS_NORM, x, None, eps=0.0)
        outputs = plan.run(x, None)
    assert torch.isfinite(outputs[0]).all() and (outputs[1] > 0).all()
    assert_golden(RMS_NORM, Case("scaled_rows", (x, None), {"eps": 0.0}), outputs)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_values_near_the_float16_maximum(dtype, backend):
    """The naive float16 sum of squares overflows at once (60000^2 > 65504): mean(x^2) is
    Inf and y is 0 for every element. opforge sums squares in float32 and stays within the
    dtype's max_eps bound (1 eps in float16/bfloat16, 32 in float32)."""
    x = ((torch.rand(4, 1000, generator=torch.Generator().manual_seed(0)) * 0.5 + 0.5)
         * 65504).to(DEVICE, dtype)
    weight = _x(1000, dtype=dtype)
    half = x.float().clamp(max=65504).half()
    naive = half * torch.rsqrt(half.square().mean(-1, keepdim=True) + 1e-6)
    assert (naive == 0).all()
    y, rstd = opforge.plan(RMS_NORM, x, weight).run(x, weight)
    assert_golden(RMS_NORM, Case("near_max", (x, weight)), (y, rstd))
    assert torch.isfinite(y).all()
    # No worse than torch's own rms_norm on the same inputs (both errors reported).
    golden = torch.nn.functional.rms_norm(x.double(), (1000,), weight.double(), 1e-6)
    theirs = torch.nn.functional.rms_norm(x, (1000,), weight, 1e-6)
    ours_error = (y.double() - golden).abs().max().item()
    torch_error = (theirs.double() - golden).abs().max().item()
    assert ours_error <= torch_error * 1.01 + torch.finfo(dtype).eps, (ours_error, torch_error)


@pytest.mark.parametrize("with_weight", [True, False])
def test_autograd_matches_torch(with_weight, backend):
    x = _x(6, 37, dtype=torch.float64).float().requires_grad_()
    weight = _x(37, seed=1).requires_grad_() if with_weight else None
    upstream = _x(6, 37, seed=2)
    ours = opforge.rms_norm(x, weight, 1e-5)
    params = [x] + ([weight] if with_weight else [])
    got = torch.autograd.grad(ours, params, upstream)
    wide = [p.detach().double().requires_grad_() for p in params]
    theirs = torch.nn.functional.rms_norm(wide[0], (37,), wide[1] if with_weight else None,
                                          1e-5)
    expected = torch.autograd.grad(theirs, wide, upstream.double())
    for g, e in zip(got, expected, strict=True):
        assert (g.double() - e).abs().max() <= 1e-5 * e.abs().max()


def test_add_rms_norm_gradients_reach_both_inputs(backend):
    x, residual = _x(4, 65).requires_grad_(), _x(4, 65, seed=1).requires_grad_()
    weight = _x(65, seed=2).requires_grad_()
    y, total = opforge.add_rms_norm(x, residual, weight)
    assert torch.equal(total, x + residual)
    (y * _x(4, 65, seed=3)).sum().backward()
    wide = [t.detach().double().requires_grad_() for t in (x, residual, weight)]
    expected_y = torch.nn.functional.rms_norm(wide[0] + wide[1], (65,), wide[2], 1e-6)
    (expected_y * _x(4, 65, seed=3).double()).sum().backward()
    for ours, theirs in zip((x, residual, weight), wide, strict=True):
        assert (ours.grad.double() - theirs.grad).abs().max() <= 1e-5 * theirs.grad.abs().max()


@pytest.mark.parametrize("x_dtype, weight_dtype", [(torch.bfloat16, torch.float32),
                                                    (torch.float16, torch.float32),
                                                    (torch.float32, torch.bfloat16)], ids=str)
def test_a_weight_of_another_dtype_follows_torch_promotion(x_dtype, weight_dtype, backend):
    """y in torch's promoted dtype (float32 for a bf16 x with a float32 weight, as Hugging
    Face's RMSNorm returns), rounded once: within the promoted dtype's bound of the
    float64 golden; gradients in x's and the weight's own dtypes, as autograd needs."""
    x = _x(6, 257, dtype=x_dtype).requires_grad_()
    weight = _x(257, dtype=weight_dtype, seed=1).requires_grad_()
    y = opforge.rms_norm(x, weight)
    assert y.dtype == torch.promote_types(x_dtype, weight_dtype)
    assert_golden(opforge.get_op("rms_norm"), Case("mixed", (x.detach(), weight.detach())),
                  (y.detach(), torch.ops.opforge.rms_norm(x.detach(), weight.detach())[1]))
    grad_x, grad_weight = torch.autograd.grad(y.square().sum(), (x, weight))
    assert grad_x.dtype == x_dtype and grad_weight.dtype == weight_dtype
    wide = [t.detach().double().requires_grad_() for t in (x, weight)]
    expected = torch.nn.functional.rms_norm(wide[0], (257,), wide[1], 1e-6)
    expected_grads = torch.autograd.grad(expected.square().sum(), wide)
    for got, want in zip((grad_x, grad_weight), expected_grads, strict=True):
        bound = 4 * torch.finfo(got.dtype).eps * want.abs().max()
        assert (got.double() - want).abs().max() <= bound


def test_gradcheck_in_float64():
    x = _x(3, 9).double().requires_grad_()
    weight = _x(9, seed=1).double().requires_grad_()
    assert torch.autograd.gradcheck(lambda a, w: opforge.rms_norm(a, w, 1e-3), (x, weight))


def test_weight_gradient_is_deterministic():
    grad, x = _x(257, 129), _x(257, 129, seed=1)
    weight = _x(129, seed=2)
    rstd = torch.rsqrt(x.square().mean(-1) + 1e-6)
    with opforge.use_backend("triton"), opforge.use_hardware(SMALL):
        first = torch.ops.opforge.rms_norm_backward(grad, x, rstd, weight, 1e-6)
        second = torch.ops.opforge.rms_norm_backward(grad, x, rstd, weight, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_torch_npu_signatures(backend):
    x, other, gamma = _x(2, 3, 16), _x(2, 3, 16, seed=1), _x(16, seed=2)
    y, rstd = torch_npu.npu_rms_norm(x, gamma)
    assert rstd.shape == (2, 3, 1) and rstd.dtype == torch.float32
    assert torch.allclose(y, opforge.rms_norm(x, gamma))
    y2, rstd2, total = torch_npu.npu_add_rms_norm(x, other, gamma, 1e-5)
    assert torch.equal(total, x + other) and rstd2.shape == (2, 3, 1)
    assert torch.allclose(y2, opforge.rms_norm(x + other, gamma, 1e-5), atol=1e-6)


def test_module_is_a_drop_in_for_torch():
    torch.manual_seed(0)
    for shape, eps, affine in (((16,), None, True), ((4, 8), 1e-5, True), (16, 1e-6, False)):
        ours, theirs = opforge.nn.RMSNorm(shape, eps, affine), torch.nn.RMSNorm(shape, eps,
                                                                              affine)
        assert ours.state_dict().keys() == theirs.state_dict().keys()
        assert ours.extra_repr() == theirs.extra_repr()
        if affine:
            theirs.weight.data.normal_()
            ours.load_state_dict(theirs.state_dict())
        x = _x(3, 4, 8) if shape == (4, 8) else _x(3, 5, 16)
        assert torch.allclose(ours(x), theirs(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_module_default_eps_is_torch_s_in_every_dtype(backend, dtype):
    """eps=None is the compute dtype's epsilon, as in torch.nn.RMSNorm: float32's for 16-bit
    inputs (bfloat16's 7.8e-3 would shrink rows of small RMS far from the golden)."""
    x = (torch.randn(64, 8, generator=torch.Generator().manual_seed(4)) * 0.05).to(dtype)
    ours, theirs = opforge.nn.RMSNorm(8, dtype=dtype), torch.nn.RMSNorm(8, dtype=dtype)
    eps = torch.finfo(torch.promote_types(dtype, torch.float32)).eps
    golden = torch.nn.functional.rms_norm(x.double(), (8,), None, eps)
    ours_error = (ours(x).double() - golden).abs().max()
    theirs_error = (theirs(x).double() - golden).abs().max()
    assert ours_error <= max(2 * theirs_error, 4 * torch.finfo(dtype).eps)


def test_a_0d_input_is_one_row_of_one_element(backend):
    """A 0-d x is normalised as a row of one element (weight (1,)) on both backends,
    forward and backward, against the float64 formula."""
    x = torch.tensor(-0.75, device=DEVICE, requires_grad=True)
    weight = torch.tensor([3.0], device=DEVICE, requires_grad=True)
    y, rstd = torch.ops.opforge.rms_norm(x, weight, 0.5)
    assert y.shape == () and rstd.shape == ()
    x64, w64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    assert_golden(opforge.get_op("rms_norm"),
                  Case("0d", (x.detach(), weight.detach()), {"eps": 0.5}), (y, rstd))
    # And against the formula itself (the golden is the reference the 0-d path changed).
    golden = x64 * torch.rsqrt(x64 * x64 + 0.5) * w64[0]
    eps = torch.finfo(torch.float32).eps
    assert abs(y.double() - golden) <= 2 * eps * abs(golden)
    for got, want in zip(torch.autograd.grad(y, (x, weight)),
                         torch.autograd.grad(golden, (x64, w64))):
        assert got.shape == want.shape
        assert (got.double() - want).abs().max() <= 8 * eps * want.abs().max()
    with pytest.raises(opforge.ShapeError) as raised:
        opforge.rms_norm(x.detach(), torch.ones(()))
    assert raised.value.expected == (1,)


def test_errors_come_before_any_kernel():
    with pytest.raises(opforge.ShapeError, match="weight"):
        opforge.rms_norm(_x(3, 4), _x(5))
    with pytest.raises(opforge.ShapeError, match="residual"):
        opforge.add_rms_norm(_x(3, 4), _x(3, 5), None)
    with pytest.raises(opforge.AttrError, match="eps"):
        opforge.rms_norm(_x(3, 4), None, -1.0)
    with pytest.raises(opforge.DtypeError):
        opforge.rms_norm(torch.ones(3, 4, dtype=torch.int32))
    with pytest.raises(opforge.ShapeError):
        opforge.nn.RMSNorm(8)(_x(3, 4))
