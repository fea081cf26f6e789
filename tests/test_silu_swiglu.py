"""SiLU and SwiGLU, the operators made from their math alone (`pointwise`, `gated`):
torch's results and gradients over shapes and dims, float64 gradcheck, the torch_npu
signature, every validation path, and one module each."""

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


def test_silu_and_swiglu_gradcheck_in_float64():
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(opforge.silu, (x,))
    assert torch.autograd.gradcheck(lambda t: opforge.swiglu(t, 1), (x,))


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
])
def test_bad_input_is_refused_before_a_kernel(call, error, words):
    with pytest.raises(error, match=words):
        call()


SWIGLU_BACKWARD = opforge.get_op("swiglu_backward")


def test_each_operator_is_one_short_module():
    """An elementwise operator is its math: one module, nothing else edited to add it."""
    for name in ("silu", "swiglu"):
        source = Path(opforge.ops.__path__[0], f"{name}.py").read_text()
        assert len(source.splitlines()) < 60, name
        assert getattr(opforge, name) is opforge.get_op(name).functional
        assert getattr(opforge.functional, name) is getattr(opforge, name)
