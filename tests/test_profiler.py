"""The profiler: costs, verdicts, the trace model, the report files, the commands."""

from __future__ import annotations

import csv
import json
import math
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import opforge
from opforge import cli
from opforge.core import hardware
from opforge.core import plan as plan_module
from opforge.core.errors import AttrError, DeviceError
from opforge.core.hardware import HardwareProfile, get_profile
from opforge.profiler import analyse, bench, report, roofline, tables, timeline
from opforge.profiler.costs import aten_cost

from .conftest import DEVICE

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "tiny_moe_lm" / "train.py"
# A device with round ceilings: 1 TB/s, 100 TFLOP/s in fp32 and 400 in bf16, 10 cores.
TOY = HardwareProfile("toy", "cuda", 1e12, {torch.float32: 100e12, torch.bfloat16: 400e12},
                      onchip_bytes=1 << 16, core_count=10)


# ---------------------------------------------------------------------------------------------
# Verdicts on kernels of known cost and time


@pytest.mark.parametrize(("flops", "moved", "bound", "pct"), [
    (90e12 * 1e-3, 1e6, roofline.COMPUTE, 90.0),       # 90% of 100 TFLOP/s
    (1e6, 0.85e12 * 1e-3, roofline.MEMORY, 85.0),      # 85% of 1 TB/s
    (50e12 * 1e-3, 0.5e12 * 1e-3, roofline.LATENCY, 50.0),
    (80e12 * 1e-3, 0.0, roofline.COMPUTE, 80.0),       # the threshold itself is bound
    (79e12 * 1e-3, 0.79e12 * 1e-3, roofline.LATENCY, 79.0),
])
def test_verdicts_of_synthetic_kernels(flops, moved, bound, pct):
    verdict = roofline.judge(flops, moved, 1e-3, TOY, torch.float32)
    assert verdict.bound == bound
    assert verdict.roofline_pct == pytest.approx(pct)
    assert verdict.tflops == pytest.approx(flops / 1e-3 / 1e12)
    assert verdict.gbs == pytest.approx(moved / 1e-3 / 1e9)


def test_verdict_uses_the_roof_of_the_dtype_and_refuses_unknown_costs():
    flops = 200e12 * 1e-3
    assert roofline.judge(flops, 1.0, 1e-3, TOY, torch.float32).bound == roofline.COMPUTE
    bf16 = roofline.judge(flops, 1.0, 1e-3, TOY, torch.bfloat16)
    assert bf16.bound == roofline.LATENCY and bf16.roofline_pct == pytest.approx(50.0)
    assert bf16.ridge == pytest.approx(400.0)
    assert roofline.judge(None, 1.0, 1e-3, TOY).bound == roofline.UNKNOWN
    assert roofline.judge(1.0, 1.0, 0.0, TOY).bound == roofline.UNKNOWN


def test_advice_names_the_cause():
    def advise(flops, moved, seconds, blocks=None):
        verdict = roofline.judge(flops, moved, seconds, TOY)
        return roofline.advice(verdict, TOY, seconds * 1e6, blocks)

    assert "launch-bound" in advise(1e3, 1e3, 2e-6)
    assert "4 blocks on 10 cores" in advise(1e6, 1e6, 1e-3, blocks=4)
    assert "bandwidth" in advise(1e3, 0.3e12 * 1e-3, 1e-3, blocks=1000)
    assert "compute roof" in advise(30e12 * 1e-3, 1e3, 1e-3, blocks=1000)
    assert "moves no data" in advise(0.0, 0.0, 1e-3)
    assert "at 90% of the compute roof" in advise(90e12 * 1e-3, 1e3, 1e-3)
    assert "no cost known" in roofline.advice(roofline.Verdict(roofline.UNKNOWN), TOY, 5.0, 1)


# ---------------------------------------------------------------------------------------------
# Costs of torch's operators


@pytest.mark.parametrize(("name", "dims", "types", "concrete", "flops", "moved", "out"), [
    ("aten::mm", [[64, 32], [32, 16]], ["float", "float"], [], 2 * 64 * 32 * 16,
     4 * (64 * 32 + 32 * 16 + 64 * 16), (64, 16)),
    ("aten::addmm", [[16], [8, 4], [4, 16]], ["c10::BFloat16"] * 3, [], 2 * 8 * 4 * 16,
     2 * (16 + 32 + 64 + 128), (8, 16)),
    ("aten::bmm", [[3, 5, 7], [3, 7, 2]], ["float", "float"], [], 2 * 3 * 5 * 7 * 2,
     4 * (105 + 42 + 30), (3, 5, 2)),
    ("aten::matmul", [[2, 1, 5, 7], [3, 7, 4]], ["float", "float"], [], 2 * 6 * 5 * 7 * 4,
     4 * (70 + 84 + 120), (2, 3, 5, 4)),
    ("aten::matmul", [[7], [7, 4]], ["float", "float"], [], 2 * 4 * 7, 4 * (7 + 28 + 4), (4,)),
    ("aten::linear", [[2, 9, 8], [5, 8], [5]], ["float"] * 3, [], 2 * 18 * 8 * 5,
     4 * (144 + 40 + 5 + 90), (2, 9, 5)),
    ("aten::conv2d", [[2, 4, 9, 9], [6, 2, 3, 3], [6], [], [], [], []],
     ["float"] * 3 + ["ScalarList"] * 3 + ["Scalar"],
     ["", "", "", "[2, 2]", "[1, 1]", "[1, 1]", "2"], 2 * (2 * 6 * 5 * 5) * 2 * 9,
     4 * (648 + 108 + 6 + 300), (2, 6, 5, 5)),
    ("aten::add", [[4, 8], [8], []], ["float", "float", "Scalar"], [], 32, 4 * (32 + 8 + 32),
     (4, 8)),
    ("aten::where", [[4, 8], [4, 8], [4, 8]], ["bool", "float", "float"], [], 32,
     32 + 4 * 64 + 4 * 32, (4, 8)),
    ("aten::copy_", [[10], [10], []], ["float", "c10::Half", "Scalar"], [], 0, 40 + 20, (10,)),
    ("aten::randn", [[], [], [], [], []], [""] * 5, ["[3, 5]", "", "", "", ""], 0, 60, (3, 5)),
    ("aten::sum", [[6, 7], [], []], ["float", "", "Scalar"], [], 42, 4 * 42, None),
    ("aten::embedding", [[100, 8], [3, 5]], ["float", "long int"], [], 0,
     2 * 4 * 120 + 8 * 15, (3, 5, 8)),
    ("aten::view", [[4, 4], []], ["float", ""], [], 0, 0, None),
    # A copy writes its destination's dtype (bfloat16), reading the float32 source.
    ("aten::copy_", [[10], [10], []], ["c10::BFloat16", "float", "Scalar"], [], 0, 40 + 20,
     (10,)),
])
def test_torch_operator_costs(name, dims, types, concrete, flops, moved, out):
    cost = aten_cost(name, dims, types, concrete)
    assert cost is not None
    assert cost.flops == flops
    assert cost.bytes_moved == moved
    if out is not None:
        assert cost.output_shapes == (out,)


def test_unknown_and_transposed_operators_get_no_cost():
    assert aten_cost("aten::nonzero", [[4]], ["float"]) is None
    assert aten_cost("mylib::op", [[4]], ["float"]) is None
    transposed = ["", "", "", "[1]", "[0]", "[1]", "True", "[0]", "1"]
    assert aten_cost("aten::convolution", [[1, 2, 5], [2, 3, 3], [], [], [], [], [], [], []],
                     ["float", "float"] + [""] * 7, transposed) is None


# ---------------------------------------------------------------------------------------------
# The trace model, on a synthetic GPU trace with known answers


def _x(name, cat, ts, dur, tid=1, pid=1, **args):
    return {"ph": "X", "name": name, "cat": cat, "ts": 1000 + ts, "dur": dur, "pid": pid,
            "tid": tid, "args": args}


def _gpu_trace():
    """One step of 100 us: an opforge softmax (one kernel), an aten::mm (its kernel linked
    by correlation only), an opforge attention_backward run as a plan (two kernels) and an
    all-reduce on another stream that overlaps them."""
    events = [
        # The device's copies of annotations, listed first, share their External ids.
        _x("opforge::attention_backward#2", "gpu_user_annotation", 70, 12, tid=7, pid=0,
           **{"External id": 14}),
        _x("ProfilerStep#1", "gpu_user_annotation", 30, 52, tid=7, pid=0,
           **{"External id": 1}),
        _x("ProfilerStep#1", "user_annotation", 0, 100, **{"External id": 1}),
        _x("opforge::softmax", "cpu_op", 5, 20, **{"External id": 10,
                                                     "Input Dims": [[4, 256], []],
                                                     "Input type": ["c10::BFloat16", "Scalar"]}),
        _x("opforge::softmax#1", "user_annotation", 6, 18, **{"External id": 11}),
        _x("cudaLaunchKernel", "cuda_runtime", 10, 5, correlation=100, **{"External id": 11}),
        _x("aten::mm", "cpu_op", 30, 10, **{"External id": 12, "Input Dims": [[64, 32], [32, 16]],
                                             "Input type": ["float", "float"]}),
        _x("cudaLaunchKernel", "cuda_runtime", 32, 4, correlation=101),
        # attention_backward's plan is run directly (no dispatcher op around it).
        _x("opforge::attention_backward#2", "user_annotation", 46, 18, **{"External id": 14}),
        _x("cudaLaunchKernel", "cuda_runtime", 47, 2, correlation=102, **{"External id": 14}),
        _x("cudaLaunchKernel", "cuda_runtime", 50, 2, correlation=103, **{"External id": 14}),
        _x("softmax_kernel", "kernel", 30, 10, tid=7, pid=0, correlation=100, grid=[4, 1, 1],
           **{"External id": 11}),
        _x("gemm", "kernel", 45, 20, tid=7, pid=0, correlation=101, grid=[2, 2, 1]),
        _x("ncclKernel_AllReduce", "kernel", 60, 20, tid=8, pid=0, correlation=104),
        _x("dq_kernel", "kernel", 70, 5, tid=7, pid=0, correlation=102, grid=[8, 1, 1],
           **{"External id": 14}),
        _x("dkdv_kernel", "kernel", 76, 6, tid=7, pid=0, correlation=103, grid=[8, 1, 1],
           **{"External id": 14}),
        {"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "ts": 900, "dur": 500,
         "pid": "Spans", "tid": "PyTorch Profiler"},
    ]
    records = {
        1: {"op": "softmax", "inputs": [{"shape": [4, 256], "dtype": "bfloat16"}],
            "outputs": [{"shape": [4, 256], "dtype": "bfloat16"}], "backend": "triton",
            "tiling": "row BLOCK=256", "grid": [4], "flops": 5120.0, "bytes": 4096.0},
        2: {"op": "attention_backward", "inputs": [{"shape": [1, 2, 8, 16], "dtype": "float32"}],
            "outputs": [{"shape": [1, 2, 8, 16], "dtype": "float32"}], "backend": "triton",
            "tiling": "flash", "grid": [8], "flops": 1e6, "bytes": 1e5,
            "kernels": {"dq_kernel": [4e5, 6e4]}},
    }
    return {"traceEvents": events}, records


def test_gpu_trace_kernels_are_owned_and_costed():
    trace, records = _gpu_trace()
    parsed = timeline.parse([trace], records)
    assert parsed.device_kernels
    rows = timeline.kernel_rows(parsed, "CUDA")
    assert [r.name for r in rows] == ["softmax_kernel", "gemm", "ncclKernel_AllReduce",
                                      "dq_kernel", "dkdv_kernel"]
    softmax, gemm, nccl, dq, dkdv = rows
    assert (softmax.type, softmax.flops, softmax.bytes_moved) == ("opforge::softmax", 5120, 4096)
    assert (softmax.block_num, softmax.input_dtypes, softmax.start_us) == (4, "bfloat16", 30)
    assert (gemm.type, gemm.flops) == ("aten::mm", 2 * 64 * 32 * 16)
    assert gemm.bytes_moved == 4 * (64 * 32 + 32 * 16 + 64 * 16)
    assert gemm.block_num == 4 and gemm.input_shapes == "64,32;32,16"
    # Two kernels share the operator's cost: the one the record costs by name gets its own,
    # the other none (never the operator's whole cost).
    assert dq.type == dkdv.type == "opforge::attention_backward"
    assert (dq.flops, dq.bytes_moved) == (4e5, 6e4) and dkdv.flops is None
    assert nccl.type == "ncclKernel_AllReduce" and nccl.flops is None
    assert [r.wait_us for r in rows] == [0, 5, 0, 5, 1]


def test_plan_records_cost_each_kernel_of_multi_kernel_operators():
    """Operators that launch several Triton kernels name each with its cost in the run
    record: the names are kernels opforge defines, and the kernels' products add up to the
    operator's (the norms' sum of partials aside, which the operator's cost leaves out)."""
    import importlib
    import pkgutil

    import opforge.ops
    from opforge.ops.mla_prolog import mla_inputs
    from opforge.profiler.session import kernel_costs

    kernels = {name for info in pkgutil.iter_modules(opforge.ops.__path__)
               for name, value in vars(importlib.import_module(
                   f"opforge.ops.{info.name}")).items()
               if hasattr(value, "fn") and hasattr(value, "__getitem__")}  # a kernel
    q, k, v = (torch.randn(1, 4, 40, 16) for _ in range(3))
    lse = torch.randn(1, 4, 40)
    x, weight = torch.randn(6, 32), torch.randn(32)
    cases = [("attention_backward", (q, q, k, v, q, lse, None), {}),
             ("rms_norm_backward", (x, x, torch.rand(6), weight), {}),
             ("layer_norm_backward", (x, x, torch.randn(6), torch.rand(6), weight, weight),
              {"normalized_shape": [32]}),
             ("mla_prolog", tuple(mla_inputs(5, torch.float32, "cpu",
                                             torch.Generator().manual_seed(0))), {})]
    # Planned for an H200: long rows and a reduction to four outputs take the split
    # variants; the embedding gradient has an atomic and a deterministic form.
    long_rows, ids = torch.randn(2, 1 << 20), torch.randint(0, 50, (300,))
    cases += [("softmax", (long_rows,), {}), ("log_softmax_backward", (long_rows, long_rows), {}),
              ("reduce_sum", (torch.randn(1 << 16, 4),), {"dims": (0,)}),
              ("embedding_dense_grad", (torch.randn(300, 16), ids),
               {"num_weights": 50, "deterministic": False}),
              ("embedding_dense_grad", (torch.randn(300, 16), ids),
               {"num_weights": 50, "deterministic": True})]
    with opforge.use_backend("triton"), opforge.use_hardware("h200"):
        for op, inputs, attrs in cases:
            plan = opforge.plan(op, *inputs, **attrs)
            costs = kernel_costs(plan)
            assert costs and set(costs) <= kernels, op
            if op == "attention_backward":
                # 4 heads x 40 x 40 pairs, each 7 products of length 16 (S and dP twice,
                # dV, dK, dQ), 2 FLOPs a multiply-add.
                assert sum(c[0] for c in costs.values()) == 2 * 4 * 40 * 40 * 7 * 16
            if op.endswith("norm_backward"):
                assert costs["norm_backward_kernel"][0] == plan.cost.flops
    with opforge.use_backend("torch"):
        assert kernel_costs(opforge.plan("attention_backward", q, q, k, v, q, lse)) == {}


def test_gpu_trace_operators_merge_the_plan_record():
    trace, records = _gpu_trace()
    operators = {o.name: o for o in timeline.operator_rows(timeline.parse([trace], records))}
    assert set(operators) == {"opforge::softmax", "aten::mm", "opforge::attention_backward"}
    softmax = operators["opforge::softmax"]
    assert (softmax.backend, softmax.tiling, softmax.grid) == ("triton", "row BLOCK=256", "4")
    assert softmax.device_self_us == 10 and softmax.host_total_us == 20
    assert operators["opforge::attention_backward"].device_total_us == 11
    assert operators["aten::mm"].device_self_us == 20


def test_step_split_counts_overlap_once():
    trace, records = _gpu_trace()
    (step,) = timeline.step_rows(timeline.parse([trace], records))
    # Compute: [30,40] [45,65] [70,75] [76,82] = 41 us; all-reduce [60,80] = 20 us, of
    # which 14 us overlap compute; busy 47 us of the 100 us step; first kernel at 30 us.
    assert step.step == "1"
    assert step.computing == pytest.approx(41)
    assert step.communication == pytest.approx(20)
    assert step.overlapped == pytest.approx(14)
    assert step.communication_not_overlapped == pytest.approx(6)
    assert step.free == pytest.approx(53)
    assert step.stage == pytest.approx(100)
    assert step.preparing == pytest.approx(30)


@pytest.mark.parametrize(("name", "communication"), [
    ("ncclKernel_AllReduce_RING_LL_Sum_float", True), ("gloo:all_reduce", True),
    ("c10d::allgather_", True), ("HcclAllReduce", True), ("aten::broadcast_to", False),
    ("c10d::broadcast_", True), ("opforge::broadcast_add", False), ("aten::isend", True),
    ("opforge::softmax", False), ("sendrecv_kernel", False)])
def test_communication_kernels_are_recognised(name, communication):
    assert bool(timeline._COMMUNICATION.search(name)) == communication


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(1, 20)), max_size=12))
def test_interval_union_matches_a_pixel_count(spans):
    intervals = [(float(a), float(a + d)) for a, d in spans]
    covered = {t for a, d in spans for t in range(a, a + d)}
    assert timeline._length(timeline._union(intervals)) == len(covered)


def test_trace_view_is_a_valid_chrome_trace(tmp_path):
    trace, records = _gpu_trace()
    parsed = timeline.parse([trace], records)
    rows = timeline.kernel_rows(parsed, "CUDA")
    path = report.write_trace_view(tmp_path / "trace_view.json", parsed, rows, TOY)
    _check_chrome_trace(json.loads(path.read_text()), kernels=5, flows=4)


def _check_chrome_trace(data, kernels=None, flows=None):
    events = data["traceEvents"]
    timed = [e for e in events if e["ph"] != "M"]
    stamps = [e["ts"] for e in timed]
    assert all(isinstance(t, int | float) and not isinstance(t, bool) for t in stamps)
    assert stamps == sorted(stamps) and min(stamps) >= 0
    for event in timed:
        assert {"name", "ph", "pid", "tid", "ts"} <= set(event)
        if event["ph"] == "X":
            assert isinstance(event["dur"], int | float) and event["dur"] >= 0
    starts = {e["id"] for e in timed if e["ph"] == "s"}
    finishes = {e["id"] for e in timed if e["ph"] == "f"}
    assert starts == finishes and all(0 < i < 2**53 for i in starts)
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert {"Python / framework", "Operators", "Kernels"} <= names
    if kernels is not None:
        assert sum(e.get("cat") == "kernel" for e in timed) == kernels
    if flows is not None:
        assert len(starts) == flows


# ---------------------------------------------------------------------------------------------
# A real CPU profile of a small model


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(64, 64)
        self.weight = torch.nn.Parameter(torch.ones(64))

    def forward(self, x):
        return opforge.softmax(opforge.rms_norm(self.linear(x), self.weight), dim=-1)


@pytest.fixture(scope="module")
def cpu_profile(tmp_path_factory):
    """Three steps of a small model on the test device (the CPU's torch backend, or a GPU's
    kernels), the first a warm-up the schedule does not record."""
    out = tmp_path_factory.mktemp("profile")
    model, x = _Model().to(DEVICE), torch.randn(16, 64, device=DEVICE)
    backend = "torch" if DEVICE.type == "cpu" else "triton"
    with opforge.use_backend(backend), opforge.profile(
            out, schedule=torch.profiler.schedule(wait=0, warmup=1, active=2)) as prof:
        for _ in range(3):
            model(x).sum().backward()
            prof.step()
    return out, prof


def test_cpu_profile_writes_every_file(cpu_profile):
    out, _ = cpu_profile
    for name in report.FILES:
        assert (out / name).stat().st_size > 0, name
    headers = {"kernel_details.csv": tables.KERNEL_COLUMNS,
               "operator_details.csv": tables.OPERATOR_COLUMNS,
               "op_statistic.csv": tables.STATISTIC_COLUMNS,
               "step_trace_time.csv": tables.STEP_COLUMNS}
    for name, header in headers.items():
        with (out / name).open(newline="") as handle:
            rows = list(csv.reader(handle))
        assert tuple(rows[0]) == header, name
        assert len(rows) > 1, name
    assert plan_module.set_run_observer(None) is None  # the session removed its observer


def test_cpu_profile_content(cpu_profile):
    out, prof = cpu_profile
    result = prof.result
    assert result is not None and result.meta.device.startswith(DEVICE.type)
    assert [s.step for s in result.steps] == ["1", "2"]  # the warm-up step is not recorded
    rms = [k for k in result.kernels if k.type == "opforge::rms_norm"]
    assert len(rms) == 2 and all(k.core == DEVICE.type.upper() for k in rms)
    expected = opforge.plan("rms_norm", torch.randn(16, 64, device=DEVICE),
                            torch.ones(64, device=DEVICE)).cost
    assert all(k.flops == expected.flops and k.bytes_moved == expected.bytes_moved for k in rms)
    assert rms[0].input_shapes == "16,64;64" and rms[0].output_shapes == "16,64;16"
    assert all(k.verdict(result.hardware).bound != roofline.UNKNOWN for k in rms)
    backward = [k for k in result.kernels if k.type == "opforge::softmax_backward"]
    assert len(backward) == 2
    # The CPU's kernel is the outermost aten::linear; a GPU's gemm belongs to aten::addmm.
    linear = [k for k in result.kernels if k.type in ("aten::linear", "aten::addmm")]
    assert linear and 2 * 16 * 64 * 64 in {k.flops for k in linear}
    stats = result.by_type()
    assert sum(s.ratio for s in stats) == pytest.approx(100, abs=0.1)
    assert sum(s.count for s in stats) == len(result.kernels)
    operators = [o for o in result.operators if o.name == "opforge::softmax"]
    assert operators and operators[0].backend == ("torch" if DEVICE.type == "cpu" else "triton")
    assert "nn.Module: _Model" in operators[0].call_stack
    for step in result.steps:
        assert step.computing + step.free == pytest.approx(step.stage, rel=1e-6)
    owned = sum(1 for k in result.kernels if k.type != k.name or DEVICE.type == "cpu")
    _check_chrome_trace(json.loads((out / "trace_view.json").read_text()),
                        kernels=len(result.kernels), flows=owned)


class _Sections(HTMLParser):
    def __init__(self):
        super().__init__()
        self.sections, self.sources, self.tags = [], [], set()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.add(tag)
        if tag == "section":
            self.sections.append(attrs.get("id"))
        for key in ("src", "href"):
            if key in attrs:
                self.sources.append(attrs[key])


def test_html_report_is_self_contained(cpu_profile):
    out, _ = cpu_profile
    parser = _Sections()
    parser.feed((out / "report.html").read_text())
    assert parser.sections == ["summary", "steps", "top-kernels", "verdicts", "operators",
                               "roofline", "advice"]
    assert parser.sources and all(s.startswith("data:image/png;base64,")
                                  for s in parser.sources)
    assert "link" not in parser.tags and "script" not in parser.tags
    text = (out / "report.html").read_text()
    assert "opforge::rms_norm" in text and "latency-bound" in text


def test_analyse_reads_a_profile_back(cpu_profile):
    out, prof = cpu_profile
    again = analyse(out)
    assert len(again.kernels) == len(prof.result.kernels)
    for mine, read in zip(prof.result.kernels, again.kernels):
        assert (mine.name, mine.type, mine.flops, mine.bytes_moved, mine.block_num) == \
            (read.name, read.type, read.flops, read.bytes_moved, read.block_num)
        assert read.duration_us == pytest.approx(mine.duration_us, abs=1e-3)
    assert [s.type for s in again.by_type()] == [s.type for s in prof.result.by_type()]
    h100 = analyse(out, get_profile("h100"))
    assert h100.hardware.name == "h100"
    slower = {s.type: s.verdict.roofline_pct for s in h100.by_type()}
    for stat in again.by_type():
        if stat.verdict.roofline_pct:
            assert slower[stat.type] < stat.verdict.roofline_pct


def test_analyse_refuses_what_is_not_a_profile(tmp_path):
    with pytest.raises(FileNotFoundError, match="not an opforge profile"):
        analyse(tmp_path)
    assert cli.main(["analyse", str(tmp_path)]) == 2


def test_analyse_refuses_foreign_csv_columns(cpu_profile, tmp_path):
    out, _ = cpu_profile
    for name in ("profile_meta.json", "operator_details.csv", "step_trace_time.csv"):
        (tmp_path / name).write_text((out / name).read_text())
    (tmp_path / "kernel_details.csv").write_text("Name,Duration(us)\nk,1\n")
    with pytest.raises(ValueError, match="columns of an opforge profile"):
        analyse(tmp_path)


def test_a_failing_block_reports_what_ran_before_and_unhooks(tmp_path):
    with pytest.raises(RuntimeError, match="boom"), opforge.profile(tmp_path / "p") as prof:
        opforge.softmax(torch.randn(4, 4))
        raise RuntimeError("boom")
    assert (tmp_path / "p" / "report.html").exists()
    assert any("softmax" in row.name for row in prof.result.operators)
    assert any("raised RuntimeError: boom" in note for note in prof.result.meta.notes)
    assert plan_module.set_run_observer(None) is None


def test_a_failing_block_whose_traces_cannot_be_read_keeps_its_error(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("unreadable trace")
    monkeypatch.setattr(timeline, "load_traces", broken)
    with pytest.raises(RuntimeError, match="boom"), pytest.warns(RuntimeWarning,
                                                                   match="unreadable"), \
            opforge.profile(tmp_path / "p") as prof:
        raise RuntimeError("boom")
    assert prof.result is None


# ---------------------------------------------------------------------------------------------
# The commands


def test_profile_command_runs_a_script(tmp_path, monkeypatch, capsys):
    out = tmp_path / "prof"
    argv = sys.argv
    code = cli.main(["profile", "--out", str(out), "--", "python", str(EXAMPLE), "--steps",
                     "2", "--batch", "2", "--seq", "16", "--dim", "32", "--heads", "2",
                     "--hidden", "32", "--layers", "1", "--device", "cpu"])
    assert code == 0 and sys.argv is argv
    printed = capsys.readouterr().out
    assert "step 1: loss" in printed and "Top kernels" in printed
    result = analyse(out)
    assert {k.type for k in result.kernels} >= {
        "opforge::attention", "opforge::attention_backward", "opforge::matmul",
        "opforge::rope", "opforge::rms_norm", "opforge::moe_gating_top_k",
        "opforge::embedding_dense_grad"}
    assert cli.main(["analyse", str(out), "--top", "3"]) == 0


def test_profile_command_passes_the_exit_status(tmp_path, capsys):
    script = tmp_path / "fails.py"
    script.write_text("import sys\nsys.exit(3)\n")
    assert cli.main(["profile", "--out", str(tmp_path / "p"), "--", str(script)]) == 3
    assert (tmp_path / "p" / "report.html").exists()
    assert cli.main(["profile", "--out", str(tmp_path / "q"), "--", "python"]) == 2
    assert "give the script" in capsys.readouterr().out
    # sys.exit("message"): like Python, the message goes to stderr and the status is 1.
    script.write_text("import sys\nsys.exit('fatal: bad config')\n")
    assert cli.main(["profile", "--out", str(tmp_path / "p"), "--", str(script)]) == 1
    assert "fatal: bad config" in capsys.readouterr().err
    # A script that raises: its traceback, status 1, and the profile of what ran before.
    script.write_text("import torch, opforge\nopforge.softmax(torch.randn(4, 4))\n"
                      "raise KeyError('missing weight')\n")
    assert cli.main(["profile", "--out", str(tmp_path / "r"), "--", str(script)]) == 1
    captured = capsys.readouterr()
    assert "KeyError: 'missing weight'" in captured.err and "Traceback" in captured.err
    assert "raised KeyError" in captured.out and "profile written" in captured.out
    meta = json.loads((tmp_path / "r" / "profile_meta.json").read_text())
    assert any("raised KeyError" in note for note in meta["notes"])


def test_bench_measures_opforge_against_torch(tmp_path):
    results, files = bench.run(["softmax", "broadcast_add"], device="cpu", dtype=torch.float32,
                               out_dir=tmp_path, shapes=[(8, 33), (32, 65)], compile=False,
                               progress=False)
    assert {(r.op, r.shape, r.impl) for r in results} == {
        (op, shape, impl) for op in ("softmax", "broadcast_add") for shape in ("8x33", "32x65")
        for impl in ("opforge", "torch")}
    for r in results:
        assert not r.error and r.ms > 0
        assert r.gbs == pytest.approx(r.bytes_moved / (r.ms * 1e-3) / 1e9)
        if r.impl == "torch":
            assert r.speedup == pytest.approx(1.0)
    softmax = next(r for r in results if r.op == "softmax" and r.shape == "32x65")
    cost = opforge.plan("softmax", torch.randn(32, 65)).cost
    assert softmax.bytes_moved == cost.bytes_moved and softmax.flops == cost.flops
    names = sorted(p.name for p in files)
    assert "bench_softmax.png" in names and "bench_broadcast_add.png" in names
    assert any(n.endswith(".csv") for n in names) and any(n.endswith(".md") for n in names)
    with pytest.raises(ValueError, match="no benchmark sweep"):
        bench.bench_op("softmax_backward", device=torch.device("cpu"), dtype=torch.float32)


def test_bench_command(tmp_path, capsys):
    code = cli.main(["bench", "rms_norm", "--device", "cpu", "--dtype", "float32", "--shapes",
                     "4x64", "--out", str(tmp_path), "--no-compile", "--quiet"])
    assert code == 0
    assert "rms_norm" in capsys.readouterr().out
    assert (tmp_path / "bench_rms_norm.png").exists()


def test_every_benchmarked_operator_builds_its_cpu_case():
    for name in bench.benchmarked_ops():
        opdef = opforge.get_op(name)
        case = bench.case_at(opdef, opdef.bench, opdef.bench.cpu_shapes[0], torch.float32,
                           torch.device("cpu"))
        planned = opforge.plan(opdef, *case.inputs, **case.attrs)
        assert planned.cost.bytes_moved > 0 and math.isfinite(planned.cost.flops)
        assert opdef.precision.peer is not None


# torch warns that the profiler's global module hooks also fire for the OptimizedModule
# wrapper: the profile gains one more `nn.Module: OptimizedModule` scope, nothing else.
@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global hooks")
def test_compilation_inside_a_profile_is_left_out(tmp_path):
    model = torch.compile(_Model(), fullgraph=True)
    x = torch.randn(16, 64)
    with opforge.use_backend("torch"), opforge.profile(tmp_path) as prof:
        for _ in range(2):
            model(x).sum().backward()
            prof.step()
    result = prof.result
    assert [k.type for k in result.kernels].count("opforge::rms_norm") == 2
    assert any("torch.compile compiled" in note for note in result.meta.notes)
    assert not any("dynamo" in o.call_stack for o in result.operators)


def test_bench_command_refuses_bad_requests(tmp_path, capsys):
    assert cli.main(["bench", "softmax_backward", "--device", "cpu", "--out", str(tmp_path),
                     "--quiet"]) == 2
    assert "no benchmark sweep" in capsys.readouterr().out
    assert cli.main(["bench", "no_such_op", "--out", str(tmp_path), "--quiet"]) == 2
    for shapes in ("4xa", "0x8"):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["bench", "softmax", "--shapes", shapes])
        assert exit_.value.code == 2


def test_profile_command_runs_a_module(tmp_path, monkeypatch, capsys):
    (tmp_path / "profiled_module.py").write_text(
        "import sys, torch, opforge\n"
        "print('args', sys.argv[1:])\n"
        "opforge.softmax(torch.randn(8, 8), dim=-1)\n")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["profile", "--out", str(tmp_path / "p"), "--", "python", "-m",
                     "profiled_module", "x", "y"]) == 0
    assert "args ['x', 'y']" in capsys.readouterr().out
    assert "opforge::softmax" in {k.type for k in analyse(tmp_path / "p").kernels}


def test_a_nested_profile_defers_to_the_outer_one(tmp_path):
    """torch's profiler cannot nest: the inner session warns and records nothing itself,
    and the outer one records the whole block."""
    with opforge.profile(tmp_path / "outer") as outer:
        opforge.softmax(torch.randn(4, 4))
        with pytest.warns(RuntimeWarning, match="already recording"), \
                opforge.profile(tmp_path / "inner") as inner:
            assert inner.nested
            opforge.rms_norm(torch.randn(4, 4))
            inner.step()
    assert inner.result is None and not (tmp_path / "inner" / "report.html").exists()
    assert {"opforge::softmax", "opforge::rms_norm"} <= {k.type for k in outer.result.kernels}
    with torch.profiler.profile(), pytest.warns(RuntimeWarning, match="already recording"), \
            opforge.profile(tmp_path / "under_torch") as under:
        opforge.softmax(torch.randn(4, 4))
    assert under.result is None


def test_memory_profile_pairs_allocations_with_releases(tmp_path):
    """A 256 KiB softmax output, allocated inside the operator and released when dropped;
    a second one still held when the profile ends."""
    x = torch.randn(256, 256)
    with opforge.use_backend("torch"), opforge.profile(tmp_path, profile_memory=True) as prof:
        first = opforge.softmax(x, dim=-1)
        del first
        kept = opforge.softmax(x, dim=-1)
    rows = [r for r in prof.result.memory if r.size_kb == 256.0]
    assert len(rows) >= 2
    released = [r for r in rows if r.release_us is not None]
    assert released and released[0].duration_us > 0
    assert released[0].release_total_allocated_mb < released[0].allocation_total_allocated_mb
    assert any(r.release_us is None for r in rows)
    assert all(r.name and r.device == "CPU" for r in rows)
    assert any("peak" in line for line in prof.result.summary_lines())
    again = analyse(tmp_path)
    assert [(r.name, r.size_kb) for r in again.memory] == \
        [(r.name, r.size_kb) for r in prof.result.memory]
    page = _Sections()
    page.feed((tmp_path / "report.html").read_text())
    assert page.sections[-1] == "memory"
    assert kept.shape == x.shape


def test_wait_steps_keep_no_records(tmp_path):
    """Calls made while the schedule waits leave no plan record behind."""
    x = torch.randn(8, 8)
    with opforge.profile(tmp_path, schedule=torch.profiler.schedule(
            wait=3, warmup=1, active=1)) as prof:
        for _ in range(5):
            opforge.softmax(x, dim=-1)
            prof.step()
    assert len(prof._records) <= 2
    assert [k.type for k in prof.result.kernels].count("opforge::softmax") == 1


# ---------------------------------------------------------------------------------------------
# Costs of torch's operators in a real CPU profile, against the tensors they made

F = torch.nn.functional


def _torch_calls():
    """(kernel name, call, the tensors it reads, or None for a view that moves nothing)."""
    x, w, w4 = torch.randn(2, 3, 16, 16), torch.randn(6, 3, 3, 3), torch.randn(6, 3, 4, 4)
    logits, target = torch.randn(8, 3), torch.randint(0, 3, (8,))
    a, b = torch.randn(24, 40), torch.randn(4, 5, 7)
    at, xb, two = a.t(), torch.randn(8, 8, dtype=torch.bfloat16), torch.tensor(2.0)
    return [
        ("aten::conv2d", lambda: F.conv2d(x, w, padding="same"), (x, w)),
        ("aten::conv2d", lambda: F.conv2d(x, w, padding="valid"), (x, w)),
        ("aten::conv2d", lambda: F.conv2d(x, w4, padding="same"), (x, w4)),
        ("aten::cross_entropy_loss", lambda: F.cross_entropy(logits, target), (logits, target)),
        ("aten::cross_entropy_loss", lambda: F.cross_entropy(logits, target, reduction="none"),
         (logits, target)),
        ("aten::mul", lambda: xb * two, (xb, two)),
        ("aten::randint", lambda: torch.randint(0, 3, (8,)), ()),
        ("aten::randint", lambda: torch.randint(5, (4, 2), dtype=torch.int32), ()),
        ("aten::zeros", lambda: torch.zeros(3, 5, dtype=torch.bfloat16), ()),
        # full's dtype follows its fill value when none is given.
        ("aten::full", lambda: torch.full((3, 5), 7), ()),
        ("aten::full", lambda: torch.full((3, 5), True), ()),
        ("aten::full", lambda: torch.full((3, 5), 2.5), ()),
        ("aten::full", lambda: torch.full((3, 5), 2, dtype=torch.float16), ()),
        # Copies: the source read, the result written.
        ("aten::to", lambda: a.to(torch.bfloat16), (a,)),
        ("aten::contiguous", lambda: at.contiguous(), (at,)),
        ("aten::reshape", lambda: at.reshape(-1), (at,)),
        ("aten::flatten", lambda: at.flatten(), (at,)),
        ("aten::type_as", lambda: a.type_as(xb), (a,)),
        # The same operators when the layout or dtype allows a view, and views.
        ("aten::to", lambda: a.to(torch.float32), None),
        ("aten::reshape", lambda: a.reshape(-1), None),
        ("aten::flatten", lambda: a.flatten(), None),
        *((f"aten::{name}", lambda name=name: getattr(b, name), None)
          for name in ("mT", "mH")),
        ("aten::numpy_T", lambda: a.T, None),
        ("aten::matrix_H", lambda: a.H, None),
        ("aten::adjoint", lambda: b.adjoint(), None),
        ("aten::movedim", lambda: b.movedim(0, 2), None),
        ("aten::swapaxes", lambda: b.swapaxes(0, 1), None),
    ]


@pytest.fixture(scope="module")
def torch_ops_profile(tmp_path_factory):
    calls = _torch_calls()
    outputs = [call() for _, call, _ in calls]
    with opforge.profile(tmp_path_factory.mktemp("torch_ops")) as prof:
        for _, call, _ in calls:
            call()
    return calls, outputs, prof.result


def test_torch_operator_costs_match_the_tensors_they_made(torch_ops_profile):
    """On the CPU each call is one kernel; its bytes are what it read and wrote (a copying
    `to`/`contiguous`/`reshape` costs its copy; a view nothing), its output shape the real
    one: string paddings, losses, a 0-dim operand, randint's size and dtype."""
    calls, outputs, result = torch_ops_profile
    # "same" for a 4-wide kernel: 1 on each side by the convolution, 1 more after by a pad.
    x_padded = F.pad(torch.randn(2, 3, 16, 16), (0, 1, 0, 1))
    assert [k.name for k in result.kernels] == [name for name, _, _ in calls]
    for kernel, (name, _, reads), out in zip(result.kernels, calls, outputs):
        if reads is None:
            assert (kernel.flops, kernel.bytes_moved) == (0, 0), name
            continue
        # An even kernel's "same" padding is a padded copy of x (written, then read).
        padded = (2 * x_padded.nbytes if name == "aten::conv2d" and reads[1].shape[-1] == 4
                  else 0)
        assert kernel.bytes_moved == sum(t.nbytes for t in reads) + out.nbytes + padded, name
        assert kernel.output_shapes == ",".join(str(d) for d in out.shape), name
        verdict = kernel.verdict(result.hardware)
        assert verdict.bound != roofline.UNKNOWN and verdict.gbs > 0, name
        assert "moves no data" not in roofline.advice(verdict, result.hardware,
                                                      kernel.duration_us, None), name
        if name == "aten::conv2d":
            # 2 x output elements x input channels x kernel elements
            assert kernel.flops == 2 * out.numel() * 3 * reads[1][0, 0].numel()


def test_a_copy_below_an_unshaped_call_is_unknown():
    """A composite operator whose copy was recorded without shapes has no known cost: never
    the zero of a view."""
    events = [_x("aten::to", "cpu_op", 0, 10),
              _x("aten::_to_copy", "cpu_op", 1, 8),
              _x("aten::copy_", "cpu_op", 2, 6),
              _x("aten::reshape", "cpu_op", 20, 5),
              _x("aten::view", "cpu_op", 21, 2, **{"Input Dims": [[4, 4], []],
                                                   "Input type": ["float", "ScalarList"]})]
    rows = timeline.kernel_rows(timeline.parse([{"traceEvents": events}], {}), "CPU")
    assert [(r.name, r.flops, r.bytes_moved) for r in rows] == [
        ("aten::to", None, None), ("aten::reshape", 0, 0)]


# ---------------------------------------------------------------------------------------------
# Sessions: Python frames, re-entry, stale files, hardware by name


def _opforge_calls():
    x = torch.randn(8, 32, requires_grad=True)
    weight = torch.ones(32)
    y = opforge.layer_norm(opforge.gelu(x), (32,), weight)
    y.sum().backward()


@pytest.mark.parametrize("with_stack", [False, True])
def test_each_opforge_call_is_one_operator_with_its_record(tmp_path, with_stack):
    """With Python frames between the dispatcher's event and the plan's annotation, the two
    still merge: one row per call, the plan's cost, and host self time without the callees'."""
    with opforge.use_backend("torch"), opforge.profile(tmp_path, with_stack=with_stack) as prof:
        _opforge_calls()
    rows = [o for o in prof.result.operators if o.name.startswith("opforge::")]
    assert sorted(o.name for o in rows) == sorted(
        f"opforge::{n}" for n in ("gelu", "layer_norm", "layer_norm_backward", "gelu_backward"))
    gelu = opforge.plan("gelu", torch.randn(8, 32)).cost
    for row in rows:
        assert row.backend == "torch" and row.flops is not None
        # The torch backend calls aten operators: their time is not the operator's own.
        assert row.host_self_us < row.host_total_us, row.name
    assert next(o.flops for o in rows if o.name == "opforge::gelu") == gelu.flops


def test_a_session_entered_twice_reports_each_block(tmp_path):
    session = opforge.profile(tmp_path)
    with session:
        opforge.softmax(torch.randn(4, 8), dim=-1)
    with session:
        opforge.gelu(torch.randn(4, 8))
    types = {k.type for k in session.result.kernels}
    assert "opforge::gelu" in types and "opforge::softmax" not in types
    assert {k.type for k in analyse(tmp_path).kernels} == types


def test_a_profile_without_memory_removes_the_previous_memory_file(tmp_path):
    x = torch.randn(64, 64)
    with opforge.profile(tmp_path, profile_memory=True):
        opforge.softmax(x, dim=-1)
    assert analyse(tmp_path).memory
    with opforge.profile(tmp_path):
        torch.relu(x)
    assert not (tmp_path / "operator_memory.csv").exists()
    assert analyse(tmp_path).memory == []


def test_profile_takes_a_hardware_profile_by_name(tmp_path):
    with opforge.profile(tmp_path, hardware="h100") as prof:
        opforge.softmax(torch.randn(4, 8), dim=-1)
    assert prof.result.hardware.name == "h100"
    ran = []
    with pytest.raises(AttrError, match="unknown hardware profile"), \
            opforge.profile(tmp_path / "bad", hardware="h1000"):
        ran.append(True)
    assert not ran and not (tmp_path / "bad").exists()


# ---------------------------------------------------------------------------------------------
# Calibration


@pytest.fixture
def calibration_dir(tmp_path, monkeypatch):
    """A calibration cache of its own; the profiles cached from it are dropped after."""
    monkeypatch.setenv("OPFORGE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("OPFORGE_HARDWARE", raising=False)
    hardware._runtime_profiles.clear()
    yield tmp_path
    hardware._runtime_profiles.clear()


def test_calibration_scales_the_dtypes_it_did_not_measure(calibration_dir):
    nominal = hardware._cpu_profile()
    measured = nominal.peak(torch.float32) / 7
    (calibration_dir / "calibration.json").write_text(json.dumps({"cpu:cpu": {
        "memory_bandwidth": 3e9, "peak_flops": {"float32": measured}}}))
    calibrated = get_profile("cpu")
    assert calibrated.source == "calibrated" and calibrated.memory_bandwidth == 3e9
    assert calibrated.peak(torch.float32) == measured
    for dtype, peak in nominal.peak_flops.items():
        ratio = peak / nominal.peak(torch.float32)
        assert calibrated.peak(dtype) == pytest.approx(measured * ratio), dtype
    assert hardware.profile_for("cpu").peak_flops == calibrated.peak_flops


def test_calibrate_rewrites_a_corrupt_cache(calibration_dir):
    path = calibration_dir / "calibration.json"
    path.write_text("{not json")
    assert get_profile("cpu").source == "estimate"  # read as no calibration
    entry = hardware.calibrate("cpu", copy_bytes=1 << 20, matmul_size=32, repeats=1)
    assert json.loads(path.read_text())["cpu:cpu"]["peak_flops"] == entry["peak_flops"]
    assert get_profile("cpu").source == "calibrated"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_calibrate_refuses_a_missing_device(calibration_dir, capsys):
    with pytest.raises(DeviceError, match="cuda"):
        hardware.calibrate("cuda")
    assert cli.main(["calibrate", "--device", "cuda"]) == 2
    assert "error" in capsys.readouterr().out
    assert not (calibration_dir / "calibration.json").exists()


# ---------------------------------------------------------------------------------------------
# opforge bench with sizes an operator does not take


def test_bench_reports_sizes_an_operator_cannot_take_and_runs_the_others(tmp_path, capsys):
    results, files = bench.run(["matmul", "softmax"], device="cpu", dtype=torch.float32,
                               out_dir=tmp_path, shapes=[(8, 33)], compile=False,
                               progress=False)
    (refused,) = [r for r in results if r.op == "matmul"]
    assert refused.ms is None and bench.shape_form(opforge.get_op("matmul").bench) in \
        refused.error and "8x33" in refused.error
    assert {r.impl for r in results if r.op == "softmax" and r.ms} == {"opforge", "torch"}
    names = {p.name for p in files}
    assert "bench_softmax.png" in names and "bench_matmul.png" not in names
    csv_path = next(p for p in files if p.suffix == ".csv")
    assert {row["op"] for row in csv.DictReader(csv_path.open())} == {"matmul", "softmax"}
    # The command says why, and fails with 2 when no size of any operator could run.
    assert cli.main(["bench", "matmul", "--shapes", "16x16", "--device", "cpu", "--out",
                     str(tmp_path), "--no-compile", "--quiet"]) == 2
    assert "matmul takes sizes of 1 number, like 256" in capsys.readouterr().out
