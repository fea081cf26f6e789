"""The SwiGLU of a model's MLP, whose gate and up projections are two tensors:
``silu_mul(gate, up) = silu(gate) * up`` (``down(silu(gate(x)) * up(x))``); its gradient
``silu_mul_backward(grad, gate, up)`` writes ``grad * up * silu'(gate)`` and
``grad * silu(gate)``, reading each operand once (`opforge.ops._gated`). One pass each
way where ``silu`` then a product make two forward and three backward passes and save
``silu(gate)`` too.
"""

from __future__ import annotations

from opforge.core.opdef import BenchSpec
from opforge.ops._gated import gated_product
from opforge.ops._liger import liger_peer
from opforge.ops.silu import silu_of, silu_reference, silu_slope, silu_slope_reference

SILU_MUL, SILU_MUL_BACKWARD = gated_product(
    "silu_mul", "SwiGLU of two tensors, ``silu(gate) * up``.",
    act=silu_of, act_grad=silu_slope, reference=silu_reference,
    reference_grad=silu_slope_reference, flops=6, gradient_flops=10,
    bench=BenchSpec(peers={"Liger-Kernel": liger_peer(
        "swiglu", "LigerSiLUMulFunction", lambda case: case.inputs)}))
