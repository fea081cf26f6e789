"""Attention: golden checks of forward and backward, the bottom-right causal rule, GQA,
log-sum-exp, block decomposition (what ring attention relies on), determinism, autograd,
torch.compile, errors and the sequence-length precision study."""

from __future__ import annotations

import math

import pytest
import torch

import opforge
from opforge.core.opdef import Case, Tiling
from opforge.ops.attention import _visible_pairs, visible_keys
from opforge.precision.attention_study import attention_error_growth, growth
from opforge.profiler.session import kernel_costs

from .conftest import (
    DEVICE,
    LOW_PRECISION,
    assert_golden,
    force_attention_tiles,
    needs_descriptors,
    needs_triton,
)

ATTENTION = opforge.get_op("attention")
ATTENTION_BACKWARD = opforge.get_op("attention_backward")


def _qkv(b: int, h: int, hkv: int, sq: int, sk: int, d: int, dv: int | None = None,
         dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shapes = ((b, h, sq, d), (b, hkv, sk, d), (b, hkv, sk, dv or d))
    return [torch.randn(s, generator=generator).to(DEVICE, dtype) for s in shapes]


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("op", [ATTENTION, ATTENTION_BACKWARD, opforge.get_op("attention_varlen"),
                                opforge.get_op("attention_varlen_backward")],
                         ids=lambda o: o.name)
def test_samples_match_the_golden(op, dtype, backend):
    generator = torch.Generator().manual_seed(1)
    for case in op.samples(dtype, DEVICE, generator):
        outputs = opforge.plan(op, *case.inputs, **case.attrs).run(*case.inputs)
        assert_golden(op, case, outputs)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq, sk", [(1, 1), (1, 63), (63, 63), (63, 1000), (1000, 1000)])
def test_odd_lengths_with_gqa_forward_and_backward(sq, sk, causal, backend):
    """Lengths 1, 63 and 1000, 4 query heads over 2 key/value heads, bf16, against the
    float64 golden (forward, then the backward from the forward's own out and lse)."""
    q, k, v = _qkv(1, 4, 2, sq, sk, 16, dtype=torch.bfloat16, seed=sq + sk)
    attrs = {"causal": causal}
    out, lse = opforge.attention(q, k, v, causal=causal, return_lse=True)
    assert_golden(ATTENTION, Case("odd", (q, k, v, None), attrs), (out, lse))
    dout = torch.randn_like(q)
    grads = opforge.attention_backward(dout, q, k, v, out, lse, causal=causal)
    assert_golden(ATTENTION_BACKWARD, Case("odd", (dout, q, k, v, out, lse, None, None), attrs),
                  grads)


@pytest.mark.parametrize("pack", [1, 2])
@pytest.mark.parametrize("query_side, key_side", [((32, 16), (16, 32)),
                                                  ((16, 32), (32, 16))])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq, sk", [(70, 150), (150, 70)])
def test_small_tiles_of_either_shape_match_the_golden(sq, sk, causal, query_side, key_side,
                                                      pack, monkeypatch):
    """The GPU tilings hold many blocks of either shape, and the dQ and dK/dV kernels
    hold different blocks: forced here on the Triton kernels, so that several held and
    streamed blocks, the unmasked range before the causal diagonal and the masked blocks
    across it all run, forward and backward, with GQA. ``pack`` 2 holds the two query
    heads of a key/value head in one forward block (query-major rows: a block's queries
    are half its rows, and its causal ranges follow them)."""
    from opforge.ops import attention

    def tiles(sq, sk, d, dv, item, hardware, backward, group=1):
        blocks = {"BLOCK_M": query_side[0], "BLOCK_N": query_side[1], "BLOCK_D": 16,
                  "BLOCK_DV": 16, "BLOCK_K": key_side[0], "BLOCK_Q": key_side[1]}
        options = {"pack_gqa": True} if pack > 1 and not backward else {}
        return [Tiling("flash", blocks, 0, double_buffered=False, options=options)]

    monkeypatch.setattr(attention, "_tiles", tiles)
    _assert_both_passes_match_the_golden(_qkv(1, 4, 2, sq, sk, 16, seed=sq + query_side[0]),
                                         causal)


def _assert_both_passes_match_the_golden(qkv: list[torch.Tensor], causal: bool) -> None:
    """Forward, then the backward from its own out and lse, on the Triton kernels (with
    fresh plans), both against the float64 golden."""
    q, k, v = qkv
    attrs = {"causal": causal}
    opforge.clear_caches()
    with opforge.use_backend("triton"):
        out, lse = opforge.attention(q, k, v, causal=causal, return_lse=True)
        dout = torch.randn_like(q)
        grads = opforge.attention_backward(dout, q, k, v, out, lse, causal=causal)
    opforge.clear_caches()
    assert_golden(ATTENTION, Case("forced", (q, k, v, None), attrs), (out, lse))
    assert_golden(ATTENTION_BACKWARD, Case("forced", (dout, q, k, v, out, lse, None, None), attrs),
                  grads)


@pytest.mark.parametrize("pack", [1, 2])
@pytest.mark.parametrize("splits", [3, 40])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq, sk", [(1, 150), (70, 150), (150, 70)])
def test_key_splits_merge_to_the_golden(sq, sk, splits, causal, pack, monkeypatch):
    """The decoding tiling (keys cut into slices, merged by log-sum-exp) forced on the
    Triton kernels: one query and a few over a long cache, slices a query sees partly or
    not at all (causal), queries that see no key (Sq > Sk, causal: out 0, lse -inf), more
    slices asked for than key blocks; the poisoned workspace must be written wherever the
    merge reads. ``pack`` 2: with the GQA packing of decoding (slices of head groups)."""
    force_attention_tiles(monkeypatch, pack, splits)
    opforge.clear_caches()
    opforge.set_poison(True)
    q, k, v = _qkv(2, 4, 2, sq, sk, 16, dv=8, seed=sq + splits)
    try:
        with opforge.use_backend("triton"):
            plan = opforge.plan("attention", q, k, v, causal=causal)
            out, lse = plan.run(q, k, v)
    finally:
        opforge.set_poison(False)
        opforge.clear_caches()
    assert plan.tiling.options["splits"] == splits and plan.workspace_bytes > 0
    costs = kernel_costs(plan)  # what the profiler gives each of the two kernels
    assert costs["_attention_forward_kernel"][0] == plan.cost.flops
    assert costs["_attention_merge_kernel"][1] > 0
    assert_golden(ATTENTION, Case("splits", (q, k, v, None), {"causal": causal}), (out, lse))
    if causal and sq > sk:
        assert (lse[:, :, :sq - sk] == -math.inf).all() and (out[:, :, :sq - sk] == 0).all()


def test_decoding_on_a_gpu_profile_packs_heads_and_splits_the_keys():
    """One query of 32 heads over 8 key/value heads: the tiling packs each group of 4 query
    heads into one block (each key block read once per group), and on an H200's 132
    cores the 8 groups would leave most idle, so it cuts the keys into slices (two
    programs a core, each slice at least 4 key blocks) and sizes the workspace for the
    slices' float32 partials. A full prefill neither packs nor splits; a batch that fills
    the cores and the CPU keep one slice."""
    def plan(b, sq, sk, hardware, heads=32):
        q = torch.empty(b, heads, sq, 128, dtype=torch.bfloat16, device=DEVICE)
        k = torch.empty(b, 8, sk, 128, dtype=torch.bfloat16, device=DEVICE)
        with opforge.use_hardware(hardware), opforge.use_backend("triton"):
            return opforge.plan("attention", q, k, k)

    for b in (1, 8):
        decode = plan(b, 1, 32768, "h200")
        splits = decode.tiling.options["splits"]
        assert decode.tiling.options["pack_gqa"] and decode.grid[1] == b * 8
        assert splits == math.ceil(2 * 132 / (b * 8))
        assert decode.workspace_bytes == 4 * splits * b * 32 * (128 + 1)
    # Tilings are chosen for power-of-two buckets of the shapes (24 heads -> 32, a group
    # of 4): the grid packs the real group of 3.
    assert plan(1, 1, 32768, "h200", heads=24).grid[1] == 8
    assert plan(1, 1, 128, "h200").tiling.options["splits"] == 1  # too few key blocks
    prefill = plan(1, 4096, 4096, "h200")
    assert "pack_gqa" not in prefill.tiling.options and prefill.grid[1] == 32
    for b, sq, sk, hardware in ((32, 1, 32768, "h200"), (1, 4096, 4096, "h200"),
                                (1, 1, 32768, "cpu")):
        chosen = plan(b, sq, sk, hardware)
        assert chosen.tiling.options["splits"] == 1 and chosen.workspace_bytes == 0


class _RecordedKernel:
    """Stands in for a Triton kernel: records each launch's keyword arguments."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.launches.append(kwargs)
            return self.kernel[grid](*args, **kwargs)
        return run


@needs_triton
@needs_descriptors
@pytest.mark.parametrize("variant", ["flash_tma", "flash_tma_ws"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype, d, by_descriptor", [
    (torch.float32, 16, True), (torch.bfloat16, 24, True),
    (torch.bfloat16, 12, False)])  # 24-byte rows: not TMA-aligned, the pointer kernel
def test_descriptor_variants_match_the_golden(variant, causal, dtype, d, by_descriptor,
                                              monkeypatch):
    """The variants that read their streamed blocks by tensor descriptor (the forward's
    keys and values, with and without a warp-specialized key loop; the backward's keys and
    values for dQ, queries and output gradients for dK/dV), on odd lengths with GQA: the
    descriptor's bounds replace the masks, so blocks past the sequence and head columns
    past D must read 0. Inputs whose rows descriptors cannot address fall back to the
    pointer kernels."""
    from opforge.ops import attention

    def tiles(sq, sk, d, dv, item, hardware, backward, group=1):
        block_d = max(16, 1 << (d - 1).bit_length())
        return [Tiling(variant, {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_D": block_d,
                                 "BLOCK_DV": block_d, "BLOCK_K": 16, "BLOCK_Q": 32}, 0,
                       double_buffered=False)]

    kernels = {name: _RecordedKernel(getattr(attention, name)) for name in (
        "_attention_forward_kernel", "_attention_query_side_kernel",
        "_attention_key_side_kernel")}
    monkeypatch.setattr(attention, "_tiles", tiles)
    for name, recorded in kernels.items():
        monkeypatch.setattr(attention, name, recorded)
    _assert_both_passes_match_the_golden(_qkv(2, 4, 2, 45, 70, d, dtype=dtype, seed=d),
                                         causal)
    for recorded in kernels.values():
        assert [launch["DESCRIPTORS"] for launch in recorded.launches] == [by_descriptor]
    forward = kernels["_attention_forward_kernel"].launches[0]
    assert forward["WARP_SPECIALIZE"] == (by_descriptor and variant.endswith("ws"))


def test_causal_is_aligned_bottom_right(backend):
    """Query i sees keys j <= i + Sk - Sq: the last query sees every key, and with
    Sq == Sk the mask is SDPA's is_causal."""
    q, k, v = _qkv(1, 2, 2, 5, 12, 16)
    causal = opforge.attention(q, k, v, causal=True)
    full = opforge.attention(q, k, v)
    torch.testing.assert_close(causal[:, :, -1], full[:, :, -1], rtol=1e-5, atol=1e-6)
    first = opforge.attention(q[:, :, :1], k[:, :, :8], v[:, :, :8])
    torch.testing.assert_close(causal[:, :, :1], first, rtol=1e-5, atol=1e-6)
    square = _qkv(1, 2, 2, 9, 9, 16, seed=3)
    expected = torch.nn.functional.scaled_dot_product_attention(*square, is_causal=True)
    torch.testing.assert_close(opforge.attention(*square, causal=True), expected,
                               rtol=1e-5, atol=1e-6)


def test_queries_that_see_no_key_get_zero_and_minus_inf_lse(backend):
    q, k, v = _qkv(1, 1, 1, 10, 4, 16)
    out, lse = opforge.attention(q, k, v, causal=True, return_lse=True)
    # Sk - Sq = -6: queries 0..5 see nothing, query i >= 6 sees i - 5 keys.
    assert torch.equal(out[:, :, :6], torch.zeros_like(out[:, :, :6]))
    assert torch.isneginf(lse[:, :, :6]).all() and torch.isfinite(lse[:, :, 6:]).all()
    causal = visible_keys(10, 4, (None, 0))
    assert not causal[:6].any() and causal[6:].any(-1).all()


@pytest.mark.parametrize("sq, sk", [(10, 4), (4, 10), (7, 7), (0, 5), (5, 0), (33, 17)])
@pytest.mark.parametrize("limits", [(None, 0), (0, None), (3, 0), (2, 5), (-2, 4), (4, -6),
                                    (-3, 1), (50, -50), (0, 0)])
def test_the_cost_counts_the_pairs_the_mask_shows(sq, sk, limits):
    # The plan's cost counts pairs in host arithmetic (a plan may be made on fake tensors).
    assert _visible_pairs(sq, sk, limits) == int(visible_keys(sq, sk, limits).sum())


def test_grouped_query_attention_equals_repeated_heads(backend):
    """Query head h reads key/value head h // 3. The grouped call packs the 3 heads of a
    group into one block of the Triton kernel (the repeated one cannot): the same
    arithmetic per row, but the interpreter's matrix products may sum a longer block in
    another order, so the two agree to float32 rounding, not bit for bit."""
    q, k, v = _qkv(2, 6, 2, 11, 13, 32)
    grouped = opforge.attention(q, k, v, causal=True)
    repeated = opforge.attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1),
                                 causal=True)
    bound = 4 * torch.finfo(q.dtype).eps * repeated.abs().max()
    assert (grouped - repeated).abs().max() <= bound
    wrong_group = opforge.attention(q, k.repeat(1, 3, 1, 1), v.repeat(1, 3, 1, 1),
                                    causal=True)
    assert (grouped - wrong_group).abs().max() > 100 * bound  # the test can tell heads apart


def test_lse_is_the_log_sum_exp_of_scaled_scores(backend):
    q, k, v = _qkv(1, 2, 1, 7, 19, 24)
    _, lse = opforge.attention(q, k, v, scale=0.3, return_lse=True)
    scores = torch.matmul(q.double(), k.double().repeat_interleave(2, 1).transpose(-1, -2))
    expected = torch.logsumexp(scores * 0.3, -1)
    assert lse.dtype == torch.float32
    assert (lse.double() - expected).abs().max() < 1e-5 * expected.abs().max()


@pytest.mark.parametrize("scale", [0.3, -0.7, 0.0])
@pytest.mark.parametrize("causal", [False, True])
def test_any_scale_sign_matches_the_golden(scale, causal, backend):
    """The forward folds a positive scale into one FMA per score after taking the block's
    max of the raw products; a negative scale (the max of the scaled scores is then the
    min of the raw ones) and a zero scale (uniform weights; a masked score must stay
    -inf, not 0 · -inf) take the plain path. Out and lse against float64, causal rows
    that see no key included (Sq > Sk): their lse is -inf, as the golden's."""
    q, k, v = _qkv(1, 2, 1, 23, 17, 24)
    out, lse = opforge.attention(q, k, v, causal=causal, scale=scale, return_lse=True)
    assert_golden(ATTENTION, Case("scale", (q, k, v, None), {"causal": causal, "scale": scale}),
                  (out, lse))


def _merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    """Outputs of attention over disjoint key blocks merged by their log-sum-exps."""
    lse = torch.stack([block_lse for _, block_lse in parts]).logsumexp(0)
    out = sum(block_out * torch.exp(block_lse - lse)[..., None] for block_out, block_lse in parts)
    return out, lse


@pytest.mark.parametrize("causal", [False, True])
def test_key_blocks_merge_by_log_sum_exp_and_backward_splits_by_block(causal, backend):
    """What ring attention relies on. Queries and keys in two chunks of 20: chunk i of the
    queries sees key chunk j < i entirely (non-causal block) and chunk i causally (a square
    diagonal block), or every chunk when not causal. The blocks' outputs merged by their
    lse equal the full attention, and with the full out and lse each block's backward gives
    a share of dq and of its keys' dk, dv that sum to the full gradients."""
    q, k, v = _qkv(1, 2, 2, 40, 40, 16, seed=5)
    dout = torch.randn_like(q)
    out, lse = opforge.attention(q, k, v, causal=causal, return_lse=True)
    full = opforge.attention_backward(dout, q, k, v, out, lse, causal=causal)
    chunk = [slice(0, 20), slice(20, 40)]
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    for i, rows in enumerate(chunk):
        parts = []
        for j, cols in enumerate(chunk):
            if causal and j > i:
                continue
            diagonal = causal and i == j
            block = (q[:, :, rows], k[:, :, cols], v[:, :, cols])
            parts.append(opforge.attention(*block, causal=diagonal, return_lse=True))
            dq, dk, dv = opforge.attention_backward(dout[:, :, rows], *block, out[:, :, rows],
                                                    lse[:, :, rows], causal=diagonal)
            grads[0][:, :, rows] += dq
            grads[1][:, :, cols] += dk
            grads[2][:, :, cols] += dv
        merged_out, merged_lse = _merge(parts)
        torch.testing.assert_close(merged_out, out[:, :, rows], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(merged_lse, lse[:, :, rows], rtol=1e-5, atol=1e-6)
    for ours, expected in zip(grads, full):
        torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_autograd_matches_float64_including_the_lse_path(causal, backend):
    q, k, v = _qkv(1, 4, 2, 13, 21, 16, dv=8, seed=7)
    weights = torch.randn(1, 4, 13, dtype=torch.float64, device=DEVICE)

    def loss(q, k, v):
        out, lse = opforge.attention(q, k, v, causal=causal, return_lse=True)
        return out.double().square().sum() + (lse.double() * weights).sum()

    def loss64(q, k, v):
        out, lse = ATTENTION.reference_fn(q, k, v, None, compute_dtype=torch.float64,
                                          causal=causal, scale=None)
        return out.square().sum() + (lse * weights).sum()

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    wide = [t.double().requires_grad_() for t in (q, k, v)]
    ours = torch.autograd.grad(loss(*leaves), leaves)
    expected = torch.autograd.grad(loss64(*wide), wide)
    for mine, golden in zip(ours, expected):
        assert (mine.double() - golden).abs().max() <= 1e-5 * golden.abs().max()


@pytest.mark.parametrize("causal", [False, True])
def test_torch_backend_in_query_chunks_equals_the_whole(causal, monkeypatch):
    """The torch backend bounds its score matrices by chunks of query rows: one row at a
    time gives the whole matrix's out, lse, gradients and error magnitudes (Sq > Sk causal:
    the chunks' masks keep their rows' offsets; GQA: dK and dV summed over chunks; a
    per-query mask sliced with its rows)."""
    from opforge.ops import attention

    q, k, v = _qkv(2, 4, 2, 13, 9, 16, dv=8, seed=11)
    generator = torch.Generator().manual_seed(12)
    dout = torch.randn(2, 4, 13, 8, generator=generator).to(DEVICE)
    mask = (torch.rand(2, 1, 13, 9, generator=generator) > 0.3).to(DEVICE)

    def everything() -> list[torch.Tensor]:
        with opforge.use_backend("torch"):
            out, lse = opforge.attention(q, k, v, causal=causal, return_lse=True,
                                         attn_mask=mask)
            grads = opforge.attention_backward(dout, q, k, v, out, lse, causal=causal,
                                               attn_mask=mask)
        magnitudes = attention._backward_terms(dout, q, k, v, out, lse, None, mask,
                                               compute_dtype=torch.float64, causal=causal,
                                               scale=None, magnitudes=True)
        return [out, lse, *grads, *magnitudes]

    whole = everything()
    monkeypatch.setattr(attention, "REFERENCE_CHUNK_ELEMENTS", 1)
    assert len(attention._query_chunks(q, 9)) == 13
    for chunked, reference in zip(everything(), whole, strict=True):
        torch.testing.assert_close(chunked, reference, rtol=1e-6, atol=1e-6, equal_nan=True)


def test_backward_is_deterministic_across_runs():
    q, k, v = _qkv(1, 4, 1, 70, 90, 32, dtype=torch.bfloat16, seed=9)
    dout = torch.randn_like(q)
    with opforge.use_backend("triton"):
        out, lse = opforge.attention(q, k, v, causal=True, return_lse=True)
        first = opforge.attention_backward(dout, q, k, v, out, lse, causal=True)
        second = opforge.attention_backward(dout, q, k, v, out, lse, causal=True)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_works_under_torch_compile():
    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 1, 9, 12, 16, seed=11))

    def step(q, k, v):
        out, lse = opforge.attention(q, k, v, causal=True, return_lse=True)
        return out.sum() + lse.sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    expected = torch.autograd.grad(step(q, k, v), (q, k, v))
    actual = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e)


def test_opcheck():
    q, k, v = _qkv(1, 2, 1, 5, 7, 16, seed=13)
    torch.library.opcheck(torch.ops.opforge.attention, (q, k, v, None, True, None))


@pytest.mark.parametrize("shapes, error, param", [
    (((2, 5, 16), (1, 2, 5, 16), (1, 2, 5, 16)), opforge.ShapeError, "q"),
    (((1, 3, 5, 16), (1, 2, 5, 16), (1, 2, 5, 16)), opforge.ShapeError, "k"),
    (((1, 2, 5, 16), (2, 2, 5, 16), (2, 2, 5, 16)), opforge.ShapeError, "k"),
    (((1, 2, 5, 16), (1, 2, 5, 8), (1, 2, 5, 16)), opforge.ShapeError, "k"),
    (((1, 2, 5, 16), (1, 2, 5, 16), (1, 2, 6, 16)), opforge.ShapeError, "v"),
    (((1, 2, 5, 300), (1, 2, 5, 300), (1, 2, 5, 16)), opforge.ShapeError, "q"),
    (((1, 2, 5, 16), (1, 2, 5, 16), (1, 2, 5, 257)), opforge.ShapeError, "v"),
    (((1, 0, 5, 16), (1, 2, 5, 16), (1, 2, 5, 16)), opforge.ShapeError, "q"),
])
def test_bad_shapes_raise_before_any_kernel(shapes, error, param):
    tensors = [torch.randn(s, device=DEVICE) for s in shapes]
    with pytest.raises(error) as raised:
        opforge.attention(*tensors)
    assert raised.value.param == param


def test_bad_dtypes_raise():
    q, k, v = _qkv(1, 2, 2, 5, 5, 16)
    with pytest.raises(opforge.DtypeError) as raised:
        opforge.attention(q, k.half(), v)
    assert raised.value.param == "k"
    out, lse = opforge.attention(q, k, v, return_lse=True)
    with pytest.raises(opforge.DtypeError):
        opforge.attention_backward(torch.ones_like(out), q, k, v, out, lse.double())
    with pytest.raises(opforge.ShapeError) as raised:
        opforge.attention_backward(torch.ones_like(out), q, k, v, out, lse[:, :, :3])
    assert raised.value.param == "lse"


@needs_triton  # the study runs opforge's kernels
def test_error_does_not_grow_faster_than_sdpa():
    """The precision study on small sizes: opforge's error against float64 grows with S no
    faster than torch SDPA's and stays within 1.25x of it at every length; the naive
    formula is worse than opforge on peaked softmaxes."""
    for causal, query_scale in ((False, 1.0), (True, 4.0)):
        rows = attention_error_growth([64, 256, 512], heads=1, head_dim=32, causal=causal,
                                      query_scale=query_scale, device=DEVICE)
        for dtype in ("float16", "bfloat16"):
            assert growth(rows, "opforge", dtype) <= 1.1 * growth(rows, "torch SDPA", dtype)
            for seq_len in (64, 256, 512):
                mine, sdpa, naive = (next(r.rel_rms for r in rows if (r.dtype, r.seq_len,
                                                                       r.impl)
                                          == (dtype, seq_len, impl))
                                     for impl in ("opforge", "torch SDPA", "naive"))
                assert mine <= 1.25 * sdpa
                if query_scale > 1:
                    assert mine < naive


def test_a_nan_value_reaches_exactly_its_output_column(backend):
    q, k, v = _qkv(1, 1, 1, 4, 6, 16)
    v[0, 0, 2, 3] = math.nan
    out = opforge.attention(q, k, v)
    assert torch.isnan(out[..., 3]).all() and not torch.isnan(out[..., [0, 1, 2, 4]]).any()


def test_an_infinite_score_makes_its_row_nan_on_both_backends(backend):
    """A +inf score has no softmax (inf / inf): out and lse of that row are NaN, as a NaN
    input makes them, and the other rows are untouched; with zero and signed key entries
    the +inf query element gives scores of +inf, -inf and NaN."""
    q, k, v = _qkv(1, 1, 1, 3, 5, 16)
    q[0, 0, 1, 0] = math.inf
    k[0, 0, 2, 0] = 0.0
    k[0, 0, 3, 0] = abs(k[0, 0, 3, 0]) + 1
    for keys in (k, torch.cat([k[:, :, 3:4], -k[:, :, 3:4].abs()], 2)):
        out, lse = opforge.attention(q, keys, v[:, :, :keys.shape[2]], return_lse=True)
        assert torch.isnan(out[0, 0, 1]).all() and torch.isnan(lse[0, 0, 1])
        assert torch.isfinite(out[0, 0, [0, 2]]).all() and torch.isfinite(lse[0, 0, [0, 2]]).all()


def test_a_nan_key_spreads_over_exactly_the_rows_that_see_it(backend):
    """A NaN in a key makes the scores, out, lse and every gradient of the rows that see
    that key NaN (as SDPA's out), on both backends; rows that see no key keep out 0 and lse
    -inf, and rows that see only other keys stay finite (causal, Sk - Sq = -2: query i
    sees keys up to i - 2), but for dq's NaN column (0 times the NaN of the key in
    ``dq = dS K``, as IEEE products have it)."""
    q, k, v = _qkv(1, 1, 1, 8, 6, 16)
    k[0, 0, 5, 1] = math.nan
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = opforge.attention(*leaves, causal=True, return_lse=True)
    assert torch.equal(out[0, 0, :2], torch.zeros_like(out[0, 0, :2]))
    assert torch.isneginf(lse[0, 0, :2]).all()
    assert torch.isfinite(out[0, 0, 2:7]).all() and torch.isfinite(lse[0, 0, 2:7]).all()
    assert torch.isnan(out[0, 0, 7]).all() and torch.isnan(lse[0, 0, 7])
    dq, dk, dv = torch.autograd.grad(out[0, 0, 7].sum(), leaves)
    other_columns = [c for c in range(16) if c != 1]
    assert torch.isnan(dq[0, 0, 7]).all() and torch.isfinite(dq[0, 0, :7, other_columns]).all()
    assert torch.isnan(dk[0, 0, 5]).all() and torch.isnan(dv[0, 0, 5]).all()
    everywhere = opforge.attention(q, k, v, return_lse=True)
    assert all(torch.isnan(t).all() for t in everywhere)


@needs_descriptors
@pytest.mark.parametrize("wide", [False, True], ids=["int32", "int64_offsets"])
def test_descriptor_tilings_fall_back_to_pointers_for_int64_offsets(monkeypatch, launches,
                                                                    fresh_plans, wide):
    """A flash_tma tiling reads by tensor descriptor (the interpreter has them), except
    when offsets need int64 (tensors past 2^31 elements): descriptor coordinates are
    int32, so forward and backward then take the pointer kernel. Results are right
    either way."""
    import dataclasses

    from opforge.ops import attention as module

    for opdef in (ATTENTION, ATTENTION_BACKWARD):
        rule = opdef.tiling
        monkeypatch.setattr(opdef, "tiling", lambda *args, rule=rule: [
            dataclasses.replace(t, variant="flash_tma") for t in rule(*args)])
    if wide:
        monkeypatch.setattr(module, "wide_offsets", lambda *tensors: True)
    generator = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(1, 2, 24, 64, generator=generator).to(DEVICE, torch.bfloat16)
               for _ in range(3))
    with opforge.use_backend("triton"):
        out, lse = opforge.attention(q, k, v, causal=True, return_lse=True)
        opforge.attention_backward(torch.ones_like(out), q, k, v, out, lse, causal=True)
    kernels = [(name, options) for name, options in launches if "DESCRIPTORS" in options]
    assert {name for name, _ in kernels} >= {"_attention_forward_kernel",
                                             "_attention_query_side_kernel",
                                             "_attention_key_side_kernel"}
    usable = module.descriptors_usable(q, k, v)  # Hopper or the interpreter
    assert usable or DEVICE.type == "cuda"
    assert all(options["DESCRIPTORS"] is (usable and not wide) and options["WIDE"] is wide
               for _, options in kernels)
    assert_golden(ATTENTION, Case("descriptors", (q, k, v, None), {"causal": True}), (out, lse))
