"""Mixture-of-experts around `opforge.moe_gating_top_k`: load statistics, the Switch/GShard
auxiliary loss, DeepSeek-V3's auxiliary-loss-free bias update, dynamic k, a `MoEGate`
module, and token dispatch/combine for building a full MoE layer.

A layer reads::

    gate = MoEGate(hidden, num_experts=64, k=4)
    weights, experts, stats = gate(x)                  # x (T, hidden)
    routed = dispatch(x, experts, num_experts)         # tokens grouped by expert
    outputs = [expert_fn[e](chunk) for e, chunk in enumerate(routed.split())]
    y = combine(torch.cat(outputs), routed, weights)   # (T, hidden), weighted sum

Gradients reach the router through ``weights`` (and through the auxiliary loss when it
is used); the selection itself has none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from opforge.core.errors import AttrError, DtypeError, IndexRangeError
from opforge.functional import moe_gating_top_k


def expert_load(expert_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens routed to each expert: int64 ``(num_experts,)`` from ``expert_idx`` of any
    shape (entries outside ``[0, num_experts)``, such as finished rows' ``E``, are not
    counted)."""
    flat = expert_idx.reshape(-1).long()
    flat = flat[(flat >= 0) & (flat < num_experts)]
    return torch.bincount(flat, minlength=num_experts)


def load_balancing_loss(scores: torch.Tensor, expert_idx: torch.Tensor) -> torch.Tensor:
    """The Switch / GShard auxiliary loss ``E * sum_e f_e P_e``: ``f_e`` the fraction of the
    ``T * k`` routing slots given to expert e (no gradient), ``P_e`` the mean router score
    of e over the tokens (differentiable). 1 when the load is uniform.

    Args:
        scores: ``(T, E)`` router probabilities (softmax or normalised sigmoid scores).
        expert_idx: ``(T, k)`` chosen experts.
    """
    experts = scores.shape[1]
    fraction = expert_load(expert_idx, experts).to(scores.dtype) / max(1, expert_idx.numel())
    # An empty batch (a micro-batch or expert shard without tokens) contributes 0, not NaN.
    mean_scores = scores.sum(0) / max(1, scores.shape[0])
    return experts * (fraction * mean_scores).sum()


@torch.no_grad()
def update_bias(bias: torch.Tensor, load: torch.Tensor, rate: float) -> torch.Tensor:
    """DeepSeek-V3's auxiliary-loss-free balancing, in place: ``bias += rate *
    sign(mean(load) - load)`` (under-loaded experts become more likely to be chosen).
    Returns ``bias``. Keep ``bias`` in float32 (`MoEGate` does): in bfloat16 a step of
    1e-3 is lost at |bias| >= 0.5 and doubled below it.

    Raises:
        DtypeError: ``bias`` is not a floating-point tensor."""
    if not bias.is_floating_point():
        raise DtypeError("must be a floating-point tensor", op="update_bias", param="bias",
                         expected="float32", got=str(bias.dtype))
    load = load.to(torch.float32)
    bias.copy_(bias.float() + rate * torch.sign(load.mean() - load))
    return bias


def dynamic_k(weights: torch.Tensor, threshold: float) -> torch.Tensor:
    """Which of each row's ``k`` experts to keep: the fewest, in descending weight, whose
    cumulative share of the row's weight reaches ``threshold`` (at least one, at most k).

    Args:
        weights: ``(T, k)`` routing weights. threshold: in (0, 1].

    Returns:
        bool ``(T, k)``.

    Raises:
        AttrError: ``threshold`` outside (0, 1].
    """
    if not 0 < threshold <= 1:
        raise AttrError("is out of range", op="dynamic_k", param="threshold",
                        expected="a share in (0, 1]", got=threshold)
    order = torch.argsort(weights, dim=-1, descending=True, stable=True)
    ranked = weights.gather(-1, order).float()
    share = ranked / ranked.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    # An exclusive cumulative sum: subtracting a share back from the inclusive one
    # re-rounds, and a prefix exactly at the threshold would keep one expert too many.
    cumulative = torch.cumsum(share, -1)
    before = torch.cat([torch.zeros_like(cumulative[..., :1]), cumulative[..., :-1]], -1)
    keep_ranked = before < threshold
    keep_ranked[..., 0] = True
    return torch.zeros_like(keep_ranked).scatter(-1, order, keep_ranked)


@dataclass
class RoutedTokens:
    """Tokens grouped by expert (`dispatch`'s result).

    Attributes:
        tokens: ``(T * k, H)`` token rows, expert 0's first, in token order within an
            expert (a stable sort).
        counts: int64 ``(E,)`` rows per expert.
        source: int64 ``(T * k,)`` the token each row came from.
        slot: int64 ``(T * k,)`` its position in the token's ``k`` choices.
    """

    tokens: torch.Tensor
    counts: torch.Tensor
    source: torch.Tensor
    slot: torch.Tensor

    def split(self) -> tuple[torch.Tensor, ...]:
        """One ``(count_e, H)`` chunk per expert."""
        return torch.split(self.tokens, self.counts.tolist())


def dispatch(x: torch.Tensor, expert_idx: torch.Tensor, num_experts: int) -> RoutedTokens:
    """Permute ``x`` ``(T, H)`` so that each expert's tokens are contiguous.

    Raises:
        IndexRangeError: an expert index outside ``[0, num_experts)``.
    """
    k = expert_idx.shape[1]
    flat = expert_idx.reshape(-1).long()
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= num_experts):
        raise IndexRangeError("holds an expert outside the table", op="dispatch",
                              param="expert_idx", expected=f"0..{num_experts - 1}",
                              got=int(flat.min()) if int(flat.min()) < 0 else int(flat.max()))
    order = torch.argsort(flat, stable=True)
    source = order // k
    return RoutedTokens(x[source], torch.bincount(flat, minlength=num_experts), source,
                        order % k)


def combine(expert_out: torch.Tensor, routed: RoutedTokens, weights: torch.Tensor
            ) -> torch.Tensor:
    """Un-permute the experts' outputs ``(T * k, H)`` and sum each token's ``k`` outputs
    weighted by ``weights`` ``(T, k)``: ``(T, H)`` in expert_out's dtype (summed in
    float32)."""
    tokens = weights.shape[0]
    scaled = expert_out.float() * weights[routed.source, routed.slot].float()[:, None]
    total = torch.zeros(tokens, expert_out.shape[1], dtype=torch.float32,
                        device=expert_out.device)
    return total.index_add(0, routed.source, scaled).to(expert_out.dtype)


@dataclass
class GateStats:
    """What one `MoEGate` call measured: the load per expert, the auxiliary loss (a
    differentiable scalar, 0 when its coefficient is 0) and the kept-expert mask of
    dynamic k (None without it)."""

    load: torch.Tensor
    aux_loss: torch.Tensor
    kept: torch.Tensor | None = None


class MoEGate(nn.Module):
    """A linear router followed by `opforge.moe_gating_top_k`.

    Args:
        hidden: token width. num_experts: E. k: experts per token.
        norm_type: 0 softmax, 1 sigmoid (DeepSeek-V3). group_count, k_group,
            group_select_mode, routed_scaling_factor, renorm: as in moe_gating_top_k.
        aux_loss_coef: weight of the Switch/GShard loss in ``stats.aux_loss`` (0: none).
        bias_update_rate: gamma of the auxiliary-loss-free bias update, applied after each
            training-mode call (0: the bias stays 0).
        dynamic_threshold: when set, each token keeps the fewest experts whose weight
            share reaches it (`dynamic_k`); dropped experts get weight 0 and the kept
            weights are renormalised to the row's total.
    """

    def __init__(self, hidden: int, num_experts: int, k: int, *, norm_type: int = 0,
                 group_count: int = 1, k_group: int = 1, group_select_mode: int = 0,
                 routed_scaling_factor: float = 1.0, renorm: int = 1,
                 aux_loss_coef: float = 0.0, bias_update_rate: float = 0.0,
                 dynamic_threshold: float | None = None, device: torch.device | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, device=device,
                                               dtype=dtype))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        # The balancing bias accumulates steps of bias_update_rate: float32 whatever the
        # module's dtype (see `_apply`), cast to the logits' dtype where it is used.
        self.register_buffer("bias", torch.zeros(num_experts, device=device,
                                                 dtype=torch.float32))
        self.num_experts, self.k = num_experts, k
        self.routing = {"k_group": k_group, "group_count": group_count,
                        "group_select_mode": group_select_mode, "renorm": renorm,
                        "norm_type": norm_type,
                        "routed_scaling_factor": routed_scaling_factor}
        self.aux_loss_coef = aux_loss_coef
        self.bias_update_rate = bias_update_rate
        self.dynamic_threshold = dynamic_threshold

    def _apply(self, fn: Any, recurse: bool = True) -> MoEGate:
        # .to(dtype) / .half() would round the float32 bias: it follows the device only.
        bias = self.bias
        super()._apply(fn, recurse)
        self.bias = bias.to(self.bias.device)
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, GateStats]:
        """``(weights (T, k), expert_idx (T, k) int32, stats)`` for tokens ``x`` ``(T, H)``
        (leading dims are flattened)."""
        tokens = x.reshape(-1, x.shape[-1])
        logits = tokens @ self.weight.t()
        use_bias = self.bias_update_rate > 0
        weights, experts, scores = moe_gating_top_k(
            logits, self.k, bias=self.bias.to(logits.dtype) if use_bias else None,
            out_flag=self.aux_loss_coef > 0, **self.routing)
        kept = None
        if self.dynamic_threshold is not None:
            kept = dynamic_k(weights.detach(), self.dynamic_threshold)
            total = weights.sum(-1, keepdim=True)
            weights = torch.where(kept, weights, torch.zeros_like(weights))
            weights = weights * (total / weights.sum(-1, keepdim=True))
        load = expert_load(experts if kept is None else
                           torch.where(kept, experts, self.num_experts), self.num_experts)
        aux = logits.new_zeros(())
        if self.aux_loss_coef > 0:
            if self.routing["norm_type"] == 1:
                scores = scores / scores.sum(-1, keepdim=True)
            aux = self.aux_loss_coef * load_balancing_loss(scores, experts)
        if self.training and use_bias:
            update_bias(self.bias, load, self.bias_update_rate)
        return weights, experts, GateStats(load, aux, kept)
