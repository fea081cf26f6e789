"""Patch a tiny random Hugging Face model with one call, train it a few steps, and compare.

    python examples/hf_patch.py [--model llama|qwen3_moe|gemma3_text|phi3|glm4_moe|gpt_oss]
                                [--steps 5]
        [--dtype bfloat16]

Builds the model from its config (no hub access), keeps a float64 copy and an unpatched
copy, then `opforge.patch`es the model and prints: what was patched and left, the
logits' error of the patched and the unpatched model against the float64 copy on a
left-padded batch, the same sequences packed without padding in one row (by
`opforge.attention_varlen`), the losses of a few AdamW steps of both (the patched model's
from its last hidden states by the fused linear cross-entropy: no logits made), and the
alerts of `opforge.precision.Monitor` watching the patched model. ``TRITON_INTERPRET=1``
runs the Triton kernels on a CPU.
"""

from __future__ import annotations

import argparse
import copy

import torch
import transformers

import opforge
from opforge.precision import Monitor

# Each kind's config beside the common sizes: a tied head (Llama), experts (Qwen3-MoE),
# Gemma 3's 1 + weight norms, GeGLU and alternating sliding windows, Phi-3's fused
# projections and a rotary embedding over half of each head, GLM-4-MoE's sigmoid router
# over groups of experts, gpt-oss's attention sinks and biased router.
CONFIGS = {
    "llama": lambda common: transformers.LlamaConfig(**common, tie_word_embeddings=True),
    "qwen3_moe": lambda common: transformers.Qwen3MoeConfig(
        **common, head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64),
    "gemma3_text": lambda common: transformers.Gemma3TextConfig(**common, head_dim=32,
                                                                sliding_window=8),
    "phi3": lambda common: transformers.Phi3Config(**common, partial_rotary_factor=0.5,
                                                   pad_token_id=0),
    "glm4_moe": lambda common: transformers.Glm4MoeConfig(
        **common, head_dim=32, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
        topk_group=2, moe_intermediate_size=64, use_qk_norm=True),
    "gpt_oss": lambda common: transformers.GptOssConfig(
        **common, head_dim=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        pad_token_id=0),
}


def tiny_model(kind: str) -> torch.nn.Module:
    common = {"vocab_size": 257, "hidden_size": 128, "intermediate_size": 256,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    return transformers.AutoModelForCausalLM.from_config(CONFIGS[kind](common))


def relative_error(value: torch.Tensor, golden: torch.Tensor) -> float:
    difference = (value.double() - golden)
    return float(difference.norm() / golden.norm())


def train(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, steps: int
          ) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=tuple(CONFIGS), default="llama")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = tiny_model(args.model).to(getattr(torch, args.dtype))
    golden = copy.deepcopy(model).double()
    golden.set_experts_implementation("eager")  # float64 experts on a CPU
    plain = copy.deepcopy(model)

    print(opforge.patch(model))
    ids = torch.randint(0, 257, (4, 32))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0  # left padding, as generation pads
    mask[3, :30] = 0
    with torch.no_grad():
        reference = golden(ids, attention_mask=mask).logits
        valid = mask.bool()
        for name, candidate in (("opforge-patched", model), ("unpatched", plain)):
            logits = candidate(ids, attention_mask=mask).logits
            print(f"{name:>16}: logits relative error vs float64 "
                  f"{relative_error(logits[valid], reference[valid]):.2e}")
        # The same sequences without padding, packed in one row as transformers'
        # flattening collator passes them: opforge.attention_varlen keeps each to itself.
        lengths = mask.sum(1).tolist()
        ends = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
        packed = model(ids[valid][None],
                       position_ids=torch.cat([torch.arange(n) for n in lengths])[None],
                       cu_seq_lens_q=ends, cu_seq_lens_k=ends, max_length_q=max(lengths),
                       max_length_k=max(lengths)).logits[0]
        padded = model(ids, attention_mask=mask).logits[valid]
        print(f"padding-free batch ({len(lengths)} sequences, {sum(lengths)} tokens in one "
              f"row): max |logits - the padded batch's| {(packed - padded).abs().max():.2e}")

    with Monitor(model) as monitor:
        patched_losses = []
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for _ in range(args.steps):
            optimizer.zero_grad()
            loss = model(ids, attention_mask=mask, labels=ids).loss
            loss.backward()
            monitor.step()
            optimizer.step()
            patched_losses.append(loss.item())
    plain_losses = train(plain, ids, mask, args.steps)
    print("losses, patched:  ", " ".join(f"{x:.4f}" for x in patched_losses))
    print("losses, unpatched:", " ".join(f"{x:.4f}" for x in plain_losses))
    print(f"monitor: {monitor.steps} steps, {len(monitor.alerts)} alerts"
          + "".join(f"\n  {alert}" for alert in monitor.alerts[:5]))
    opforge.unpatch(model)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
