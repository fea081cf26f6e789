"""Mixture-of-experts routing with the semantics of CANN's MoeGatingTopK (and of
``torch_npu.npu_moe_gating_top_k``) and MoeGatingTopKSoftmax.

``moe_gating_top_k(x, k, bias, k_group, group_count, group_select_mode, renorm, norm_type,
out_flag, routed_scaling_factor, eps, sigmoid_renorm, round_scores) -> (y, expert_idx,
out)`` over ``x`` ``(rows, E)``::

    norm = softmax(x) (norm_type 0) or sigmoid(x) (1)                 float32
    if round_scores: norm = float32(rounded_to_x_dtype(norm))        (the vendor's fp16 rule)
    sel  = norm + bias                                                bias: selection only
    if grouped: score each of group_count groups by its max (group_select_mode 0) or the
                sum of its top two (1) and keep the best k_group groups; others -> -inf
    idx  = top-k of sel, descending
    w    = norm[idx]                                                  un-biased
    if renorm == 1 or (norm_type == 1 and sigmoid_renorm): w = w / (sum(w) + eps)
    y    = rounded_to_x_dtype(w * routed_scaling_factor);  out = norm if out_flag

Selection is decided on the float32 scores (what the kernels compute), whatever precision
the weights are judged in. Ties go to the lower expert (and group) index. NaN scores rank
below every number (-inf included); a row whose scores are all NaN selects experts
``0..k-1`` (MoeGatingTopKSoftmax's rule), and their weights are NaN. A row of -inf logits
has NaN softmax scores, as in torch.

The Triton kernel is one pass from logits to outputs, portable (no ``tl.topk``, no
``tl.sort``): ``BLOCK_M`` rows a program as ``(rows, groups, experts per group)`` tiles;
scores become order-preserving int32 keys (the float bits, negatives' magnitude bits
flipped), and each of the k selections is an integer max, then the lowest index holding
it, then that key retired. The gradient of ``y`` reaches ``x`` through the gathered scores
and the renormalisation (not through the selection), in one kernel for both forms
(``moe_gating_top_k_backward``): the scores again from ``x``, each chosen expert's gradient
added where its index meets the row's columns, then through softmax or sigmoid.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from opforge.core.errors import AttrError, DtypeError, ShapeError
from opforge.core.hardware import HardwareProfile
from opforge.core.opdef import (
    Attr,
    Attrs,
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
from opforge.core.tiling import (
    INT32_LIMIT,
    MAX_PROGRAMS,
    cdiv,
    gpu_warps,
    launch_options,
    next_power_of_2,
    wide_offsets,
)
from opforge.library import register_op
from opforge.ops._rows import SHARED_ROW_STATISTIC
from opforge.precision.cases import generate

try:
    import triton
    import triton.language as tl

    from opforge.ops._math import rounded_for, sigmoid_pair, widen
except ImportError:  # pragma: no cover
    triton = None

NAME = "moe_gating_top_k"
MAX_EXPERTS = 8192
# Keys: retired experts below NaN scores below every number.
RETIRED_KEY = -(2**31)
NAN_KEY = -(2**31) + 1
NEG_INF_KEY = -2139095041  # the key of -inf: 0xFF800000 with its magnitude bits flipped
TILE_ELEMENTS = {"cuda": 4096, "cpu": 1 << 16}

ROUND_SCORES_ATTR = Attr("round_scores", "bool", False,
                         doc="select on the scores rounded to x's dtype (the vendor's fp16 "
                             "rule)")
GATING_ATTRS = (
    Attr("k", "int", 1, range=(1, MAX_EXPERTS), doc="experts per row"),
    Attr("k_group", "int", 1, range=(1, MAX_EXPERTS), doc="groups kept"),
    Attr("group_count", "int", 1, range=(1, MAX_EXPERTS), doc="groups of experts"),
    Attr("group_select_mode", "int", 0, choices=(0, 1), doc="group score: max | top-2 sum"),
    Attr("renorm", "int", 0, choices=(0, 1), doc="renormalise softmax weights (V2)"),
    Attr("norm_type", "int", 0, choices=(0, 1), doc="0 softmax, 1 sigmoid"),
    Attr("out_flag", "bool", False, doc="also return the normalised scores"),
    Attr("routed_scaling_factor", "float", 1.0, doc="multiplies y"),
    Attr("eps", "float", 1e-20, range=(0.0, None), doc="added to the renormalising sum"),
    Attr("sigmoid_renorm", "bool", True,
         doc="renormalise sigmoid weights (CANN always does; off: norm_topk_prob=False)"),
    ROUND_SCORES_ATTR,
)



def renormalises(renorm: int, norm_type: int, sigmoid_renorm: bool) -> bool:
    """Whether the weights are divided by their sum: softmax ones with ``renorm``, sigmoid
    ones unless ``sigmoid_renorm`` is off."""
    return renorm == 1 or (norm_type == 1 and sigmoid_renorm)


def _check(inputs: Specs, attrs: Attrs) -> None:
    """Every constraint of the reference, with the offending value."""
    x, bias = inputs
    if len(x.shape) != 2:
        raise ShapeError("must be 2-D (rows, experts)", op=NAME, param="x",
                         expected="(rows, E)", got=tuple(x.shape))
    experts = x.shape[1]
    if not 1 <= experts <= MAX_EXPERTS:
        raise ShapeError("expert count out of range", op=NAME, param="x",
                         expected=f"1..{MAX_EXPERTS} experts", got=experts)
    if bias is not None:
        if tuple(bias.shape) != (experts,):
            raise ShapeError("must be (E,)", op=NAME, param="bias", expected=(experts,),
                             got=tuple(bias.shape))
        if bias.dtype not in (x.dtype, torch.float32):
            raise DtypeError("must have x's dtype or float32", op=NAME, param="bias",
                             expected=f"{str(x.dtype).removeprefix('torch.')} | float32",
                             got=str(bias.dtype).removeprefix("torch."))
    k, k_group, groups = attrs["k"], attrs["k_group"], attrs["group_count"]

    def need(ok: bool, param: str, expected: str, got: object) -> None:
        if not ok:
            raise AttrError("violates MoeGatingTopK's constraints", op=NAME, param=param,
                            expected=expected, got=got)

    need(k <= experts, "k", f"1 <= k <= E = {experts}", k)
    need(experts % groups == 0, "group_count", f"a divisor of E = {experts}", groups)
    need(k_group <= groups, "k_group", f"1 <= k_group <= group_count = {groups}", k_group)
    need(k <= k_group * experts // groups, "k",
         f"k <= k_group * E / group_count = {k_group * experts // groups}", k)
    need(attrs["group_select_mode"] == 0 or experts // groups >= 2, "group_select_mode",
         "0, or groups of at least 2 experts for mode 1", attrs["group_select_mode"])


def _infer_shape(inputs: Specs, attrs: Attrs) -> list[tuple[int, ...]]:
    rows, experts = inputs[0].shape
    return [(rows, attrs["k"]), (rows, attrs["k"]),
            (rows, experts) if attrs["out_flag"] else (0,)]


def _infer_dtype(inputs: Specs, attrs: Attrs) -> list[torch.dtype]:
    return [inputs[0].dtype, torch.int32, torch.float32]


def _cost(inputs: Specs, outputs: Specs, attrs: Attrs) -> Cost:
    x = inputs[0]
    selections = attrs["k"] + (attrs["k_group"] if attrs["group_count"] > 1 else 0)
    return Cost(flops=x.numel * (6 + 3 * selections),
                bytes_moved=x.numel * x.itemsize + sum(o.numel * (o.itemsize)
                                                       for o in outputs))


def _layout(experts: int, attrs: Attrs) -> tuple[int, int, bool]:
    """(groups in the tile, experts per group, grouped selection on)."""
    grouped = attrs["group_count"] > 1 and attrs["k_group"] < attrs["group_count"]
    groups = attrs["group_count"] if grouped else 1
    return groups, experts // groups, grouped


def _tiling(inputs: Specs, outputs: Specs, attrs: Attrs, hardware: HardwareProfile
            ) -> list[Tiling]:
    """``BLOCK_M`` rows of ``BLOCK_G x BLOCK_EG`` (groups x experts per group) scores; as
    many rows as fit a tile of 4096 elements on GPUs (registers), 65536 on the CPU."""
    rows, experts = inputs[0].shape
    groups = attrs["group_count"] if attrs["k_group"] < attrs["group_count"] else 1
    block_g = next_power_of_2(groups)
    block_eg = next_power_of_2(max(1, experts // groups))
    budget = TILE_ELEMENTS.get(hardware.device_type, 4096)
    block_m = max(1, min(next_power_of_2(max(rows, 1)), budget // (block_g * block_eg)))
    # One load of the rows, no pipelined stream of blocks: nothing double-buffered.
    return [Tiling("rows", {"BLOCK_M": block_m, "BLOCK_G": block_g, "BLOCK_EG": block_eg,
                            "BLOCK_K": next_power_of_2(attrs["k"])},
                   block_m * block_g * block_eg * 16, double_buffered=False,
                   options={"warps": gpu_warps(block_m * block_g * block_eg, hardware)})]


def _grid(tiling: Tiling, inputs: Specs, outputs: Specs, attrs: Attrs,
          hardware: HardwareProfile) -> tuple[int, ...]:
    rows = inputs[0].shape[0]
    tiles = cdiv(rows, tiling.blocks["BLOCK_M"])
    return (max(1, min(tiles, hardware.core_count * 8, MAX_PROGRAMS)),)


def _deepseek_case(rows: int, dtype: torch.dtype, device: torch.device,
                   generator: torch.Generator) -> Case:
    x = torch.randn(rows, 256, generator=generator).to(device, dtype)
    bias = (0.1 * torch.randn(256, generator=generator)).to(device, dtype)
    return Case("deepseek_v3_e256_g8_kg4_k8", (x, bias),
                {"k": 8, "k_group": 4, "group_count": 8, "group_select_mode": 1,
                 "norm_type": 1, "routed_scaling_factor": 2.5})


def _samples(dtype: torch.dtype, device: torch.device, generator: torch.Generator
             ) -> list[Case]:
    def x(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(shape, generator=generator)).to(device, dtype)

    ties = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0, -1.0, 2.0, 2.0]] * 3).to(device, dtype)
    special = x(4, 16)
    special[0, 3] = float("-inf")
    special[1, :] = float("-inf")
    special[2, 5] = float("nan")
    special[3, :] = float("nan")
    return [
        _deepseek_case(33, dtype, device, generator),
        Case("softmax_top2_e8", (x(17, 8), None), {"k": 2}),
        Case("softmax_renorm_out_e64", (x(9, 64), None),
             {"k": 6, "renorm": 1, "out_flag": True}),
        Case("sigmoid_bias_groups_max", (x(12, 32), x(32, scale=0.1)),
             {"k": 4, "k_group": 2, "group_count": 4, "norm_type": 1}),
        Case("sigmoid_unnormalised_float32_bias", (
            x(10, 16), (0.1 * torch.randn(16, generator=generator)).to(device)),
             {"k": 3, "norm_type": 1, "sigmoid_renorm": False, "routed_scaling_factor": 2.5}),
        Case("ties_lower_index_wins", (ties, None), {"k": 4, "norm_type": 1}),
        Case("grouped_ties", (ties, None), {"k": 3, "k_group": 2, "group_count": 4,
                                            "group_select_mode": 1}),
        Case("inf_and_nan_logits", (special, None), {"k": 3, "out_flag": True}),
        Case("e2048_k8", (x(3, 2048), None), {"k": 8, "norm_type": 1}),
        Case("k_equals_e", (x(5, 7), None), {"k": 7}),
        Case("zero_rows", (x(0, 16), None), {"k": 2}),
    ]


def _sweep(kind: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
           generator: torch.Generator) -> list[Case]:
    """Logits drawn from the kind as ``(rows, E)``: rows the shape's leading size (at
    most 300), E = 64 (4097 for long rows: a wide router); softmax top-4 and the grouped
    sigmoid form with a bias."""
    rows = min(shape[0], 300)
    experts = 4097 if kind == "long_rows" else 64
    # long_rows would widen the last dim to 65537: a wide router of normal logits instead.
    x = generate("normal" if kind == "long_rows" else kind, (rows, experts), dtype,
                 device=device, generator=generator)
    bias = generate("normal", (experts,), dtype, device=device, generator=generator) * 0.1
    cases = [Case("softmax_k4", (x, None), {"k": 4, "out_flag": True})]
    if experts % 8 == 0:
        cases.append(Case("grouped_sigmoid", (x, bias),
                          {"k": 4, "k_group": 2, "group_count": 8, "group_select_mode": 1,
                           "norm_type": 1}))
    return cases


def _weights_scale(opdef: OpDef, inputs: Sequence[torch.Tensor | None], attrs: Attrs,
                   golden: torch.Tensor, output: str) -> torch.Tensor:
    """|golden| for the weights and scores; the indices are judged exactly."""
    return golden.abs().to(torch.float64)


def _torch_gating(x: torch.Tensor, bias: torch.Tensor | None, k: int, k_group: int,
                  group_count: int, group_select_mode: int, renorm: int, norm_type: int,
                  out_flag: bool, routed_scaling_factor: float, eps: float,
                  sigmoid_renorm: bool, round_scores: bool) -> tuple[torch.Tensor, ...]:
    """DeepSeek-V3's Gate in torch ops (float32 scores, torch.topk), CANN's renorm rule"""
    scores = torch.softmax(x.float(), -1) if norm_type == 0 else torch.sigmoid(x.float())
    if round_scores:
        scores = scores.to(x.dtype).float()
    sel = scores if bias is None else scores + bias.float()
    if group_count > 1 and k_group < group_count:
        grouped = sel.view(x.shape[0], group_count, x.shape[1] // group_count)
        group_scores = grouped.amax(-1) if group_select_mode == 0 else \
            grouped.topk(2, -1)[0].sum(-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(
            1, group_scores.topk(k_group, -1)[1], True)
        sel = grouped.masked_fill(~keep[..., None], float("-inf")).view(x.shape)
    idx = sel.topk(k, -1)[1]
    weights = scores.gather(1, idx)
    if renormalises(renorm, norm_type, sigmoid_renorm):
        weights = weights / (weights.sum(-1, keepdim=True) + eps)
    out = scores if out_flag else scores.new_empty(0)
    return (weights * routed_scaling_factor).to(x.dtype), idx.int(), out


def _bench_case(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                generator: torch.Generator) -> Case:
    """DeepSeek-V3 routing of ``shape = (tokens, experts)`` logits: sigmoid scores with a
    bias, top-8 within the best 4 of 8 groups, renormalised."""
    x = generate("normal", shape, dtype, device=device, generator=generator)
    bias = generate("normal", shape[-1:], dtype, device=device, generator=generator) * 0.1
    return Case("deepseek_v3", (x, bias), {"k": 8, "k_group": 4, "group_count": 8,
                                           "group_select_mode": 1, "norm_type": 1})


MOE_GATING_TOP_K = OpDef(
    name=NAME, doc="MoE routing: softmax/sigmoid scores, group-limited top-k with a "
                   "selection-only bias, CANN's renormalisation (y, expert_idx, out).",
    inputs=(TensorArg("x", dtypes=(torch.float32, torch.float16, torch.bfloat16)),
            TensorArg("bias", dtypes=(torch.float32, torch.float16, torch.bfloat16),
                      optional=True)),
    outputs=(OutputArg("y"), OutputArg("expert_idx"), OutputArg("out")),
    attrs=GATING_ATTRS, infer_shape=_infer_shape, infer_dtype=_infer_dtype, check=_check,
    cost=_cost, tiling=_tiling, grid=_grid, samples=_samples, error_scale=_weights_scale,
    precision=PrecisionSpec("benchmark_ratio", "L0", _torch_gating, sweep=_sweep,
                            known_limitations=(SHARED_ROW_STATISTIC,)),
    bench=BenchSpec(shapes=((128, 256), (4096, 256), (16384, 256)),
                    cpu_shapes=((128, 256), (1024, 256)), case=_bench_case))


def _check_softmax(inputs: Specs, attrs: Attrs) -> None:
    x, finished = inputs
    op = "moe_gating_top_k_softmax"
    if len(x.shape) not in (2, 3):
        raise ShapeError("must be 2-D or 3-D", op=op, param="x", expected="(..., E)",
                         got=tuple(x.shape))
    if finished is not None and tuple(finished.shape) != tuple(x.shape[:-1]):
        raise ShapeError("must have x's leading dims", op=op, param="finished",
                         expected=tuple(x.shape[:-1]), got=tuple(finished.shape))
    if not 1 <= x.shape[-1] <= MAX_EXPERTS:
        raise ShapeError("expert count out of range", op=op, param="x",
                         expected=f"1..{MAX_EXPERTS} experts", got=x.shape[-1])
    if not 1 <= attrs["k"] <= x.shape[-1]:
        raise AttrError("must be in 1..E", op=op, param="k", expected=f"1..{x.shape[-1]}",
                        got=attrs["k"])
    leading = x.shape[:-1]
    # row_idx is int32 (CANN's): its largest value, (k - 1) * rows + rows - 1, must fit.
    if all(type(size) is int for size in leading) and \
            math.prod(leading) * attrs["k"] > INT32_LIMIT:
        raise ShapeError("has more rows x k than int32 row indices hold", op=op, param="x",
                         expected=f"rows x k <= {INT32_LIMIT}",
                         got=f"{math.prod(leading)} rows x k {attrs['k']}")


def _softmax_shapes(inputs: Specs, attrs: Attrs) -> list[tuple[int, ...]]:
    shape = (*inputs[0].shape[:-1], attrs["k"])
    return [shape, shape, shape]


def _softmax_dtypes(inputs: Specs, attrs: Attrs) -> list[torch.dtype]:
    return [inputs[0].dtype, torch.int32, torch.int32]


def _flat_rows(x: object) -> int:
    """Rows of x with its leading dims flattened."""
    return math.prod(x.shape[:-1])


def _softmax_tiling(inputs: Specs, outputs: Specs, attrs: Attrs, hardware: HardwareProfile
                    ) -> list[Tiling]:
    flat = (type(inputs[0])((_flat_rows(inputs[0]), inputs[0].shape[-1]), inputs[0].dtype),
            None)
    return _tiling(flat, outputs, MOE_GATING_TOP_K.bind_attrs({"k": attrs["k"]}), hardware)


def _softmax_grid(tiling: Tiling, inputs: Specs, outputs: Specs, attrs: Attrs,
                  hardware: HardwareProfile) -> tuple[int, ...]:
    tiles = cdiv(_flat_rows(inputs[0]), tiling.blocks["BLOCK_M"])
    return (max(1, min(tiles, hardware.core_count * 8, MAX_PROGRAMS)),)


def _softmax_cost(inputs: Specs, outputs: Specs, attrs: Attrs) -> Cost:
    x = inputs[0]
    return Cost(flops=x.numel * (6 + 3 * attrs["k"]),
                bytes_moved=x.numel * x.itemsize + sum(o.numel * o.itemsize for o in outputs))


def _softmax_samples(dtype: torch.dtype, device: torch.device, generator: torch.Generator
                     ) -> list[Case]:
    def x(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator).to(device, dtype)

    finished = torch.tensor([[False, True, False], [True, False, False]], device=device)
    nan_rows = x(3, 8)
    nan_rows[1] = float("nan")
    return [Case("2d_k2", (x(9, 16), None), {"k": 2}),
            Case("3d_finished_k3", (x(2, 3, 10), finished), {"k": 3}),
            Case("nan_row_takes_first_k", (nan_rows, None), {"k": 3}),
            Case("k_1_e128", (x(5, 128), None), {"k": 1})]


def _softmax_sweep(kind: str, shape: tuple[int, ...], dtype: torch.dtype,
                   device: torch.device, generator: torch.Generator) -> list[Case]:
    """Logits from the kind as ``(rows, 64)`` (4097 experts for long rows), top-4."""
    experts = 4097 if kind == "long_rows" else 64
    x = generate("normal" if kind == "long_rows" else kind, (min(shape[0], 300), experts),
                 dtype, device=device, generator=generator)
    return [Case("k4", (x, None), {"k": 4})]


def _torch_top_k_softmax(x: torch.Tensor, finished: torch.Tensor | None, k: int,
                         round_scores: bool) -> tuple[torch.Tensor, ...]:
    """torch.topk of torch.softmax in float32 (rounded to x's dtype with round_scores)"""
    probabilities = torch.softmax(x.float(), -1)
    if round_scores:
        probabilities = probabilities.to(x.dtype).float()
    values, idx = probabilities.topk(k, -1)
    idx = idx.int()
    if finished is not None:
        idx = torch.where(finished[..., None], x.shape[-1], idx)
    rows = x.numel() // x.shape[-1]
    row_idx = (torch.arange(k, device=x.device)[None, :] * rows
               + torch.arange(rows, device=x.device)[:, None]).int().view(idx.shape)
    return values.to(x.dtype), idx, row_idx


MOE_GATING_TOP_K_SOFTMAX = OpDef(
    name="moe_gating_top_k_softmax",
    doc="MoeGatingTopKSoftmax: top-k of softmax(x) (y, expert_idx with finished rows set "
        "to E, row_idx[..., j] = j * N + i).",
    inputs=(TensorArg("x", dtypes=(torch.float32, torch.float16, torch.bfloat16)),
            TensorArg("finished", dtypes=(torch.bool,), optional=True)),
    outputs=(OutputArg("y"), OutputArg("expert_idx"), OutputArg("row_idx")),
    attrs=(Attr("k", "int", 1, range=(1, 1024), doc="experts per row"),
           ROUND_SCORES_ATTR),
    infer_shape=_softmax_shapes, infer_dtype=_softmax_dtypes, check=_check_softmax,
    cost=_softmax_cost, tiling=_softmax_tiling, grid=_softmax_grid, samples=_softmax_samples,
    error_scale=_weights_scale,
    precision=PrecisionSpec("benchmark_ratio", "L0", _torch_top_k_softmax,
                            sweep=_softmax_sweep))


BACKWARD_NAME = "moe_gating_top_k_backward"
BACKWARD_ATTRS = (
    GATING_ATTRS[5],  # norm_type
    Attr("renormalised", "bool", False, doc="the weights were divided by their sum"),
    GATING_ATTRS[7],  # routed_scaling_factor
    GATING_ATTRS[8],  # eps
)


def _check_backward(inputs: Specs, attrs: Attrs) -> None:
    grad_y, x, expert_idx, grad_out = inputs
    if len(x.shape) != 2 or not 1 <= x.shape[1] <= MAX_EXPERTS:
        raise ShapeError("must be 2-D (rows, experts), 1..8192 experts", op=BACKWARD_NAME,
                         param="x", expected="(rows, E)", got=tuple(x.shape))
    if len(expert_idx.shape) != 2 or expert_idx.shape[0] != x.shape[0]:
        raise ShapeError("must be (rows, k)", op=BACKWARD_NAME, param="expert_idx",
                         expected=f"({x.shape[0]}, k)", got=tuple(expert_idx.shape))
    for name, given, shape in (("grad_y", grad_y, expert_idx.shape),
                               ("grad_out", grad_out, x.shape)):
        if given is not None and tuple(given.shape) != tuple(shape):
            raise ShapeError("has the wrong shape", op=BACKWARD_NAME, param=name,
                             expected=tuple(shape), got=tuple(given.shape))


def _backward_tiling(inputs: Specs, outputs: Specs, attrs: Attrs, hardware: HardwareProfile
                     ) -> list[Tiling]:
    """``BLOCK_M`` whole rows of ``BLOCK_E`` experts, as many as fit the forward's tile."""
    rows, experts = inputs[1].shape
    block_e = next_power_of_2(experts)
    budget = TILE_ELEMENTS.get(hardware.device_type, 4096)
    block_m = max(1, min(next_power_of_2(max(rows, 1)), budget // block_e))
    return [Tiling("rows", {"BLOCK_M": block_m, "BLOCK_E": block_e}, block_m * block_e * 12,
                   double_buffered=False,
                   options={"warps": gpu_warps(block_m * block_e, hardware)})]


def _backward_grid(tiling: Tiling, inputs: Specs, outputs: Specs, attrs: Attrs,
                   hardware: HardwareProfile) -> tuple[int, ...]:
    tiles = cdiv(inputs[1].shape[0], tiling.blocks["BLOCK_M"])
    return (max(1, min(tiles, hardware.core_count * 8, MAX_PROGRAMS)),)


def _backward_cost(inputs: Specs, outputs: Specs, attrs: Attrs) -> Cost:
    """Each input read once and dx written once: the least (the renormalising pass reads
    the selection again, from cache)."""
    passes = 2 if attrs["renormalised"] else 1
    return Cost(flops=inputs[1].numel * (8 + 2 * passes * inputs[2].shape[1]),
                bytes_moved=sum(t.numel * t.itemsize for t in (*inputs, *outputs)
                                if t is not None))


def _backward_case(case: Case) -> Case:
    """A backward call from a forward one: the float64 reference's selection, a random
    gradient of y (and of the scores when the forward returns them)."""
    x, bias = case.inputs
    attrs = MOE_GATING_TOP_K.bind_attrs(case.attrs)
    _, idx, _ = reference(x, bias, compute_dtype=torch.float64, **attrs)
    generator = torch.Generator().manual_seed(x.numel())
    grad_y = torch.randn(idx.shape, generator=generator).to(x.device, x.dtype)
    grad_out = torch.randn(x.shape, generator=generator).to(x.device) \
        if attrs["out_flag"] else None
    return Case(case.name, (grad_y, x, idx, grad_out), {
        "norm_type": attrs["norm_type"], "routed_scaling_factor":
        attrs["routed_scaling_factor"], "eps": attrs["eps"], "renormalised": renormalises(
            attrs["renorm"], attrs["norm_type"], attrs["sigmoid_renorm"])})


def _backward_samples(dtype: torch.dtype, device: torch.device, generator: torch.Generator
                      ) -> list[Case]:
    cases = [_backward_case(case) for case in _samples(dtype, device, generator)]
    base = next(case for case in cases if case.name == "softmax_renorm_out_e64")
    grad_y, x, idx, grad_out = base.inputs
    outside = idx.long().clone()
    outside[::2, 0] = x.shape[1]  # a finished row's index, and a negative one
    outside[1::2, -1] = -1
    unchosen = outside.clone()
    unchosen[0] = x.shape[1]  # a row that chooses nothing: no weight to renormalise by
    # Six experts in a block of eight: indices 6 and 7 name padded columns, not x's.
    narrow = x[:, :6]
    padded_idx = torch.tensor([[0, 6], [7, 2]] * 5, device=x.device,
                              dtype=torch.int32)[:x.shape[0]]
    padded_grad = grad_y[:, :2].clone()
    padded_grad[padded_idx >= 6] = float("inf")
    return [*cases,
            Case("only_the_scores_gradient", (None, x, idx, grad_out), base.attrs),
            Case("int64_indices_transposed_gradient",
                 (grad_y.t().contiguous().t(), x, idx.long(), None), base.attrs),
            Case("indices_outside_choose_nothing", (grad_y, x, outside, grad_out),
                 base.attrs),
            Case("a_row_choosing_nothing_eps_0", (grad_y, x, unchosen, None),
                 {**base.attrs, "eps": 0.0}),
            Case("infinite_gradient_at_a_padded_index", (padded_grad, narrow, padded_idx,
                                                          None),
                 {**base.attrs, "renormalised": False})]


def _backward_sweep(kind: str, shape: tuple[int, ...], dtype: torch.dtype,
                    device: torch.device, generator: torch.Generator) -> list[Case]:
    return [_backward_case(case) for case in _sweep(kind, shape, dtype, device, generator)]


def _backward_scale(opdef: OpDef, inputs: Sequence[torch.Tensor | None], attrs: Attrs,
                    golden: torch.Tensor, output: str) -> torch.Tensor:
    """The sum of every term's magnitude: the renormalisation and softmax's row sum
    cancel, and their float32 error follows the terms, not the result."""
    spread = backward_reference(*inputs, compute_dtype=torch.float64, magnitudes=True,
                                **attrs)
    return golden.abs() + spread.nan_to_num(0.0, 0.0, 0.0)


def _torch_gating_backward(grad_y: torch.Tensor | None, x: torch.Tensor,
                           expert_idx: torch.Tensor, grad_out: torch.Tensor | None,
                           **attrs: object) -> torch.Tensor:
    """torch ops in float32 (gather, scatter_add, softmax or sigmoid)"""
    return backward_reference(grad_y, x, expert_idx, grad_out, compute_dtype=torch.float32,
                              **attrs).to(x.dtype)


MOE_GATING_TOP_K_BACKWARD = OpDef(
    name=BACKWARD_NAME,
    doc="dx of moe_gating_top_k's weights (and scores) through the gathered scores.",
    inputs=(TensorArg("grad_y", optional=True),
            TensorArg("x", dtypes=(torch.float32, torch.float16, torch.bfloat16)),
            TensorArg("expert_idx", dtypes=(torch.int32, torch.int64)),
            TensorArg("grad_out", dtypes=(torch.float32,), optional=True)),
    outputs=(OutputArg("grad_x"),), attrs=BACKWARD_ATTRS,
    infer_shape=lambda inputs, attrs: [tuple(inputs[1].shape)],
    infer_dtype=lambda inputs, attrs: [inputs[1].dtype], check=_check_backward,
    cost=_backward_cost, tiling=_backward_tiling, grid=_backward_grid,
    samples=_backward_samples, error_scale=_backward_scale,
    precision=PrecisionSpec("benchmark_ratio", "L0", _torch_gating_backward,
                            sweep=_backward_sweep, known_limitations=(SHARED_ROW_STATISTIC,)))


# ---------------------------------------------------------------------------------------------
# Reference


def ordered_keys(scores: torch.Tensor) -> torch.Tensor:
    """float32 scores as int64 keys in the same order (NaN lowest): the float bits with a
    negative number's magnitude bits flipped."""
    bits = scores.to(torch.float32).view(torch.int32).to(torch.int64)
    keys = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return torch.where(torch.isnan(scores), torch.full_like(keys, NAN_KEY), keys)


def _top(keys: torch.Tensor, count: int) -> torch.Tensor:
    """Positions of the ``count`` largest keys of each row, ties to the lower position."""
    return torch.argsort(-keys, dim=-1, stable=True)[..., :count]


def select_experts(x: torch.Tensor, bias: torch.Tensor | None, k: int, k_group: int,
                   group_count: int, group_select_mode: int, norm_type: int,
                   round_scores: bool = False) -> torch.Tensor:
    """The int64 ``(rows, k)`` experts chosen, from float32 scores (rounded to x's dtype
    with ``round_scores``) exactly as the kernel chooses them."""
    x32 = x.to(torch.float32)
    norm = torch.softmax(x32, -1) if norm_type == 0 else torch.sigmoid(x32)
    if round_scores:
        norm = norm.to(x.dtype).float()
    sel = norm if bias is None else norm + bias.to(torch.float32)
    keys = ordered_keys(sel)
    if group_count > 1 and k_group < group_count:
        rows = x.shape[0]
        per_group = x.shape[1] // group_count
        grouped_keys = keys.view(rows, group_count, per_group)
        grouped_sel = sel.view(rows, group_count, per_group)
        best = _top(grouped_keys, 2 if group_select_mode == 1 else 1)
        group_scores = grouped_sel.gather(-1, best).sum(-1, dtype=torch.float32)
        kept = _top(ordered_keys(group_scores), k_group)
        keep = torch.zeros(rows, group_count, dtype=torch.bool, device=x.device)
        keep.scatter_(1, kept, True)
        keys = torch.where(keep[..., None], grouped_keys, NEG_INF_KEY).view(rows, x.shape[1])
    return _top(keys, k)


@MOE_GATING_TOP_K.reference
def reference(x: torch.Tensor, bias: torch.Tensor | None, *, compute_dtype: torch.dtype,
              k: int, k_group: int, group_count: int, group_select_mode: int, renorm: int,
              norm_type: int, out_flag: bool, routed_scaling_factor: float, eps: float,
              sigmoid_renorm: bool, round_scores: bool) -> tuple[torch.Tensor, ...]:
    """(y, expert_idx, out): the selection on float32 scores, the weights and scores in
    ``compute_dtype`` (with ``round_scores``, the scores rounded to x's dtype first)."""
    idx = select_experts(x, bias, k, k_group, group_count, group_select_mode, norm_type,
                         round_scores)
    wide = x.to(compute_dtype)
    norm = torch.softmax(wide, -1) if norm_type == 0 else torch.sigmoid(wide)
    if round_scores:
        norm = norm.to(x.dtype).to(compute_dtype)
    weights = norm.gather(1, idx)
    if renormalises(renorm, norm_type, sigmoid_renorm):
        weights = weights / (weights.sum(-1, keepdim=True) + eps)
    out = norm if out_flag else norm.new_empty(0)
    return weights * routed_scaling_factor, idx.to(torch.int32), out


def _finished_and_rows(idx: torch.Tensor, finished: torch.Tensor | None, experts: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert_idx with finished rows set to E, row_idx) for flat ``(N, k)`` indices."""
    rows, k = idx.shape
    if finished is not None:
        idx = torch.where(finished.reshape(rows, 1), experts, idx)
    row_idx = torch.arange(k, device=idx.device)[None, :] * rows \
        + torch.arange(rows, device=idx.device)[:, None]
    return idx.to(torch.int32), row_idx.to(torch.int32)


@MOE_GATING_TOP_K_SOFTMAX.reference
def softmax_reference(x: torch.Tensor, finished: torch.Tensor | None, *,
                      compute_dtype: torch.dtype, k: int, round_scores: bool
                      ) -> tuple[torch.Tensor, ...]:
    """(y, expert_idx, row_idx): moe_gating_top_k's softmax form on the flattened rows."""
    experts = x.shape[-1]
    flat = x.reshape(-1, experts)
    y, idx, _ = reference(flat, None, compute_dtype=compute_dtype,
                          **MOE_GATING_TOP_K.bind_attrs({"k": k,
                                                         "round_scores": round_scores}))
    idx, row_idx = _finished_and_rows(idx, finished, experts)
    shape = (*x.shape[:-1], k)
    return y.view(shape), idx.view(shape), row_idx.view(shape)


@MOE_GATING_TOP_K_BACKWARD.reference
def backward_reference(grad_y: torch.Tensor | None, x: torch.Tensor, expert_idx: torch.Tensor,
                       grad_out: torch.Tensor | None, *, compute_dtype: torch.dtype,
                       norm_type: int, renormalised: bool, routed_scaling_factor: float,
                       eps: float, magnitudes: bool = False) -> torch.Tensor:
    """dx in ``compute_dtype``: with ``w = norm[idx]`` and ``S = sum(w) + eps``, ``dw =
    scale (g / S - sum(g w) / S^2)`` (renormalised) or ``scale g``, scattered into the
    scores' gradient (plus ``grad_out``), then through softmax or sigmoid. An index outside
    ``[0, E)`` chooses nothing. ``magnitudes``: each difference a sum of magnitudes (the
    scale of its rounding error)."""
    sign = 1 if magnitudes else -1

    def term(value: torch.Tensor) -> torch.Tensor:
        return value.abs() if magnitudes else value

    wide = x.to(compute_dtype)
    norm = torch.softmax(wide, -1) if norm_type == 0 else torch.sigmoid(wide)
    grad_norm = torch.zeros_like(norm)
    if grad_y is not None:
        chosen = (expert_idx >= 0) & (expert_idx < x.shape[1])
        index = torch.where(chosen, expert_idx, 0).long()
        g = term(grad_y.to(compute_dtype))
        if renormalised:
            weights = torch.where(chosen, norm.gather(1, index), 0)
            total = weights.sum(-1, keepdim=True) + eps
            g = g / total + sign * (g * weights).sum(-1, keepdim=True) / total.square()
        grad_norm.scatter_add_(1, index, torch.where(chosen, g * term(
            torch.tensor(routed_scaling_factor, dtype=compute_dtype)), 0))
    if grad_out is not None:
        grad_norm = grad_norm + term(grad_out.to(compute_dtype))
    if norm_type == 1:
        return grad_norm * norm * (1 - norm)
    return norm * (grad_norm + sign * (grad_norm * norm).sum(-1, keepdim=True))


# ---------------------------------------------------------------------------------------------
# Kernel

if triton is not None:
    RETIRED = tl.constexpr(RETIRED_KEY)
    NAN_ORDER = tl.constexpr(NAN_KEY)
    MAGNITUDE_BITS = tl.constexpr(0x7FFFFFFF)
    NEG_INF = tl.constexpr(float("-inf"))
    MASKED = tl.constexpr(NEG_INF_KEY)

    @triton.jit
    def _keys(scores):
        """Order-preserving int32 keys of float32 scores, NaN lowest."""
        bits = scores.to(tl.int32, bitcast=True)
        keys = tl.where(bits < 0, bits ^ MAGNITUDE_BITS, bits)
        return tl.where(scores != scores, NAN_ORDER, keys)

    @triton.jit
    def _gating_kernel(x_ptr, bias_ptr, y_ptr, idx_ptr, out_ptr, R, E, EG, G, K, K_GROUP,
                       stride_x, scale, eps, HAS_BIAS: tl.constexpr, SIGMOID: tl.constexpr,
                       GROUPED: tl.constexpr, TOP2: tl.constexpr, RENORM: tl.constexpr,
                       OUT_FLAG: tl.constexpr, ROUND_SCORES: tl.constexpr, WIDE: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_EG: tl.constexpr,
                       BLOCK_K: tl.constexpr):
        """``BLOCK_M`` rows a program (persistently). ``WIDE``: row offsets in int64 (rows
        x experts past int32)."""
        group = tl.arange(0, BLOCK_G)[None, :, None]
        member = tl.arange(0, BLOCK_EG)[None, None, :]
        expert = group * EG + member
        valid = (group < G) & (member < EG)
        columns = tl.arange(0, BLOCK_K)[None, :]
        group_index = tl.arange(0, BLOCK_G)[None, :]
        if HAS_BIAS:
            bias = widen(tl.load(bias_ptr + expert, mask=valid, other=0.0))
        for tile in range(tl.program_id(0), tl.cdiv(R, BLOCK_M), tl.num_programs(0)):
            rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
            if WIDE:
                rows = rows.to(tl.int64)
            row_mask = rows < R
            mask = row_mask[:, None, None] & valid
            x = widen(tl.load(x_ptr + rows[:, None, None] * stride_x + expert, mask=mask,
                              other=NEG_INF))
            if SIGMOID:
                norm, _ = sigmoid_pair(x)
            else:
                peak = tl.max(tl.max(x, 2), 1)
                exps = tl.exp(x - peak[:, None, None])
                exps = tl.where(mask, exps, 0.0)
                norm = exps / tl.sum(tl.sum(exps, 2), 1)[:, None, None]
            norm = tl.where(mask, norm, 0.0)
            if ROUND_SCORES:
                norm = widen(rounded_for(norm, y_ptr))
            sel = norm
            if HAS_BIAS:
                sel = norm + bias
            keys = tl.where(valid, _keys(sel), RETIRED)
            if GROUPED:
                best = tl.max(keys, 2)
                first = tl.min(tl.where(keys == best[:, :, None], member, BLOCK_EG), 2)
                score = tl.sum(tl.where(member == first[:, :, None], sel, 0.0), 2)
                if TOP2:
                    rest = tl.where(member == first[:, :, None], RETIRED, keys)
                    second = tl.min(tl.where(rest == tl.max(rest, 2)[:, :, None], member,
                                             BLOCK_EG), 2)
                    score += tl.sum(tl.where(member == second[:, :, None], sel, 0.0), 2)
                group_keys = tl.where(group_index < G, _keys(score), RETIRED)
                keep = group_keys < RETIRED  # all False, one flag per (row, group)
                for _ in range(0, K_GROUP):
                    top = tl.max(group_keys, 1)
                    chosen = tl.min(tl.where(group_keys == top[:, None], group_index,
                                             BLOCK_G), 1)
                    hit = group_index == chosen[:, None]
                    keep = keep | hit
                    group_keys = tl.where(hit, RETIRED, group_keys)
                keys = tl.where(keep[:, :, None] | (keys == RETIRED), keys, MASKED)
            weights = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
            chosen_experts = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.int32)
            total = tl.zeros([BLOCK_M], dtype=tl.float32)
            for j in range(0, K):
                top = tl.max(tl.max(keys, 2), 1)
                at_top = keys == top[:, None, None]
                # An expert index fits int32 whatever width E arrives in (64-bit sizes).
                position = tl.min(tl.min(tl.where(at_top, expert, E), 2), 1).to(tl.int32)
                hit = expert == position[:, None, None]
                weight = tl.sum(tl.sum(tl.where(hit, norm, 0.0), 2), 1)
                weights = tl.where(columns == j, weight[:, None], weights)
                chosen_experts = tl.where(columns == j, position[:, None], chosen_experts)
                total += weight
                keys = tl.where(hit, RETIRED, keys)
            if RENORM:
                weights = weights / (total + eps)[:, None]
            weights = weights * scale
            out_mask = row_mask[:, None] & (columns < K)
            out_offsets = rows[:, None] * K + columns
            tl.store(y_ptr + out_offsets, rounded_for(weights, y_ptr), mask=out_mask)
            tl.store(idx_ptr + out_offsets, rounded_for(chosen_experts, idx_ptr),
                     mask=out_mask)
            if OUT_FLAG:
                scores_ptrs = out_ptr + rows[:, None, None] * E + expert
                tl.store(scores_ptrs, rounded_for(norm, out_ptr), mask=mask)


    @triton.jit
    def _finish_rows_kernel(idx_ptr, finished_ptr, row_idx_ptr, R, K, E,
                            HAS_FINISHED: tl.constexpr, BLOCK: tl.constexpr):
        """For flat ``(R, K)`` indices: ``row_idx[i, j] = j * R + i``, and the experts of
        a finished row set to ``E``."""
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < R * K
        row = offsets // K
        index = ((offsets - row * K) * R + row).to(tl.int32)
        tl.store(row_idx_ptr + offsets, index, mask=mask)  # integer index
        if HAS_FINISHED:
            done = tl.load(finished_ptr + row, mask=mask, other=0)  # boolean mask (uint8)
            chosen = tl.load(idx_ptr + offsets, mask=mask)  # integer index
            tl.store(idx_ptr + offsets, tl.where(done != 0, E, chosen), mask=mask)  # integer index


    @triton.jit
    def _chosen_expert(idx_at, row_mask, E):
        """The experts one selection column names, -1 for an index outside ``[0, E)``: it
        meets no column of the row, the padded ones past E included."""
        chosen = tl.load(idx_at, mask=row_mask, other=-1)  # integer index
        return tl.where(chosen < E, chosen, -1)

    @triton.jit
    def _gating_backward_kernel(grad_y_ptr, x_ptr, idx_ptr, grad_out_ptr, dx_ptr, R, E, K,
                                stride_gy, stride_gyk, stride_x, stride_xe, stride_idx,
                                stride_idxk, stride_go, stride_goe, scale, eps,
                                HAS_GRAD_Y: tl.constexpr, HAS_OUT: tl.constexpr,
                                SIGMOID: tl.constexpr, RENORM: tl.constexpr,
                                WIDE: tl.constexpr, BLOCK_M: tl.constexpr,
                                BLOCK_E: tl.constexpr):
        """``BLOCK_M`` whole rows a program (persistently): the scores again from x, each
        chosen expert's gradient added where its index meets the row's columns (an index
        outside ``[0, E)`` meets none), then through softmax or sigmoid."""
        experts = tl.arange(0, BLOCK_E)[None, :]
        for tile in range(tl.program_id(0), tl.cdiv(R, BLOCK_M), tl.num_programs(0)):
            rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
            if WIDE:
                rows = rows.to(tl.int64)
            row_mask = rows < R
            mask = row_mask[:, None] & (experts < E)
            x = widen(tl.load(x_ptr + rows[:, None] * stride_x + experts * stride_xe,
                              mask=mask, other=NEG_INF))
            if SIGMOID:
                norm, rest = sigmoid_pair(x)
            else:
                exps = tl.where(mask, tl.exp(x - tl.max(x, 1)[:, None]), 0.0)
                norm = exps / tl.sum(exps, 1)[:, None]
            norm = tl.where(mask, norm, 0.0)
            grad_norm = tl.zeros([BLOCK_M, BLOCK_E], dtype=tl.float32)
            if HAS_GRAD_Y:
                total = tl.zeros([BLOCK_M], dtype=tl.float32)
                weighted = tl.zeros([BLOCK_M], dtype=tl.float32)
                if RENORM:
                    # The weights' sum and the gradient's projection on them first. The
                    # pointers step by a stride: no j x stride product to overflow int32.
                    idx_at = idx_ptr + rows * stride_idx
                    grad_at = grad_y_ptr + rows * stride_gy
                    for _ in range(0, K):
                        chosen = _chosen_expert(idx_at, row_mask, E)
                        g = widen(tl.load(grad_at, mask=row_mask, other=0.0))
                        weight = tl.sum(tl.where(experts == chosen[:, None], norm, 0.0), 1)
                        total += weight
                        weighted += g * weight
                        idx_at += stride_idxk
                        grad_at += stride_gyk
                    total += eps
                idx_at = idx_ptr + rows * stride_idx
                grad_at = grad_y_ptr + rows * stride_gy
                for _ in range(0, K):
                    chosen = _chosen_expert(idx_at, row_mask, E)
                    g = widen(tl.load(grad_at, mask=row_mask, other=0.0))
                    idx_at += stride_idxk
                    grad_at += stride_gyk
                    if RENORM:
                        # g / S - W / S^2 without S^2, which underflows for tiny weights.
                        g = (g - weighted / total) / total
                    grad_norm += tl.where(experts == chosen[:, None], (g * scale)[:, None],
                                          0.0)
            if HAS_OUT:
                grad_scores = widen(tl.load(grad_out_ptr + rows[:, None] * stride_go
                                            + experts * stride_goe, mask=mask, other=0.0))
                grad_norm += grad_scores
            if SIGMOID:
                dx = grad_norm * norm * rest
            else:
                projection = tl.sum(grad_norm * norm, 1)
                if HAS_GRAD_Y and RENORM:
                    # The chosen terms of sum(grad_norm * norm) add up to scale W eps / S^2
                    # exactly; summed, they cancel to float32 noise (twice the peer's). S = 0
                    # (no weight, eps 0) keeps the plain sum: 0, or NaN as the formula's.
                    exact = scale * (weighted / total) * (eps / total)
                    if HAS_OUT:
                        exact += tl.sum(grad_scores * norm, 1)
                    projection = tl.where(total > 0, exact, projection)
                dx = norm * (grad_norm - projection[:, None])
            tl.store(dx_ptr + rows[:, None] * E + experts, rounded_for(dx, dx_ptr),
                     mask=mask)


# ---------------------------------------------------------------------------------------------
# Launcher

FINISH_BLOCK = 1024


@MOE_GATING_TOP_K.launcher("triton")
def launch(plan: object, inputs: Sequence[torch.Tensor | None],
           outputs: Sequence[torch.Tensor], workspace: torch.Tensor | None) -> None:
    """``BLOCK_M`` rows a program (persistently), each row's experts as a
    ``(groups, experts per group)`` tile."""
    x, bias = inputs
    y, expert_idx, out = outputs
    attrs = plan.attrs
    rows, experts = x.shape
    groups, per_group, grouped = _layout(experts, attrs)
    if x.stride(1) != 1:
        x = x.contiguous()
    _gating_kernel[plan.grid](
        x, x if bias is None else bias.contiguous(), y, expert_idx, out, rows, experts,
        per_group, groups, attrs["k"], attrs["k_group"], x.stride(0),
        attrs["routed_scaling_factor"], attrs["eps"], HAS_BIAS=bias is not None,
        SIGMOID=attrs["norm_type"] == 1, GROUPED=grouped,
        TOP2=attrs["group_select_mode"] == 1,
        RENORM=renormalises(attrs["renorm"], attrs["norm_type"], attrs["sigmoid_renorm"]),
        OUT_FLAG=attrs["out_flag"], ROUND_SCORES=attrs["round_scores"],
        WIDE=wide_offsets(x, out), **plan.tiling.blocks, **launch_options(plan.tiling))


@MOE_GATING_TOP_K_SOFTMAX.launcher("triton")
def launch_softmax(plan: object, inputs: Sequence[torch.Tensor | None],
                   outputs: Sequence[torch.Tensor], workspace: torch.Tensor | None) -> None:
    """The gating step (softmax, no groups) on the flattened rows, writing y and the
    indices in place; then one kernel for the finished rows and row_idx."""
    x, finished = inputs
    experts = x.shape[-1]
    flat = x.reshape(-1, experts)
    rows = flat.shape[0]
    y, idx, row_idx = (t.view(rows, -1) for t in outputs)
    # The step's scores output (off here) is empty: an empty float32 view of row_idx
    # stands for it, where a fresh tensor would be an allocation on every call (narrow,
    # not indexing: a CPU-only torch cannot index the fake CUDA tensors of
    # tests/test_compiled_launches.py).
    unused_scores = row_idx.view(torch.float32).reshape(-1).narrow(0, 0, 0)
    plan.run_step("gating", MOE_GATING_TOP_K, flat, None, out=(y, idx, unused_scores),
                  k=plan.attrs["k"], round_scores=plan.attrs["round_scores"])
    count = row_idx.numel()
    _finish_rows_kernel[(cdiv(count, FINISH_BLOCK),)](
        idx, idx if finished is None else finished.contiguous().view(torch.uint8), row_idx,
        rows, plan.attrs["k"], experts, HAS_FINISHED=finished is not None,
        BLOCK=FINISH_BLOCK)


@MOE_GATING_TOP_K_BACKWARD.launcher("triton")
def launch_backward(plan: object, inputs: Sequence[torch.Tensor | None],
                    outputs: Sequence[torch.Tensor], workspace: torch.Tensor | None) -> None:
    """``BLOCK_M`` whole rows a program, any strides in."""
    grad_y, x, expert_idx, grad_out = inputs
    attrs = plan.attrs
    rows, experts = x.shape
    grad_y_strides = (0, 0) if grad_y is None else grad_y.stride()
    grad_out_strides = (0, 0) if grad_out is None else grad_out.stride()
    _gating_backward_kernel[plan.grid](
        x if grad_y is None else grad_y, x, expert_idx, x if grad_out is None else grad_out,
        outputs[0], rows, experts, expert_idx.shape[1], *grad_y_strides, *x.stride(),
        *expert_idx.stride(), *grad_out_strides, attrs["routed_scaling_factor"],
        attrs["eps"], HAS_GRAD_Y=grad_y is not None, HAS_OUT=grad_out is not None,
        SIGMOID=attrs["norm_type"] == 1, RENORM=attrs["renormalised"],
        WIDE=wide_offsets(*(t for t in (grad_y, x, expert_idx, grad_out) if t is not None),
                          outputs[0]),
        **plan.tiling.blocks, **launch_options(plan.tiling))


# ---------------------------------------------------------------------------------------------
# Backward


def _setup_context(ctx: object, inputs: tuple[object, ...], output: tuple[torch.Tensor, ...]
                   ) -> None:
    x, renorm, norm_type, out_flag, scale, eps, sigmoid_renorm = (inputs[0], *inputs[6:12])
    ctx.save_for_backward(x, output[1])
    ctx.out_flag = out_flag
    ctx.attrs = (norm_type, renormalises(renorm, norm_type, sigmoid_renorm), scale, eps)


@MOE_GATING_TOP_K.autograd(_setup_context)
def backward(ctx: object, grad_y: torch.Tensor | None, grad_idx: torch.Tensor | None,
             grad_out: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """dx through `moe_gating_top_k_backward`; the bias gets none."""
    x, idx = ctx.saved_tensors
    grad_x = MOE_GATING_TOP_K_BACKWARD(grad_y, x, idx, grad_out if ctx.out_flag else None,
                                       *ctx.attrs)
    return (grad_x, None, *([None] * len(GATING_ATTRS)))


def _softmax_setup_context(ctx: object, inputs: tuple[object, ...],
                           output: tuple[torch.Tensor, ...]) -> None:
    # A finished row's returned experts are E: without finished rows the returned
    # selection is the one the backward needs.
    ctx.save_for_backward(inputs[0], output[1] if inputs[1] is None else None)
    ctx.k, ctx.round_scores = inputs[2], inputs[3]


@MOE_GATING_TOP_K_SOFTMAX.autograd(_softmax_setup_context)
def softmax_backward(ctx: object, grad_y: torch.Tensor | None, grad_idx: torch.Tensor | None,
                     grad_row_idx: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """dx through `moe_gating_top_k_backward` at the chosen experts (chosen again from x
    where some rows finished); ``finished`` gets none."""
    x, idx = ctx.saved_tensors
    experts = x.shape[-1]
    flat = x.reshape(-1, experts)
    idx = select_experts(flat, None, ctx.k, 1, 1, 0, 0, ctx.round_scores) if idx is None \
        else idx.reshape(-1, ctx.k)
    grad = None if grad_y is None else grad_y.reshape(-1, ctx.k)
    grad_x = MOE_GATING_TOP_K_BACKWARD(grad, flat, idx, None, 0, False, 1.0, 0.0)
    return grad_x.reshape(x.shape), None, None, None


register_op(MOE_GATING_TOP_K_BACKWARD)
register_op(MOE_GATING_TOP_K)
register_op(MOE_GATING_TOP_K_SOFTMAX)


@MOE_GATING_TOP_K.exported
def moe_gating_top_k(x: torch.Tensor, k: int, *, bias: torch.Tensor | None = None,
                     k_group: int = 1, group_count: int = 1, group_select_mode: int = 0,
                     renorm: int = 0, norm_type: int = 0, out_flag: bool = False,
                     routed_scaling_factor: float = 1.0, eps: float = 1e-20,
                     sigmoid_renorm: bool = True, index_dtype: torch.dtype = torch.int32
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MoE routing with CANN MoeGatingTopK's semantics (formula in
    `opforge.ops.moe_gating`): softmax (``norm_type=0``) or sigmoid (1) scores in float32,
    ``bias`` for selection only, the best ``k_group`` of ``group_count`` groups (by max,
    ``group_select_mode=0``, or top-2 sum, 1), top-k (ties: lower index), weights from the
    un-biased scores, renormalised with ``+ eps`` for softmax when ``renorm=1`` and for
    sigmoid unless ``sigmoid_renorm=False`` (CANN always renormalises sigmoid weights;
    DeepSeek-V3's ``norm_topk_prob=False`` does not), times ``routed_scaling_factor``.

    Args:
        x: ``(..., E)`` fp16/bf16/fp32 logits, E <= 8192 (leading dims are flattened into
            rows and restored on the outputs). bias: ``(E,)`` of x's dtype or float32 (a
            float32 correction bias beside bf16 logits, as DeepSeek-V3 keeps it).
        index_dtype: ``torch.int32`` (CANN's) or ``torch.int64`` (what ``one_hot``,
            ``index_select`` and transformers' experts take).

    Returns:
        ``(y (..., k) in x's dtype, expert_idx (..., k) of index_dtype, out)``; ``out`` is
        the float32 scores ``(..., E)`` when ``out_flag``, else an empty float32 tensor.
        ``y`` is differentiable with respect to ``x`` (not through the selection); the
        backward reads the int32 indices (returned as they are for ``index_dtype=int32``),
        as torch.topk's does: changing them in place before it raises autograd's error
        (shift a copy for expert parallelism).

    Raises:
        ShapeError: x of no dims or a bad bias shape. DtypeError: a bias of another dtype,
        an index dtype other than int32/int64. AttrError: any constraint (``1 <= k <= E``,
        ``E % group_count == 0``, ``1 <= k_group <= group_count``,
        ``k <= k_group * E / group_count``, 2+ experts a group in mode 1).
    """
    if index_dtype not in (torch.int32, torch.int64):
        raise DtypeError("must be int32 or int64", op="moe_gating_top_k", param="index_dtype",
                         expected="int32 | int64", got=str(index_dtype))
    if x.dim() == 0:
        raise ShapeError("must have an experts dim", op="moe_gating_top_k", param="x",
                         expected="(..., E)", got=tuple(x.shape))
    leading = x.shape[:-1]
    y, idx, out = MOE_GATING_TOP_K(x.reshape(-1, x.shape[-1]), bias, k, k_group,
                       group_count, group_select_mode, renorm, norm_type, out_flag,
                       routed_scaling_factor, eps, sigmoid_renorm, False)
    if x.dim() != 2:
        y, idx = y.view(*leading, k), idx.view(*leading, k)
        out = out.view(*leading, x.shape[-1]) if out_flag else out
    return y, idx.to(index_dtype), out


@MOE_GATING_TOP_K_SOFTMAX.exported
def moe_gating_top_k_softmax(x: torch.Tensor, finished: torch.Tensor | None = None,
                             k: int = 1, round_scores: bool = False
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k of ``softmax(x)`` over the last dim with MoeGatingTopKSoftmax's outputs.

    Args:
        x: 2-D or 3-D logits. finished: bool of x's leading dims; those rows get expert
            index E. k: 1..min(E, 1024).
        round_scores: select on the probabilities rounded to x's dtype (ties to the lower
            expert), as the vendor's float16 golden does; by default the float32
            probabilities decide (more precise).

    Returns:
        ``(y, expert_idx, row_idx)`` of shape ``(*x.shape[:-1], k)``: y in x's dtype,
        int32 indices, ``row_idx[..., j] = j * N + i`` for flattened row i of N. y is
        differentiable through the gathered softmax scores (finished rows included); without
        ``finished`` the backward reads the returned indices (as torch.topk's does): change
        a copy of them, not them in place.

    Raises:
        ShapeError: x not 2-D/3-D or a bad ``finished``. AttrError: k out of range.
    """
    return MOE_GATING_TOP_K_SOFTMAX(x, finished, k, round_scores)
