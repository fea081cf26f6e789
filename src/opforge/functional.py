"""The functional API: torch-style signatures over the ``torch.ops.opforge.*`` operators.

Each function validates through the operator's `plan` (typed errors before any kernel),
supports autograd, and works inside ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Importing the operator modules registers the operators.
import opforge.ops.attention
import opforge.ops.attention_varlen
import opforge.ops.broadcast_add
import opforge.ops.embedding_dense_grad
import opforge.ops.gelu
import opforge.ops.layer_norm
import opforge.ops.matmul
import opforge.ops.mla_prolog
import opforge.ops.moe_gating
import opforge.ops.reduce_sum
import opforge.ops.rms_norm
import opforge.ops.rope
import opforge.ops.sigmoid
import opforge.ops.softmax
from opforge.core.errors import AttrError, DtypeError, ShapeError
from opforge.core.registry import functionals
from opforge.library import call


def __getattr__(name: str) -> object:
    # The functionals operator modules export themselves (`OpDef.exported`).
    found = functionals().get(name)
    if found is None:
        raise AttributeError(f"module 'opforge.functional' has no attribute {name!r}")
    return found


def broadcast_add(a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """``a + alpha * b`` with NumPy broadcasting (up to 8 dims), like ``torch.add``.

    Args:
        a, b: float32/float16/bfloat16/float64 tensors of broadcastable shapes, on one
            device.
        alpha: multiplier of ``b`` (a finite number).

    Returns:
        A tensor of the broadcast shape and ``torch.add``'s dtype: ``torch.promote_types(
        a.dtype, b.dtype)``, except that a 0-d operand beside a dimensioned one keeps the
        dimensioned one's dtype (fp16 tensor + 0-d float32 tensor: fp16).

    Raises:
        ShapeError: the shapes cannot be broadcast (the message names both shapes and the
            offending dim) or have more than 8 dims.
        DtypeError: an unsupported dtype. DeviceError: inputs on different devices.
        AttrError: ``alpha`` is not a finite number.
    """
    return call("broadcast_add", a, b, alpha)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``1 / (1 + exp(-x))`` without overflow for any |x|; same shape and dtype as ``x``.

    Raises:
        DtypeError: ``x`` is not float32/float16/bfloat16/float64.
    """
    return call("sigmoid", x)


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU like ``torch.nn.functional.gelu``: ``x * Phi(x)`` (``"none"``) or the tanh
    approximation (``"tanh"``); same shape and dtype as ``x``. The erf form keeps full
    relative accuracy in the left tail.

    Raises:
        DtypeError: unsupported dtype. AttrError: ``approximate`` not ``"none"``/``"tanh"``.
    """
    return call("gelu", x, approximate)


def reduce_sum(x: torch.Tensor, dims: int | Sequence[int] | None = None,
               keepdim: bool = False, scale: float = 1.0) -> torch.Tensor:
    """``scale * x.sum(dims)`` accumulated in float32, output in ``x.dtype``.

    ``dims=None`` reduces every dim; ``dims=()`` reduces none, as CANN's ReduceSum does
    (``torch.sum(x, dim=())`` reduces every dim).

    Raises:
        AttrError: a dim out of range or repeated. DtypeError: unsupported dtype.
    """
    if isinstance(dims, int):
        dims = [dims]
    return call("reduce_sum", x, None if dims is None else list(dims), keepdim, scale)


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``exp(x - max) / sum(exp(x - max))`` over ``dim``, like ``torch.softmax``: the row
    max is subtracted and the statistics are float32, so no input overflows; rows of only
    ``-inf`` give NaN, as in torch. Same shape and dtype as ``x``; long rows (up to 2^31
    columns) use the online multi-block variant.

    Raises:
        DtypeError: ``x`` is not float32/float16/bfloat16/float64.
        AttrError: ``dim`` is out of range for ``x``.
    """
    return call("softmax", x, dim)


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``x - max - log(sum(exp(x - max)))`` over ``dim``, like ``torch.log_softmax``;
    same shape and dtype as ``x``, float32 statistics.

    Raises:
        DtypeError: ``x`` is not float32/float16/bfloat16/float64.
        AttrError: ``dim`` is out of range for ``x``.
    """
    return call("log_softmax", x, dim)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None,
             eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(mean(x^2, -1) + eps) * weight`` over the last dim, like
    ``torch.nn.functional.rms_norm(x, x.shape[-1:], weight, eps)``; statistics in float32,
    output in torch's promoted dtype of ``x`` and ``weight`` (``x.dtype`` without a weight;
    float32 for a bfloat16 ``x`` with a float32 weight, as Hugging Face's RMSNorm returns),
    rounded once. `opforge.compat.torch_npu.npu_rms_norm` also returns ``rstd``.

    Args:
        x: float32/float16/bfloat16/float64, any leading shape.
        weight: ``[x.shape[-1]]`` of any float dtype, or ``None``.
        eps: a finite number >= 0.

    Raises:
        ShapeError: ``weight`` is not 1-D of x's last dim. DtypeError: unsupported dtype.
        AttrError: ``eps`` negative or not finite.
    """
    return call("rms_norm", x, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                 eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused residual add and RMSNorm: ``s = x + residual`` (float32, rounded once to
    ``x.dtype``), returns ``(rms_norm(s, weight, eps), s)``, reading each input once.

    Raises:
        ShapeError: ``residual`` differs from ``x`` in shape, or a bad ``weight``.
        DtypeError: unsupported dtype. AttrError: bad ``eps``.
    """
    y, _, total = call("add_rms_norm", x, residual, weight, eps)
    return y, total


def layer_norm(x: torch.Tensor, normalized_shape: int | Sequence[int],
               weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               eps: float = 1e-5) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the trailing
    ``normalized_shape`` dims, like ``torch.nn.functional.layer_norm``: float32 statistics,
    the variance by a stable method, output in ``x.dtype``.

    Raises:
        AttrError: ``normalized_shape`` is not the trailing dims of ``x``, or a bad ``eps``.
        ShapeError: ``weight``/``bias`` do not have ``normalized_shape``.
        DtypeError: unsupported dtype.
    """
    if isinstance(normalized_shape, int):
        normalized_shape = [normalized_shape]
    return call("layer_norm", x, weight, bias, list(normalized_shape), eps)[0]


def matmul(a: torch.Tensor, b: torch.Tensor, *, allow_tf32: bool = False) -> torch.Tensor:
    """``a @ b`` with ``torch.matmul``'s rules (1-D operands promoted and the added dim
    dropped, batch dims broadcast), float32 accumulation, output in the operands' dtype.
    float32 products use tf32 on GPUs only with ``allow_tf32=True``.

    Raises:
        ShapeError: a 0-d operand, mismatched inner dims, or batch dims that do not
            broadcast. DtypeError: operands of different or unsupported dtypes.
    """
    return call("matmul", a, b, allow_tf32)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str = "half"
         ) -> torch.Tensor:
    """Rotary position embedding over the last dim of ``x`` (even): ``"half"`` (GPT-NeoX),
    ``"interleave"`` (GPT-J / DeepSeek complex pairs) or ``"interleave_half"`` (CANN's form,
    de-interleaved output). ``cos``/``sin`` have x's last dim, broadcast over its leading
    dims, and are laid out ``[θ0 … θ(d/2−1), θ0 … θ(d/2−1)]`` for ``"half"`` and
    ``"interleave_half"``, ``[θ0, θ0, θ1, θ1, …]`` for ``"interleave"``
    (`opforge.ops.rope.rope_tables` builds them). Same shape and dtype as ``x``.
    Differentiable in ``x`` and in tables that require grad.

    Raises:
        ShapeError: an odd last dim, or tables that do not match x. AttrError: bad mode.
        DtypeError: unsupported dtype.
    """
    return call("rope", x, cos, sin, mode)


ATTENTION_LAYOUTS = ("BNSD", "BSND", "BSH", "SBH", "TND")


def _to_bnsd(t: torch.Tensor, layout: str, heads: int | None, name: str) -> torch.Tensor:
    """A view of ``t`` in ``layout`` as ``(B, N, S, D)`` (no copy)."""
    if t.dim() != (4 if layout in ("BNSD", "BSND") else 3):
        raise ShapeError(f"must be {'4' if layout in ('BNSD', 'BSND') else '3'}-D in layout "
                         f"{layout}", op="attention", param=name, expected=layout,
                         got=tuple(t.shape))
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.transpose(1, 2)
    if heads is None or heads < 1 or t.shape[-1] % heads:
        raise ShapeError(f"layout {layout} needs a head count dividing the last dim",
                         op="attention", param=name, expected="H = heads x D",
                         got=(tuple(t.shape), heads))
    if layout == "SBH":
        t = t.transpose(0, 1)
    return t.unflatten(-1, (heads, -1)).transpose(1, 2)


def _from_bnsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    """`_to_bnsd` undone on an output ``(B, N, S, D)``."""
    if layout == "BNSD":
        return t
    t = t.transpose(1, 2)
    if layout == "BSND":
        return t
    t = t.flatten(-2)
    return t.transpose(0, 1) if layout == "SBH" else t


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              scale: float | None = None, return_lse: bool = False, *,
              attn_mask: torch.Tensor | None = None, layout: str = "BNSD",
              heads: int | None = None, cu_seqlens_q: torch.Tensor | None = None,
              cu_seqlens_k: torch.Tensor | None = None, max_seqlen_q: int | None = None,
              max_seqlen_k: int | None = None, window_left: int | None = None,
              window_right: int | None = None
              ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention, flash-style on the Triton backend (no ``Sq x Sk``
    matrix in memory); the torch backend (the CPU development path) holds the score
    matrices of a chunk of query rows at a time (at most 2**24 elements).

    Args:
        q: ``(B, H, Sq, D)``; k: ``(B, Hkv, Sk, D)``; v: ``(B, Hkv, Sk, Dv)``, one float
            dtype, ``H`` a multiple of ``Hkv`` (grouped-query attention), ``D, Dv <= 256``
            (in ``layout``: see below).
        causal: query ``i`` sees keys ``j <= i + Sk - Sq`` (aligned to the bottom-right as
            in FlashAttention and KV-cache decoding; torch's SDPA ``is_causal`` aligns
            top-left, the same only when ``Sq == Sk``).
        scale: score scale, ``1 / sqrt(D)`` when None.
        window_left, window_right: a band around each query's diagonal key ``i + Sk -
            Sq``: query ``i`` sees keys ``i + Sk - Sq - window_left <= j <= i + Sk - Sq +
            window_right`` (None: unbounded on that side; negative values shift the band
            off the diagonal). With ``causal``, keys after the diagonal stay hidden. A
            sliding window of ``W`` keys (Mistral's, transformers' ``sliding_window``) is
            ``causal=True, window_left=W - 1``; CANN's band (``sparse_mode`` 4) is
            ``window_left=pre_tokens, window_right=next_tokens``. The kernels skip the key
            blocks outside the band: the work is ``O(Sq * W)``, not ``O(Sq * Sk)``.
        return_lse: also return the float32 (for float64 inputs float64) natural-log
            log-sum-exp of each query's scaled scores, ``(B, H, Sq)`` in every layout but
            ``"TND"``'s ``(H, T)`` (``-inf`` for a query that sees no key). A NaN or +inf
            score (a NaN input, an overflowed ``q.k``) makes its row's out and lse NaN.
        attn_mask: broadcastable to ``(B, H, Sq, Sk)`` (a lower rank is aligned to the
            right, as in torch): bool, True where the query sees the key (torch SDPA's
            convention), or float (q's dtype or float32), added to the scaled scores
            (``-inf`` hides a key). Combined with ``causal``. The kernels read it per tile
            (broadcast dims are not expanded in memory); it gets no gradient. A query
            whose keys are all hidden (by the mask, ``causal`` or the window) gets
            ``out = 0`` and ``lse = -inf`` (torch's SDPA gives NaN there).
        layout: ``"BNSD"`` (the shapes above), ``"BSND"`` (``(B, S, N, D)``, as Hugging
            Face models hold them), ``"BSH"`` (``(B, S, N * D)``) or ``"SBH"``
            (``(S, B, N * D)``); ``out`` comes back in the same layout. Views, no copies.
            ``"TND"``: packed sequences ``(T, N, D)`` with ``cu_seqlens_q`` /
            ``cu_seqlens_k``, run by `opforge.attention_varlen` (lse ``(N, T)``, no
            ``attn_mask``).
        heads: the query head count ``N``, needed by ``"BSH"`` and ``"SBH"`` (the key and
            value heads follow from q's head dim).
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k: the packing of ``"TND"``
            (see `opforge.attention_varlen`).

    Returns:
        ``out`` (``(B, H, Sq, Dv)`` in BNSD) in q's dtype, or ``(out, lse)``.
        Differentiable in q, k, v (and through lse).

    Raises:
        ShapeError: a rank that does not fit the layout, mismatched batch/lengths/head
            dims, heads not grouped, a head dim above 256, a mask that does not broadcast,
            a packed layout without ``heads``. DtypeError: q, k, v of different or
            unsupported dtypes; a float mask of another dtype. AttrError: an unknown layout;
            ``"TND"`` without both lengths or with a mask or ``heads``; packing arguments
            in another layout.
            IndexRangeError: ``"TND"`` lengths that do not cover the tokens.
    """
    if layout not in ATTENTION_LAYOUTS:
        raise AttrError("unknown layout", op="attention", param="layout",
                        expected=" | ".join(ATTENTION_LAYOUTS), got=layout)
    if layout != "TND":
        # Four reads on every call: the packing arguments, named only on the rare error.
        if cu_seqlens_q is not None or cu_seqlens_k is not None or max_seqlen_q is not None \
                or max_seqlen_k is not None:
            given = next(name for name, value in (
                ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
                ("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k))
                if value is not None)
            raise AttrError("belongs to layout TND (packed sequences)", op="attention",
                            param=given, expected="layout='TND'", got=layout)
    else:
        for name, value in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
                            ("attn_mask", attn_mask), ("heads", heads)):
            if (value is None) == name.startswith("cu_"):
                raise AttrError("TND takes both cumulative lengths, and no attn_mask or "
                                "heads", op="attention", param=name,
                                expected="a tensor" if name.startswith("cu_") else None,
                                got=None if value is None else type(value).__name__)
        return opforge.ops.attention_varlen.attention_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, max_seqlen_q, max_seqlen_k,
            return_lse, window_left=window_left, window_right=window_right)
    if layout in ("BSH", "SBH"):
        head_dim = q.shape[-1] // heads if heads else None
        kv_heads = k.shape[-1] // head_dim if head_dim else None
        q = _to_bnsd(q, layout, heads, "q")
        k, v = (_to_bnsd(t, layout, kv_heads, name) for t, name in ((k, "k"), (v, "v")))
    else:
        q, k, v = (_to_bnsd(t, layout, None, name) for t, name in ((q, "q"), (k, "k"),
                                                                      (v, "v")))
    if attn_mask is not None and 0 < attn_mask.dim() < 4:
        attn_mask = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    out, lse = call("attention", q, k, v, attn_mask, causal, scale, window_left,
                    window_right)
    out = _from_bnsd(out, layout)
    return (out, lse) if return_lse else out


def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, causal: bool = False,
                       scale: float | None = None, grad_lse: torch.Tensor | None = None,
                       attn_mask: torch.Tensor | None = None, window_left: int | None = None,
                       window_right: int | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of `attention`, recomputed from the saved ``out`` and ``lse``.

    With ``out`` and ``lse`` of the attention over all keys, ``k``/``v`` may be any block
    of those keys: the result is that block's share of dq and its dk, dv (ring attention
    sums the dq shares). ``causal`` then applies to the block's own positions
    (``Sk - Sq`` offset). ``grad_lse``: the gradient reaching ``lse``, if any.
    ``attn_mask``, ``window_left``, ``window_right``: the forward's (the mask 4-D, each dim
    1 or full).

    Raises:
        ShapeError: shapes that do not match the forward's. DtypeError: dtypes differ, or
            ``lse``/``grad_lse`` are not float32 (float64 for float64 inputs).
    """
    return call("attention_backward", dout, q, k, v, out, lse, grad_lse, attn_mask, causal,
                scale, window_left, window_right)


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
    query, query_rope = call(
        "mla_prolog", token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr,
        rmsnorm_gamma_cq, rmsnorm_gamma_ckv, rope_sin, rope_cos, cache_index, kv_cache,
        kr_cache, rmsnorm_epsilon_cq, rmsnorm_epsilon_ckv, cache_mode)
    return query, query_rope, kv_cache, kr_cache


def moe_gating_top_k(x: torch.Tensor, k: int, *, bias: torch.Tensor | None = None,
                     k_group: int = 1, group_count: int = 1, group_select_mode: int = 0,
                     renorm: int = 0, norm_type: int = 0, out_flag: bool = False,
                     routed_scaling_factor: float = 1.0, eps: float = 1e-20,
                     sigmoid_renorm: bool = True, index_dtype: torch.dtype = torch.int32
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MoE routing with CANN MoeGatingTopK's semantics (formula in
    `opforge.ops.moe_gating`): softmax (``norm_type=0``) or sigmoid (1) scores in float32,
    ``bias`` for selection only, the best ``k_group`` of ``group_count`` groups (by max,
    ``group_select_mode=0``, or top-2 sum, 1), top-k (ties: lower index), weights from the
    un-biased scores, renormalised with ``+ eps`` for softmax when ``renorm=1`` and for
    sigmoid unless ``sigmoid_renorm=False`` (CANN always renormalises sigmoid weights;
    DeepSeek-V3's ``norm_topk_prob=False`` does not), times ``routed_scaling_factor``.

    Args:
        x: ``(..., E)`` fp16/bf16/fp32 logits, E <= 8192 (leading dims are flattened into
            rows and restored on the outputs). bias: ``(E,)`` of x's dtype or float32 (a
            float32 correction bias beside bf16 logits, as DeepSeek-V3 keeps it).
        index_dtype: ``torch.int32`` (CANN's) or ``torch.int64`` (what ``one_hot``,
            ``index_select`` and transformers' experts take).

    Returns:
        ``(y (..., k) in x's dtype, expert_idx (..., k) of index_dtype, out)``; ``out`` is
        the float32 scores ``(..., E)`` when ``out_flag``, else an empty float32 tensor.
        ``y`` is differentiable with respect to ``x`` (not through the selection).

    Raises:
        ShapeError: x of no dims or a bad bias shape. DtypeError: a bias of another dtype,
        an index dtype other than int32/int64. AttrError: any constraint (``1 <= k <= E``,
        ``E % group_count == 0``, ``1 <= k_group <= group_count``,
        ``k <= k_group * E / group_count``, 2+ experts a group in mode 1).
    """
    if index_dtype not in (torch.int32, torch.int64):
        raise DtypeError("must be int32 or int64", op="moe_gating_top_k", param="index_dtype",
                         expected="int32 | int64", got=str(index_dtype))
    if x.dim() == 0:
        raise ShapeError("must have an experts dim", op="moe_gating_top_k", param="x",
                         expected="(..., E)", got=tuple(x.shape))
    leading = x.shape[:-1]
    y, idx, out = call("moe_gating_top_k", x.reshape(-1, x.shape[-1]), bias, k, k_group,
                       group_count, group_select_mode, renorm, norm_type, out_flag,
                       routed_scaling_factor, eps, sigmoid_renorm, False)
    if x.dim() != 2:
        y, idx = y.view(*leading, k), idx.view(*leading, k)
        out = out.view(*leading, x.shape[-1]) if out_flag else out
    return y, idx.to(index_dtype), out


def moe_gating_top_k_softmax(x: torch.Tensor, finished: torch.Tensor | None = None,
                             k: int = 1, round_scores: bool = False
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k of ``softmax(x)`` over the last dim with MoeGatingTopKSoftmax's outputs.

    Args:
        x: 2-D or 3-D logits. finished: bool of x's leading dims; those rows get expert
            index E. k: 1..min(E, 1024).
        round_scores: select on the probabilities rounded to x's dtype (ties to the lower
            expert), as the vendor's float16 golden does; by default the float32
            probabilities decide (more precise).

    Returns:
        ``(y, expert_idx, row_idx)`` of shape ``(*x.shape[:-1], k)``: y in x's dtype,
        int32 indices, ``row_idx[..., j] = j * N + i`` for flattened row i of N. y is
        differentiable through the gathered softmax scores (finished rows included).

    Raises:
        ShapeError: x not 2-D/3-D or a bad ``finished``. AttrError: k out of range.
    """
    return call("moe_gating_top_k_softmax", x, finished, k, round_scores)


def embedding_dense_grad(grad: torch.Tensor, indices: torch.Tensor, num_weights: int,
                         padding_idx: int = -1, scale_grad_by_freq: bool = False,
                         deterministic: bool | None = None, check_range: bool = True
                         ) -> torch.Tensor:
    """The embedding table's gradient, equal to ``torch.ops.aten.embedding_dense_backward``:
    ``out[indices[i]] += grad[i]`` (divided by the index's count when
    ``scale_grad_by_freq``), rows of ``padding_idx`` skipped, float32 accumulation.

    Args:
        grad: ``(*indices.shape, D)`` fp32/fp16/bf16. indices: int64, int32, int16, int8
            or uint8, any shape and layout. deterministic: the sort-based kernel (bitwise
            reproducible) or the atomic one; None follows
            ``torch.are_deterministic_algorithms_enabled()``.
        check_range: check every index before the kernels (one read of the extremes);
            ``False`` skips it on GPUs only.

    Returns:
        ``(num_weights, D)`` in grad's dtype.

    Raises:
        ShapeError: grad's leading dims differ from indices'. DtypeError: unsupported
        dtypes. IndexRangeError: an index outside ``[0, num_weights)``.
    """
    return call("embedding_dense_grad", grad, indices, num_weights, padding_idx,
                scale_grad_by_freq, deterministic, check_range)
