"""opforge verify: the sweep over precision.cases, judging by each OpDef's standard against
torch's operator, known limitations, and the committed precision certificate."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

import opforge
from opforge.core.opdef import KnownLimitation
from opforge.precision.cases import KINDS
from opforge.precision.standards import CATEGORIES, LEVELS
from opforge.precision.verify import (
    LONG_ROWS_SHAPE,
    SWEEP_SHAPES,
    rounded_range,
    verification_cases,
    verify,
)

CERTIFICATE = Path(__file__).resolve().parents[1] / "docs" / "precision-certificate.md"


@pytest.mark.parametrize("op", opforge.list_ops(), ids=lambda op: op.name)
def test_every_operator_declares_a_standard_and_a_peer(op):
    spec = op.precision
    assert spec.category in CATEGORIES and spec.level in LEVELS
    assert spec.peer is not None and spec.peer.__doc__
    for limitation in spec.known_limitations:
        assert len(limitation.reason) > 40


@pytest.mark.parametrize("op", opforge.list_ops(), ids=lambda op: op.name)
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


def _planted(monkeypatch, op_name, limitation=None):
    """Make the operator's Triton path wrong by 1% on every element."""
    op = opforge.get_op(op_name)
    launch = op.launchers["triton"]

    def wrong(plan, inputs, outputs, workspace):
        launch(plan, inputs, outputs, workspace)
        outputs[0].mul_(1.01)

    monkeypatch.setitem(op.launchers, "triton", wrong)
    if limitation is not None:
        spec = dataclasses.replace(op.precision, known_limitations=(limitation,))
        monkeypatch.setattr(op, "precision", spec)
    return op


def test_a_planted_error_fails_its_standard(monkeypatch):
    op = _planted(monkeypatch, "sigmoid")
    results = verify([op], [torch.float16], ["torch", "triton"], case_sets=("samples",))
    by_backend = {b: {r.status for r in results if r.backend == b} for b in ("torch", "triton")}
    assert by_backend["torch"] == {"pass"}
    triton = [r for r in results if r.backend == "triton" and r.case != "zero_size"]
    assert {r.status for r in triton} == {"fail"}
    assert all(any(reason.startswith("rmse ratio") for reason in r.reasons) for r in triton)


def test_known_limitations_excuse_only_the_cases_they_name(monkeypatch):
    reason = "a planted one-percent error, for this test only; never silent in the report"
    op = _planted(monkeypatch, "sigmoid", KnownLimitation(reason, case="rows_*",
                                                          backend="triton"))
    results = verify([op], [torch.float16], ["triton"], case_sets=("samples",))
    statuses = {r.case: r.status for r in results}
    assert statuses["rows_63x1000"] == "known"
    assert statuses["randn_4097"] == "fail"
    assert next(r for r in results if r.status == "known").detail == reason


def test_errors_in_a_case_are_recorded_not_raised(monkeypatch):
    op = opforge.get_op("sigmoid")

    def broken(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    monkeypatch.setitem(op.launchers, "triton", broken)
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


@pytest.mark.parametrize("device", ["cuda:99", "nosuchdevice"])
def test_an_unusable_device_exits_2_with_one_line(device, capsys):
    from opforge.cli import main

    assert main(["verify", "sigmoid", "--device", device, "--quiet"]) == 2
    out = capsys.readouterr().out.strip()
    assert out.startswith("error:") and device in out and "\n" not in out, out
