"""Cross-entropy of logits against class indices, and its gradient.

``cross_entropy(logits, target, ignore_index=-100, reduction="mean", label_smoothing=0.0)``
is ``torch.nn.functional.cross_entropy`` for logits ``[N, C]`` and class indices ``[N]``
(int64 or int32). Row ``i`` with target ``t`` loses

    loss_i = lse_i - (1 - eps) x[i, t] - eps * mean_j x[i, j],   lse_i = log sum_j exp(x[i, j])

with the log-sum-exp in float32 (the row max subtracted first, so no ``exp`` overflows) and
``eps`` the label smoothing; a row whose target is ``ignore_index`` loses 0 and leaves the
mean's count. ``mean`` divides the float32 sum of the rows by that count (NaN when every
row is ignored, as torch), ``sum`` adds them, ``none`` returns the rows. ``lse`` is a second
output, float32 (float64 for float64 logits): the backward reads it instead of the max and
sum again,

    cross_entropy_backward(grad, logits, target, lse) = w_i (exp(x - lse_i) - eps / C
                                                            - (1 - eps) [j == t]),

``w_i`` the row's weight in the reduction (``grad_i``, ``grad``, ``grad / count``; 0 for an
ignored row). Variants: ``rows`` (``BLOCK_M`` whole rows on chip: one read of the logits)
and ``looped`` (a row too long for the chip, a 128k vocabulary: one pass over its blocks
with the running max and sum of the online softmax). The backward's tiles are independent
given ``lse``: one read of the logits and one write of the gradient at any length. A
target outside ``[0, C)`` that is not ``ignore_index`` is an ``IndexRangeError`` before any
kernel (one host read of the targets' extremes, skipped where host reads are not allowed:
the kernels then read no logit for it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from opforge.core import backends
from opforge.core.errors import IndexRangeError, ShapeError
from opforge.core.hardware import HardwareProfile
from opforge.core.opdef import (
    Attr,
    Attrs,
    AutocastPolicy,
    BenchSpec,
    Case,
    Cost,
    OpDef,
    OutputArg,
    PrecisionSpec,
    Specs,
    TensorArg,
    Tiling,
)
from opforge.core.shapes import is_unknown_rank
from opforge.core.tiling import (
    INT32_LIMIT,
    LOOP_BLOCK,
    ROWS_TILE,
    cdiv,
    gpu_warps,
    launch_options,
    next_power_of_2,
    persistent_grid,
    rows_then_looped,
)
from opforge.library import register_op
from opforge.ops._elementwise import random_input
from opforge.ops._math import finite_shift, jit, rounded_for, tl, widen
from opforge.ops._rows import SHARED_ROW_STATISTIC
from opforge.ops._statistics import STATISTICS_DTYPES, check_statistics, statistics_dtype
from opforge.precision.cases import generate

NAME = "cross_entropy"
BACKWARD_NAME = "cross_entropy_backward"
INDEX_DTYPES = (torch.int64, torch.int32)
REDUCTIONS = ("none", "mean", "sum")
ATTRS = (Attr("ignore_index", "int", -100, doc="a target of this value loses 0 and is not "
              "counted"),
         Attr("reduction", "str", "mean", choices=REDUCTIONS, doc="none: one loss per row"),
         Attr("label_smoothing", "float", 0.0, range=(0.0, 1.0),
              doc="weight of the uniform distribution mixed into the target"))
SUM_BLOCK = 1024


def _geometry(inputs: Specs) -> tuple[int, int]:
    rows, classes = inputs[-3 if len(inputs) == 4 else 0].shape  # the logits
    return rows, classes


def _check(op: str, backward: bool) -> object:
    def check(inputs: Specs, attrs: Attrs) -> None:
        logits, target = (inputs[1], inputs[2]) if backward else inputs[:2]
        if is_unknown_rank(logits.shape) or is_unknown_rank(target.shape):
            return
        if len(logits.shape) != 2:
            raise ShapeError("must be 2-D: rows of class scores", op=op, param="logits",
                             expected="[N, C]", got=tuple(logits.shape))
        rows, classes = logits.shape
        if classes == 0:
            raise ShapeError("has no classes", op=op, param="logits", expected="C >= 1",
                             got=tuple(logits.shape))
        if tuple(target.shape) != (rows,):
            raise ShapeError("must hold one class index per row of logits", op=op,
                             param="target", expected=(rows,), got=tuple(target.shape))
        if backward:
            grad, lse = inputs[0], inputs[3]
            want = (rows,) if attrs["reduction"] == "none" else ()
            if tuple(grad.shape) != want:
                raise ShapeError("must have the loss's shape", op=op, param="grad",
                                 expected=want, got=tuple(grad.shape))
            if tuple(lse.shape) != (rows,):
                raise ShapeError("must hold one log-sum-exp per row", op=op, param="lse",
                                 expected=(rows,), got=tuple(lse.shape))
            check_statistics(op, logits, [("lse", lse)])
    return check


def loss_shapes(rows_spec: object, attrs: Attrs) -> list[tuple[int, ...]]:
    """(loss, lse) shapes for rows of ``rows_spec`` (the logits, or a head's input)."""
    rows = rows_spec.shape[0] if not is_unknown_rank(rows_spec.shape) else -1
    return [(rows,) if attrs["reduction"] == "none" else (), (rows,)]


def _forward_dtypes(inputs: Specs, attrs: Attrs) -> list[torch.dtype]:
    return [inputs[0].dtype, statistics_dtype(inputs[0].dtype)]


def _cost(backward: bool) -> object:
    """The logits read once (and their gradient written once), the targets, the losses or
    their gradient, and the log-sum-exp."""
    def cost(inputs: Specs, outputs: Specs, attrs: Attrs) -> Cost:
        rows, classes = _geometry(inputs)
        elements = rows * classes
        if backward:
            grad, logits, target, lse = inputs
            rest = (grad, target, lse)
        else:
            logits, target = inputs
            rest = (target, *outputs)
        moved = elements * logits.itemsize * (2 if backward else 1) + sum(
            spec.numel * spec.itemsize for spec in rest)
        return Cost(flops=(5 if backward else 4) * elements, bytes_moved=moved)
    return cost


def _kernel_costs(tiling: Tiling, grid: tuple[int, ...], inputs: Specs, outputs: Specs,
                  attrs: Attrs) -> dict[str, Cost]:
    """With a reduction, the rows' float32 losses go through the workspace to the kernel
    that sums them in a fixed order."""
    if attrs["reduction"] == "none":
        return {}
    rows, _ = _geometry(inputs)
    whole = _cost(False)(inputs, outputs, attrs)
    partials = 4 * rows
    target = inputs[1].numel * inputs[1].itemsize
    loss = outputs[0].itemsize
    return {"_cross_entropy_kernel": Cost(whole.flops, whole.bytes_moved - loss + partials),
            "_sum_rows_kernel": Cost(rows, partials + target + loss)}


def _backward_workspace(tiling: Tiling, grid: tuple[int, ...], inputs: Specs,
                        outputs: Specs, attrs: Attrs) -> int:
    """The float32 count of kept targets, which the mean's gradient divides by."""
    return 4 if attrs["reduction"] == "mean" else 0


def _backward_kernel_costs(tiling: Tiling, grid: tuple[int, ...], inputs: Specs,
                           outputs: Specs, attrs: Attrs) -> dict[str, Cost]:
    """The mean's count of kept targets comes from its own one-program kernel."""
    if attrs["reduction"] != "mean":
        return {}
    rows, _ = _geometry(inputs)
    whole = _cost(True)(inputs, outputs, attrs)
    target = inputs[2].numel * inputs[2].itemsize
    return {"_cross_entropy_backward_kernel": Cost(whole.flops, whole.bytes_moved + 4),
            "_count_kept_kernel": Cost(rows, target + 4)}


def _tiling(backward: bool) -> object:
    """The forward: ``rows`` when ``BLOCK_M`` whole rows (and their float32 copies) fit on
    chip, else ``looped`` with shrinking blocks. The backward: tiles of ``BLOCK_M`` rows by
    ``BLOCK_N`` columns, any row length."""
    def tiling(inputs: Specs, outputs: Specs, attrs: Attrs, hardware: HardwareProfile
               ) -> list[Tiling]:
        rows, classes = _geometry(inputs)
        itemsize = inputs[1 if backward else 0].itemsize
        per_element = (2 if backward else 1) * itemsize + 4
        if not backward:
            # NOTE: H200, bf16 8192 x 8192 (results/gpu_2026-12-04, kernel_breakdown run 2):
            # 8 warps, 32 values a thread, 55 µs against 16 warps' 71; no variant spills
            # at sm_90 (compile-check). layer_norm's forward and softmax's backward, also
            # faster at 8 warps there, take 32 values a thread in one-row tiles only.
            return rows_then_looped(rows, classes, per_element, hardware,
                                    values_per_thread=32)
        return gradient_tilings(rows, classes, per_element, hardware)
    return tiling


def gradient_tilings(rows: int, classes: int, per_element: int, hardware: HardwareProfile,
                     max_rows: int = ROWS_TILE) -> list[Tiling]:
    """The gradient kernel's ``tiles`` of ``BLOCK_M`` rows (``max_rows`` at most) by
    ``BLOCK_N`` columns of [rows, classes] logits, the widest first; ``per_element``:
    on-chip bytes an element takes."""
    candidates = []
    block = min(next_power_of_2(max(classes, 1)), LOOP_BLOCK, hardware.max_tile_elements)
    while True:
        block_m = max(1, min(next_power_of_2(max(rows, 1)), ROWS_TILE // block, max_rows))
        candidates.append(Tiling("tiles", {"BLOCK_M": block_m, "BLOCK_N": block},
                                 block_m * block * per_element,
                                 options={"warps": gpu_warps(block_m * block, hardware)}))
        if block <= 16:
            return candidates
        block //= 2


def _grid(tiling: Tiling, inputs: Specs, outputs: Specs, attrs: Attrs,
          hardware: HardwareProfile) -> tuple[int, ...]:
    rows, classes = _geometry(inputs)
    if tiling.variant == "tiles":
        return gradient_grid(tiling, rows, classes, hardware)
    return (persistent_grid(cdiv(rows, tiling.blocks["BLOCK_M"]), hardware),)


def gradient_grid(tiling: Tiling, rows: int, classes: int, hardware: HardwareProfile
                  ) -> tuple[int]:
    """The gradient kernel's persistent grid over the tiles of [rows, classes] logits."""
    tiles = cdiv(rows, tiling.blocks["BLOCK_M"]) * cdiv(classes, tiling.blocks["BLOCK_N"])
    return (persistent_grid(tiles, hardware),)


def _workspace(tiling: Tiling, grid: tuple[int, ...], inputs: Specs, outputs: Specs,
               attrs: Attrs) -> int:
    """float32 row losses, summed by a second kernel, for ``mean`` and ``sum``."""
    return 0 if attrs["reduction"] == "none" else 4 * _geometry(inputs)[0]


def check_targets(plan: object, target: torch.Tensor, classes: int) -> None:
    """Every target is in ``[0, classes)`` or ``ignore_index``, by one host read of their
    extremes (skipped where host reads are not allowed: the kernels read no logit for a
    target out of range).

    Raises:
        IndexRangeError: a target out of range.
    """
    if not target.numel() or not backends.host_reads_allowed(target.device):
        return
    # ignore_index counted as class 0: a boolean selection of the kept targets and their
    # min and max were three synchronisations.
    kept = target.masked_fill(target == plan.attrs["ignore_index"], 0)
    extremes = torch.aminmax(kept)
    # One transfer from an accelerator; on the CPU two reads cost 2.5 µs less than a stack.
    low, high = (extremes.min.item(), extremes.max.item()) if kept.device.type == "cpu" \
        else torch.stack(extremes).tolist()
    if low < 0 or high >= classes:
        raise IndexRangeError("holds a class index outside the logits' columns",
                              op=plan.op.name, param="target",
                              expected=f"0..{classes - 1} or ignore_index "
                                       f"{plan.attrs['ignore_index']}",
                              got=low if low < 0 else high)


def _check_values(plan: object, inputs: Sequence[torch.Tensor | None]) -> None:
    check_targets(plan, inputs[2 if len(inputs) == 4 else 1], _geometry(plan.inputs)[1])


def checked_targets() -> contextlib.AbstractContextManager[None]:
    """Around a backward whose forward read its targets on the host: no second read (a
    compiled backward, traced once, checks as any call does)."""
    return contextlib.nullcontext() if torch.compiler.is_compiling() \
        else backends.device_side_checks()


def random_targets(rows: int, classes: int, device: torch.device, generator: torch.Generator,
             ignored: float = 0.0, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Random class indices, a share ``ignored`` of them -100."""
    target = torch.randint(0, classes, (rows,), generator=generator)
    if ignored:
        target[torch.rand(rows, generator=generator) < ignored] = -100
    return target.to(device=device, dtype=dtype)


def _samples(dtype: torch.dtype, device: torch.device, generator: torch.Generator
             ) -> list[Case]:
    def x(*shape: int, scale: float = 3.0) -> torch.Tensor:
        return random_input(shape, dtype, device, generator, scale=scale)

    def t(rows: int, classes: int, **kwargs: object) -> torch.Tensor:
        return random_targets(rows, classes, device, generator, **kwargs)

    big = float(min(1e4, torch.finfo(dtype).max / 8))
    special = torch.tensor([[0.0, 1.0, float("inf"), 2.0], [1.0, float("nan"), 0.0, -1.0],
                            [float("-inf")] * 4, [3.0, float("-inf"), 3.0, 3.0],
                            [-5.0, 0.5, 2.0, float("-inf")]], dtype=dtype, device=device)
    special_target = torch.tensor([1, 2, 0, 0, 1], device=device)
    return [
        Case("rows_37x1000", (x(37, 1000), t(37, 1000)), {}),
        Case("none_ignored_9x333", (x(9, 333), t(9, 333, ignored=0.3)), {"reduction": "none"}),
        Case("sum_smoothing_17x100", (x(17, 100), t(17, 100, ignored=0.2)),
             {"reduction": "sum", "label_smoothing": 0.1}),
        Case("mean_smoothing_ignore_3", (x(13, 64), t(13, 64)),
             {"ignore_index": 3, "label_smoothing": 0.25}),
        Case("around_1e4", (x(6, 500, scale=1.0) + big, t(6, 500)), {"reduction": "none"}),
        Case("long_rows_3x70000", (x(3, 70000), t(3, 70000)), {}),
        Case("int32_target", (x(11, 50), t(11, 50, dtype=torch.int32)), {}),
        Case("all_ignored", (x(4, 10), torch.full((4,), -100, device=device)), {}),
        Case("special", (special, special_target), {"reduction": "none"}),
        Case("special_smoothing", (special, special_target),
             {"reduction": "none", "label_smoothing": 0.1}),
        Case("one_class", (x(5, 1), t(5, 1)), {"reduction": "sum"}),
        Case("zero_rows", (x(0, 7), t(0, 7)), {"reduction": "none"}),
    ]


def _sweep(kind: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
           generator: torch.Generator) -> list[Case]:
    """The logits drawn from the kind (as rows of the last dim), targets uniform with a
    tenth ignored; mean, and the rows with label smoothing."""
    logits = generate(kind, shape, dtype, device=device, generator=generator)
    logits = logits.reshape(-1, logits.shape[-1]) if logits.ndim else logits.reshape(1, 1)
    target = random_targets(logits.shape[0], logits.shape[1], device, generator, ignored=0.1)
    return [Case("mean", (logits, target), {}),
            Case("none_smoothing", (logits, target),
                 {"reduction": "none", "label_smoothing": 0.1})]


def _backward_case(case: Case) -> Case:
    """A backward call from a forward one: a gradient of the loss's shape, the float64
    log-sum-exp rounded to the statistics dtype."""
    logits, target = case.inputs
    generator = torch.Generator().manual_seed(logits.numel())
    reduction = case.attrs.get("reduction", "mean")
    shape = (logits.shape[0],) if reduction == "none" else ()
    grad = torch.randn(shape, generator=generator).to(logits.device, logits.dtype)
    lse = torch.logsumexp(logits.double(), -1).to(statistics_dtype(logits.dtype))
    return Case(case.name, (grad, logits, target, lse), case.attrs)


def _backward_samples(dtype: torch.dtype, device: torch.device, generator: torch.Generator
                      ) -> list[Case]:
    return [_backward_case(case) for case in _samples(dtype, device, generator)]


def _backward_sweep(kind: str, shape: tuple[int, ...], dtype: torch.dtype,
                    device: torch.device, generator: torch.Generator) -> list[Case]:
    return [_backward_case(case) for case in _sweep(kind, shape, dtype, device, generator)]


def _bench_case(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                generator: torch.Generator) -> Case:
    rows, classes = shape
    return Case("", (random_input((rows, classes), dtype, device, generator),
                     random_targets(rows, classes, device, generator)), {})


def _row_weights(grad: torch.Tensor, target: torch.Tensor, attrs: Attrs) -> torch.Tensor:
    """Each row's weight in the reduction (0 for an ignored row), in grad's dtype."""
    valid = target != attrs["ignore_index"]
    if attrs["reduction"] == "none":
        weights = grad
    elif attrs["reduction"] == "sum":
        weights = grad.expand(target.shape)
    else:
        weights = (grad / valid.sum()).expand(target.shape)
    return torch.where(valid, weights, 0)


def gradient_spread(grad: torch.Tensor, logits: torch.Tensor, target: torch.Tensor,
                    lse: torch.Tensor, attrs: Attrs, magnitude: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """Each gradient element's error scale in float64: the row's weight times exp(x - lse)
    (1 + the error of x - lse in units of eps: |x - lse|, or ``magnitude + |lse|`` for
    logits that carry a rounding of ``magnitude``) plus the smoothing and target terms."""
    smoothing, classes = attrs["label_smoothing"], logits.shape[1]
    hit = torch.nn.functional.one_hot(target.long().clamp(0, classes - 1), classes)
    shifted = logits - lse[:, None]
    error = shifted.abs() if magnitude is None else magnitude + lse.abs()[:, None]
    # A -inf logit's probability is 0 exactly (0 * inf would hide the other terms).
    spread = (torch.exp(shifted) * (1 + error)).nan_to_num(0, 0, 0) \
        + smoothing / classes + (1 - smoothing) * hit
    weights = _row_weights(grad, target, attrs).abs()[:, None]
    return (weights * spread).nan_to_num(0, 0, 0)


def loss_scale(logits: torch.Tensor, target: torch.Tensor, attrs: Attrs,
               golden: torch.Tensor, output: str, magnitude: torch.Tensor | None = None
               ) -> torch.Tensor:
    """A loss's (or lse's) error scale from float64 ``logits``: a row against |lse| + |x_t|
    + eps_ls mean|x| + 1, with the logits' own rounding ``magnitude`` (when they carry one)
    in place of |x|; a reduction against the sum of its rows'."""
    if output == "lse" or not logits.numel():
        extra = 0.0 if magnitude is None or not logits.numel() else magnitude.amax(-1)
        return golden.abs() + (1.0 + extra if output == "lse" else 0.0)
    size = logits.abs() if magnitude is None else magnitude
    lse = torch.logsumexp(logits, -1)
    if magnitude is not None:
        lse = lse.abs() + magnitude.amax(-1)
    picked = size.gather(1, target.long().clamp(0, logits.shape[1] - 1)[:, None])[:, 0]
    rows = (lse.abs() + picked + attrs["label_smoothing"] * size.mean(-1)
            + 1.0).nan_to_num(0, 0, 0)
    rows = torch.where(target != attrs["ignore_index"], rows, 0)
    if attrs["reduction"] == "none":
        return rows + golden.abs()
    total = rows.sum()
    if attrs["reduction"] == "mean":
        total = total / (target != attrs["ignore_index"]).sum()
    return total + golden.abs()


def _error_scale(opdef: OpDef, inputs: Sequence[torch.Tensor | None], attrs: Attrs,
                 golden: torch.Tensor, output: str) -> torch.Tensor:
    """The float32 log-sum-exp rounds the row sum by eps relative, an absolute eps in lse:
    a row's loss is judged against |lse| + |x_t| + eps_ls mean|x| + 1 (a reduction against
    the sum of its rows'). The gradient's exp(x - lse) carries eps |x - lse| relative."""
    if opdef.name == BACKWARD_NAME:
        grad, logits, target, lse = (t.double() if t.is_floating_point() else t
                                     for t in inputs)
        if not logits.numel():
            return golden.abs()
        return gradient_spread(grad, logits, target, lse, attrs) + golden.abs()
    return loss_scale(inputs[0].double(), inputs[1], attrs, golden, output)


def torch_cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int,
                         reduction: str, label_smoothing: float
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.nn.functional.cross_entropy"""
    loss = torch.nn.functional.cross_entropy(logits, target.long(), ignore_index=ignore_index,
                                             reduction=reduction,
                                             label_smoothing=label_smoothing)
    return loss, torch.logsumexp(logits.to(statistics_dtype(logits.dtype)), -1)


def _torch_cross_entropy_backward(grad: torch.Tensor, logits: torch.Tensor,
                                  target: torch.Tensor, lse: torch.Tensor, ignore_index: int,
                                  reduction: str, label_smoothing: float) -> torch.Tensor:
    """torch.autograd through torch.nn.functional.cross_entropy"""
    leaf = logits.detach().requires_grad_()
    with torch.enable_grad():
        loss = torch.nn.functional.cross_entropy(leaf, target.long(), ignore_index=ignore_index,
                                                 reduction=reduction,
                                                 label_smoothing=label_smoothing)
        (grad_logits,) = torch.autograd.grad(loss, leaf, grad)
    return grad_logits


CROSS_ENTROPY = OpDef(
    name=NAME, doc="Cross-entropy of logits [N, C] against class indices [N] "
                   "(ignore_index, label smoothing, reduction), float32 log-sum-exp.",
    inputs=(TensorArg("logits"), TensorArg("target", INDEX_DTYPES)),
    outputs=(OutputArg("loss"), OutputArg("lse", differentiable=False)), attrs=ATTRS,
    infer_shape=lambda inputs, attrs: loss_shapes(inputs[0], attrs),
    infer_dtype=_forward_dtypes, check=_check(NAME, False),
    check_values=_check_values, cost=_cost(False), tiling=_tiling(False), grid=_grid,
    workspace=_workspace, kernel_costs=_kernel_costs, samples=_samples,
    autocast=AutocastPolicy.FP32, error_scale=_error_scale,
    precision=PrecisionSpec("benchmark_ratio", "L0", torch_cross_entropy, sweep=_sweep,
                            known_limitations=(SHARED_ROW_STATISTIC,)),
    bench=BenchSpec(shapes=((4096, 32000), (8192, 128256)),
                    cpu_shapes=((64, 1024), (256, 4096)), case=_bench_case))

CROSS_ENTROPY_BACKWARD = OpDef(
    name=BACKWARD_NAME, doc="grad_logits of cross_entropy from its saved log-sum-exp.",
    inputs=(TensorArg("grad"), TensorArg("logits"), TensorArg("target", INDEX_DTYPES),
            TensorArg("lse", STATISTICS_DTYPES)),
    outputs=(OutputArg("grad_logits"),), attrs=ATTRS,
    infer_shape=lambda inputs, attrs: [tuple(inputs[1].shape)],
    infer_dtype=lambda inputs, attrs: [inputs[1].dtype], check=_check(BACKWARD_NAME, True),
    check_values=_check_values, cost=_cost(True), tiling=_tiling(True), grid=_grid,
    workspace=_backward_workspace, kernel_costs=_backward_kernel_costs,
    samples=_backward_samples, error_scale=_error_scale,
    precision=PrecisionSpec("benchmark_ratio", "L0", _torch_cross_entropy_backward,
                            sweep=_backward_sweep, known_limitations=(SHARED_ROW_STATISTIC,)))


# ---------------------------------------------------------------------------------------------
# References


@CROSS_ENTROPY.reference
def reference(logits: torch.Tensor, target: torch.Tensor, *, compute_dtype: torch.dtype,
              ignore_index: int, reduction: str, label_smoothing: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, lse) in ``compute_dtype`` by the formula of the module docstring."""
    x = logits.to(compute_dtype)
    lse = torch.logsumexp(x, -1)
    valid = target != ignore_index
    picked = x.gather(1, torch.where(valid, target, 0).long()[:, None])[:, 0]
    loss = lse - (1 - label_smoothing) * picked
    if label_smoothing:
        # Each term divided first: near float32's largest, a row's plain sum overflows.
        loss = loss - label_smoothing * (x / x.shape[1]).sum(-1)
    loss = torch.where(valid, loss, 0)
    if reduction == "sum":
        loss = loss.sum()
    elif reduction == "mean":
        rows = max(loss.shape[0], 1)
        loss = (loss / rows).sum() * (rows / valid.sum())
    return loss, lse


@CROSS_ENTROPY_BACKWARD.reference
def backward_reference(grad: torch.Tensor, logits: torch.Tensor, target: torch.Tensor,
                       lse: torch.Tensor, *, compute_dtype: torch.dtype, ignore_index: int,
                       reduction: str, label_smoothing: float, first_class: int = 0,
                       classes: int | None = None) -> torch.Tensor:
    """The gradient formula of the module docstring in ``compute_dtype``, in place on one
    block of that dtype. ``logits`` may be a block of columns ``first_class ..`` of rows of
    ``classes`` (the fused linear cross-entropy's blocks of classes): the one-hot term
    where a target falls in the block, the smoothing term over all ``classes``."""
    width = logits.shape[1]
    classes = width if classes is None else classes
    weights = _row_weights(grad.to(compute_dtype), target,
                           {"ignore_index": ignore_index, "reduction": reduction})
    slope = (logits.to(compute_dtype) - lse.to(compute_dtype)[:, None]).exp_()
    if label_smoothing:
        slope -= label_smoothing / classes
    if width:
        column = target.long() - first_class
        inside = (column >= 0) & (column < width)
        slope.scatter_add_(1, column.clamp(0, width - 1)[:, None],
                           torch.where(inside, label_smoothing - 1.0, 0.0)
                           .to(compute_dtype)[:, None])
    return slope.mul_(weights[:, None])


# ---------------------------------------------------------------------------------------------
# Kernels


@jit
def shifted(x, shift):
    """``x - shift``, 0 where they are equal: a row's +inf less its +inf max is 0 (its
    exponential 1), not NaN, so that the sum of exponentials is NaN only for a NaN in the
    row (a GPU's max skips a NaN: the sum must carry it)."""
    return tl.where(x == shift, 0.0, x - shift)


@jit
def looped_row_statistics(x_rows, row_mask, N, inverse_n, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr):
    """(max, sum of exp(x - max), sum of x * inverse_n) of the BLOCK_M rows of N values
    that the pointers ``x_rows`` [BLOCK_M, 1] start, streamed in blocks of BLOCK_N by the
    online softmax (`row_lse` makes their lse). The sum of x is of terms divided first:
    near float32's largest, a plain row sum overflows."""
    cols = tl.arange(0, BLOCK_N)
    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        offsets = start + cols
        mask = row_mask[:, None] & (offsets < N)[None, :]
        x = widen(tl.load(x_rows + offsets[None, :], mask=mask, other=float("-inf")))
        new_max = tl.maximum(running_max, tl.max(x, axis=1))
        shift = finite_shift(new_max)
        # The sum so far was taken against the old max.
        running_sum = running_sum * tl.exp(shifted(running_max, shift)) \
            + tl.sum(tl.exp(shifted(x, shift[:, None])), axis=1)
        running_max = new_max
        total += tl.sum(tl.where(mask, x * inverse_n, 0.0), axis=1)
    return running_max, running_sum, total


@jit
def row_lse(top, exps):
    """The log-sum-exp of rows from their max and their sum of exponentials of `shifted`
    values: NaN for a row that holds a NaN (its sum), +inf for a row whose max is."""
    lse = tl.where(top == float("inf"), top, finite_shift(top) + tl.log(exps))
    return tl.where(exps != exps, exps, lse)


@jit
def _cross_entropy_kernel(x_ptr, target_ptr, loss_ptr, lse_ptr, M, N, stride_x,
                          ignore_index, smoothing, LOOPED: tl.constexpr, WIDE: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Each row's log-sum-exp and loss (0 for an ignored row) into ``lse_ptr`` and
    ``loss_ptr`` (the output, or float32 rows for the sum)."""
    cols = tl.arange(0, BLOCK_N)
    # The row mean for the smoothing adds x / N: near float32's largest, a plain row sum
    # overflows.
    inverse_n = 1.0 / N
    for block in range(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.num_programs(0)):
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        if WIDE:
            rows = rows.to(tl.int64)
        row_mask = rows < M
        x_rows = x_ptr + rows[:, None] * stride_x
        if LOOPED:
            top, exps, total = looped_row_statistics(x_rows, row_mask, N, inverse_n, BLOCK_M,
                                                     BLOCK_N)
        else:
            mask = row_mask[:, None] & (cols < N)[None, :]
            x = widen(tl.load(x_rows + cols[None, :], mask=mask, other=float("-inf")))
            top = tl.max(x, axis=1)
            exps = tl.sum(tl.exp(shifted(x, finite_shift(top)[:, None])), axis=1)
            total = tl.sum(tl.where(mask, x * inverse_n, 0.0), axis=1)
        lse = row_lse(top, exps)
        target = tl.load(target_ptr + rows, mask=row_mask, other=ignore_index)  # integer index
        kept = row_mask & (target != ignore_index)
        # A target outside the columns reads nothing (the host check raised before).
        inside = kept & (target >= 0) & (target < N)
        picked = widen(tl.load(x_ptr + rows * stride_x + target, mask=inside, other=0.0))
        loss = lse - (1.0 - smoothing) * picked
        # Smoothing 0 leaves out the row mean (0 * -inf would be NaN).
        loss = tl.where(smoothing > 0.0, loss - smoothing * total, loss)
        tl.store(lse_ptr + rows, rounded_for(lse, lse_ptr), mask=row_mask)
        tl.store(loss_ptr + rows, rounded_for(tl.where(kept, loss, 0.0), loss_ptr),
                 mask=row_mask)


@jit
def _kept(target_ptr, M, ignore_index, BLOCK: tl.constexpr):
    """The float32 count of targets other than ``ignore_index``."""
    count = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, M, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        in_range = offsets < M
        target = tl.load(target_ptr + offsets, mask=in_range, other=ignore_index)  # integer index
        count += tl.where(target != ignore_index, 1.0, 0.0)
    return tl.sum(count, axis=0)


@jit
def _sum_rows_kernel(loss_ptr, target_ptr, out_ptr, M, ignore_index, MEAN: tl.constexpr,
                     BLOCK: tl.constexpr):
    """The rows' float32 losses added in a fixed order by one program; for the mean,
    each divided by the row count first (rows of near float32's largest loss would
    overflow their plain sum), then scaled by rows / kept rows."""
    total = tl.zeros([BLOCK], dtype=tl.float32)
    inverse_m = 1.0 / tl.maximum(M, 1).to(tl.float32)
    for start in range(0, M, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        row_loss = tl.load(loss_ptr + offsets, mask=offsets < M, other=0.0)  # float32 partial
        if MEAN:
            row_loss = row_loss * inverse_m
        total += row_loss
    result = tl.sum(total, axis=0)
    if MEAN:
        result = result * (tl.maximum(M, 1).to(tl.float32) / _kept(target_ptr, M, ignore_index,
                                                                   BLOCK))
    tl.store(out_ptr, rounded_for(result, out_ptr))


@jit
def _count_kept_kernel(target_ptr, count_ptr, M, ignore_index, BLOCK: tl.constexpr):
    """The mean's divisor for the backward, by one program: a float32 count of targets
    other than ``ignore_index``."""
    tl.store(count_ptr, _kept(target_ptr, M, ignore_index, BLOCK))  # float32 statistic


@jit
def _cross_entropy_backward_kernel(grad_ptr, x_ptr, target_ptr, lse_ptr, count_ptr, dx_ptr,
                                   M, N, stride_x, first_class, classes, ignore_index,
                                   smoothing, PER_ROW: tl.constexpr, MEAN: tl.constexpr,
                                   WIDE: tl.constexpr, BLOCK_M: tl.constexpr,
                                   BLOCK_N: tl.constexpr):
    """Tiles of ``w_i (exp(x - lse_i) - smoothing / classes - (1 - smoothing) [j == t_i])``
    into a contiguous [M, N] ``dx_ptr``, for the N columns of classes ``first_class ..``
    of rows of ``classes`` (all of them: 0 and N; the fused linear cross-entropy's blocks
    of classes otherwise)."""
    col_tiles = tl.cdiv(N, BLOCK_N)
    for tile in range(tl.program_id(0), tl.cdiv(M, BLOCK_M) * col_tiles, tl.num_programs(0)):
        rows = (tile // col_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = (tile % col_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        if WIDE:
            rows = rows.to(tl.int64)
        row_mask = rows < M
        mask = row_mask[:, None] & (cols < N)[None, :]
        target = tl.load(target_ptr + rows, mask=row_mask, other=ignore_index)  # integer index
        if PER_ROW:
            weight = widen(tl.load(grad_ptr + rows, mask=row_mask, other=0.0))
        else:
            weight = widen(tl.load(grad_ptr + rows * 0))
            if MEAN:
                weight = weight / tl.load(count_ptr + rows * 0)  # float32 statistic
        weight = tl.where(row_mask & (target != ignore_index), weight, 0.0)
        lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)  # float32 statistic
        x = widen(tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask,
                          other=0.0))
        slope = tl.exp(x - lse[:, None]) - smoothing / classes
        slope = tl.where(cols[None, :] + first_class == target[:, None], slope - (1.0 - smoothing),
                         slope)
        outs = dx_ptr + rows[:, None] * N + cols[None, :]
        tl.store(outs, rounded_for(weight[:, None] * slope, dx_ptr), mask=mask)


# ---------------------------------------------------------------------------------------------
# Launchers


def _rows_of(logits: torch.Tensor) -> torch.Tensor:
    """The logits with unit column stride (the kernels step rows by their stride)."""
    return logits if logits.stride(1) == 1 or logits.shape[1] <= 1 else logits.contiguous()


def wide_offsets(logits: torch.Tensor) -> bool:
    rows, classes = logits.shape
    return max(rows * classes, (rows - 1) * logits.stride(0) + classes) > INT32_LIMIT


@CROSS_ENTROPY.launcher("triton")
def launch(plan: object, inputs: Sequence[torch.Tensor | None],
           outputs: Sequence[torch.Tensor], workspace: torch.Tensor | None) -> None:
    logits, target = _rows_of(inputs[0]), inputs[1].contiguous()
    loss, lse = outputs
    rows, classes = logits.shape
    reduction = plan.attrs["reduction"]
    # No rows: the sum kernel reads none, and writes 0 (sum) or 0 / 0 (mean).
    per_row = loss if reduction == "none" or not rows else \
        workspace.view(torch.float32)[:rows]
    if rows:
        _cross_entropy_kernel[plan.grid](
            logits, target, per_row, lse, rows, classes, logits.stride(0),
            plan.attrs["ignore_index"], plan.attrs["label_smoothing"],
            LOOPED=plan.tiling.variant == "looped", WIDE=wide_offsets(logits), **plan.tiling.blocks,
            **launch_options(plan.tiling))
    if reduction != "none":
        _sum_rows_kernel[(1,)](per_row, target, loss, rows, plan.attrs["ignore_index"],
                               MEAN=reduction == "mean", BLOCK=SUM_BLOCK)


def count_kept(target: torch.Tensor, ignore_index: int, count: torch.Tensor) -> None:
    """Into float32 ``count`` [1]: the targets other than ``ignore_index`` (the mean's
    divisor), by one program."""
    _count_kept_kernel[(1,)](target, count, target.shape[0], ignore_index, BLOCK=SUM_BLOCK)


def launch_gradient(tiling: Tiling, grid: tuple[int, ...], grad: torch.Tensor,
                    logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
                    count: torch.Tensor, grad_logits: torch.Tensor, attrs: Attrs,
                    first_class: int = 0, classes: int | None = None) -> None:
    """The gradient kernel on ``tiling`` (one of `gradient_tilings`) and its
    `gradient_grid`: ``grad_logits`` (contiguous, any float dtype) of ``logits`` [M, N]
    with unit column stride, the columns of classes ``first_class ..`` of rows of
    ``classes`` (N when None); ``grad``, ``target`` and ``lse`` contiguous; ``count`` the
    mean's `count_kept` (unread by the other reductions)."""
    rows, width = logits.shape
    _cross_entropy_backward_kernel[grid](
        grad, logits, target, lse, count, grad_logits, rows, width,
        logits.stride(0), first_class, width if classes is None else classes,
        attrs["ignore_index"], attrs["label_smoothing"],
        PER_ROW=attrs["reduction"] == "none", MEAN=attrs["reduction"] == "mean",
        WIDE=wide_offsets(logits), BLOCK_M=tiling.blocks["BLOCK_M"],
        BLOCK_N=tiling.blocks["BLOCK_N"], **launch_options(tiling))


@CROSS_ENTROPY_BACKWARD.launcher("triton")
def launch_backward(plan: object, inputs: Sequence[torch.Tensor | None],
                    outputs: Sequence[torch.Tensor], workspace: torch.Tensor | None) -> None:
    grad, logits, target, lse = inputs
    logits, target = _rows_of(logits), target.contiguous()
    count = lse  # unread without the mean
    if plan.attrs["reduction"] == "mean":
        count = workspace.view(torch.float32)
        count_kept(target, plan.attrs["ignore_index"], count)
    launch_gradient(plan.tiling, plan.grid, grad.contiguous(), logits, target,
                    lse.contiguous(), count, outputs[0], plan.attrs)


# ---------------------------------------------------------------------------------------------
# Backward


def _setup_context(ctx: object, inputs: tuple[object, ...], output: tuple[object, ...]
                   ) -> None:
    logits, target, *attrs = inputs
    ctx.save_for_backward(logits, target, output[1])
    ctx.attrs = attrs


@CROSS_ENTROPY.autograd(_setup_context)
def backward(ctx: object, grad_loss: torch.Tensor, grad_lse: torch.Tensor | None
             ) -> tuple[torch.Tensor | None, ...]:
    """grad_logits through `cross_entropy_backward`; the target and lse take none."""
    logits, target, lse = ctx.saved_tensors
    with checked_targets():
        grad_logits = CROSS_ENTROPY_BACKWARD(grad_loss, logits, target, lse, *ctx.attrs)
    return grad_logits, None, *(None for _ in ctx.attrs)


register_op(CROSS_ENTROPY_BACKWARD)
register_op(CROSS_ENTROPY)


@CROSS_ENTROPY.exported
def cross_entropy(input: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                  reduction: str = "mean", label_smoothing: float = 0.0) -> torch.Tensor:
    """``torch.nn.functional.cross_entropy`` of logits ``input`` [N, C] against class
    indices ``target`` [N] (int64 or int32): the loss (a scalar, or [N] with ``reduction=
    "none"``) in ``input``'s dtype, differentiable in ``input``; the log-sum-exp in float32.

    Raises:
        ShapeError: ``input`` is not 2-D with at least one class, or ``target`` is not [N].
        DtypeError: ``input`` is not floating point, or ``target`` not int64/int32.
        IndexRangeError: a target outside ``[0, C)`` that is not ``ignore_index``.
        AttrError: ``reduction`` not none/mean/sum, ``label_smoothing`` outside [0, 1].
    """
    return CROSS_ENTROPY(input, target, ignore_index, reduction, label_smoothing)[0]
