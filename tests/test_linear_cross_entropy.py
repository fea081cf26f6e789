"""fused_linear_cross_entropy: torch's cross_entropy of hidden @ weight.T (reductions,
ignore_index, label smoothing) in blocks of classes, forward and backward, the float64
golden, no tensor of the logits' size, and its errors."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import opforge
from opforge.core.errors import DtypeError, IndexRangeError, ShapeError
from opforge.core.opdef import Case
from opforge.ops.linear_cross_entropy import class_block

from .conftest import DEVICE, LOW_PRECISION, TRITON, assert_golden

FORWARD = opforge.get_op("fused_linear_cross_entropy")
BACKWARD = opforge.get_op("fused_linear_cross_entropy_backward")


def _draw(tokens: int, hidden_size: int, classes: int, seed: int = 0,
          dtype: torch.dtype = torch.float32
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, hidden_size, generator=generator).to(DEVICE, dtype)
    weight = (torch.randn(classes, hidden_size, generator=generator)
              * hidden_size ** -0.5).to(DEVICE, dtype)
    target = torch.randint(0, classes, (tokens,), generator=generator)
    target[torch.rand(tokens, generator=generator) < 0.2] = -100
    return hidden, weight, target.to(DEVICE)


def _class_block_of(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> int:
    """The classes of a block in the plan of this call: `class_block` of the shapes rounded
    up to powers of two (the key tilings are made and shared under)."""
    return opforge.plan(FORWARD, hidden, weight, target).tiling.blocks["CLASS_BLOCK"]


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("smoothing", [0.0, 0.15])
def test_loss_and_gradients_are_torch_s_through_several_blocks(reduction, smoothing,
                                                               backend):
    """Against torch's cross_entropy of the float64 product: 200 classes in blocks of 64
    (three full blocks and a tail), the loss and both gradients of a random weighting."""
    hidden, weight, target = _draw(150, 40, 200)
    assert _class_block_of(hidden, weight, target) == class_block(256, 64, 256) == 64
    leaves = (hidden.clone().requires_grad_(), weight.clone().requires_grad_())
    loss = opforge.fused_linear_cross_entropy(*leaves, target, reduction=reduction,
                                              label_smoothing=smoothing)
    upstream = torch.randn(loss.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    grads = torch.autograd.grad((loss * upstream).sum(), leaves)
    wide = tuple(t.double().requires_grad_() for t in (hidden, weight))
    want = torch.nn.functional.cross_entropy(wide[0] @ wide[1].T, target,
                                             reduction=reduction, label_smoothing=smoothing)
    want_grads = torch.autograd.grad((want * upstream.double()).sum(), wide)
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-5)
    for grad, want_grad in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(grad.double(), want_grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_low_precision_matches_the_golden(dtype, backend):
    """Each sample in a 16-bit dtype, forward and backward, against the float64 golden
    within the verify standard (no worse than torch's unfused pair)."""
    generator = torch.Generator().manual_seed(0)
    for op in (FORWARD, BACKWARD):
        for case in op.samples(dtype, DEVICE, generator)[:3]:
            assert_golden(op, case, opforge.plan(op, *case.inputs, **case.attrs).run(
                *case.inputs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_forward_s_lse_is_the_one_the_backward_would_merge(dtype, backend):
    """The backward's gradient from the forward's lse (three products) is bitwise the one
    it computes after merging the lse again (four): the forward and the backward make the
    logits by the same matmul steps, so the softmax the gradient uses sums to 1 as the
    forward's did. 150 tokens, 200 classes in blocks of 64 and a tail."""
    hidden, weight, target = _draw(150, 40, 200, dtype=dtype)
    assert _class_block_of(hidden, weight, target) == 64
    grad = torch.randn((), generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    lse = FORWARD(hidden, weight, target, -100, "mean", 0.1)[1]
    with_lse = BACKWARD(grad, hidden, weight, target, lse, -100, "mean", 0.1)
    merged = BACKWARD(grad, hidden, weight, target, None, -100, "mean", 0.1)
    for given, own in zip(with_lse, merged, strict=True):
        assert torch.equal(given, own)


def test_blocks_wider_than_a_tile_match_the_golden(backend):
    """3 tokens over 5000 classes: one block (8192 classes for the shapes rounded up) that
    the kernels stream in two tiles of 4096 columns; the loss with smoothing and both
    gradients against the float64 golden."""
    hidden, weight, target = _draw(3, 8, 5000, seed=4)
    attrs = {"label_smoothing": 0.1}
    assert _class_block_of(hidden, weight, target) == 8192
    forward = Case("wide_block", (hidden, weight, target), attrs)
    assert_golden(FORWARD, forward, FORWARD(hidden, weight, target, -100, "mean", 0.1))
    grad = torch.tensor(0.7, device=DEVICE)
    backward = Case("wide_block", (grad, hidden, weight, target, None), attrs)
    assert_golden(BACKWARD, backward, BACKWARD(grad, hidden, weight, target, None, -100,
                                               "mean", 0.1))


def test_a_nan_in_one_block_is_not_hidden_by_an_inf_in_another(backend):
    """A class whose head row holds a NaN (in the first block) and one whose row holds
    +inf (in the last) make every token's lse and loss NaN, as torch's logsumexp of the
    whole logits: the merge keeps the NaN an earlier block left. Without the NaN, the
    lse is +inf."""
    hidden, weight, target = _draw(6, 8, 200, seed=5)
    hidden = hidden.abs() + 0.1  # the +inf row's logits are +inf, not NaN (inf * 0)
    weight[3], weight[190] = float("nan"), float("inf")
    loss, lse = FORWARD(hidden, weight, target, -100, "none", 0.0)
    assert torch.isnan(torch.logsumexp(hidden @ weight.T, -1)).all()
    assert torch.isnan(lse).all() and torch.isnan(loss[target != -100]).all()
    weight[3] = 0.1
    assert (FORWARD(hidden, weight, target, -100, "none", 0.0)[1] == float("inf")).all()


@pytest.mark.skipif(not TRITON, reason="Triton is not installed")
def test_the_triton_backend_reads_each_block_s_logits_in_one_kernel(launches):
    """Besides the products, one kernel a block reads its logits: the forward's row
    statistics (lse merged, target picked, smoothing sum), the backward's gradient
    (cross_entropy's kernel on a block of columns); the mean's count of kept targets once.
    150 tokens, 200 classes in blocks of 64 and a tail."""
    hidden, weight, target = _draw(150, 40, 200)
    grad = torch.ones((), device=DEVICE)
    with opforge.use_backend("triton"):
        assert _class_block_of(hidden, weight, target) == 64
        lse = FORWARD(hidden, weight, target, -100, "mean", 0.1)[1]
        forward = [name for name, _ in launches]
        launches.clear()
        BACKWARD(grad, hidden, weight, target, lse, -100, "mean", 0.1)
        backward = [name for name, _ in launches]
    assert forward.count("_merge_block_kernel") == 4
    assert "_cross_entropy_backward_kernel" not in forward
    assert backward.count("_cross_entropy_backward_kernel") == 4
    assert backward.count("_count_kept_kernel") == 1
    assert "_merge_block_kernel" not in backward


class _Sizes(TorchDispatchMode):
    """The largest tensor any operator inside the block returns, in bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel() * tensor.element_size())
        return out


def test_no_tensor_holds_the_logits(backend):
    """With 1024 tokens, 32 features and 2048 classes, the largest tensor the forward's or
    the backward's plan makes (their steps' outputs, workspaces and every temporary: the
    plans run directly, so the mode sees inside them) holds one block's logits, 128 classes
    over all tokens in float32, a 16th of the whole; the unfused pair's largest is all of them."""
    hidden, weight, target = _draw(1024, 32, 2048)
    grad = torch.ones((), device=DEVICE)
    forward = opforge.plan(FORWARD, hidden, weight, target)
    lse = forward.run(hidden, weight, target)[1]
    backward = opforge.plan(BACKWARD, grad, hidden, weight, target, lse)
    with _Sizes() as sizes:
        forward.run(hidden, weight, target)
        backward.run(grad, hidden, weight, target, lse)
    assert sizes.largest == 64 * 2048 * 4
    with _Sizes() as unfused:
        torch.nn.functional.cross_entropy(hidden @ weight.T, target)
    assert unfused.largest == 1024 * 2048 * 4


def test_errors_come_before_any_kernel():
    hidden, weight, target = _draw(8, 4, 10)
    with pytest.raises(ShapeError, match="weight"):
        opforge.fused_linear_cross_entropy(hidden, weight[:, :3], target)
    with pytest.raises(ShapeError, match="hidden"):
        opforge.fused_linear_cross_entropy(hidden[None], weight, target)
    with pytest.raises(ShapeError, match="target"):
        opforge.fused_linear_cross_entropy(hidden, weight, target[:5])
    with pytest.raises(DtypeError, match="weight"):
        opforge.fused_linear_cross_entropy(hidden, weight.double(), target)
    with pytest.raises(DtypeError):
        opforge.fused_linear_cross_entropy(hidden, weight, target.float())
    bad = target.clone()
    bad[3] = 10
    with pytest.raises(IndexRangeError, match="target"):
        opforge.fused_linear_cross_entropy(hidden, weight, bad)
    grad = torch.ones((), device=DEVICE)
    lse = FORWARD(hidden, weight, target, -100, "mean", 0.0)[1]
    with pytest.raises(ShapeError, match="lse"):
        BACKWARD(grad, hidden, weight, target, lse[:5], -100, "mean", 0.0)
    with pytest.raises(DtypeError, match="lse"):
        BACKWARD(grad, hidden, weight, target, lse.double(), -100, "mean", 0.0)
