"""Train one pre-norm transformer block built from opforge operators, on random data.

    python examples/transformer_block.py [--steps 5] [--seq 128] [--dim 256] [--device cuda]
    opforge profile -- python examples/transformer_block.py      # the same, profiled

The block is RMSNorm → attention (q, k, v projections, rotary embedding, causal flash
attention) → residual → RMSNorm → GELU MLP → residual, every piece an opforge operator
(`opforge.nn.Linear` runs `opforge.matmul`). Each step regresses the block's output on a
fixed random target and takes an SGD step; the loss printed each step falls.
"""

from __future__ import annotations

import argparse

import torch

import opforge
from opforge import nn
from opforge.ops.rope import rope_tables


class Block(torch.nn.Module):
    """A pre-norm decoder block with ``heads`` attention heads over ``dim`` features."""

    def __init__(self, dim: int, heads: int, seq: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.act = nn.GELU()
        cos, sin = rope_tables(torch.arange(seq), dim // heads, "half")
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = (t.reshape(batch, seq, self.heads, dim // self.heads).transpose(1, 2)
                   for t in self.qkv(self.norm1(x)).chunk(3, dim=-1))
        q, k = (opforge.rope(t.contiguous(), self.cos, self.sin) for t in (q, k))
        mixed = opforge.attention(q, k, v.contiguous(), causal=True)
        x = x + self.proj(mixed.transpose(1, 2).reshape(batch, seq, dim))
        return x + self.down(self.act(self.up(self.norm2(x))))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    block = Block(args.dim, args.heads, args.seq).to(args.device, dtype)
    x, target = (torch.randn(args.batch, args.seq, args.dim, generator=generator)
                 .to(args.device, dtype) for _ in range(2))
    optimizer = torch.optim.SGD(block.parameters(), lr=0.05)
    for step in range(args.steps):
        loss = (block(x) - target).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"step {step}: loss {loss.item():.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
