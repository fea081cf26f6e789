"""SiLU, SwiGLU, silu_mul and gelu_tanh_mul, the operators made from their math alone
(`pointwise`, `gated`, `gated_product`): torch's results and gradients over shapes and
dims, float64 gradcheck, the torch_npu signature, every validation path, and one module
each."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import opforge
from opforge.compat.torch_npu import npu_swiglu
from opforge.core.opdef import Case

from .conftest import DEVICE, LOW_PRECISION, assert_golden

SWIGLU = opforge.get_op("swiglu")
SILU = opforge.get_op("silu")
SILU_MUL = opforge.get_op("silu_mul")
SILU_MUL_BACKWARD = opforge.get_op("silu_mul_backward")


def _torch_swiglu(x: torch.Tensor, dim: int) -> torch.Tensor:
    a, b = x.chunk(2, dim)
    return torch.nn.functional.silu(a) * b


@given(shape=st.lists(st.integers(1, 9), min_size=1, max_size=4), data=st.data(),
       dtype=st.sampled_from(LOW_PRECISION), backend=st.sampled_from(("torch", "triton")))
def test_swiglu_over_shapes_dims_and_dtypes(shape, data, dtype, backend):
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    shape[dim] *= 2
    generator = torch.Generator().manual_seed(len(shape))
    x = (torch.randn(shape, generator=generator) * 3).to(DEVICE, dtype)
    with opforge.use_backend(backend):
        out = opforge.swiglu(x, dim)
        assert torch.equal(npu_swiglu(x, dim), out)
    assert_golden(SWIGLU, Case("drawn", (x,), {"dim": dim}), out)


@pytest.mark.parametrize("dim", [-1, 0, 1])
def test_swiglu_gradient_equals_torch(dim, backend):
    x = torch.randn(6, 8, 4, device=DEVICE, dtype=torch.float64).float().requires_grad_()
    upstream = torch.randn(_torch_swiglu(x, dim).shape, device=DEVICE)
    ours = torch.autograd.grad(opforge.swiglu(x, dim), x, upstream)[0]
    theirs = torch.autograd.grad(_torch_swiglu(x, dim), x, upstream)[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


@given(shape=st.lists(st.integers(1, 9), min_size=1, max_size=4),
       dtype=st.sampled_from(LOW_PRECISION), backend=st.sampled_from(("torch", "triton")))
def test_silu_mul_is_swiglu_of_the_two_halves(shape, dtype, backend):
    """One kernel, two layouts: ``silu_mul(gate, up)`` has the bits of ``swiglu`` of the
    two concatenated, and is within the golden's bound."""
    generator = torch.Generator().manual_seed(len(shape))
    gate, up = ((torch.randn(shape, generator=generator) * 3).to(DEVICE, dtype)
                for _ in range(2))
    with opforge.use_backend(backend):
        out = opforge.silu_mul(gate, up)
        assert torch.equal(out, opforge.swiglu(torch.cat([gate, up], -1)))
    assert_golden(SILU_MUL, Case("drawn", (gate, up)), out)


def test_silu_mul_gradients_equal_torch(backend):
    gate, up = (torch.randn(6, 8, 5, device=DEVICE).requires_grad_() for _ in range(2))
    upstream = torch.randn(6, 8, 5, device=DEVICE)
    ours = torch.autograd.grad(opforge.silu_mul(gate, up), (gate, up), upstream)
    theirs = torch.autograd.grad(torch.nn.functional.silu(gate) * up, (gate, up), upstream)
    for mine, torchs in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine, torchs, rtol=1e-5, atol=1e-6)


def test_silu_mul_promotes_and_returns_each_gradient_in_its_operand_dtype(backend):
    gate = torch.randn(4, 9, device=DEVICE).bfloat16().requires_grad_()
    up = torch.randn(4, 9, device=DEVICE).requires_grad_()
    out = opforge.silu_mul(gate, up)
    assert out.dtype == torch.float32
    grad_gate, grad_up = torch.autograd.grad(out, (gate, up), torch.ones_like(out))
    assert (grad_gate.dtype, grad_up.dtype) == (torch.bfloat16, torch.float32)
    assert_golden(SILU_MUL_BACKWARD, Case("mixed", (torch.ones_like(out), gate.detach(),
                                                     up.detach())), (grad_gate, grad_up))


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x, approximate="tanh")


@given(shape=st.lists(st.integers(1, 9), min_size=1, max_size=4),
       dtype=st.sampled_from(LOW_PRECISION), backend=st.sampled_from(("torch", "triton")))
def test_gelu_tanh_mul_is_within_the_golden_bound(shape, dtype, backend):
    generator = torch.Generator().manual_seed(len(shape))
    gate, up = ((torch.randn(shape, generator=generator) * 3).to(DEVICE, dtype)
                for _ in range(2))
    with opforge.use_backend(backend):
        out = opforge.gelu_tanh_mul(gate, up)
    assert out.dtype == dtype and out.shape == gate.shape
    assert_golden(opforge.get_op("gelu_tanh_mul"), Case("drawn", (gate, up)), out)


def test_gelu_tanh_mul_gradients_equal_torch_and_gradcheck(backend):
    """The gradients of ``gelu(gate, 'tanh') * up`` as torch's autograd gives them (the far
    tails included, where the sigmoid saturates) and within the float64 golden's bound;
    float64 gradcheck."""
    gate = torch.cat([torch.randn(6, 8, 5), torch.tensor([-40.0, -9.0, 9.0, 40.0, 0.0])
                      .expand(6, 8, 5)], -1).to(DEVICE).requires_grad_()
    up = torch.randn(6, 8, 10, device=DEVICE).requires_grad_()
    upstream = torch.randn(6, 8, 10, device=DEVICE)
    ours = torch.autograd.grad(opforge.gelu_tanh_mul(gate, up), (gate, up), upstream)
    theirs = torch.autograd.grad(_gelu_tanh(gate) * up, (gate, up), upstream)
    for mine, torchs in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine, torchs, rtol=1e-5, atol=1e-6)
    assert_golden(opforge.get_op("gelu_tanh_mul_backward"),
                  Case("saturated", (upstream, gate.detach(), up.detach())), ours)
    pair = [torch.randn(5, 6, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    assert torch.autograd.gradcheck(opforge.gelu_tanh_mul, pair)


class _TorchMLP(torch.nn.Module):
    """transformers' LlamaMLP (SiLU) or GemmaMLP (GELU's tanh form) in torch operators."""

    def __init__(self, hidden: int, inner: int, bias: bool,
                 act: object = torch.nn.functional.silu) -> None:
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, inner, bias)
        self.up_proj = torch.nn.Linear(hidden, inner, bias)
        self.down_proj = torch.nn.Linear(inner, hidden, bias)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


@pytest.mark.parametrize("module, act", [(opforge.nn.SwiGLUMLP, torch.nn.functional.silu),
                                         (opforge.nn.GeGLUMLP, _gelu_tanh)])
@pytest.mark.parametrize("bias", [False, True])
def test_gated_mlp_module_loads_a_transformers_mlp_and_trains_alike(bias, module, act,
                                                                    backend):
    torch.manual_seed(0)
    reference = _TorchMLP(16, 40, bias, act).to(DEVICE)
    ours = module(16, 40, bias=bias, device=DEVICE)
    ours.load_state_dict(reference.state_dict())
    x = torch.randn(3, 5, 16, device=DEVICE)
    out, expected = ours(x), reference(x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    out.square().sum().backward()
    expected.square().sum().backward()
    for (name, mine), theirs in zip(ours.named_parameters(), reference.parameters(),
                                    strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-4, atol=1e-5, msg=name)
    x = torch.randn(7, 9, device=DEVICE)
    assert torch.equal(opforge.nn.SiLU()(x), opforge.silu(x))


def test_silu_swiglu_and_silu_mul_gradcheck_in_float64():
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    up = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(opforge.silu, (x,))
    assert torch.autograd.gradcheck(lambda t: opforge.swiglu(t, 1), (x,))
    assert torch.autograd.gradcheck(opforge.silu_mul, (x, up))


def test_silu_keeps_its_far_tails(backend):
    """exp of -|x| only: no overflow at -1e4, and silu(-100) is the tiny -100 e^-100
    (float64), not 0 from an underflowed float32 sigmoid."""
    x = torch.tensor([-1e4, -100.0, 1e4, 0.0], dtype=torch.float64, device=DEVICE)
    torch.testing.assert_close(opforge.silu(x), x * torch.sigmoid(x), rtol=1e-14, atol=0)
    y = opforge.silu(x.float())
    assert y[0] == 0 and y[2] == 1e4 and not y.isnan().any()


@pytest.mark.parametrize("call, error, words", [
    (lambda: opforge.swiglu(torch.randn(3, 5)), opforge.ShapeError, "even size"),
    (lambda: opforge.swiglu(torch.randn(4, 4), 2), opforge.AttrError, "out of range"),
    (lambda: opforge.swiglu(torch.tensor(1.0)), opforge.ShapeError, "a dim to split"),
    (lambda: opforge.swiglu(torch.ones(4, 4, dtype=torch.int32)), opforge.DtypeError, "x"),
    (lambda: opforge.silu(torch.ones(3, dtype=torch.int64)), opforge.DtypeError, "x"),
    (lambda: SWIGLU_BACKWARD(torch.randn(4, 3), torch.randn(4, 4)), opforge.ShapeError,
     "dim halved"),
    (lambda: opforge.silu_mul(torch.randn(4, 3), torch.randn(4, 1)), opforge.ShapeError,
     "shape of gate"),
    (lambda: opforge.silu_mul(torch.randn(3), torch.ones(3, dtype=torch.int64)),
     opforge.DtypeError, "up"),
    (lambda: SILU_MUL_BACKWARD(torch.randn(4, 2), torch.randn(4, 3), torch.randn(4, 3)),
     opforge.ShapeError, "shape of grad"),
    (lambda: SILU_MUL_BACKWARD(torch.randn(4, 3), torch.randn(4, 3), torch.randn(3, 4)),
     opforge.ShapeError, "shape of gate"),
])
def test_bad_input_is_refused_before_a_kernel(call, error, words):
    with pytest.raises(error, match=words):
        call()


SWIGLU_BACKWARD = opforge.get_op("swiglu_backward")


def test_each_operator_is_one_short_module():
    """An elementwise operator is its math: one module, nothing else edited to add it."""
    for name in ("silu", "swiglu", "silu_mul"):
        source = Path(opforge.ops.__path__[0], f"{name}.py").read_text()
        assert len(source.splitlines()) < 60, name
        assert getattr(opforge, name) is opforge.get_op(name).functional
        assert getattr(opforge.functional, name) is getattr(opforge, name)
