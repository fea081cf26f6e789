"""How attention's error grows with sequence length: opforge, torch SDPA and the naive
formula against a float64 golden.

For each sequence length ``S`` and low-precision dtype, the same random ``q, k, v``
(``(B, H, S, D)``, standard normal, ``q`` times ``query_scale`` to sharpen the softmax) go
through

- ``opforge``: `opforge.attention` (the Triton kernel: online softmax in float32, P rounded
  to the dtype for ``P @ V``);
- ``torch SDPA``: ``torch.nn.functional.scaled_dot_product_attention`` in the dtype
  (whatever backend torch picks on the device);
- ``naive``: ``softmax(q k^T scale) v`` with every intermediate a tensor of the dtype (the
  scores and probabilities rounded to it, as an unfused implementation stores them).

Each output is compared with attention computed in float64 (in query chunks, so the
golden never holds more than ``chunk x S`` scores): the relative RMS error
``||out - golden|| / ||golden||`` and the largest error relative to the largest
``|golden|``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

IMPLEMENTATIONS = ("opforge", "torch SDPA", "naive")
GOLDEN_CHUNK = 1024


@dataclass(frozen=True)
class StudyRow:
    """One implementation at one length and dtype."""

    dtype: str
    seq_len: int
    impl: str
    rel_rms: float
    max_rel: float


def golden_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                     chunk: int = GOLDEN_CHUNK) -> torch.Tensor:
    """Attention in float64 on q's device, ``chunk`` queries at a time (same lengths and
    heads for q, k and v; bottom-right causal mask equals top-left here)."""
    q, k, v = (t.to(torch.float64) for t in (q, k, v))
    scale = q.shape[-1] ** -0.5
    parts = []
    for start in range(0, q.shape[2], chunk):
        scores = torch.matmul(q[:, :, start:start + chunk], k.transpose(-1, -2)) * scale
        if causal:
            rows = torch.arange(start, start + scores.shape[2], device=q.device)[:, None]
            cols = torch.arange(k.shape[2], device=q.device)[None, :]
            scores = scores.masked_fill(cols > rows, -math.inf)
        parts.append(torch.matmul(torch.softmax(scores, -1), v))
    return torch.cat(parts, 2)


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
                    ) -> torch.Tensor:
    """``softmax(q k^T / sqrt(D)) v`` with the scores and probabilities stored in q's
    dtype."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, -math.inf)
    return torch.matmul(torch.softmax(scores, -1), v)


def _opforge_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
                       ) -> torch.Tensor:
    """The Triton kernel (under the interpreter on a CPU), never the torch backend."""
    import opforge

    with opforge.use_backend("triton"):
        return opforge.attention(q, k, v, causal=causal)


def _implementations(causal: bool) -> dict[str, Callable[..., torch.Tensor]]:
    return {
        "opforge": lambda q, k, v: _opforge_attention(q, k, v, causal),
        "torch SDPA": lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=causal),
        "naive": lambda q, k, v: naive_attention(q, k, v, causal),
    }


def attention_error_growth(seq_lens: Sequence[int],
                           dtypes: Sequence[torch.dtype] = (torch.float16, torch.bfloat16),
                           device: torch.device | str = "cpu", batch: int = 1,
                           heads: int = 2, head_dim: int = 64, causal: bool = False,
                           query_scale: float = 1.0, seed: int = 0,
                           progress: Callable[[StudyRow], None] | None = None
                           ) -> list[StudyRow]:
    """Measure every implementation at every length and dtype (see the module
    docstring). The inputs of one length are drawn once in float32 from ``seed`` and
    rounded to each dtype, so the dtypes see the same values."""
    device = torch.device(device)
    implementations = _implementations(causal)
    rows = []
    for seq_len in seq_lens:
        generator = torch.Generator().manual_seed(seed + seq_len)
        shape = (batch, heads, seq_len, head_dim)
        base = [torch.randn(shape, generator=generator) for _ in range(3)]
        base[0] = base[0] * query_scale
        for dtype in dtypes:
            q, k, v = (t.to(device, dtype) for t in base)
            golden = golden_attention(q, k, v, causal)
            norm = golden.norm().item()
            peak = golden.abs().max().item()
            for impl, function in implementations.items():
                with torch.no_grad():
                    error = (function(q, k, v).to(torch.float64) - golden)
                row = StudyRow(str(dtype).removeprefix("torch."), seq_len, impl,
                               error.norm().item() / norm, error.abs().max().item() / peak)
                rows.append(row)
                if progress is not None:
                    progress(row)
            del golden
    return rows


def growth(rows: Sequence[StudyRow], impl: str, dtype: str) -> float:
    """Relative RMS error at the longest length over that at the shortest."""
    mine = sorted((r for r in rows if r.impl == impl and r.dtype == dtype),
                  key=lambda r: r.seq_len)
    return mine[-1].rel_rms / mine[0].rel_rms
