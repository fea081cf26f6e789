"""Attention over packed variable-length sequences (layout ``TND``), flash-style:
``attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, max_seqlen_q,
max_seqlen_k)`` and its gradient ``attention_varlen_backward``.

``q`` is ``(T, H, D)``, ``k`` ``(Tk, Hkv, D)``, ``v`` ``(Tk, Hkv, Dv)``: the tokens of
``B`` sequences one after another; sequence ``b`` holds query rows ``cu_seqlens_q[b]`` to
``cu_seqlens_q[b + 1]`` and key rows ``cu_seqlens_k[b]`` to ``cu_seqlens_k[b + 1]``
(int32 or int64 cumulative lengths, ``B + 1`` of them, from 0 to ``T`` and to ``Tk``). Each
sequence attends to its own keys only, as `opforge.ops.attention` does on one batch entry
(grouped-query heads, ``causal`` aligned to the bottom-right of each sequence, a query
that sees no key gets ``out = 0`` and ``lse = -inf``). Outputs: ``out`` ``(T, H, Dv)`` in
q's dtype and ``lse`` ``(H, T)`` float32 (float64 for float64 inputs). CANN's
FlashAttentionScore takes the same packing as ``input_layout="TND"`` with
``actual_seq_qlen`` / ``actual_seq_kvlen``.

The kernels are attention's own (forward, dQ, dK/dV) with ``VARLEN``: a program's batch
entry is a sequence, whose first row and length it reads from the cumulative lengths, so
no ``T x T`` mask exists and no block of keys from another sequence is read.
``max_seqlen_q`` / ``max_seqlen_k`` size the grid and the tiles; smaller than a real
length they only cost speed (programs loop over query blocks), larger only idle programs.
The pointer kernels run (no tensor-descriptor variants, no GQA packing, no key splits).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Sequence
from types import SimpleNamespace

import torch

from opforge.core import backends
from opforge.core.errors import IndexRangeError, ShapeError
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
from opforge.core.shapes import is_unknown_rank
from opforge.core.tiling import MAX_PROGRAMS, cdiv
from opforge.library import register_op
from opforge.ops import attention as dense
from opforge.ops._elementwise import random_input
from opforge.ops._rows import SHARED_ROW_STATISTIC
from opforge.ops._statistics import (
    STATISTICS_DTYPES,
    check_scalar,
    check_statistics,
    statistics_dtype,
)
from opforge.precision.cases import LONG_ROW, generate

NAME = "attention_varlen"
BACKWARD_NAME = f"{NAME}_backward"
CU_SEQLENS = (TensorArg("cu_seqlens_q", dtypes=(torch.int32, torch.int64),
                        doc="(B + 1,) cumulative query lengths, 0 to T"),
              TensorArg("cu_seqlens_k", dtypes=(torch.int32, torch.int64),
                        doc="(B + 1,) cumulative key lengths, 0 to Tk"))
ATTRS = (dense.CAUSAL, dense.SCALE,
         Attr("max_seqlen_q", "int", None, range=(0, None),
              doc="the longest query sequence (sizes the grid); None: T"),
         Attr("max_seqlen_k", "int", None, range=(0, None),
              doc="the longest key sequence (sizes the tiles); None: Tk"),
         dense.WINDOW_LEFT, dense.WINDOW_RIGHT, dense.SOFTCAP)


def _shapes(q: object, k: object, v: object, cu_q: object, cu_k: object, op: str
            ) -> tuple[int, ...]:
    """(B, H, Hkv, T, Tk, D, Dv) of a call.

    Raises:
        ShapeError: not 3-D ``(T, H, D)``, key/value mismatch, heads not grouped, a head
            dim beyond 256, cumulative lengths that are not 1-D of one length.
    """
    for name, spec in (("q", q), ("k", k), ("v", v)):
        if len(spec.shape) != 3:
            raise ShapeError("must be 3-D [T, H, D] (packed sequences)", op=op, param=name,
                             expected="(T, H, D)", got=tuple(spec.shape))
    for name, spec in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if len(spec.shape) != 1 or spec.shape[0] < 1:
            raise ShapeError("must be 1-D: B + 1 cumulative lengths", op=op, param=name,
                             expected="(B + 1,)", got=tuple(spec.shape))
    if cu_k.shape[0] != cu_q.shape[0]:
        raise ShapeError("must hold as many sequences as cu_seqlens_q", op=op,
                         param="cu_seqlens_k", expected=tuple(cu_q.shape),
                         got=tuple(cu_k.shape))
    # attention's checks on one batch entry holding every token, ``(1, H, T, D)``.
    _, h, hkv, t, tk, d, dv = dense._shapes(*(
        SimpleNamespace(shape=(1, x.shape[1], x.shape[0], x.shape[2])) for x in (q, k, v)), op)
    return cu_q.shape[0] - 1, h, hkv, t, tk, d, dv


def _check(inputs: Specs, attrs: Attrs) -> None:
    q, k, v, cu_q, cu_k = inputs
    check_scalar(NAME, "scale", attrs["scale"], inputs)
    dense.check_softcap(NAME, attrs, inputs)
    dense._same_dtype(NAME, q, (("k", k), ("v", v)))
    if not any(is_unknown_rank(t.shape) for t in inputs):
        _shapes(q, k, v, cu_q, cu_k, NAME)


# Lengths read on the host, by tensor identity (a weak reference, so that a new tensor at
# a dead one's address is not taken for it), with the version and token count they were
# read at: a model's layers (forward and backward) share one packing, which is read once
# instead of once per layer and pass (on an accelerator each read is a synchronisation).
# An in-place update bumps the tensor's version, and the next call reads it again.
_checked: dict[int, tuple[weakref.ref, int, int]] = {}
MAX_CHECKED = 64


def _ends(cu: torch.Tensor) -> list[int]:
    return cu.tolist()


def check_lengths(plan: object, cu: torch.Tensor, total: int, name: str) -> None:
    """``cu`` runs from 0 to ``total`` without decreasing, by one host read per version of
    the tensor (skipped where host reads are not allowed: the kernels clamp each sequence
    to the tokens there are, rows no sequence holds get 0 (lse -inf, no gradient), and
    sequences that overlap, after a decrease, write their common rows in no defined order).

    Raises:
        IndexRangeError: a first length other than 0, a decrease, a last length other
            than ``total``.
    """
    if not backends.host_reads_allowed(cu.device):
        return
    seen = _checked.get(id(cu))
    if seen is not None and seen[0]() is cu and seen[1:] == (cu._version, total):
        return
    ends = _ends(cu)
    bad = next((i for i in range(1, len(ends)) if ends[i] < ends[i - 1]), None)
    if ends[0] != 0 or ends[-1] != total or bad is not None:
        raise IndexRangeError("must be cumulative lengths from 0 to the token count",
                              op=plan.op.name, param=name,
                              expected=f"0 = {name}[0] <= ... <= {name}[-1] = {total}",
                              got=ends if len(ends) <= 16 else f"{ends[:8]} ... {ends[-8:]}")
    if len(_checked) >= MAX_CHECKED:
        _checked.clear()
    _checked[id(cu)] = (weakref.ref(cu), cu._version, total)


def _value_check(first: int) -> Callable[[object, Sequence[torch.Tensor | None]], None]:
    """The lengths' check of an operator whose q is input ``first`` (k the next), the
    lengths its last two inputs."""
    def check(plan: object, inputs: Sequence[torch.Tensor | None]) -> None:
        check_lengths(plan, inputs[-2], inputs[first].shape[0], "cu_seqlens_q")
        check_lengths(plan, inputs[-1], inputs[first + 1].shape[0], "cu_seqlens_k")
    return check


def _infer_shape(inputs: Specs, attrs: Attrs) -> list[tuple[int, ...]]:
    q, _, v = inputs[:3]
    return [(*q.shape[:2], v.shape[2]), (q.shape[1], q.shape[0])]


def _infer_dtype(inputs: Specs, attrs: Attrs) -> list[torch.dtype]:
    return [inputs[0].dtype, statistics_dtype(inputs[0].dtype)]


def _lengths(b: int, t: int, tk: int, attrs: Attrs) -> tuple[int, int]:
    """(query, key) rows a sequence's tiles are sized for: the given longest, else all."""
    return (t if attrs["max_seqlen_q"] is None else attrs["max_seqlen_q"],
            tk if attrs["max_seqlen_k"] is None else attrs["max_seqlen_k"])


def _pairs(b: int, h: int, t: int, tk: int, attrs: Attrs) -> int:
    """(query, key) pairs computed, estimated as ``B`` sequences of the mean lengths (the
    lengths are data, which a cost model does not read)."""
    if b == 0:
        return 0
    return b * h * dense._visible_pairs(t // b, tk // b, dense.limits_of(attrs))


def _cost(inputs: Specs, outputs: Specs, attrs: Attrs) -> Cost:
    """attention's cost on ``B`` sequences of the mean lengths (an estimate, see `_pairs`)."""
    b, h, hkv, t, tk, d, dv = _shapes(*inputs, NAME)
    item = inputs[0].itemsize
    return Cost(flops=2 * _pairs(b, h, t, tk, attrs) * (d + dv),
                bytes_moved=item * (h * t * (d + dv) + hkv * tk * (d + dv)) + 4 * h * t
                + 8 * (b + 1))


def _tiles(inputs: Specs, attrs: Attrs, hardware: HardwareProfile, backward: bool
           ) -> list[Tiling]:
    """attention's pointer-kernel tiles for the longest sequences (no GQA packing, no
    key splits)."""
    b, _, _, t, tk, d, dv = _shapes(*inputs, NAME)
    sq, sk = _lengths(b, t, tk, attrs)
    return [tiling for tiling in dense._tiles(sq, sk, d, dv, inputs[0].itemsize, hardware,
                                              backward=backward)
            if tiling.variant == "flash"]


def _grid(tiling: Tiling, inputs: Specs, outputs: Specs, attrs: Attrs,
          hardware: HardwareProfile) -> tuple[int, ...]:
    """(query blocks of the longest sequence, sequences x heads), capped at the grid
    limit (programs loop)."""
    b, h, _, t, tk, _, _ = _shapes(*inputs, NAME)
    sq, _ = _lengths(b, t, tk, attrs)
    return (max(1, min(cdiv(sq, tiling.blocks["BLOCK_M"]), MAX_PROGRAMS)),
            max(1, min(b * h, MAX_PROGRAMS)))


def _sequences(cu_q: torch.Tensor, cu_k: torch.Tensor, t: int, tk: int
               ) -> list[tuple[slice, slice]]:
    """Each sequence's (query rows, key rows), clamped to the tokens as the kernels clamp
    them (`opforge.ops.attention._sequence`)."""
    def spans(ends: list[int], total: int) -> list[slice]:
        result = []
        for first, last in itertools.pairwise(ends):
            start = min(max(first, 0), total)
            result.append(slice(start, min(max(last, start), total)))
        return result

    return list(zip(spans(cu_q.tolist(), t), spans(cu_k.tolist(), tk), strict=True))


def _dense(x: torch.Tensor, rows: slice) -> torch.Tensor:
    """Rows of a ``(T, H, D)`` tensor as attention's ``(1, H, S, D)``, contiguous: torch's
    products then add in one order whatever the packed tensor's layout."""
    return x[rows].transpose(0, 1)[None].contiguous()


def _per_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                  cu_k: torch.Tensor,
                  attend: Callable[..., tuple[torch.Tensor, torch.Tensor]]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out ``(T, H, Dv)``, lse ``(H, T)``) from ``attend(q, k, v)`` on each sequence's
    ``(1, H, S, D)`` views; rows no sequence holds (lengths not checked, inside
    `opforge.device_side_checks`) get 0 and -inf, as in the kernels."""
    out = lse = None
    for rows, keys in _sequences(cu_q, cu_k, q.shape[0], k.shape[0]):
        part_out, part_lse = attend(_dense(q, rows), _dense(k, keys), _dense(v, keys))
        if lse is None:
            out = part_out.new_zeros((*q.shape[:2], v.shape[2]))
            lse = part_lse.new_full((q.shape[1], q.shape[0]), -torch.inf)
        out[rows] = part_out[0].transpose(0, 1)
        lse[:, rows] = part_lse[0]
    if lse is None:  # no sequence
        out = q.new_zeros((*q.shape[:2], v.shape[2]))
        lse = q.new_full((q.shape[1], q.shape[0]), -torch.inf,
                         dtype=statistics_dtype(q.dtype))
    return out, lse


def _samples(dtype: torch.dtype, device: torch.device, generator: torch.Generator
             ) -> list[Case]:
    def packed(lengths: Sequence[int], key_lengths: Sequence[int], h: int, hkv: int, d: int,
               dv: int | None = None, scale: float = 1.0) -> tuple[torch.Tensor, ...]:
        t, tk = sum(lengths), sum(key_lengths)
        return (random_input((t, h, d), dtype, device, generator, scale=scale),
                random_input((tk, hkv, d), dtype, device, generator, scale=scale),
                random_input((tk, hkv, dv or d), dtype, device, generator),
                cumulative(lengths, device), cumulative(key_lengths, device))

    return [
        Case("three_sequences", packed((5, 17, 9), (5, 17, 9), 2, 2, 16)),
        Case("causal_three", packed((5, 17, 9), (5, 17, 9), 2, 2, 32), {"causal": True}),
        # Key lengths that differ from the query lengths: bottom-right per sequence, a
        # sequence whose early queries see no key, an empty sequence, one without keys.
        Case("causal_offsets_gqa", packed((3, 0, 20, 6, 4), (9, 0, 12, 0, 4), 4, 2, 64),
             {"causal": True, "max_seqlen_q": 20, "max_seqlen_k": 12}),
        Case("one_sequence_d100_dv40", packed((33,), (29,), 2, 1, 100, 40),
             {"scale": 0.05}),
        Case("peaked_scores", packed((24, 8), (24, 8), 2, 2, 32, scale=4.0),
             {"causal": True}),
        # A longest sequence given shorter than the real one: programs loop.
        Case("max_seqlen_underestimated", packed((70, 3), (70, 3), 1, 1, 16),
             {"causal": True, "max_seqlen_q": 16, "max_seqlen_k": 16}),
        Case("no_tokens", packed((), (), 2, 2, 16)),
        # A sliding window per sequence, and a band past some sequences' keys.
        Case("sliding_window_gqa", packed((6, 40, 13), (6, 40, 20), 4, 2, 32),
             {"causal": True, "window_left": 5}),
        Case("band_off_diagonal", packed((9, 30), (2, 35), 2, 2, 16),
             {"window_left": 3, "window_right": -4}),
    ]


def cumulative(lengths: Sequence[int], device: torch.device | str | None = None
               ) -> torch.Tensor:
    """int32 cumulative lengths ``[0, l0, l0 + l1, ...]`` of sequence ``lengths``."""
    ends = [0]
    for length in lengths:
        ends.append(ends[-1] + length)
    return torch.tensor(ends, dtype=torch.int32, device=device)


def _sweep(kind: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
           generator: torch.Generator) -> list[Case]:
    """q, k and v drawn from the kind as three packed sequences, two heads: S, S / 3 and
    S / 2 tokens with S the shape's leading size (8 to 96), D its last (at most 64; 16 for
    1-D shapes); one plain and one causal case. As attention's sweep, ``long_rows`` is a
    long context (3 queries over 65537 keys and a short sequence, one head, D = 16) and
    ``masked_rows`` causal with each sequence's keys half its queries (the first queries
    see no key). No sequence is of one key: there every gradient but dV cancels exactly,
    and its rounding noise is all a comparison would see."""
    def draw(source: str, tokens: int, heads: int, dim: int) -> torch.Tensor:
        return generate(source, (tokens, heads, dim), dtype, device=device,
                        generator=generator)

    source, heads = ("normal" if kind in ("long_rows", "masked_rows") else kind), 2
    if kind == "long_rows":
        lengths, key_lengths, heads, dim = (3, 5), (LONG_ROW, 5), 1, 16
    else:
        seq = max(8, min(shape[0], 96))
        dim = min(shape[-1], 64) if len(shape) > 1 else 16
        lengths = (seq, max(8, seq // 3), max(8, seq // 2))
        key_lengths = tuple(n // 2 for n in lengths) if kind == "masked_rows" else lengths
    inputs = (draw(source, sum(lengths), heads, dim),
              draw(source, sum(key_lengths), heads, dim),
              draw(source, sum(key_lengths), heads, dim),
              cumulative(lengths, device), cumulative(key_lengths, device))
    causal = Case("causal", inputs, {"causal": True})
    return [causal] if kind == "masked_rows" else [Case("", inputs), causal]


def _error_scale(opdef: OpDef, inputs: Sequence[torch.Tensor | None], attrs: Attrs,
                 golden: torch.Tensor, output: str) -> torch.Tensor:
    """attention's error scale (`opforge.ops.attention`) per sequence."""
    q, k, v, cu_q, cu_k = inputs
    dense_attrs = {name: attrs[name] for name in ("causal", "scale", "window_left",
                                                  "window_right", "softcap")}

    def scales(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        scale = dense._attention_scale(dense.ATTENTION, (q, k, v, None), dense_attrs,
                                       golden, output)
        return (scale, scale[..., 0]) if output == "out" else (scale[..., None], scale)

    out_scale, lse_scale = _per_sequence(q.double(), k.double(), v.double(), cu_q, cu_k,
                                         scales)
    return out_scale if output == "out" else lse_scale


def _torch_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            cu_q: torch.Tensor, cu_k: torch.Tensor, causal: bool,
                            scale: float | None, max_seqlen_q: int | None,
                            max_seqlen_k: int | None, window_left: int | None = None,
                            window_right: int | None = None, softcap: float | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """torch SDPA per sequence (attention's peer)"""
    return _per_sequence(q, k, v, cu_q, cu_k, lambda q, k, v: dense._torch_attention(
        q, k, v, None, causal, scale, window_left, window_right, softcap))


def _bench_case(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                generator: torch.Generator) -> Case:
    """Causal packed sequences of 1024 tokens (the last takes the rest), ``shape = (T, H,
    D)``, a key/value head per four query heads: equal lengths, so that the cost model's
    count of the work (`_pairs`) is exact."""
    t, h, d = shape
    count = max(1, t // 1024)
    lengths = [t // count] * (count - 1) + [t - (t // count) * (count - 1)]
    hkv = h // 4 if h % 4 == 0 else h
    q, k, v = (generate("normal", (t, heads, d), dtype, device=device, generator=generator)
               for heads in (h, hkv, hkv))
    cu = cumulative(lengths, device)
    return Case("causal", (q, k, v, cu, cu), {"causal": True, "max_seqlen_q": max(lengths),
                                              "max_seqlen_k": max(lengths)})


ATTENTION_VARLEN = OpDef(
    name=NAME, doc="Flash-style attention over packed variable-length sequences [T, H, D] "
                   "(cumulative lengths), GQA, bottom-right causal per sequence.",
    inputs=(TensorArg("q"), TensorArg("k"), TensorArg("v"), *CU_SEQLENS),
    outputs=(OutputArg("out"), OutputArg("lse")), attrs=ATTRS,
    infer_shape=_infer_shape, infer_dtype=_infer_dtype, check=_check,
    check_values=_value_check(0), cost=_cost,
    tiling=lambda inputs, outputs, attrs, hardware: _tiles(inputs, attrs, hardware, False),
    grid=_grid, samples=_samples, error_scale=_error_scale,
    precision=PrecisionSpec("benchmark_ratio", "L0", _torch_attention_varlen, sweep=_sweep,
                            known_limitations=(dense.CANCELLING_TERMS,
                                               dense.OVERFLOWING_SCORES,
                                               dense.SUBNORMAL_MEANS)),
    bench=BenchSpec(shapes=((8192, 32, 128), (32768, 32, 128)),
                    cpu_shapes=((256, 4, 64), (2048, 4, 64)), case=_bench_case,
                    metric="TFLOP/s"))


def _check_backward(inputs: Specs, attrs: Attrs) -> None:
    dout, q, k, v, out, lse, grad_lse, cu_q, cu_k = inputs
    check_scalar(BACKWARD_NAME, "scale", attrs["scale"], inputs)
    dense.check_softcap(BACKWARD_NAME, attrs, inputs)
    dense._same_dtype(BACKWARD_NAME, q, (("k", k), ("v", v), ("dout", dout), ("out", out)))
    check_statistics(BACKWARD_NAME, q, [("lse", lse), ("grad_lse", grad_lse)])
    if any(is_unknown_rank(t.shape) for t in inputs if t is not None):
        return
    _, h, _, t, _, _, dv = _shapes(q, k, v, cu_q, cu_k, BACKWARD_NAME)
    for name, spec, shape in (("dout", dout, (t, h, dv)), ("out", out, (t, h, dv)),
                              ("lse", lse, (h, t)), ("grad_lse", grad_lse, (h, t))):
        if spec is not None and tuple(spec.shape) != shape:
            raise ShapeError("has the wrong shape", op=BACKWARD_NAME, param=name,
                             expected=shape, got=tuple(spec.shape))


def _backward_cost(inputs: Specs, outputs: Specs, attrs: Attrs) -> Cost:
    """attention_backward's cost on ``B`` sequences of the mean lengths (an estimate)."""
    b, h, hkv, t, tk, d, dv = _shapes(*inputs[1:4], *inputs[7:], BACKWARD_NAME)
    item = inputs[1].itemsize
    pairs = _pairs(b, h, t, tk, attrs)
    return Cost(flops=2 * pairs * (4 * d + 3 * dv),
                bytes_moved=h * t * (2 * d + 2 * dv) * item + 2 * h * t * 4
                + hkv * tk * 2 * (d + dv) * item + 8 * (b + 1))


def _backward_specs(inputs: Specs) -> Specs:
    """The forward's inputs (q, k, v and the lengths) of a backward call."""
    return (*inputs[1:4], *inputs[7:])


def _backward_samples(dtype: torch.dtype, device: torch.device, generator: torch.Generator
                      ) -> list[Case]:
    cases = []
    for case in _samples(dtype, device, generator):
        cases.append(Case(case.name, _backward_inputs(
            *case.inputs, ATTENTION_VARLEN.bind_attrs(case.attrs), generator), case.attrs))
    first = cases[1]
    cases.append(Case("with_grad_lse", _backward_inputs(
        *first.inputs[1:4], *first.inputs[7:], ATTENTION_VARLEN.bind_attrs(first.attrs),
        generator, with_grad_lse=True), first.attrs))
    return cases


def _backward_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                     cu_k: torch.Tensor, attrs: Attrs, generator: torch.Generator,
                     with_grad_lse: bool = False) -> tuple[torch.Tensor | None, ...]:
    """(dout, q, k, v, out, lse, grad_lse, cu_q, cu_k): out and lse from the float64
    forward rounded to their dtypes, dout drawn normal."""
    out, lse = reference(q.double(), k.double(), v.double(), cu_q, cu_k,
                         compute_dtype=torch.float64, **attrs)
    dout = torch.randn(out.shape, generator=generator).to(q.device, q.dtype)
    statistics = statistics_dtype(q.dtype)
    grad_lse = torch.randn(lse.shape, generator=generator).to(q.device, statistics) \
        if with_grad_lse else None
    return dout, q, k, v, out.to(q.dtype), lse.to(statistics), grad_lse, cu_q, cu_k


def _backward_sweep(kind: str, shape: tuple[int, ...], dtype: torch.dtype,
                    device: torch.device, generator: torch.Generator) -> list[Case]:
    """The forward's sweep cases with dout normal, out and lse from the float64 forward."""
    return [Case(case.name, _backward_inputs(*case.inputs,
                                             ATTENTION_VARLEN.bind_attrs(case.attrs),
                                             generator), case.attrs)
            for case in _sweep(kind, shape, dtype, device, generator)]


def _gradients_per_sequence(inputs: Sequence[torch.Tensor | None],
                            gradients: Callable[..., tuple[torch.Tensor, ...]]
                            ) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) in the packed layout from ``gradients(dout, q, k, v, out, lse,
    grad_lse)`` on each sequence's ``(1, H, S, D)`` views (lse ``(1, H, S)``)."""
    dout, q, k, v, out, lse, grad_lse, cu_q, cu_k = inputs
    results: list[torch.Tensor] | None = None
    for rows, keys in _sequences(cu_q, cu_k, q.shape[0], k.shape[0]):
        parts = gradients(_dense(dout, rows), _dense(q, rows), _dense(k, keys),
                          _dense(v, keys), _dense(out, rows), lse[None, :, rows],
                          None if grad_lse is None else grad_lse[None, :, rows])
        if results is None:
            results = [torch.zeros(x.shape, dtype=parts[0].dtype, device=x.device)
                       for x in (q, k, v)]
        for result, part, span in zip(results, parts, (rows, keys, keys)):
            result[span] = part[0].transpose(0, 1)
    if results is None:
        results = [torch.zeros_like(x) for x in (q, k, v)]
    return tuple(results)


def _backward_scale(opdef: OpDef, inputs: Sequence[torch.Tensor | None], attrs: Attrs,
                    golden: torch.Tensor, output: str) -> torch.Tensor:
    """attention_backward's error scale per sequence: the gradient formulas on
    magnitudes."""
    wide = [t if t is None or not t.is_floating_point() else t.to(torch.float64)
            for t in inputs]
    grads = _gradients_per_sequence(wide, lambda *args: dense._backward_terms(
        *args, None, compute_dtype=torch.float64, magnitudes=True, causal=attrs["causal"],
        scale=attrs["scale"], window_left=attrs["window_left"],
        window_right=attrs["window_right"], softcap=attrs["softcap"]))
    result = grads[("grad_q", "grad_k", "grad_v").index(output)]
    return torch.where(result > 0, result, torch.ones_like(result))


def _torch_attention_varlen_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                                     v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                                     grad_lse: torch.Tensor | None, cu_q: torch.Tensor,
                                     cu_k: torch.Tensor, causal: bool, scale: float | None,
                                     max_seqlen_q: int | None, max_seqlen_k: int | None,
                                     window_left: int | None = None,
                                     window_right: int | None = None,
                                     softcap: float | None = None
                                     ) -> tuple[torch.Tensor, ...]:
    """torch.autograd through SDPA per sequence (attention_backward's peer)"""
    return _gradients_per_sequence(
        (dout, q, k, v, out, lse, grad_lse, cu_q, cu_k),
        lambda dout, q, k, v, out, lse, grad_lse: dense._torch_attention_backward(
            dout, q, k, v, out, lse, grad_lse, None, causal, scale, window_left,
            window_right, softcap))


ATTENTION_VARLEN_BACKWARD = OpDef(
    name=BACKWARD_NAME, doc="Gradients of attention_varlen by recomputation from the "
                            "saved lse.",
    inputs=(TensorArg("dout"), TensorArg("q"), TensorArg("k"), TensorArg("v"),
            TensorArg("out"), TensorArg("lse", dtypes=STATISTICS_DTYPES),
            TensorArg("grad_lse", dtypes=STATISTICS_DTYPES, optional=True), *CU_SEQLENS),
    outputs=(OutputArg("grad_q"), OutputArg("grad_k"), OutputArg("grad_v")), attrs=ATTRS,
    infer_shape=lambda inputs, attrs: [tuple(inputs[i].shape) for i in (1, 2, 3)],
    infer_dtype=lambda inputs, attrs: [inputs[i].dtype for i in (1, 2, 3)],
    check=_check_backward, check_values=_value_check(1), cost=_backward_cost,
    tiling=lambda inputs, outputs, attrs, hardware: _tiles(_backward_specs(inputs), attrs,
                                                           hardware, True),
    grid=lambda tiling, inputs, outputs, attrs, hardware: _grid(
        tiling, _backward_specs(inputs), outputs, attrs, hardware),
    workspace=lambda tiling, grid, inputs, outputs, attrs: 4 * inputs[1].shape[0]
    * inputs[1].shape[1],
    samples=_backward_samples, error_scale=_backward_scale,
    precision=PrecisionSpec("benchmark_ratio", "L0", _torch_attention_varlen_backward,
                            sweep=_backward_sweep, known_limitations=(
                                dense.CANCELLING_TERMS, dense.OVERFLOWING_SCORES,
                                dense.SUBNORMAL_MEANS, dense.RECOMPUTED_EXPONENTS,
                                SHARED_ROW_STATISTIC)))


# ---------------------------------------------------------------------------------------------
# References


@ATTENTION_VARLEN.reference
def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
              cu_k: torch.Tensor, *, compute_dtype: torch.dtype, causal: bool,
              scale: float | None, max_seqlen_q: int | None, max_seqlen_k: int | None,
              window_left: int | None = None, window_right: int | None = None,
              softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """attention's reference on each sequence, in ``compute_dtype``."""
    return _per_sequence(q, k, v, cu_q, cu_k, lambda q, k, v: dense.reference(
        q, k, v, None, compute_dtype=compute_dtype, causal=causal, scale=scale,
        window_left=window_left, window_right=window_right, softcap=softcap))


@ATTENTION_VARLEN_BACKWARD.reference
def backward_reference(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, grad_lse: torch.Tensor | None,
                       cu_q: torch.Tensor, cu_k: torch.Tensor, *, compute_dtype: torch.dtype,
                       causal: bool, scale: float | None, max_seqlen_q: int | None,
                       max_seqlen_k: int | None, window_left: int | None = None,
                       window_right: int | None = None, softcap: float | None = None
                       ) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) in ``compute_dtype``: attention_backward's reference on each
    sequence."""
    return _gradients_per_sequence(
        (dout, q, k, v, out, lse, grad_lse, cu_q, cu_k),
        lambda *args: dense.backward_reference(*args, None, compute_dtype=compute_dtype,
                                               causal=causal, scale=scale,
                                               window_left=window_left,
                                               window_right=window_right, softcap=softcap))


# ---------------------------------------------------------------------------------------------
# Launchers


def _packed_strides(x: torch.Tensor) -> tuple[int, int, int, int]:
    """A ``(T, H, D)`` tensor's strides in the kernels' (batch, head, row, column) order:
    the batch stride 0 (a sequence starts at its first row)."""
    return 0, x.stride(1), x.stride(0), x.stride(2)


@ATTENTION_VARLEN.launcher("triton")
def launch(plan: object, inputs: Sequence[torch.Tensor | None],
           outputs: Sequence[torch.Tensor], workspace: torch.Tensor | None) -> None:
    """attention's forward kernel with ``VARLEN``: programs over (query blocks of the
    longest sequence, sequences x heads)."""
    q, k, v, cu_q, cu_k = inputs
    out, lse = outputs
    b, h, hkv, t, tk, d, dv = _shapes(q, k, v, cu_q, cu_k, NAME)
    if t == 0:
        return
    cu_q, cu_k = cu_q.contiguous(), cu_k.contiguous()  # read by offset
    if not backends.host_reads_allowed(q.device):
        # Unchecked lengths may leave rows out of every sequence: defined as no key seen.
        out.zero_()
        lse.fill_(-torch.inf)
    options = dense._launch_options(plan, (q, k, v, out), "BLOCK_M", "BLOCK_N")
    qk_scale = dense._scale_of(plan.attrs, d) * dense.LOG2_E
    reach, band = dense.band_arguments(plan.attrs, t, tk)
    for first, count in dense._head_chunks(b * h):
        dense._attention_forward_kernel[(plan.grid[0], count, 1)](
            q, k, v, q, out, lse, cu_q, cu_k, t, tk, h, h // hkv, first, b * h, tk, qk_scale,
            *reach, *_packed_strides(q), *_packed_strides(k), *_packed_strides(v), 0, 0, 0, 0,
            d, dv, MASK=0, BAND=band, DESCRIPTORS=False, WARP_SPECIALIZE=False,
            EXACT_HEAD=dense._exact_head(options, d, dv), PACK=1,
            SOFTCAP=dense.softcap_argument(plan.attrs),
            FOLD_SCALE=qk_scale > 0 and plan.attrs["softcap"] is None, VARLEN=True, **options)


@ATTENTION_VARLEN_BACKWARD.launcher("triton")
def launch_backward(plan: object, inputs: Sequence[torch.Tensor | None],
                    outputs: Sequence[torch.Tensor], workspace: torch.Tensor | None) -> None:
    """attention_backward's dQ and dK/dV kernels with ``VARLEN``."""
    dout, q, k, v, out, lse, grad_lse, cu_q, cu_k = inputs
    grad_q, grad_k, grad_v = outputs
    b, h, hkv, t, tk, d, dv = _shapes(q, k, v, cu_q, cu_k, BACKWARD_NAME)
    if t == 0 or tk == 0:
        for grad in outputs:
            grad.zero_()
        return
    lse = lse.contiguous()
    grad_lse = None if grad_lse is None else grad_lse.contiguous()
    cu_q, cu_k = cu_q.contiguous(), cu_k.contiguous()  # read by offset
    if not backends.host_reads_allowed(q.device):
        for grad in outputs:  # rows out of every sequence: no gradient
            grad.zero_()
    delta = workspace[:4 * h * t].view(torch.float32)
    tensors = (q, k, v, dout, out, grad_q, grad_k, grad_v)
    query_side = dense._launch_options(plan, tensors, "BLOCK_M", "BLOCK_N")
    key_side = dense._launch_options(plan, tensors, "BLOCK_K", "BLOCK_Q")
    exact = dense._exact_head(query_side, d, dv)
    scale = dense._scale_of(plan.attrs, d)
    reach, band = dense.band_arguments(plan.attrs, t, tk)
    for first, count in dense._head_chunks(b * h):
        dense._attention_query_side_kernel[(plan.grid[0], count)](
            dout, q, k, v, out, lse, lse if grad_lse is None else grad_lse, delta, grad_q,
            q, cu_q, cu_k, t, tk, h, h // hkv, first, scale * dense.LOG2_E, scale, *reach,
            *_packed_strides(dout), *_packed_strides(q), *_packed_strides(k),
            *_packed_strides(v), *_packed_strides(out), 0, 0, 0, 0, d, dv, MASK=0, BAND=band,
            HAS_GRAD_LSE=grad_lse is not None, DESCRIPTORS=False, EXACT_HEAD=exact,
            SOFTCAP=dense.softcap_argument(plan.attrs), VARLEN=True, **query_side)
    _, sk = _lengths(b, t, tk, plan.attrs)
    key_blocks = max(1, min(cdiv(max(sk, 1), plan.tiling.blocks["BLOCK_K"]), MAX_PROGRAMS))
    for first, count in dense._head_chunks(b * hkv):
        dense._attention_key_side_kernel[(key_blocks, count)](
            dout, q, k, v, lse, delta, grad_k, grad_v, q, cu_q, cu_k, t, tk, h, hkv,
            h // hkv, first, scale * dense.LOG2_E, scale, *reach, *_packed_strides(dout),
            *_packed_strides(q), *_packed_strides(k), *_packed_strides(v), 0, 0, 0, 0, d, dv,
            MASK=0, BAND=band, DESCRIPTORS=False, EXACT_HEAD=exact, VARLEN=True,
            SOFTCAP=dense.softcap_argument(plan.attrs), **key_side)


# ---------------------------------------------------------------------------------------------
# Backward


def _setup_context(ctx: object, inputs: tuple[object, ...], output: tuple[torch.Tensor, ...]
                   ) -> None:
    q, k, v, cu_q, cu_k, *attrs = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.attrs = attrs


@ATTENTION_VARLEN.autograd(_setup_context)
def backward(ctx: object, grad_out: torch.Tensor | None, grad_lse: torch.Tensor | None
             ) -> tuple[torch.Tensor | None, ...]:
    """dq, dk, dv through `attention_varlen_backward`; the lengths get none."""
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    grad_q, grad_k, grad_v = ATTENTION_VARLEN_BACKWARD(
        grad_out, q, k, v, out, lse, grad_lse, cu_q, cu_k, *ctx.attrs)
    return grad_q, grad_k, grad_v, None, None, *[None] * len(ctx.attrs)


register_op(ATTENTION_VARLEN_BACKWARD)
register_op(ATTENTION_VARLEN)


@ATTENTION_VARLEN.exported
def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                     causal: bool = False, scale: float | None = None,
                     max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
                     return_lse: bool = False, *, window_left: int | None = None,
                     window_right: int | None = None, sinks: torch.Tensor | None = None,
                     softcap: float | None = None
                     ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention over packed variable-length sequences (FlashAttention's varlen call,
    CANN's ``TND`` layout): each sequence attends to its own keys only.

    Args:
        q: ``(T, H, D)``; k: ``(Tk, Hkv, D)``; v: ``(Tk, Hkv, Dv)``: the tokens of the
            sequences one after another, one float dtype, ``H`` a multiple of ``Hkv``,
            ``D, Dv <= 256``.
        cu_seqlens_q, cu_seqlens_k: ``(B + 1,)`` cumulative lengths (int32 or int64),
            from 0 to ``T`` / ``Tk``: sequence ``b`` is rows
            ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of q and ``cu_seqlens_k[b]:
            cu_seqlens_k[b + 1]`` of k and v.
        causal: per sequence, query ``i`` sees keys ``j <= i + Sk - Sq`` (bottom-right).
        scale: score scale, ``1 / sqrt(D)`` when None.
        window_left, window_right: per sequence, a band around each query's diagonal key
            (see `opforge.attention`): a sliding window of ``W`` keys is ``causal=True,
            window_left=W - 1``. The kernels skip the key blocks outside it.
        max_seqlen_q, max_seqlen_k: the longest query and key sequence; they size the
            grid and the tiles (a wrong value costs speed, not correctness). None: read
            from the lengths on the host (one more read of each; inside torch.compile,
            the token counts).
        return_lse: also return the float32 (float64 for float64 inputs) log-sum-exp of
            each query's scaled scores, ``(H, T)`` (``-inf`` for a query that sees no key).
        sinks: ``(H,)`` attention sinks, one logit per query head (see `opforge.attention`).
        softcap: scores become ``softcap * tanh(scores / softcap)`` (see
            `opforge.attention`).

    Returns:
        ``out`` ``(T, H, Dv)`` in q's dtype, or ``(out, lse)``. Differentiable in q, k, v.

    Raises:
        ShapeError: not ``(T, H, D)``, mismatched heads or dims, lengths of different
            counts. DtypeError: q, k, v of different or unsupported dtypes, lengths not
            int32 or int64. IndexRangeError: lengths that do not run from 0 to the token
            count without decreasing (read on the host unless `opforge.device_side_checks`,
            see `check_lengths`). ShapeError, DtypeError: ``sinks`` not a float ``(H,)``
            on q's device.
    """
    if sinks is not None and isinstance(q, torch.Tensor) and q.dim() == 3:
        dense.check_sinks(sinks, q.shape[1], q, "attention_varlen")  # else the op raises
    if (max_seqlen_q is None or max_seqlen_k is None) and not torch.compiler.is_compiling():
        longest = [_longest(cu) for cu in (cu_seqlens_q, cu_seqlens_k)]
        max_seqlen_q = longest[0] if max_seqlen_q is None else max_seqlen_q
        max_seqlen_k = longest[1] if max_seqlen_k is None else max_seqlen_k
    out, lse = ATTENTION_VARLEN(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale,
                                max_seqlen_q, max_seqlen_k, window_left, window_right,
                                softcap)
    if sinks is not None:
        out, lse = dense.with_sinks(out, lse, sinks, head_major=False)
    return (out, lse) if return_lse else out


def _longest(cu: object) -> int | None:
    """The longest sequence of cumulative lengths (None for what is not a 1-D tensor:
    the operator reports it)."""
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 2 \
            or cu.is_floating_point():
        return None
    return max(0, int((cu[1:] - cu[:-1]).max()))
