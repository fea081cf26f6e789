"""Fused linear cross-entropy: the loss of a language model's head without its logits.

    fused_linear_cross_entropy(hidden [N, H], weight [V, H], target [N])
        = cross_entropy(hidden @ weight.T, target)  -> loss

The logits of N tokens over a vocabulary of V (8k tokens x 128k classes: 2 GiB in
bfloat16, and as much again for their gradient) are never held whole. The tokens go in
chunks of C rows, C chosen so that a chunk's logits hold about as many elements as
``hidden`` (at least `MIN_CHUNK` rows): each chunk's logits come from opforge's matmul,
its log-sum-exp from `cross_entropy`, and its row losses
``lse - (1 - eps) x_t - eps mean(x)`` in float32 from them; the reduction sums the float32
rows in a fixed order (``mean``: over the rows not ignored).

The backward makes two passes, each holding about as many logits as a forward chunk.
Over the chunks of tokens it recomputes each chunk's logits and their log-sum-exp (a
forward that kept the lse would hand it over in float32, computed from logits rounded to
the inputs' dtype), their gradient by `cross_entropy_backward` and ``grad_hidden =
grad_logits @ weight``, and keeps every row's lse. Over blocks of classes (all tokens
at once, the block's logits as large as a chunk's) it recomputes the block's logits, their
gradient from the kept lse (``w (softmax - (1 - eps) onehot - eps / V)``, 0 on ignored
rows) and ``grad_weight[block] = grad_logits.T @ hidden``. Each gradient element is thus
one product, accumulated in float32 inside the matmul and rounded once, and nothing of
size [V, H] or [N, V] is held beyond the gradients themselves: five products in all (the
logits made three times) against the unfused pair's three.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from opforge.core import backends
from opforge.core.errors import DtypeError, ShapeError
from opforge.core.hardware import HardwareProfile
from opforge.core.opdef import (
    Attrs,
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
from opforge.core.tiling import cdiv
from opforge.library import register_op
from opforge.ops import cross_entropy
from opforge.ops._elementwise import random_input
from opforge.ops._rows import SHARED_ROW_STATISTIC
from opforge.precision.cases import generate

NAME = "fused_linear_cross_entropy"
BACKWARD_NAME = "fused_linear_cross_entropy_backward"
# Rows a chunk takes at least: a matmul of fewer rows leaves the tensor cores idle.
MIN_CHUNK = 64
# The precision sweep's one shape of hidden, and its head's classes.
SWEEP_SHAPE = (33, 17)
SWEEP_CLASSES = 257
OVERFLOWING_LOGITS = KnownLimitation(
    "The logits are dot products of hidden and weight rows: inputs near the dtype's maximum "
    "give logits beyond its range (Inf, then NaN or Inf in the loss and its gradients) where "
    "the float64 golden is finite; torch's unfused pair overflows alike.",
    case="large_*", failures="*NaN/Inf*")


def _geometry(inputs: Specs) -> tuple[int, int, int]:
    """(tokens N, hidden size H, classes V)."""
    hidden, weight = (inputs[1], inputs[2]) if len(inputs) == 4 else inputs[:2]
    return hidden.shape[0], hidden.shape[1], weight.shape[0]


def chunk_rows(tokens: int, hidden_size: int, classes: int) -> int:
    """Rows of a chunk: its logits about as large as ``hidden``, at least `MIN_CHUNK`."""
    return max(1, min(tokens, max(MIN_CHUNK, cdiv(tokens * hidden_size, max(classes, 1)))))


def class_block(tokens: int, hidden_size: int, classes: int) -> int:
    """Classes of a backward block: its logits over all tokens as large as a chunk's."""
    chunk = chunk_rows(tokens, hidden_size, classes)
    return max(1, min(classes, cdiv(chunk * classes, max(tokens, 1))))


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
            want = (rows,) if attrs["reduction"] == "none" else ()
            if tuple(inputs[0].shape) != want:
                raise ShapeError("must have the loss's shape", op=op, param="grad",
                                 expected=want, got=tuple(inputs[0].shape))
    return check


def _check_values(plan: object, inputs: Sequence[torch.Tensor | None]) -> None:
    """Every target is a class or ``ignore_index`` (one host read for all chunks)."""
    cross_entropy.check_targets(plan, inputs[3 if len(inputs) == 4 else 2],
                                _geometry(plan.inputs)[2])


def _cost(backward: bool) -> object:
    """The products' FLOPs (one forward, four backward) and the least bytes: hidden,
    weight, target (and the loss's gradient) read once, the outputs written once."""
    def cost(inputs: Specs, outputs: Specs, attrs: Attrs) -> Cost:
        tokens, hidden_size, classes = _geometry(inputs)
        products = 4 if backward else 1
        moved = sum(spec.numel * spec.itemsize for spec in (*inputs, *outputs))
        return Cost(flops=products * 2 * tokens * hidden_size * classes
                    + 5 * tokens * classes, bytes_moved=moved)
    return cost


def _tiling(inputs: Specs, outputs: Specs, attrs: Attrs, hardware: HardwareProfile
            ) -> list[Tiling]:
    """One variant: chunks of `chunk_rows` tokens, blocks of `class_block` classes (the
    steps keep their own tiles)."""
    geometry = _geometry(inputs)
    return [Tiling("chunks", {"CHUNK": chunk_rows(*geometry),
                              "CLASS_BLOCK": class_block(*geometry)}, 0)]


def _grid(tiling: Tiling, inputs: Specs, outputs: Specs, attrs: Attrs,
          hardware: HardwareProfile) -> tuple[int, ...]:
    return (cdiv(_geometry(inputs)[0], tiling.blocks["CHUNK"]),)


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
    """At the kinds' 33 x 17 shape only (each case runs up to four products through the
    interpreter: the sweep's other shapes would add minutes to the certificate; matmul's
    and cross_entropy's own sweeps cover long and wide rows): hidden drawn from the kind,
    a normal head of 257 classes scaled by H^-1/2, targets uniform with a tenth ignored,
    the mean with label smoothing."""
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
    """A backward call from a forward one: a gradient of the loss's shape."""
    hidden, weight, target = case.inputs
    generator = torch.Generator().manual_seed(hidden.numel() + 1)
    reduction = case.attrs.get("reduction", "mean")
    shape = (hidden.shape[0],) if reduction == "none" else ()
    grad = torch.randn(shape, generator=generator).to(hidden.device, hidden.dtype)
    return Case(case.name, (grad, hidden, weight, target), case.attrs)


def _backward_samples(dtype: torch.dtype, device: torch.device, generator: torch.Generator
                      ) -> list[Case]:
    return [_backward_case(case) for case in _samples(dtype, device, generator)]


def _error_scale(opdef: OpDef, inputs: Sequence[torch.Tensor | None], attrs: Attrs,
                 golden: torch.Tensor, output: str) -> torch.Tensor:
    """The logits are rounded once to the input dtype (eps times |hidden| |weight| each):
    a loss is judged against cross_entropy's scale with those magnitudes in place of the
    logits, a gradient against the products
    of the row weights' spread with |weight| (grad_hidden) or |hidden| (grad_weight)."""
    if opdef.name == BACKWARD_NAME:
        grad, hidden, weight, target = inputs
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
                ignore_index: int, reduction: str, label_smoothing: float) -> torch.Tensor:
    """torch.nn.functional.cross_entropy of hidden @ weight.T"""
    return torch.nn.functional.cross_entropy(hidden @ weight.T, target.long(),
                                             ignore_index=ignore_index, reduction=reduction,
                                             label_smoothing=label_smoothing)


def _torch_peer_backward(grad: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                         target: torch.Tensor, ignore_index: int,
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
    name=NAME, doc="cross_entropy(hidden @ weight.T, target) in chunks of tokens, the "
                   "logits never held whole.",
    inputs=(TensorArg("hidden"), TensorArg("weight"),
            TensorArg("target", cross_entropy.INDEX_DTYPES)),
    outputs=(OutputArg("loss"),), attrs=cross_entropy.ATTRS,
    infer_shape=lambda inputs, attrs: cross_entropy.loss_shapes(inputs[0], attrs)[:1],
    infer_dtype=lambda inputs, attrs: [inputs[0].dtype],
    check=_check(NAME, False), check_values=_check_values, cost=_cost(False),
    tiling=_tiling, grid=_grid, samples=_samples, error_scale=_error_scale,
    held_launches=False,
    precision=PrecisionSpec("benchmark_ratio", "L0", _torch_peer, sweep=_sweep,
                            known_limitations=(SHARED_ROW_STATISTIC, OVERFLOWING_LOGITS)))

FUSED_LINEAR_CROSS_ENTROPY_BACKWARD = OpDef(
    name=BACKWARD_NAME, doc="(grad_hidden, grad_weight) of fused_linear_cross_entropy, "
                            "the logits recomputed chunk by chunk.",
    inputs=(TensorArg("grad"), TensorArg("hidden"), TensorArg("weight"),
            TensorArg("target", cross_entropy.INDEX_DTYPES)),
    outputs=(OutputArg("grad_hidden"), OutputArg("grad_weight")),
    attrs=cross_entropy.ATTRS,
    infer_shape=lambda inputs, attrs: [tuple(inputs[1].shape), tuple(inputs[2].shape)],
    infer_dtype=lambda inputs, attrs: [inputs[1].dtype, inputs[2].dtype],
    check=_check(BACKWARD_NAME, True), check_values=_check_values, cost=_cost(True),
    tiling=_tiling, grid=_grid, samples=_backward_samples, error_scale=_error_scale,
    held_launches=False,
    precision=PrecisionSpec("benchmark_ratio", "L0", _torch_peer_backward,
                            sweep=_backward_sweep,
                            known_limitations=(SHARED_ROW_STATISTIC, OVERFLOWING_LOGITS)))


# ---------------------------------------------------------------------------------------------
# References


@FUSED_LINEAR_CROSS_ENTROPY.reference
def reference(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *,
              compute_dtype: torch.dtype, **attrs: object) -> torch.Tensor:
    """cross_entropy's reference of ``hidden @ weight.T`` in ``compute_dtype``."""
    logits = hidden.to(compute_dtype) @ weight.to(compute_dtype).T
    return cross_entropy.reference(logits, target, compute_dtype=compute_dtype, **attrs)[0]


@FUSED_LINEAR_CROSS_ENTROPY_BACKWARD.reference
def backward_reference(grad: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                       target: torch.Tensor, *, compute_dtype: torch.dtype, **attrs: object
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """cross_entropy_backward's reference of the logits, through the product's rule."""
    hidden, weight = hidden.to(compute_dtype), weight.to(compute_dtype)
    logits = hidden @ weight.T
    grad_logits = cross_entropy.backward_reference(grad, logits, target,
                                                   torch.logsumexp(logits, -1),
                                                   compute_dtype=compute_dtype, **attrs)
    return grad_logits @ weight, grad_logits.T @ hidden


# ---------------------------------------------------------------------------------------------
# Launchers (both backends: the steps run on the backend in use)


def _blocks(plan: object, count: int, block: str) -> list[tuple[str, int, int]]:
    """(step suffix, start, end) of each block of ``count`` rows (``block`` "CHUNK") or
    classes ("CLASS_BLOCK"): the full blocks share one plan per step, the shorter last
    block another."""
    geometry = _geometry(plan.inputs)
    size = plan.tiling.blocks[block] if plan.tiling is not None else (
        chunk_rows if block == "CHUNK" else class_block)(*geometry)
    return [("" if end - start == size else "_tail", start, end)
            for start in range(0, count, size) for end in (min(start + size, count),)]


def _dense(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inputs as contiguous tensors (a copy only of a strided view): each chunk's
    products then take the same path, so a view gives the contiguous call's bits."""
    return hidden.contiguous(), weight.contiguous(), target.contiguous()


def _chunk_logits(plan: object, hidden: torch.Tensor, weight: torch.Tensor,
                  target: torch.Tensor
                  ) -> Iterator[tuple[str, int, int, torch.Tensor, torch.Tensor]]:
    """(step suffix, first row, end row, logits, float32 lse) of each chunk, by a matmul
    step and a cross_entropy step."""
    row_attrs = {**plan.attrs, "reduction": "none"}
    for suffix, start, end in _blocks(plan, hidden.shape[0], "CHUNK"):
        logits = plan.run_step("logits" + suffix, "matmul", hidden[start:end], weight.T)
        _, lse = plan.run_step("lse" + suffix, "cross_entropy", logits, target[start:end],
                               **row_attrs)
        yield suffix, start, end, logits, lse
        # Freed before the next chunk's are made, here and by each caller: the peak
        # holds one chunk's logits, not two.
        del logits, lse


def _row_losses(logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
                attrs: Attrs) -> torch.Tensor:
    """The rows' float32 losses from their log-sum-exp (0 for an ignored row)."""
    valid = target != attrs["ignore_index"]
    picked = logits.gather(1, torch.where(valid, target, 0).long()[:, None])[:, 0]
    smoothing = attrs["label_smoothing"]
    loss = lse - (1 - smoothing) * picked.float()
    if smoothing:
        loss = loss - smoothing * logits.float().mean(-1)
    return torch.where(valid, loss, 0.0)


@FUSED_LINEAR_CROSS_ENTROPY.launcher("triton")
@FUSED_LINEAR_CROSS_ENTROPY.launcher("torch")
def launch(plan: object, inputs: Sequence[torch.Tensor | None],
           outputs: Sequence[torch.Tensor], workspace: torch.Tensor | None) -> None:
    """Chunk by chunk: the logits by matmul, their lse by cross_entropy, the row losses in
    float32; then the reduction."""
    hidden, weight, target = _dense(*inputs)
    (loss,) = outputs
    attrs = plan.attrs
    rows = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    # The targets were checked once for every chunk (`_check_values`).
    with backends.device_side_checks():
        for _, start, end, logits, lse in _chunk_logits(plan, hidden, weight, target):
            rows[start:end] = _row_losses(logits, target[start:end], lse, attrs)
            del logits, lse
    if attrs["reduction"] == "none":
        loss.copy_(rows)
    elif attrs["reduction"] == "sum":
        loss.copy_(rows.sum())
    else:
        loss.copy_(rows.sum() / (target != attrs["ignore_index"]).sum())


@FUSED_LINEAR_CROSS_ENTROPY_BACKWARD.launcher("triton")
@FUSED_LINEAR_CROSS_ENTROPY_BACKWARD.launcher("torch")
def launch_backward(plan: object, inputs: Sequence[torch.Tensor | None],
                    outputs: Sequence[torch.Tensor], workspace: torch.Tensor | None) -> None:
    """Chunk by chunk of tokens: the logits and their lse again, their gradient by
    cross_entropy_backward (each row weighted by the loss's gradient, divided by the rows
    counted for ``mean``) and grad_hidden; then block by block of classes: the logits
    again, their gradient from the kept lse and grad_weight."""
    grad, (hidden, weight, target) = inputs[0], _dense(*inputs[1:])
    grad_hidden, grad_weight = outputs
    attrs = plan.attrs
    tokens, classes = hidden.shape[0], weight.shape[0]
    valid = target != attrs["ignore_index"]
    weights = grad.float()
    if attrs["reduction"] == "mean":
        weights = weights / valid.sum()
    row_attrs = {**attrs, "reduction": "none" if attrs["reduction"] == "none" else "sum"}
    lse = torch.empty(tokens, dtype=torch.float32, device=hidden.device)
    with backends.device_side_checks():
        for suffix, start, end, logits, chunk_lse in _chunk_logits(plan, hidden, weight,
                                                                    target):
            lse[start:end] = chunk_lse
            grad_logits = plan.run_step(
                "grad_logits" + suffix, "cross_entropy_backward",
                weights[start:end] if attrs["reduction"] == "none" else weights, logits,
                target[start:end], chunk_lse, **row_attrs)
            plan.run_step("grad_hidden" + suffix, "matmul", grad_logits, weight,
                          out=grad_hidden[start:end])
            del logits, chunk_lse, grad_logits
    if not tokens:
        grad_weight.zero_()
        return
    # The block's gradient by cross_entropy's formula, in float32 (float64 for float64
    # inputs), rounded once to the inputs' dtype.
    wide = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    for suffix, start, end in _blocks(plan, classes, "CLASS_BLOCK"):
        logits = plan.run_step("block_logits" + suffix, "matmul", hidden,
                               weight[start:end].T)
        gradient = cross_entropy.backward_reference(
            grad, logits, target, lse, compute_dtype=wide, first_class=start,
            classes=classes, **attrs).to(logits.dtype)
        plan.run_step("grad_weight" + suffix, "matmul", gradient.T, hidden,
                      out=grad_weight[start:end])
        del logits, gradient


# ---------------------------------------------------------------------------------------------
# Backward


def _setup_context(ctx: object, inputs: tuple[object, ...], output: tuple[object, ...]
                   ) -> None:
    hidden, weight, target, *attrs = inputs
    ctx.save_for_backward(hidden, weight, target)
    ctx.attrs = attrs


@FUSED_LINEAR_CROSS_ENTROPY.autograd(_setup_context)
def backward(ctx: object, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """(grad_hidden, grad_weight) through `fused_linear_cross_entropy_backward`; the
    target takes none."""
    hidden, weight, target = ctx.saved_tensors
    # The forward read these targets on the host; its backward does not read them again.
    with cross_entropy.checked_targets():
        grad_hidden, grad_weight = FUSED_LINEAR_CROSS_ENTROPY_BACKWARD(
            grad_loss, hidden, weight, target, *ctx.attrs)
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
                                      label_smoothing)
