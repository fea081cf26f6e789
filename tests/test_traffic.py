"""The memory-traffic audit: counts that are exact, accounts that are honest, and an extra
pass that shows on the CPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import opforge
from opforge.cli import main
from opforge.core import backends
from opforge.core.hardware import get_profile, use_hardware
from opforge.core.opdef import Case
from opforge.profiler import traffic

from .conftest import needs_triton

pytestmark = needs_triton  # the interpreter counts the kernels' accesses

# Sizes small enough for the interpreter; every form an operator's bench takes.
SMALL = {"matmul": (64,), "attention": (1, 2, 64, 32), "embedding_dense_grad": (64, 32, 500),
         "moe_gating_top_k": (16, 256), "fused_linear_cross_entropy": (256, 16, 300)}
AUDITED = [op.name for op in opforge.list_ops() if op.bench is not None]
# Composites: their kernels run once a block of classes and their products are steps, which
# the bench's one-launch account does not assume (it leaves their planned bytes out).
BLOCKWISE = {"fused_linear_cross_entropy"}


def _calls(name: str, dtype: torch.dtype) -> list[traffic.CallTraffic]:
    op = opforge.get_op(name)
    return traffic.audit_ops([op], dtype, "h200", [SMALL.get(name, (16, 520))])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", AUDITED)
def test_each_operators_account_lies_between_what_it_touches_and_requests(name, dtype):
    """For every operator and each gradient operator it calls: the least is no more than
    its kernels' account, which is no less than the distinct bytes they touch (an account
    that forgets an intermediate flatters the roofline) and no more than every byte they
    request; each kernel of the account launches as many times as the bench assumes (one)
    for a forward."""
    for call in _calls(name, dtype):
        slack = 0.02 * call.least + 4096  # a partial block, the saved statistics
        assert call.least <= call.planned + slack, call
        assert call.footprint <= call.planned + slack, (call.op, call.case, call.footprint,
                                                        call.planned)
        assert call.planned <= call.requested + slack, (call.op, call.case, call.planned,
                                                        call.requested)
        if call.op == name and name not in BLOCKWISE:
            assert all(k.launches == 1 for k in call.kernels), call.kernels


def test_the_fused_losss_account_holds_its_steps_and_each_blocks_logits():
    """The fused linear cross-entropy at 256 tokens and 300 classes (3 blocks on an H200's
    tiling): the products write each block's float32 logits once and the statistics
    kernel reads them once; the account counts that round trip and the products (matmul's
    steps, each run's launches its own), and no more than the kernels request."""
    op = opforge.get_op("fused_linear_cross_entropy")
    (case,) = traffic.bench_cases(op, torch.bfloat16, [(256, 16, 300)])
    call = traffic.audit(op, case, "h200")
    kernels = {k.kernel: k for k in call.kernels}
    logits = 256 * 300 * 4
    assert kernels["_matmul_kernel"].launches == kernels["_merge_block_kernel"].launches == 3
    assert kernels["_matmul_kernel"].written == logits
    assert logits <= kernels["_merge_block_kernel"].read < logits + 3 * 256 * 16
    assert call.least + 2 * logits <= call.planned <= call.requested


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("with_lse", [True, False])
def test_the_fused_losss_backward_account_lies_between_touched_and_requested(reduction,
                                                                            with_lse):
    """Each of the fused loss's backward paths (a reduction's gradient, the forward's lse
    or none: a first pass merges it again) at 256 tokens and 300 classes: the account
    holds at least the distinct bytes touched and no more than those requested."""
    forward = opforge.get_op("fused_linear_cross_entropy")
    (case,) = traffic.bench_cases(forward, torch.bfloat16, [(256, 16, 300)])
    hidden, weight, target = case.inputs
    lse = opforge.plan(forward, hidden, weight, target, reduction=reduction).run(
        hidden, weight, target)[1] if with_lse else None
    grad = torch.randn(256 if reduction == "none" else ()).bfloat16()
    backward = opforge.get_op("fused_linear_cross_entropy_backward")
    call = traffic.audit(backward, Case("", (grad, hidden, weight, target, lse),
                                        {"reduction": reduction}), "h200")
    launches = {k.kernel: k.launches for k in call.kernels}
    assert launches["_cross_entropy_backward_kernel"] == 3
    assert launches.get("_merge_block_kernel", 0) == (0 if with_lse else 3)
    assert call.footprint <= call.planned <= call.requested


def test_a_composite_without_an_account_of_its_kernels_is_counted_once():
    """moe_gating_top_k_softmax runs moe_gating_top_k as a step and declares no kernel
    costs: its whole cost, which holds the step's bytes, is its account, not that plus
    the step's."""
    op = opforge.get_op("moe_gating_top_k_softmax")
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    call = traffic.audit(op, Case("64x32", (x,), {"k": 4}), "h200")
    assert op.kernel_costs is None and "_gating_kernel" in {k.kernel for k in call.kernels}
    assert call.planned == call.least <= call.requested


def test_elementwise_counts_are_exact_and_masked_lanes_are_free():
    """sigmoid of 1000 float32 elements in 1024-wide blocks: 4000 bytes read, 4000
    written, 8000 distinct: the 24 masked lanes touch nothing."""
    x = torch.randn(1000)
    (call,) = [traffic.audit(opforge.get_op("sigmoid"), Case("1000", (x,), {}), "h200")]
    (kernel,) = call.kernels
    assert (kernel.launches, kernel.read, kernel.written, kernel.footprint) == \
        (1, 4000, 4000, 8000)
    assert call.least == call.planned == call.requested == 8000


def test_an_extra_pass_is_visible_on_the_cpu():
    """A row too long for the chip (a profile with a small tile) makes the norm read x
    again: its requested bytes grow by a read of x, the footprint does not."""
    op = opforge.get_op("rms_norm")
    x, weight = torch.randn(4, 2048), torch.randn(2048)
    case = Case("4x2048", (x, weight), {"eps": 1e-6})
    whole = traffic.audit(op, case, "h200")
    cramped = dataclasses.replace(get_profile("h200"), name="cramped",
                                  onchip_bytes=4096, max_tile_elements=256)
    with use_hardware(cramped):
        looped = traffic.audit(op, case)
    assert (whole.variant, looped.variant) == ("rows", "looped")
    x_bytes = x.numel() * 4
    assert looped.requested >= whole.requested + x_bytes
    assert looped.footprint == pytest.approx(whole.footprint, rel=0.01)


def test_counting_needs_the_interpreter(monkeypatch):
    monkeypatch.setattr(backends, "interpreter_enabled", lambda: False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"), traffic.counting():
        pass


def test_traffic_command(tmp_path, capsys):
    assert main(["traffic", "softmax", "--shapes", "4x300", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "softmax_backward" in out and "_softmax_rows_kernel" in out
    (markdown,) = tmp_path.glob("traffic_*.md")
    assert "| softmax | 4x300 last | rows |" in markdown.read_text()
    assert main(["traffic", "matmul", "softmax", "--shapes", "4x300"]) == 0
    assert "matmul: takes sizes of 1 number, like 256, not 4x300: skipped" in \
        capsys.readouterr().out
    assert main(["traffic", "softmax_backward"]) == 2
    assert "error:" in capsys.readouterr().out
    assert main(["traffic", "softmax", "--hardware", "h999"]) == 2
    assert "unknown hardware profile" in capsys.readouterr().out
