"""core/: shapes, OpDef specs, plan cache, tiling buckets, workspace pool, backends,
hardware profiles."""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
import threading
from fractions import Fraction
from unittest import mock

import pytest
import torch

import opforge
from opforge.core import backends
from opforge.core.hardware import PROFILES, calibrate, get_profile, profile_for
from opforge.core.opdef import Case, TensorSpec
from opforge.core.shapes import (
    UNKNOWN_RANK,
    broadcast_dims,
    broadcast_shapes,
    normalize_dim,
    normalize_dims,
)
from opforge.core.tiling import (
    INT32_LIMIT,
    cdiv,
    gpu_warps,
    grid_stride_wide,
    next_power_of_2,
    split_steps,
    wide_offsets,
    work_splits,
)

from .conftest import assert_golden

REDUCE_SUM = opforge.get_op("reduce_sum")


@pytest.fixture(autouse=True)
def fresh_caches():
    opforge.clear_caches()
    opforge.set_plan_cache(True)
    yield
    opforge.set_plan_cache(True)


# -- shapes -----------------------------------------------------------------------------------

@pytest.mark.parametrize("a, b, out", [
    ((3, 1), (4,), (3, 4)),
    ((), (2, 3), (2, 3)),
    ((2, 1, 5), (3, 1), (2, 3, 5)),
    ((-1, 4), (3, 1), (3, 4)),       # unknown dim meets a known size
    ((-1, 1), (1, 1), (-1, 1)),      # unknown stays unknown against 1
    ((-1,), (-1,), (-1,)),
    ((-2,), (3, 4), UNKNOWN_RANK),   # unknown rank wins
])
def test_broadcast_shapes(a, b, out):
    """Broadcasting gives the expected shape whichever operand comes first."""
    assert broadcast_shapes(a, b) == out
    assert broadcast_shapes(b, a) == out


@pytest.mark.parametrize("shape, out_shape, dims", [
    ((4,), (2, 3, 4), (0, 1)),           # padded on the left
    ((3, 1), (2, 3, 4), (0, 2)),         # padded, and a 1 stretched to 4
    ((2, 3, 4), (2, 3, 4), ()),
    ((1, 4), (1, 4), ()),                # a 1 that stays 1 is not stretched
    ((2, 1), (3, 2, 1), (0,)),
    ((1, 1, 5), (1, 3, 5), (1,)),
])
def test_broadcast_dims_lists_padded_and_stretched_dims(shape, out_shape, dims):
    """broadcast_dims names exactly the dims a gradient must be summed over: summing a
    gradient of out_shape over them (keepdim) gives a tensor that views as shape."""
    assert broadcast_dims(shape, out_shape) == dims
    grad = torch.ones(out_shape)
    summed = grad.sum(dim=dims, keepdim=True) if dims else grad
    assert summed.reshape(shape).shape == torch.Size(shape)
    assert summed.numel() == torch.Size(shape).numel()


def test_dim_normalisation():
    """Dims map into [0, rank), sorted; out-of-range and repeated dims are AttrErrors."""
    assert normalize_dim(-1, 3) == 2 and normalize_dim(0, 0) == 0
    assert normalize_dims((2, -3), 3) == (0, 2)
    with pytest.raises(opforge.AttrError, match=r"\[-3, 2\]"):
        normalize_dim(3, 3, op="x")
    for repeated in ((1, 1), (2, -1), (0, 2, -3)):
        with pytest.raises(opforge.AttrError, match="more than once"):
            normalize_dims(repeated, 3)


def test_repeated_reduction_dims_are_rejected_in_plan():
    """reduce_sum over the same dim named twice is an AttrError from plan, naming the
    operator and the parameter, before any kernel."""
    with pytest.raises(opforge.AttrError, match="more than once") as raised:
        opforge.plan("reduce_sum", torch.ones(2, 3), dims=(1, -1))
    assert raised.value.param == "dims" and "reduce_sum" in str(raised.value)


def test_infer_shape_accepts_unknown_dims_and_rank():
    add, total = opforge.get_op("broadcast_add"), opforge.get_op("reduce_sum")
    spec = TensorSpec((-1, 8), torch.float16)
    attrs = add.bind_attrs({})
    assert add.infer_shape([spec, TensorSpec((8,), torch.float32)], attrs) == [(-1, 8)]
    assert add.infer_dtype([spec, TensorSpec((8,), torch.float32)], attrs) == [torch.float32]
    assert add.infer_shape([TensorSpec(UNKNOWN_RANK, torch.float32), spec], attrs) == [
        UNKNOWN_RANK]
    attrs = total.bind_attrs({"dims": (1,), "keepdim": True})
    assert total.infer_shape([spec], attrs) == [(-1, 1)]
    assert total.infer_shape([TensorSpec(UNKNOWN_RANK, torch.float32)], attrs) == [UNKNOWN_RANK]


# -- plan -------------------------------------------------------------------------------------

def test_plan_reports_outputs_cost_and_tiling():
    a, b = torch.ones(63, 1000, dtype=torch.bfloat16), torch.ones(1000, dtype=torch.bfloat16)
    plan = opforge.plan("broadcast_add", a, b, alpha=2)
    assert plan.outputs[0] == TensorSpec((63, 1000), torch.bfloat16, torch.device("cpu"))
    assert plan.cost.bytes_moved == 2 * (63_000 + 1000 + 63_000)
    assert plan.cost.flops == 2 * 63_000
    assert plan.tiling.variant == "persistent" and plan.grid[0] >= 1
    assert plan.tiling.onchip_bytes <= plan.hardware.onchip_limit(plan.tiling.double_buffered)
    assert plan.attrs == {"alpha": 2.0} and "broadcast_add" in repr(plan)


def test_repeated_signature_never_replans():
    x = torch.randn(7, 5)
    first = opforge.plan("gelu", x, approximate="tanh")
    second = opforge.plan("gelu", torch.randn(7, 5), approximate="tanh")
    assert first is second
    stats = opforge.cache_stats()
    assert (stats.plan_hits, stats.plan_misses) == (1, 1)
    opforge.plan("gelu", x)  # another attribute value: another plan
    assert opforge.cache_stats().plan_misses == 2


def test_attribute_values_equal_in_value_but_not_type_never_share_a_plan():
    """k=2 cached must not let k=2.0 (an AttrError on its own) through."""
    x = torch.randn(4, 8)
    opforge.plan("moe_gating_top_k", x, None, k=2)
    with pytest.raises(opforge.AttrError) as raised:
        opforge.plan("moe_gating_top_k", x, None, k=2.0)
    assert raised.value.param == "k"
    opforge.plan("reduce_sum", x, dims=[1])
    with pytest.raises(opforge.AttrError):
        opforge.plan("reduce_sum", x, dims=[True])


@pytest.mark.parametrize("call, param", [
    (lambda q: opforge.attention(q, q, q, causal=None), "causal"),
    (lambda q: opforge.attention(q, q, q, causal=1), "causal"),
    (lambda q: opforge.attention(q, q, q, causal=1.0), "causal"),
    (lambda q: opforge.attention(q, q, q, scale=True), "scale"),
    (lambda q: opforge.attention(q, q, q, scale=10 ** 400), "scale"),
    (lambda q: opforge.gelu(q, approximate=None), "approximate"),
    (lambda q: opforge.reduce_sum(q, dims=[True]), "dims"),
])
def test_functionals_refuse_attribute_values_the_dispatcher_would_convert(call, param):
    """None or 1 for a bool, True for a float: the torch dispatcher converts them, plan
    refuses them; the functional raises plan's AttrError. An int past float's range is no
    finite float (an untyped OverflowError before)."""
    with pytest.raises(opforge.AttrError) as raised:
        call(torch.randn(1, 1, 3, 4))
    assert raised.value.param == param


def test_a_sparse_input_is_refused_before_any_kernel(backend):
    """Kernels address elements through strides: a sparse tensor is an OpError from plan,
    the functional and a held plan's run, also once a dense tensor of its shape, dtype and
    device has a cached plan."""
    dense = torch.randn(4, 8)
    held = opforge.plan("softmax", dense)
    sparse = dense.to_sparse()
    for call in (lambda: opforge.plan("softmax", sparse), lambda: opforge.softmax(sparse),
                 lambda: held.run(sparse)):
        with pytest.raises(opforge.OpError, match="dense") as raised:
            call()
        assert raised.value.param == "x"


def test_nearby_shapes_share_a_tiling():
    opforge.plan("sigmoid", torch.ones(1000))
    opforge.plan("sigmoid", torch.ones(1001))   # same power-of-two bucket (1024)
    opforge.plan("sigmoid", torch.ones(5000))   # another bucket
    stats = opforge.cache_stats()
    assert (stats.plan_misses, stats.tiling_hits, stats.tiling_misses) == (3, 1, 2)


def test_plan_cache_can_be_disabled():
    opforge.set_plan_cache(False)
    x = torch.ones(3)
    assert opforge.plan("sigmoid", x) is not opforge.plan("sigmoid", x)
    assert opforge.cache_stats().plan_hits == 0


def test_plan_cache_is_bounded(monkeypatch):
    from opforge.core import plan as plan_module

    monkeypatch.setattr(plan_module._caches, "capacity", 4)
    for n in range(1, 10):
        opforge.plan("sigmoid", torch.ones(n))
    assert opforge.cache_stats().plans_cached == 4


def test_cache_and_pool_are_thread_safe():
    errors: list[BaseException] = []
    calls_per_thread = 40

    def work(seed: int) -> None:
        try:
            generator = torch.Generator().manual_seed(seed)
            with opforge.use_backend("triton"):
                for i in range(calls_per_thread):
                    x = torch.randn(64 + (i * seed) % 37, 3, generator=generator)
                    got = opforge.plan("reduce_sum", x, dims=(0,)).run(x)
                    assert_golden(REDUCE_SUM, Case("thread", (x,), {"dims": (0,)}), got)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(1, 5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    stats = opforge.cache_stats()
    assert stats.plan_hits + stats.plan_misses == 4 * calls_per_thread


def test_workspace_pool_reuses_memory_across_shapes():
    with opforge.use_backend("triton"):
        sizes = [3, 5, 4, 7, 6, 3, 8, 2]
        for cols in sizes:
            x = torch.randn(4097, cols)
            plan = opforge.plan("reduce_sum", x, dims=(0,))
            assert plan.workspace_bytes > 0
            assert_golden(REDUCE_SUM, Case("pool", (x,), {"dims": (0,)}), plan.run(x))
    stats = opforge.workspace_stats()
    assert stats.requests == len(sizes)
    assert stats.allocations <= 2  # grows to the next power of two, then reuses


def test_run_with_out_and_workspace_allocates_nothing():
    x = torch.randn(4097, 3)
    with opforge.use_backend("triton"):
        plan = opforge.plan("reduce_sum", x, dims=(0,))
    out = torch.empty(3)
    workspace = torch.empty(plan.workspace_bytes, dtype=torch.uint8)

    def refuse(*args, **kwargs):
        raise AssertionError("run allocated")

    patches = [mock.patch.object(torch, name, refuse)
               for name in ("empty", "zeros", "empty_like", "zeros_like", "empty_strided")]
    for patch in patches:
        patch.start()
    try:
        result = plan.run(x, out=out, workspace=workspace)
    finally:
        for patch in patches:
            patch.stop()
    assert result is out
    assert_golden(REDUCE_SUM, Case("no_alloc", (x,), {"dims": (0,)}), out)
    assert opforge.workspace_stats().requests == 0


def test_run_refuses_what_is_not_an_out_or_a_workspace_of_its_own():
    """Typed errors before any kernel: an out or workspace that is not a tensor, and a
    workspace whose bytes overlap an input or the out (the kernels' scratch writes would
    corrupt them; the input is left as it was)."""
    x = torch.randn(2, 4097)
    with opforge.use_backend("triton"):
        plan = opforge.plan("reduce_sum", x, dims=(1,))
    assert plan.workspace_bytes > 0
    before = x.clone()
    bad_runs = [({"out": 5}, "out"), ({"workspace": 5}, "workspace"),
                ({"workspace": x.view(-1)}, "workspace"),
                ({"out": torch.empty(2), "workspace": x[1]}, "workspace"),
                # flat bytes of exactly the plan's size (checked without a view)
                ({"workspace": x.view(-1).view(torch.uint8)[: plan.workspace_bytes]},
                 "workspace")]
    for arguments, param in bad_runs:
        with pytest.raises(opforge.OpError) as raised:
            plan.run(x, **arguments)
        assert raised.value.param == param
    assert torch.equal(x, before)
    scratch = torch.empty(plan.workspace_bytes + 8, dtype=torch.uint8)
    out = torch.empty(2)
    with pytest.raises(opforge.OpError):
        plan.run(x, out=scratch[:8].view(torch.float32), workspace=scratch)
    # Scratch starting off a 16-byte boundary (the launcher views it as float32).
    with pytest.raises(opforge.OpError, match="not aligned") as raised:
        plan.run(x, out=out, workspace=scratch[1:])
    assert raised.value.param == "workspace"
    assert_golden(REDUCE_SUM, Case("own_scratch", (x,), {"dims": (1,)}),
                  plan.run(x, out=out, workspace=scratch))


def test_non_contiguous_out_is_filled(backend):
    a, b = torch.randn(4, 6), torch.randn(6)
    out = torch.full((6, 4), float("nan")).t()
    result = opforge.plan("broadcast_add", a, b).run(a, b, out=out)
    assert result is out
    torch.testing.assert_close(out, a + b, rtol=0, atol=0)


def test_float64_always_runs_on_torch(backend):
    x = torch.randn(5, dtype=torch.float64)
    assert opforge.plan("gelu", x).backend == "torch"


# -- backends ---------------------------------------------------------------------------------

def test_backend_setting_precedence(setenv, monkeypatch):
    setenv("OPFORGE_BACKEND", "triton")
    assert backends.requested_backend() == "triton"
    with opforge.use_backend("torch"):
        assert backends.requested_backend() == "torch"
        assert opforge.plan("sigmoid", torch.ones(2)).backend == "torch"
    monkeypatch.setenv("OPFORGE_BACKEND", "torch")  # read once: not seen until reloaded
    assert backends.requested_backend() == "triton"
    setenv("OPFORGE_BACKEND", "cuda")
    with pytest.raises(ValueError, match="unknown backend"):
        backends.requested_backend()


def test_auto_uses_torch_on_cpu_and_triton_on_accelerators():
    op = opforge.get_op("sigmoid")
    spec = [TensorSpec((4,), torch.float32)]
    assert backends.select_backend(op, spec, {}, torch.device("cpu")) == "torch"
    assert backends.select_backend(op, spec, {}, torch.device("cuda")) == "triton"


def test_declining_backend_falls_back_under_auto_and_raises_when_explicit(monkeypatch, caplog):
    op = opforge.get_op("sigmoid")
    monkeypatch.setitem(op.decliners, "triton", lambda specs, attrs: "odd sizes only")
    spec = [TensorSpec((4,), torch.float32)]
    with caplog.at_level(logging.WARNING, logger="opforge"):
        for _ in range(3):
            assert backends.select_backend(op, spec, {}, torch.device("cuda")) == "torch"
    assert sum("odd sizes only" in r.getMessage() for r in caplog.records) == 1
    with opforge.use_backend("triton"), pytest.raises(opforge.UnsupportedError,
                                                      match="odd sizes only"):
        backends.select_backend(op, spec, {}, torch.device("cuda"))


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setattr(backends, "interpreter_enabled", lambda: False)
    op = opforge.get_op("sigmoid")
    spec = [TensorSpec((4,), torch.float32)]
    with opforge.use_backend("triton"), pytest.raises(opforge.UnsupportedError,
                                                      match="TRITON_INTERPRET"):
        backends.select_backend(op, spec, {}, torch.device("cpu"))


# -- hardware ---------------------------------------------------------------------------------

def test_datasheet_profiles():
    ascend = PROFILES["ascend910b"]
    assert ascend.memories["UB"] == 192 * 1024 and ascend.memories["L1"] == 512 * 1024
    assert ascend.memories["L0A"] == ascend.memories["L0B"] == 64 * 1024
    assert ascend.memories["L0C"] == 128 * 1024
    assert ascend.onchip_limit(double_buffered=True) == 96 * 1024
    h200 = get_profile("h200")
    assert h200.memory_bandwidth > get_profile("h100").memory_bandwidth
    assert 150 < h200.ridge_point(torch.bfloat16) < 250
    cpu = profile_for("cpu")
    assert cpu.device_type == "cpu" and cpu.core_count >= 1 and cpu.onchip_bytes > 0
    with pytest.raises(opforge.AttrError, match="ascend910b"):
        get_profile("tpu")


def test_ascend_tiling_fits_half_the_unified_buffer():
    with opforge.use_hardware("ascend910b"):
        for op, x in [("gelu", torch.ones(1 << 20)), ("reduce_sum", torch.ones(8192, 4096))]:
            plan = opforge.plan(op, x)
            assert plan.hardware.name == "ascend910b"
            assert plan.tiling.onchip_bytes <= 96 * 1024
            assert plan.grid[0] * (plan.grid[1] if len(plan.grid) > 1 else 1) <= 65535


def test_tiling_falls_back_to_a_variant_that_fits():
    from opforge.core.hardware import HardwareProfile

    small = HardwareProfile("small", "cpu", 1e9, {torch.float32: 1e9}, onchip_bytes=40 * 1024,
                            core_count=4)
    x = torch.ones(1 << 16)
    preferred = opforge.plan("gelu", x).tiling
    with opforge.use_hardware(small):
        plan = opforge.plan("gelu", x)
    assert plan.tiling.blocks["BLOCK"] < preferred.blocks["BLOCK"]
    assert plan.tiling.onchip_bytes <= 20 * 1024 < preferred.onchip_bytes


def test_calibrate_caches_measured_ceilings(tmp_path, monkeypatch):
    from opforge.core import hardware

    monkeypatch.setenv("OPFORGE_CACHE_DIR", str(tmp_path))
    entry = calibrate("cpu", copy_bytes=1 << 20, matmul_size=64, repeats=3)
    assert entry["memory_bandwidth"] > 0 and entry["peak_flops"]["float32"] > 0
    assert (tmp_path / "calibration.json").exists()
    profile = profile_for("cpu")
    assert profile.source == "calibrated"
    assert profile.memory_bandwidth == entry["memory_bandwidth"]
    hardware._runtime_profiles.clear()


def test_collapse_dims_merges_what_is_contiguous_in_every_operand():
    from opforge.ops._elementwise import collapse_dims

    # Same-shape contiguous operands: one dim.
    assert collapse_dims((4, 5, 6), [[30, 6, 1], [30, 6, 1]]) == ([120], [[1], [1]])
    # A bias broadcast over rows (stride 0) keeps two dims; size-1 dims vanish.
    assert collapse_dims((4, 1, 6), [[6, 6, 1], [0, 0, 1]]) == ([4, 6], [[6, 1], [0, 1]])
    # A transposed operand blocks the merge.
    assert collapse_dims((3, 5), [[5, 1], [1, 3]]) == ([3, 5], [[5, 1], [1, 3]])
    assert collapse_dims((1, 1), [[1, 1]]) == ([1], [[0]])


def test_auto_falls_back_to_torch_when_no_tiling_fits(monkeypatch, caplog):
    from opforge.core.hardware import HardwareProfile

    # Treat CPU tensors as accelerator tensors so that auto picks triton first.
    monkeypatch.setattr(backends, "ACCELERATOR_TYPES", ("cpu",))
    tiny = HardwareProfile("tiny", "cpu", 1e9, {torch.float32: 1e9}, onchip_bytes=64,
                           core_count=1)
    x = torch.randn(300)
    assert opforge.plan("sigmoid", x).backend == "triton"
    with opforge.use_hardware(tiny), caplog.at_level(logging.WARNING, logger="opforge"):
        plan = opforge.plan("sigmoid", x)
        assert (plan.backend, plan.tiling) == ("torch", None)
        assert "no tiling fits the tiny on-chip memory" in caplog.text
        assert_golden(plan.op, Case("fallback", (x,)), plan.run(x))


# -- tiling arithmetic ------------------------------------------------------------------------

def test_cdiv_and_next_power_of_2_match_their_definitions():
    """cdiv is the ceiling of a / b (exact multiples and 0 included); next_power_of_2 is
    the smallest power of two >= n (1 for n <= 1)."""
    for a in range(70):
        for b in range(1, 10):
            assert cdiv(a, b) == math.ceil(Fraction(a, b)), (a, b)
    for n in range(-1, 1100):
        power = next_power_of_2(n)
        assert power & (power - 1) == 0 and power >= n, n
        assert power == 1 or power // 2 < n, n


def test_split_steps_counts_only_slices_that_hold_steps():
    """split_steps(steps, splits) = (steps a slice holds, slices used): at most ``splits``
    slices of whole steps that cover every step, and none of them empty."""
    for steps in (1, 2, 7, 8, 9, 100):
        for splits in (1, 2, 3, 5, 8, 200):
            per, used = split_steps(steps, splits)
            assert per == math.ceil(Fraction(steps, splits)), (steps, splits)
            assert used <= splits and per * used >= steps, (steps, splits)
            assert per * (used - 1) < steps, (steps, splits)   # the last slice holds a step


def test_gpu_warps_keep_about_16_values_a_thread_within_4_to_32_warps():
    """On CUDA, warps are next_power_of_2(elements) / (32 threads x 16 values), clamped to
    [4, 32]; other devices get None (no warps there)."""
    cuda = get_profile("h100")
    for elements in (1, 100, 2048, 4096, 4097, 8192, 16384, 1 << 20):
        expected = min(32, max(4, next_power_of_2(elements) // (32 * 16)))
        assert gpu_warps(elements, cuda) == expected, elements
    assert gpu_warps(16384, cuda) == 32 and gpu_warps(1 << 20, cuda) == 32
    assert gpu_warps(16384, profile_for("cpu")) is None
    assert gpu_warps(16384, get_profile("ascend910b")) is None


def test_one_row_tiles_take_32_values_a_thread_where_a_kernel_asks_up_to_8_warps():
    """layer_norm's forward and the softmax backwards tile one row of 8192 at 8 warps (32
    values a thread, faster on the H200); a tile of several rows, a one-row tile that
    would need more than 8 warps (the register cap), and the other row kernels keep 16."""
    def warps(op: str, rows: int, cols: int, **attrs: object) -> int:
        x = torch.empty(rows, cols, dtype=torch.bfloat16)
        inputs = {"layer_norm": (x, x[0], x[0]), "rms_norm": (x, x[0]),
                  "softmax": (x,)}.get(op, (x, x))
        with opforge.use_hardware("h200"), opforge.use_backend("triton"):
            return opforge.plan(op, *inputs, **attrs).tiling.options["warps"]

    norm = {"normalized_shape": [8192]}
    assert warps("layer_norm", 64, 8192, **norm) == 8
    assert warps("rms_norm", 64, 8192) == 16
    for op in ("softmax_backward", "log_softmax_backward"):
        assert warps(op, 64, 8192, dim=-1) == 8, op
        assert warps(op, 64, 1024, dim=-1) == 8, op       # 4 x 1024 tiles: 16 a thread
        assert warps(op, 64, 16384, dim=-1) == 32, op     # 16 warps at 32: 16 a thread
    assert warps("softmax", 64, 8192, dim=-1) == 16
    assert warps("layer_norm", 64, 4096, normalized_shape=[4096]) == 4
    assert warps("layer_norm", 64, 16384, normalized_shape=[16384]) == 32


def test_norm_backward_runs_one_program_a_core_where_one_fills_the_registers():
    """The norms' backward programs own float32 partials: two a core where both fit on an
    SM (8 warps at 4096 columns), one where a program of 16 warps fills its registers
    (8192 columns): a second would only run after the first, with twice the partials."""
    cores = get_profile("h200").core_count
    for op, cols, programs in (("rms_norm_backward", 8192, cores),
                               ("rms_norm_backward", 4096, 2 * cores),
                               ("layer_norm_backward", 8192, cores)):
        x = torch.empty(4 * cores, cols, dtype=torch.bfloat16)
        stat = torch.empty(4 * cores, dtype=torch.float32)
        inputs = (x, x, stat, x[0]) if op == "rms_norm_backward" else \
            (x, x, stat, stat, x[0], x[0])
        attrs = {} if op == "rms_norm_backward" else {"normalized_shape": [cols]}
        with opforge.use_hardware("h200"), opforge.use_backend("triton"):
            planned = opforge.plan(op, *inputs, **attrs)
        assert planned.grid == (programs,), (op, cols, planned.tiling)
        assert planned.workspace_bytes == 4 * programs * cols * (
            1 if op == "rms_norm_backward" else 2), op


def test_work_splits_fill_idle_cores_with_slices_of_at_least_min_steps():
    """work_splits is 1 on the CPU and once the programs fill busy_share of the cores;
    otherwise enough slices for two programs a core, each at least min_steps steps."""
    gpu = get_profile("h100")
    cores = gpu.core_count
    assert work_splits(1, 10_000, profile_for("cpu")) == 1
    for programs in (cores, cores + 1, 2 * cores):
        assert work_splits(programs, 10_000, gpu) == 1, programs
    assert work_splits(cores // 2, 10_000, gpu, busy_share=0.5) == 1
    assert work_splits(1, 10_000, gpu) == 2 * cores
    assert work_splits(1, 4, gpu) == 1          # a 4-step loop is one slice of min_steps
    for programs in (1, 2, 7, cores - 1):
        for steps in (0, 3, 4, 7, 64, 10_000):
            splits = work_splits(programs, steps, gpu)
            assert splits == max(1, min(math.ceil(Fraction(2 * cores, programs)),
                                        steps // 4)), (programs, steps)
            assert splits == 1 or steps // splits >= 4, (programs, steps)


_GRID_STRIDE_PROBE = """
import torch, opforge
from opforge.aot import recorded_launches
from opforge.core.hardware import get_profile
from opforge.core.plan import plan
for name, count in (("sigmoid", 1), ("silu_mul", 2)):
    for n in (2**31 - 1000, 10**6):
        inputs = (torch.empty(n, device="meta", dtype=torch.bfloat16),) * count
        with recorded_launches(get_profile("h200")) as recorder:
            plan(opforge.get_op(name), *inputs).run(*inputs)
        print(name, n, *(v.constexprs["WIDE"] for v in recorder.variants.values()))
"""


def test_a_grid_stride_loop_near_int32_takes_int64_offsets():
    """Below 2^31 elements, but within a step of the grid (programs x block) of it, the
    elementwise and gated kernels' loop offset would wrap past 2^31 to a negative int32
    that the mask lets through: they take int64 offsets there (meta tensors, launches
    recorded on the compiled path, so without the interpreter)."""
    assert grid_stride_wide(2**31 - 1000, 1056, 2048)
    assert not grid_stride_wide(2**31 - 1 - 1056 * 2048, 1056, 2048)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _GRID_STRIDE_PROBE], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:4] == [
        f"sigmoid {2**31 - 1000} True", "sigmoid 1000000 False",
        f"silu_mul {2**31 - 1000} True", "silu_mul 1000000 False"]


def test_wide_offsets_switch_when_the_reach_passes_int32():
    """wide_offsets is true when 1 + sum((size - 1) * |stride|) of some tensor (its element
    count when contiguous) exceeds INT32_LIMIT = 2^31 - 1 (meta tensors: no memory)."""

    def meta(*shape):
        return torch.empty(*shape, dtype=torch.int8, device="meta")

    assert INT32_LIMIT == 2**31 - 1
    assert not wide_offsets(meta(2**31 - 1)) and wide_offsets(meta(2**31))
    every_second = meta(2**31)[::2]           # 2^30 elements, last offset 2^31 - 2
    assert not every_second.is_contiguous() and not wide_offsets(every_second)
    assert wide_offsets(meta(2**31 + 2)[::2])  # last offset 2^31
    transposed = meta(2**16, 2**15).t()       # last offset 2^31 - 1: reach 2^31
    assert not transposed.is_contiguous() and wide_offsets(transposed)
    assert wide_offsets(meta(4), meta(2**31)) and not wide_offsets(meta(4), every_second)
