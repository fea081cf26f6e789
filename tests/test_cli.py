"""The opforge command: ops, verify (table, report, exit code), doctor."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from opforge.cli import main

from .conftest import needs_descriptors


def test_ops_lists_every_operator(capsys):
    assert main(["ops"]) == 0
    text = capsys.readouterr().out
    for name in ("broadcast_add", "gelu", "sigmoid", "reduce_sum", "approximate", "bfloat16",
                 "benchmark_ratio L2", "absolute L0"):
        assert name in text


def test_verify_writes_a_report(tmp_path, capsys):
    certificate = tmp_path / "docs" / "certificate.md"
    assert main(["verify", "sigmoid", "gelu", "--dtype", "float32", "--dtype", "bfloat16",
                 "--cases", "samples", "--quiet", "--report", str(tmp_path),
                 "--certificate", str(certificate)]) == 0
    out = capsys.readouterr().out
    assert "sigmoid" in out and "0 failed" in out
    cases = json.loads((tmp_path / "verify.json").read_text())["cases"]
    assert {c["backend"] for c in cases} == {"torch", "triton"}
    assert {c["status"] for c in cases} <= {"pass", "known"}
    assert all(c["category"] == "benchmark_ratio" for c in cases)
    # Every case was also measured against torch's own operator.
    assert all(c["peer_max_rel"] == c["peer_max_rel"] for c in cases)
    report = (tmp_path / "verify.md").read_text()
    assert "| gelu | triton | bfloat16 |" in report
    assert "| gelu | benchmark_ratio | L2 | torch.nn.functional.gelu |" in report
    assert (tmp_path / "verify.png").read_bytes()[:4] == b"\x89PNG"
    assert certificate.read_text() == report.replace("verify.png", "certificate.png")
    assert certificate.with_suffix(".png").exists()


def _plant(replace_launcher, op_name: str, output: int = 0) -> None:
    """Make the operator's Triton path wrong by 1% on every element of one output."""
    import opforge

    op = opforge.get_op(op_name)
    launch = op.launchers["triton"]

    def wrong(plan, inputs, outputs, workspace):
        launch(plan, inputs, outputs, workspace)
        outputs[output].mul_(1.01)

    replace_launcher(op, "triton", wrong)


def test_verify_fails_with_non_zero_exit(replace_launcher, capsys):
    _plant(replace_launcher, "sigmoid")
    assert main(["verify", "sigmoid", "--backend", "triton", "--dtype", "float32",
                 "--cases", "samples", "--quiet"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "sigmoid / randn_4097 / triton / float32: fail" in out
    # A reason about one of several outputs keeps its [output] tag on the terminal.
    _plant(replace_launcher, "rms_norm", output=1)
    assert main(["verify", "rms_norm", "--backend", "triton", "--dtype", "float32",
                 "--cases", "samples", "--quiet"]) == 1
    assert "[rstd]" in capsys.readouterr().out


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
                           "--backend", "triton", "--dtype", "float16", "--cases", "samples"],
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


def test_compile_check_at_given_sizes_compiles_the_calls_and_their_backward():
    """--shapes compiles the kernels opforge bench's calls launch at those sizes and the
    gradient operators' their backward makes (a model's hidden width, not the samples'),
    and reports the variants that spill registers even under --quiet."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "opforge", "compile-check", "rms_norm",
                           "--shapes", "64x16384", "--dtype", "bfloat16"], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "rms_norm_backward" in done.stdout and "BLOCK_N=16384" in done.stdout
    assert "norm_backward_kernel" in done.stdout and "norm_forward_kernel" in done.stdout
    summary = done.stdout.strip().splitlines()[-1]
    assert summary.endswith("of them spill registers to the stack), 0 failed"), summary
    spilled = int(summary.split("(")[1].split()[0])
    assert done.stdout.count("│ spills") == spilled  # the status of each such row


_SPECIALISATION_PROBE = """
import torch, opforge
from opforge.aot import record_variants
from opforge.core.hardware import get_profile
(variant, *_) = record_variants([opforge.get_op("softmax")], [torch.float32],
                                get_profile("h100"))
names = [p.name for p in variant.kernel.params]
print(sorted(k for k, v in variant.constexprs.items() if v == 1 and k.startswith("stride")))
print(sorted(names[i] for (i,) in variant.attrs))
"""


_CANDIDATES_PROBE = """
import os, torch, opforge
from opforge.aot import record_variants
from opforge.core.hardware import get_profile
ops = [opforge.get_op("attention")]
first = record_variants(ops, [torch.bfloat16], get_profile("h100"), capability=90)
every = record_variants(ops, [torch.bfloat16], get_profile("h100"), True, capability=90)
older = record_variants(ops, [torch.bfloat16], get_profile("a100"), True, capability=80)
def variants(recorded):
    return {(v.constexprs.get("DESCRIPTORS"), v.constexprs.get("WARP_SPECIALIZE"))
            for v in recorded if v.name == "_attention_forward_kernel"}
print(len(first), len(every), sorted(variants(first)), sorted(variants(every)),
      sorted(variants(older)), len(opforge.tuning_records()),
      os.path.exists(os.environ["OPFORGE_AUTOTUNE_CACHE"]))
"""


@needs_descriptors
def test_compile_check_of_every_candidate_records_the_descriptor_variants(tmp_path):
    """--candidates records the launches of every tiling candidate autotuning could time:
    on a Hopper target the tensor-descriptor and warp-specialized attention kernels too
    (not on an Ampere target, whose GPUs would run the pointer kernel); nothing is
    recorded as a tuning choice and no choices file is written."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["OPFORGE_AUTOTUNE_CACHE"] = str(tmp_path / "choices.json")
    done = subprocess.run([sys.executable, "-c", _CANDIDATES_PROBE], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    first, every, *rest = done.stdout.strip().splitlines()[-1].split(" ", 2)
    assert int(every) > int(first)
    assert rest[0].startswith("[(False, False)] ")
    assert "(True, True)" in rest[0] and "(True, False)" in rest[0]
    assert rest[0].endswith("[(False, False)] 0 False")


def test_compile_check_specialises_arguments_as_a_launch_does():
    """Without the JIT's specialisation (unit strides as constants, 16-divisible pointers
    and sizes marked) the compiler cannot vectorise or pipeline loads, and the registers,
    spills and shared memory it reports are not the launched kernel's."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _SPECIALISATION_PROBE], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    unit_strides, divisible = done.stdout.strip().splitlines()[-2:]
    assert "stride_xn" in unit_strides
    assert "x_ptr" in divisible and "out_ptr" in divisible


_ROUNDING_PROBE = """
import os, tempfile
from unittest import mock
import torch, triton, opforge
from triton.compiler import ASTSource
from opforge.aot import _ast_source, parse_target, record_variants, sass_instructions
from opforge.ops import _math
target, hardware = parse_target("cuda:90")
(variant, *_) = record_variants([opforge.get_op("silu_mul")], [torch.bfloat16], hardware)
compiled = triton.compile(_ast_source(ASTSource, variant), target=target,
                          options=variant.options)
counts = [compiled.asm["ptx"].count("cvt.rn.bf16"), sass_instructions(variant, target)]
with tempfile.TemporaryDirectory() as cache, \\
        mock.patch.dict(os.environ, {"TRITON_CACHE_DIR": cache}), \\
        mock.patch.object(_math, "INTEGER_BF16_ROUNDING", _math.tl.constexpr(True)):
    counts.append(sass_instructions(variant, target))
print(*counts)
"""


def test_a_kernel_compiled_for_a_gpu_rounds_to_bfloat16_with_the_gpus_conversion():
    """Compiled for a CUDA GPU, a bfloat16 result is rounded by the hardware's
    round-to-nearest-even conversion: fewer machine instructions than the integer form
    the interpreter needs (about seven a value, against one for two)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _ROUNDING_PROBE], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    conversions, hardware, integer = map(int, done.stdout.strip().splitlines()[-1].split())
    assert conversions > 0 and 0 < hardware < integer


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
    target, hardware = parse_target("ascend910b")
    assert (target.backend, target.arch, hardware.name) == ("npu", "Ascend910B3", "ascend910b")


def test_the_compilers_failing_line_is_the_reported_one():
    """From triton-ascend's banners, its compiler's diagnostics and a crash's stack dump,
    the line that says what failed."""
    from opforge.aot import _first_error_line

    crash = ("///---[ERROR][Triton][BEG]---\n[ConvertTritonIRToLinalgIR] encounters error:\n"
             "<unknown>:0: error: strides must not be zero\nStack dump:\n"
             "0.\tProgram arguments: triton-adapter-opt\n #0 0x55f1 (triton-adapter-opt)\n"
             "[INFO]: The compiled kernel cache is in /root/.triton/cache/x\n///---[END]---")
    assert _first_error_line(crash) == "<unknown>:0: error: strides must not be zero"
    assert _first_error_line("[MLIRCompile] encounters error:\nAssertionError('no')\n"
                             " #1 0x12 (lib)") == "AssertionError('no')"


# ---------------------------------------------------------------------------------------------
# opforge profile: what runs, and how it fails


def test_profile_strips_only_an_interpreter(tmp_path, capsys):
    """A script whose name starts with "python" is the script, not the interpreter."""
    from opforge.cli import _script

    script = tmp_path / "python_helper.py"
    script.write_text("import sys\nprint('args', sys.argv)\n")
    for interpreter in ("python", "python3", "python3.11", "/usr/bin/python3", sys.executable):
        assert _script(["--", interpreter, str(script), "2"]) == (
            "path", str(script), [str(script), "2"])
    assert main(["profile", "--out", str(tmp_path / "p"), "--", str(script), "2"]) == 0
    assert f"args {[str(script), '2']}" in capsys.readouterr().out


def test_profile_runs_a_python_command_found_on_path(tmp_path, monkeypatch, capsys):
    """`opforge profile -- opforge demo` runs the `opforge` console script as `opforge demo`
    would; a command that is not Python is refused with a usage error."""
    from opforge.cli import _script

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "traincmd").write_text("#!/usr/bin/env python\nimport sys\n"
                                      "print('command args', sys.argv[1:])\n")
    (bin_dir / "shellcmd").write_text("#!/bin/sh\necho not python\n")
    for name in ("traincmd", "shellcmd"):
        (bin_dir / name).chmod(0o755)
    venv_bin = os.path.dirname(sys.executable)
    monkeypatch.setenv("PATH", os.pathsep.join([str(bin_dir), venv_bin, os.environ["PATH"]]))
    kind, target, argv = _script(["--", "opforge", "demo", "--steps", "1"])
    assert (kind, argv[1:]) == ("path", ["demo", "--steps", "1"])
    assert os.path.samefile(target, os.path.join(venv_bin, "opforge"))
    assert main(["profile", "--out", str(tmp_path / "p"), "--", "traincmd", "a"]) == 0
    assert "command args ['a']" in capsys.readouterr().out
    assert main(["profile", "--out", str(tmp_path / "q"), "--", "shellcmd"]) == 2
    assert "not a Python script" in capsys.readouterr().out
    assert main(["profile", "--out", str(tmp_path / "q"), "--", "no_such_script.py"]) == 2
    assert "error" in capsys.readouterr().out


def test_profile_refuses_an_unknown_hardware_before_running(tmp_path, capsys):
    script = tmp_path / "s.py"
    script.write_text("raise SystemExit('the script ran')\n")
    argv = sys.argv
    assert main(["profile", "--hardware", "nope", "--out", str(tmp_path / "p"), "--",
                 "python", str(script)]) == 2
    captured = capsys.readouterr()
    assert "error" in captured.out and "unknown hardware profile" in captured.out
    assert "the script ran" not in captured.err and sys.argv is argv
    assert main(["analyse", str(tmp_path), "--hardware", "nope"]) == 2


def test_verify_counts_a_repeated_name_once_and_a_skip_as_no_success(monkeypatch, capsys):
    from opforge.precision import verify as verify_module

    assert main(["verify", "sigmoid", "sigmoid", "--dtype", "float32", "--dtype", "float32",
                 "--backend", "torch", "--cases", "samples", "--quiet"]) == 0
    assert "5 passed" in capsys.readouterr().out
    monkeypatch.setattr(verify_module, "backend_refusal",
                        lambda backend, device: "refused for this test")
    assert main(["verify", "sigmoid", "--dtype", "float32", "--backend", "triton",
                 "--cases", "samples", "--quiet"]) == 1
    out = capsys.readouterr().out
    assert "0 failed, 5 skipped" in out and "refused for this test" in out
    assert "nan" not in out


@pytest.mark.parametrize("arguments, fragment", [
    (["verify", "sigmoid", "--device", "meta"], "holds no data"),
    (["verify", "sigmoid", "--certificate", "{tmp}/cert.png"], "name the Markdown file"),
    (["verify", "sigmoid", "--report", "{tmp}/file/report"], "cannot be a directory"),
    (["compile-check", "sigmoid", "--target", "rocm"], "cuda:"),
    (["compile-check", "sigmoid", "--target", "ascend910b"], "needs triton-ascend"),
    (["bench", "sigmoid", "--device", "bogus"], "not usable here"),
    (["bench", "sigmoid", "--out", "{tmp}/file"], "cannot be a directory"),
    (["profile", "--out", "{tmp}/file", "--", "python", "{tmp}/script.py"],
     "cannot be a directory"),
    (["profile", "--out", "{tmp}/p", "--", "python", "-m", "no_such_module_here"],
     "no module named"),
    (["verify", "no_such_op", "another"], "no_such_op"),
])
def test_bad_arguments_exit_2_with_one_line_before_any_work(arguments, fragment, tmp_path,
                                                            monkeypatch, capsys):
    from opforge.precision import verify as verify_module

    (tmp_path / "file").write_text("")
    (tmp_path / "script.py").write_text("raise SystemExit('the script ran')\n")
    monkeypatch.setattr(verify_module, "verify", lambda *a, **k: pytest.fail("cases ran"))
    assert main([a.format(tmp=tmp_path) for a in arguments]) == 2
    out = capsys.readouterr().out.strip()
    assert out.startswith("error:") and fragment in out and "\n" not in out, out


@pytest.mark.parametrize("arguments", [["verify", "--seed", str(2**64)],
                                       ["analyse", ".", "--top", "0"]])
def test_out_of_range_numbers_are_usage_errors(arguments, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(arguments)
    assert exit_.value.code == 2 and "is not an integer" in capsys.readouterr().err


def test_doctor_reports_a_bad_backend_setting_and_what_cpu_tensors_get(setenv, monkeypatch,
                                                                       capsys):
    setenv("OPFORGE_BACKEND", "bogus")
    assert main(["doctor"]) == 0
    assert "invalid" in capsys.readouterr().out
    setenv("OPFORGE_BACKEND", "triton")
    monkeypatch.setattr("opforge.core.backends.interpreter_enabled", lambda: False)
    assert main(["doctor"]) == 0
    assert "refused: CPU tensors need TRITON_INTERPRET=1" in capsys.readouterr().out


def test_doctor_reports_the_autotuning_setting_and_its_file(monkeypatch, capsys, tmp_path):
    path = tmp_path / "choices.json"
    path.write_text('{"a | b": {"choice": "x", "timings_us": {}}}')
    monkeypatch.setenv("OPFORGE_AUTOTUNE_CACHE", str(path))
    monkeypatch.setenv("OPFORGE_AUTOTUNE", "on")
    assert main(["doctor"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "autotuning (OPFORGE_AUTOTUNE) │ True" in out and "(1 choices)" in out
    monkeypatch.setenv("OPFORGE_AUTOTUNE", "maybe")
    assert main(["doctor"]) == 0
    assert "invalid: OPFORGE_AUTOTUNE='maybe'" in " ".join(capsys.readouterr().out.split())


def test_cpu_verification_restarts_with_the_interpreter_also_beside_a_gpu(monkeypatch):
    from opforge import cli

    started = []
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(cli, "_accelerator_present", lambda: True)
    monkeypatch.setattr(cli.os, "execv", lambda *args: started.append(args))
    cli._ensure_interpreter(["torch", "triton"], None)
    assert not started  # the accelerator runs the kernels
    cli._ensure_interpreter(["torch", "triton"], "cpu")
    assert started and os.environ["TRITON_INTERPRET"] == "1"
