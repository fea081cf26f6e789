"""opforge verify: the sweep over precision.cases, judging by each OpDef's standard against
torch's operator, known limitations, and the committed precision certificate."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest
import torch

import opforge
from opforge.core.opdef import KnownLimitation
from opforge.precision.cases import KINDS
from opforge.precision.metrics import compare_tensors
from opforge.precision.standards import CATEGORIES, LEVELS, judge
from opforge.precision.verify import (
    LONG_ROWS_SHAPE,
    SWEEP_SHAPES,
    read_certificate,
    rounded_range,
    summarize,
    verification_cases,
    verify,
    write_report,
)

CERTIFICATE = Path(__file__).resolve().parents[1] / "docs" / "precision-certificate.md"


@pytest.mark.parametrize("op", opforge.list_ops(), ids=lambda op: op.name)
def test_every_operator_declares_a_standard_and_a_peer(op):
    spec = op.precision
    assert spec.category in CATEGORIES and spec.level in LEVELS
    assert spec.peer is not None and spec.peer.__doc__
    for limitation in spec.known_limitations:
        assert len(limitation.reason) > 40


# Operators whose sweep takes one shape, with why.
ONE_SHAPE_SWEEPS = {
    "fused_linear_cross_entropy": "up to four products a block through the interpreter: every "
                                  "shape would add minutes to the certificate",
    "fused_linear_cross_entropy_backward": "as its forward"}


@pytest.mark.parametrize("op", [op for op in opforge.list_ops()
                                if op.name not in ONE_SHAPE_SWEEPS], ids=lambda op: op.name)
def test_sweep_covers_every_kind_and_shape(op):
    cases = verification_cases(op, torch.float16, case_sets=("sweep",))
    names = [case.name for case in cases]
    assert len(names) == len(set(names))
    for kind in KINDS:
        assert any(name.startswith(kind) for name in names), kind
    for shape in SWEEP_SHAPES:
        assert any(f"_{'x'.join(map(str, shape))}" in name for name in names), shape
    assert any("_3x65537" in name for name in names) and LONG_ROWS_SHAPE == (3, 1)
    for case in cases:
        assert all(t is None or t.dtype == torch.float16 or torch.float16 not in arg.dtypes
                   for t, arg in zip(case.inputs, op.inputs))
    # Deterministic: the same seed gives the same tensors.
    again = verification_cases(op, torch.float16, case_sets=("sweep",))
    assert all(torch.equal(a.nan_to_num(), b.nan_to_num())
               for x, y in zip(cases, again) for a, b in zip(x.inputs, y.inputs)
               if a is not None)


def test_unknown_case_set():
    with pytest.raises(ValueError, match="case set"):
        verification_cases(opforge.get_op("sigmoid"), torch.float32, case_sets=("all",))


def test_goldens_beyond_the_range_count_as_inf():
    golden = torch.tensor([1e39, -1e39, 3.0e38, float("nan")], dtype=torch.float64)
    rounded = rounded_range(golden, torch.float32)
    assert rounded[:2].tolist() == [float("inf"), float("-inf")]
    assert rounded[2] == 3.0e38 and rounded[3].isnan()
    assert rounded_range(golden, torch.float16)[2] == float("inf")


def _planted(monkeypatch, replace_launcher, op_name, limitation=None, output=0):
    """Make the operator's Triton path wrong by 1% on every element of one output."""
    op = opforge.get_op(op_name)
    launch = op.launchers["triton"]

    def wrong(plan, inputs, outputs, workspace):
        launch(plan, inputs, outputs, workspace)
        outputs[output].mul_(1.01)

    replace_launcher(op, "triton", wrong)
    if limitation is not None:
        spec = dataclasses.replace(op.precision, known_limitations=(limitation,))
        monkeypatch.setattr(op, "precision", spec)
    return op


def test_a_planted_error_fails_its_standard(monkeypatch, replace_launcher):
    op = _planted(monkeypatch, replace_launcher, "sigmoid")
    results = verify([op], [torch.float16], ["torch", "triton"], case_sets=("samples",))
    by_backend = {b: {r.status for r in results if r.backend == b} for b in ("torch", "triton")}
    assert by_backend["torch"] == {"pass"}
    triton = [r for r in results if r.backend == "triton" and r.case != "zero_size"]
    assert {r.status for r in triton} == {"fail"}
    assert all(any(reason.startswith("rmse ratio") for reason in r.reasons) for r in triton)


def test_known_limitations_excuse_only_the_cases_they_name(monkeypatch, replace_launcher):
    reason = "a planted one-percent error, for this test only; never silent in the report"
    limitation = KnownLimitation(reason, case="rows_*", backend="triton")
    op = _planted(monkeypatch, replace_launcher, "sigmoid", limitation)
    results = verify([op], [torch.float16], ["triton"], case_sets=("samples",))
    statuses = {r.case: r.status for r in results}
    assert statuses["rows_63x1000"] == "known"
    assert statuses["randn_4097"] == "fail"
    assert next(r for r in results if r.status == "known").detail == reason


def test_errors_in_a_case_are_recorded_not_raised(replace_launcher):
    op = opforge.get_op("sigmoid")

    def broken(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    replace_launcher(op, "triton", broken)
    results = verify([op], [torch.float32], ["triton"], case_sets=("samples",))
    assert {r.status for r in results if r.case != "zero_size"} == {"error"}
    assert "kernel exploded" in results[0].detail


def test_progress_reports_the_total_first_then_each_case():
    calls = []
    verify([opforge.get_op("sigmoid")], [torch.float32], ["torch"], case_sets=("samples",),
           progress=lambda total, result: calls.append((total, result)))
    assert calls[0][1] is None
    assert len(calls) == calls[0][0] + 1 and all(r is not None for _, r in calls[1:])


def test_the_committed_certificate_is_current_and_complete():
    """docs/precision-certificate.md is generated by `make certificate`; it names every
    operator with its standard, has no failures, and explains each known limitation."""
    text = CERTIFICATE.read_text()
    summary = re.search(r"\*\*(\d+) cases: (\d+) pass, (\d+) warning, (\d+) known limitation, "
                        r"(\d+) fail, (\d+) error, (\d+) skipped\.\*\*", text)
    assert summary, "summary line missing"
    total, passed, warned, known, failed, errors, skipped = map(int, summary.groups())
    assert failed == errors == skipped == 0 and total == passed + warned + known
    assert "case sets: samples, sweep" in text
    for op in opforge.list_ops():
        spec = op.precision
        assert f"| {op.name} | {spec.category} | {spec.level} |" in text, op.name
        for backend in ("torch", "triton"):
            for dtype in ("float32", "float16", "bfloat16"):
                assert f"| {op.name} | {backend} | {dtype} |" in text
        for limitation in spec.known_limitations:
            assert limitation.reason in text
    assert CERTIFICATE.with_suffix(".png").exists()
    # Each known case is attributed to the one limitation that decided it.
    known_by_op: dict[str, int] = {}
    for row in read_certificate(CERTIFICATE).rows:
        known_by_op[row["op"]] = known_by_op.get(row["op"], 0) + int(row["known"])
    attributed: dict[str, int] = {}
    for op, count in re.findall(r"^- \*\*(\w+)\*\* .* (\d+) case\(s\) here", text, re.M):
        attributed[op] = attributed.get(op, 0) + int(count)
    assert {op: n for op, n in attributed.items() if n} == {
        op: n for op, n in known_by_op.items() if n}


def test_a_sweep_case_has_the_same_inputs_in_any_selection():
    op = opforge.get_op("sigmoid")
    alone = verification_cases(op, torch.float32, case_sets=("sweep",))
    together = verification_cases(op, torch.float32, case_sets=("samples", "sweep"))
    by_name = {case.name: case for case in together}
    assert alone and all(torch.equal(case.inputs[0], by_name[case.name].inputs[0])
                         for case in alone)
    other = verification_cases(op, torch.float32, seed=1, case_sets=("sweep",))
    assert not torch.equal(other[0].inputs[0], alone[0].inputs[0])


def test_a_failing_output_of_several_is_named(monkeypatch, replace_launcher):
    """Reasons and the worst element say which output missed: rstd here."""
    op = _planted(monkeypatch, replace_launcher, "rms_norm", output=1)
    results = verify([op], [torch.float32], ["triton"], case_sets=("samples",))
    failed = [r for r in results if r.status == "fail"]
    assert failed and all(reason.endswith("[rstd]") for r in failed for reason in r.reasons)
    assert all(" of rstd:" in r.detail for r in failed)


def test_an_all_zero_golden_tolerates_a_negligible_error():
    golden = torch.zeros(64, dtype=torch.float64)
    ours = torch.zeros(64)
    ours[0] = 1e-40
    verdict = judge(compare_tensors(ours, golden), torch.float32, "benchmark_ratio",
                    peer=compare_tensors(torch.zeros(64), golden), level="L2")
    assert verdict.status == "pass", verdict.reasons
    ours[0] = 1e-3
    verdict = judge(compare_tensors(ours, golden), torch.float32, "benchmark_ratio",
                    peer=compare_tensors(torch.zeros(64), golden), level="L2")
    assert verdict.status != "pass"


def test_skipped_cases_are_not_figures_and_the_json_is_strict(tmp_path, monkeypatch):
    from opforge.precision import verify as verify_module

    monkeypatch.setattr(verify_module, "backend_refusal",
                        lambda backend, device: "refused for this test" if backend == "triton"
                        else None)
    op = opforge.get_op("softmax")
    results = verify([op], [torch.float32], ["torch", "triton"], case_sets=("samples",))
    rows = {row["backend"]: row for row in summarize(results)}
    assert rows["triton"]["status"] == "skip" and rows["triton"]["category"] == "benchmark_ratio"
    assert math.isnan(rows["triton"]["max_rel"]) and not math.isnan(rows["torch"]["max_rel"])
    write_report(results, tmp_path, [op])

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")
    json.loads((tmp_path / "verify.json").read_text(), parse_constant=refuse)


@pytest.mark.parametrize("device", ["cuda:99", "nosuchdevice"])
def test_an_unusable_device_exits_2_with_one_line(device, capsys):
    from opforge.cli import main

    assert main(["verify", "sigmoid", "--device", device, "--quiet"]) == 2
    out = capsys.readouterr().out.strip()
    assert out.startswith("error:") and device in out and "\n" not in out, out
