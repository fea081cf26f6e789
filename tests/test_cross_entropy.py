"""cross_entropy: torch's semantics (reductions, ignore_index, label smoothing, int32
targets), the float64 golden on both variants, the gradient, and its errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import opforge
from opforge.core.opdef import Case

from .conftest import DEVICE, LOW_PRECISION, assert_golden, needs_triton

CROSS_ENTROPY = opforge.get_op("cross_entropy")
CROSS_ENTROPY_BACKWARD = opforge.get_op("cross_entropy_backward")


def _draw(rows: int, classes: int, seed: int = 0, ignored: float = 0.25,
          dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, classes, generator=generator) * 3).to(DEVICE, dtype)
    target = torch.randint(0, classes, (rows,), generator=generator)
    target[torch.rand(rows, generator=generator) < ignored] = -100
    return logits, target.to(DEVICE)


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_loss_and_gradient_are_torch_s(reduction, smoothing, backend):
    """Against torch.nn.functional.cross_entropy in float64 (the kernels compute in
    float32): the loss and the gradient of a random weighting of it."""
    logits, target = _draw(23, 301)
    leaf = logits.clone().requires_grad_()
    loss = opforge.cross_entropy(leaf, target, reduction=reduction, label_smoothing=smoothing)
    weights = torch.randn(loss.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    (grad,) = torch.autograd.grad((loss * weights).sum(), leaf)
    wide = logits.double().requires_grad_()
    want = torch.nn.functional.cross_entropy(wide, target, reduction=reduction,
                                             label_smoothing=smoothing)
    (want_grad,) = torch.autograd.grad((want * weights.double()).sum(), wide)
    torch.testing.assert_close(loss.double(), want, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(grad.double(), want_grad, rtol=1e-5, atol=1e-7)


@needs_triton
def test_rows_too_long_for_the_chip_take_the_looped_variant():
    """A 70000-class row on an H200's tiling is looped over its blocks (the online
    softmax) and matches the golden; so does the gradient's tiles."""
    logits, target = _draw(3, 70000, seed=2, ignored=0.0)
    case = Case("long", (logits, target), {"reduction": "none", "label_smoothing": 0.1})
    with opforge.use_backend("triton"), opforge.use_hardware("h200"):
        plan = opforge.plan(CROSS_ENTROPY, *case.inputs, **case.attrs)
        assert plan.tiling.variant == "looped"
        assert_golden(CROSS_ENTROPY, case, plan.run(*case.inputs))


def test_an_all_ignored_batch_is_nan_as_torch_s(backend):
    logits, _ = _draw(4, 9)
    target = torch.full((4,), -100, device=DEVICE)
    leaf = logits.clone().requires_grad_()
    loss = opforge.cross_entropy(leaf, target)
    assert torch.isnan(loss) and torch.isnan(torch.nn.functional.cross_entropy(logits, target))
    loss.backward()
    assert torch.equal(leaf.grad, torch.zeros_like(leaf.grad))


@pytest.mark.parametrize("classes", [50, 70000])
def test_a_nan_logit_makes_its_row_nan_even_beside_an_inf(classes, backend):
    """A row holding a NaN and a +inf logit has a NaN lse and loss, as torch's logsumexp
    gives (a GPU's max returns the operand that is not NaN: the kernels count the NaNs);
    a row with +inf alone has the lse +inf. On the H200's tiling 50 classes take the
    ``rows`` variant, 70000 the ``looped`` one."""
    logits, target = _draw(3, classes, seed=3, ignored=0.0)
    logits[0, 3], logits[0, 7], logits[1, 7] = float("nan"), float("inf"), float("inf")
    with opforge.use_hardware("h200"):
        loss, lse = CROSS_ENTROPY(logits, target, -100, "none", 0.0)
    assert torch.isnan(torch.logsumexp(logits[0], 0))
    assert torch.isnan(lse[0]) and torch.isnan(loss[0])
    assert lse[1] == float("inf") and torch.isfinite(lse[2]) and torch.isfinite(loss[2])


def test_ignore_index_may_be_a_class(backend):
    """A target equal to ignore_index is ignored even inside [0, C), as torch does."""
    logits, target = _draw(16, 8, seed=3, ignored=0.0)
    got = opforge.cross_entropy(logits, target, ignore_index=3, reduction="none")
    want = torch.nn.functional.cross_entropy(logits, target, ignore_index=3, reduction="none")
    assert (got[target == 3] == 0).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_int32_targets_and_low_precision_logits(dtype, backend):
    logits, target = _draw(12, 50, seed=4, dtype=dtype)
    got = opforge.cross_entropy(logits, target.int(), reduction="none")
    assert got.dtype == dtype
    assert_golden(CROSS_ENTROPY, Case("int32", (logits, target.int()), {"reduction": "none"}),
                  (got, CROSS_ENTROPY(logits, target.int(), -100, "none", 0.0)[1]))


@pytest.mark.parametrize("call, error, words", [
    (lambda: opforge.cross_entropy(torch.randn(4, 5), torch.tensor([0, 1, 5, 2])),
     opforge.IndexRangeError, "0..4"),
    (lambda: opforge.cross_entropy(torch.randn(4, 5), torch.tensor([0, -1, 2, 2])),
     opforge.IndexRangeError, "target"),
    (lambda: opforge.cross_entropy(torch.randn(4, 5, 2), torch.zeros(4, dtype=torch.long)),
     opforge.ShapeError, "2-D"),
    (lambda: opforge.cross_entropy(torch.randn(4, 5), torch.zeros(3, dtype=torch.long)),
     opforge.ShapeError, "one class index per row"),
    (lambda: opforge.cross_entropy(torch.randn(4, 0), torch.zeros(4, dtype=torch.long)),
     opforge.ShapeError, "no classes"),
    (lambda: opforge.cross_entropy(torch.randn(4, 5), torch.zeros(4)),
     opforge.DtypeError, "target"),
    (lambda: opforge.cross_entropy(torch.randn(4, 5), torch.zeros(4, dtype=torch.long),
                                   reduction="avg"), opforge.AttrError, "reduction"),
    (lambda: opforge.cross_entropy(torch.randn(4, 5), torch.zeros(4, dtype=torch.long),
                                   label_smoothing=1.5), opforge.AttrError, "label_smoothing"),
    (lambda: CROSS_ENTROPY_BACKWARD(torch.randn(3), torch.randn(4, 5),
                                    torch.zeros(4, dtype=torch.long), torch.zeros(4), -100,
                                    "none", 0.0), opforge.ShapeError, "loss's shape"),
    (lambda: CROSS_ENTROPY_BACKWARD(torch.randn(()), torch.randn(4, 5),
                                    torch.zeros(4, dtype=torch.long),
                                    torch.zeros(4, dtype=torch.float16), -100, "mean", 0.0),
     opforge.DtypeError, "lse"),
])
def test_bad_input_is_refused_before_a_kernel(call, error, words, backend):
    with pytest.raises(error, match=words):
        call()


@given(rows=st.integers(1, 40), classes=st.integers(1, 300), seed=st.integers(0, 2**16),
       reduction=st.sampled_from(["none", "mean", "sum"]),
       smoothing=st.sampled_from([0.0, 0.05, 1.0]))
def test_property_matches_the_golden(rows, classes, seed, reduction, smoothing):
    logits, target = _draw(rows, classes, seed=seed)
    case = Case("drawn", (logits, target),
                {"reduction": reduction, "label_smoothing": smoothing})
    for backend in ("torch", "triton"):
        with opforge.use_backend(backend):
            assert_golden(CROSS_ENTROPY, case, CROSS_ENTROPY(logits, target, -100, reduction,
                                                             smoothing))
