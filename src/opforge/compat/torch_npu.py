"""``torch_npu``'s fused-operator signatures, computed by opforge on any device: code written
for Ascend runs unchanged on a GPU or a CPU.

``rstd`` is float32 (float64 for float64 inputs) with the input's shape and the
normalised (last) dim kept as 1, as torch_npu returns it. `npu_mla_prolog` takes the
quantisation arguments of the signature and refuses them (opforge's MlaProlog has no int8
path).
"""

from __future__ import annotations

import torch

import opforge.ops.mla_prolog
import opforge.ops.moe_gating
import opforge.ops.rms_norm  # noqa: F401 - registers the operators
from opforge.core.errors import ShapeError, UnsupportedError
from opforge.functional import mla_prolog, moe_gating_top_k, moe_gating_top_k_softmax
from opforge.library import call
from opforge.ops.swiglu import SWIGLU


def npu_rms_norm(x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch_npu.npu_rms_norm``: ``(x * rstd * gamma, rstd)`` over the last dim.

    Raises:
        ShapeError: ``gamma`` is not 1-D of x's last dim. DtypeError, AttrError.
    """
    y, rstd = call("rms_norm", x, gamma, epsilon)
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
    """``torch_npu.npu_add_rms_norm``: ``(rms_norm(x1 + x2), rstd, x1 + x2)``, each input
    read once.

    Raises:
        ShapeError: ``x2`` differs from ``x1`` in shape, or a bad ``gamma``.
    """
    y, rstd, total = call("add_rms_norm", x1, x2, gamma, epsilon)
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
    `opforge.moe_gating_top_k_softmax`)."""
    return moe_gating_top_k_softmax(x, finished, k)
