"""Rotary position embedding: ``rope(x, cos, sin, mode)`` and its gradient.

Over the last dim ``d`` of ``x`` (even), with ``h = d / 2``:

``half`` (GPT-NeoX)
    ``y = x * cos + cat(-x[h:], x[:h]) * sin``; ``cos``/``sin`` laid out as
    ``[θ0 … θ(h−1), θ0 … θ(h−1)]``.
``interleave`` (GPT-J, DeepSeek's complex pairs)
    ``y[2i] = x[2i] cos[2i] − x[2i+1] sin[2i]``, ``y[2i+1] = x[2i+1] cos[2i+1] +
    x[2i] sin[2i+1]``; ``cos``/``sin`` as ``[θ0, θ0, θ1, θ1, …]``.
``interleave_half`` (CANN's MlaProlog form)
    ``x1 = x[0::2]``, ``x2 = x[1::2]``, ``y = cat(x1, x2) * cos + cat(-x2, x1) * sin``: the
    output is de-interleaved; ``cos``/``sin`` laid out as for ``half``.

Each mode is ``y[j] = x[p(j)] cos[j] + s(j) x[q(j)] sin[j]`` for a permutation ``p``, a
partner ``q`` and a sign ``s``, which the kernel computes from ``j``. ``cos`` and ``sin``
have x's last dim and broadcast over its leading dims; when they cover x's trailing dims
only (``(S, d)`` against ``(B, H, S, d)``) the kernel reads cos row ``r mod S`` and nothing
is copied. Products and sums are float32, rounded once.

``rope_backward(grad, cos, sin, mode)`` is the transpose, ``dx[i] = grad[p⁻¹(i)]
cos[p⁻¹(i)] + s grad[q⁻¹(i)] sin[q⁻¹(i)]``: exact for any ``cos``/``sin``, not only the
rotation layouts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from opforge.core.errors import ShapeError
from opforge.core.hardware import HardwareProfile
from opforge.core.opdef import (
    Attr,
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
from opforge.core.shapes import UNKNOWN_RANK, broadcast_shapes, is_unknown_rank
from opforge.core.tiling import (
    INT32_LIMIT,
    cdiv,
    gpu_warps,
    launch_options,
    next_power_of_2,
    persistent_grid,
)
from opforge.library import register_op
from opforge.ops._elementwise import random_input
from opforge.precision.cases import generate

try:
    import triton
    import triton.language as tl

    from opforge.ops._math import rounded_for, widen
except ImportError:  # pragma: no cover
    triton = None

MODES = ("half", "interleave", "interleave_half")
MODE = Attr("mode", "str", "half", choices=MODES, doc="which elements rotate together")
ROWS_TILE = 4096
# On CUDA, tiles of 512 elements: the H200 ran 131072 rows of 64 (MlaProlog's query rope
# at T = 1024) in 36 µs with 8 rows a tile, against 79 µs with 64
# (benchmarks/results/gpu_2026-12-01/, autotuning choices).
CUDA_ROWS_TILE = 512
COLUMN_BLOCK = 1024


def _check(op: str, first: str) -> Callable[[Specs, Attrs], None]:
    """An even last dim; cos and sin of one shape, with x's last dim, broadcasting to x."""
    def check(inputs: Specs, attrs: Attrs) -> None:
        x, cos, sin = inputs
        if is_unknown_rank(x.shape):
            return
        shape = tuple(x.shape)
        if not shape or shape[-1] % 2:
            raise ShapeError("last dim must be even", op=op, param=first,
                             expected="an even size", got=shape)
        if tuple(sin.shape) != tuple(cos.shape):
            raise ShapeError("must have cos's shape", op=op, param="sin",
                             expected=tuple(cos.shape), got=tuple(sin.shape))
        if tuple(cos.shape)[-1:] != shape[-1:]:
            raise ShapeError("must have x's last dim", op=op, param="cos",
                             expected=shape[-1:], got=tuple(cos.shape))
        if tuple(broadcast_shapes(cos.shape, shape, op=op, names=("cos", first))) != shape:
            raise ShapeError("must broadcast to x's shape", op=op, param="cos",
                             expected=shape, got=tuple(cos.shape))
    return check


def _infer_shape(inputs: Specs, attrs: Attrs) -> list[tuple[int, ...]]:
    shape = inputs[0].shape
    return [UNKNOWN_RANK if is_unknown_rank(shape) else tuple(shape)]


def _infer_dtype(inputs: Specs, attrs: Attrs) -> list[torch.dtype]:
    return [inputs[0].dtype]


def _rows_and_cols(spec: object) -> tuple[int, int]:
    cols = spec.shape[-1]
    return (math.prod(spec.shape) // cols if cols else 0), cols


def _cost(inputs: Specs, outputs: Specs, attrs: Attrs) -> Cost:
    x, cos = inputs[0], inputs[1]
    return Cost(flops=3 * x.numel,
                bytes_moved=2 * x.numel * x.itemsize + 2 * cos.numel * cos.itemsize)


def _tiling(inputs: Specs, outputs: Specs, attrs: Attrs, hardware: HardwareProfile
            ) -> list[Tiling]:
    """``BLOCK_M x BLOCK_N`` tiles of the output; each element gathers its two inputs from
    anywhere in its row, so a tile never needs the whole row."""
    rows, cols = _rows_and_cols(inputs[0])
    block_n = min(next_power_of_2(max(cols, 1)), COLUMN_BLOCK)
    tile = CUDA_ROWS_TILE if hardware.device_type == "cuda" else ROWS_TILE
    block_m = max(1, min(next_power_of_2(max(rows, 1)), tile // block_n))
    per_element = 2 * inputs[0].itemsize + 2 * inputs[1].itemsize + 12
    candidates = []
    while True:
        candidates.append(Tiling("rows", {"BLOCK_M": block_m, "BLOCK_N": block_n},
                                 block_m * block_n * per_element,
                                 options={"warps": gpu_warps(block_m * block_n, hardware)}))
        if block_m == 1:
            return candidates
        block_m //= 2


def _grid(tiling: Tiling, inputs: Specs, outputs: Specs, attrs: Attrs,
          hardware: HardwareProfile) -> tuple[int, ...]:
    rows, cols = _rows_and_cols(inputs[0])
    tiles = cdiv(rows, tiling.blocks["BLOCK_M"]) * cdiv(cols, tiling.blocks["BLOCK_N"])
    return (persistent_grid(tiles, hardware),)


def rope_tables(positions: torch.Tensor, dim: int, mode: str, base: float = 10000.0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of shape ``(len(positions), dim)`` for ``mode``, angles
    ``positions * base^(-2i / dim)``, computed in float64 and returned in float32."""
    inverse = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = positions.to(torch.float64)[:, None] * inverse[None, :]
    angles = angles.repeat_interleave(2, -1) if mode == "interleave" else \
        torch.cat([angles, angles], -1)
    return angles.cos().float(), angles.sin().float()


def _samples(dtype: torch.dtype, device: torch.device, generator: torch.Generator
             ) -> list[Case]:
    def x(*shape: int) -> torch.Tensor:
        return random_input(shape, dtype, device, generator, scale=1.0)

    cases = []
    for mode in MODES:
        cos, sin = rope_tables(torch.arange(7), 64, mode)
        far_cos, far_sin = rope_tables(torch.arange(4090, 4097), 128, mode)
        cases += [
            Case(f"{mode}_bhsd", (x(2, 3, 7, 64), cos.to(device, dtype), sin.to(device, dtype)),
                 {"mode": mode}),
            Case(f"{mode}_far_positions", (x(7, 2, 128), far_cos[:, None].to(device, dtype),
                                           far_sin[:, None].to(device, dtype)),
                 {"mode": mode}),
            Case(f"{mode}_per_row_tables", (x(5, 6), x(5, 6), x(5, 6)), {"mode": mode}),
            Case(f"{mode}_transposed", (x(6, 10).t(), x(6), x(6)), {"mode": mode}),
        ]
    return [*cases, Case("zero_rows", (x(0, 8), x(8), x(8)))]


def _sweep(kind: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
           generator: torch.Generator) -> list[Case]:
    """x drawn from the kind (an odd last dim loses its last column), rotation tables of
    its width."""
    x = generate(kind, shape, dtype, device=device, generator=generator)
    if x.shape[-1] % 2:
        x = x[..., :-1].contiguous()
    cases = []
    for mode in MODES:
        cos, sin = rope_tables(torch.arange(x.shape[-2] if x.ndim > 1 else 1), x.shape[-1],
                               mode)
        if x.ndim == 1:
            cos, sin = cos[0], sin[0]
        cases.append(Case(mode, (x, cos.to(device, dtype), sin.to(device, dtype)),
                          {"mode": mode}))
    return cases


def _rotation_scale(opdef: OpDef, inputs: Sequence[torch.Tensor | None], attrs: Attrs,
                    golden: torch.Tensor, output: str) -> torch.Tensor:
    """|x p| |cos| + |x q| |sin| (through the reference on |inputs|): the two products are
    rounded separately before they meet."""
    return opdef.reference_fn(*(t.abs() for t in inputs), compute_dtype=torch.float64,
                              mode=attrs["mode"], magnitudes=True)


def _indices(d: int, mode: str, backward: bool) -> tuple[torch.Tensor, ...]:
    """(source index, cos/sin index of the first term, partner index, cos/sin index of the
    second term, sign) for each output index, as the kernel computes them."""
    j = torch.arange(d)
    h = d // 2
    if mode == "half":
        p, q = j, torch.where(j < h, j + h, j - h)
        sign = torch.where(j < h, -1.0, 1.0)
    elif mode == "interleave":
        p, q = j, torch.where(j % 2 == 0, j + 1, j - 1)
        sign = torch.where(j % 2 == 0, -1.0, 1.0)
    else:
        p = torch.where(j < h, 2 * j, 2 * (j - h) + 1)
        q = torch.where(j < h, 2 * j + 1, 2 * (j - h))
        sign = torch.where(j < h, -1.0, 1.0)
    if not backward:
        return p, j, q, j, sign
    p_inverse = torch.empty_like(p).scatter_(0, p, j)
    q_inverse = torch.empty_like(q).scatter_(0, q, j)
    return p_inverse, p_inverse, q_inverse, q_inverse, sign[q_inverse]


def _torch_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str
                ) -> torch.Tensor:
    """torch ops (the usual cat/rotate_half formula)"""
    d = x.shape[-1]
    h = d // 2
    if mode == "half":
        rotated = torch.cat([-x[..., h:], x[..., :h]], -1)
        return x * cos + rotated * sin
    if mode == "interleave":
        pairs = x.unflatten(-1, (h, 2))
        rotated = torch.stack([-pairs[..., 1], pairs[..., 0]], -1).flatten(-2)
        return x * cos + rotated * sin
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even, odd], -1) * cos + torch.cat([-odd, even], -1) * sin


def _torch_rope_backward(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         mode: str) -> torch.Tensor:
    """torch.autograd through the torch ops"""
    leaf = torch.zeros_like(grad).requires_grad_()
    with torch.enable_grad():
        (dx,) = torch.autograd.grad(_torch_rope(leaf, cos, sin, mode), leaf, grad)
    return dx


FUSED_ROTATION = KnownLimitation(
    "The kernel computes x p cos + s x q sin as one fused multiply-add (one rounding "
    "where torch rounds each product; explicit, so that every mode rounds alike on every "
    "device): where the two terms cancel, the relative error of either is rounding luck, "
    "while both stay within 1 eps of |x p||cos| + |x q||sin| (max_eps < 1).",
    backend="triton", dtype="float32",
    failures="max_rel ratio*")

ROPE = OpDef(
    name="rope", doc="Rotary position embedding over the last dim (half, interleave or "
                     "interleave_half pairing).",
    inputs=(TensorArg("x"), TensorArg("cos"), TensorArg("sin")),
    outputs=(OutputArg("out"),), attrs=(MODE,), infer_shape=_infer_shape,
    infer_dtype=_infer_dtype, check=_check("rope", "x"), cost=_cost, tiling=_tiling,
    grid=_grid, samples=_samples, error_scale=_rotation_scale,
    precision=PrecisionSpec("benchmark_ratio", "L0", _torch_rope, sweep=_sweep,
                            known_limitations=(FUSED_ROTATION,)), bench=BenchSpec())

ROPE_BACKWARD = OpDef(
    name="rope_backward", doc="The transpose of rope: dx from the output gradient.",
    inputs=(TensorArg("grad"), TensorArg("cos"), TensorArg("sin")),
    outputs=(OutputArg("grad_x"),), attrs=(MODE,), infer_shape=_infer_shape,
    infer_dtype=_infer_dtype, check=_check("rope_backward", "grad"), cost=_cost,
    tiling=_tiling, grid=_grid, samples=_samples, error_scale=_rotation_scale,
    precision=PrecisionSpec("benchmark_ratio", "L0", _torch_rope_backward, sweep=_sweep,
                            known_limitations=(FUSED_ROTATION,)))


# ---------------------------------------------------------------------------------------------
# References


def _apply(values: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str,
           backward: bool, compute_dtype: torch.dtype, magnitudes: bool) -> torch.Tensor:
    """The index form of the module docstring, in ``compute_dtype``."""
    values = values.to(compute_dtype)
    # The tables are gathered before they broadcast against the values: gathering the
    # broadcast view would materialise a table as large as the values.
    cos, sin = (t.to(compute_dtype) for t in (cos, sin))
    source, cos_index, partner, sin_index, sign = (
        t.to(values.device) for t in _indices(values.shape[-1], mode, backward))
    sign = sign.to(compute_dtype)
    first = values[..., source] * cos[..., cos_index]
    second = values[..., partner] * sin[..., sin_index]
    return first + second if magnitudes else first + sign * second


@ROPE.reference
def reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
              compute_dtype: torch.dtype, mode: str, magnitudes: bool = False
              ) -> torch.Tensor:
    """rope in ``compute_dtype`` (``magnitudes``: the sum of the two terms' magnitudes)."""
    return _apply(x, cos, sin, mode, False, compute_dtype, magnitudes)


@ROPE_BACKWARD.reference
def backward_reference(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                       compute_dtype: torch.dtype, mode: str, magnitudes: bool = False
                       ) -> torch.Tensor:
    """rope's transpose in ``compute_dtype``."""
    return _apply(grad, cos, sin, mode, True, compute_dtype, magnitudes)


# ---------------------------------------------------------------------------------------------
# Kernel

if triton is not None:

    @triton.jit
    def rope_indices(j, D, MODE: tl.constexpr, BACKWARD: tl.constexpr):
        """(source, cos index, partner, sin index, sign) of output index j."""
        h = D // 2
        low = j < h
        even = (j % 2) == 0
        if MODE == "half":
            if BACKWARD:
                partner = tl.where(low, j + h, j - h)
                return j, j, partner, partner, tl.where(low, 1.0, -1.0)
            else:
                return j, j, tl.where(low, j + h, j - h), j, tl.where(low, -1.0, 1.0)
        elif MODE == "interleave":
            if BACKWARD:
                partner = tl.where(even, j + 1, j - 1)
                return j, j, partner, partner, tl.where(even, 1.0, -1.0)
            else:
                return j, j, tl.where(even, j + 1, j - 1), j, tl.where(even, -1.0, 1.0)
        else:
            if BACKWARD:
                source = tl.where(even, j // 2, h + j // 2)
                partner = tl.where(even, h + j // 2, j // 2)
                return source, source, partner, partner, tl.where(even, 1.0, -1.0)
            else:
                source = tl.where(low, 2 * j, 2 * (j - h) + 1)
                partner = tl.where(low, 2 * j + 1, 2 * (j - h))
                return source, j, partner, j, tl.where(low, -1.0, 1.0)

    @triton.jit
    def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, M, D, stride_x, stride_c, table_rows,
                     table_step, MODE: tl.constexpr, BACKWARD: tl.constexpr, WIDE: tl.constexpr,
                     ONE_ROW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        col_tiles = tl.cdiv(D, BLOCK_N)
        for tile in range(tl.program_id(0), tl.cdiv(M, BLOCK_M) * col_tiles,
                          tl.num_programs(0)):
            cols = (tile % col_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
            source, cos_index, partner, sin_index, sign = rope_indices(cols, D, MODE,
                                                                        BACKWARD)
            col_mask = cols < D
            rows = (tile // col_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
            if WIDE:
                rows = rows.to(tl.int64)
            mask = (rows < M)[:, None] & col_mask[None, :]
            x_rows = x_ptr + rows[:, None] * stride_x
            x_source = widen(tl.load(x_rows + source[None, :], mask=mask, other=0.0))
            x_partner = widen(tl.load(x_rows + partner[None, :], mask=mask, other=0.0))
            if ONE_ROW:
                # One table row for every x row: loaded once a tile and broadcast (a block
                # of addresses with row stride 0 fails triton-ascend's linalg lowering).
                cos = widen(tl.load(cos_ptr + cos_index, mask=col_mask, other=0.0))[None, :]
                sin = widen(tl.load(sin_ptr + sin_index, mask=col_mask, other=0.0))[None, :]
            else:
                # cos/sin broadcast over leading dims: x row r uses table row
                # (r // table_step) mod table_rows.
                table = ((rows // table_step) % table_rows)[:, None] * stride_c
                cos = widen(tl.load(cos_ptr + table + cos_index[None, :], mask=mask,
                                    other=0.0))
                sin = widen(tl.load(sin_ptr + table + sin_index[None, :], mask=mask,
                                    other=0.0))
            # One explicit fma, the same in every mode: left to itself the GPU compiler
            # contracts either product, and the modes' outputs would differ by an ulp where
            # they should be one permutation of the same values.
            y = tl.fma(x_source, cos, sign[None, :] * (x_partner * sin))
            tl.store(out_ptr + rows[:, None] * D + cols[None, :], rounded_for(y, out_ptr),
                     mask=mask)


# ---------------------------------------------------------------------------------------------
# Launcher


def _tables(x: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """``(rows, d)`` view of a cos/sin table, its row period and its row step: x row ``r``
    uses table row ``(r // step) % period``. That holds without a copy when the table's
    leading dims (x's rank, ones prepended) are ones, then x's own dims, then ones: the
    first ones repeat the table (period), the last ones broadcast each table row over
    several x rows (step), as position tables of ``(S, 1, d)`` over heads of ``(B, S, H,
    d)`` do. Any other broadcast is expanded to x's shape (a copy)."""
    d = x.shape[-1]
    lead = tuple(x.shape[:-1])
    padded = (1,) * len(lead) + tuple(table.shape[:-1])
    own = padded[len(padded) - len(lead):]
    first = next((i for i, size in enumerate(own) if size != 1), len(own))
    last = max((i + 1 for i, size in enumerate(own) if size != 1), default=first)
    if own[first:last] == lead[first:last]:
        flat = table.reshape(-1, d)
        flat = flat if flat.stride(-1) == 1 else flat.contiguous()
        return flat, flat.shape[0], math.prod(lead[last:])
    full = table.expand(x.shape).reshape(-1, d).contiguous()
    return full, full.shape[0], 1


def _launch(plan: object, inputs: Sequence[torch.Tensor | None], out: torch.Tensor,
            backward: bool) -> None:
    x, cos, sin = inputs
    d = x.shape[-1]
    rows_x = x.reshape(-1, d)
    rows_x = rows_x if rows_x.stride(-1) == 1 else rows_x.contiguous()
    cos_rows, period, step = _tables(x, cos)
    sin_rows, _, _ = _tables(x, sin)
    if sin_rows.stride(0) != cos_rows.stride(0):
        sin_rows = sin_rows.contiguous()
        cos_rows = cos_rows.contiguous()
    rows = rows_x.shape[0]
    reach = max((rows - 1) * rows_x.stride(0) + d, rows * d)
    _rope_kernel[plan.grid](rows_x, cos_rows, sin_rows, out.view(rows, d), rows, d,
                            rows_x.stride(0), cos_rows.stride(0), max(period, 1), max(step, 1),
                            MODE=plan.attrs["mode"], BACKWARD=backward,
                            WIDE=reach > INT32_LIMIT, ONE_ROW=period <= 1, **plan.tiling.blocks,
                            **launch_options(plan.tiling))


@ROPE.launcher("triton")
def launch(plan: object, inputs: Sequence[torch.Tensor | None],
           outputs: Sequence[torch.Tensor], workspace: torch.Tensor | None) -> None:
    """Whole rows of x, the pairs gathered within the row."""
    _launch(plan, inputs, outputs[0], backward=False)


@ROPE_BACKWARD.launcher("triton")
def launch_backward(plan: object, inputs: Sequence[torch.Tensor | None],
                    outputs: Sequence[torch.Tensor], workspace: torch.Tensor | None) -> None:
    """The same kernel with the inverse index maps."""
    _launch(plan, inputs, outputs[0], backward=True)


# ---------------------------------------------------------------------------------------------
# Backward


def _setup_context(ctx: object, inputs: tuple[object, ...], output: torch.Tensor) -> None:
    x, cos, sin, mode = inputs
    tables_learn = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
    ctx.save_for_backward(cos, sin, x if tables_learn else None)
    ctx.mode = mode


@ROPE.autograd(_setup_context)
def backward(ctx: object, grad: torch.Tensor
             ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None]:
    """dx through `rope_backward`; for tables that need it (learned frequencies, say),
    ``dcos[j] = sum grad[j] x[p(j)]`` and ``dsin[j] = sum s(j) grad[j] x[q(j)]`` in
    float32 (float64 for float64 operands), summed over the dims the table broadcast
    along."""
    cos, sin, x = ctx.saved_tensors
    needs = ctx.needs_input_grad
    grad_x = ROPE_BACKWARD(grad, cos, sin, ctx.mode) if needs[0] else None
    grad_cos = grad_sin = None
    if x is not None:
        source, _, partner, _, sign = (t.to(x.device) for t in _indices(x.shape[-1],
                                                                       ctx.mode, False))
        compute = torch.promote_types(torch.promote_types(grad.dtype, x.dtype),
                                      torch.float32)
        wide_grad, values = grad.to(compute), x.to(compute)
        if needs[1]:
            grad_cos = (wide_grad * values[..., source]).sum_to_size(cos.shape).to(cos.dtype)
        if needs[2]:
            grad_sin = (wide_grad * values[..., partner] * sign).sum_to_size(sin.shape).to(
                sin.dtype)
    return grad_x, grad_cos, grad_sin, None


register_op(ROPE_BACKWARD)
register_op(ROPE)


@ROPE.exported
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str = "half"
         ) -> torch.Tensor:
    """Rotary position embedding over the last dim of ``x`` (even): ``"half"`` (GPT-NeoX),
    ``"interleave"`` (GPT-J / DeepSeek complex pairs) or ``"interleave_half"`` (CANN's form,
    de-interleaved output). ``cos``/``sin`` have x's last dim, broadcast over its leading
    dims, and are laid out ``[θ0 … θ(d/2−1), θ0 … θ(d/2−1)]`` for ``"half"`` and
    ``"interleave_half"``, ``[θ0, θ0, θ1, θ1, …]`` for ``"interleave"``
    (`opforge.ops.rope.rope_tables` builds them). Same shape and dtype as ``x``.
    Differentiable in ``x`` and in tables that require grad.

    Raises:
        ShapeError: an odd last dim, or tables that do not match x. AttrError: bad mode.
        DtypeError: unsupported dtype.
    """
    return ROPE(x, cos, sin, mode)
