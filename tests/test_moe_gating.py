"""MoE gating: the float64 golden and DeepSeek-V3's Gate, ties, -inf/NaN logits, every
constraint, the gradient of y, the softmax variant's outputs, compile and compat."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import opforge
from opforge.compat.torch_npu import npu_moe_gating_top_k, npu_moe_gating_top_k_softmax
from opforge.core.opdef import Case

from .conftest import DEVICE, LOW_PRECISION, assert_golden

GATING = opforge.get_op("moe_gating_top_k")
SOFTMAX = opforge.get_op("moe_gating_top_k_softmax")
DEEPSEEK = {"k": 8, "k_group": 4, "group_count": 8, "group_select_mode": 1, "norm_type": 1,
            "routed_scaling_factor": 2.5}


def _logits(rows: int, experts: int, dtype: torch.dtype = torch.float32, seed: int = 0
            ) -> torch.Tensor:
    return torch.randn(rows, experts, generator=torch.Generator().manual_seed(seed)).to(
        DEVICE, dtype)


def deepseek_gate(x: torch.Tensor, bias: torch.Tensor, top_k: int = 8, groups: int = 8,
                  topk_groups: int = 4, route_scale: float = 2.5) -> tuple[torch.Tensor, ...]:
    """DeepSeek-V3's ``Gate.forward`` (sigmoid scoring, bias for selection, top-2-sum group
    scores), written out as in its inference code."""
    scores = x.float().sigmoid()
    original_scores = scores
    scores = scores + bias.float()
    grouped = scores.view(x.size(0), groups, -1)
    group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
    indices = group_scores.topk(topk_groups, dim=-1)[1]
    mask = grouped.new_ones(x.size(0), groups, dtype=torch.bool).scatter_(1, indices, False)
    scores = grouped.masked_fill_(mask.unsqueeze(-1), float("-inf")).flatten(1)
    indices = torch.topk(scores, top_k, dim=-1)[1]
    weights = original_scores.gather(1, indices)
    weights /= weights.sum(dim=-1, keepdim=True)
    return (weights * route_scale).type_as(x), indices


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("op", [GATING, SOFTMAX], ids=lambda o: o.name)
def test_samples_match_the_golden(op, dtype, backend):
    for case in op.samples(dtype, DEVICE, torch.Generator().manual_seed(1)):
        assert_golden(op, case, opforge.plan(op, *case.inputs, **case.attrs).run(
            *case.inputs))


def test_int64_row_offsets_give_the_same_routing(monkeypatch, launches, fresh_plans):
    """Rows x experts past int32 switch the kernel to int64 row offsets; forced on the
    samples (launch argument checked), the results still match the golden."""
    from opforge.ops import moe_gating

    monkeypatch.setattr(moe_gating, "wide_offsets", lambda *tensors: True)
    with opforge.use_backend("triton"):
        for case in GATING.samples(torch.float32, DEVICE, torch.Generator().manual_seed(1)):
            assert_golden(GATING, case, opforge.plan(GATING, *case.inputs, **case.attrs).run(
                *case.inputs))
    switches = [kwargs.get("WIDE") for name, kwargs in launches if name == "_gating_kernel"]
    assert switches and all(switches)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deepseek_v3_routing_equals_its_gate(dtype, backend):
    x = _logits(64, 256, dtype, seed=2)
    bias = (0.05 * torch.randn(256, generator=torch.Generator().manual_seed(3))).to(
        DEVICE, dtype)
    y, idx, out = opforge.moe_gating_top_k(x, 8, bias=bias, **{
        k: v for k, v in DEEPSEEK.items() if k != "k"}, eps=0.0)
    weights, indices = deepseek_gate(x, bias)
    assert out.numel() == 0 and idx.dtype == torch.int32 and y.dtype == dtype
    # torch.topk returns the same set in descending order; opforge's order is descending
    # too, ties to the lower index.
    assert torch.equal(idx.long(), indices)
    torch.testing.assert_close(y, weights, rtol=2e-2 if dtype != torch.float32 else 1e-6,
                               atol=1e-6)


def test_ties_go_to_the_lower_index_and_groups_too(backend):
    x = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0, -1.0, 2.0, 2.0]], device=DEVICE)
    _, idx, _ = opforge.moe_gating_top_k(x, 4, norm_type=1)
    assert idx.tolist() == [[1, 2, 4, 6]]
    # Groups of two with equal softmax top-2 sums: groups 1 and 2 tie, group 1 wins.
    tied = torch.tensor([[0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0]], device=DEVICE)
    _, idx, _ = opforge.moe_gating_top_k(tied, 2, k_group=1, group_count=4,
                                         group_select_mode=1)
    assert idx.tolist() == [[2, 3]]


def test_minus_inf_and_nan_logits(backend):
    x = _logits(4, 6)
    x[0, 2] = float("-inf")
    x[1, :] = float("-inf")
    x[2, 4] = float("nan")
    x[3, :] = float("nan")
    y, idx, out = opforge.moe_gating_top_k(x, 3, out_flag=True)
    assert 2 not in idx[0].tolist() and torch.isfinite(y[0]).all()
    # A row of -inf has NaN softmax scores (as torch): all NaN, so experts 0..k-1.
    assert idx[1].tolist() == [0, 1, 2] and torch.isnan(y[1]).all()
    # One NaN logit makes the row's softmax NaN.
    assert torch.isnan(out[2]).all()
    assert idx[3].tolist() == [0, 1, 2]
    sig_y, sig_idx, _ = opforge.moe_gating_top_k(x[2:3], 3, norm_type=1)
    assert 4 not in sig_idx[0].tolist() and torch.isfinite(sig_y).all()


@pytest.mark.parametrize("layout", ["transposed_x", "strided_bias", "nan_bias", "eps"])
def test_any_input_layout_and_eps_match_the_golden(layout, backend):
    """Column-strided logits, a strided bias, a NaN bias entry (NaN scores rank below every
    number, whatever the NaN's sign) and an eps large enough to show in the renormalised
    weights ``w / (sum(w) + eps)``: the golden's experts and weights."""
    x = _logits(16, 8, seed=9).t() if layout == "transposed_x" else _logits(6, 8, seed=9)
    bias = _logits(1, 16, seed=10)[0, ::2] if layout == "strided_bias" else None
    if layout == "nan_bias":
        bias = torch.zeros(8, device=DEVICE)
        bias[x[0].argmax()] = float("nan")
    attrs = {"k": 2, "norm_type": 1, "eps": 0.5 if layout == "eps" else 1e-20}
    outputs = opforge.moe_gating_top_k(x, bias=bias, **attrs)
    y, idx, _ = outputs
    assert_golden(GATING, Case(layout, (x, bias), attrs), outputs)
    if layout == "nan_bias":
        assert int(x[0].argmax()) not in idx[0].tolist()
    if layout == "eps":
        chosen = torch.sigmoid(x.double()).gather(1, idx.long())
        expected = chosen / (chosen.sum(-1, keepdim=True) + 0.5)
        assert (y.double() - expected).abs().max() < 1e-6


@pytest.mark.parametrize("attrs, param", [
    ({"k": 9}, "k"),
    ({"k": 2, "group_count": 3}, "group_count"),
    ({"k": 2, "group_count": 4, "k_group": 5}, "k_group"),
    ({"k": 5, "group_count": 4, "k_group": 2}, "k"),
    ({"k": 1, "group_count": 8, "k_group": 2, "group_select_mode": 1},
     "group_select_mode"),
    ({"k": 1, "norm_type": 2}, "norm_type"),
])
def test_constraints_are_checked_in_plan(attrs, param):
    with pytest.raises(opforge.AttrError) as raised:
        opforge.plan("moe_gating_top_k", _logits(2, 8), None, **attrs)
    assert raised.value.param == param


@pytest.mark.parametrize("hardware", ["h200", "a100", "ascend910b"])
def test_the_documented_expert_count_runs_the_kernel_on_every_accelerator_profile(hardware):
    """8192 experts (the documented maximum) in one tile: the row is loaded once, not
    double-buffered, so it fits each profile's on-chip memory (it compiles for sm_90 with
    16 warps, 90-102 registers and no spill); against the golden in the interpreter."""
    x = _logits(2, 8192)
    with opforge.use_backend("triton"), opforge.use_hardware(hardware):
        plan = opforge.plan(GATING, x, None, k=8)
        outputs = plan.run(x, None)
    assert plan.tiling.blocks["BLOCK_EG"] == 8192
    assert_golden(GATING, Case("e8192", (x, None), {"k": 8}), outputs)


def test_bad_inputs():
    with pytest.raises(opforge.ShapeError, match="expert count"):
        opforge.moe_gating_top_k(_logits(2, 8193), 1)
    with pytest.raises(opforge.ShapeError, match="finished"):
        opforge.moe_gating_top_k_softmax(
            _logits(6, 10).view(2, 3, 10), torch.zeros(3, 2, dtype=torch.bool, device=DEVICE),
            2)
    with pytest.raises(opforge.ShapeError):
        opforge.moe_gating_top_k(torch.tensor(1.0, device=DEVICE), 1)
    with pytest.raises(opforge.ShapeError):
        opforge.moe_gating_top_k(_logits(2, 8), 1, bias=torch.zeros(7, device=DEVICE))
    with pytest.raises(opforge.DtypeError):
        opforge.moe_gating_top_k(_logits(2, 8), 1, bias=torch.zeros(8, device=DEVICE).half())
    with pytest.raises(opforge.DtypeError):
        opforge.moe_gating_top_k(_logits(2, 8), 1, index_dtype=torch.int16)


def test_bad_backward_inputs():
    x, idx = _logits(4, 8), torch.zeros(4, 2, dtype=torch.int32, device=DEVICE)
    for param, inputs in (("expert_idx", (None, x, idx[:3], None)),
                          ("grad_y", (torch.zeros(4, 3, device=DEVICE), x, idx, None)),
                          ("grad_out", (None, x, idx, torch.zeros(4, 7, device=DEVICE))),
                          ("x", (None, x[0], idx, None))):
        with pytest.raises(opforge.ShapeError) as raised:
            opforge.plan("moe_gating_top_k_backward", *inputs)
        assert raised.value.param == param
    with pytest.raises(opforge.DtypeError):
        opforge.plan("moe_gating_top_k_backward", None, x, idx.float(), None)


def test_leading_dims_int64_indices_and_a_float32_bias_beside_bf16_logits(backend):
    """What a transformers router hands over: ``(B, S, E)`` bf16 logits, DeepSeek-V3's
    float32 correction bias, int64 indices for ``one_hot``; the same routing as the 2-D
    call on the flattened rows with the bias rounded to nothing."""
    x = _logits(6, 16, seed=9).to(torch.bfloat16)
    bias = 0.1 * torch.randn(16, generator=torch.Generator().manual_seed(10)).to(DEVICE)
    attrs = {"k_group": 2, "group_count": 4, "group_select_mode": 1, "norm_type": 1}
    y, idx, out = opforge.moe_gating_top_k(x.view(2, 3, 16), 4, bias=bias, out_flag=True,
                                           index_dtype=torch.int64, **attrs)
    assert y.shape == idx.shape == (2, 3, 4) and out.shape == (2, 3, 16)
    assert idx.dtype == torch.int64
    flat = opforge.moe_gating_top_k(x, 4, bias=bias, out_flag=True, **attrs)
    assert torch.equal(y.view(6, 4), flat[0]) and torch.equal(idx.view(6, 4), flat[1].long())
    assert_golden(GATING, Case("float32_bias", (x, bias), {"k": 4, "out_flag": True, **attrs}),
                  flat)


def test_sigmoid_weights_without_renormalisation(backend):
    """``sigmoid_renorm=False`` (DeepSeek-V3's ``norm_topk_prob=False``): the gathered
    sigmoid scores times the scaling factor, the same experts as with renormalisation."""
    x = _logits(7, 32, seed=11)
    y, idx, _ = opforge.moe_gating_top_k(x, 4, norm_type=1, sigmoid_renorm=False,
                                         routed_scaling_factor=2.5)
    expected = torch.sigmoid(x.double()).gather(1, idx.long()) * 2.5
    torch.testing.assert_close(y.double(), expected, rtol=1e-6, atol=1e-7)
    assert torch.equal(idx, opforge.moe_gating_top_k(x, 4, norm_type=1)[1])


@pytest.mark.parametrize("attrs", [{"norm_type": 1, "routed_scaling_factor": 1.5},
                                   {"norm_type": 0, "renorm": 1, "out_flag": True},
                                   {"norm_type": 0}, {"norm_type": 1, "eps": 0.5},
                                   {"norm_type": 1, "sigmoid_renorm": False}])
def test_gradient_of_y_through_the_gathered_scores(attrs, backend):
    x = _logits(5, 16, seed=4)
    leaf = x.clone().requires_grad_()
    wide = x.double().clone().requires_grad_()
    y, idx, out = opforge.moe_gating_top_k(leaf, 3, **attrs)
    upstream = torch.randn_like(y, dtype=torch.float64)
    loss = (y.double() * upstream).sum() + (out.double().sum() if out.numel() else 0)
    (grad,) = torch.autograd.grad(loss, leaf)
    scores = wide.sigmoid() if attrs["norm_type"] == 1 else wide.softmax(-1)
    weights = scores.gather(1, idx.long())
    if (attrs["norm_type"] == 1 and attrs.get("sigmoid_renorm", True)) or attrs.get("renorm"):
        weights = weights / (weights.sum(-1, keepdim=True) + attrs.get("eps", 1e-20))
    expected_loss = (weights * attrs.get("routed_scaling_factor", 1.0) * upstream).sum()
    if attrs.get("out_flag"):
        expected_loss = expected_loss + scores.sum()
    (expected,) = torch.autograd.grad(expected_loss, wide)
    assert (grad.double() - expected).abs().max() < 1e-5


@pytest.mark.parametrize("finished", [None, [[False, True, False], [True, False, False]]])
def test_softmax_variant_gradient_through_the_chosen_scores(finished, backend):
    """y of the softmax form is softmax(x) at the top-k experts (finished rows too, whose
    returned experts are E): its gradient against float64 autograd of that formula."""
    x = _logits(6, 16, torch.float32, seed=9).view(2, 3, 16).requires_grad_()
    if finished is not None:
        finished = torch.tensor(finished, device=DEVICE)
    y, _, _ = opforge.moe_gating_top_k_softmax(x, finished, k=4)
    upstream = torch.randn(y.shape, generator=torch.Generator().manual_seed(10)).to(DEVICE)
    (got,) = torch.autograd.grad(y, x, upstream)
    wide = x.detach().double().requires_grad_()
    scores = wide.softmax(-1)
    chosen = scores.gather(-1, torch.topk(scores, 4, -1)[1])
    (expected,) = torch.autograd.grad(chosen, wide, upstream.double())
    assert (got.double() - expected).abs().max() <= 1e-6 * expected.abs().max()


def test_softmax_variant_finished_rows_and_row_idx(backend):
    """Each call's own rows are finished: the second call replays the first's launches
    (the gating step's and the finishing kernel's) on its own tensors."""
    opforge.clear_caches()
    for seed, finished in enumerate(([[False, True, False], [False, False, True]],
                                     [[True, False, False], [False, True, False]])):
        x = _logits(6, 10, seed=seed).view(2, 3, 10)
        finished = torch.tensor(finished, device=DEVICE)
        y, idx, row_idx = opforge.moe_gating_top_k_softmax(x, finished, k=2)
        values, indices = torch.softmax(x, -1).topk(2, -1)
        torch.testing.assert_close(y, values)
        assert torch.equal(idx[~finished], indices[~finished].int())
        assert (idx[finished] == 10).all()
        flat = row_idx.view(6, 2)
        assert flat[:, 1].tolist() == [6 + i for i in range(6)] and flat[:, 0].tolist() == \
            list(range(6))


def test_softmax_variant_refuses_row_indices_past_int32():
    """row_idx is int32: rows x k up to 2**31 - 1 plan, one more is refused before any
    kernel (meta tensors: no memory)."""
    fits = torch.empty(2**31 - 1, 2, device="meta")
    assert opforge.plan("moe_gating_top_k_softmax", fits, None, k=1).outputs[2].shape == \
        (2**31 - 1, 1)
    with pytest.raises(opforge.ShapeError) as error:
        opforge.plan("moe_gating_top_k_softmax", torch.empty(2**31, 2, device="meta"), None,
                     k=1)
    assert (error.value.op, error.value.param) == ("moe_gating_top_k_softmax", "x")
    assert "2147483648 rows" in str(error.value)


def test_works_under_torch_compile():
    x = _logits(8, 32, seed=5).requires_grad_()

    def route(x):
        y, idx, _ = opforge.moe_gating_top_k(x, 2, norm_type=1)
        return y.sum(), idx

    compiled = torch.compile(route, fullgraph=True, backend="aot_eager")
    (expected_grad,) = torch.autograd.grad(route(x)[0], x)
    loss, idx = compiled(x)
    (grad,) = torch.autograd.grad(loss, x)
    torch.testing.assert_close(grad, expected_grad)
    assert torch.equal(idx, route(x)[1])


def test_compat_signatures():
    x = _logits(4, 16, seed=6)
    y, idx, out = npu_moe_gating_top_k(x, 2, norm_type=1)
    assert out.shape == (4, 16) and out.dtype == torch.float32
    expected = opforge.moe_gating_top_k(x, 2, norm_type=1)
    assert torch.equal(y, expected[0]) and torch.equal(idx, expected[1])
    with pytest.raises(opforge.UnsupportedError):
        npu_moe_gating_top_k(x, 2, tid2eid=torch.zeros(4, 2, dtype=torch.int32))
    with pytest.raises(opforge.UnsupportedError) as raised:  # CANN documents renorm=0 only
        npu_moe_gating_top_k(x, 2, renorm=1)
    assert raised.value.param == "renorm"
    with pytest.raises(opforge.ShapeError):
        npu_moe_gating_top_k(x.view(2, 2, 16), 2)
    assert npu_moe_gating_top_k_softmax(x, k=3)[0].shape == (4, 3)


@given(rows=st.integers(1, 40), groups=st.sampled_from([1, 2, 4, 8]),
       per_group=st.integers(2, 12), data=st.data())
def test_property_grouped_selection_matches_the_golden(rows, groups, per_group, data):
    experts = groups * per_group
    k_group = data.draw(st.integers(1, groups))
    k = data.draw(st.integers(1, k_group * per_group))
    attrs = {"k": k, "k_group": k_group, "group_count": groups,
             "group_select_mode": data.draw(st.sampled_from([0, 1])),
             "norm_type": data.draw(st.sampled_from([0, 1]))}
    x = _logits(rows, experts, torch.bfloat16, seed=rows * 31 + experts)
    bias = _logits(1, experts, torch.bfloat16, seed=experts)[0] * 0.1
    case = Case("property", (x, bias), attrs)
    with opforge.use_backend("triton"):
        outputs = opforge.plan(GATING, x, bias, **attrs).run(x, bias)
    assert_golden(GATING, case, outputs)
