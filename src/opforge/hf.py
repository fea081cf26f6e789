"""One call puts opforge's operators into a Hugging Face ``transformers`` model:
``report = opforge.patch(model)``, undone by ``opforge.unpatch(model)``.

What is swapped, per supported model type (`SUPPORTED_MODEL_TYPES`):

- every RMSNorm module's forward by `opforge.rms_norm` (its ``variance_epsilon``; the
  result in torch's promoted dtype of the input and the weight, as the module gives it);
  Gemma's, Qwen3-Next's and Qwen3.5's, which scale by ``1 + weight`` in float32 and round
  once to the input's dtype, by `opforge.rms_norm` with that float32 scale; OLMo 2's,
  OLMo 3's, Helium's and gpt-oss's, in the input's dtype whatever the weight's;
- every SwiGLU MLP's forward by `opforge.nn.SwiGLUMLP`'s, ``down(silu_mul(gate(x),
  up(x)))`` (`opforge.silu_mul`: one pass each way where ``silu`` and a product make two
  forward and three backward); Phi-3's and GLM's, whose one projection holds gate and
  up, by ``down(swiglu(gate_up(x)))`` (`opforge.swiglu`); Gemma's GELU-gated one (GELU's
  tanh form) by `opforge.nn.GeGLUMLP`'s, ``down(gelu_tanh_mul(gate(x), up(x)))``;
- the attention, through transformers' attention-interface registry under the name
  ``"opforge"`` (unless the model drops attention weights out in training), Gemma 2's
  soft cap as the kernels' ``softcap``:
  `opforge.attention` with the boolean masks transformers builds for it
  (padding, packed sequences, overlays) or, with no mask, the causal rule and the module's
  sliding window as the kernels' band; padding-free packed batches by
  `opforge.attention_varlen`, their window as its band; gpt-oss's attention sinks as
  the ``sinks`` of either;
- the rotary embedding functions of the model's modeling module (``half`` mode; DeepSeek's
  interleaved pairs as ``interleave_half``; GLM's, Helium's and ERNIE 4.5's interleaved
  pairs, whose tables repeat the half layout's first half of angles, as ``interleave``;
  gpt-oss's halves, whose tables hold each angle once, as ``half``; a partial rotary
  embedding, Phi-3's, GLM's and Qwen3.5's, on the leading dims its cos and sin cover);
- the MoE routers' selection by `opforge.moe_gating_top_k` with each model's rule: softmax
  top-k renormalised or not (``norm_topk_prob``; routers without the switch always:
  Mixtral, Qwen3.5-MoE, gpt-oss, Hunyuan-MoE) for Qwen2-MoE, Qwen3-MoE, OLMoE, Mixtral,
  Qwen3-Next, Qwen3.5-MoE, gpt-oss and Hunyuan-MoE; DeepSeek-V3's, GLM-4-MoE's and
  GLM-4-MoE-Lite's sigmoid scores with the correction bias, group-limited top-k and
  ``norm_topk_prob`` either way; int64 indices for the experts;
- the causal-LM loss by `opforge.cross_entropy` (float32 log-sum-exp on the logits as
  they come, with no float32 copy of them); in training with ``labels``, by
  `opforge.fused_linear_cross_entropy` on the last hidden states and the output head's
  weight, so that the ``[tokens, vocab]`` logits are never made (the output's ``logits``
  is then None, as a fused loss's is).

Modules keep their class and their parameters: a forward is bound on the instance, so
``state_dict`` keys, tied weights, devices and dtypes are those of the model as it was.
The rotary functions are module globals: they are swapped for every model of that type
in the process while any of them is patched, and restored when the last one is unpatched.
Fused experts, routers of other rules (ERNIE 4.5's) and linear-attention layers
(Qwen3-Next's and Qwen3.5's gated delta nets) are left as they are (the report says why).
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from opforge import nn
from opforge.core.errors import OpError
from opforge.functional import (
    attention,
    attention_varlen,
    cross_entropy,
    fused_linear_cross_entropy,
    moe_gating_top_k,
    rms_norm,
    rope,
    swiglu,
)

ATTENTION_NAME = "opforge"
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe",
                         "olmoe", "mixtral", "deepseek_v3", "phi3", "gemma", "gemma2",
                         "gemma3_text", "granite", "smollm3", "olmo2", "olmo3", "exaone4",
                         "seed_oss", "ministral", "hunyuan_v1_dense", "hunyuan_v1_moe",
                         "glm", "glm4", "glm4_moe", "glm4_moe_lite", "helium", "ernie4_5",
                         "ernie4_5_moe", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text",
                         "gpt_oss", "qwen3_vl", "gemma3")
# Routers of softmax top-k, renormalised when ``norm_topk_prob`` (those without the switch:
# always), the weights in the logits' dtype except Mixtral's (float32).
SOFTMAX_ROUTERS = ("Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter", "OlmoeTopKRouter",
                   "MixtralTopKRouter", "Qwen3NextTopKRouter", "Qwen3_5MoeTopKRouter",
                   "GptOssTopKRouter")
FLOAT32_WEIGHT_ROUTERS = ("MixtralTopKRouter",)
# Routers of DeepSeek-V3's rule: sigmoid scores, correction bias, group-limited top-k.
SIGMOID_GROUP_ROUTERS = ("DeepseekV3TopkRouter", "Glm4MoeTopkRouter", "Glm4MoeLiteTopkRouter")
# RMSNorms that scale by 1 + weight, in float32, rounded once to the input's dtype.
OFFSET_RMS_NORMS = ("GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm", "Qwen3NextRMSNorm",
                    "Qwen3_5RMSNorm", "Qwen3_5MoeRMSNorm")
# RMSNorms that scale in float32 and round once to the input's dtype, whatever the weight's.
INPUT_DTYPE_RMS_NORMS = ("Olmo2RMSNorm", "Olmo3RMSNorm", "HeliumRMSNorm", "GptOssRMSNorm")
# Rotary functions of a modeling module and the rope mode each one is.
ROPE_FUNCTIONS = {"apply_rotary_pos_emb": "half",
                  "apply_rotary_pos_emb_interleave": "interleave_half"}
# Model types whose ``apply_rotary_pos_emb`` takes other tables than ``rope``'s: GLM's
# rotates interleaved pairs by the first half of the ``half``-layout tables, each angle
# repeated; gpt-oss's rotates halves by tables that hold each angle once.
ROPE_TABLES = {**dict.fromkeys(("glm", "glm4", "helium", "ernie4_5", "ernie4_5_moe"),
                               "paired"), "gpt_oss": "angles_once"}
GATED_MLP_REASON = ("left as transformers computes it: an MLP gated by {}, where opforge's "
                    "fused gates are SiLU and GELU's tanh form")
# transformers' activations that are GELU's tanh form.
GELU_TANH_ACTIVATIONS = ("GELUTanh", "PytorchGELUTanh", "NewGELUActivation",
                         "FastGELUActivation", "AccurateGELUActivation")
DROPOUT_REASON = ("left as transformers computes it: the model drops attention weights out in "
                  "training (attention_dropout), which opforge's attention does not")
ROUTER_REASON = "left as transformers computes it: opforge.patch does not know {}'s rule"
LINEAR_ATTENTION_REASON = ("left as transformers computes it: {} is a linear (gated delta) "
                           "attention, which opforge has no operator for")
EXPERTS_REASON = ("left as transformers computes them: the experts hold fused weight tensors "
                  "that opforge has no grouped-matmul operator for")


class PatchError(OpError, ValueError):
    """A model opforge cannot patch, or an attention call it cannot run."""


@dataclass
class PatchReport:
    """What `patch` swapped (component -> module names) and what it left (-> why)."""

    model_type: str
    patched: dict[str, list[str]] = field(default_factory=dict)
    left: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"opforge.patch({self.model_type}):"]
        lines += [f"  patched {name}: " + (where[0] if len(where) == 1 else
                                          f"{len(where)} ({', '.join(where[:3])}"
                                          f"{', ...' if len(where) > 3 else ''})")
                  for name, where in self.patched.items()]
        lines += [f"  left {name}: {why}" for name, why in self.left.items()]
        return "\n".join(lines)


@dataclass
class _PatchState:
    report: PatchReport
    modules: list[torch.nn.Module]
    attn_implementation: str | None
    rope_module: str | None
    forward: Callable | None  # the model's own instance forward, if it had one
    labels_position: int | None  # of ``labels`` among the forward's positional parameters


# Modeling module name -> (models patched, the functions it had).
_ROPE_OWNERS: dict[str, tuple[int, dict[str, Callable]]] = {}


def _rms_norm_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    # The dtype is torch's promotion of the input's and the weight's, as transformers'.
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _input_dtype_rms_norm_forward(self: torch.nn.Module, hidden_states: torch.Tensor
                                  ) -> torch.Tensor:
    # OLMo 2's: weight times the float32 normalised values, in the input's dtype.
    return rms_norm(hidden_states, self.weight, self.variance_epsilon).to(hidden_states.dtype)


def _offset_rms_norm_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    # Gemma's norm: x's rms-normalised float32 values times 1 + weight in float32, then
    # x's dtype (one rounding, as transformers' computes it).
    return rms_norm(x, 1.0 + self.weight.float(), self.eps).to(x.dtype)


def _dropout_mlp_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    # Seed-OSS's MLP: its output through dropout (residual_dropout) while training.
    return torch.nn.functional.dropout(nn.SwiGLUMLP.forward(self, x), self.residual_dropout,
                                       self.training)


def _fused_gate_mlp_forward(self: torch.nn.Module, hidden_states: torch.Tensor
                            ) -> torch.Tensor:
    # Phi-3's and GLM's MLP: one projection holds the gate and the up halves, silu(gate) * up.
    return self.down_proj(swiglu(self.gate_up_proj(hidden_states)))


def _softmax_router_forward(self: torch.nn.Module, hidden_states: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A softmax TopKRouter (`SOFTMAX_ROUTERS`: Qwen2-MoE's, Qwen3-MoE's, OLMoE's,
    Mixtral's, Qwen3-Next's, Qwen3.5-MoE's, gpt-oss's): (logits, top-k softmax weights,
    int64 experts); renormalised without an epsilon when ``norm_topk_prob`` (routers
    without the switch: always; gpt-oss's softmax of the top-k logits is that), the
    weights in the logits' dtype or float32 (Mixtral), as each returns; the logits with
    the router's bias where it has one (gpt-oss)."""
    router_logits = torch.nn.functional.linear(hidden_states.reshape(-1, self.hidden_dim),
                                               self.weight, getattr(self, "bias", None))
    logits = router_logits.float() if type(self).__name__ in FLOAT32_WEIGHT_ROUTERS \
        else router_logits
    weights, experts, _ = moe_gating_top_k(logits, self.top_k,
                                           renorm=int(getattr(self, "norm_topk_prob", True)),
                                           eps=0.0, index_dtype=torch.int64)
    return router_logits, weights, experts


def _linear_gate_router_forward(self: torch.nn.Module, hidden_states: torch.Tensor
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hunyuan-MoE's gate: logits from its ``wg`` Linear (in float32 when ``wg`` is), softmax
    top-k always renormalised, the weights in the logits' dtype, int64 experts."""
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    router_logits = self.wg(hidden.float() if self.wg.weight.dtype == torch.float32
                            else hidden)
    weights, experts, _ = moe_gating_top_k(router_logits, self.top_k, renorm=1, eps=0.0,
                                           index_dtype=torch.int64)
    return router_logits, weights, experts


def _deepseek_router_forward(self: torch.nn.Module, hidden_states: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's router (and GLM-4-MoE's, `SIGMOID_GROUP_ROUTERS`): float32 logits,
    sigmoid scores, the correction bias for the selection only, the best ``topk_group``
    groups by their top-two sums, top-k, the weights renormalised (+1e-20) when
    ``norm_topk_prob``, times the scaling factor."""
    router_logits = torch.nn.functional.linear(
        hidden_states.reshape(-1, self.hidden_dim).float(), self.weight.float())
    weights, experts, _ = moe_gating_top_k(
        router_logits, self.top_k, bias=self.e_score_correction_bias.float(),
        k_group=self.topk_group, group_count=self.num_group, group_select_mode=1,
        norm_type=1, sigmoid_renorm=bool(self.norm_topk_prob),
        routed_scaling_factor=self.routed_scaling_factor, eps=1e-20,
        index_dtype=torch.int64)
    return router_logits, weights, experts


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                      dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, **kwargs: object
                      ) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface signature over `opforge.attention`: ``query``
    ``(B, H, Sq, D)``, ``key``/``value`` ``(B, Hkv, Sk, D|Dv)``, ``attention_mask`` a
    boolean or additive 4-D mask or None (then the module's causal rule and sliding
    window, see `_mask`); returns the output as ``(B, Sq, H, Dv)`` and no weights. A
    padding-free batch (one row of packed sequences with transformers' ``cu_seq_lens_q``
    / ``cu_seq_lens_k`` keywords, as its flattening collator gives) runs
    `opforge.attention_varlen`: each sequence attends to its own keys only, and no ``S x
    S`` mask is read; a sliding window of ``W`` keys runs
    as the kernels' band (``window_left = W - 1``), which skips the key blocks outside it.

    Raises:
        PatchError: dropout during training or a position bias (opforge's attention has
            neither); a padding-free batch under a sliding window in a module that is not
            causal.
    """
    if dropout:
        raise PatchError("opforge attention has no dropout", op="attention", param="dropout",
                         expected=0.0, got=dropout)
    if kwargs.get("position_bias") is not None:
        raise PatchError("opforge attention has no position_bias", op="attention",
                         param="position_bias", expected=None, got="a value")
    module_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None and cu_k is not None and query.shape[0] == 1:
        window = _window(module, kwargs)
        longest = kwargs.get("max_length_k")
        if window is not None and not module_causal:
            longest = int((cu_k[1:] - cu_k[:-1]).max()) if longest is None else longest
            if longest > window:
                raise PatchError("a padding-free batch under a sliding window needs a causal "
                                 "module", op="attention", param="sliding_window",
                                 expected="a causal attention", got="is_causal=False")
            window = None  # no sequence reaches past it
        out = attention_varlen(*(t[0].transpose(0, 1) for t in (query, key, value)), cu_q,
                               cu_k, bool(module_causal), scaling, kwargs.get("max_length_q"),
                               longest, window_left=None if window is None else window - 1,
                               sinks=kwargs.get("s_aux"), softcap=kwargs.get("softcap"))
        return out[None], None
    q_length, kv_length = query.shape[2], key.shape[2]
    causal = attention_mask is None and q_length > 1 and module_causal
    if causal and kv_length > q_length:
        # Prefill of an empty static cache: the slots after the queries hold nothing yet.
        key, value = key[:, :, :q_length], value[:, :, :q_length]
    # Without a mask (`_mask`), a causal module's sliding window runs as the kernels' band.
    window = _window(module, kwargs) if attention_mask is None and module_causal else None
    out = attention(query, key, value, causal, scaling, attn_mask=attention_mask,
                    window_left=None if window is None else window - 1,
                    sinks=kwargs.get("s_aux"), softcap=kwargs.get("softcap"))
    return out.transpose(1, 2).contiguous(), None


def _window(module: torch.nn.Module, kwargs: dict[str, object]) -> int | None:
    """The sliding window of this call: the ``sliding_window`` keyword when the module
    passes one, even None (EXAONE 4's full-attention layers pass None while their module
    holds the model's window), else the module's."""
    if "sliding_window" in kwargs:
        return kwargs["sliding_window"]
    return getattr(module, "sliding_window", None)


def _rope_function(mode: str, tables: str | None = None) -> Callable:
    def apply(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              position_ids: object = None, unsqueeze_dim: int = 1
              ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        if tables == "paired":
            # GLM's: the half layout's first half of angles, each repeated for its pair.
            cos, sin = (t[..., :t.shape[-1] // 2].repeat_interleave(2, -1) for t in (cos, sin))
        elif tables == "angles_once":
            # gpt-oss's: each angle once, for both halves of the head.
            cos, sin = (torch.cat([t, t], -1) for t in (cos, sin))
        rotary = cos.shape[-1]
        if rotary == q.shape[-1]:
            return rope(q, cos, sin, mode), rope(k, cos, sin, mode)
        # A partial rotary embedding rotates the leading dims; the rest pass as they are.
        return tuple(torch.cat([rope(t[..., :rotary], cos, sin, mode), t[..., rotary:]], -1)
                     for t in (q, k))

    apply.__name__ = f"opforge_rope_{mode}" + (f"_{tables}_tables" if tables else "")
    return apply


def _causal_loss(loss_of: Callable[[torch.Tensor], torch.Tensor], labels: torch.Tensor,
                 device: torch.device, num_items_in_batch: torch.Tensor | int | None,
                 ignore_index: int, shift_labels: torch.Tensor | None) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` rule around ``loss_of(targets)``, the tokens'
    losses: labels shifted left by one (unless ``shift_labels`` is given), the mean over
    non-ignored tokens, or the sum divided by ``num_items_in_batch`` when given, in float32
    (float64 for a float64 model) as transformers' (it upcasts the logits): a 16-bit loss
    would move in steps of 2^-6 near 3, what a training log shows."""
    if shift_labels is None:
        labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:]
    targets = shift_labels.reshape(-1).to(device)
    rows = loss_of(targets)
    total = rows.to(torch.float64 if rows.dtype == torch.float64 else torch.float32).sum()
    if num_items_in_batch is None:
        return total / (targets != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                   num_items_in_batch: torch.Tensor | int | None = None,
                   ignore_index: int = -100, shift_labels: torch.Tensor | None = None,
                   **kwargs: object) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` over `opforge.cross_entropy` (see `_causal_loss`):
    a float32 scalar (float64 for float64 logits)."""
    rows = logits.reshape(-1, vocab_size)
    return _causal_loss(
        lambda targets: cross_entropy(rows, targets, ignore_index=ignore_index,
                                      reduction="none"),
        labels, logits.device, num_items_in_batch, ignore_index, shift_labels)


def fused_causal_lm_loss(hidden_states: torch.Tensor, weight: torch.Tensor,
                         labels: torch.Tensor,
                         num_items_in_batch: torch.Tensor | int | None = None,
                         ignore_index: int = -100, shift_labels: torch.Tensor | None = None,
                         **kwargs: object) -> torch.Tensor:
    """`causal_lm_loss` of ``hidden_states @ weight.T`` (``hidden_states`` ``(B, S, H)``,
    the output head's ``weight`` ``(V, H)``) by `opforge.fused_linear_cross_entropy`:
    the logits are never made. Under autocast both run in its dtype, as the head would.
    A float32 scalar (float64 for a float64 model)."""
    device = hidden_states.device
    dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) \
        else weight.dtype
    rows = hidden_states.reshape(-1, hidden_states.shape[-1]).to(dtype)
    head = weight.to(dtype)
    return _causal_loss(
        lambda targets: fused_linear_cross_entropy(rows, head, targets,
                                                   ignore_index=ignore_index,
                                                   reduction="none"),
        labels, device, num_items_in_batch, ignore_index, shift_labels)


def _head_forward(self: torch.nn.Linear, hidden_states: torch.Tensor) -> torch.Tensor:
    """The output head's forward while the model is patched: the hidden states themselves
    while the model's fused-loss forward runs (``_opforge_hidden_out``), else the head's
    product (a bias-free Linear, `_fused_loss_refusal`)."""
    if self._opforge_hidden_out:
        return hidden_states
    return torch.nn.functional.linear(hidden_states, self.weight)


def _carries_head_forward(head: object) -> bool:
    """Whether ``head`` is still the output head `patch` bound `_head_forward` on (a head
    replaced or re-wrapped since then is left to compute its logits)."""
    bound = vars(head).get("forward") if isinstance(head, torch.nn.Module) else None
    return getattr(bound, "__func__", None) is _head_forward


def _fused_loss_call(self: torch.nn.Module, *args: object, **kwargs: object) -> object:
    """The patched model's forward: in training, given ``labels`` (by name or position),
    the model's own forward with its output head returning the hidden states, and the loss
    of those by `fused_causal_lm_loss` (plus a MoE model's router loss, as its forward
    adds it); the output's ``logits`` is None. Any other call is the model's own forward."""
    state = self._opforge_patch
    forward = state.forward if state.forward is not None else types.MethodType(
        type(self).forward, self)
    position = state.labels_position
    positional = position is not None and len(args) > position
    labels = args[position] if positional else kwargs.get("labels")
    head = getattr(self, "lm_head", None)
    if labels is None or not self.training or not _carries_head_forward(head):
        return forward(*args, **kwargs)
    return_dict = kwargs.pop("return_dict", None)
    loss_kwargs = {name: value for name, value in kwargs.items() if name != "labels"}
    if positional:
        args = (*args[:position], None, *args[position + 1:])
    else:
        kwargs["labels"] = None
    head._opforge_hidden_out = True
    try:
        outputs = forward(*args, return_dict=True, **kwargs)
    finally:
        head._opforge_hidden_out = False
    loss = fused_causal_lm_loss(outputs.logits, head.weight, labels, **loss_kwargs)
    aux_loss = outputs.get("aux_loss")
    if aux_loss is not None:
        loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
    # A fresh output: its fields (and a tuple of it) in the model's order, logits None.
    outputs = type(outputs)(**{**outputs, "loss": loss, "logits": None})
    wants_dict = self.config.return_dict if return_dict is None else return_dict
    return outputs if wants_dict else outputs.to_tuple()


def _fused_loss_forward(cls: type) -> Callable:
    """`_fused_loss_call` under the name, docstring and signature of ``cls.forward``
    (transformers reads a model's forward signature: Trainer's input columns, generate's
    ``logits_to_keep`` and attention-mask rules)."""
    @functools.wraps(cls.forward)
    def forward(self: torch.nn.Module, *args: object, **kwargs: object) -> object:
        return _fused_loss_call(self, *args, **kwargs)
    return forward


def _fused_loss_refusal(model: torch.nn.Module) -> str | None:
    """Why the fused loss cannot stand in for the model's head and loss, or None."""
    head = model.lm_head
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return "the output head is not a bias-free torch.nn.Linear"
    if "forward" in vars(head):
        return "the output head's forward is already replaced (hooks of another library)"
    if getattr(model.config, "final_logit_softcapping", None):
        return "the logits are soft-capped"
    return None


def _mask(*, q_length: int, kv_length: int, kv_offset: object = 0,
          attention_mask: torch.Tensor | None = None, local_size: int | None = None,
          allow_is_causal_skip: bool = True, config: object = None, **kwargs: object
          ) -> torch.Tensor | None:
    """The mask opforge's attention gets: SDPA's boolean one (None when the causal rule
    alone says it), and None too for a plain sliding-window causal mask that the causal
    rule would skip (no padding; one query, or as many queries as keys): `attention_forward`
    then runs the module's window as the kernels' band, which skips the key blocks outside
    it instead of reading an ``Sq x Sk`` mask. transformers allows the skip only for the
    unmodified pattern (no packing or overlay) and passes the window as ``local_size``;
    a chunked pattern (``attention_chunk_size``) keeps its mask, and so does a padding
    mask that does not cover the keys, or whose values a traced or compiled call would
    have to read (they would be baked into the graph: without a padding mask, a compiled
    model gets the band too)."""
    from transformers.masking_utils import sdpa_mask

    if (local_size is not None and allow_is_causal_skip
            and local_size == getattr(config, "sliding_window", None)
            and getattr(config, "attention_chunk_size", None) is None
            and (q_length == 1 or q_length == kv_length) and isinstance(kv_offset, int)
            and (attention_mask is None
                 or (not torch.compiler.is_compiling() and not torch.jit.is_tracing()
                     and isinstance(attention_mask, torch.Tensor)
                     and attention_mask.shape[-1] >= kv_offset + kv_length
                     and bool(attention_mask.all())))):
        return None
    return sdpa_mask(q_length=q_length, kv_length=kv_length, kv_offset=kv_offset,
                     attention_mask=attention_mask, local_size=local_size,
                     allow_is_causal_skip=allow_is_causal_skip, config=config, **kwargs)


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, _mask)


def _is_rms_norm(module: torch.nn.Module) -> bool:
    return (type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon")
            and isinstance(getattr(module, "weight", None), torch.nn.Parameter))


def _is_offset_rms_norm(module: torch.nn.Module) -> bool:
    return (type(module).__name__ in OFFSET_RMS_NORMS and hasattr(module, "eps")
            and isinstance(getattr(module, "weight", None), torch.nn.Parameter))


def _rms_norm_forward_of(module: torch.nn.Module) -> Callable:
    if _is_offset_rms_norm(module):
        return _offset_rms_norm_forward
    if type(module).__name__ in INPUT_DTYPE_RMS_NORMS:
        return _input_dtype_rms_norm_forward
    return _rms_norm_forward


def _is_silu(act: object) -> bool:
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"


def _mlp_forward(module: torch.nn.Module) -> tuple[str, Callable] | str | None:
    """(report component, opforge forward) of a gated MLP, the reason one is left (its
    activation), or None for a module that is not a gated MLP."""
    # Projections are Linear modules or wrap one (a LoRA adapter's); fused experts hold
    # Parameters under these names, not modules.
    if all(isinstance(getattr(module, name, None), torch.nn.Module)
           for name in ("gate_proj", "up_proj", "down_proj")):
        act = getattr(module, "act_fn", None)
        if _is_silu(act):
            return "swiglu_mlp", (_dropout_mlp_forward if getattr(module, "residual_dropout", 0)
                                  else nn.SwiGLUMLP.forward)
        if type(act).__name__ in GELU_TANH_ACTIVATIONS:
            return "geglu_mlp", nn.GeGLUMLP.forward
        return GATED_MLP_REASON.format(type(act).__name__)
    if all(isinstance(getattr(module, name, None), torch.nn.Module)
           for name in ("gate_up_proj", "down_proj")):
        act = getattr(module, "activation_fn", None)
        return ("swiglu_mlp", _fused_gate_mlp_forward) if _is_silu(act) \
            else GATED_MLP_REASON.format(type(act).__name__)
    return None


def _router_forward(module: torch.nn.Module) -> Callable | None:
    """The opforge forward of a transformers MoE router, None for other modules."""
    name = type(module).__name__
    if name in SIGMOID_GROUP_ROUTERS:
        return _deepseek_router_forward
    if name in SOFTMAX_ROUTERS:
        return _softmax_router_forward
    if name == "HunYuanMoEV1Gate":
        return _linear_gate_router_forward
    return None


def _bind(module: torch.nn.Module, forward: Callable, modules: list[torch.nn.Module]) -> None:
    module.forward = types.MethodType(forward, module)
    modules.append(module)


def _swap_rope(module_name: str, model_type: str) -> list[str]:
    """Swap the rotary functions of a modeling module (counted per patched model)."""
    count, originals = _ROPE_OWNERS.get(module_name, (0, {}))
    modeling = sys.modules[module_name]
    if count == 0:
        originals = {name: getattr(modeling, name) for name in ROPE_FUNCTIONS
                     if callable(getattr(modeling, name, None))}
        tables = ROPE_TABLES.get(model_type)
        for name in originals:
            setattr(modeling, name, _rope_function(
                "interleave" if tables == "paired" else ROPE_FUNCTIONS[name], tables))
    _ROPE_OWNERS[module_name] = (count + 1, originals)
    return sorted(originals)


def _restore_rope(module_name: str) -> None:
    count, originals = _ROPE_OWNERS[module_name]
    if count == 1:
        for name, function in originals.items():
            setattr(sys.modules[module_name], name, function)
        del _ROPE_OWNERS[module_name]
    else:
        _ROPE_OWNERS[module_name] = (count - 1, originals)


def _transformers_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model itself: a PEFT model's base model, else ``model``."""
    base = getattr(model, "get_base_model", None)
    return base() if callable(base) else model


def patch(model: torch.nn.Module, *, rms_norm: bool = True, mlp: bool = True,
          rope: bool = True, attention: bool = True, router: bool = True, loss: bool = True,
          fused_loss: bool = True) -> PatchReport:
    """Swap opforge's operators into a ``transformers`` model in place (see the module's
    docstring for what each switch swaps); a model already patched returns its report.

    Args:
        model: a ``transformers`` ``PreTrainedModel`` of a type in
            `SUPPORTED_MODEL_TYPES`, on any device and dtype, or a PEFT model around one
            (its LoRA adapters stay in the projections the patched forwards call).
        fused_loss: with ``loss``, a training call given ``labels`` takes its loss from the
            last hidden states by `fused_linear_cross_entropy` and returns ``logits``
            None (the memory of the ``[tokens, vocab]`` logits and their gradient saved);
            ``False`` keeps the logits (the loss by `opforge.cross_entropy` on them).

    Returns:
        A `PatchReport`: the module names patched per component, and what was left (fused
        experts, switched-off components) with the reason.

    Raises:
        PatchError: not a transformers model, or a model type opforge does not know.
        ImportError: transformers is not installed (``pip install opforge[transformers]``).
    """
    model = _transformers_model(model)
    state = getattr(model, "_opforge_patch", None)
    if state is not None:
        return state.report
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    modeling = next((cls.__module__ for cls in type(model).__mro__
                     if cls.__module__.startswith("transformers.models.")), None)
    if model_type not in SUPPORTED_MODEL_TYPES or modeling is None:
        raise PatchError("not a transformers model of a supported type", op="patch",
                         param="model", expected=" | ".join(SUPPORTED_MODEL_TYPES),
                         got=model_type or type(model).__name__)
    report = PatchReport(model_type)
    modules: list[torch.nn.Module] = []
    for name, module in model.named_modules():
        mlp_forward = _mlp_forward(module) if mlp else None
        if rms_norm and (_is_rms_norm(module) or _is_offset_rms_norm(module)):
            _bind(module, _rms_norm_forward_of(module), modules)
            report.patched.setdefault("rms_norm", []).append(name)
        elif isinstance(mlp_forward, str):
            report.left.setdefault("mlp", mlp_forward)
        elif mlp_forward is not None:
            component, forward = mlp_forward
            _bind(module, forward, modules)
            report.patched.setdefault(component, []).append(name)
        elif router and _router_forward(module) is not None:
            _bind(module, _router_forward(module), modules)
            report.patched.setdefault("moe_router", []).append(name)
        elif type(module).__name__.endswith("Experts"):
            report.left.setdefault("moe_experts", EXPERTS_REASON)
        elif router and type(module).__name__.endswith(("Router", "Gate")):
            report.left.setdefault("moe_router", ROUTER_REASON.format(type(module).__name__))
        elif type(module).__name__.endswith("GatedDeltaNet"):
            report.left.setdefault("linear_attention",
                                   LINEAR_ATTENTION_REASON.format(type(module).__name__))
    previous = None
    if attention and getattr(config, "attention_dropout", 0):
        report.left["attention"] = DROPOUT_REASON
    elif attention:
        _register_attention()
        previous = model.config._attn_implementation
        model.set_attn_implementation(ATTENTION_NAME)
        report.patched["attention"] = [f"config._attn_implementation={ATTENTION_NAME!r} "
                                       f"(was {previous!r})"]
    rope_module = None
    if rope:
        rope_module = modeling
        report.patched["rope"] = [f"{rope_module}.{name}" for name in
                                  _swap_rope(rope_module, model_type)]
    forward = labels_position = None
    if loss and hasattr(model, "lm_head"):
        model.loss_function = causal_lm_loss
        report.patched["loss"] = ["loss_function"]
        refusal = _fused_loss_refusal(model) if fused_loss else "switched off by the caller"
        if refusal is None:
            forward = vars(model).get("forward")
            names = list(inspect.signature(model.forward).parameters)
            labels_position = names.index("labels") if "labels" in names else None
            _bind(model.lm_head, _head_forward, modules)
            model.lm_head._opforge_hidden_out = False
            model.forward = types.MethodType(_fused_loss_forward(type(model)), model)
            report.patched["fused_loss"] = ["forward (training with labels: "
                                            "fused_linear_cross_entropy, logits None)"]
        else:
            report.left["fused_loss"] = refusal
    for switch, on in (("rms_norm", rms_norm), ("mlp", mlp), ("attention", attention),
                       ("rope", rope), ("moe_router", router), ("loss", loss)):
        if not on:
            report.left[switch] = "switched off by the caller"
    model._opforge_patch = _PatchState(report, modules, previous, rope_module, forward,
                                       labels_position)
    return report


def unpatch(model: torch.nn.Module) -> None:
    """Undo `patch`: the modules' own forwards, the attention implementation the model
    had, its loss and (with the last patched model of its type) the rotary functions. A
    model that is not patched is left as it is."""
    model = _transformers_model(model)
    state = getattr(model, "_opforge_patch", None)
    if state is None:
        return
    for module in state.modules:
        del module.forward
        vars(module).pop("_opforge_hidden_out", None)
    if state.attn_implementation is not None:
        model.set_attn_implementation(state.attn_implementation)
    if state.rope_module is not None:
        _restore_rope(state.rope_module)
    if "loss" in state.report.patched:
        del model._loss_function
    if "fused_loss" in state.report.patched:
        if state.forward is None:
            del model.forward
        else:
            model.forward = state.forward
    del model._opforge_patch
