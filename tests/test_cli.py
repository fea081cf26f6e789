"""The opforge command: ops, verify (table, report, exit code), doctor."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from opforge.cli import main


def test_ops_lists_every_operator(capsys):
    assert main(["ops"]) == 0
    text = capsys.readouterr().out
    for name in ("broadcast_add", "gelu", "sigmoid", "reduce_sum", "approximate", "bfloat16"):
        assert name in text


def test_verify_writes_a_report(tmp_path, capsys):
    assert main(["verify", "sigmoid", "gelu", "--dtype", "float32", "--dtype", "bfloat16",
                 "--report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "sigmoid" in out and "0 failed" in out
    cases = json.loads((tmp_path / "verify.json").read_text())["cases"]
    assert {c["backend"] for c in cases} == {"torch", "triton"}
    assert all(c["status"] == "pass" for c in cases)
    assert "| gelu | triton | bfloat16 |" in (tmp_path / "verify.md").read_text()


def test_verify_fails_with_non_zero_exit(monkeypatch, capsys):
    import opforge

    op = opforge.get_op("sigmoid")
    monkeypatch.setattr(op, "reference_fn", lambda x, *, compute_dtype: x.to(compute_dtype))
    assert main(["verify", "sigmoid", "--backend", "triton", "--dtype", "float32"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_verify_unknown_operator(capsys):
    assert main(["verify", "softplus"]) == 2
    assert "softplus" in capsys.readouterr().out


def test_doctor(capsys):
    assert main(["doctor"]) == 0
    text = capsys.readouterr().out
    for fragment in ("torch", "triton", "TRITON_INTERPRET", "hardware profile"):
        assert fragment in text


@pytest.mark.slow
def test_verify_turns_the_interpreter_on_by_itself(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "opforge", "verify", "broadcast_add",
                           "--backend", "triton", "--dtype", "float16"],
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "triton" in done.stdout and "0 failed" in done.stdout


@pytest.mark.slow
def test_compile_check_builds_every_kernel_variant_for_sm90():
    """Every kernel variant the samples launch (and its int64-offset twin) compiles to
    cubin for compute capability 9.0, tiled for an H100, without a GPU."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "opforge", "compile-check", "--dtype",
                           "bfloat16"], env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for kernel in ("_elementwise_kernel", "_reduce_rows_kernel", "_reduce_partials_kernel"):
        assert kernel in done.stdout
    assert "WIDE=True" in done.stdout and " 0 failed" in done.stdout


def test_compile_check_needs_compiled_kernels():
    import torch

    import opforge
    from opforge.aot import parse_target, record_variants

    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        record_variants([opforge.get_op("sigmoid")], [torch.float32],
                        opforge.core.hardware.get_profile("h100"))
    with pytest.raises(ValueError, match="cuda:<cc>"):
        parse_target("gfx942")
    assert parse_target("cuda:80")[1].name == "a100"
