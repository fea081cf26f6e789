"""MlaProlog: the float64 golden, the CANN rounding formula, in-place cache updates in both
layouts, token layouts, errors, the torch op's mutation schema, torch_npu compatibility
and properties over MLA sizes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import opforge
from opforge.compat.torch_npu import npu_mla_prolog
from opforge.core.hardware import get_profile
from opforge.core.opdef import Case
from opforge.ops.mla_prolog import cache_rows, mla_inputs, nz_view
from opforge.profiler.session import kernel_costs

from .conftest import DEVICE, LOW_PRECISION, assert_golden

MLA = opforge.get_op("mla_prolog")


def _inputs(tokens: int | tuple[int, ...] = 6, dtype: torch.dtype = torch.bfloat16,
            seed: int = 0, **sizes: int) -> list[torch.Tensor]:
    return list(mla_inputs(tokens, dtype, DEVICE, torch.Generator().manual_seed(seed),
                           **sizes))


def _run(inputs: list[torch.Tensor], **attrs: object) -> tuple[torch.Tensor, ...]:
    return opforge.mla_prolog(*inputs, **attrs)


@pytest.fixture(params=["fused", "steps"])
def query_path(request, monkeypatch):
    """Both forms of the query path after the down-projection, whatever the token count:
    `_mla_query_kernel` (variant fused_kv_query) or the rms_norm, matmul and rope steps."""
    from opforge.ops import mla_prolog

    monkeypatch.setattr(mla_prolog, "FUSED_QUERY_TOKENS",
                        10**9 if request.param == "fused" else 0)
    opforge.clear_caches()
    yield request.param
    opforge.clear_caches()


def _variant(inputs: list[torch.Tensor], **attrs: object) -> str:
    with opforge.use_backend("triton"):
        return opforge.plan(MLA, *inputs, **attrs).tiling.variant


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_samples_match_the_golden(dtype, backend):
    for case in MLA.samples(dtype, DEVICE, torch.Generator().manual_seed(2)):
        inputs = [t.clone() for t in case.inputs]
        assert_golden(MLA, case, opforge.mla_prolog(*inputs, **case.attrs))


def test_steps_are_planned_once_per_plan():
    """A decode step is bound by host time: the query path's matmul/rms_norm/rope steps are
    planned on the plan's first run and kept with it, so a second run of the same plan
    makes no plan-cache lookup, and gives the same results."""
    inputs = _inputs(5)
    with opforge.use_backend("triton"):
        held = opforge.plan(MLA, *inputs)
        first = [t.clone() for t in held.run(*[t.clone() for t in inputs])]
        before = opforge.cache_stats()
        second = held.run(*[t.clone() for t in inputs])
        after = opforge.cache_stats()
    assert (after.plan_hits, after.plan_misses) == (before.plan_hits, before.plan_misses)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_triton_matches_the_cann_rounding_formula(query_path):
    """bf16: both query paths of the Triton backend round where CANN's golden rounds
    (the normalised cq, qq, query, query_rope); against that formula at float32 (the
    torch backend) every output is within one bf16 ulp and nearly all elements are
    equal."""
    inputs = _inputs(9, seed=3, he=128, hcq=64, hckv=64, n=4, d=32, dr=16)
    assert _variant(inputs) == {"fused": "fused_kv_query", "steps": "fused_kv"}[query_path]
    with opforge.use_backend("torch"):
        expected = _run([t.clone() for t in inputs])
    with opforge.use_backend("triton"):
        actual = _run([t.clone() for t in inputs])
    for ours, cann in zip(actual, expected):
        ulp = torch.finfo(torch.bfloat16).eps * cann.float().abs().clamp_min(1e-3)
        assert ((ours.float() - cann.float()).abs() <= ulp).all()
        assert (ours == cann).float().mean() > 0.97


@pytest.mark.parametrize("mode", ["PA_BSND", "PA_NZ"])
def test_caches_are_updated_in_place_row_by_row(mode, backend):
    inputs = _inputs(7, seed=4)
    kv_before, kr_before = inputs[10].clone(), inputs[11].clone()
    _, _, kv_out, kr_out = _run(inputs, cache_mode=mode)
    assert kv_out is inputs[10] and kr_out is inputs[11]
    slots = inputs[9]
    written = slots[slots >= 0]
    untouched = torch.ones(kv_before.shape[0] * kv_before.shape[1], dtype=torch.bool,
                           device=DEVICE)
    untouched[written] = False
    for before, after in ((kv_before, kv_out), (kr_before, kr_out)):
        rows_before, rows_after = cache_rows(before, mode), cache_rows(after, mode)
        assert torch.equal(rows_before[untouched], rows_after[untouched])
        assert not torch.equal(rows_before[written], rows_after[written])


def test_nz_layout_holds_the_same_rows_as_bsnd(backend):
    inputs = _inputs(6, seed=5)
    plain = _run([t.clone() for t in inputs])
    nz_inputs = [t.clone() for t in inputs]
    for i in (10, 11):  # the same starting rows, stored in the NZ layout
        nz_view(nz_inputs[i]).copy_(inputs[i].view(inputs[i].shape[0], inputs[i].shape[1],
                                                   -1, 16).permute(0, 2, 1, 3))
    nz = _run(nz_inputs, cache_mode="PA_NZ")
    assert torch.equal(plain[0], nz[0]) and torch.equal(plain[1], nz[1])
    for i in (2, 3):
        assert torch.equal(cache_rows(plain[i]), cache_rows(nz[i], "PA_NZ"))


def test_batch_and_token_layouts_agree(backend):
    flat = _inputs(6, seed=6)
    batched = [t.clone() for t in flat]
    for i in (0, 7, 8):
        batched[i] = batched[i].reshape(2, 3, -1)
    batched[9] = batched[9].reshape(2, 3)
    a = _run(flat)
    b = _run(batched)
    assert b[0].shape == (2, 3, 4, 32) and b[1].shape == (2, 3, 4, 16)
    assert torch.equal(a[0], b[0].reshape(a[0].shape)) and torch.equal(a[2], b[2])


def test_empty_batch_leaves_caches_untouched(backend, launches):
    inputs = _inputs(0)
    before = inputs[10].clone()
    query, query_rope, kv, _ = _run(inputs)
    assert query.shape == (0, 4, 32) and query_rope.shape == (0, 4, 16)
    assert torch.equal(kv, before)
    assert not launches  # no kernel, not even one of zero programs


def test_an_empty_hidden_dim_projects_to_zero(backend):
    """He = 0: the projections are empty sums, so the queries and the written cache rows
    are 0 (against the golden), and the unwritten rows stay."""
    inputs = _inputs(5, seed=4)
    for index in (0, 1, 4):  # token_x, weight_dq, weight_dkv_kr
        inputs[index] = inputs[index][..., :0] if index == 0 else inputs[index][:0]
    outputs = _run([t.clone() for t in inputs])
    assert not outputs[0].any() and not outputs[1].any()
    assert_golden(MLA, Case("empty_hidden", inputs), outputs)


def test_zero_heads_still_write_the_caches(backend):
    """N = 0: the queries are empty, but the KV path does not depend on N: the cache rows
    are written as the golden writes them."""
    inputs = _inputs(5, seed=6, n=0)
    before = [t.clone() for t in inputs[10:]]
    outputs = _run([t.clone() for t in inputs])
    assert outputs[0].shape == (5, 0, 32) and outputs[1].shape == (5, 0, 16)
    assert not any(torch.equal(after, old) for after, old in zip(outputs[2:], before))
    assert_golden(MLA, Case("zero_heads", inputs), outputs)


def test_inference_caches_outside_inference_mode_are_refused_before_any_write(backend):
    """torch forbids updating an inference tensor outside inference mode: a typed error,
    with both caches as they were; inside inference mode the call writes them."""
    inputs = _inputs(5, seed=7)
    with torch.inference_mode():
        caches = [t.clone() for t in inputs[10:]]
    before = [t.clone() for t in caches]
    with pytest.raises(opforge.OpError) as raised:
        _run([*inputs[:10], *caches])
    assert raised.value.param == "kv_cache" and "inference" in str(raised.value)
    assert all(torch.equal(cache, old) for cache, old in zip(caches, before))
    with torch.inference_mode():
        outputs = _run([*inputs[:10], *caches])
    assert outputs[2] is caches[0] and not torch.equal(caches[0], before[0])


@pytest.mark.parametrize("shape", [(2, 4, 1, 24), (2, 4, 32), (2, 4, 2, 32)])
def test_cache_views_of_the_wrong_form_are_shape_errors(shape):
    cache = torch.zeros(shape, dtype=torch.bfloat16)
    with pytest.raises(opforge.ShapeError, match="PA_NZ"):
        nz_view(cache)
    with pytest.raises(opforge.ShapeError, match="PA_NZ"):
        cache_rows(cache, "PA_NZ")
    if shape[-2] != 1 or len(shape) != 4:
        with pytest.raises(opforge.ShapeError, match="PA_BSND"):
            cache_rows(cache)
    else:
        assert cache_rows(cache).shape == (8, 24)


def test_slot_beyond_the_cache_raises_before_any_write(backend):
    inputs = _inputs(5)
    inputs[9][2] = inputs[10].shape[0] * inputs[10].shape[1]
    before = inputs[10].clone()
    with pytest.raises(opforge.IndexRangeError) as raised:
        _run(inputs)
    assert raised.value.param == "cache_index" and torch.equal(inputs[10], before)


def test_slot_check_waits_only_before_the_caches_are_written(query_path):
    """The Triton launcher queues the query path before it waits for the slot read: a slot
    beyond the cache raises before either cache is written, and the query outputs given
    as out= (NaN-poisoned) already hold the call's queries, which do not depend on the
    slots."""
    inputs = _inputs(5, seed=4)
    with opforge.use_backend("triton"):
        plan = opforge.plan("mla_prolog", *inputs)
        expected = plan.run(*[t.clone() for t in inputs])
        inputs[9][1] = inputs[10].shape[0] * inputs[10].shape[1]
        caches = [t.clone() for t in inputs[10:]]
        out = [torch.full_like(expected[i], float("nan")) for i in (0, 1)]
        with pytest.raises(opforge.IndexRangeError):
            plan.run(*inputs, out=out)
    assert all(torch.equal(cache, before) for cache, before in zip(inputs[10:], caches))
    for got, want in zip(out, expected[:2]):
        assert torch.equal(got, want)


def _guarded_call_with_a_slot_beyond(seed: int) -> tuple[list[torch.Tensor], ...]:
    """(inputs whose token 2 names a slot beyond the cache, the same call with that token
    skipped, the guard buffers): the caches are the front of larger buffers filled with
    7, so a write past their end would show in the guard rows behind them."""
    inputs = _inputs(5, seed=seed)
    slots = inputs[10].shape[0] * inputs[10].shape[1]
    inputs[9][2] = slots + 3
    guarded = []
    for i in (10, 11):
        buffer = torch.full((2 * inputs[i].shape[0], *inputs[i].shape[1:]), 7.0,
                            dtype=inputs[i].dtype, device=DEVICE)
        buffer[:inputs[i].shape[0]] = inputs[i]
        guarded.append(buffer)
        inputs[i] = buffer[:inputs[i].shape[0]]
    skipped = [t.clone() for t in inputs]
    skipped[9][2] = -1  # what the skipped token amounts to
    return inputs, skipped, guarded


def _assert_skipped(inputs: list[torch.Tensor], skipped: list[torch.Tensor],
                    guarded: list[torch.Tensor]) -> None:
    for mine, theirs in zip(_run(inputs), _run(skipped)):
        assert torch.equal(mine, theirs)
    for buffer, cache in zip(guarded, inputs[10:]):
        assert (buffer[cache.shape[0]:] == 7.0).all()


def test_under_graph_capture_slots_beyond_the_cache_write_nothing(monkeypatch):
    """While a CUDA graph is captured the slot check cannot read the indices: the kernel
    skips a slot beyond the cache instead."""
    monkeypatch.setattr(opforge.core.backends, "capturing", lambda device: True)
    with opforge.use_backend("triton"):
        _assert_skipped(*_guarded_call_with_a_slot_beyond(8))


def test_device_side_checks_skip_slots_beyond_the_cache_without_a_host_read(
        backend, monkeypatch):
    """Inside device_side_checks the slots are never read on the host (no
    synchronisation): both launchers skip a slot beyond the cache, and outside the block
    it is an IndexRangeError again."""
    inputs, skipped, guarded = _guarded_call_with_a_slot_beyond(9)
    reads = []
    real_max = torch.Tensor.max
    monkeypatch.setattr(torch.Tensor, "max",
                        lambda self, *a, **k: reads.append(1) or real_max(self, *a, **k))
    with opforge.device_side_checks():
        _assert_skipped(inputs, skipped, guarded)
    assert not reads
    with pytest.raises(opforge.IndexRangeError):
        _run(inputs)


def test_fused_query_kernel_over_token_blocks_and_latent_chunks(query_path):
    """The fused query kernel where its loops matter: 80 tokens (two blocks of 64), a
    latent width of 160 (two 128-column chunks of the absorbed product, the second
    partial), nope and rope dims that are not powers of two for the blocks, a
    non-contiguous gamma_cq; NaN-poisoned outputs, against the float64 golden, both
    query paths."""
    inputs = _inputs(80, seed=5, he=72, hcq=40, hckv=160, n=3, d=24, dr=16, blocks=8)
    inputs[5] = torch.stack([inputs[5], torch.zeros_like(inputs[5])], 1)[:, 0]
    assert not inputs[5].is_contiguous()
    with opforge.use_backend("triton"):
        outputs = _run([t.clone() for t in inputs])
    assert_golden(MLA, Case("query_blocks", inputs), outputs)


def test_a_decode_step_fuses_the_query_path_into_one_launch(launches):
    """Up to FUSED_QUERY_TOKENS tokens, the query path after the down-projection is one
    kernel launch where the rms_norm, matmul (up, absorb) and rope steps make four, so a
    decode step makes three launches fewer (on the CPU: down-projection, query kernel,
    KV kernel)."""
    from opforge.ops import mla_prolog

    names = {}
    for tokens in (mla_prolog.FUSED_QUERY_TOKENS, mla_prolog.FUSED_QUERY_TOKENS + 1):
        launches.clear()
        with opforge.use_backend("triton"):
            _run(_inputs(tokens, seed=1, blocks=8))
        names[tokens] = [name for name, _ in launches]
    fused, steps = names[64], names[65]
    with opforge.use_backend("triton"):
        plan = opforge.plan(MLA, *_inputs(64, blocks=8))
    flops, _ = kernel_costs(plan)["_mla_query_kernel"]  # the profiler's figure for it
    assert flops == 2 * 64 * 4 * (48 * (16 + 16) + 16 * 32)  # T N (Hcq (D + Dr) + D Hckv)
    assert fused.count("_mla_query_kernel") == 1 and "_rope_kernel" not in fused
    assert "_mla_query_kernel" not in steps and "_rope_kernel" in steps
    assert len(steps) - len(fused) == 3
    if DEVICE.type == "cpu":
        assert fused == ["_matmul_kernel", "_mla_query_kernel", "_mla_kv_kernel"]


def test_int64_offsets_when_a_tensor_passes_int32(monkeypatch, launches):
    """A long prefill's token_x (T x He past 2**31 elements) switches the KV kernel to
    int64 token offsets and the query path to its steps (which switch their own); forced
    here on a small problem, whose results must not change: against the float64 golden,
    with the launch arguments checked."""
    from opforge.ops import mla_prolog

    monkeypatch.setattr(mla_prolog, "wide_offsets", lambda *tensors: True)
    inputs = _inputs(5, seed=3, he=40, hcq=24, hckv=32, n=2, d=16, dr=16, blocks=4)
    with opforge.use_backend("triton"):
        written = [t.clone() for t in inputs]
        outputs = (*_run(written, cache_mode="PA_NZ")[:2], *written[10:])
    wide = {name: kwargs.get("WIDE") for name, kwargs in launches}
    assert wide["_mla_kv_kernel"] is True and "_mla_query_kernel" not in wide
    assert_golden(MLA, Case("wide", inputs, {"cache_mode": "PA_NZ"}), outputs)


@pytest.mark.parametrize("slices", [3, 40])
@pytest.mark.parametrize("mode", ["PA_BSND", "PA_NZ"])
def test_sliced_projections_match_the_golden(mode, slices, monkeypatch):
    """The decode tiling of GPUs forced on the Triton kernels: He of the KV projection cut
    into slices whose float32 partial sums the merge kernel adds before the norm, rope and
    scatter, and the query down-projection's K sliced alike (opforge's matmul). A last
    slice shorter than the others, more slices asked for than He has steps, skipped
    tokens, both cache layouts; the workspace is poisoned, so a partial the merge reads
    but no slice wrote shows."""
    from opforge.ops import matmul, mla_prolog

    for module in (matmul, mla_prolog):
        monkeypatch.setattr(module, "work_splits", lambda *args, **kwargs: slices)
    inputs = _inputs(21, seed=11, he=600, hcq=48, hckv=64, n=3, d=24, dr=16, blocks=4)
    opforge.clear_caches()
    opforge.set_poison(True)
    try:
        with opforge.use_backend("triton"):
            plan = opforge.plan(MLA, *inputs, cache_mode=mode)
            written = [t.clone() for t in inputs]
            outputs = (*plan.run(*written), *written[10:])
    finally:
        opforge.set_poison(False)
        opforge.clear_caches()
    assert plan.grid[1] > 1 and plan.workspace_bytes > 0
    costs = kernel_costs(plan)  # what the profiler gives each of the two KV kernels
    assert costs["_mla_kv_kernel"][0] > 0 and costs["_mla_kv_merge_kernel"][1] > 0
    assert_golden(MLA, Case("sliced", inputs, {"cache_mode": mode}), outputs)


def test_decoding_on_a_gpu_profile_slices_the_kv_projection():
    """DeepSeek-V3 sizes on an H200 profile: 16 tokens take the fused query kernel and are
    one block of the KV kernel, so He (7168) is cut into slices of at least 4 BLOCK_K steps
    for the 132 cores, with their float32 partials in the workspace; 1024 tokens (64 blocks)
    take a few slices; 4096 tokens fill the cores without."""
    grids, variants, candidates = {}, {}, {}
    he, hcq, hckv, n, d, dr = 7168, 1536, 512, 128, 128, 64
    for tokens in (16, 1024, 4096):
        shapes = ((tokens, he), (he, hcq), (hcq, n * (d + dr)), (n, d, hckv), (he, hckv + dr),
                  (hcq,), (hckv,), (tokens, dr), (tokens, dr))
        inputs = [torch.empty(shape, dtype=torch.bfloat16, device=DEVICE) for shape in shapes]
        blocks = max(4, tokens // 16)
        inputs += [torch.zeros(tokens, dtype=torch.int64, device=DEVICE),
                   torch.empty(blocks, 16, 1, hckv, dtype=torch.bfloat16, device=DEVICE),
                   torch.empty(blocks, 16, 1, dr, dtype=torch.bfloat16, device=DEVICE)]
        with opforge.use_backend("triton"), opforge.use_hardware("h200"):
            plan = opforge.plan(MLA, *inputs)
        grids[tokens] = (plan.grid, plan.workspace_bytes)
        variants[tokens] = plan.tiling
        candidates[tokens] = [(t.blocks["BLOCK_T"], t.blocks["BLOCK_K"], t.options["warps"])
                              for t in MLA.tiling(
                                  plan.inputs, plan.outputs, plan.attrs, get_profile("h200"))]
    # A decode step's query path is one kernel holding its 16 tokens; 1024 go through
    # the matmul steps.
    assert variants[16].variant == "fused_kv_query"
    assert variants[16].blocks["QUERY_T"] == 16 and variants[16].blocks["QUERY_C"] == 128
    assert variants[1024].variant == variants[4096].variant == "fused_kv"
    (programs, slices), workspace = grids[16]
    assert programs == 1 and slices == 7168 // (4 * 64)  # slices of 4 BLOCK_K steps
    assert workspace == 4 * slices * 16 * (512 + 2 * 64)
    (programs, slices), _ = grids[1024]
    assert programs == 64 and 132 <= programs * slices <= 2 * 132 + programs
    assert grids[4096] == ((256, 1), 0)
    # A prefill takes 16-wide K steps; its taller token blocks (8 warps) come after that
    # default, for autotuning.
    assert candidates[1024][0] == (16, 16, 32)
    assert candidates[1024][1:5] == [(64, 32, 8), (64, 16, 8), (32, 32, 8), (32, 16, 8)]
    assert all(block_t == 16 for block_t, _, _ in candidates[16])


@pytest.mark.parametrize("index, shape, param", [
    (2, (48, 4 * 30), "weight_uq_qr"),
    (4, (64, 40), "weight_dkv_kr"),
    (5, (47,), "rmsnorm_gamma_cq"),
    (8, (5, 16), "rope_cos"),
    (9, (5,), "cache_index"),
    (11, (4, 16, 1, 8), "kr_cache"),
])
def test_inconsistent_shapes_name_the_tensor(index, shape, param):
    inputs = _inputs(6)
    inputs[index] = torch.zeros(shape, dtype=inputs[index].dtype, device=DEVICE)
    with pytest.raises(opforge.ShapeError) as raised:
        _run(inputs)
    assert raised.value.param == param


def test_other_errors():
    inputs = _inputs(4)
    mixed = [*inputs[:3], inputs[3].float(), *inputs[4:]]
    with pytest.raises(opforge.DtypeError):
        _run(mixed)
    strided = [*inputs[:10], inputs[10].transpose(0, 1).contiguous().transpose(0, 1),
               inputs[11]]
    with pytest.raises(opforge.OpError, match="contiguous"):
        _run(strided)
    with pytest.raises(opforge.AttrError):
        _run(inputs, cache_mode="BSND")
    narrow = _inputs(4, hckv=24)
    with pytest.raises(opforge.ShapeError, match="32-byte"):
        _run(narrow, cache_mode="PA_NZ")


def test_torch_op_declares_the_caches_mutated():
    schema = torch.ops.opforge.mla_prolog.default._schema
    written = {arg.name for arg in schema.arguments
               if arg.alias_info is not None and arg.alias_info.is_write}
    assert written == {"kv_cache", "kr_cache"} and len(schema.returns) == 2
    inputs = _inputs(3, dtype=torch.float32)
    torch.library.opcheck(torch.ops.opforge.mla_prolog, tuple(inputs),
                          test_utils=("test_schema", "test_faketensor"))


def test_compat_signature_and_quantisation_refusal():
    inputs = _inputs(4, seed=8)
    expected = _run([t.clone() for t in inputs])
    actual = npu_mla_prolog(*[t.clone() for t in inputs], rmsnorm_epsilon_cq=1e-5,
                            cache_mode="PA_BSND")
    assert all(torch.equal(a, e) for a, e in zip(actual, expected))
    with pytest.raises(opforge.UnsupportedError):
        npu_mla_prolog(*inputs, quant_scale_ckv=torch.ones(1))


@given(tokens=st.integers(1, 20), he=st.integers(8, 80), hcq=st.integers(8, 40),
       n=st.integers(1, 5), d=st.integers(4, 40), dr=st.sampled_from([16, 32]),
       hckv=st.sampled_from([16, 48, 64]), mode=st.sampled_from(["PA_BSND", "PA_NZ"]))
def test_property_over_mla_sizes(tokens, he, hcq, n, d, dr, hckv, mode):
    generator = torch.Generator().manual_seed(tokens * 7 + he)
    inputs = mla_inputs(tokens, torch.bfloat16, DEVICE, generator, he=he, hcq=hcq, n=n, d=d,
                        dr=dr, hckv=hckv, blocks=2)
    case = Case("property", inputs, {"cache_mode": mode})
    with opforge.use_backend("triton"):
        outputs = opforge.mla_prolog(*[t.clone() for t in inputs], cache_mode=mode)
    assert_golden(MLA, case, outputs)


def test_works_under_torch_compile_with_the_caches_updated():
    inputs = _inputs(5, dtype=torch.float32, seed=9)
    eager = [t.clone() for t in inputs]
    expected = _run(eager)

    def step(*tensors):
        query, query_rope, _, _ = opforge.mla_prolog(*tensors)
        return query, query_rope

    compiled_inputs = [t.clone() for t in inputs]
    query, query_rope = torch.compile(step, fullgraph=True, backend="aot_eager")(
        *compiled_inputs)
    assert torch.equal(query, expected[0]) and torch.equal(query_rope, expected[1])
    assert torch.equal(compiled_inputs[10], eager[10])
    assert torch.equal(compiled_inputs[11], eager[11])
