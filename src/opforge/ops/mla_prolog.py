"""MlaProlog: the query and latent-KV preprocessing of DeepSeek's multi-head latent
attention, with the semantics of ``torch_npu.npu_mla_prolog`` (V1). Forward only: an
inference operator, with no gradient.

With ``T`` tokens (``token_x`` ``(B, S, He)`` or ``(T, He)``), ``N`` heads, nope dim ``D``,
rope dim ``Dr``, latent ``Hckv`` and ``[r]`` a rounding to the input dtype (CANN's rounding
points; float32 inputs are never rounded to bf16)::

    x          = token_x.reshape(T, He)
    cq         = [r](x @ weight_dq)                                         (T, Hcq)
    cq         = [r](cq / sqrt(mean(cq^2) + eps_cq) * gamma_cq)
    qq         = [r](cq @ weight_uq_qr).view(T, N, D + Dr)   per head [D nope | Dr rope]
    query      = [r](einsum("tnd,ndc->tnc", qq[..., :D], weight_uk))     (T, N, Hckv)
    query_rope = [r](rope(qq[..., D:], cos, sin, "interleave_half"))      (T, N, Dr)
    kv         = x @ weight_dkv_kr                                 float32, (T, Hckv + Dr)
    ckv        = kv[:, :Hckv] / sqrt(mean(kv[:, :Hckv]^2) + eps_ckv) * gamma_ckv
    kr         = rope(kv[:, Hckv:], cos, sin, "interleave_half")
    kv_cache[slot t] = [r] ckv[t];  kr_cache[slot t] = [r] kr[t]   for cache_index[t] >= 0

The caches ``(BlockNum, BlockSize, 1, Hckv)`` and ``(BlockNum, BlockSize, 1, Dr)`` are
updated in place: token ``t`` goes to slot ``cache_index[t]`` (block ``slot // BlockSize``,
row ``slot % BlockSize``); a negative index skips the token. ``cache_mode="PA_BSND"``
stores each block row-major; ``"PA_NZ"`` stores each block in the NZ layout of the Ascend
cube unit, ``(width / c0, BlockSize, c0)`` with ``c0 = 32 bytes / itemsize``, in the same
tensor (`nz_view` shows it). Duplicate non-negative indices leave one of the tokens' rows,
unspecified which (as on Ascend).

Triton backend: the down-projection runs through opforge's matmul. For a decode step (up
to `FUSED_QUERY_TOKENS` tokens) the rest of the query path is one kernel per (block of
tokens, head): the RMSNorm of ``cq``, the head's up-projection columns, its RoPE and its
absorbed product, so a decode step launches three kernels fewer and keeps no ``qq`` in
memory; past that size it runs through opforge's rms_norm, matmul and rope, whose large
tiles suit the larger products. Both round at CANN's points. The KV path is one fused
kernel per block of tokens that computes the ``kv`` projection in float32, never stores
it, and applies the RMSNorm, the interleave-half RoPE (the rope columns of the weight
are read in rotated order, so each output element finds its partner in a second
accumulator) and the scatter into both caches. A decode step's few tokens make one or
two such blocks, each reading all of ``weight_dkv_kr``: He is then cut into slices, each
a program writing the float32 partial sums of its slice, and a merge kernel adds them in
slice order before the norm, rope and scatter (still no rounding of ``kv``). The torch
backend computes the same formula at float32 and writes only the indexed cache rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from opforge.core import backends
from opforge.core.errors import DtypeError, IndexRangeError, OpError, ShapeError
from opforge.core.hardware import HardwareProfile
from opforge.core.opdef import (
    Attr,
    Attrs,
    Case,
    Cost,
    KnownLimitation,
    OpDef,
    OutputArg,
    PrecisionSpec,
    Specs,
    TensorArg,
    Tiling,
)
from opforge.core.shapes import is_unknown_rank
from opforge.core.tiling import (
    MAX_PROGRAMS,
    cdiv,
    gpu_warps,
    launch_options,
    next_power_of_2,
    split_steps,
    wide_offsets,
    work_splits,
)
from opforge.library import register_op
from opforge.ops.rope import reference as rope_reference
from opforge.ops.rope import rope_tables
from opforge.precision.cases import LONG_ROW, generate

try:
    import triton
    import triton.language as tl

    from opforge.ops._math import as_dot_operand, dot_operand, rounded_for, widen
    from opforge.ops.rope import rope_indices
except ImportError:  # pragma: no cover
    triton = None

NAME = "mla_prolog"
CACHE_MODES = ("PA_BSND", "PA_NZ")
NZ_BYTES = 32
MERGE_ROWS = 1  # tokens a program of the KV merge kernel takes: one, for the most programs
# Tokens up to which the query path after the down-projection is one kernel (variant
# fused_kv_query): a decode step, bound by launches and host time. Its programs hold all
# the tokens, so the up-projection's weight is read once.
FUSED_QUERY_TOKENS = 64
# Taller token blocks of the fused KV kernel that autotuning times in a prefill on CUDA,
# after the 16-token default: (BLOCK_T, BLOCK_K, warps). Every token block reads all of
# weight_dkv_kr, so 64 tokens read it a quarter as often as 16 and give the tensor cores
# taller tiles. Compiled for sm_90 (DeepSeek sizes, bf16), 8 warps hold these blocks'
# accumulators in 199-255 registers a thread with at most 8 B of spill, where 32 warps
# (64 registers a thread) spill 32-272 B and BLOCK_K 64 spills 192-208 B at 8 warps.
PREFILL_ALTERNATIVES = ((64, 32, 8), (64, 16, 8), (32, 32, 8), (32, 16, 8))
INDEX_DTYPES = (torch.int64, torch.int32)
EPS_RANGE = (0.0, None)
INPUT_NAMES = ("token_x", "weight_dq", "weight_uq_qr", "weight_uk", "weight_dkv_kr",
               "rmsnorm_gamma_cq", "rmsnorm_gamma_ckv", "rope_sin", "rope_cos")


def _sizes(inputs: Specs, attrs: Attrs) -> dict[str, object]:
    """Every size of a call, checked for consistency.

    Raises:
        ShapeError: naming the tensor whose shape disagrees with the others.
    """
    (x, w_dq, w_uq_qr, w_uk, w_dkv_kr, gamma_cq, gamma_ckv, sin, cos, index, kv_cache,
     kr_cache) = inputs

    def need(ok: bool, param: str, expected: object, got: object, what: str) -> None:
        if not ok:
            raise ShapeError(what, op=NAME, param=param, expected=expected, got=got)

    need(len(x.shape) in (2, 3), "token_x", "(B, S, He) or (T, He)", tuple(x.shape),
         "must be 2-D or 3-D")
    tokens, he = tuple(x.shape[:-1]), x.shape[-1]
    need(len(w_dq.shape) == 2 and w_dq.shape[0] == he, "weight_dq", f"({he}, Hcq)",
         tuple(w_dq.shape), "must be (He, Hcq)")
    hcq = w_dq.shape[1]
    need(len(w_uk.shape) == 3, "weight_uk", "(N, D, Hckv)", tuple(w_uk.shape),
         "must be 3-D")
    n, d, hckv = w_uk.shape
    need(len(sin.shape) == len(tokens) + 1 and tuple(sin.shape[:-1]) == tokens, "rope_sin",
         (*tokens, "Dr"), tuple(sin.shape), "must be (*tokens, Dr)")
    dr = sin.shape[-1]
    need(dr % 2 == 0 and dr > 0, "rope_sin", "an even Dr", dr, "rope dim must be even")
    need(tuple(cos.shape) == tuple(sin.shape), "rope_cos", tuple(sin.shape),
         tuple(cos.shape), "must have rope_sin's shape")
    need(tuple(w_uq_qr.shape) == (hcq, n * (d + dr)), "weight_uq_qr", (hcq, n * (d + dr)),
         tuple(w_uq_qr.shape), "must be (Hcq, N * (D + Dr))")
    need(tuple(w_dkv_kr.shape) == (he, hckv + dr), "weight_dkv_kr", (he, hckv + dr),
         tuple(w_dkv_kr.shape), "must be (He, Hckv + Dr)")
    need(tuple(gamma_cq.shape) == (hcq,), "rmsnorm_gamma_cq", (hcq,), tuple(gamma_cq.shape),
         "must be (Hcq,)")
    need(tuple(gamma_ckv.shape) == (hckv,), "rmsnorm_gamma_ckv", (hckv,),
         tuple(gamma_ckv.shape), "must be (Hckv,)")
    need(tuple(index.shape) == tokens, "cache_index", tokens, tuple(index.shape),
         "must have token_x's token dims")
    need(len(kv_cache.shape) == 4 and kv_cache.shape[2:] == (1, hckv), "kv_cache",
         ("BlockNum", "BlockSize", 1, hckv), tuple(kv_cache.shape),
         "must be (BlockNum, BlockSize, 1, Hckv)")
    need(tuple(kr_cache.shape) == (*kv_cache.shape[:2], 1, dr), "kr_cache",
         (*kv_cache.shape[:2], 1, dr), tuple(kr_cache.shape),
         "must be (BlockNum, BlockSize, 1, Dr) like kv_cache")
    col0 = NZ_BYTES // kv_cache.itemsize
    if attrs["cache_mode"] == "PA_NZ":
        for name, width in (("kv_cache", hckv), ("kr_cache", dr)):
            need(width % col0 == 0, name, f"a multiple of {col0}", width,
                 "PA_NZ needs the last dim in whole 32-byte columns")
    return {"tokens": tokens, "t": math.prod(tokens), "he": he, "hcq": hcq, "n": n, "d": d,
            "hckv": hckv, "dr": dr, "blocks": kv_cache.shape[0],
            "block_size": kv_cache.shape[1], "col0": col0}


def _check(inputs: Specs, attrs: Attrs) -> None:
    if any(is_unknown_rank(t.shape) for t in inputs):
        return
    first = inputs[0]
    for name, spec in zip(("weight_dq", "weight_uq_qr", "weight_uk", "weight_dkv_kr",
                           "rmsnorm_gamma_cq", "rmsnorm_gamma_ckv", "rope_sin", "rope_cos",
                           "cache_index", "kv_cache", "kr_cache"), inputs[1:]):
        if name != "cache_index" and spec.dtype != first.dtype:
            raise DtypeError("must have token_x's dtype", op=NAME, param=name,
                             expected=str(first.dtype).removeprefix("torch."),
                             got=str(spec.dtype).removeprefix("torch."))
    _sizes(inputs, attrs)


def _infer_shape(inputs: Specs, attrs: Attrs) -> list[tuple[int, ...]]:
    sizes = _sizes(inputs, attrs)
    tokens, n = sizes["tokens"], sizes["n"]
    return [(*tokens, n, sizes["hckv"]), (*tokens, n, sizes["dr"])]


def _infer_dtype(inputs: Specs, attrs: Attrs) -> list[torch.dtype]:
    return [inputs[0].dtype, inputs[0].dtype]


def _cost(inputs: Specs, outputs: Specs, attrs: Attrs) -> Cost:
    s = _sizes(inputs, attrs)
    t, he, hcq, n, d, hckv, dr = (s[k] for k in ("t", "he", "hcq", "n", "d", "hckv", "dr"))
    flops = 2 * t * (he * hcq + hcq * n * (d + dr) + n * d * hckv + he * (hckv + dr))
    weights = sum(spec.numel for spec in inputs[1:8])
    moved = (inputs[0].numel + weights + sum(o.numel for o in outputs)
             + 2 * t * (hckv + dr) + 2 * t * dr) * inputs[0].itemsize
    return Cost(flops=flops, bytes_moved=moved)


def _kernel_costs(tiling: Tiling, grid: tuple[int, ...], inputs: Specs, outputs: Specs,
                  attrs: Attrs) -> dict[str, Cost]:
    """The fused KV kernel: the latent and rope projections (the rope columns twice, in
    source and partner order) and the rows written into the caches; with He in slices,
    the float32 partials it writes instead, which the merge kernel reads back. In variant
    ``fused_kv_query`` also the query kernel: its products, and the head weights read
    once per block of tokens. (The other steps, the query path's matmuls, norm and rope,
    are plans of their own, with their own costs.)"""
    s = _sizes(inputs, attrs)
    t, he, hckv, dr = (s[k] for k in ("t", "he", "hckv", "dr"))
    item = inputs[0].itemsize
    products = Cost(flops=2 * t * he * (hckv + 2 * dr),
                    bytes_moved=(t * he + he * (hckv + dr)) * item)
    rows = (hckv + 2 * t * dr + t * (hckv + dr)) * item  # gamma, tables, cache rows
    partials = 4 * _partials(tiling, grid, t)
    if not partials:
        costs = {"_mla_kv_kernel": Cost(products.flops, products.bytes_moved + rows)}
    else:
        costs = {"_mla_kv_kernel": Cost(products.flops, products.bytes_moved + partials),
                 "_mla_kv_merge_kernel": Cost(partials // 4, partials + rows)}
    if tiling.variant == "fused_kv_query":
        hcq, n, d = s["hcq"], s["n"], s["d"]
        # The head's weights are read once per block of tokens.
        reads = cdiv(t, tiling.blocks["QUERY_T"]) * (hcq * n * (d + dr) + n * d * hckv) \
            + t * hcq + hcq + 2 * t * dr
        costs["_mla_query_kernel"] = Cost(2 * t * n * (hcq * (d + dr) + d * hckv),
                                          (reads + t * n * (hckv + dr)) * item)
    return costs


def _tiling(inputs: Specs, outputs: Specs, attrs: Attrs, hardware: HardwareProfile
            ) -> list[Tiling]:
    """The fused KV kernel's blocks: ``BLOCK_T`` tokens, ``BLOCK_K`` of He per step, the
    whole latent row (``BLOCK_C``) and two rotated rope accumulators (``BLOCK_R``) held,
    so that the RMSNorm sees complete rows. 16 tokens a program (the dot's minimum) on
    GPUs, BLOCK_K 64 (32 for float32); the interpreter takes 256-wide K steps. Past
    `FUSED_QUERY_TOKENS` (a prefill) on CUDA with 16-bit inputs, BLOCK_K 16 comes first
    and the taller token blocks of `PREFILL_ALTERNATIVES` follow it, for autotuning to
    time. On CUDA
    the on-chip bytes are the operand buffers in shared memory (the float32
    accumulators live in registers).

    Variant ``fused_kv_query`` (up to `FUSED_QUERY_TOKENS` tokens: a decode step) also
    fuses the query path after the down-projection into `_mla_query_kernel`, one program
    per (token block, head) holding all ``QUERY_T`` tokens (so the up-projection's weight
    is read once): ``QUERY_K`` of Hcq per step, the head's nope columns (``BLOCK_D``) and
    its even and odd rope columns (``QUERY_H`` each), then ``QUERY_C`` latent columns of
    the absorbed product at a time. Variant ``fused_kv`` runs the query path as matmul,
    rms_norm and rope plans. A decode step lists every ``fused_kv_query`` level first,
    then the ``fused_kv`` ones: the steps take over where the query kernel does not fit,
    and autotuning times one path against the other."""
    # Tiling sees power-of-two buckets of the shapes: read the sizes, check nothing.
    x, d, hckv, dr = inputs[0], inputs[3].shape[1], inputs[3].shape[2], inputs[7].shape[-1]
    tokens, hcq = math.prod(x.shape[:-1]), inputs[1].shape[1]
    item = x.itemsize
    block_c, block_r = max(16, next_power_of_2(hckv)), max(16, next_power_of_2(dr))
    block_d = max(16, next_power_of_2(d))
    cpu, cuda = hardware.device_type == "cpu", hardware.device_type == "cuda"
    widest_k = 256 if cpu else (64 if item <= 2 else 32)
    # float32's IEEE products take larger register tiles: 64 tokens spill on sm_90 (8 KB
    # a thread), 16 do not, so float32 takes its tokens 16 at a time.
    query_t = max(16, min(64 if item <= 2 else 16, next_power_of_2(tokens)))
    query_c = min(block_c, 128)
    query_h = max(16, next_power_of_2(dr // 2))
    query_width = block_d + 2 * query_h
    query_warps = gpu_warps(query_t * query_width, hardware)
    block_t = max(16, min(64 if cpu else 16, next_power_of_2(tokens)))

    def k_levels(size: int) -> list[int]:
        """K steps for a reduction over ``size``: the widest first, halved down to 16."""
        levels = [max(16, min(widest_k, next_power_of_2(size)))]
        while levels[-1] > 16:
            levels.append(levels[-1] // 2)
        return levels

    def kv_tiling(block_t: int, block_k: int, warps: int | None = None) -> Tiling:
        operands = 2 * block_k * (block_t + block_c + 2 * block_r) * item
        accumulators = block_t * (block_c + 2 * block_r) * 4
        return Tiling("fused_kv", {"BLOCK_T": block_t, "BLOCK_K": block_k,
                                   "BLOCK_C": block_c, "BLOCK_R": block_r},
                      operands + (0 if cuda else accumulators), double_buffered=False,
                      options={"warps": warps or gpu_warps(block_t * (block_c + 2 * block_r),
                                                           hardware),
                               "stages": 2 if cuda else None})

    kv_levels = [kv_tiling(block_t, block_k) for block_k in k_levels(x.shape[-1])]
    if tokens > FUSED_QUERY_TOKENS:
        if cuda and item <= 2:
            widest = kv_levels[0].blocks["BLOCK_K"]
            # BLOCK_K 16 first: both H200 tunings of a DeepSeek-V3 prefill (T = 1024)
            # chose it, 3% ahead of 64 (benchmarks/results/gpu_2026-12-01/).
            kv_levels = kv_levels[-1:] + [
                kv_tiling(t, k, warps) for t, k, warps in PREFILL_ALTERNATIVES
                if t <= next_power_of_2(tokens) and k <= widest] + kv_levels[:-1]
        return kv_levels
    he_levels, hcq_levels = k_levels(x.shape[-1]), k_levels(hcq)
    count = max(len(he_levels), len(hcq_levels))
    query_levels = []
    for block_k, query_k in zip(he_levels + [16] * (count - len(he_levels)),
                                hcq_levels + [16] * (count - len(hcq_levels))):
        kv = kv_tiling(block_t, block_k)
        query_onchip = 2 * query_k * (query_t + query_width) * item \
            + query_t * query_width * 4 + block_d * query_c * item + query_t * query_c * 4
        query_levels.append(Tiling(
            "fused_kv_query",
            {**kv.blocks, "QUERY_T": query_t, "QUERY_K": query_k, "BLOCK_D": block_d,
             "QUERY_H": query_h, "QUERY_C": query_c},
            max(kv.onchip_bytes, query_onchip), double_buffered=False,
            options={**kv.options, **({"query_warps": min(8, query_warps)} if query_warps
                                      else {})}))
    return query_levels + kv_levels


def _grid(tiling: Tiling, inputs: Specs, outputs: Specs, attrs: Attrs,
          hardware: HardwareProfile) -> tuple[int, ...]:
    """(programs over the token blocks, slices of He). A decode step's few token blocks
    would leave most cores idle, each reading all of ``weight_dkv_kr``: He is then cut
    into slices (`work_splits`) whose float32 partial sums a second kernel adds before
    the norm, rope and scatter."""
    sizes = _sizes(inputs, attrs)
    token_blocks = cdiv(sizes["t"], tiling.blocks["BLOCK_T"])
    steps = cdiv(sizes["he"], tiling.blocks["BLOCK_K"])
    _, slices = split_steps(steps, work_splits(token_blocks, steps, hardware))
    return max(1, min(token_blocks, MAX_PROGRAMS)), slices


def _partials(tiling: Tiling, grid: tuple[int, ...], tokens: int) -> int:
    """float32 partial sums of sliced He: slices x T x (BLOCK_C + 2 BLOCK_R)."""
    width = tiling.blocks["BLOCK_C"] + 2 * tiling.blocks["BLOCK_R"]
    return 0 if grid[1] == 1 else grid[1] * tokens * width


def _workspace(tiling: Tiling, grid: tuple[int, ...], inputs: Specs, outputs: Specs,
               attrs: Attrs) -> int:
    return 4 * _partials(tiling, grid, _sizes(inputs, attrs)["t"])


def _cache_shape(cache: torch.Tensor, nz: bool) -> tuple[int, int, int]:
    """(BlockNum, BlockSize, W) of a cache ``(BlockNum, BlockSize, 1, W)``.

    Raises:
        ShapeError: ``cache`` is not of that form, or (``nz``) W is not a whole number of
            32-byte columns.
    """
    if cache.ndim != 4 or cache.shape[2] != 1 or (nz and cache.shape[-1] % _col0(cache)):
        layout = f", W a multiple of {_col0(cache)} (32 bytes)" if nz else ""
        raise ShapeError(f"is not a {'PA_NZ' if nz else 'PA_BSND'} cache", op=NAME,
                         param="cache", expected=f"(BlockNum, BlockSize, 1, W){layout}",
                         got=tuple(cache.shape))
    return cache.shape[0], cache.shape[1], cache.shape[3]


def nz_view(cache: torch.Tensor) -> torch.Tensor:
    """A ``PA_NZ`` cache ``(BlockNum, BlockSize, 1, W)`` seen as its storage
    ``(BlockNum, W / c0, BlockSize, c0)``, ``c0 = 32 bytes / itemsize``.

    Raises:
        ShapeError: ``cache`` is not of that form, or W is not a whole number of
            32-byte columns.
    """
    blocks, block_size, width = _cache_shape(cache, nz=True)
    return cache.view(blocks, width // _col0(cache), block_size, _col0(cache))


def cache_rows(cache: torch.Tensor, cache_mode: str = "PA_BSND") -> torch.Tensor:
    """The cache as ``(BlockNum * BlockSize, W)`` rows in slot order, whatever its
    layout (a view for ``PA_BSND``, a copy for ``PA_NZ``).

    Raises:
        ShapeError: as `nz_view` (for ``PA_BSND``, W may be any width).
    """
    blocks, block_size, width = _cache_shape(cache, nz=cache_mode == "PA_NZ")
    if cache_mode == "PA_BSND":
        return cache.view(blocks * block_size, width)
    return nz_view(cache).permute(0, 2, 1, 3).reshape(blocks * block_size, width)


def _slot_offsets(slots: torch.Tensor, width: int, block_size: int, nz: bool, col0: int
                  ) -> torch.Tensor:
    """Flat element offsets ``(len(slots), width)`` of the cache rows of ``slots``."""
    cols = torch.arange(width, device=slots.device)
    if not nz:
        return slots[:, None] * width + cols[None, :]
    block, row = slots // block_size, slots % block_size
    return (block * block_size * width)[:, None] + (cols // col0 * block_size * col0)[None, :] \
        + (row * col0)[:, None] + (cols % col0)[None, :]


def _samples(dtype: torch.dtype, device: torch.device, generator: torch.Generator
             ) -> list[Case]:
    return [
        Case("t5_bsnd", mla_inputs(5, dtype, device, generator)),
        Case("b2s3_nz", mla_inputs((2, 3), dtype, device, generator), {"cache_mode": "PA_NZ"}),
        Case("wide_heads_n8_d32_dr16", mla_inputs(7, dtype, device, generator, he=96, hcq=40,
                                                  hckv=48, n=8, d=32, dr=16),
             {"rmsnorm_epsilon_cq": 1e-6, "rmsnorm_epsilon_ckv": 1e-3}),
        Case("all_skipped", mla_inputs(4, dtype, device, generator, skip_all=True)),
        Case("zero_tokens", mla_inputs(0, dtype, device, generator)),
        # Past FUSED_QUERY_TOKENS: the query path through the matmul, norm and rope steps.
        Case("t80_query_steps", mla_inputs(80, dtype, device, generator, blocks=8)),
    ]


def mla_inputs(tokens: int | tuple[int, ...], dtype: torch.dtype, device: torch.device | str,
               generator: torch.Generator, he: int = 64, hcq: int = 48, hckv: int = 32,
               n: int = 4, d: int = 16, dr: int = 16, block_size: int = 16, blocks: int = 4,
               x: torch.Tensor | None = None, skip_all: bool = False
               ) -> tuple[torch.Tensor, ...]:
    """Inputs of one call in prototype order: weights normal over sqrt(fan-in), gammas
    near 1, interleave-half rope tables of the token positions, distinct random slots
    with every third token skipped (-1), caches filled with normal values (untouched rows
    must stay as they were)."""
    shape = tokens if isinstance(tokens, tuple) else (tokens,)
    t = math.prod(shape)

    def normal(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(size, generator=generator, dtype=torch.float64) * scale).to(
            device, dtype)

    if x is None:
        x = normal(*shape, he)
    cos, sin = rope_tables(torch.arange(t), dr, "interleave_half")
    slots = torch.randperm(blocks * block_size, generator=generator)[:t]
    slots[1::3] = -1
    if skip_all:
        slots[:] = -1
    return (x, normal(he, hcq, scale=he ** -0.5), normal(hcq, n * (d + dr), scale=hcq ** -0.5),
            normal(n, d, hckv, scale=d ** -0.5), normal(he, hckv + dr, scale=he ** -0.5),
            (1 + 0.1 * torch.randn(hcq, generator=generator)).to(device, dtype),
            (1 + 0.1 * torch.randn(hckv, generator=generator)).to(device, dtype),
            sin.reshape(*shape, dr).to(device, dtype), cos.reshape(*shape, dr).to(device, dtype),
            slots.reshape(shape).to(device), normal(blocks, block_size, 1, hckv),
            normal(blocks, block_size, 1, dr))


def _sweep(kind: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
           generator: torch.Generator) -> list[Case]:
    """token_x drawn from the kind as ``(T, He)``: T the shape's leading size (at most 64),
    He 64, or He = 65537 for ``long_rows`` (long projections); the other inputs as in
    `mla_inputs`, at least one slot per token."""
    tokens = min(shape[0], 64)
    he = LONG_ROW if kind == "long_rows" else 64
    x = generate(kind, (tokens, he), dtype, device=device, generator=generator)
    blocks = max(4, cdiv(tokens, 16))
    return [Case("", mla_inputs(tokens, dtype, device, generator, he=he, x=x, blocks=blocks))]


def _magnitude_scale(opdef: OpDef, inputs: Sequence[torch.Tensor | None], attrs: Attrs,
                     golden: torch.Tensor, output: str) -> torch.Tensor:
    """The formula evaluated on magnitudes (each product on |operands|, the RMSNorm's rstd
    of the true rows, the rotation as |x p||cos| + |x q||sin|), in float64; untouched
    cache entries keep |golden|."""
    results = dict(zip(("query", "query_rope", "kv_cache", "kr_cache"),
                       _rows(*inputs, compute_dtype=torch.float64, magnitudes=True,
                             rounded=torch.float64, **attrs)))
    if output in ("query", "query_rope"):
        scale = results[output]
    else:
        scale = _scattered(golden.abs(), results[output].abs(), inputs[9], attrs,
                           _col0(inputs[10]))
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _torch_mla_prolog(token_x: torch.Tensor, weight_dq: torch.Tensor,
                      weight_uq_qr: torch.Tensor, weight_uk: torch.Tensor,
                      weight_dkv_kr: torch.Tensor, rmsnorm_gamma_cq: torch.Tensor,
                      rmsnorm_gamma_ckv: torch.Tensor, rope_sin: torch.Tensor,
                      rope_cos: torch.Tensor, cache_index: torch.Tensor,
                      kv_cache: torch.Tensor, kr_cache: torch.Tensor,
                      rmsnorm_epsilon_cq: float, rmsnorm_epsilon_ckv: float,
                      cache_mode: str) -> tuple[torch.Tensor, ...]:
    """the same computation composed of torch ops in the inputs' dtype"""
    tokens, dr = token_x.shape[:-1], rope_sin.shape[-1]
    n, d, hckv = weight_uk.shape
    x = token_x.flatten(0, -2)
    cos, sin = rope_cos.flatten(0, -2), rope_sin.flatten(0, -2)
    norm = torch.nn.functional.rms_norm
    cq = norm(x @ weight_dq, (weight_dq.shape[1],), rmsnorm_gamma_cq, rmsnorm_epsilon_cq)
    qq = (cq @ weight_uq_qr).view(x.shape[0], n, d + dr)
    query = torch.einsum("tnd,ndc->tnc", qq[..., :d], weight_uk)
    query_rope = rope_reference(qq[..., d:], cos[:, None], sin[:, None],
                                compute_dtype=torch.float32, mode="interleave_half")
    kv = x @ weight_dkv_kr
    ckv = norm(kv[:, :hckv], (hckv,), rmsnorm_gamma_ckv, rmsnorm_epsilon_ckv)
    kr = rope_reference(kv[:, hckv:], cos, sin, compute_dtype=torch.float32,
                        mode="interleave_half").to(kv.dtype)
    attrs = {"cache_mode": cache_mode}
    return (query.reshape(*tokens, n, hckv), query_rope.to(x.dtype).reshape(*tokens, n, dr),
            _scattered(kv_cache, ckv, cache_index, attrs, _col0(kv_cache)),
            _scattered(kr_cache, kr, cache_index, attrs, _col0(kv_cache)))


OVERFLOWING_PROJECTIONS = KnownLimitation(
    "token_x near the dtype's maximum: the projections overflow float32 accumulation and "
    "the input dtype at CANN's rounding points (cq and qq are stored in it), where the "
    "unrounded float64 golden stays finite. Any implementation that stores cq and qq in "
    "the input dtype, as CANN's golden does, overflows there too.", case="large_*",
    failures="*NaN/Inf*")

CANCELLING_PRODUCTS = KnownLimitation(
    "Elements of the absorbed query whose products cancel (a golden of 5e-5 where the "
    "magnitude of its terms is 150, on uniform inputs) are rounding noise for opforge and "
    "the torch composition alike: which of them lands closer in relative terms is luck "
    "(opforge 15x the peer's max_rel on one such element of a float32 sweep case, with the "
    "same inputs' down-projection rounded in another order). Every element stays within "
    "the dtype's eps bound of its terms' magnitude (the error scale: there 9e-9, the "
    "peer's 1e-8).", failures=("max_rel ratio*", "mean_rel ratio*"))

def _slot_count(kv_cache: object) -> int:
    """BlockNum * BlockSize: the cache rows a slot may name."""
    return kv_cache.shape[0] * kv_cache.shape[1]


def _check_values(plan: object, inputs: Sequence[torch.Tensor | None]) -> None:
    """Contiguous caches (written in place by offset), before anything runs. The slots
    are checked by the launchers (`_slot_check`), while the query path runs.

    Raises:
        OpError: a cache that is not contiguous.
    """
    for name, cache in (("kv_cache", inputs[10]), ("kr_cache", inputs[11])):
        if not cache.is_contiguous():
            raise OpError("must be contiguous (it is updated in place)", op=NAME,
                          param=name, expected="a contiguous tensor",
                          got=f"strides {cache.stride()}")


def _slot_check(cache_index: torch.Tensor) -> backends.HostRead | None:
    """Start reading the largest slot on the host (`_check_slots` waits for it): queued
    before the query path's kernels, so that on a GPU the device computes the queries
    while the host waits for one number, instead of idling after a synchronisation. None
    when there is nothing to read, while a CUDA graph is captured (the read cannot run
    then) and inside `opforge.device_side_checks` (no synchronisation): the launchers
    skip slots beyond the cache instead, writing nothing out of bounds."""
    if cache_index.numel() == 0 or not backends.host_reads_allowed(cache_index.device):
        return None
    return backends.HostRead(cache_index.max())


def _check_slots(pending: backends.HostRead | None, kv_cache: torch.Tensor) -> None:
    """Every slot below BlockNum * BlockSize (negative ones skip), before either cache is
    written. The queries may be computed already: they do not depend on the slots.

    Raises:
        IndexRangeError: a slot beyond the cache.
    """
    if pending is None:
        return
    slots = _slot_count(kv_cache)
    largest = int(pending.value())
    if largest >= slots:
        raise IndexRangeError("holds a slot beyond the cache", op=NAME, param="cache_index",
                              expected=f"< BlockNum * BlockSize = {slots} (or negative)",
                              got=largest)


MLA_PROLOG = OpDef(
    name=NAME, doc="DeepSeek MLA preprocessing (torch_npu.npu_mla_prolog V1): queries, "
                   "query rope, and the latent KV and rope rows scattered into paged caches "
                   "in place. Forward only.",
    inputs=(*(TensorArg(name) for name in INPUT_NAMES),
            TensorArg("cache_index", dtypes=INDEX_DTYPES),
            # Rows are scattered into the caches, never read from them: a rerun writes the
            # same values, so autotuning may time the operator on the call's caches.
            TensorArg("kv_cache", mutated=True, write_only=True),
            TensorArg("kr_cache", mutated=True, write_only=True)),
    outputs=(OutputArg("query"), OutputArg("query_rope")),
    attrs=(Attr("rmsnorm_epsilon_cq", "float", 1e-5, range=EPS_RANGE),
           Attr("rmsnorm_epsilon_ckv", "float", 1e-5, range=EPS_RANGE),
           Attr("cache_mode", "str", "PA_BSND", choices=CACHE_MODES)),
    infer_shape=_infer_shape, infer_dtype=_infer_dtype, check=_check,
    check_values=_check_values, cost=_cost, tiling=_tiling, grid=_grid,
    workspace=_workspace, kernel_costs=_kernel_costs, samples=_samples,
    error_scale=_magnitude_scale,
    precision=PrecisionSpec("benchmark_ratio", "L0", _torch_mla_prolog, sweep=_sweep,
                            known_limitations=(OVERFLOWING_PROJECTIONS,
                                               CANCELLING_PRODUCTS)))


# ---------------------------------------------------------------------------------------------
# Reference


def _rms(rows: torch.Tensor, gamma: torch.Tensor, eps: float, compute_dtype: torch.dtype,
         magnitudes: bool, reference_rows: torch.Tensor) -> torch.Tensor:
    """RMSNorm of ``rows`` with the rstd of ``reference_rows`` (the true rows: on
    magnitudes, |rows| is normalised by the statistic of the real ones)."""
    rstd = torch.rsqrt(reference_rows.square().mean(-1, keepdim=True) + eps)
    gamma = gamma.to(compute_dtype)
    return rows * rstd * (gamma.abs() if magnitudes else gamma)


def _rows(token_x: torch.Tensor, weight_dq: torch.Tensor, weight_uq_qr: torch.Tensor,
          weight_uk: torch.Tensor, weight_dkv_kr: torch.Tensor, gamma_cq: torch.Tensor,
          gamma_ckv: torch.Tensor, rope_sin: torch.Tensor, rope_cos: torch.Tensor,
          cache_index: torch.Tensor, kv_cache: torch.Tensor, kr_cache: torch.Tensor, *,
          compute_dtype: torch.dtype, rmsnorm_epsilon_cq: float, rmsnorm_epsilon_ckv: float,
          cache_mode: str, rounded: torch.dtype, magnitudes: bool = False
          ) -> tuple[torch.Tensor, ...]:
    """(query, query_rope, ckv rows, kr rows) in ``compute_dtype``, rounded to
    ``rounded`` at CANN's points; ``magnitudes``: every product on absolute values."""
    def r(t: torch.Tensor) -> torch.Tensor:
        return t.to(rounded).to(compute_dtype)

    def w(t: torch.Tensor) -> torch.Tensor:
        t = t.to(compute_dtype)
        return t.abs() if magnitudes else t

    tokens, dr = token_x.shape[:-1], rope_sin.shape[-1]
    n, d, hckv = weight_uk.shape
    x = token_x.flatten(0, -2).to(compute_dtype)
    cos = rope_cos.flatten(0, -2).to(compute_dtype)
    sin = rope_sin.flatten(0, -2).to(compute_dtype)
    if magnitudes:
        cos, sin = cos.abs(), sin.abs()
    true_cq = r(x @ weight_dq.to(compute_dtype))
    cq_rows = w(x) @ w(weight_dq) if magnitudes else true_cq
    cq = r(_rms(cq_rows, gamma_cq, rmsnorm_epsilon_cq, compute_dtype, magnitudes, true_cq))
    qq = r(cq @ w(weight_uq_qr)).view(x.shape[0], n, d + dr)
    query = r(torch.einsum("tnd,ndc->tnc", qq[..., :d], w(weight_uk)))
    rope_mode = {"compute_dtype": compute_dtype, "mode": "interleave_half",
                 "magnitudes": magnitudes}
    query_rope = r(rope_reference(qq[..., d:], cos[:, None], sin[:, None], **rope_mode))
    true_kv = x @ weight_dkv_kr.to(compute_dtype)
    kv = w(x) @ w(weight_dkv_kr) if magnitudes else true_kv
    ckv = _rms(kv[:, :hckv], gamma_ckv, rmsnorm_epsilon_ckv, compute_dtype, magnitudes,
               true_kv[:, :hckv])
    kr = rope_reference(kv[:, hckv:], cos, sin, **rope_mode)
    return (query.reshape(*tokens, n, hckv), query_rope.reshape(*tokens, n, dr), ckv, kr)


def _col0(cache: torch.Tensor) -> int:
    """Elements in one 32-byte NZ column of the cache's dtype."""
    return NZ_BYTES // cache.element_size()


def _scattered(cache: torch.Tensor, rows: torch.Tensor, cache_index: torch.Tensor,
               attrs: Attrs, col0: int) -> torch.Tensor:
    """A copy of ``cache`` with ``rows`` written at the slots of ``cache_index`` (negative
    slots skipped), in ``rows``' dtype; ``col0``: the NZ column of the real cache's dtype."""
    result = cache.to(rows.dtype).clone()
    _write_rows(result, rows, cache_index, attrs["cache_mode"], col0)
    return result


def _write_rows(cache: torch.Tensor, rows: torch.Tensor, cache_index: torch.Tensor,
                cache_mode: str, col0: int) -> None:
    """Write ``rows`` (rounded to the cache's dtype) into ``cache`` in place; negative
    slots and slots beyond the cache (let through by `opforge.device_side_checks`) are
    skipped."""
    slots = cache_index.reshape(-1).to(torch.int64)
    keep = (slots >= 0) & (slots < cache.shape[0] * cache.shape[1])
    width = cache.shape[-1]
    offsets = _slot_offsets(slots[keep], width, cache.shape[1], cache_mode == "PA_NZ", col0)
    cache.view(-1)[offsets.reshape(-1)] = rows[keep].reshape(-1).to(cache.dtype)


@MLA_PROLOG.reference
def reference(*inputs: torch.Tensor, compute_dtype: torch.dtype, rmsnorm_epsilon_cq: float,
              rmsnorm_epsilon_ckv: float, cache_mode: str
              ) -> tuple[torch.Tensor, ...]:
    """(query, query_rope, kv_cache, kr_cache) in ``compute_dtype``, rounded at CANN's
    points to the inputs' dtype (not at all for the float64 golden); the caches are new
    tensors (the reference never writes its inputs)."""
    attrs = {"rmsnorm_epsilon_cq": rmsnorm_epsilon_cq,
             "rmsnorm_epsilon_ckv": rmsnorm_epsilon_ckv, "cache_mode": cache_mode}
    query, query_rope, ckv, kr = _rows(*inputs, compute_dtype=compute_dtype,
                                       rounded=inputs[0].dtype, **attrs)
    col0 = _col0(inputs[10])
    return (query, query_rope, _scattered(inputs[10], ckv, inputs[9], attrs, col0),
            _scattered(inputs[11], kr, inputs[9], attrs, col0))


# ---------------------------------------------------------------------------------------------
# Kernel

if triton is not None:

    @triton.jit
    def _cache_offsets(slots, cols, WIDTH, block_size, NZ: tl.constexpr, COL0: tl.constexpr):
        """Element offsets of (slot, column) pairs in a PA_BSND or PA_NZ cache."""
        if NZ:
            block = slots // block_size
            row = slots % block_size
            return (block * block_size * WIDTH)[:, None] \
                + ((cols // COL0) * block_size * COL0)[None, :] \
                + (row * COL0)[:, None] + (cols % COL0)[None, :]
        else:
            return slots[:, None] * WIDTH + cols[None, :]

    @triton.jit
    def _kv_products(x_ptr, w_ptr, rows, row_mask, k_first, k_end, HCKV, DR, stride_xt,
                     stride_xk, stride_wk, stride_wn, UPCAST: tl.constexpr,
                     PRECISION: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                     BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr):
        """float32 sums over He in ``[k_first, k_end)`` of x @ W for a block of tokens: the
        latent columns, and the rope columns twice, in the rotation's source and partner
        orders (so that each rotated element finds its partner at its own position)."""
        latent = tl.arange(0, BLOCK_C)
        rope = tl.arange(0, BLOCK_R)
        source, _, partner, _, _ = rope_indices(rope, DR, "interleave_half", False)
        acc_c = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        acc_p = tl.zeros([BLOCK_T, BLOCK_R], dtype=tl.float32)
        acc_q = tl.zeros([BLOCK_T, BLOCK_R], dtype=tl.float32)
        for start in range(k_first, k_end, BLOCK_K):
            ks = start + tl.arange(0, BLOCK_K)
            k_mask = ks < k_end
            x = dot_operand(x_ptr + rows[:, None] * stride_xt + ks[None, :] * stride_xk,
                            row_mask[:, None] & k_mask[None, :], UPCAST)
            w_rows = w_ptr + ks[:, None] * stride_wk
            w_c = dot_operand(w_rows + latent[None, :] * stride_wn,
                              k_mask[:, None] & (latent < HCKV)[None, :], UPCAST)
            rope_mask = k_mask[:, None] & (rope < DR)[None, :]
            w_p = dot_operand(w_rows + (HCKV + source)[None, :] * stride_wn, rope_mask,
                              UPCAST)
            w_q = dot_operand(w_rows + (HCKV + partner)[None, :] * stride_wn, rope_mask,
                              UPCAST)
            acc_c = tl.dot(x, w_c, acc_c, input_precision=PRECISION)
            acc_p = tl.dot(x, w_p, acc_p, input_precision=PRECISION)
            acc_q = tl.dot(x, w_q, acc_q, input_precision=PRECISION)
        return acc_c, acc_p, acc_q

    @triton.jit
    def _kv_write_rows(acc_c, acc_p, acc_q, rows, row_mask, gamma_ptr, cos_ptr, sin_ptr,
                       index_ptr, kv_ptr, kr_ptr, HCKV, DR, eps, block_size, slot_count,
                       NZ: tl.constexpr, COL0: tl.constexpr, BLOCK_C: tl.constexpr,
                       BLOCK_R: tl.constexpr):
        """RMSNorm of the latent rows, interleave-half RoPE of the rope rows, and the
        scatter of both into the caches (negative slots and slots past ``slot_count``
        write nothing)."""
        latent = tl.arange(0, BLOCK_C)
        rope = tl.arange(0, BLOCK_R)
        _, _, _, _, sign = rope_indices(rope, DR, "interleave_half", False)
        rstd = 1.0 / tl.sqrt(tl.sum(acc_c * acc_c, 1) / HCKV + eps)
        gamma = widen(tl.load(gamma_ptr + latent, mask=latent < HCKV, other=0.0))
        ckv = acc_c * rstd[:, None] * gamma[None, :]
        table = rows[:, None] * DR + rope[None, :]
        table_mask = row_mask[:, None] & (rope < DR)[None, :]
        cos = widen(tl.load(cos_ptr + table, mask=table_mask, other=0.0))
        sin = widen(tl.load(sin_ptr + table, mask=table_mask, other=0.0))
        kr = acc_p * cos + sign[None, :] * acc_q * sin
        slots = tl.load(index_ptr + rows, mask=row_mask, other=-1)  # integer index
        slots = slots.to(tl.int64)
        keep = (slots >= 0) & (slots < slot_count) & row_mask
        slots = tl.where(keep, slots, 0)
        kv_offsets = _cache_offsets(slots, latent, HCKV, block_size, NZ, COL0)
        tl.store(kv_ptr + kv_offsets, rounded_for(ckv, kv_ptr),
                 mask=keep[:, None] & (latent < HCKV)[None, :])
        kr_offsets = _cache_offsets(slots, rope, DR, block_size, NZ, COL0)
        tl.store(kr_ptr + kr_offsets, rounded_for(kr, kr_ptr),
                 mask=keep[:, None] & (rope < DR)[None, :])

    @triton.jit
    def _partial_offsets(k_slice, rows, T, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr):
        """Where slice ``k_slice``'s three accumulators of ``rows`` lie in the float32
        partials ``(slices, T, BLOCK_C + 2 BLOCK_R)``: latent, source rope, partner rope."""
        width: tl.constexpr = BLOCK_C + 2 * BLOCK_R
        base = (k_slice * T + rows)[:, None] * width
        return (base + tl.arange(0, BLOCK_C)[None, :],
                base + BLOCK_C + tl.arange(0, BLOCK_R)[None, :],
                base + BLOCK_C + BLOCK_R + tl.arange(0, BLOCK_R)[None, :])

    @triton.jit
    def _mla_kv_kernel(x_ptr, w_ptr, gamma_ptr, cos_ptr, sin_ptr, index_ptr, kv_ptr, kr_ptr,
                       partials_ptr, T, HE, K_SLICE, stride_xt, stride_xk, stride_wk, stride_wn,
                       HCKV, DR, eps, block_size, slot_count, SLICED: tl.constexpr,
                       NZ: tl.constexpr, COL0: tl.constexpr, UPCAST: tl.constexpr,
                       PRECISION: tl.constexpr, WIDE: tl.constexpr, BLOCK_T: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr):
        """Per block of tokens and slice ``program_id(1)`` of He (``K_SLICE`` long): the
        kv projection in float32, never stored in the input dtype. Unsliced, the RMSNorm,
        RoPE and cache scatter follow in the same program; sliced, the slice's sums go to
        the partials for `_mla_kv_merge_kernel`. ``WIDE``: token offsets in int64 (a long
        prefill's ``T x He`` passes int32)."""
        k_slice = tl.program_id(1)
        k_first = k_slice * K_SLICE
        k_end = tl.minimum(HE, k_first + K_SLICE)
        for tile in range(tl.program_id(0), tl.cdiv(T, BLOCK_T), tl.num_programs(0)):
            rows = tile * BLOCK_T + tl.arange(0, BLOCK_T)
            if WIDE:
                rows = rows.to(tl.int64)
            row_mask = rows < T
            acc_c, acc_p, acc_q = _kv_products(
                x_ptr, w_ptr, rows, row_mask, k_first, k_end, HCKV, DR, stride_xt, stride_xk,
                stride_wk, stride_wn, UPCAST, PRECISION, BLOCK_T, BLOCK_K, BLOCK_C, BLOCK_R)
            if SLICED:
                at_c, at_p, at_q = _partial_offsets(k_slice, rows, T, BLOCK_C, BLOCK_R)
                tl.store(partials_ptr + at_c, acc_c, mask=row_mask[:, None])
                tl.store(partials_ptr + at_p, acc_p, mask=row_mask[:, None])
                tl.store(partials_ptr + at_q, acc_q, mask=row_mask[:, None])
            else:
                _kv_write_rows(acc_c, acc_p, acc_q, rows, row_mask, gamma_ptr, cos_ptr,
                               sin_ptr, index_ptr, kv_ptr, kr_ptr, HCKV, DR, eps, block_size,
                               slot_count, NZ, COL0, BLOCK_C, BLOCK_R)

    @triton.jit
    def _mla_kv_merge_kernel(partials_ptr, gamma_ptr, cos_ptr, sin_ptr, index_ptr, kv_ptr,
                             kr_ptr, T, HCKV, DR, eps, block_size, slot_count, slices,
                             NZ: tl.constexpr, COL0: tl.constexpr, BLOCK_T: tl.constexpr,
                             BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr):
        """Per block of tokens (a few rows: no dot here, and a decode step has few
        tokens to spread over the cores): the slices' partial sums added in slice order
        (deterministic), then the RMSNorm, RoPE and cache scatter."""
        for tile in range(tl.program_id(0), tl.cdiv(T, BLOCK_T), tl.num_programs(0)):
            rows = tile * BLOCK_T + tl.arange(0, BLOCK_T)
            row_mask = rows < T
            acc_c = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
            acc_p = tl.zeros([BLOCK_T, BLOCK_R], dtype=tl.float32)
            acc_q = tl.zeros([BLOCK_T, BLOCK_R], dtype=tl.float32)
            for k_slice in range(slices):
                at_c, at_p, at_q = _partial_offsets(k_slice, rows, T, BLOCK_C, BLOCK_R)
                acc_c += tl.load(partials_ptr + at_c, mask=row_mask[:, None], other=0.0)
                acc_p += tl.load(partials_ptr + at_p, mask=row_mask[:, None], other=0.0)
                acc_q += tl.load(partials_ptr + at_q, mask=row_mask[:, None], other=0.0)
            _kv_write_rows(acc_c, acc_p, acc_q, rows, row_mask, gamma_ptr, cos_ptr, sin_ptr,
                           index_ptr, kv_ptr, kr_ptr, HCKV, DR, eps, block_size, slot_count,
                           NZ, COL0, BLOCK_C, BLOCK_R)


    @triton.jit
    def _mla_query_kernel(cq_ptr, gamma_ptr, wuq_ptr, wuk_ptr, cos_ptr, sin_ptr, query_ptr,
                          rope_ptr, T, N, HCQ, D, DR, HCKV, eps, stride_wk, stride_wn,
                          stride_uh, stride_ud, stride_uc, UPCAST: tl.constexpr,
                          PRECISION: tl.constexpr, BLOCK_T: tl.constexpr,
                          BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                          BLOCK_C: tl.constexpr):
        """The query path of a decode step after the down-projection, per (block of
        tokens, head): the RMSNorm of the ``cq`` rows (rounded), the head's columns of the
        up-projection (rounded: CANN's ``qq``), the interleave-half RoPE of its rope part
        into ``query_rope``, and its nope part times ``weight_uk[head]`` into ``query``,
        ``BLOCK_C`` latent columns at a time. The rope columns are read as two
        accumulators, the even and the odd ones (``BLOCK_H`` each): the de-interleaved
        halves of the output pair them up. ``cq`` is ``(T, HCQ)`` contiguous, the tables
        ``(T, DR)``, the outputs ``(T, N, HCKV)`` and ``(T, N, DR)``."""
        nope = tl.arange(0, BLOCK_D)
        pair = tl.arange(0, BLOCK_H)
        pair_mask = pair < DR // 2
        for work in range(tl.program_id(0), tl.cdiv(T, BLOCK_T) * N, tl.num_programs(0)):
            # Heads of one token block run side by side: they read the same cq rows.
            head = work % N
            rows = (work // N) * BLOCK_T + tl.arange(0, BLOCK_T)
            row_mask = rows < T
            squares = tl.zeros([BLOCK_T], dtype=tl.float32)
            for start in range(0, HCQ, BLOCK_K):
                ks = start + tl.arange(0, BLOCK_K)
                cq = widen(tl.load(cq_ptr + rows[:, None] * HCQ + ks[None, :],
                                   mask=row_mask[:, None] & (ks < HCQ)[None, :], other=0.0))
                squares += tl.sum(cq * cq, 1)
            rstd = 1.0 / tl.sqrt(squares / HCQ + eps)
            acc_n = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
            acc_e = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
            acc_o = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
            first_col = head * (D + DR)
            for start in range(0, HCQ, BLOCK_K):
                ks = start + tl.arange(0, BLOCK_K)
                k_mask = ks < HCQ
                cq = widen(tl.load(cq_ptr + rows[:, None] * HCQ + ks[None, :],
                                   mask=row_mask[:, None] & k_mask[None, :], other=0.0))
                gamma = widen(tl.load(gamma_ptr + ks, mask=k_mask, other=0.0))
                # CANN rounds the normalised rows to the input dtype before the product.
                normed = as_dot_operand(cq * rstd[:, None] * gamma[None, :], cq_ptr, UPCAST)
                w_rows = wuq_ptr + ks[:, None] * stride_wk
                w_n = dot_operand(w_rows + (first_col + nope)[None, :] * stride_wn,
                                  k_mask[:, None] & (nope < D)[None, :], UPCAST)
                w_mask = k_mask[:, None] & pair_mask[None, :]
                rope_cols = w_rows + (first_col + D + 2 * pair)[None, :] * stride_wn
                w_e = dot_operand(rope_cols, w_mask, UPCAST)
                w_o = dot_operand(rope_cols + stride_wn, w_mask, UPCAST)
                acc_n = tl.dot(normed, w_n, acc_n, input_precision=PRECISION)
                acc_e = tl.dot(normed, w_e, acc_e, input_precision=PRECISION)
                acc_o = tl.dot(normed, w_o, acc_o, input_precision=PRECISION)
            out_rows = rows * N + head
            # qq is rounded to the input dtype (CANN) before the rope and the absorption.
            even = widen(rounded_for(acc_e, cq_ptr))
            odd = widen(rounded_for(acc_o, cq_ptr))
            low = rows[:, None] * DR + pair[None, :]
            high = low + DR // 2
            mask = row_mask[:, None] & pair_mask[None, :]
            rope_out = rope_ptr + out_rows[:, None] * DR + pair[None, :]
            # Output j < DR/2 pairs x[2j] with x[2j+1]; j >= DR/2 pairs x[2j-DR+1] with
            # x[2j-DR]: the tables' two halves.
            cos = widen(tl.load(cos_ptr + low, mask=mask, other=0.0))
            sin = widen(tl.load(sin_ptr + low, mask=mask, other=0.0))
            tl.store(rope_out, rounded_for(even * cos - odd * sin, rope_ptr), mask=mask)
            cos = widen(tl.load(cos_ptr + high, mask=mask, other=0.0))
            sin = widen(tl.load(sin_ptr + high, mask=mask, other=0.0))
            tl.store(rope_out + DR // 2, rounded_for(odd * cos + even * sin, rope_ptr),
                     mask=mask)
            q_nope = as_dot_operand(acc_n, cq_ptr, UPCAST)
            for chunk in range(0, HCKV, BLOCK_C):
                cols = chunk + tl.arange(0, BLOCK_C)
                col_mask = cols < HCKV
                w_uk = dot_operand(wuk_ptr + head * stride_uh + nope[:, None] * stride_ud
                                   + cols[None, :] * stride_uc,
                                   (nope < D)[:, None] & col_mask[None, :], UPCAST)
                query = tl.dot(q_nope, w_uk, input_precision=PRECISION)
                at = out_rows[:, None] * HCKV + cols[None, :]
                tl.store(query_ptr + at, rounded_for(query, query_ptr),
                         mask=row_mask[:, None] & col_mask[None, :])


# ---------------------------------------------------------------------------------------------
# Launchers


@MLA_PROLOG.launcher("torch")
def launch_torch(plan: object, inputs: Sequence[torch.Tensor | None],
                 outputs: Sequence[torch.Tensor], workspace: torch.Tensor | None) -> None:
    """The formula at float32 (float64 for float64 inputs), writing only the indexed rows
    of the caches.

    Raises:
        IndexRangeError: a slot beyond the cache (`_check_slots`), before anything runs.
    """
    _check_slots(_slot_check(inputs[9]), inputs[10])
    wide = inputs[0].dtype == torch.float64
    query, query_rope, ckv, kr = _rows(*inputs, compute_dtype=torch.float64 if wide
                                       else torch.float32, rounded=inputs[0].dtype,
                                       **plan.attrs)
    outputs[0].copy_(query)
    outputs[1].copy_(query_rope)
    col0 = _col0(inputs[10])
    _write_rows(inputs[10], ckv, inputs[9], plan.attrs["cache_mode"], col0)
    _write_rows(inputs[11], kr, inputs[9], plan.attrs["cache_mode"], col0)


def _query_steps(plan: object, inputs: Sequence[torch.Tensor], cq: torch.Tensor,
                 outputs: Sequence[torch.Tensor]) -> None:
    """The query path after the down-projection through opforge's rms_norm, matmul and
    rope (their plans run directly, kept with this plan as its steps: this launcher is
    already below the dispatcher)."""
    w_uq_qr, w_uk, gamma_cq, sin, cos = (inputs[i] for i in (2, 3, 5, 7, 8))
    n, d, hckv = w_uk.shape
    t, dr = cq.shape[0], sin.shape[-1]
    normed, _ = plan.run_step("norm_cq", "rms_norm", cq, gamma_cq,
                              eps=plan.attrs["rmsnorm_epsilon_cq"])
    qq = plan.run_step("up", "matmul", normed, w_uq_qr).view(t, n, d + dr)
    # The absorbed product per head, (N, T, Hckv), written straight into the (T, N, Hckv)
    # output through a transposed view: no copy of the largest intermediate.
    plan.run_step("absorb", "matmul", qq[..., :d].transpose(0, 1), w_uk,
                  out=outputs[0].view(t, n, hckv).transpose(0, 1))
    tables = (cos.reshape(t, 1, dr), sin.reshape(t, 1, dr))
    plan.run_step("rope_q", "rope", qq[..., d:], *tables, out=outputs[1].view(t, n, dr),
                  mode="interleave_half")


@MLA_PROLOG.launcher("triton")
def launch(plan: object, inputs: Sequence[torch.Tensor | None],
           outputs: Sequence[torch.Tensor], workspace: torch.Tensor | None) -> None:
    """The down-projection through opforge's matmul; for a decode step (variant
    ``fused_kv_query``) the rest of the query path in `_mla_query_kernel`, else through
    `_query_steps`; the KV path in the fused kernel (and its merge when He is sliced).

    Raises:
        IndexRangeError: a slot beyond the cache (`_check_slots`), after the query path
            is queued and before either cache is written.
    """
    (token_x, w_dq, w_uq_qr, w_uk, w_dkv_kr, gamma_cq, gamma_ckv, sin, cos, cache_index,
     kv_cache, kr_cache) = inputs
    n, d, hckv = w_uk.shape
    dr = sin.shape[-1]
    x = token_x.flatten(0, -2)
    t, he = x.shape
    if t == 0:
        return  # no tokens: nothing to write (the plan launches even so, as it mutates)
    pending = _slot_check(cache_index)
    cq = plan.run_step("down", "matmul", x, w_dq)
    rows_cos = cos.reshape(t, dr).contiguous()
    rows_sin = sin.reshape(t, dr).contiguous()
    tiling = plan.tiling
    blocks = tiling.blocks
    # Every dot's operands are x's dtype: 16-bit ones take the matrix unit whatever the
    # precision, and "ieee" is the one every backend accepts (triton-ascend rejects "tf32").
    precision = "ieee"
    upcast = backends.interpreter_enabled()
    if tiling.variant == "fused_kv_query" and not wide_offsets(w_uq_qr, w_uk, outputs[0]):
        warps = tiling.options.get("query_warps")
        _mla_query_kernel[(min(cdiv(t, blocks["QUERY_T"]) * n, MAX_PROGRAMS),)](
            cq, gamma_cq.contiguous(), w_uq_qr, w_uk, rows_cos, rows_sin, *outputs, t, n,
            cq.shape[1], d, dr, hckv, plan.attrs["rmsnorm_epsilon_cq"], *w_uq_qr.stride(),
            *w_uk.stride(),
            UPCAST=upcast, PRECISION=precision, BLOCK_T=blocks["QUERY_T"],
            BLOCK_K=blocks["QUERY_K"], BLOCK_D=blocks["BLOCK_D"], BLOCK_H=blocks["QUERY_H"],
            BLOCK_C=blocks["QUERY_C"],
            **{**launch_options(tiling), **({"num_warps": warps} if warps else {})})
    else:
        _query_steps(plan, inputs, cq, outputs)
    _check_slots(pending, kv_cache)
    slices = plan.grid[1]
    k_per_slice = split_steps(cdiv(he, blocks["BLOCK_K"]), slices)[0] * blocks["BLOCK_K"]
    # What the norm, rope and scatter of the rows read and write, and their sizes.
    row_tensors = (gamma_ckv.contiguous(), rows_cos, rows_sin,
                   cache_index.reshape(-1).contiguous(), kv_cache, kr_cache)
    row_sizes = (hckv, dr, plan.attrs["rmsnorm_epsilon_ckv"], kv_cache.shape[1],
                 _slot_count(kv_cache))
    # Slices only while token blocks leave cores idle (T below cores x BLOCK_T): the
    # partials' offsets stay in int32.
    partials = workspace.view(torch.float32) if slices > 1 else x
    common = {"NZ": plan.attrs["cache_mode"] == "PA_NZ", "COL0": _col0(kv_cache),
              "BLOCK_C": blocks["BLOCK_C"], "BLOCK_R": blocks["BLOCK_R"]}
    _mla_kv_kernel[plan.grid](
        x, w_dkv_kr, *row_tensors, partials, t, he, k_per_slice, *x.stride(),
        *w_dkv_kr.stride(), *row_sizes, SLICED=slices > 1, UPCAST=upcast,
        PRECISION=precision, WIDE=wide_offsets(x), BLOCK_T=blocks["BLOCK_T"],
        BLOCK_K=blocks["BLOCK_K"], **common,
        **launch_options(tiling))
    if slices > 1:
        warps = gpu_warps(MERGE_ROWS * (blocks["BLOCK_C"] + 2 * blocks["BLOCK_R"]),
                          plan.hardware)
        _mla_kv_merge_kernel[(min(t, MAX_PROGRAMS),)](
            partials, *row_tensors, t, *row_sizes, slices, BLOCK_T=MERGE_ROWS, **common,
            **({} if warps is None else {"num_warps": warps}))


register_op(MLA_PROLOG)


@MLA_PROLOG.exported
def mla_prolog(token_x: torch.Tensor, weight_dq: torch.Tensor, weight_uq_qr: torch.Tensor,
               weight_uk: torch.Tensor, weight_dkv_kr: torch.Tensor,
               rmsnorm_gamma_cq: torch.Tensor, rmsnorm_gamma_ckv: torch.Tensor,
               rope_sin: torch.Tensor, rope_cos: torch.Tensor, cache_index: torch.Tensor,
               kv_cache: torch.Tensor, kr_cache: torch.Tensor, *,
               rmsnorm_epsilon_cq: float = 1e-5, rmsnorm_epsilon_ckv: float = 1e-5,
               cache_mode: str = "PA_BSND"
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeek MLA preprocessing with ``torch_npu.npu_mla_prolog``'s (V1) semantics; the
    formula and rounding points are in `opforge.ops.mla_prolog`. Forward only (an
    inference operator: no gradient).

    Args:
        token_x: ``(B, S, He)`` or ``(T, He)``; weight_dq ``(He, Hcq)``; weight_uq_qr
            ``(Hcq, N (D + Dr))``; weight_uk ``(N, D, Hckv)``; weight_dkv_kr
            ``(He, Hckv + Dr)``; the gammas ``(Hcq,)``, ``(Hckv,)``; rope_sin/rope_cos
            ``(*tokens, Dr)`` in the interleave-half layout; all of one float dtype.
        cache_index: int64/int32 ``(*tokens)``: the cache slot of each token, negative to
            skip it.
        kv_cache, kr_cache: ``(BlockNum, BlockSize, 1, Hckv)`` / ``(..., Dr)``, contiguous,
            updated in place (``cache_mode`` ``"PA_BSND"`` or ``"PA_NZ"``).

    Returns:
        ``(query (*tokens, N, Hckv), query_rope (*tokens, N, Dr), kv_cache, kr_cache)``:
        the last two are the updated cache tensors themselves (no copy).

    Raises:
        ShapeError: inconsistent sizes, naming the tensor. DtypeError: mixed dtypes.
        IndexRangeError: a slot at or beyond ``BlockNum * BlockSize``. OpError: a cache
        that is not contiguous. AttrError: a bad epsilon or cache mode.
    """
    query, query_rope = MLA_PROLOG(token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr,
        rmsnorm_gamma_cq, rmsnorm_gamma_ckv, rope_sin, rope_cos, cache_index, kv_cache,
        kr_cache, rmsnorm_epsilon_cq, rmsnorm_epsilon_ckv, cache_mode)
    return query, query_rope, kv_cache, kr_cache
