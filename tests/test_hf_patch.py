"""`opforge.patch` on tiny random transformers models built from their configs (no hub):
what it swaps really runs, logits and gradients as close to a float64 copy as the
unpatched model's, masks honoured, generation unchanged, the model's parameters, keys and
ties kept, and `unpatch` restoring it."""

from __future__ import annotations

import copy
import inspect
import re
import runpy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import opforge
import opforge.hf

transformers = pytest.importorskip("transformers")

VOCAB = 101
# Vision-language model types, and the first of the ids their images take (below VOCAB).
VISION_KINDS = ("qwen3_vl", "gemma3")
IMAGE_TOKEN = 96
# The model types whose MoE routers opforge's forward replaces.
ROUTED_KINDS = ("qwen2_moe", "qwen3_moe", "olmoe", "mixtral", "deepseek_v3", "glm4_moe",
                "glm4_moe_lite", "qwen3_next", "qwen3_5_moe_text", "gpt_oss",
                "hunyuan_v1_moe")
_MODELS: list[torch.nn.Module] = []


@pytest.fixture(autouse=True)
def _unpatch_every_model():
    """The rotary functions are module globals: no test leaves a model patched."""
    yield
    while _MODELS:
        opforge.unpatch(_MODELS.pop())


def _tiny(kind: str, **overrides: object) -> torch.nn.Module:
    torch.manual_seed(0)
    common = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 2, "num_attention_heads": 4}
    common.update({key: overrides.pop(key) for key in list(overrides) if key in common})
    if kind == "llama":
        config = transformers.LlamaConfig(**common, num_key_value_heads=2,
                                          tie_word_embeddings=True, **overrides)
    elif kind in ("qwen3_moe", "qwen2_moe", "olmoe"):  # Qwen2-MoE with its shared expert
        config = getattr(transformers, {"qwen3_moe": "Qwen3MoeConfig",
                                        "qwen2_moe": "Qwen2MoeConfig",
                                        "olmoe": "OlmoeConfig"}[kind])(**{
            **common, "num_key_value_heads": 2, "num_experts": 8, "num_experts_per_tok": 2,
            "norm_topk_prob": True, **({"head_dim": 16, "moe_intermediate_size": 32}
                                       if kind == "qwen3_moe" else {}),
            **({"moe_intermediate_size": 32, "shared_expert_intermediate_size": 48}
               if kind == "qwen2_moe" else {}), **overrides})
    elif kind == "mistral":  # a sliding window shorter than the batch's sequences
        config = transformers.MistralConfig(**{**common, "num_key_value_heads": 2,
                                               "sliding_window": 4, **overrides})
    elif kind == "qwen2":
        config = transformers.Qwen2Config(**common, num_key_value_heads=2, **overrides)
    elif kind == "qwen3":
        config = transformers.Qwen3Config(**common, num_key_value_heads=2, head_dim=16,
                                          **overrides)
    elif kind in ("gemma", "gemma2", "gemma3_text"):  # sliding windows in gemma2 and 3
        config = getattr(transformers, {"gemma": "GemmaConfig", "gemma2": "Gemma2Config",
                                        "gemma3_text": "Gemma3TextConfig"}[kind])(**{
            **common, "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 4,
            **overrides})
    elif kind == "phi3":  # half the head dims rotated, as Phi-4-mini's three quarters
        config = transformers.Phi3Config(**common, num_key_value_heads=2, pad_token_id=0,
                                         partial_rotary_factor=0.5, **overrides)
    elif kind == "granite":  # the logits divided by 4 after the head: the fused loss too
        config = transformers.GraniteConfig(**common, num_key_value_heads=2,
                                            logits_scaling=4.0, attention_multiplier=0.2,
                                            **overrides)
    elif kind in ("olmo2", "olmo3", "exaone4", "seed_oss"):  # sliding windows in 3 and 4
        config = getattr(transformers, {"olmo2": "Olmo2Config", "olmo3": "Olmo3Config",
                                        "exaone4": "Exaone4Config",
                                        "seed_oss": "SeedOssConfig"}[kind])(**{
            **common, "num_key_value_heads": 2, "pad_token_id": 0,
            **({"sliding_window": 4} if kind in ("olmo3", "exaone4") else {}),
            # Seed-OSS drops attention weights out by default: opforge's attention with none.
            **({"attention_dropout": 0.0} if kind == "seed_oss" else {}), **overrides})
    elif kind in ("ministral", "hunyuan_v1_dense"):  # Ministral's sliding window
        config = getattr(transformers, {"ministral": "MinistralConfig",
                                        "hunyuan_v1_dense": "HunYuanDenseV1Config"}[kind])(**{
            **common, "num_key_value_heads": 2, "head_dim": 16, "pad_token_id": 0,
            **({"sliding_window": 4} if kind == "ministral" else {}), **overrides})
    elif kind == "smollm3":
        config = transformers.SmolLM3Config(**common, num_key_value_heads=2, pad_token_id=0,
                                            **overrides)
    elif kind in ("glm", "glm4"):  # interleaved pairs on half the head dims, attention bias
        config = getattr(transformers, {"glm": "GlmConfig", "glm4": "Glm4Config"}[kind])(
            **common, num_key_value_heads=2, head_dim=16, pad_token_id=0, **overrides)
    elif kind == "glm4_moe":  # DeepSeek-V3's router, half the head dims rotated, q/k norms
        config = transformers.Glm4MoeConfig(**{
            **common, "num_key_value_heads": 2, "head_dim": 16, "moe_intermediate_size": 32,
            "n_routed_experts": 8, "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2,
            "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "use_qk_norm": True,
            "partial_rotary_factor": 0.5, **overrides})
    elif kind == "glm4_moe_lite":  # DeepSeek-V3's latent attention and router
        config = transformers.Glm4MoeLiteConfig(**{
            **common, "num_key_value_heads": 4, "moe_intermediate_size": 32,
            "n_routed_experts": 8, "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2,
            "q_lora_rank": 32, "kv_lora_rank": 16,
            "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
            "routed_scaling_factor": 2.5, **overrides})
    elif kind in ("helium", "ernie4_5"):  # GLM's interleaved pairs on the whole head
        config = getattr(transformers, {"helium": "HeliumConfig",
                                        "ernie4_5": "Ernie4_5Config"}[kind])(**{
            **common, "num_key_value_heads": 2, "head_dim": 16, "pad_token_id": 0,
            **({"use_bias": True} if kind == "ernie4_5" else {}), **overrides})
    elif kind in ("ernie4_5_moe", "hunyuan_v1_moe"):  # routers transformers keeps
        config = getattr(transformers, {"ernie4_5_moe": "Ernie4_5_MoeConfig",
                                        "hunyuan_v1_moe": "HunYuanMoEV1Config"}[kind])(**{
            **common, "num_key_value_heads": 2, "head_dim": 16, "pad_token_id": 0,
            **({"moe_intermediate_size": 32, "moe_num_experts": 8, "moe_k": 2}
               if kind == "ernie4_5_moe" else {"num_experts": 8, "moe_topk": 2}),
            **overrides})
    elif kind in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"):
        # Gated delta-net layers (transformers') between gated full-attention ones.
        config = getattr(transformers, {"qwen3_next": "Qwen3NextConfig",
                                        "qwen3_5_text": "Qwen3_5TextConfig",
                                        "qwen3_5_moe_text": "Qwen3_5MoeTextConfig"}[kind])(**{
            **common, "num_key_value_heads": 2, "head_dim": 16, "pad_token_id": 0,
            "layer_types": ["linear_attention", "full_attention"] * (
                common["num_hidden_layers"] // 2),
            "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            **({} if kind == "qwen3_5_text" else {
                "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                "shared_expert_intermediate_size": 48}), **overrides})
    elif kind == "gpt_oss":  # attention sinks, sliding and full layers, a biased router
        config = transformers.GptOssConfig(**{
            **common, "num_key_value_heads": 2, "head_dim": 16, "pad_token_id": 0,
            "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4,
            **overrides})
    elif kind == "qwen3_vl":  # a vision tower; multimodal rotary sections over the head
        config = transformers.Qwen3VLConfig(
            text_config={**common, "num_key_value_heads": 2, "head_dim": 16,
                         "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                             "mrope_section": [2, 3, 3],
                                             "mrope_interleaved": True}, **overrides},
            vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 48,
                           "num_heads": 2, "patch_size": 4, "out_hidden_size": 64,
                           "num_position_embeddings": 64, "deepstack_visual_indexes": [0]},
            image_token_id=IMAGE_TOKEN, video_token_id=IMAGE_TOKEN + 1,
            vision_start_token_id=IMAGE_TOKEN + 2, vision_end_token_id=IMAGE_TOKEN + 3)
    elif kind == "gemma3":  # a SigLIP vision tower, images attended bidirectionally
        config = transformers.Gemma3Config(
            text_config={**common, "num_key_value_heads": 2, "head_dim": 16,
                         "sliding_window": 4, **overrides},
            vision_config={"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
                           "num_attention_heads": 2, "image_size": 16, "patch_size": 4},
            mm_tokens_per_image=4, image_token_index=IMAGE_TOKEN,
            boi_token_index=IMAGE_TOKEN + 1, eoi_token_index=IMAGE_TOKEN + 2)
    elif kind == "mixtral":
        config = transformers.MixtralConfig(**common, num_key_value_heads=2,
                                            num_local_experts=4, num_experts_per_tok=2,
                                            **overrides)
    else:
        config = transformers.DeepseekV3Config(**{
            **common, "num_key_value_heads": 4, "moe_intermediate_size": 32,
            "n_routed_experts": 8, "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2,
            "first_k_dense_replace": 1, "q_lora_rank": 32, "kv_lora_rank": 16,
            "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
            "routed_scaling_factor": 2.5, **overrides})
    model = (transformers.AutoModelForImageTextToText if kind in VISION_KINDS
             else transformers.AutoModelForCausalLM).from_config(config)
    # Random weights with the scale of trained ones (the routers start at zero; Gemma's
    # norms at 1 + 0).
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0, 0.05)
            elif kind.startswith("gemma"):
                parameter.normal_(0, 0.1)
            elif kind == "gpt_oss":  # sinks and biases of a trained model's scale
                parameter.normal_(0, 0.5)
    _MODELS.append(model)
    return model.eval()


def _full_attention_layers(model: torch.nn.Module) -> int:
    """The text layers that call the attention interface (not the linear-attention
    ones)."""
    config = model.config.get_text_config()
    types = getattr(config, "layer_types", None) or ["full_attention"] * (
        config.num_hidden_layers)
    return sum(layer != "linear_attention" for layer in types)


def _with_golden(kind: str, dtype: torch.dtype, **overrides: object
                 ) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A tiny model in ``dtype`` and its float64 copy (eager experts: grouped_mm has no
    float64 on CPUs)."""
    model = _tiny(kind, **overrides)
    golden_model = copy.deepcopy(model).double()
    golden_model.set_experts_implementation("eager")
    return model.to(dtype), golden_model


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :4] = 0  # left padding, as generation pads
    return ids, attention_mask


def _step(model: torch.nn.Module, ids: torch.Tensor, attention_mask: torch.Tensor
          ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    out = model(ids, attention_mask=attention_mask, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {name: p.grad.detach().clone()
                                 for name, p in model.named_parameters() if p.grad is not None}


def _rms_error(value: torch.Tensor, golden: torch.Tensor, valid: torch.Tensor | None = None
               ) -> float:
    difference = value.double() - golden
    if valid is not None:
        difference, golden = difference[valid], golden[valid]
    return float(difference.square().mean().sqrt() / golden.square().mean().sqrt().clamp_min(
        1e-300))


@pytest.fixture
def calls(monkeypatch):
    """How often the patched forwards reach each opforge functional (the MLP's through
    `opforge.nn.SwiGLUMLP`, which reads it from `opforge.functional`)."""
    counted: dict[str, int] = {}
    for module, name in ((opforge.hf, "attention"), (opforge.hf, "rms_norm"),
                         (opforge.hf, "rope"), (opforge.functional, "silu_mul"),
                         (opforge.hf, "swiglu"), (opforge.functional, "gelu_tanh_mul"),
                         (opforge.hf, "cross_entropy"),
                         (opforge.hf, "moe_gating_top_k"),
                         (opforge.hf, "fused_linear_cross_entropy")):
        real = getattr(module, name)

        def counting(*args, _name=name, _real=real, **kwargs):
            counted[_name] = counted.get(_name, 0) + 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, counting)
    return counted


# Qwen3.5 in bf16 only: in float32 its gated delta rule's gate gradients (A_log, dt_bias;
# transformers' own code) carry a relative error near 1e-5 that any change of rounding
# upstream moves by up to 8x (four batches, patched against unpatched: 1.1x to 8.2x).
@pytest.mark.parametrize("kind, dtype", [
    (kind, dtype) for kind in ("llama", "qwen3_moe", "deepseek_v3", "gemma3_text", "phi3",
                               "qwen2_moe", "glm4", "glm4_moe_lite", "helium", "gpt_oss")
    for dtype in (torch.float32, torch.bfloat16)] + [("qwen3_5_moe_text", torch.bfloat16)])
def test_patched_model_is_as_close_to_float64_as_the_unpatched_one(kind, dtype, calls):
    """Logits and every parameter gradient of a training step with a left-padded batch:
    the patched model's error against a float64 copy is at most 2x the unpatched model's
    own (plus float32 rounding, where both are at that level)."""
    model, golden_model = _with_golden(kind, dtype)
    ids, attention_mask = _batch()
    golden_logits, golden_grads = _step(golden_model, ids, attention_mask)
    plain_logits, plain_grads = _step(model, ids, attention_mask)
    report = opforge.patch(model)
    patched_logits, patched_grads = _step(model, ids, attention_mask)
    assert {"rms_norm", "attention", "rope", "loss"} <= set(report.patched)
    assert calls["rms_norm"] >= 5 and calls["cross_entropy"] == 1
    assert calls["attention"] == _full_attention_layers(model)
    assert calls["rope"] == 2 * calls["attention"]
    gated = ("silu_mul", "swiglu", "gelu_tanh_mul")
    assert sum(calls.get(name, 0) for name in gated) == len(
        report.patched.get("swiglu_mlp", []) + report.patched.get("geglu_mlp", []))
    assert calls.get("moe_gating_top_k", 0) == len(report.patched.get("moe_router", []))
    assert ("moe_router" in report.patched) == (kind in ROUTED_KINDS)
    assert ("geglu_mlp" in report.patched) == kind.startswith("gemma")
    floor = 4 * torch.finfo(torch.float32).eps
    valid = attention_mask.bool()
    pairs = [(patched_logits, plain_logits, golden_logits, valid)]
    pairs += [(patched_grads[name], plain_grads[name], golden_grads[name], None)
              for name in golden_grads]
    assert patched_grads.keys() == golden_grads.keys()
    for patched, plain, golden, where in pairs:
        assert _rms_error(patched, golden, where) <= 2 * _rms_error(plain, golden, where) + floor


def _training_step(model: torch.nn.Module, ids: torch.Tensor, attention_mask: torch.Tensor,
                   labels: torch.Tensor | None = None
                   ) -> tuple[object, dict[str, torch.Tensor]]:
    model.train().zero_grad()
    out = model(ids, attention_mask=attention_mask, labels=ids if labels is None else labels)
    out.loss.backward()
    return out, {name: p.grad.detach().clone()
                 for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["llama", "qwen3_moe", "deepseek_v3", "gemma3_text", "phi3",
                                  "granite", "glm4_moe"])
def test_training_takes_the_fused_loss_and_makes_no_logits(kind, dtype, calls):
    """In training with labels the loss comes from fused_linear_cross_entropy on the last
    hidden states (logits None): the loss (Qwen3-MoE's with its router loss) in
    transformers' dtype (float32: it upcasts the logits) and every parameter gradient
    within 2x the unpatched model's error against a float64 copy; a tuple output starts
    with the loss; unpatch gives the model its own forward back."""
    overrides = {"output_router_logits": True} if kind == "qwen3_moe" else {}
    model, golden_model = _with_golden(kind, dtype, **overrides)
    ids, attention_mask = _batch()
    golden, golden_grads = _training_step(golden_model, ids, attention_mask)
    plain, plain_grads = _training_step(model, ids, attention_mask)
    report = opforge.patch(model)
    fused, fused_grads = _training_step(model, ids, attention_mask)
    assert "fused_loss" in report.patched and fused.logits is None
    assert calls["fused_linear_cross_entropy"] == 1 and "cross_entropy" not in calls
    if kind == "qwen3_moe":
        assert fused.aux_loss is not None and golden.aux_loss is not None
    floor = 4 * torch.finfo(torch.float32).eps
    assert fused.loss.dtype == plain.loss.dtype == torch.float32
    # One scalar: its error ratio is luck below the model dtype's resolution (the hidden
    # states it comes from carry that dtype's roundings), hence one rounding's allowance.
    resolution = torch.finfo(dtype).eps * abs(golden.loss.item())
    assert abs(fused.loss.item() - golden.loss.item()) <= 2 * abs(
        plain.loss.item() - golden.loss.item()) + resolution + floor
    assert fused_grads.keys() == golden_grads.keys()
    for name, golden_grad in golden_grads.items():
        assert _rms_error(fused_grads[name], golden_grad) <= 2 * _rms_error(
            plain_grads[name], golden_grad) + floor
    as_tuple = model(ids, attention_mask=attention_mask, labels=ids, return_dict=False)
    assert torch.equal(as_tuple[0], fused.loss)
    with torch.no_grad():  # in eval, the logits as before
        assert model.eval()(ids, labels=ids).logits.shape == (*ids.shape, VOCAB)
    opforge.unpatch(model)
    assert "forward" not in vars(model)


def test_the_fused_loss_can_be_switched_off_and_divides_by_num_items():
    """``fused_loss=False`` keeps the logits in training (the loss by cross_entropy); the
    fused loss with ``num_items_in_batch`` is the sum over that count, as transformers'."""
    model = _tiny("llama")
    ids, _ = _batch()
    report = opforge.patch(model, fused_loss=False)
    assert report.left["fused_loss"] == "switched off by the caller"
    kept = model.train()(ids, labels=ids)
    assert kept.logits is not None
    opforge.unpatch(model)
    opforge.patch(model)
    fused = model(ids, labels=ids, num_items_in_batch=7)
    summed = torch.nn.functional.cross_entropy(
        kept.logits[:, :-1].reshape(-1, VOCAB).double(), ids[:, 1:].reshape(-1),
        reduction="sum") / 7
    torch.testing.assert_close(fused.loss.double(), summed, rtol=1e-5, atol=1e-6)


def test_the_fused_loss_forward_behaves_as_the_model_s_own():
    """The patched forward keeps the model's signature (transformers' Trainer and generate
    read it), takes labels by position too, leaves a head replaced or re-wrapped after
    the patch to compute its logits, gives a deep copy a forward of its own, and runs
    under torch.compile."""
    model = _tiny("llama")
    ids, attention_mask = _batch()
    signature = inspect.signature(model.forward)
    opforge.patch(model)
    assert inspect.signature(model.forward) == signature
    model.train()
    by_name = model(ids, attention_mask=attention_mask, labels=ids)
    by_position = model(ids, attention_mask, None, None, None, ids)
    assert by_position.logits is None and torch.equal(by_position.loss, by_name.loss)

    copied = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in copied.parameters():
            parameter.zero_()
    copied(ids, labels=ids).loss.backward()
    assert all(p.grad is None for p in model.parameters())
    assert any(p.grad is not None for p in copied.parameters())

    compiled = torch.compile(model, backend="eager")
    torch.testing.assert_close(compiled(ids, attention_mask=attention_mask, labels=ids).loss,
                               by_name.loss)

    def hooked(hidden_states):  # a forward another library installs on the head
        return torch.nn.functional.linear(hidden_states, model.lm_head.weight)

    model.lm_head.forward = hooked
    kept = model(ids, attention_mask=attention_mask, labels=ids)
    assert kept.logits is not None and vars(model.lm_head)["forward"] is hooked
    torch.testing.assert_close(kept.loss, by_name.loss)
    model.lm_head = torch.nn.Linear(64, VOCAB, bias=False)  # a new head: its own logits
    assert model(ids, labels=ids).logits.shape == (*ids.shape, VOCAB)


@pytest.mark.parametrize("kind", ["llama", "gemma3_text"])
def test_a_padded_batch_equals_each_sequence_alone(kind):
    model = _tiny(kind)
    opforge.patch(model)
    ids, attention_mask = _batch()
    with torch.no_grad():
        batched = model(ids, attention_mask=attention_mask).logits
        for row in range(2):
            valid = attention_mask[row].bool()
            alone = model(ids[row:row + 1, valid]).logits
            torch.testing.assert_close(batched[row:row + 1, valid], alone, rtol=2e-5,
                                       atol=2e-5)


def _recorded(monkeypatch: pytest.MonkeyPatch, name: str,
              pick: Callable[[tuple, dict], object]) -> list[object]:
    """``pick(args, kwargs)`` of every call `opforge.hf` makes to its functional ``name``
    (the calls still run)."""
    seen: list[object] = []
    real = getattr(opforge.hf, name)

    def recording(*args: object, **kwargs: object) -> object:
        seen.append(pick(args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(opforge.hf, name, recording)
    return seen


@pytest.mark.parametrize("kind", ["llama", "mistral", "gpt_oss"])
def test_a_packed_batch_runs_varlen_attention_and_equals_each_sequence_alone(kind,
                                                                             monkeypatch):
    """A padding-free batch (sequences of 5, 9 and 3 tokens in one row, positions restarting,
    transformers' flash keywords) takes `opforge.attention_varlen` in every layer (Mistral
    too, its sliding window as long as the longest sequence; gpt-oss with its sinks and a
    window of 4), and each sequence's logits and loss gradients equal those of the
    sequence run alone."""
    model = _tiny(kind, **({"sliding_window": 9} if kind == "mistral" else {})).train()
    opforge.patch(model)
    varlen_calls = _recorded(monkeypatch, "attention_varlen", lambda args, kwargs: args[3])
    lengths = [5, 9, 3]
    ids = torch.randint(0, VOCAB, (1, sum(lengths)), generator=torch.Generator().manual_seed(2))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, 5, 14, 17], dtype=torch.int32)
    packed = model(ids, position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                   max_length_q=9, max_length_k=9)
    assert len(varlen_calls) == 2  # one per layer
    packed.logits.square().sum().backward()
    packed_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    start = 0
    for length in lengths:
        alone = model(ids[:, start:start + length])
        torch.testing.assert_close(packed.logits[:, start:start + length], alone.logits,
                                   rtol=2e-5, atol=2e-5)
        alone.logits.square().sum().backward()
        start += length
    for name, p in model.named_parameters():
        torch.testing.assert_close(packed_grads[name], p.grad, rtol=1e-4, atol=1e-5,
                                   msg=name)


def test_a_packed_batch_longer_than_the_sliding_window_keeps_the_window(monkeypatch):
    """Packed sequences of 5, 9 and 3 tokens under Mistral's window of 4: `attention_varlen`
    runs the window as its band (``window_left`` 3), and each sequence's logits equal
    those of the unpatched model on the sequence alone."""
    model = _tiny("mistral")
    reference = copy.deepcopy(model)
    opforge.patch(model)
    windows = _recorded(monkeypatch, "attention_varlen",
                        lambda args, kwargs: kwargs["window_left"])
    lengths = [5, 9, 3]
    ids = torch.randint(0, VOCAB, (1, sum(lengths)), generator=torch.Generator().manual_seed(3))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, 5, 14, 17], dtype=torch.int32)
    with torch.no_grad():
        packed = model(ids, position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                       max_length_q=9, max_length_k=9).logits
        start = 0
        for length in lengths:
            alone = reference(ids[:, start:start + length]).logits
            torch.testing.assert_close(packed[:, start:start + length], alone, rtol=2e-5,
                                       atol=2e-5)
            start += length
    assert windows == [3, 3]  # one call per layer


def test_a_sliding_window_runs_as_the_band_without_a_mask(monkeypatch):
    """Mistral's window of 4 over 11 unpadded tokens: transformers' mask creation yields
    no ``S x S`` mask, the attention runs causal with ``window_left`` 3, and the logits are
    the unpatched model's; a padded batch keeps transformers' boolean mask (and its
    logits); greedy generation, which decodes one query over the cache, is unchanged;
    under torch.compile the unpadded batch takes the band too (no padding mask to read)."""
    model = _tiny("mistral")
    reference = copy.deepcopy(model)
    opforge.patch(model)
    seen = _recorded(monkeypatch, "attention", lambda args, kwargs: (
        kwargs["attn_mask"] is None, kwargs["window_left"]))
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=2e-5,
                                   atol=2e-5)
        assert seen == [(True, 3), (True, 3)]
        seen.clear()
        padded, attention_mask = _batch()
        valid = attention_mask.bool()
        torch.testing.assert_close(model(padded, attention_mask=attention_mask).logits[valid],
                                   reference(padded, attention_mask=attention_mask
                                             ).logits[valid], rtol=2e-5, atol=2e-5)
        assert seen == [(False, None), (False, None)]
    generate = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(model.generate(ids, **generate), reference.generate(ids, **generate))
    seen.clear()
    with torch.no_grad():
        compiled = torch.compile(lambda ids: model(ids).logits)(ids)
        torch.testing.assert_close(compiled, reference(ids).logits, rtol=2e-5, atol=2e-5)
    assert seen[:2] == [(True, 3), (True, 3)]


def test_the_mask_function_skips_only_a_plain_unpadded_window(monkeypatch):
    """transformers' mask for a sliding window is skipped (None: the attention runs the
    band) only for its plain pattern over unpadded keys with one query or as many queries
    as keys; padding, a chunked pattern, a forbidden skip, a cached multi-token step and
    a padding mask shorter than the keys keep the boolean mask, equal to SDPA's."""
    from types import SimpleNamespace

    from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

    config = SimpleNamespace(sliding_window=4)
    ones = torch.ones(2, 11, dtype=torch.bool)
    padded = ones.clone()
    padded[1, :3] = False
    base = {"batch_size": 2, "q_length": 11, "kv_length": 11, "q_offset": 0,
            "kv_offset": 0, "mask_function": sliding_window_causal_mask_function(4),
            "local_size": 4, "config": config}
    assert opforge.hf._mask(**base) is None
    assert opforge.hf._mask(**base, attention_mask=ones) is None
    assert opforge.hf._mask(**{**base, "q_length": 1, "q_offset": 10}) is None
    for change in ({"attention_mask": padded},
                   {"config": SimpleNamespace(sliding_window=4, attention_chunk_size=4)},
                   {"allow_is_causal_skip": False},
                   {"q_length": 3, "q_offset": 8},
                   {"attention_mask": ones[:, :9]}):
        call = {**base, **change}
        expected = sdpa_mask(**call)
        assert expected is not None
        assert torch.equal(opforge.hf._mask(**call), expected)
    # Compiling: a padding mask's values are not read (the mask stays), no padding mask
    # still gives the band.
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert opforge.hf._mask(**base) is None
    assert torch.equal(opforge.hf._mask(**base, attention_mask=ones),
                       sdpa_mask(**base, attention_mask=ones))


def test_a_packed_batch_in_a_bidirectional_module_under_its_window():
    """A non-causal module's window: sequences no longer than it run unwindowed (it hides
    nothing); a longer one is refused, as opforge's band is causal-side only here."""
    model = _tiny("mistral", sliding_window=9)
    opforge.patch(model)
    attention = model.model.layers[0].self_attn
    generator = torch.Generator().manual_seed(6)
    q, k = torch.randn(1, 4, 14, 16, generator=generator), torch.randn(1, 2, 14, 16,
                                                                          generator=generator)
    cu = torch.tensor([0, 5, 14], dtype=torch.int32)
    out, _ = opforge.hf.attention_forward(attention, q, k, k, None, is_causal=False,
                                          cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    expected = opforge.attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1),
                                        k[0].transpose(0, 1), cu, cu)
    torch.testing.assert_close(out[0], expected)
    with pytest.raises(opforge.hf.PatchError) as raised:
        opforge.hf.attention_forward(attention, q, k, k, None, is_causal=False,
                                     cu_seq_lens_q=cu, cu_seq_lens_k=cu, sliding_window=4)
    assert raised.value.param == "sliding_window"


@pytest.mark.parametrize("kind", ["llama", "gemma3_text", "phi3", "glm", "gpt_oss"])
def test_generation_is_unchanged_and_unpatch_restores_the_model(kind):
    """Greedy generation from a left-padded batch (Gemma 3's sliding windows over the
    cache, Phi-3's partial rotary embedding, GLM's interleaved pairs on part of the head,
    gpt-oss's sinks): the same tokens patched, and after unpatch."""
    model = _tiny(kind)
    ids, attention_mask = _batch()
    generate = {"max_new_tokens": 5, "do_sample": False, "attention_mask": attention_mask,
                "pad_token_id": 0}
    plain = model.generate(ids, **generate)
    implementation = model.config._attn_implementation  # gpt-oss's eager, the others' SDPA
    parameters = {name: p for name, p in model.named_parameters()}
    keys = list(model.state_dict())
    first = opforge.patch(model)
    assert opforge.patch(model) is first  # patching twice changes nothing
    assert torch.equal(model.generate(ids, **generate), plain)
    assert list(model.state_dict()) == keys
    assert dict(model.named_parameters()) == parameters  # the same Parameter objects
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    opforge.unpatch(model)
    assert model.config._attn_implementation == implementation
    assert "forward" not in vars(model.model.norm) and not hasattr(model, "_opforge_patch")
    modeling = inspect.getmodule(type(model))
    assert modeling.apply_rotary_pos_emb.__name__ == "apply_rotary_pos_emb"
    assert torch.equal(model.generate(ids, **generate), plain)


def test_rope_functions_stay_swapped_while_any_model_of_the_type_is_patched():
    from transformers.models.llama import modeling_llama

    first, second = _tiny("llama"), _tiny("llama")
    opforge.patch(first)
    opforge.patch(second)
    opforge.unpatch(first)
    assert modeling_llama.apply_rotary_pos_emb.__name__.startswith("opforge_rope")
    opforge.unpatch(second)
    assert modeling_llama.apply_rotary_pos_emb.__name__ == "apply_rotary_pos_emb"


def test_the_report_names_what_it_left_and_why():
    model = _tiny("qwen3_moe")
    report = opforge.patch(model, loss=False)
    assert "grouped-matmul" in report.left["moe_experts"]
    assert report.left["loss"] == "switched off by the caller"
    assert "loss" not in report.patched and "left moe_experts" in str(report)
    opforge.unpatch(model)


@pytest.mark.parametrize("kind, overrides", [
    ("qwen3_moe", {"norm_topk_prob": True}), ("qwen3_moe", {"norm_topk_prob": False}),
    ("qwen2_moe", {"norm_topk_prob": False}), ("olmoe", {"norm_topk_prob": False}),
    ("mixtral", {}), ("deepseek_v3", {"norm_topk_prob": True}),
    ("deepseek_v3", {"norm_topk_prob": False}), ("deepseek_v3", {"topk_group": 4}),
    ("glm4_moe", {"norm_topk_prob": True}), ("glm4_moe_lite", {"norm_topk_prob": False}),
    ("qwen3_next", {"norm_topk_prob": False}), ("qwen3_5_moe_text", {}), ("gpt_oss", {}),
    ("hunyuan_v1_moe", {}),
])
def test_routers_choose_the_experts_transformers_chooses(kind, overrides):
    """Each router's own rule: the same logits, the same experts (as sets: transformers'
    unsorted top-k orders them otherwise), weights within float32 rounding, int64 indices,
    the weights' dtype; a gradient reaches the router's weight."""
    model = _tiny(kind, **overrides)
    routers = [m for m in model.modules() if type(m).__name__.endswith(("TopKRouter",
                                                                         "TopkRouter", "Gate"))]
    assert routers
    if hasattr(routers[0], "e_score_correction_bias"):
        with torch.no_grad():  # a live correction bias, as a trained model has
            routers[0].e_score_correction_bias.normal_(0, 0.1)
    hidden = torch.randn(13, 64, generator=torch.Generator().manual_seed(5))
    expected = routers[0](hidden)
    opforge.patch(model)
    got = routers[0](hidden)
    torch.testing.assert_close(got[0], expected[0])
    assert got[2].dtype == torch.int64 and got[1].dtype == expected[1].dtype
    order, expected_order = got[2].sort(-1), expected[2].sort(-1)
    assert torch.equal(order.values, expected_order.values)
    torch.testing.assert_close(got[1].gather(1, order.indices),
                               expected[1].gather(1, expected_order.indices),
                               rtol=2e-6, atol=1e-7)
    got[1].sum().backward()
    weight = routers[0].wg.weight if kind == "hunyuan_v1_moe" else routers[0].weight
    assert weight.grad is not None and weight.grad.abs().sum() > 0


def test_unsupported_models_and_attention_features_raise():
    with pytest.raises(opforge.hf.PatchError) as raised:
        opforge.patch(torch.nn.Linear(2, 2))
    assert raised.value.param == "model"
    model = _tiny("llama")
    opforge.patch(model)
    q = torch.randn(1, 4, 3, 16)
    with pytest.raises(opforge.hf.PatchError) as raised:
        opforge.hf.attention_forward(model.model.layers[0].self_attn, q, q, q, None,
                                     dropout=0.1)
    assert raised.value.param == "dropout"
    with pytest.raises(opforge.hf.PatchError) as raised:
        opforge.hf.attention_forward(model.model.layers[0].self_attn, q, q, q, None,
                                     position_bias=q)
    assert raised.value.param == "position_bias"
    opforge.unpatch(model)


def test_a_patched_model_trains():
    """A few AdamW steps on one batch: the loss falls, as it does unpatched."""
    losses = {}
    for patched in (False, True):
        model = _tiny("llama").train()
        if patched:
            opforge.patch(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ids, attention_mask = _batch()
        history = []
        for _ in range(4):
            optimizer.zero_grad()
            loss = model(ids, attention_mask=attention_mask, labels=ids).loss
            loss.backward()
            optimizer.step()
            history.append(loss.item())
        losses[patched] = history
    assert losses[True][-1] < losses[True][0]
    assert losses[True] == pytest.approx(losses[False], rel=1e-3)


@pytest.mark.parametrize("kind", opforge.hf.SUPPORTED_MODEL_TYPES)
def test_every_supported_type_patches_and_keeps_its_logits(kind, calls):
    """Every supported model type (the list itself, so a type cannot be added untested):
    its components patched (Gemma 2's soft-capped attention too; Mistral's sliding
    window over a padded batch reaches opforge's attention as transformers' boolean mask),
    the float32 logits of a left-padded batch as the unpatched model's within float32
    rounding."""
    model = _tiny(kind)
    assert model.config.model_type == kind
    ids, attention_mask = _batch()
    with torch.no_grad():
        expected = model(ids, attention_mask=attention_mask).logits
        report = opforge.patch(model)
        got = model(ids, attention_mask=attention_mask).logits
    kept_router = kind == "ernie4_5_moe"
    full_layers = _full_attention_layers(model)
    assert {"rms_norm", "rope", "loss"} <= set(report.patched)
    assert "attention" in report.patched
    assert ("moe_router" in report.patched) == (kind in ROUTED_KINDS)
    assert ("moe_router" in report.left) == kept_router
    assert ("linear_attention" in report.left) == (full_layers < 2)
    assert calls.get("attention", 0) == full_layers
    assert calls["rope"] == 2 * full_layers
    valid = attention_mask.bool()
    torch.testing.assert_close(got[valid], expected[valid], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", opforge.hf.SUPPORTED_MODEL_TYPES)
def test_every_supported_type_keeps_its_logits_without_padding(kind):
    """Four layers (sliding and full ones alternate in the models that have both) over an
    unpadded batch longer than any window, which transformers gives no mask where the
    causal rule suffices: each layer's window or none reaches opforge's attention as the
    kernels' band (EXAONE 4's full-attention layer passes no window while its module holds
    the model's); the logits as the unpatched model's within float32 rounding."""
    model = _tiny(kind, num_hidden_layers=4)
    ids = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(ids).logits
        opforge.patch(model)
        got = model(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_soft_capped_gemma2_takes_opforge_attention_and_keeps_its_head(calls):
    """Gemma 2 soft-caps its attention scores and its logits: attention runs opforge's
    with the cap (a small one here, 2, so that it bends the scores), the fused loss is left
    with the reason, the norms (1 + weight) and rotary functions are opforge's, and a
    training step's loss and gradients equal the unpatched model's within float32
    rounding (no label predicted from a padding position: a query that sees no key gets 0
    from opforge's attention and the mean of the values from Gemma 2's eager one)."""
    model = _tiny("gemma2", attn_logit_softcapping=2.0)
    ids, attention_mask = _batch()
    # Label t is predicted at position t - 1: the first token after the padding too.
    labels = ids.masked_fill(attention_mask.roll(1, -1) == 0, -100)
    plain, plain_grads = _training_step(model, ids, attention_mask, labels)
    report = opforge.patch(model)
    patched, patched_grads = _training_step(model, ids, attention_mask, labels)
    assert "soft-capped" in report.left["fused_loss"] and "attention" in report.patched
    assert {"rms_norm", "rope", "loss"} <= set(report.patched) and calls["attention"] == 2
    assert calls["rms_norm"] == 9 and calls["rope"] == 4 and calls["cross_entropy"] == 1
    assert calls["gelu_tanh_mul"] == 2 and len(report.patched["geglu_mlp"]) == 2
    torch.testing.assert_close(patched.loss, plain.loss, rtol=1e-6, atol=1e-6)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(patched_grads[name], grad, rtol=1e-4, atol=1e-6)


def _with_images(kind: str) -> dict[str, torch.Tensor]:
    """A prompt with images for a tiny vision-language model of ``kind``: Qwen3-VL's two
    images of 4 x 4 and 2 x 4 patches (4 and 2 tokens after the 2 x 2 merge), Gemma 3's
    one 16 x 16 image of 4 tokens."""
    generator = torch.Generator().manual_seed(6)
    if kind == "qwen3_vl":
        start, end = IMAGE_TOKEN + 2, IMAGE_TOKEN + 3
        ids = torch.tensor([[5, 6, start, *[IMAGE_TOKEN] * 4, end, 7, 8, start,
                             *[IMAGE_TOKEN] * 2, end, 9, 10, 11]])
        grid = torch.tensor([[1, 4, 4], [1, 2, 4]])
        return {"input_ids": ids, "image_grid_thw": grid,
                "pixel_values": torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 4 * 4,
                                            generator=generator),
                "mm_token_type_ids": (ids == IMAGE_TOKEN).int()}
    ids = torch.tensor([[2, 5, 6, IMAGE_TOKEN + 1, *[IMAGE_TOKEN] * 4, IMAGE_TOKEN + 2, 7, 8,
                         9, 10]])
    return {"input_ids": ids, "pixel_values": torch.randn(1, 3, 16, 16, generator=generator),
            "token_type_ids": (ids == IMAGE_TOKEN).long()}


@pytest.mark.parametrize("kind", VISION_KINDS)
def test_a_vision_language_model_runs_its_images_through_opforge(kind, calls):
    """Qwen3-VL and Gemma 3 with images: the vision tower's attention (bidirectional, one
    image at a time) runs opforge's too, the logits are the unpatched model's within
    float32 rounding, and a training step with labels (the image tokens ignored) takes the
    fused loss with the unpatched loss and gradients."""
    model = _tiny(kind)
    inputs = _with_images(kind)
    with torch.no_grad():
        expected = model(**inputs).logits
    labels = inputs["input_ids"].masked_fill(inputs["input_ids"] >= IMAGE_TOKEN, -100)
    model.train().zero_grad()
    plain = model(**inputs, labels=labels)
    plain.loss.backward()
    plain_grads = {name: p.grad.clone() for name, p in model.named_parameters()
                   if p.grad is not None}
    report = opforge.patch(model)
    assert {"rms_norm", "attention", "rope", "fused_loss"} <= set(report.patched)
    with torch.no_grad():
        got = model.eval()(**inputs).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    text_layers = _full_attention_layers(model)
    assert calls["attention"] > text_layers  # the vision tower's layers too
    model.train().zero_grad()
    fused = model(**inputs, labels=labels)
    fused.loss.backward()
    assert fused.logits is None and calls["fused_linear_cross_entropy"] == 1
    torch.testing.assert_close(fused.loss, plain.loss, rtol=1e-6, atol=1e-6)
    assert plain_grads.keys() == {name for name, p in model.named_parameters()
                                  if p.grad is not None}
    for name, grad in plain_grads.items():
        torch.testing.assert_close(model.get_parameter(name).grad, grad, rtol=1e-4,
                                   atol=1e-6, msg=name)


@pytest.mark.parametrize("kind", ["llama", "olmo2", "gemma3_text", "helium", "qwen3_5_text"])
def test_each_rms_norm_keeps_its_models_output_dtype_under_a_float32_weight(kind):
    """A bf16 input with a float32 weight (norms kept in float32 in a bf16 model): each
    model's norm returns the dtype its own module returns (Llama's the promoted float32,
    OLMo 2's, Helium's, Gemma's and Qwen3.5's the input's bf16), within a bf16 rounding of
    it."""
    model = _tiny(kind)
    norm = model.model.norm.float()
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    expected = norm(x)
    opforge.patch(model)
    got = norm(x)
    assert got.dtype == expected.dtype
    torch.testing.assert_close(got.float(), expected.float(), rtol=8e-3, atol=1e-5)


def test_dropout_is_kept_where_the_model_has_it():
    """Seed-OSS as its config comes (attention and residual dropout 0.1): attention is
    left to transformers with the reason, and the MLP's output still goes through its
    dropout in training: a step's loss and gradients equal the unpatched model's under
    the same random seed."""
    model = _tiny("seed_oss", attention_dropout=0.1).train()
    ids, attention_mask = _batch()
    torch.manual_seed(5)
    plain, plain_grads = _training_step(model, ids, attention_mask)
    report = opforge.patch(model, fused_loss=False)
    torch.manual_seed(5)
    patched, patched_grads = _training_step(model, ids, attention_mask)
    assert "attention_dropout" in report.left["attention"] and "swiglu_mlp" in report.patched
    torch.testing.assert_close(patched.loss, plain.loss, rtol=1e-6, atol=1e-6)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(patched_grads[name], grad, rtol=1e-4, atol=1e-6)


def test_a_peft_model_is_patched_with_its_adapters_in_place(calls):
    """LoRA adapters on every projection (PEFT): patch and unpatch take the PEFT model, the
    MLPs' gate step is opforge's with the adapters still in the projections it calls, and
    a training step's loss and adapter gradients equal the unpatched model's."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_tiny("llama"), peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj"]))
    ids, attention_mask = _batch()
    plain, plain_grads = _training_step(model, ids, attention_mask)
    report = opforge.patch(model)
    patched, patched_grads = _training_step(model, ids, attention_mask)
    assert len(report.patched["swiglu_mlp"]) == 2 and calls["silu_mul"] == 2
    assert "fused_loss" in report.patched and patched.logits is None
    assert patched_grads.keys() == plain_grads.keys()
    assert plain_grads and all("lora_" in name for name in plain_grads)
    torch.testing.assert_close(patched.loss, plain.loss, rtol=1e-5, atol=1e-6)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(patched_grads[name], grad, rtol=1e-4, atol=1e-6)
    opforge.unpatch(model)
    assert not hasattr(model.get_base_model(), "_opforge_patch")


def test_an_mlp_of_another_gate_is_left_with_its_activation_named():
    """A Llama MLP gated by GELU's erf form (``hidden_act="gelu"``), which opforge has no
    fused gate for: left as transformers computes it, the report naming the activation,
    and the logits as before."""
    model = _tiny("llama", hidden_act="gelu")
    ids, attention_mask = _batch()
    with torch.no_grad():
        expected = model(ids, attention_mask=attention_mask).logits
        report = opforge.patch(model)
        got = model(ids, attention_mask=attention_mask).logits
    assert "swiglu_mlp" not in report.patched and "GELUActivation" in report.left["mlp"]
    valid = attention_mask.bool()
    torch.testing.assert_close(got[valid], expected[valid], rtol=1e-5, atol=1e-5)


def test_a_partial_rotary_embedding_rotates_the_leading_dims_only():
    """Phi-3's rotary function with cos and sin over half the head dims: opforge's rotates
    those dims as transformers' does and passes the rest through bit for bit."""
    model = _tiny("phi3")
    from transformers.models.phi3 import modeling_phi3

    own = modeling_phi3.apply_rotary_pos_emb
    generator = torch.Generator().manual_seed(3)
    q, k = (torch.randn(2, 4, 5, 16, generator=generator) for _ in range(2))
    angles = torch.randn(2, 5, 4, generator=generator)
    cos, sin = (torch.cat([f(angles)] * 2, -1) for f in (torch.cos, torch.sin))
    expected = own(q, k, cos, sin)
    opforge.patch(model)
    got = modeling_phi3.apply_rotary_pos_emb(q, k, cos, sin)
    for g, e, t in zip(got, expected, (q, k), strict=True):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)
        assert torch.equal(g[..., 8:], t[..., 8:])


@pytest.mark.parametrize("kind", ["gemma3_text", "phi3", "gpt_oss"])
def test_the_example_patches_compares_and_trains(kind, monkeypatch, capsys):
    """examples/hf_patch.py on a model type: the patched logits within 2x the unpatched
    model's error against float64, the packed batch equal to the padded one, the two
    trainings' losses alike, no monitor alert."""
    example = Path(__file__).resolve().parent.parent / "examples" / "hf_patch.py"
    monkeypatch.setattr("sys.argv", [str(example), "--model", kind, "--steps", "2"])
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(example), run_name="__main__")
    assert exited.value.code == 0
    out = capsys.readouterr().out
    patched, plain = (float(v) for v in re.findall(r"vs float64 (\S+)", out))
    assert patched <= 2 * plain
    assert float(re.search(r"padded batch's\| (\S+)", out).group(1)) < 1e-5
    losses = [[float(v) for v in line.split(":")[1].split()]
              for line in out.splitlines() if line.startswith("losses")]
    assert losses[0] == pytest.approx(losses[1], rel=1e-4)
    assert ", 0 alerts" in out
