"""GeGLU, the gated MLP of Gemma-family models: ``gelu_tanh_mul(gate, up) =
gelu_tanh(gate) * up`` with GELU's tanh form (``torch.nn.functional.gelu(approximate=
"tanh")``, transformers' ``gelu_pytorch_tanh``); its gradient writes
``grad * up * gelu_tanh'(gate)`` and ``grad * gelu_tanh(gate)``, reading each operand once
(`opforge.ops._gated`), where ``gelu`` then a product make two passes forward and three
backward.
"""

from __future__ import annotations

from opforge.core.opdef import BenchSpec
from opforge.ops._gated import gated_product
from opforge.ops._liger import liger_peer
from opforge.ops.gelu import (
    gelu_tanh_of,
    gelu_tanh_reference,
    gelu_tanh_slope,
    gelu_tanh_slope_reference,
)

GELU_TANH_MUL, GELU_TANH_MUL_BACKWARD = gated_product(
    "gelu_tanh_mul", "GeGLU of two tensors, ``gelu(gate, approximate='tanh') * up``.",
    act=gelu_tanh_of, act_grad=gelu_tanh_slope, reference=gelu_tanh_reference,
    reference_grad=gelu_tanh_slope_reference, flops=12, gradient_flops=20,
    bench=BenchSpec(peers={"Liger-Kernel": liger_peer(
        "geglu", "LigerGELUMulFunction", lambda case: case.inputs)}))
