"""A tiny character-level mixture-of-experts language model built from opforge operators.

Each piece of the model is an opforge operator or module:

==================  ===========================================================================
token embedding     `opforge.nn.Embedding` (its backward is `opforge.embedding_dense_grad`)
pre-attention norm  `opforge.nn.RMSNorm`
attention           `opforge.nn.Linear` projections (`opforge.matmul`), `opforge.rope` on q
                    and k, causal `opforge.attention` (flash, bottom-right aligned)
residual + norm     `opforge.add_rms_norm` (the residual add and the RMSNorm in one read)
feed-forward        a mixture of experts: `opforge.moe.MoEGate` (router + `moe_gating_top_k`,
                    DeepSeek-V3's auxiliary-loss-free bias update), `dispatch`/`combine`,
                    experts ``gelu(x W_in) W_out`` with `opforge.matmul` and `opforge.gelu`
output              `opforge.nn.RMSNorm`, an `opforge.nn.Linear` head, softmax cross-entropy
                    with `opforge.log_softmax`
==================  ===========================================================================

``naive_softmax=True`` replaces the model's softmaxes (attention's and the loss's, not the
router's) by the textbook ``exp(x) / sum(exp(x))`` computed in the activations' dtype, with
no max subtracted: the precision study's foil.

The experts are slices of two stacked weights rather than submodules, so that every run of
the model has the same modules with the same shapes (a dump of two runs lines up even when
their routing differs).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

import opforge
from opforge import nn
from opforge.moe import MoEGate, combine, dispatch
from opforge.ops.rope import rope_tables

TEXT = Path(__file__).with_name("genesis.txt")


class CharData:
    """The text as character ids, split 90/10 into training and validation data.

    Args:
        path: a UTF-8 text file. seq: the training context length.
    """

    def __init__(self, path: Path = TEXT, seq: int = 64) -> None:
        text = Path(path).read_text(encoding="utf-8")
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}
        ids = torch.tensor([self.index[c] for c in text], dtype=torch.long)
        cut = int(0.9 * len(ids))
        self.splits = {"train": ids[:cut], "val": ids[cut:]}
        self.seq = seq

    @property
    def vocab(self) -> int:
        return len(self.chars)

    def batch(self, size: int, generator: torch.Generator, split: str = "train",
              device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)``: ``size`` random windows of ``seq`` ids, targets shifted
        by one, int64 ``(size, seq)``."""
        ids = self.splits[split]
        starts = torch.randint(0, len(ids) - self.seq - 1, (size,), generator=generator)
        windows = torch.stack([ids[s:s + self.seq + 1] for s in starts.tolist()])
        return windows[:, :-1].to(device), windows[:, 1:].to(device)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.index[c] for c in text if c in self.index], dtype=torch.long)

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(self.chars[i] for i in ids.tolist())


def naive_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``exp(x) / sum(exp(x))`` in x's dtype: overflows once x passes log(max) (11.1 in
    float16, 88.7 in float32 and bfloat16)."""
    e = torch.exp(x)
    return e / e.sum(dim, keepdim=True)


class Attention(torch.nn.Module):
    """Causal multi-head self-attention with rotary position embeddings."""

    def __init__(self, dim: int, heads: int, max_seq: int, naive: bool) -> None:
        super().__init__()
        if heads < 1 or dim % heads:
            raise ValueError(f"dim {dim} must split into {heads} heads of equal width")
        self.heads, self.naive = heads, naive
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        cos, sin = rope_tables(torch.arange(max_seq), dim // heads, "half")
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = (t.reshape(batch, seq, self.heads, dim // self.heads).transpose(1, 2)
                   .contiguous() for t in self.qkv(x).chunk(3, dim=-1))
        cos, sin = self.cos[:seq].to(q.dtype), self.sin[:seq].to(q.dtype)
        q, k = opforge.rope(q, cos, sin), opforge.rope(k, cos, sin)
        if self.naive:
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
            future = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
            out = naive_softmax(scores.masked_fill(future, float("-inf"))) @ v
        else:
            out = opforge.attention(q, k, v, causal=True)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, dim))


class MixtureOfExperts(torch.nn.Module):
    """``k`` of ``experts`` GELU feed-forward experts per token, chosen by a router whose
    selection bias is nudged towards balance after each training step."""

    def __init__(self, dim: int, hidden: int, experts: int, k: int,
                 bias_update_rate: float) -> None:
        super().__init__()
        self.experts = experts
        self.gate = MoEGate(dim, experts, k, bias_update_rate=bias_update_rate)
        self.w_in = torch.nn.Parameter(torch.randn(experts, dim, hidden) / math.sqrt(dim))
        self.w_out = torch.nn.Parameter(torch.randn(experts, hidden, dim) / math.sqrt(hidden))
        self.load = torch.zeros(experts, dtype=torch.long)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        weights, chosen, stats = self.gate(tokens)
        self.load = stats.load
        routed = dispatch(tokens, chosen, self.experts)
        outputs = [opforge.matmul(opforge.gelu(opforge.matmul(chunk, self.w_in[e])),
                                  self.w_out[e]) for e, chunk in enumerate(routed.split())]
        return combine(torch.cat(outputs), routed, weights).reshape(x.shape)


class Block(torch.nn.Module):
    """Pre-norm decoder block: attention, then the fused residual add + RMSNorm, then the
    mixture of experts."""

    def __init__(self, dim: int, heads: int, max_seq: int, hidden: int, experts: int, k: int,
                 naive: bool, bias_update_rate: float) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(dim)
        self.attn = Attention(dim, heads, max_seq, naive)
        self.moe_norm_weight = torch.nn.Parameter(torch.ones(dim))
        self.moe = MixtureOfExperts(dim, hidden, experts, k, bias_update_rate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed, residual = opforge.add_rms_norm(self.attn(self.attn_norm(x)), x,
                                                self.moe_norm_weight)
        return residual + self.moe(normed)


class TinyMoELM(torch.nn.Module):
    """A decoder-only character model.

    Args:
        vocab: characters. dim: width. layers: blocks. heads: attention heads.
        max_seq: longest context. hidden: expert width. experts, k: experts, and experts
        per token. naive_softmax: see the module docstring. bias_update_rate: the router's
        balancing step.
    """

    def __init__(self, vocab: int, dim: int = 128, layers: int = 2, heads: int = 4,
                 max_seq: int = 64, hidden: int = 256, experts: int = 4, k: int = 2,
                 naive_softmax: bool = False, bias_update_rate: float = 1e-3) -> None:
        super().__init__()
        self.naive = naive_softmax
        self.max_seq = max_seq
        self.embed = nn.Embedding(vocab, dim)
        with torch.no_grad():
            self.embed.weight.mul_(0.1)
        self.blocks = torch.nn.ModuleList(
            Block(dim, heads, max_seq, hidden, experts, k, naive_softmax, bias_update_rate)
            for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``(B, S, vocab)`` for int64 ``tokens`` ``(B, S)``."""
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean softmax cross-entropy of ``logits`` against ``targets`` (float32)."""
        flat = logits.reshape(-1, logits.shape[-1])
        if self.naive:
            log_probs = torch.log(naive_softmax(flat))
        else:
            log_probs = opforge.log_softmax(flat, dim=-1)
        return -log_probs.gather(1, targets.reshape(-1, 1)).float().mean()

    def expert_load(self) -> list[list[int]]:
        """Tokens routed to each expert in the last forward pass, per block."""
        return [block.moe.load.tolist() for block in self.blocks]

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, length: int, generator: torch.Generator,
                 temperature: float = 0.8) -> torch.Tensor:
        """``prompt`` (1-D ids) followed by ``length`` sampled ids."""
        ids = prompt.clone()
        for _ in range(length):
            logits = self(ids[-self.max_seq:][None])[0, -1].float() / temperature
            probs = opforge.softmax(logits, dim=-1)
            ids = torch.cat([ids, torch.multinomial(probs.cpu(), 1, generator=generator)
                             .to(ids.device)])
        return ids
