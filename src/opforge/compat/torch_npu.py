"""``torch_npu``'s fused-operator signatures, computed by opforge on any device: code written
for Ascend runs unchanged on a GPU or a CPU.

``rstd`` is float32 (float64 for float64 inputs) with the input's shape and the
normalised (last) dim kept as 1, as torch_npu returns it. `npu_mla_prolog` takes the
quantisation arguments of the signature and refuses them (opforge's MlaProlog has no int8
path).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

import opforge.ops.mla_prolog
import opforge.ops.moe_gating  # noqa: F401 - registers the operators
from opforge.core.errors import AttrError, ShapeError, UnsupportedError
from opforge.functional import (
    attention,
    mla_prolog,
    moe_gating_top_k,
    moe_gating_top_k_softmax,
    rope,
)
from opforge.ops.attention_varlen import attention_varlen
from opforge.ops.rms_norm import ADD_RMS_NORM, RMS_NORM
from opforge.ops.swiglu import SWIGLU


def npu_rms_norm(x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch_npu.npu_rms_norm``: ``(x * rstd * gamma, rstd)`` over the last dim.

    Raises:
        ShapeError: ``gamma`` is not 1-D of x's last dim. DtypeError, AttrError.
    """
    y, rstd = RMS_NORM(x, gamma, epsilon)
    return y, rstd.unsqueeze(-1)


def npu_swiglu(input: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``torch_npu.npu_swiglu``: ``silu(a) * b`` of the halves ``a, b`` of ``input`` along
    ``dim``; differentiable (torch_npu's SwiGluGrad is `opforge.ops.swiglu`'s backward).

    Raises:
        ShapeError: an odd size along ``dim``. AttrError: ``dim`` out of range.
        DtypeError: not a float dtype.
    """
    return SWIGLU(input, dim)


def npu_add_rms_norm(x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor,
                     epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch_npu.npu_add_rms_norm``: ``(rms_norm(x1 + x2), rstd, x1 + x2)``. The vendor
    normalises the sum rounded to the inputs' dtype (its golden, `test_npu_add_rms_norm.py`):
    16-bit inputs take that rounded sum (an add, then rms_norm), float32 ones the fused
    operator (its float32 sum is the same). `opforge.add_rms_norm` normalises the
    unrounded sum.

    Raises:
        ShapeError: ``x2`` differs from ``x1`` in shape, or a bad ``gamma``.
    """
    if x1.dtype in (torch.float16, torch.bfloat16) and x1.shape == x2.shape:
        total = x1 + x2
        y, rstd = RMS_NORM(total, gamma, epsilon)
    else:
        y, rstd, total = ADD_RMS_NORM(x1, x2, gamma, epsilon)
    return y, rstd.unsqueeze(-1), total


def npu_mla_prolog(token_x: torch.Tensor, weight_dq: torch.Tensor, weight_uq_qr: torch.Tensor,
                   weight_uk: torch.Tensor, weight_dkv_kr: torch.Tensor,
                   rmsnorm_gamma_cq: torch.Tensor, rmsnorm_gamma_ckv: torch.Tensor,
                   rope_sin: torch.Tensor, rope_cos: torch.Tensor, cache_index: torch.Tensor,
                   kv_cache: torch.Tensor, kr_cache: torch.Tensor, *,
                   dequant_scale_x: torch.Tensor | None = None,
                   dequant_scale_w_dq: torch.Tensor | None = None,
                   dequant_scale_w_uq_qr: torch.Tensor | None = None,
                   dequant_scale_w_dkv_kr: torch.Tensor | None = None,
                   quant_scale_ckv: torch.Tensor | None = None,
                   quant_scale_ckr: torch.Tensor | None = None,
                   smooth_scales_cq: torch.Tensor | None = None,
                   rmsnorm_epsilon_cq: float = 1e-05, rmsnorm_epsilon_ckv: float = 1e-05,
                   cache_mode: str = "PA_BSND"
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch_npu.npu_mla_prolog`` (V1): ``(query, query_rope, kv_cache_out,
    kr_cache_out)``, the caches updated in place and returned (see `opforge.mla_prolog`).
    Forward only.

    Raises:
        UnsupportedError: a quantisation argument is given. Otherwise as
            `opforge.mla_prolog`.
    """
    quantisation = {"dequant_scale_x": dequant_scale_x, "dequant_scale_w_dq": dequant_scale_w_dq,
                    "dequant_scale_w_uq_qr": dequant_scale_w_uq_qr,
                    "dequant_scale_w_dkv_kr": dequant_scale_w_dkv_kr,
                    "quant_scale_ckv": quant_scale_ckv, "quant_scale_ckr": quant_scale_ckr,
                    "smooth_scales_cq": smooth_scales_cq}
    given = [name for name, value in quantisation.items() if value is not None]
    if given:
        raise UnsupportedError("quantised MlaProlog is not supported", op="npu_mla_prolog",
                               param=given[0], expected="None", got="a tensor")
    return mla_prolog(token_x, weight_dq, weight_uq_qr, weight_uk, weight_dkv_kr,
                      rmsnorm_gamma_cq, rmsnorm_gamma_ckv, rope_sin, rope_cos, cache_index,
                      kv_cache, kr_cache, rmsnorm_epsilon_cq=rmsnorm_epsilon_cq,
                      rmsnorm_epsilon_ckv=rmsnorm_epsilon_ckv, cache_mode=cache_mode)


def npu_moe_gating_top_k(x: torch.Tensor, k: int, *, bias: torch.Tensor | None = None,
                         input_ids: torch.Tensor | None = None,
                         tid2eid: torch.Tensor | None = None, k_group: int = 1,
                         group_count: int = 1, group_select_mode: int = 0, renorm: int = 0,
                         norm_type: int = 0, out_flag: bool = False,
                         routed_scaling_factor: float = 1.0, eps: float = 1e-20
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch_npu.npu_moe_gating_top_k``: ``(y, expert_idx, out)`` (see
    `opforge.moe_gating_top_k`; ``out`` is ``(rows, E)`` float32 as torch_npu allocates it,
    holding the scores when ``out_flag``, else zeros).

    Raises:
        UnsupportedError: the V2 hash mode (``input_ids``/``tid2eid``), or ``renorm=1``
            (CANN documents only 0; `opforge.moe_gating_top_k` has it). ShapeError: x not
            2-D. Otherwise as `opforge.moe_gating_top_k`.
    """
    if input_ids is not None or tid2eid is not None:
        raise UnsupportedError("the hash-routing mode (V2) is not supported",
                               op="npu_moe_gating_top_k", param="tid2eid", expected="None",
                               got="a tensor")
    if renorm != 0:
        raise UnsupportedError("CANN's MoeGatingTopK documents renorm=0 only",
                               op="npu_moe_gating_top_k", param="renorm", expected=0,
                               got=renorm)
    if x.dim() != 2:
        raise ShapeError("must be 2-D (rows, E)", op="npu_moe_gating_top_k", param="x",
                         expected="(rows, E)", got=tuple(x.shape))
    y, idx, out = moe_gating_top_k(x, k, bias=bias, k_group=k_group, group_count=group_count,
                                   group_select_mode=group_select_mode, renorm=renorm,
                                   norm_type=norm_type, out_flag=out_flag,
                                   routed_scaling_factor=routed_scaling_factor, eps=eps)
    if not out_flag:
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    return y, idx, out


def npu_moe_gating_top_k_softmax(x: torch.Tensor, finished: torch.Tensor | None = None,
                                 k: int = 1
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch_npu.npu_moe_gating_top_k_softmax``: ``(y, expert_idx, row_idx)`` (see
    `opforge.moe_gating_top_k_softmax`), the experts selected on the probabilities rounded
    to x's dtype, ties to the lower index, as the vendor's golden
    (`test_npu_moe_gating_top_k_softmax.py`) selects."""
    return moe_gating_top_k_softmax(x, finished, k, round_scores=True)


def npu_rotary_mul(input: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor,
                   rotary_mode: str = "half") -> torch.Tensor:
    """``torch_npu.npu_rotary_mul``: ``input * r1 + rotate(input) * r2`` over the last dim,
    ``rotate`` the half (``"half"``) or pairwise (``"interleave"``) rotation: `opforge.rope`
    with ``cos = r1``, ``sin = r2`` (broadcast over input's leading dims).

    Raises:
        AttrError: another ``rotary_mode``. Otherwise as `opforge.rope`.
    """
    if rotary_mode not in ("half", "interleave"):
        raise AttrError("must be 'half' or 'interleave'", op="npu_rotary_mul",
                        param="rotary_mode", expected="half | interleave", got=rotary_mode)
    return rope(input, r1, r2, rotary_mode)


# CANN's "no limit" for pre_tockens / next_tockens.
ALL_TOKENS = 2147483647
SPARSE_MODES = (0, 1, 2, 3, 4)


def _tokens(limit: int, shift: int) -> int | None:
    """A CANN token limit as an opforge window side (bottom-right aligned after ``shift``);
    None for CANN's "no limit"."""
    return None if limit >= ALL_TOKENS else limit + shift


def _fusion_rule(sq: int, sk: int, atten_mask: torch.Tensor | None, sparse_mode: int,
                 pre_tockens: int, next_tockens: int
                 ) -> tuple[torch.Tensor | None, int | None, int | None]:
    """(opforge's boolean mask, True where seen; window_left; window_right) for one
    sequence under a sparse mode, the window counted from opforge's bottom-right diagonal
    ``i + Sk - Sq``: 0 the given mask within the band ``-pre <= j - i <= next`` (aligned
    top-left), 1 the given mask, 2 causal aligned top-left (``j <= i``), 3 causal aligned
    bottom-right, 4 the band aligned bottom-right. The bands run in the kernels (blocks
    outside them skipped); modes 2-4 ignore ``atten_mask`` (CANN's compressed 2048 x 2048
    form of their own rule)."""
    offset = sk - sq
    if sparse_mode == 3:
        return None, None, 0
    if sparse_mode == 2:
        return None, None, -offset
    if sparse_mode == 4:
        return None, _tokens(pre_tockens, 0), _tokens(next_tockens, 0)
    keep = None if atten_mask is None else ~atten_mask.bool()
    if sparse_mode == 1:
        return keep, None, None
    return keep, _tokens(pre_tockens, offset), _tokens(next_tockens, -offset)


def _with_pse(keep: torch.Tensor | None, pse: torch.Tensor | None, scale: float,
              dtype: torch.dtype) -> torch.Tensor | None:
    """The mask opforge's attention takes: ``scale * pse`` added to the scores (CANN adds
    pse before scaling), -inf where ``keep`` hides a key; or the boolean ``keep``."""
    if pse is None:
        return keep
    bias = pse.to(torch.float64 if dtype == torch.float64 else torch.float32) * scale
    return bias if keep is None else bias.masked_fill(~keep, float("-inf"))


def npu_fusion_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         head_num: int, input_layout: str, pse: torch.Tensor | None = None,
                         padding_mask: torch.Tensor | None = None,
                         atten_mask: torch.Tensor | None = None, scale: float = 1.0,
                         keep_prob: float = 1.0, pre_tockens: int = ALL_TOKENS,
                         next_tockens: int = ALL_TOKENS, inner_precise: int = 0,
                         prefix: Sequence[int] | None = None,
                         actual_seq_qlen: Sequence[int] | None = None,
                         actual_seq_kvlen: Sequence[int] | None = None, sparse_mode: int = 0,
                         gen_mask_parallel: bool = True, sync: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                    int, int, int]:
    """``torch_npu.npu_fusion_attention`` (CANN FlashAttentionScore) over `opforge.attention`:
    ``softmax(mask(scale * (q k^T + pse))) v`` in ``input_layout`` ``BSH``, ``SBH``,
    ``BSND``, ``BNSD`` or ``TND`` (packed sequences with cumulative ``actual_seq_qlen`` /
    ``actual_seq_kvlen``, each sequence run on its own rows: no ``T x T`` mask).
    Sparse modes 2-4 and mode 0's band run as opforge's window (`opforge.attention`'s
    ``window_left`` / ``window_right``): the kernels skip the key blocks outside the band,
    and no ``Sq x Sk`` mask is built.

    ``atten_mask`` is CANN's: True (1) hides a key; shapes ``(B, N, Sq, Sk)``, ``(B, 1, Sq,
    Sk)``, ``(1, 1, Sq, Sk)`` or ``(Sq, Sk)``. ``sparse_mode``: 0 the mask within the band
    ``-pre_tockens <= j - i <= next_tockens``; 1 the mask as given; 2 causal aligned
    top-left; 3 causal aligned bottom-right; 4 the band aligned bottom-right (modes 2-4
    ignore ``atten_mask``, CANN's compressed form of their own rule). ``pse``
    (``(B|1, N, Sq, Sk)``) is added before the scale and gets no gradient. A query that sees
    no key gets 0 (CANN leaves such rows undefined).

    Returns:
        ``(attention_out in input_layout, softmax_max, softmax_sum, softmax_out, seed,
        offset, numels)``: the statistics float32 ``(B, N, Sq, 8)`` (``(T, N, 8)`` for TND)
        holding opforge's log-sum-exp as the max and ones as the sum (the same softmax
        normalisation, ``sum exp(s - lse) = 1``, not CANN's split of it) repeated 8 times;
        ``softmax_out`` empty; seed, offset and numels 0 (no dropout).

    Raises:
        UnsupportedError: ``keep_prob < 1`` (dropout), ``padding_mask``, ``prefix``.
        AttrError: an unknown layout or sparse mode. ShapeError: TND without both length
            lists, or lists that do not cover the tokens. Otherwise as `opforge.attention`.
    """
    for name, value_given in (("keep_prob", keep_prob != 1.0),
                              ("padding_mask", padding_mask is not None),
                              ("prefix", prefix is not None)):
        if value_given:
            raise UnsupportedError(f"{name} is not supported (no dropout, no prefix mode)",
                                   op="npu_fusion_attention", param=name, expected="default",
                                   got="a value")
    if sparse_mode not in SPARSE_MODES:
        raise AttrError("unknown sparse mode", op="npu_fusion_attention", param="sparse_mode",
                        expected="0..4", got=sparse_mode)
    if input_layout == "TND":
        return _packed_fusion_attention(query, key, value, atten_mask, pse, scale,
                                        pre_tockens, next_tockens, actual_seq_qlen,
                                        actual_seq_kvlen, sparse_mode)
    if input_layout not in ("BSH", "SBH", "BSND", "BNSD"):
        raise AttrError("unknown layout", op="npu_fusion_attention", param="input_layout",
                        expected="BSH | SBH | BSND | BNSD | TND", got=input_layout)
    sq = query.shape[{"BSH": 1, "SBH": 0, "BSND": 1, "BNSD": 2}[input_layout]]
    sk = key.shape[{"BSH": 1, "SBH": 0, "BSND": 1, "BNSD": 2}[input_layout]]
    keep, left, right = _fusion_rule(sq, sk, atten_mask, sparse_mode, pre_tockens,
                                     next_tockens)
    out, lse = attention(query, key, value, False, scale, True,
                         attn_mask=_with_pse(keep, pse, scale, query.dtype),
                         layout=input_layout, heads=head_num, window_left=left,
                         window_right=right)
    softmax_max = lse.float()[..., None].expand(*lse.shape, 8).contiguous()
    return (out, softmax_max, torch.ones_like(softmax_max), query.new_empty(0), 0, 0, 0)


# Cumulative lengths as device tensors, one per (lengths, device): a model calls the fusion
# attention in every layer with the same lists, and one tensor object is checked on the
# host once by attention_varlen (a tensor per call was a copy to the device and a host
# read in every layer).
MAX_LENGTH_TENSORS = 32
_length_tensors: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}


def _lengths_tensor(ends: Sequence[int], device: torch.device) -> torch.Tensor:
    """int32 ``[0, *ends]`` on ``device``, the same tensor for the same lengths (the
    oldest of `MAX_LENGTH_TENSORS` dropped first)."""
    key = (tuple(ends), device)
    found = _length_tensors.get(key)
    if found is None:
        if len(_length_tensors) >= MAX_LENGTH_TENSORS:
            del _length_tensors[next(iter(_length_tensors))]
        found = _length_tensors[key] = torch.tensor([0, *ends], dtype=torch.int32,
                                                    device=device)
    return found


def _packed_fusion_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             atten_mask: torch.Tensor | None, pse: torch.Tensor | None,
                             scale: float, pre_tockens: int, next_tockens: int,
                             actual_seq_qlen: Sequence[int] | None,
                             actual_seq_kvlen: Sequence[int] | None, sparse_mode: int
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                        int, int, int]:
    """TND: `opforge.attention_varlen` when every sequence takes one window (from its own
    bottom-right diagonal) and no mask, and there is no pse; else each sequence's rows as
    a batch of one (BSND views) under its own rule, outputs concatenated."""
    if actual_seq_qlen is None or actual_seq_kvlen is None or \
            len(actual_seq_qlen) != len(actual_seq_kvlen):
        raise ShapeError("TND needs actual_seq_qlen and actual_seq_kvlen of one length",
                         op="npu_fusion_attention", param="actual_seq_qlen",
                         expected="two cumulative length lists", got=(actual_seq_qlen,
                                                                      actual_seq_kvlen))
    query_ends, key_ends = [int(n) for n in actual_seq_qlen], [int(n) for n in actual_seq_kvlen]
    for name, ends, total in (("actual_seq_qlen", query_ends, query.shape[0]),
                              ("actual_seq_kvlen", key_ends, key.shape[0])):
        if any(b < a for a, b in zip([0, *ends], ends, strict=False)) or \
                (ends and ends[-1] != total) or (not ends and total):
            raise ShapeError("must be non-decreasing cumulative lengths ending at the "
                             "token count", op="npu_fusion_attention", param=name,
                             expected=f"... ending at {total}", got=ends)
    spans = list(zip([0, *query_ends], query_ends, [0, *key_ends], key_ends, strict=False))
    rules = [_fusion_rule(q_end - q_start, k_end - k_start, None if atten_mask is None
                          else atten_mask[..., :q_end - q_start, :k_end - k_start],
                          sparse_mode, pre_tockens, next_tockens)
             for q_start, q_end, k_start, k_end in spans]
    windows = {(left, right) for _, left, right in rules}
    if pse is None and all(keep is None for keep, _, _ in rules) and len(windows) <= 1:
        left, right = windows.pop() if windows else (None, None)
        out, lse = attention_varlen(
            query, key, value, *(_lengths_tensor(ends, query.device)
                                 for ends in (query_ends, key_ends)),
            False, scale, max((end - start for start, end, _, _ in spans), default=0),
            max((end - start for _, _, start, end in spans), default=0), return_lse=True,
            window_left=left, window_right=right)
        softmax_max = lse.float().transpose(0, 1)[..., None].expand(
            *lse.shape[::-1], 8).contiguous()
        return (out, softmax_max, torch.ones_like(softmax_max), query.new_empty(0), 0, 0, 0)
    outs, statistics = [], []
    for (q_start, q_end, k_start, k_end), (keep, left, right) in zip(spans, rules,
                                                                      strict=True):
        sq, sk = q_end - q_start, k_end - k_start
        out, lse = attention(query[None, q_start:q_end], key[None, k_start:k_end],
                             value[None, k_start:k_end], False, scale, True,
                             attn_mask=_with_pse(keep, None if pse is None else
                                                 pse[..., :sq, :sk], scale, query.dtype),
                             layout="BSND", window_left=left, window_right=right)
        outs.append(out[0])
        statistics.append(lse[0].transpose(0, 1))  # (S, N)
    out = torch.cat(outs) if outs else value.new_empty((0, *value.shape[1:]))
    lse = torch.cat(statistics) if statistics else query.new_empty((0, query.shape[1]))
    softmax_max = lse.float()[..., None].expand(*lse.shape, 8).contiguous()
    return (out, softmax_max, torch.ones_like(softmax_max), query.new_empty(0), 0, 0, 0)
