"""RMSNorm, the fused Add-RMSNorm, and their gradient, over the last dim.

``rms_norm(x, weight, eps) -> (y, rstd)``: ``rstd = 1 / sqrt(mean(x^2) + eps)`` per row in
float32 and ``y = x * rstd * weight`` (CANN's RmsNorm and ``torch_npu.npu_rms_norm``; torch's
``F.rms_norm`` returns ``y`` alone, as `opforge.rms_norm` does). The squares are summed in
float32, so float16 values near 65504 do not overflow (their squares reach 4.3e9); a row
whose float32 sum of squares overflows (bfloat16 or float32 values beyond 1.8e19 /
sqrt(N)) or may have underflowed (values below about 1e-19) is summed again, scaled by a
power of two (`opforge.ops._norm`), and normalises as in float64.
``add_rms_norm(x, residual, weight, eps) -> (y, rstd, x + residual)`` reads each input once
and normalises the float32 sum (CANN's AddRmsNorm). ``weight`` may be ``None`` (no scale)
and may have its own float dtype: rms_norm's ``y`` then has torch's promoted dtype of the
two (a bfloat16 ``x`` with a float32 weight gives float32, rounded once, as Hugging Face's
RMSNorm modules return float32 there), add_rms_norm's outputs keep ``x``'s dtype; ``rstd``
is float32 (float64 for float64 ``x``) with ``x``'s leading shape.

``rms_norm_backward(grad, x, rstd, weight) -> (grad_x, grad_weight)`` with
``x_hat = x * rstd``, ``g = grad * weight``: ``grad_x = rstd * (g - x_hat * mean(g x_hat))``
and ``grad_weight = sum over rows of grad * x_hat``, reduced from per-program float32
partials in a fixed order (no atomics: deterministic). ``grad_weight`` is empty without
``weight``.

Tiling variants, kernels and launchers are `opforge.ops._norm`'s, without centering.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from opforge.core.errors import ShapeError
from opforge.core.opdef import (
    FLOAT_DTYPES,
    Attr,
    Attrs,
    AutocastPolicy,
    BenchSpec,
    Case,
    Cost,
    KnownLimitation,
    OpDef,
    OutputArg,
    PrecisionSpec,
    Specs,
    TensorArg,
)
from opforge.core.shapes import UNKNOWN_RANK, is_unknown_rank
from opforge.library import register_op
from opforge.ops import _norm as norm
from opforge.ops._elementwise import random_input
from opforge.ops._liger import liger_peer
from opforge.ops._rows import (
    CANCELLING_GRADIENT,
    OVERFLOWING_ROW_SUM,
    SHARED_ROW_STATISTIC,
)
from opforge.ops._statistics import STATISTICS_DTYPES, check_statistics, statistics_dtype
from opforge.precision.cases import generate

EPS = Attr("eps", "float", 1e-6, range=(0.0, None), doc="added to mean(x^2)")


def _check_weight(op: str, x: object, weight: object) -> None:
    if weight is None or is_unknown_rank(x.shape):
        return
    # A 0-d x is one row of one element.
    expected = tuple(x.shape)[-1:] or (1,)
    if tuple(weight.shape) != expected:
        raise ShapeError("must be 1-D with the size of x's last dim", op=op, param="weight",
                         expected=expected, got=tuple(weight.shape))


def _check(op: str, paired: tuple[str, ...], statistics: bool = False
           ) -> Callable[[Specs, Attrs], None]:
    """``weight`` matches x's last dim; ``paired`` inputs have x's shape; with
    ``statistics`` (a backward), ``rstd`` has the forward's statistics dtype."""
    def check(inputs: Specs, attrs: Attrs) -> None:
        x = inputs[0]
        for index, name in enumerate(paired, start=1):
            other = inputs[index]
            if tuple(other.shape) != tuple(x.shape):
                raise ShapeError("must have the shape of the first input", op=op,
                                 param=name, expected=tuple(x.shape), got=tuple(other.shape))
        if statistics:
            check_statistics(op, inputs[1], [("rstd", inputs[2])])
        _check_weight(op, x, inputs[-1])
    return check


def _statistics_shape(shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(shape)[:-1]


def _forward_shapes(residual: bool) -> Callable[[Specs, Attrs], list[tuple[int, ...]]]:
    def infer(inputs: Specs, attrs: Attrs) -> list[tuple[int, ...]]:
        shape = inputs[0].shape
        if is_unknown_rank(shape):
            return [UNKNOWN_RANK] * (3 if residual else 2)
        shapes = [tuple(shape), _statistics_shape(shape)]
        return [*shapes, tuple(shape)] if residual else shapes
    return infer


def _forward_dtypes(residual: bool) -> Callable[[Specs, Attrs], list[torch.dtype]]:
    """rms_norm's y: torch's promotion of x's and the weight's dtypes (``weight * x_hat``,
    as Hugging Face's RMSNorm modules compute it); add_rms_norm's outputs: x's dtype
    (CANN's AddRmsNorm)."""
    def infer(inputs: Specs, attrs: Attrs) -> list[torch.dtype]:
        dtype = inputs[0].dtype
        stats = statistics_dtype(dtype)
        if residual:
            return [dtype, stats, dtype]
        weight = inputs[1]
        return [dtype if weight is None else torch.promote_types(dtype, weight.dtype), stats]
    return infer


def _backward_shapes(inputs: Specs, attrs: Attrs) -> list[tuple[int, ...]]:
    shape, weight = inputs[0].shape, inputs[3]
    if is_unknown_rank(shape):
        return [UNKNOWN_RANK, (-1,)]
    return [tuple(shape), tuple(weight.shape) if weight is not None else (0,)]


def _backward_dtypes(inputs: Specs, attrs: Attrs) -> list[torch.dtype]:
    """grad_x in x's dtype (the gradient may arrive in y's promoted one), grad_weight in
    the weight's."""
    x, weight = inputs[1], inputs[3]
    return [x.dtype, weight.dtype if weight is not None else x.dtype]


def _cost(reads: int, writes: int) -> Callable[[Specs, Specs, Attrs], Cost]:
    def cost(inputs: Specs, outputs: Specs, attrs: Attrs) -> Cost:
        x = inputs[0]
        moved = (reads * x.numel + writes * outputs[0].numel) * x.itemsize
        return Cost(flops=4 * x.numel, bytes_moved=moved)
    return cost


def _geometry(inputs: Specs, attrs: Attrs) -> tuple[int, int]:
    return norm.rows_and_cols(inputs[0].shape, 1)


def _partial_sets(inputs: Specs) -> int:
    return int(inputs[3] is not None)


def _samples(dtype: torch.dtype, device: torch.device, generator: torch.Generator
             ) -> list[Case]:
    def x(*shape: int, scale: float = 3.0, of: torch.dtype = dtype) -> torch.Tensor:
        return random_input(shape, of, device, generator, scale=scale)

    near_max = (torch.rand(4, 1000, generator=generator) * 0.5 + 0.5) \
        * torch.finfo(torch.float16).max
    return [
        Case("rows_63x1000", (x(63, 1000), x(1000, scale=1.0)), {}),
        Case("no_weight", (x(7, 33), None), {"eps": 1e-5}),
        Case("weight_fp32", (x(5, 129), x(129, scale=1.0, of=torch.float32)), {}),
        Case("near_fp16_max", (near_max.to(dtype=dtype, device=device),
                               x(1000, scale=1.0)), {}),
        Case("tiny_eps_dominates", (x(3, 64, scale=1e-4), x(64)), {"eps": 1e-2}),
        Case("rank3", (x(2, 3, 70), x(70)), {}),
        Case("long_row_70000", (x(2, 70000), x(70000, scale=1.0)), {}),
        Case("transposed", (x(33, 17).t(), x(33)), {}),
        Case("zero_rows", (x(0, 8), x(8)), {}),
    ]


def _add_samples(dtype: torch.dtype, device: torch.device, generator: torch.Generator
                 ) -> list[Case]:
    return [Case(case.name, (case.inputs[0], torch.flip(case.inputs[0], (0,)) * 0.5,
                             case.inputs[1]), case.attrs)
            for case in _samples(dtype, device, generator)]


def _backward_samples(dtype: torch.dtype, device: torch.device, generator: torch.Generator
                      ) -> list[Case]:
    cases = []
    for case in _samples(dtype, device, generator):
        x, weight = case.inputs
        grad = random_input(tuple(x.shape), dtype, device, generator, scale=1.0)
        eps = case.attrs.get("eps", EPS.default)
        rstd = torch.rsqrt(x.float().square().mean(-1) + eps) if x.numel() else \
            torch.empty(x.shape[:-1], device=device)
        cases.append(Case(case.name, (grad, x, rstd, weight)))
    return cases


def _sweep(residual: bool) -> Callable[..., list[Case]]:
    def sweep(kind: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
              generator: torch.Generator) -> list[Case]:
        """x (and the residual) drawn from the kind; a normal weight."""
        x = generate(kind, shape, dtype, device=device, generator=generator)
        weight = generate("normal", x.shape[-1:], dtype, device=device, generator=generator)
        if residual:
            other = generate(kind, shape, dtype, device=device, generator=generator)
            return [Case("", (x, other, weight))]
        return [Case("", (x, weight))]
    return sweep


def _backward_sweep(kind: str, shape: tuple[int, ...], dtype: torch.dtype,
                    device: torch.device, generator: torch.Generator) -> list[Case]:
    """grad and x drawn from the kind; rstd of x in float32; a normal weight."""
    grad = generate(kind, shape, dtype, device=device, generator=generator)
    x = generate(kind, shape, dtype, device=device, generator=generator)
    weight = generate("normal", x.shape[-1:], dtype, device=device, generator=generator)
    rstd = torch.rsqrt(x.double().square().mean(-1) + EPS.default).float() if x.numel() \
        else torch.empty(x.shape[:-1], device=device)
    return [Case("", (grad, x, rstd, weight))]


def _norm_scale(opdef: OpDef, inputs: Sequence[torch.Tensor | None], attrs: Attrs,
                golden: torch.Tensor, output: str) -> torch.Tensor:
    """|golden| for y, rstd and the sum; `_norm.gradient_scale` for the gradients."""
    if not opdef.name.endswith("backward") or not golden.numel():
        return golden.abs()
    grad, x, rstd, weight = inputs
    cols = x.shape[-1]
    grad, x = grad.reshape(-1, cols), x.reshape(-1, cols)
    rstd = rstd.reshape(-1, 1)
    g = grad * (weight if weight is not None else 1.0)
    return norm.gradient_scale(grad, x * rstd, rstd, g, golden, center=False)


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.nn.functional.rms_norm (a weight of another dtype multiplied after it, in the
    promoted dtype)"""
    if weight is not None and weight.dtype != x.dtype:
        y = torch.nn.functional.rms_norm(x, x.shape[-1:], None, eps) * weight
    else:
        y = torch.nn.functional.rms_norm(x, x.shape[-1:], weight, eps)
    rstd = torch.rsqrt(x.float().square().mean(-1) + eps)
    return y, rstd


def _torch_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                        eps: float) -> tuple[torch.Tensor, ...]:
    """x + residual, then torch.nn.functional.rms_norm"""
    total = x + residual
    return (*_torch_rms_norm(total, weight, eps), total)


def _torch_rms_norm_backward(grad: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor,
                             weight: torch.Tensor | None, eps: float
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.autograd through torch.nn.functional.rms_norm"""
    leaf = x.detach().requires_grad_()
    params = [leaf]
    scale = None
    if weight is not None:
        scale = weight.detach().to(x.dtype).requires_grad_()
        params.append(scale)
    with torch.enable_grad():
        y = torch.nn.functional.rms_norm(leaf, x.shape[-1:], scale, eps)
        grads = torch.autograd.grad(y, params, grad)
    return grads[0], (grads[1].to(weight.dtype) if weight is not None
                      else torch.empty(0, dtype=x.dtype, device=x.device))


RMS_NORM = OpDef(
    name="rms_norm", doc="x * rstd * weight, rstd = 1/sqrt(mean(x^2) + eps) in float32.",
    inputs=(TensorArg("x"), TensorArg("weight", FLOAT_DTYPES, optional=True)),
    outputs=(OutputArg("y"), OutputArg("rstd", differentiable=False)), attrs=(EPS,),
    infer_shape=_forward_shapes(False), infer_dtype=_forward_dtypes(False),
    check=_check("rms_norm", ()), cost=_cost(1, 1), tiling=norm.tiling(_geometry, 1),
    grid=norm.grid(_geometry), samples=_samples, autocast=AutocastPolicy.FP32,
    error_scale=_norm_scale,
    precision=PrecisionSpec("benchmark_ratio", "L2", _torch_rms_norm, sweep=_sweep(False),
                            known_limitations=(SHARED_ROW_STATISTIC,)),
    bench=BenchSpec(peers={"Liger-Kernel": liger_peer(
        "rms_norm", "LigerRMSNormFunction", lambda case: (*case.inputs, EPS.default))}),
    inplace_out=True)

ADD_RMS_NORM = OpDef(
    name="add_rms_norm", doc="s = x + residual; (s * rstd * weight, rstd, s), one read each.",
    inputs=(TensorArg("x"), TensorArg("residual"),
            TensorArg("weight", FLOAT_DTYPES, optional=True)),
    outputs=(OutputArg("y"), OutputArg("rstd", differentiable=False), OutputArg("sum")),
    attrs=(EPS,),
    infer_shape=_forward_shapes(True), infer_dtype=_forward_dtypes(True),
    check=_check("add_rms_norm", ("residual",)), cost=_cost(2, 2),
    tiling=norm.tiling(_geometry, 2), grid=norm.grid(_geometry), samples=_add_samples,
    autocast=AutocastPolicy.FP32, error_scale=_norm_scale,
    precision=PrecisionSpec("benchmark_ratio", "L2", _torch_add_rms_norm,
                            sweep=_sweep(True), known_limitations=(SHARED_ROW_STATISTIC,)),
    bench=BenchSpec())

RMS_NORM_BACKWARD = OpDef(
    name="rms_norm_backward", doc="(grad_x, grad_weight) of rms_norm from its saved rstd.",
    inputs=(TensorArg("grad"), TensorArg("x"), TensorArg("rstd", STATISTICS_DTYPES),
            TensorArg("weight", FLOAT_DTYPES, optional=True)),
    outputs=(OutputArg("grad_x"), OutputArg("grad_weight")), attrs=(EPS,),
    infer_shape=_backward_shapes, infer_dtype=_backward_dtypes,
    check=_check("rms_norm_backward", ("x",), statistics=True), cost=_cost(2, 1),
    tiling=norm.tiling(_geometry, 2), grid=norm.grid(_geometry, backward=True),
    workspace=norm.backward_workspace(_geometry, _partial_sets),
    kernel_costs=norm.backward_kernel_costs(_geometry, _partial_sets, _cost(2, 1)),
    samples=_backward_samples, error_scale=_norm_scale,
    precision=PrecisionSpec("benchmark_ratio", "L2", _torch_rms_norm_backward,
                            sweep=_backward_sweep, known_limitations=(
                                SHARED_ROW_STATISTIC, OVERFLOWING_ROW_SUM,
                                KnownLimitation(CANCELLING_GRADIENT, failures=(
                                    "max_rel ratio*", "small_value ratio*")))))


# ---------------------------------------------------------------------------------------------
# References


@RMS_NORM.reference
def reference(x: torch.Tensor, weight: torch.Tensor | None, *, compute_dtype: torch.dtype,
              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd) in ``compute_dtype``."""
    if x.ndim == 0:  # one row of one element, as the kernels take it
        y, rstd = reference(x.reshape(1), weight, compute_dtype=compute_dtype, eps=eps)
        return y.reshape(()), rstd
    wide = x.to(compute_dtype)
    if not wide.numel():
        return wide, wide.sum(-1)
    scale, inverse = norm.rescaled_inverse_rms(wide, wide.square().mean(-1, keepdim=True),
                                               (-1,), eps)
    y = (wide * scale) * inverse * (1.0 if weight is None else weight.to(compute_dtype))
    return y, (scale * inverse).squeeze(-1)


@ADD_RMS_NORM.reference
def add_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, *,
                  compute_dtype: torch.dtype, eps: float) -> tuple[torch.Tensor, ...]:
    """(y, rstd, x + residual) in ``compute_dtype``."""
    total = x.to(compute_dtype) + residual.to(compute_dtype)
    return (*reference(total, weight, compute_dtype=compute_dtype, eps=eps), total)


@RMS_NORM_BACKWARD.reference
def backward_reference(grad: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor,
                       weight: torch.Tensor | None, *, compute_dtype: torch.dtype,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_x, grad_weight) in ``compute_dtype`` from the saved rstd."""
    if x.ndim == 0:
        grad_x, grad_weight = backward_reference(grad.reshape(1), x.reshape(1), rstd, weight,
                                                 compute_dtype=compute_dtype, eps=eps)
        return grad_x.reshape(()), grad_weight
    grad, x = grad.to(compute_dtype), x.to(compute_dtype)
    rstd = rstd.to(compute_dtype).unsqueeze(-1)
    x_hat = x * rstd
    first, last = norm.rstd_split(rstd)  # the kernels' order of the roundings
    g = first * grad * (1.0 if weight is None else weight.to(compute_dtype))
    grad_x = last * (g - x_hat * (g * x_hat).mean(-1, keepdim=True)) if x.numel() else g
    if weight is None:
        return grad_x, torch.empty(0, dtype=compute_dtype, device=x.device)
    return grad_x, (grad * x_hat).reshape(-1, x.shape[-1]).sum(0)


# ---------------------------------------------------------------------------------------------
# Launchers (the kernels are `opforge.ops._norm`'s)


@RMS_NORM.launcher("triton")
def launch(plan: object, inputs: Sequence[torch.Tensor | None],
           outputs: Sequence[torch.Tensor], workspace: torch.Tensor | None) -> None:
    """Rows (or looped blocks) of x to (y, rstd)."""
    x, weight = inputs
    y, rstd = outputs
    norm.launch_forward(plan, x.shape[-1] if x.ndim else 1, x, None, weight, None, y, None,
                        rstd, None, center=False)


@ADD_RMS_NORM.launcher("triton")
def launch_add(plan: object, inputs: Sequence[torch.Tensor | None],
               outputs: Sequence[torch.Tensor], workspace: torch.Tensor | None) -> None:
    """Rows of x and residual to (y, rstd, x + residual), each read once."""
    x, residual, weight = inputs
    y, rstd, total = outputs
    norm.launch_forward(plan, x.shape[-1] if x.ndim else 1, x, residual, weight, None, y,
                        None, rstd, total, center=False)


@RMS_NORM_BACKWARD.launcher("triton")
def launch_backward(plan: object, inputs: Sequence[torch.Tensor | None],
                    outputs: Sequence[torch.Tensor], workspace: torch.Tensor | None) -> None:
    """grad_x row by row; grad_weight from per-program partials summed in order."""
    grad, x, rstd, weight = inputs
    grad_x, grad_weight = outputs
    norm.launch_backward(plan, x.shape[-1] if x.ndim else 1, grad, x, None, rstd, weight,
                         False, grad_x, grad_weight if weight is not None else None, None,
                         workspace, center=False)


# ---------------------------------------------------------------------------------------------
# Backward


def _setup_context(ctx: object, inputs: tuple[object, ...], output: tuple[object, ...]
                   ) -> None:
    *tensors, weight, eps = inputs
    ctx.save_for_backward(output[-1] if len(tensors) == 2 else tensors[0], output[1], weight)
    ctx.eps = eps
    ctx.residual = len(tensors) == 2


def _backward(ctx: object, grad_y: torch.Tensor, grad_rstd: torch.Tensor | None,
              grad_sum: torch.Tensor | None = None) -> tuple[torch.Tensor | None, ...]:
    x, rstd, weight = ctx.saved_tensors
    grad_x, grad_weight = RMS_NORM_BACKWARD(grad_y, x, rstd, weight,
                                                              ctx.eps)
    if grad_sum is not None:
        grad_x = grad_x + grad_sum
    weight_grad = grad_weight if weight is not None and ctx.needs_input_grad[-2] else None
    if ctx.residual:
        return grad_x, grad_x, weight_grad, None
    return grad_x, weight_grad, None


@RMS_NORM.autograd(_setup_context)
def backward(ctx: object, grad_y: torch.Tensor, grad_rstd: torch.Tensor | None
             ) -> tuple[torch.Tensor | None, ...]:
    """grad_x and grad_weight through `rms_norm_backward`; rstd is not differentiable."""
    return _backward(ctx, grad_y, grad_rstd)


@ADD_RMS_NORM.autograd(_setup_context)
def add_backward(ctx: object, grad_y: torch.Tensor, grad_rstd: torch.Tensor | None,
                 grad_sum: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """x and residual get the same gradient: rms_norm's grad_x plus the sum's gradient."""
    return _backward(ctx, grad_y, grad_rstd, grad_sum)


register_op(RMS_NORM_BACKWARD)
register_op(RMS_NORM)
register_op(ADD_RMS_NORM)


@RMS_NORM.exported
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
    return RMS_NORM(x, weight, eps)[0]


@ADD_RMS_NORM.exported
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                 eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused residual add and RMSNorm: ``s = x + residual`` (float32, rounded once to
    ``x.dtype``), returns ``(rms_norm(s, weight, eps), s)``, reading each input once.

    Raises:
        ShapeError: ``residual`` differs from ``x`` in shape, or a bad ``weight``.
        DtypeError: unsupported dtype. AttrError: bad ``eps``.
    """
    y, _, total = ADD_RMS_NORM(x, residual, weight, eps)
    return y, total
