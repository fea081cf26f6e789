"""SwiGLU with ``torch_npu.npu_swiglu``'s semantics: ``x`` cut in two halves ``a, b``
along ``dim`` (default -1), ``swiglu(x) = silu(a) * b``; its gradient ``swiglu_backward(
grad, x, dim)`` writes ``grad * b * silu'(a)`` and ``grad * silu(a)`` into the two halves
of one tensor, reading each half of ``x`` once (`opforge.ops._gated`).
"""

from __future__ import annotations

from opforge.core.opdef import BenchSpec
from opforge.ops._gated import gated
from opforge.ops._liger import liger_peer
from opforge.ops.silu import silu_of, silu_reference, silu_slope, silu_slope_reference

SWIGLU, SWIGLU_BACKWARD = gated(
    "swiglu", "SwiGLU ``silu(a) * b`` of the halves of ``x`` along ``dim`` "
              "(``torch_npu.npu_swiglu``).",
    act=silu_of, act_grad=silu_slope, reference=silu_reference,
    reference_grad=silu_slope_reference, flops=6, gradient_flops=10,
    # Liger's fused gate-up function splits the last dim, the bench's (dim -1).
    bench=BenchSpec(peers={"Liger-Kernel": liger_peer(
        "swiglu", "LigerFusedGateUpSiLUMulFunction", lambda case: case.inputs)}))
