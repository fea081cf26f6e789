"""Fused linear cross-entropy: the loss of a language model's head without its logits.

    fused_linear_cross_entropy(hidden [N, H], weight [V, H], target [N])
        = cross_entropy(hidden @ weight.T, target)  -> loss (and each row's lse)

The logits of N tokens over a vocabulary of V (8k tokens x 128k classes: 2 GiB in
bfloat16, and as much again for their gradient) are never held whole. The classes go in
blocks of B, over all tokens at once, B chosen so that a block's logits hold about as many
elements as ``hidden`` (as many as `MIN_BLOCK_ROWS` tokens' logits at least): each block's
logits come from opforge's matmul (for 16-bit inputs its float32 accumulator, unrounded:
the loss is then more accurate than the unfused pair's, whose logits are rounded to 16
bits, and finite where float16's overflow); each row's log-sum-exp is merged across the
blocks (log-add-exp), its target's logit picked from its block and, for label smoothing,
its logits summed. The row losses
``lse - (1 - eps) x_t - eps mean(x)`` are float32 (float64 for float64 inputs); the
reduction sums them in a fixed order (``mean``: over the rows not ignored). Each row's lse,
in the same dtype, is the second output, which the backward takes.

The backward makes one pass over the same blocks: it recomputes the block's logits by the
same matmul steps (bitwise the forward's, so the softmax it takes from the forward's lse
sums to 1 as the forward's did), their gradient ``w (softmax - (1 - eps) onehot - eps /
V)`` (0 on ignored rows), ``grad_weight[block] = grad_logits.T @ hidden`` (the whole sum
over tokens inside one matmul, rounded once) and ``grad_logits @ weight[block]``, added to
``grad_hidden`` in float32 (for 16-bit inputs the matmul's float32 accumulators, rounded
once at the end). Nothing of size [V, H] or [N, V] is held beyond the gradients
themselves: four products in all (the logits made twice) against the unfused pair's
three. Without the forward's lse (a backward called alone) a first pass merges it again:
five products.

On the Triton backend one kernel reads a block's float32 logits once for all of its row
statistics (the online softmax's max and sum merged into the lse, the target's logit, the
smoothing sum), and cross_entropy's gradient kernel, on a block of columns, writes the
block's gradient in the inputs' dtype in one pass: torch operations would make a pass over
the block for each of max, exponentials, sums, scaling and rounding.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from opforge.core.errors import DtypeError, ShapeError
from opforge.core.hardware import HardwareProfile
from opforge.core.opdef import (
    Attrs,
    BenchSpec,
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
from opforge.core.tiling import cdiv, launch_options, persistent_grid
from opforge.library import register_op
from opforge.ops import cross_entropy
from opforge.ops._elementwise import random_input
from opforge.ops._math import finite_shift, jit, tl, widen
from opforge.ops._rows import SHARED_ROW_STATISTIC
from opforge.ops._statistics import STATISTICS_DTYPES, check_statistics, statistics_dtype
from opforge.ops.cross_entropy import looped_row_statistics
from opforge.precision.cases import generate

NAME = "fused_linear_cross_entropy"
BACKWARD_NAME = "fused_linear_cross_entropy_backward"
# A block holds at least as many logits as this many tokens' rows: fewer classes a block
# would make the products too thin to keep the tensor cores busy.
MIN_BLOCK_ROWS = 64
# Rows of a tile of the Triton kernels on a block's logits at most. NOTE: sm_90
# (compile-check): the row statistics' kernel spills at 128 rows of 32 columns and at 8
# rows of 512 (a running max, sum and total a row); 4 keep it in registers. Llama-sized
# blocks take 2 rows of 2048 columns on a GPU (its tile limit), 1 of 4096 on Ascend.
MAX_TILE_ROWS = 4
# The precision sweep's one shape of hidden, and its head's classes.
SWEEP_SHAPE = (33, 17)
SWEEP_CLASSES = 257
OVERFLOWING_LOGITS = KnownLimitation(
    "The logits are dot products of hidden and weight rows: float32 and bfloat16 inputs near "
    "their maximum give logits beyond float32's range (Inf, then NaN or Inf in the loss and "
    "its gradients) where the float64 golden is finite; torch's unfused pair overflows "
    "alike.", case="large_*", failures="*NaN/Inf*")
PEER_OVERFLOWS = KnownLimitation(
    "float16 inputs near the dtype's maximum give logits beyond its range: torch's unfused "
    "pair rounds them to Inf (a NaN loss and gradients) where opforge's float32 logits stay "
    "finite, within a few of the dtype's eps of the golden; the error ratios against the "
    "peer then compare with none of its elements.", case="large_*", dtype="float16",
    failures="*ratio*")


def _geometry(inputs: Specs) -> tuple[int, int, int]:
    """(tokens N, hidden size H, classes V)."""
    hidden, weight = (inputs[1], inputs[2]) if len(inputs) == 5 else inputs[:2]
    return hidden.shape[0], hidden.shape[1], weight.shape[0]


def class_block(tokens: int, hidden_size: int, classes: int) -> int:
    """Classes of a block: its logits over all tokens about as large as ``hidden``, and as
    large as `MIN_BLOCK_ROWS` tokens' logits at least."""
    rows = max(1, min(tokens, max(MIN_BLOCK_ROWS, cdiv(tokens * hidden_size, max(classes, 1)))))
    return max(1, min(classes, cdiv(rows * classes, max(tokens, 1))))


def _check(op: str, backward: bool) -> object:
    def check(inputs: Specs, attrs: Attrs) -> None:
        hidden, weight, target = inputs[1:4] if backward else inputs
        if any(is_unknown_rank(t.shape) for t in (hidden, weight, target)):
            return
        if len(hidden.shape) != 2:
            raise ShapeError("must be 2-D: one row per token", op=op, param="hidden",
                             expected="[N, H]", got=tuple(hidden.shape))
        if len(weight.shape) != 2 or weight.shape[1] != hidden.shape[1] \
                or weight.shape[0] == 0:
            raise ShapeError("must be [V, H] with V >= 1 classes and hidden's H", op=op,
                             param="weight", expected=f"[V, {hidden.shape[1]}]",
                             got=tuple(weight.shape))
        if weight.dtype != hidden.dtype:
            raise DtypeError("must have hidden's dtype", op=op, param="weight",
                             expected=hidden.dtype, got=weight.dtype)
        rows = hidden.shape[0]
        if tuple(target.shape) != (rows,):
            raise ShapeError("must hold one class index per row of hidden", op=op,
                             param="target", expected=(rows,), got=tuple(target.shape))
        if backward:
            grad, lse = inputs[0], inputs[4]
            want = (rows,) if attrs["reduction"] == "none" else ()
            if tuple(grad.shape) != want:
                raise ShapeError("must have the loss's shape", op=op, param="grad",
                                 expected=want, got=tuple(grad.shape))
            if lse is not None and tuple(lse.shape) != (rows,):
                raise ShapeError("must hold one log-sum-exp per row of hidden", op=op,
                                 param="lse", expected=(rows,), got=tuple(lse.shape))
            check_statistics(op, hidden, [("lse", lse)])
    return check


def _check_values(plan: object, inputs: Sequence[torch.Tensor | None]) -> None:
    """Every target is a class or ``ignore_index`` (one host read for all blocks)."""
    cross_entropy.check_targets(plan, inputs[3 if len(inputs) == 5 else 2],
                                _geometry(plan.inputs)[2])


def _cost(backward: bool) -> object:
    """The products' FLOPs (one forward; three backward, four without the forward's lse)
    and the least bytes: hidden, weight, target (and the loss's gradient and lse) read
    once, the outputs written once."""
    def cost(inputs: Specs, outputs: Specs, attrs: Attrs) -> Cost:
        tokens, hidden_size, classes = _geometry(inputs)
        products = (3 if inputs[4] is not None else 4) if backward else 1
        moved = sum(spec.numel * spec.itemsize for spec in (*inputs, *outputs)
                    if spec is not None)
        return Cost(flops=products * 2 * tokens * hidden_size * classes
                    + 5 * tokens * classes, bytes_moved=moved)
    return cost


def _tiling(inputs: Specs, outputs: Specs, attrs: Attrs, hardware: HardwareProfile
            ) -> list[Tiling]:
    """One variant: blocks of `class_block` classes (the products keep their own tiles),
    and for the Triton kernels on a block's float32 logits (its row statistics, its
    gradient) tiles of ``BLOCK_M`` rows by ``BLOCK_N`` columns."""
    tokens, hidden_size, classes = _geometry(inputs)
    block = class_block(tokens, hidden_size, classes)
    # On chip a tile holds the float32 logits, their exponentials and the gradient.
    candidates = cross_entropy.gradient_tilings(
        tokens, block, 8 + inputs[1 if len(inputs) == 5 else 0].itemsize, hardware,
        max_rows=MAX_TILE_ROWS)
    tiles = next((t for t in candidates
                  if t.onchip_bytes <= hardware.onchip_limit(t.double_buffered)),
                 candidates[-1])
    return [Tiling("class_blocks", {"CLASS_BLOCK": block, **tiles.blocks}, tiles.onchip_bytes,
                   tiles.double_buffered, tiles.options)]


def _grid(tiling: Tiling, inputs: Specs, outputs: Specs, attrs: Attrs,
          hardware: HardwareProfile) -> tuple[int, ...]:
    return (cdiv(_geometry(inputs)[2], tiling.blocks["CLASS_BLOCK"]),)


def _kernel_costs(backward: bool) -> object:
    """This operator's own kernels, each launched once a block of classes (the last block
    shorter): a launch's cost is its share of the call's. The row statistics' kernel reads
    a block's logits once (float32 for 16-bit inputs) and merges each row's lse; the
    gradient kernel reads them once and writes the block's gradient. The products are
    matmul's steps, with their own account; the torch operations between the kernels (the
    float32 sum of grad_hidden's shares, the loss's reduction) are not kernels and are not
    counted here."""
    def kernel_costs(tiling: Tiling, grid: tuple[int, ...], inputs: Specs, outputs: Specs,
                     attrs: Attrs) -> dict[str, Cost]:
        tokens, _, classes = _geometry(inputs)
        blocks = grid[0]
        if not tokens or not blocks:
            return {}
        hidden, target = (inputs[1], inputs[3]) if backward else (inputs[0], inputs[2])
        wide = max(4, hidden.itemsize)  # the logits' and the statistics' bytes
        logits = tokens * classes * wide
        targets = tokens * target.itemsize
        merge_flops = 5 * tokens * classes
        if not backward:
            smoothing = 2 * tokens * wide if attrs["label_smoothing"] else 0
            merged = logits + blocks * (targets + 2 * tokens * wide + smoothing) \
                + tokens * wide  # each target's logit written once, in its block
            return {"_merge_block_kernel": Cost(merge_flops // blocks, merged // blocks)}
        grad = inputs[0].numel * inputs[0].itemsize
        mean = attrs["reduction"] == "mean"
        gradient = logits + tokens * classes * hidden.itemsize + blocks * (
            targets + tokens * wide + grad + (4 if mean else 0))
        costs = {"_cross_entropy_backward_kernel": Cost(4 * tokens * classes // blocks,
                                                        gradient // blocks)}
        if mean:
            costs["_count_kept_kernel"] = Cost(tokens, targets + 4)
        if inputs[4] is None:
            costs["_merge_block_kernel"] = Cost(
                merge_flops // blocks, (logits + blocks * 2 * tokens * wide) // blocks)
        return costs
    return kernel_costs


def _bench_case(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                generator: torch.Generator) -> Case:
    """Tokens, hidden size and classes: a head of columns of norm about 1 (logits of unit
    scale), uniform targets."""
    tokens, hidden_size, classes = shape
    return Case("", (random_input((tokens, hidden_size), dtype, device, generator),
                     random_input((classes, hidden_size), dtype, device, generator,
                              scale=hidden_size ** -0.5),
                     cross_entropy.random_targets(tokens, classes, device, generator)), {})


def _samples(dtype: torch.dtype, device: torch.device, generator: torch.Generator
             ) -> list[Case]:
    def case(name: str, tokens: int, hidden_size: int, classes: int, ignored: float = 0.0,
             target_dtype: torch.dtype = torch.int64, **attrs: object) -> Case:
        hidden = random_input((tokens, hidden_size), dtype, device, generator)
        # Columns of norm about 1: logits of unit scale, as a trained head gives.
        weight = random_input((classes, hidden_size), dtype, device, generator,
                              scale=hidden_size ** -0.5)
        target = cross_entropy.random_targets(tokens, classes, device, generator,
                                              ignored=ignored, dtype=target_dtype)
        return Case(name, (hidden, weight, target), attrs)

    return [
        case("mean_200x48x333", 200, 48, 333, ignored=0.1),
        case("none_70x32x1000", 70, 32, 1000, reduction="none"),
        case("sum_smoothing_130x16x97", 130, 16, 97, ignored=0.2, reduction="sum",
             label_smoothing=0.1),
        case("ignore_3_int32", 65, 24, 50, target_dtype=torch.int32, ignore_index=3),
        case("one_token", 1, 8, 3000),
        case("one_class", 9, 8, 1),
        case("zero_tokens", 0, 8, 20, reduction="none"),
    ]


def _sweep(kind: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
           generator: torch.Generator) -> list[Case]:
    """At the kinds' 33 x 17 shape only (each case runs up to four products a block
    through the interpreter: the sweep's other shapes would add minutes to the certificate;
    matmul's and cross_entropy's own sweeps cover long and wide rows): hidden drawn from the
    kind, a normal head of 257 classes scaled by H^-1/2, targets uniform with a tenth
    ignored, the mean with label smoothing."""
    if shape != SWEEP_SHAPE:
        return []
    hidden = generate(kind, shape, dtype, device=device, generator=generator)
    weight = random_input((SWEEP_CLASSES, shape[1]), dtype, device, generator,
                          scale=shape[1] ** -0.5)
    target = cross_entropy.random_targets(shape[0], SWEEP_CLASSES, device, generator,
                                          ignored=0.1)
    return [Case("mean_smoothing", (hidden, weight, target), {"label_smoothing": 0.1})]


def _backward_sweep(kind: str, shape: tuple[int, ...], dtype: torch.dtype,
                    device: torch.device, generator: torch.Generator) -> list[Case]:
    return [_backward_case(case) for case in _sweep(kind, shape, dtype, device, generator)]


def _backward_case(case: Case) -> Case:
    """A backward call from a forward one: a gradient of the loss's shape, no lse (any
    lse but the forward's would disagree with the logits the backward recomputes, by their
    rounding: the backward merges its own; tests check the forward's is bitwise that)."""
    hidden, weight, target = case.inputs
    generator = torch.Generator().manual_seed(hidden.numel() + 1)
    reduction = case.attrs.get("reduction", "mean")
    shape = (hidden.shape[0],) if reduction == "none" else ()
    grad = torch.randn(shape, generator=generator).to(hidden.device, hidden.dtype)
    return Case(case.name, (grad, hidden, weight, target, None), case.attrs)


def _backward_samples(dtype: torch.dtype, device: torch.device, generator: torch.Generator
                      ) -> list[Case]:
    return [_backward_case(case) for case in _samples(dtype, device, generator)]


def _error_scale(opdef: OpDef, inputs: Sequence[torch.Tensor | None], attrs: Attrs,
                 golden: torch.Tensor, output: str) -> torch.Tensor:
    """A product's error is relative to its terms' magnitudes (|hidden| |weight| for each
    logit): a loss is judged against cross_entropy's scale with those magnitudes in place
    of the logits, a gradient against the products
    of the row weights' spread with |weight| (grad_hidden) or |hidden| (grad_weight)."""
    if opdef.name == BACKWARD_NAME:
        grad, hidden, weight, target, _ = inputs
        hidden64, weight64 = hidden.double(), weight.double()
        logits = hidden64 @ weight64.T
        if not logits.numel():
            return golden.abs()
        magnitude = hidden64.abs() @ weight64.abs().T
        spread = cross_entropy.gradient_spread(grad.double(), logits, target,
                                               torch.logsumexp(logits, -1), attrs, magnitude)
        product = spread @ weight64.abs() if output == "grad_hidden" \
            else spread.T @ hidden64.abs()
        return product + golden.abs()
    hidden, weight, target = inputs
    hidden64, weight64 = hidden.double(), weight.double()
    magnitude = hidden64.abs() @ weight64.abs().T
    return cross_entropy.loss_scale(hidden64 @ weight64.T, target, attrs, golden, output,
                                    magnitude)


def _torch_peer(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                ignore_index: int, reduction: str, label_smoothing: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.nn.functional.cross_entropy of hidden @ weight.T"""
    return cross_entropy.torch_cross_entropy(hidden @ weight.T, target, ignore_index,
                                             reduction, label_smoothing)


def _torch_peer_backward(grad: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                         target: torch.Tensor, lse: torch.Tensor | None, ignore_index: int,
                         reduction: str, label_smoothing: float
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.autograd through torch.nn.functional.cross_entropy of hidden @ weight.T"""
    leaves = (hidden.detach().requires_grad_(), weight.detach().requires_grad_())
    with torch.enable_grad():
        loss = torch.nn.functional.cross_entropy(
            leaves[0] @ leaves[1].T, target.long(), ignore_index=ignore_index,
            reduction=reduction, label_smoothing=label_smoothing)
        return torch.autograd.grad(loss, leaves, grad)


FUSED_LINEAR_CROSS_ENTROPY = OpDef(
    name=NAME, doc="cross_entropy(hidden @ weight.T, target) in blocks of classes, the "
                   "logits never held whole.",
    inputs=(TensorArg("hidden"), TensorArg("weight"),
            TensorArg("target", cross_entropy.INDEX_DTYPES)),
    outputs=(OutputArg("loss"), OutputArg("lse", differentiable=False)),
    attrs=cross_entropy.ATTRS,
    infer_shape=lambda inputs, attrs: cross_entropy.loss_shapes(inputs[0], attrs),
    infer_dtype=lambda inputs, attrs: [inputs[0].dtype, statistics_dtype(inputs[0].dtype)],
    check=_check(NAME, False), check_values=_check_values, cost=_cost(False),
    tiling=_tiling, grid=_grid, kernel_costs=_kernel_costs(False), samples=_samples,
    error_scale=_error_scale, held_launches=False,
    precision=PrecisionSpec("benchmark_ratio", "L0", _torch_peer, sweep=_sweep,
                            known_limitations=(SHARED_ROW_STATISTIC, OVERFLOWING_LOGITS,
                                               PEER_OVERFLOWS)),
    bench=BenchSpec(shapes=((8192, 4096, 128256), (4096, 4096, 32000)),
                    cpu_shapes=((256, 64, 4096),), case=_bench_case, metric="TFLOP/s"))

FUSED_LINEAR_CROSS_ENTROPY_BACKWARD = OpDef(
    name=BACKWARD_NAME, doc="(grad_hidden, grad_weight) of fused_linear_cross_entropy, "
                            "the logits recomputed block by block of classes.",
    inputs=(TensorArg("grad"), TensorArg("hidden"), TensorArg("weight"),
            TensorArg("target", cross_entropy.INDEX_DTYPES),
            TensorArg("lse", STATISTICS_DTYPES, optional=True,
                      doc="the forward's lse; None merges it again (one product more)")),
    outputs=(OutputArg("grad_hidden"), OutputArg("grad_weight")),
    attrs=cross_entropy.ATTRS,
    infer_shape=lambda inputs, attrs: [tuple(inputs[1].shape), tuple(inputs[2].shape)],
    infer_dtype=lambda inputs, attrs: [inputs[1].dtype, inputs[2].dtype],
    check=_check(BACKWARD_NAME, True), check_values=_check_values, cost=_cost(True),
    tiling=_tiling, grid=_grid, kernel_costs=_kernel_costs(True), samples=_backward_samples,
    error_scale=_error_scale, held_launches=False,
    precision=PrecisionSpec("benchmark_ratio", "L0", _torch_peer_backward,
                            sweep=_backward_sweep,
                            known_limitations=(SHARED_ROW_STATISTIC, OVERFLOWING_LOGITS,
                                               PEER_OVERFLOWS)))


# ---------------------------------------------------------------------------------------------
# References


@FUSED_LINEAR_CROSS_ENTROPY.reference
def reference(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *,
              compute_dtype: torch.dtype, **attrs: object
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """cross_entropy's reference (loss, lse) of ``hidden @ weight.T`` in
    ``compute_dtype``."""
    logits = hidden.to(compute_dtype) @ weight.to(compute_dtype).T
    return cross_entropy.reference(logits, target, compute_dtype=compute_dtype, **attrs)


@FUSED_LINEAR_CROSS_ENTROPY_BACKWARD.reference
def backward_reference(grad: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                       target: torch.Tensor, lse: torch.Tensor | None, *,
                       compute_dtype: torch.dtype, **attrs: object
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """cross_entropy_backward's reference of the logits, through the product's rule (with
    their own lse: a given one is the forward's rounding of it)."""
    hidden, weight = hidden.to(compute_dtype), weight.to(compute_dtype)
    logits = hidden @ weight.T
    grad_logits = cross_entropy.backward_reference(grad, logits, target,
                                                   torch.logsumexp(logits, -1),
                                                   compute_dtype=compute_dtype, **attrs)
    return grad_logits @ weight, grad_logits.T @ hidden


# ---------------------------------------------------------------------------------------------
# Kernels


@jit
def _merge_block_kernel(x_ptr, target_ptr, lse_ptr, picked_ptr, total_ptr, M, N, stride_x,
                        first_class, classes, ignore_index, PICK: tl.constexpr,
                        SUM: tl.constexpr, WIDE: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    """One read of a block's float32 logits [M, N] (classes ``first_class ..`` of
    ``classes``): each row's log-sum-exp over the block merged into ``lse_ptr``
    (log-add-exp); with PICK the target's logit, where it falls in the block, into
    ``picked_ptr``; with SUM the row's ``x / classes`` added to ``total_ptr``."""
    for block in range(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.num_programs(0)):
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        if WIDE:
            rows = rows.to(tl.int64)
        row_mask = rows < M
        top, exps, total = looped_row_statistics(x_ptr + rows[:, None] * stride_x, row_mask,
                                                 N, 1.0 / classes, BLOCK_M, BLOCK_N)
        previous = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)  # float32 statistic
        both = tl.maximum(previous, top)
        shift = finite_shift(both)
        merged = shift + tl.log(tl.exp(previous - shift) + exps * tl.exp(top - shift))
        merged = tl.where(both == float("inf"), both, merged)
        # A NaN, in this block's logits or an earlier block's lse, stays: a GPU's max skips
        # it.
        merged = tl.where((exps != exps) | (previous != previous), float("nan"), merged)
        tl.store(lse_ptr + rows, merged, mask=row_mask)  # float32 statistic
        if PICK:
            target = tl.load(target_ptr + rows, mask=row_mask, other=ignore_index)  # integer index
            inside = row_mask & (target != ignore_index) & (target >= first_class) \
                & (target < first_class + N)
            # The block's column of the target, by the pointer: triton-ascend fails on the
            # difference of an integer index and a scalar in a one-row tile.
            picked = widen(tl.load(x_ptr - first_class + rows * stride_x + target, mask=inside))
            tl.store(picked_ptr + rows, picked, mask=inside)  # float32 statistic
        if SUM:
            total += tl.load(total_ptr + rows, mask=row_mask)  # float32 statistic
            tl.store(total_ptr + rows, total, mask=row_mask)  # float32 statistic


# ---------------------------------------------------------------------------------------------
# Launchers (both backends: the steps run on the backend in use)


def _blocks(plan: object) -> list[tuple[str, int, int]]:
    """(step suffix, start, end) of each block of classes: the full blocks share one plan
    per step, the shorter last block another."""
    geometry = _geometry(plan.inputs)
    size = plan.tiling.blocks["CLASS_BLOCK"] if plan.tiling is not None \
        else class_block(*geometry)
    return [("" if end - start == size else "_tail", start, end)
            for start in range(0, geometry[2], size)
            for end in (min(start + size, geometry[2]),)]


def _dense(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inputs as contiguous tensors (a copy only of a strided view): each block's
    products then take the same path, so a view gives the contiguous call's bits."""
    return hidden.contiguous(), weight.contiguous(), target.contiguous()


def _class_blocks(plan: object, hidden: torch.Tensor, weight: torch.Tensor
                  ) -> Iterator[tuple[str, int, int, torch.Tensor]]:
    """(step suffix, first class, end class, logits) of each block of classes over all
    tokens, by the same matmul steps in the forward and the backward, so that both passes
    see bitwise the same logits (for 16-bit inputs the float32 accumulator, unrounded)."""
    narrow = hidden.element_size() == 2
    for suffix, start, end in _blocks(plan):
        yield suffix, start, end, plan.run_step("block_logits" + suffix, "matmul", hidden,
                                        weight[start:end].T, float32_out=narrow)


def _merge_block(plan: object, logits: torch.Tensor, target: torch.Tensor, first_class: int,
                 lse: torch.Tensor, picked: torch.Tensor | None = None,
                 total: torch.Tensor | None = None) -> None:
    """A block's share of each row's statistics, in place: its log-sum-exp merged into
    ``lse``; with ``picked``, the target's logit where it falls in the block; with
    ``total``, the row's logits, each divided by the classes, summed."""
    classes, ignore_index = _geometry(plan.inputs)[2], plan.attrs["ignore_index"]
    rows, width = logits.shape
    if plan.backend == "triton":
        blocks = plan.tiling.blocks
        _merge_block_kernel[(persistent_grid(cdiv(rows, blocks["BLOCK_M"]), plan.hardware),)](
            logits, target, lse, lse if picked is None else picked,
            lse if total is None else total, rows, width, logits.stride(0), first_class,
            classes, ignore_index, PICK=picked is not None, SUM=total is not None,
            WIDE=cross_entropy.wide_offsets(logits), BLOCK_M=blocks["BLOCK_M"],
            BLOCK_N=blocks["BLOCK_N"], **launch_options(plan.tiling))
        return
    x = logits.to(lse.dtype)
    torch.logaddexp(lse, torch.logsumexp(x, -1), out=lse)
    if picked is not None:
        inside = (target != ignore_index) & (target >= first_class) \
            & (target < first_class + width)
        column = torch.where(inside, target - first_class, 0).long()[:, None]
        picked += torch.where(inside, x.gather(1, column)[:, 0], 0)
    if total is not None:
        total += x.sum(-1) / classes


def _block_gradient(plan: object, grad: torch.Tensor, logits: torch.Tensor,
                    target: torch.Tensor, lse: torch.Tensor, first_class: int,
                    count: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """A block's logits' gradient by cross_entropy's formula, computed in float32 (float64
    for float64 inputs) and rounded once to ``dtype``; ``count``: the Triton kernel's
    `cross_entropy.count_kept` (for the mean)."""
    classes = _geometry(plan.inputs)[2]
    if plan.backend == "triton":
        gradient = torch.empty(logits.shape, dtype=dtype, device=logits.device)
        cross_entropy.launch_gradient(
            plan.tiling, cross_entropy.gradient_grid(plan.tiling, *logits.shape, plan.hardware),
            grad, logits, target, lse, lse if count is None else count, gradient, plan.attrs,
            first_class, classes)
        return gradient
    return cross_entropy.backward_reference(
        grad, logits, target, lse, compute_dtype=lse.dtype, first_class=first_class,
        classes=classes, **plan.attrs).to(dtype)


@FUSED_LINEAR_CROSS_ENTROPY.launcher("triton")
@FUSED_LINEAR_CROSS_ENTROPY.launcher("torch")
def launch(plan: object, inputs: Sequence[torch.Tensor | None],
           outputs: Sequence[torch.Tensor], workspace: torch.Tensor | None) -> None:
    """Block by block of classes: the logits by matmul, each row's lse merged across the
    blocks (log-add-exp), the target's logit picked from its block and the logits' sum
    (label smoothing); then the row losses and their reduction."""
    hidden, weight, target = _dense(*inputs)
    loss, lse = outputs
    attrs, wide = plan.attrs, statistics_dtype(hidden.dtype)
    valid = target != attrs["ignore_index"]
    smoothing = attrs["label_smoothing"]
    merged = torch.full(target.shape, float("-inf"), dtype=wide, device=hidden.device)
    picked = torch.zeros(target.shape, dtype=wide, device=hidden.device)
    total = torch.zeros_like(picked) if smoothing else None
    for _, start, _, logits in _class_blocks(plan, hidden, weight):
        _merge_block(plan, logits, target, start, merged, picked, total)
        del logits
    lse.copy_(merged)
    rows = merged - (1 - smoothing) * picked
    if smoothing:
        rows -= smoothing * total
    rows = torch.where(valid, rows, 0)
    if attrs["reduction"] == "none":
        loss.copy_(rows)
    elif attrs["reduction"] == "sum":
        loss.copy_(rows.sum())
    else:
        loss.copy_(rows.sum() / valid.sum())


@FUSED_LINEAR_CROSS_ENTROPY_BACKWARD.launcher("triton")
@FUSED_LINEAR_CROSS_ENTROPY_BACKWARD.launcher("torch")
def launch_backward(plan: object, inputs: Sequence[torch.Tensor | None],
                    outputs: Sequence[torch.Tensor], workspace: torch.Tensor | None) -> None:
    """Block by block of classes, over all tokens: the block's logits again, their gradient
    from the forward's lse (without one, a first pass over the blocks merges it), the
    block's grad_weight, and its share of grad_hidden summed in float32."""
    grad, (hidden, weight, target) = inputs[0].contiguous(), _dense(*inputs[1:4])
    lse = None if inputs[4] is None else inputs[4].contiguous()
    grad_hidden, grad_weight = outputs
    if not hidden.shape[0]:
        grad_weight.zero_()
        return
    wide = statistics_dtype(hidden.dtype)
    if lse is None:
        lse = torch.full(target.shape, float("-inf"), dtype=wide, device=hidden.device)
        for _, start, _, logits in _class_blocks(plan, hidden, weight):
            _merge_block(plan, logits, target, start, lse)
            del logits
    count = None
    if plan.backend == "triton" and plan.attrs["reduction"] == "mean":
        count = torch.empty(1, dtype=torch.float32, device=hidden.device)
        cross_entropy.count_kept(target, plan.attrs["ignore_index"], count)
    # 16-bit inputs' grad_hidden shares are the matmul's float32 accumulators, summed
    # unrounded.
    narrow = hidden.element_size() == 2
    summed = torch.empty(grad_hidden.shape, dtype=wide, device=hidden.device) \
        if narrow else grad_hidden
    for index, (suffix, start, end, logits) in enumerate(_class_blocks(plan, hidden,
                                                                        weight)):
        gradient = _block_gradient(plan, grad, logits, target, lse, start, count,
                                   hidden.dtype)
        del logits
        plan.run_step("grad_weight" + suffix, "matmul", gradient.T, hidden,
                      out=grad_weight[start:end])
        # The first block's share is the sum so far; each later one is added to it.
        if index == 0:
            plan.run_step("grad_hidden" + suffix, "matmul", gradient, weight[start:end],
                          float32_out=narrow, out=summed)
        else:
            summed += plan.run_step("grad_hidden" + suffix, "matmul", gradient,
                                    weight[start:end], float32_out=narrow)
        del gradient
    if narrow:
        grad_hidden.copy_(summed)


# ---------------------------------------------------------------------------------------------
# Backward


def _setup_context(ctx: object, inputs: tuple[object, ...], output: tuple[object, ...]
                   ) -> None:
    hidden, weight, target, *attrs = inputs
    ctx.save_for_backward(hidden, weight, target, output[1])
    ctx.attrs = attrs


@FUSED_LINEAR_CROSS_ENTROPY.autograd(_setup_context)
def backward(ctx: object, grad_loss: torch.Tensor, grad_lse: torch.Tensor | None
             ) -> tuple[torch.Tensor | None, ...]:
    """(grad_hidden, grad_weight) through `fused_linear_cross_entropy_backward` with the
    forward's lse; the target takes none."""
    hidden, weight, target, lse = ctx.saved_tensors
    # The forward read these targets on the host; its backward does not read them again.
    with cross_entropy.checked_targets():
        grad_hidden, grad_weight = FUSED_LINEAR_CROSS_ENTROPY_BACKWARD(
            grad_loss, hidden, weight, target, lse, *ctx.attrs)
    needs = ctx.needs_input_grad
    return (grad_hidden if needs[0] else None, grad_weight if needs[1] else None, None,
            *(None for _ in ctx.attrs))


register_op(FUSED_LINEAR_CROSS_ENTROPY_BACKWARD)
register_op(FUSED_LINEAR_CROSS_ENTROPY)


@FUSED_LINEAR_CROSS_ENTROPY.exported
def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor,
                               target: torch.Tensor, ignore_index: int = -100,
                               reduction: str = "mean", label_smoothing: float = 0.0
                               ) -> torch.Tensor:
    """``torch.nn.functional.cross_entropy(hidden @ weight.T, target)`` without holding the
    logits: ``hidden`` [N, H] (a model's last hidden states, tokens flattened), ``weight``
    [V, H] (its output head, no bias), ``target`` [N] class indices (int64 or int32). The
    loss (a scalar, or [N] with ``reduction="none"``) in ``hidden``'s dtype, summed in
    float32; differentiable in ``hidden`` and ``weight``.

    Raises:
        ShapeError: ``hidden`` not 2-D, ``weight`` not [V, H] with V >= 1, ``target`` not
            [N].
        DtypeError: ``weight`` not in ``hidden``'s dtype, or ``target`` not int64/int32.
        IndexRangeError: a target outside ``[0, V)`` that is not ``ignore_index``.
        AttrError: ``reduction`` not none/mean/sum, ``label_smoothing`` outside [0, 1].
    """
    return FUSED_LINEAR_CROSS_ENTROPY(hidden, weight, target, ignore_index, reduction,
                                      label_smoothing)[0]
