"""LayerNorm over the trailing ``normalized_shape`` dims, and its gradient.

``layer_norm(x, weight, bias, normalized_shape, eps) -> (y, mean, rstd)`` as
``torch.ops.aten.native_layer_norm`` and CANN's LayerNorm: the mean and the variance of each
row are float32 and computed stably (two passes in registers, or Chan's merge of per-block
statistics of ``x - x[0]`` for rows longer than the chip holds; never ``E[x^2] - E[x]^2``,
which loses every digit for data like ``1e4 + N(0, 1)``; in registers the rough mean's
rounding is taken out of the deviations of rows far from zero, in blocks the shifted
values are exact, so y stays within a few float32 ulps there either way, where torch's
float32 LayerNorm loses about 1e-3), ``rstd = 1 / sqrt(var + eps)`` with the biased
variance, ``y = (x - mean) * rstd * weight + bias``. ``mean`` and ``rstd`` are float32
(float64 for float64 x) with x's leading shape; `opforge.layer_norm` returns ``y`` as
``torch.nn.functional.layer_norm`` does. ``normalized_shape=None`` normalises the last dim.

``layer_norm_backward(grad, x, mean, rstd, weight, bias, normalized_shape) -> (grad_x,
grad_weight, grad_bias)``; the weight and bias gradients are reduced from per-program
float32 partials in a fixed order (deterministic, no atomics) and are empty when the
forward had no weight or bias. ``x_hat = (x - mean) * rstd`` from the given statistics,
as aten's and CANN's backward compute it; with ``recentre=True`` (what the autograd
formula passes: its mean is the forward's own rough float32 mean) the rows variant takes
the mean's rounding out of ``x_hat`` as the forward took it out of y, so on rows like
``1e4 + N(0, 1)`` both gradients stay within a few float32 ulps of the exact gradient
(torch's float32 backward: about 2e-4). The looped variant and the torch backend's
reference recentre alike (the reference on every row that qualifies).

Tiling variants, kernels and launchers are `opforge.ops._norm`'s, with centering.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from opforge.core.errors import AttrError, ShapeError
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
    OVERFLOWING_ROW_SUMS,
    SHARED_ROW_STATISTIC,
)
from opforge.ops._statistics import STATISTICS_DTYPES, check_statistics, statistics_dtype
from opforge.precision.cases import generate

NORMALIZED_SHAPE = Attr("normalized_shape", "ints", None, range=(0, None),
                        doc="trailing dims to normalise (None: the last dim)")
EPS = Attr("eps", "float", 1e-5, range=(0.0, None), doc="added to the variance")
RECENTRE = Attr("recentre", "bool", False,
                doc="mean is the forward's own rough float32 mean of x (the autograd formula "
                    "says so): its rounding is taken out of x_hat where the mean stands "
                    "beyond the spread, as the forward took it out of y")


def _normalized(shape: Sequence[int], attrs: Attrs) -> tuple[int, ...]:
    given = attrs["normalized_shape"]
    return tuple(given) if given is not None else tuple(shape)[-1:]


def _geometry(inputs: Specs, attrs: Attrs) -> tuple[int, int]:
    return norm.rows_and_cols(inputs[0].shape, len(_normalized(inputs[0].shape, attrs)))


def _check(op: str, first_param: int) -> Callable[[Specs, Attrs], None]:
    """normalized_shape ends x's shape; weight and bias have it; a gradient has x's shape;
    mean and rstd have x's leading shape."""
    def check(inputs: Specs, attrs: Attrs) -> None:
        x = inputs[first_param]
        if is_unknown_rank(x.shape):
            return
        shape = tuple(x.shape)
        normalized = _normalized(shape, attrs)
        if not normalized or shape[len(shape) - len(normalized):] != normalized:
            raise AttrError("must equal the trailing dims of x", op=op,
                            param="normalized_shape", expected=shape[-len(normalized):]
                            if normalized else "at least one dim", got=normalized)
        if first_param:
            expected = {"x": shape, "mean": shape[:len(shape) - len(normalized)],
                        "rstd": shape[:len(shape) - len(normalized)]}
            for spec, name in zip(inputs[:4], ("grad", "x", "mean", "rstd")):
                want = expected.get(name, shape)
                if tuple(spec.shape) != want:
                    raise ShapeError(f"must have shape {want}", op=op, param=name,
                                     expected=want, got=tuple(spec.shape))
            check_statistics(op, x, [("mean", inputs[2]), ("rstd", inputs[3])])
        for spec, name in zip(inputs[-2:], ("weight", "bias")):
            if spec is not None and tuple(spec.shape) != normalized:
                raise ShapeError("must have the normalized shape", op=op, param=name,
                                 expected=normalized, got=tuple(spec.shape))
    return check


def _forward_shapes(inputs: Specs, attrs: Attrs) -> list[tuple[int, ...]]:
    shape = inputs[0].shape
    if is_unknown_rank(shape):
        return [UNKNOWN_RANK, UNKNOWN_RANK, UNKNOWN_RANK]
    leading = tuple(shape)[:len(shape) - len(_normalized(shape, attrs))]
    return [tuple(shape), leading, leading]


def _forward_dtypes(inputs: Specs, attrs: Attrs) -> list[torch.dtype]:
    stats = statistics_dtype(inputs[0].dtype)
    return [inputs[0].dtype, stats, stats]


def _backward_shapes(inputs: Specs, attrs: Attrs) -> list[tuple[int, ...]]:
    shape = inputs[1].shape
    if is_unknown_rank(shape):
        return [UNKNOWN_RANK, (-2,), (-2,)]
    return [tuple(shape)] + [tuple(spec.shape) if spec is not None else (0,)
                             for spec in inputs[4:6]]


def _backward_dtypes(inputs: Specs, attrs: Attrs) -> list[torch.dtype]:
    return [inputs[1].dtype] + [spec.dtype if spec is not None else inputs[1].dtype
                                for spec in inputs[4:6]]


def _cost(reads: int) -> Callable[[Specs, Specs, Attrs], Cost]:
    def cost(inputs: Specs, outputs: Specs, attrs: Attrs) -> Cost:
        x = inputs[0]
        return Cost(flops=8 * x.numel, bytes_moved=(reads + 1) * x.numel * x.itemsize)
    return cost


def _backward_geometry(inputs: Specs, attrs: Attrs) -> tuple[int, int]:
    return _geometry(inputs[1:], attrs)


def _partial_sets(inputs: Specs) -> int:
    return sum(spec is not None for spec in inputs[4:6])


def _samples(dtype: torch.dtype, device: torch.device, generator: torch.Generator
             ) -> list[Case]:
    def x(*shape: int, scale: float = 3.0, of: torch.dtype = dtype) -> torch.Tensor:
        return random_input(shape, of, device, generator, scale=scale)

    offset = float(min(1e4, torch.finfo(dtype).max / 16))
    return [
        Case("rows_63x1000", (x(63, 1000), x(1000, scale=1.0), x(1000)), {}),
        Case("around_1e4", ((x(7, 1000, scale=1.0, of=torch.float64) + offset).to(dtype),
                            x(1000, scale=1.0), x(1000)), {}),
        Case("no_affine", (x(7, 33), None, None), {"eps": 1e-6}),
        Case("weight_only_fp32", (x(5, 129), x(129, scale=1.0, of=torch.float32), None), {}),
        Case("normalized_2d", (x(2, 3, 35), x(3, 35, scale=1.0), x(3, 35)),
             {"normalized_shape": (3, 35)}),
        Case("constant_rows", (torch.full((3, 64), 2.5, dtype=dtype, device=device),
                               x(64), x(64)), {}),
        Case("long_row_70000", (x(2, 70000), x(70000, scale=1.0), x(70000)), {}),
        Case("transposed", (x(33, 17).t(), x(33), x(33)), {}),
        Case("zero_rows", (x(0, 8), x(8), x(8)), {}),
    ]


def _statistics(x: torch.Tensor, normalized: int, eps: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    dims = tuple(range(x.ndim - normalized, x.ndim))
    wide = x.double()
    if not x.numel():
        empty = wide.sum(dims)
        return empty.float(), empty.float()
    mean = wide.mean(dims)
    var = wide.var(dims, unbiased=False)
    return mean.float(), torch.rsqrt(var + eps).float()


def _backward_samples(dtype: torch.dtype, device: torch.device, generator: torch.Generator
                      ) -> list[Case]:
    cases = []
    for case in _samples(dtype, device, generator):
        x, weight, bias = case.inputs
        normalized = len(case.attrs.get("normalized_shape", (1,)))
        mean, rstd = _statistics(x, normalized, case.attrs.get("eps", EPS.default))
        grad = random_input(tuple(x.shape), dtype, device, generator, scale=1.0)
        cases.append(Case(case.name, (grad, x, mean, rstd, weight, bias), case.attrs))
    return cases


def _sweep(kind: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
           generator: torch.Generator) -> list[Case]:
    """x drawn from the kind; a normal weight and bias."""
    x = generate(kind, shape, dtype, device=device, generator=generator)
    weight = generate("normal", x.shape[-1:], dtype, device=device, generator=generator)
    bias = generate("normal", x.shape[-1:], dtype, device=device, generator=generator)
    return [Case("", (x, weight, bias))]


def _backward_sweep(kind: str, shape: tuple[int, ...], dtype: torch.dtype,
                    device: torch.device, generator: torch.Generator) -> list[Case]:
    """grad and x drawn from the kind; x's float32 statistics; a normal weight and bias."""
    grad = generate(kind, shape, dtype, device=device, generator=generator)
    x, weight, bias = _sweep(kind, shape, dtype, device, generator)[0].inputs
    mean, rstd = _statistics(x, 1, EPS.default)
    return [Case("", (grad, x, mean, rstd, weight, bias))]


def _error_scale(opdef: OpDef, inputs: Sequence[torch.Tensor | None], attrs: Attrs,
                 golden: torch.Tensor, output: str) -> torch.Tensor:
    """Subtracting a float32 mean moves x - mean by eps (|x| + mean|x|): y is judged against
    |y| + rstd (|x| + mean|x|) |weight| + |bias|; the mean, a sum, against mean |x|; rstd against
    rstd (1 + mean|x| rstd); the gradients by `_norm.gradient_scale` plus the same
    eps |x| rstd shift of x_hat."""
    backward = opdef.name.endswith("backward")
    x = inputs[1] if backward else inputs[0]
    if not golden.numel() or not x.numel():
        return golden.abs()
    normalized = _normalized(x.shape, attrs)
    cols = math.prod(normalized)
    rows_x = x.reshape(-1, cols)
    if output == "mean":
        return golden.abs() + rows_x.abs().mean(-1).reshape(golden.shape)
    if output == "rstd":
        # Deviations off by eps |x| move the variance by eps |x| / sigma relative.
        spread = rows_x.abs().mean(-1).reshape(golden.shape) * golden.abs()
        return golden.abs() * (1.0 + spread.nan_to_num(0.0, 0.0, 0.0))
    mean, rstd = (inputs[2], inputs[3]) if backward else _statistics(x, len(normalized),
                                                                      attrs["eps"])
    mean, rstd = mean.double().reshape(-1, 1), rstd.double().reshape(-1, 1)
    weight = inputs[4] if backward else inputs[1]
    if output == "y":
        # x - mean carries the mean's rounding, eps mean|x|, besides eps |x|; and
        # x_hat * weight + bias cancels where the bias opposes (eps |bias|).
        scale_w = weight.reshape(1, -1).abs() if weight is not None else 1.0
        bias = inputs[2].reshape(1, -1).abs() if inputs[2] is not None else 0.0
        spread = rows_x.abs() + rows_x.abs().mean(-1, keepdim=True)
        return golden.abs() + (spread * rstd * scale_w + bias).reshape(golden.shape)
    grad = inputs[0].reshape(-1, cols)
    x_hat = (rows_x - mean) * rstd
    g = grad * (weight.reshape(1, -1) if weight is not None else 1.0)
    scale = norm.gradient_scale(grad, x_hat, rstd, g, golden, center=True)
    if output == "grad_x":
        return scale + (rows_x.abs() * rstd * rstd * g.abs()).reshape(golden.shape)
    if output == "grad_bias":
        return golden.abs() + grad.abs().sum(0).reshape(golden.shape)
    return scale + (grad * rows_x * rstd).abs().sum(0).reshape(golden.shape)


def _torch_layer_norm(x: torch.Tensor, weight: torch.Tensor | None,
                      bias: torch.Tensor | None, normalized_shape: Sequence[int] | None,
                      eps: float) -> tuple[torch.Tensor, ...]:
    """torch.ops.aten.native_layer_norm"""
    normalized = _normalized(x.shape, {"normalized_shape": normalized_shape})
    y, mean, rstd = torch.ops.aten.native_layer_norm(
        x, normalized, None if weight is None else weight.to(x.dtype),
        None if bias is None else bias.to(x.dtype), eps)
    leading = x.shape[:x.ndim - len(normalized)]
    return y, mean.float().reshape(leading), rstd.float().reshape(leading)


def _torch_layer_norm_backward(grad: torch.Tensor, x: torch.Tensor, mean: torch.Tensor,
                               rstd: torch.Tensor, weight: torch.Tensor | None,
                               bias: torch.Tensor | None,
                               normalized_shape: Sequence[int] | None, eps: float,
                               recentre: bool = False) -> tuple[torch.Tensor, ...]:
    """torch.ops.aten.native_layer_norm_backward (which has no recentring)"""
    normalized = _normalized(x.shape, {"normalized_shape": normalized_shape})
    kept = (*x.shape[:x.ndim - len(normalized)], *([1] * len(normalized)))
    # aten keeps the statistics of 16-bit inputs in float32 on CUDA, in the input dtype on
    # the CPU, and its backward insists on the same.
    low = x.dtype in (torch.float16, torch.bfloat16)
    stats = torch.float32 if x.device.type == "cuda" and low else x.dtype
    dx, dw, db = torch.ops.aten.native_layer_norm_backward(
        grad, x, normalized, mean.reshape(kept).to(stats), rstd.reshape(kept).to(stats),
        None if weight is None else weight.to(x.dtype),
        None if bias is None else bias.to(x.dtype), [True, weight is not None,
                                                     bias is not None])
    empty = torch.empty(0, dtype=x.dtype, device=x.device)
    return (dx, empty if dw is None else dw.to(weight.dtype),
            empty if db is None else db.to(bias.dtype))


CANCELLING_MEAN = KnownLimitation(
    "The saved mean of a row whose values centre near zero is a cancelling float32 sum: its "
    "relative error there is large for opforge and torch alike, and which is larger is "
    "rounding luck (the absolute error stays at a few ulp of the row's magnitude).",
    failures=("max_rel ratio*", "mean_rel ratio* [[]mean[]]"))

# NOTE: H200, bf16 8192 x 8192 (results/gpu_2026-12-04, kernel_breakdown run 2): the
# forward's one-row tile (three row sums) took 94.6 µs at 8 warps, 32 values a thread,
# against 110.8 at 16; rms_norm's (one sum) was faster at 16 (75.2 against 79.9). Tiles
# of several rows (unmeasured) and one-row tiles past 8 warps keep 16: at 16 warps, 32
# values a thread spill at sm_90 (8 B, float32, 16384 columns).
ONE_ROW_VALUES_PER_THREAD = 32

LAYER_NORM = OpDef(
    name="layer_norm", doc="(x - mean) * rstd * weight + bias over the trailing dims; float32 "
                           "mean and rstd, stable variance.",
    inputs=(TensorArg("x"), TensorArg("weight", FLOAT_DTYPES, optional=True),
            TensorArg("bias", FLOAT_DTYPES, optional=True)),
    outputs=(OutputArg("y"), OutputArg("mean", differentiable=False),
             OutputArg("rstd", differentiable=False)),
    attrs=(NORMALIZED_SHAPE, EPS), infer_shape=_forward_shapes, infer_dtype=_forward_dtypes,
    check=_check("layer_norm", 0), cost=_cost(1),
    tiling=norm.tiling(_geometry, 1, one_row=ONE_ROW_VALUES_PER_THREAD),
    grid=norm.grid(_geometry), samples=_samples, autocast=AutocastPolicy.FP32,
    error_scale=_error_scale,
    precision=PrecisionSpec("benchmark_ratio", "L2", _torch_layer_norm, sweep=_sweep,
                            known_limitations=(SHARED_ROW_STATISTIC, OVERFLOWING_ROW_SUMS,
                                               CANCELLING_MEAN)),
    bench=BenchSpec(peers={"Liger-Kernel": liger_peer(
        "layer_norm", "LigerLayerNormFunction", lambda case: (*case.inputs, EPS.default))}),
    inplace_out=True)

LAYER_NORM_BACKWARD = OpDef(
    name="layer_norm_backward", doc="(grad_x, grad_weight, grad_bias) of layer_norm from its "
                                    "saved mean and rstd.",
    inputs=(TensorArg("grad"), TensorArg("x"), TensorArg("mean", STATISTICS_DTYPES),
            TensorArg("rstd", STATISTICS_DTYPES),
            TensorArg("weight", FLOAT_DTYPES, optional=True),
            TensorArg("bias", FLOAT_DTYPES, optional=True)),
    outputs=(OutputArg("grad_x"), OutputArg("grad_weight"), OutputArg("grad_bias")),
    attrs=(NORMALIZED_SHAPE, EPS, RECENTRE), infer_shape=_backward_shapes,
    infer_dtype=_backward_dtypes, check=_check("layer_norm_backward", 1), cost=_cost(2),
    tiling=norm.tiling(_backward_geometry, 2),
    grid=norm.grid(_backward_geometry, backward=True),
    workspace=norm.backward_workspace(_backward_geometry, _partial_sets),
    kernel_costs=norm.backward_kernel_costs(_backward_geometry, _partial_sets, _cost(2)),
    samples=_backward_samples, error_scale=_error_scale,
    precision=PrecisionSpec("benchmark_ratio", "L2", _torch_layer_norm_backward,
                            sweep=_backward_sweep, known_limitations=(
                                SHARED_ROW_STATISTIC, OVERFLOWING_ROW_SUM,
                                KnownLimitation(CANCELLING_GRADIENT, failures=(
                                    "max_rel ratio*", "small_value ratio*")))))


# ---------------------------------------------------------------------------------------------
# References


@LAYER_NORM.reference
def reference(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, *,
              compute_dtype: torch.dtype, normalized_shape: Sequence[int] | None,
              eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, mean, rstd) in ``compute_dtype``, the variance by two passes, corrected as the
    kernel's where the mean stands beyond the spread (the rough mean's rounding taken out
    of the deviations; the saved mean is the rough one)."""
    normalized = _normalized(x.shape, {"normalized_shape": normalized_shape})
    dims = tuple(range(x.ndim - len(normalized), x.ndim))
    wide = x.to(compute_dtype)
    if not wide.numel():
        empty = wide.sum(dims)
        return wide, empty, empty
    mean = wide.mean(dims, keepdim=True)
    deviation = wide - mean
    variance = deviation.square().mean(dims, keepdim=True)
    offset = (mean.square() > variance) & mean.isfinite()
    correction = torch.where(offset, deviation.mean(dims, keepdim=True), 0.0)
    deviation = deviation - correction
    scale, inverse = norm.rescaled_inverse_rms(deviation, variance - correction.square(),
                                               dims, eps)
    rstd = scale * inverse
    y = (deviation * scale) * inverse
    if weight is not None:
        y = y * weight.to(compute_dtype)
    if bias is not None:
        y = y + bias.to(compute_dtype)
    return y, mean.reshape(mean.shape[:len(mean.shape) - len(dims)]), \
        rstd.reshape(rstd.shape[:len(rstd.shape) - len(dims)])


@LAYER_NORM_BACKWARD.reference
def backward_reference(grad: torch.Tensor, x: torch.Tensor, mean: torch.Tensor,
                       rstd: torch.Tensor, weight: torch.Tensor | None,
                       bias: torch.Tensor | None, *, compute_dtype: torch.dtype,
                       normalized_shape: Sequence[int] | None, eps: float,
                       recentre: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_x, grad_weight, grad_bias) in ``compute_dtype`` from the saved statistics;
    ``recentre``: x_hat less its row mean where ``mean^2 * rstd^2 > 1`` (a finite mean
    beyond the spread)."""
    normalized = _normalized(x.shape, {"normalized_shape": normalized_shape})
    cols = math.prod(normalized)
    grad_rows = grad.to(compute_dtype).reshape(-1, cols)
    row_mean = mean.to(compute_dtype).reshape(-1, 1)
    row_rstd = rstd.to(compute_dtype).reshape(-1, 1)
    x_hat = (x.to(compute_dtype).reshape(-1, cols) - row_mean) * row_rstd
    if recentre and x.numel():
        offset = (row_mean * row_mean * row_rstd * row_rstd > 1) & row_mean.isfinite()
        x_hat = x_hat - torch.where(offset, x_hat.mean(-1, keepdim=True), 0.0)
    first, last = norm.rstd_split(row_rstd)  # the kernels' order of the roundings
    g = first * grad_rows * (weight.to(compute_dtype).reshape(1, -1)
                             if weight is not None else 1.0)
    if x.numel():
        grad_x = last * (g - g.mean(-1, keepdim=True)
                         - x_hat * (g * x_hat).mean(-1, keepdim=True))
    else:
        grad_x = g
    empty = torch.empty(0, dtype=compute_dtype, device=x.device)
    grad_weight = (grad_rows * x_hat).sum(0).reshape(normalized) if weight is not None \
        else empty
    grad_bias = grad_rows.sum(0).reshape(normalized) if bias is not None else empty
    return grad_x.reshape(x.shape), grad_weight, grad_bias


# ---------------------------------------------------------------------------------------------
# Launchers (the kernels are `opforge.ops._norm`'s)


@LAYER_NORM.launcher("triton")
def launch(plan: object, inputs: Sequence[torch.Tensor | None],
           outputs: Sequence[torch.Tensor], workspace: torch.Tensor | None) -> None:
    """Rows (or looped blocks) of x to (y, mean, rstd)."""
    x, weight, bias = inputs
    y, mean, rstd = outputs
    _, cols = _geometry(plan.inputs, plan.attrs)
    norm.launch_forward(plan, cols, x, None, weight, bias, y, mean, rstd, None, center=True)


@LAYER_NORM_BACKWARD.launcher("triton")
def launch_backward(plan: object, inputs: Sequence[torch.Tensor | None],
                    outputs: Sequence[torch.Tensor], workspace: torch.Tensor | None) -> None:
    """grad_x row by row; grad_weight and grad_bias from per-program partials."""
    grad, x, mean, rstd, weight, bias = inputs
    grad_x, grad_weight, grad_bias = outputs
    _, cols = _backward_geometry(plan.inputs, plan.attrs)
    norm.launch_backward(plan, cols, grad, x, mean, rstd, weight, bias is not None, grad_x,
                         grad_weight if weight is not None else None,
                         grad_bias if bias is not None else None, workspace, center=True,
                         recentre=plan.attrs["recentre"])


# ---------------------------------------------------------------------------------------------
# Backward


def _setup_context(ctx: object, inputs: tuple[object, ...], output: tuple[object, ...]
                   ) -> None:
    x, weight, bias, normalized_shape, eps = inputs
    ctx.save_for_backward(x, output[1], output[2], weight, bias)
    ctx.normalized_shape = normalized_shape
    ctx.eps = eps


@LAYER_NORM.autograd(_setup_context)
def backward(ctx: object, grad_y: torch.Tensor, grad_mean: torch.Tensor | None,
             grad_rstd: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """Through `layer_norm_backward`, recentring x_hat (the saved mean is the forward's
    own); mean and rstd are not differentiable."""
    x, mean, rstd, weight, bias = ctx.saved_tensors
    grad_x, grad_weight, grad_bias = LAYER_NORM_BACKWARD(
        grad_y, x, mean, rstd, weight, bias, ctx.normalized_shape, ctx.eps, True)
    return (grad_x, grad_weight if weight is not None else None,
            grad_bias if bias is not None else None, None, None)


register_op(LAYER_NORM_BACKWARD)
register_op(LAYER_NORM)


@LAYER_NORM.exported
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
    elif not isinstance(normalized_shape, (list, torch.Tensor)):
        normalized_shape = list(normalized_shape)  # a tuple, torch.Size, range
    return LAYER_NORM(x, weight, bias, normalized_shape, eps)[0]
