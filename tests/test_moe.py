"""opforge.moe: load statistics, the auxiliary loss, the bias update, dynamic k, the gate
module and dispatch/combine (a whole MoE layer against a per-token loop)."""

from __future__ import annotations

import pytest
import torch

import opforge
from opforge.moe import (
    MoEGate,
    combine,
    dispatch,
    dynamic_k,
    expert_load,
    load_balancing_loss,
    update_bias,
)

from .conftest import DEVICE


def test_expert_load_counts_every_choice():
    idx = torch.tensor([[0, 3], [3, 1], [3, 5]], device=DEVICE)
    assert expert_load(idx, 6).tolist() == [1, 1, 0, 3, 0, 1]
    assert expert_load(torch.tensor([[6, 0]]), 6).tolist() == [1, 0, 0, 0, 0, 0]


def test_load_balancing_loss_is_one_when_uniform_and_grows_with_imbalance():
    uniform = torch.full((8, 4), 0.25, requires_grad=True)
    balanced = torch.tensor([[0], [1], [2], [3]] * 2)
    assert load_balancing_loss(uniform, balanced).item() == pytest.approx(1.0)
    skewed = torch.softmax(torch.tensor([[4.0, 0, 0, 0]] * 8), -1).requires_grad_()
    loss = load_balancing_loss(skewed, torch.zeros(8, 1, dtype=torch.long))
    assert loss.item() > 3
    (grad,) = torch.autograd.grad(loss, skewed)
    # d/dP_e of E * sum f_e P_e / T: only the over-loaded expert 0 has f > 0.
    assert torch.allclose(grad[:, 0], torch.full((8,), 4.0 / 8)) and (grad[:, 1:] == 0).all()


def test_bias_update_raises_under_loaded_experts():
    bias = torch.zeros(4)
    update_bias(bias, torch.tensor([10, 2, 2, 2]), 0.01)
    assert bias.tolist() == pytest.approx([-0.01, 0.01, 0.01, 0.01])


def test_an_empty_batch_has_no_auxiliary_loss():
    scores = torch.empty(0, 4, requires_grad=True)
    loss = load_balancing_loss(scores, torch.empty(0, 2, dtype=torch.long))
    assert loss.item() == 0
    gate = MoEGate(8, num_experts=4, k=2, aux_loss_coef=0.01)
    weights, _, stats = gate(torch.empty(0, 8))
    assert weights.shape == (0, 2) and stats.aux_loss.item() == 0
    stats.aux_loss.backward()
    assert torch.isfinite(gate.weight.grad).all()


def test_the_gate_bias_stays_float32_in_a_low_precision_gate():
    """Steps of 1e-3 round away in bfloat16 (lost at |bias| >= 0.5, doubled below):
    the bias buffer keeps float32 through .to(dtype) and moves with the device."""
    gate = MoEGate(8, num_experts=4, k=2, bias_update_rate=1e-3).to(torch.bfloat16)
    assert gate.weight.dtype == torch.bfloat16 and gate.bias.dtype == torch.float32
    gate.bias.fill_(0.5)
    update_bias(gate.bias, torch.tensor([10, 2, 2, 2]), 1e-3)
    torch.testing.assert_close(gate.bias, torch.tensor([0.499, 0.501, 0.501, 0.501]))
    gate.train()
    weights, _, _ = gate(torch.randn(6, 8, dtype=torch.bfloat16))
    assert weights.dtype == torch.bfloat16
    assert gate.to("meta").bias.device.type == "meta"
    with pytest.raises(opforge.DtypeError):
        update_bias(torch.zeros(4, dtype=torch.int64), torch.tensor([1, 2, 3, 4]), 1.0)


def test_dynamic_k_keeps_the_fewest_experts_reaching_the_share():
    weights = torch.tensor([[0.1, 0.6, 0.3], [0.34, 0.33, 0.33], [0.9, 0.05, 0.05]])
    kept = dynamic_k(weights, 0.8)
    assert kept.tolist() == [[False, True, True], [True, True, True], [True, False, False]]
    assert dynamic_k(weights, 1e-9).sum(-1).tolist() == [1, 1, 1]
    # A prefix whose share equals the threshold exactly is enough (no re-rounding).
    ties = torch.tensor([[0.5, 0.4, 0.1], [0.45, 0.35, 0.2]])
    assert dynamic_k(ties, 0.5)[0].tolist() == [True, False, False]
    assert dynamic_k(ties, 0.8)[1].tolist() == [True, True, False]
    with pytest.raises(opforge.AttrError) as raised:
        dynamic_k(weights, 0.0)
    assert raised.value.param == "threshold"


def test_moe_layer_equals_a_per_token_loop():
    """Gate, dispatch, experts, combine: the same as routing each token by hand."""
    torch.manual_seed(0)
    gate = MoEGate(16, num_experts=6, k=2)
    experts = [torch.nn.Linear(16, 16) for _ in range(6)]
    x = torch.randn(11, 16)
    weights, idx, _ = gate(x)
    routed = dispatch(x, idx, 6)
    outputs = torch.cat([experts[e](chunk) for e, chunk in enumerate(routed.split())])
    y = combine(outputs, routed, weights)
    expected = torch.stack([sum(weights[t, j] * experts[int(idx[t, j])](x[t])
                                for j in range(2)) for t in range(11)])
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    assert routed.counts.tolist() == expert_load(idx, 6).tolist()


def test_gradients_reach_the_router_through_the_weights():
    torch.manual_seed(1)
    gate = MoEGate(8, num_experts=4, k=2, aux_loss_coef=0.01)
    x = torch.randn(10, 8)
    weights, idx, stats = gate(x)
    routed = dispatch(x, idx, 4)
    y = combine(routed.tokens * 2.0, routed, weights)
    (y.square().sum() + stats.aux_loss).backward()
    assert gate.weight.grad is not None and gate.weight.grad.abs().sum() > 0
    assert stats.aux_loss.item() > 0


def test_aux_loss_free_bias_moves_in_training_only():
    torch.manual_seed(2)
    gate = MoEGate(8, num_experts=8, k=2, norm_type=1, group_count=4, k_group=2,
                   group_select_mode=1, bias_update_rate=0.05)
    x = torch.randn(32, 8)
    gate.eval()
    gate(x)
    assert (gate.bias == 0).all()
    gate.train()
    _, _, stats = gate(x)
    expected = 0.05 * torch.sign(stats.load.float().mean() - stats.load.float())
    assert torch.equal(gate.bias, expected)


def test_dynamic_gate_zeroes_dropped_experts_and_keeps_the_row_total():
    torch.manual_seed(3)
    gate = MoEGate(8, num_experts=8, k=4, dynamic_threshold=0.5)
    plain = MoEGate(8, num_experts=8, k=4)
    plain.load_state_dict(gate.state_dict())
    x = torch.randn(16, 8)
    weights, _, stats = gate(x)
    full, _, _ = plain(x)
    assert stats.kept is not None and (weights[~stats.kept] == 0).all()
    torch.testing.assert_close(weights.sum(-1), full.sum(-1))
    assert stats.load.sum() == stats.kept.sum()


def test_dispatch_rejects_bad_indices():
    with pytest.raises(opforge.IndexRangeError) as raised:
        dispatch(torch.randn(2, 4), torch.tensor([[0, 5], [1, 2]]), 5)
    assert raised.value.param == "expert_idx" and raised.value.got == 5
