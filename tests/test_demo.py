"""The demo: the tiny MoE language model, its report, and the precision study's code path."""

from __future__ import annotations

import math
import sys
from html.parser import HTMLParser

import pytest
import torch

import opforge
from opforge import cli, demo
from opforge.core.opdef import Case
from opforge.demo import study
from opforge.precision.verify import read_certificate

from .conftest import DEVICE, assert_golden

TINY = {"dim": 32, "layers": 1, "heads": 2, "hidden": 32, "experts": 4, "k": 2}
# Every operator the model is made of, as the profiler names it.
MODEL_OPERATORS = {"opforge::embedding_dense_grad", "opforge::rms_norm",
                   "opforge::add_rms_norm", "opforge::rope", "opforge::attention",
                   "opforge::attention_backward", "opforge::moe_gating_top_k",
                   "opforge::gelu", "opforge::matmul", "opforge::log_softmax"}


class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.sections: dict[str, list[str]] = {}
        self.current: str | None = None
        self.images: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "section":
            self.current = attrs["id"]
            self.sections[self.current] = []
        if tag == "img":
            self.images.append(attrs["src"])

    def handle_endtag(self, tag):
        if tag == "section":
            self.current = None

    def handle_data(self, data):
        if self.current is not None and data.strip():
            self.sections[self.current].append(data.strip())


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("reports")
    steps: list[float] = []
    run, index = demo.run_demo(out, steps=12, batch=4, device=DEVICE, model=TINY,
                               profile_steps=(3, 2), sample_chars=24,
                               on_step=lambda step, loss: steps.append(loss))
    return out, run, index, steps


def test_demo_trains_the_model(demo_run):
    _, run, _, progress = demo_run
    assert len(run.losses) == 12 and progress == run.losses
    assert all(math.isfinite(v) for v in run.losses)
    assert run.losses[0] == pytest.approx(math.log(run.vocab), rel=0.05)  # uniform at first
    assert run.final_loss < run.losses[0] - 0.3
    assert [s for s, _ in run.val_losses] == [12]
    assert run.sample.startswith("And God said") and len(run.sample) == len("And God said") + 24
    assert len(run.expert_load) == 1 and sum(run.expert_load[0]) == 4 * 64 * 2


def test_demo_model_is_made_of_opforge_operators(demo_run):
    _, run, _, _ = demo_run
    assert [s.step for s in run.profile.steps] == ["3", "4"]
    kinds = {k.type for k in run.profile.kernels} | {o.name for o in run.profile.operators}
    assert kinds >= MODEL_OPERATORS


def test_demo_report_has_every_section(demo_run):
    out, run, index, _ = demo_run
    page = _Page()
    page.feed(index.read_text())
    assert list(page.sections) == list(demo.SECTIONS)
    for name, texts in page.sections.items():
        assert texts or name == "loss", name
    assert len(page.images) == 2 and all(i.startswith("data:image/png;base64,")
                                         for i in page.images)
    run_text = " ".join(page.sections["run"])
    assert "12 steps of 4 x 64 characters" in run_text
    assert "no anomalies in 12 steps" in " ".join(page.sections["monitor"])
    profile_text = " ".join(page.sections["profile"])
    # The top kernels with their verdicts: matmul takes about 30% of the kernel time; the
    # smaller operators' ranks move with the machine's load (every one of them is checked
    # in the profile by test_demo_model_is_made_of_opforge_operators).
    assert "opforge::matmul" in profile_text and "latency-bound" in profile_text
    certificate = read_certificate(demo.default_certificate())
    assert certificate.totals in " ".join(page.sections["certificate"])
    assert run.sample[:12] in " ".join(page.sections["sample"])
    for name in ("loss.png", "profile/report.html", "profile/trace_view.json",
                 "profile/kernel_details.csv"):
        assert (out / name).exists(), name


def test_naive_softmax_is_the_overflowing_foil():
    model = demo.load_example()
    x = torch.tensor([[12.0, 0.0, -3.0]], dtype=torch.float16)
    assert torch.isnan(model.naive_softmax(x)).any()            # exp(12) > 65504
    stable = opforge.softmax(x, dim=-1)
    assert torch.isfinite(stable).all()
    assert_golden(opforge.get_op("softmax"), Case("", (x,), {"dim": -1}), stable)


def test_study_code_path_on_tiny_sizes(tmp_path):
    result = demo.run_study(tmp_path / "study", steps=6, batch=4, model=TINY, dump_every=3,
                            device=DEVICE, doc=tmp_path / "docs" / "precision-study.md")
    names = [r.config.name for r in result.runs]
    assert names == [r.name for r in demo.STUDY_RUNS]
    assert result.dump_steps == [0, 3, 5]
    assert set(result.divergences) == set(names[1:])
    for found in result.divergences.values():
        assert found.error == "" and 1 <= found.compared_steps <= 3
        assert (found.step is None) == (found.compared_steps == 3 and not found.entry)
    # Every run started from the same weights on the same batch.
    assert len({round(r.losses[0], 1) for r in result.runs}) == 1
    assert all(r.peaks["near_underflow"].phase == "backward" for r in result.runs)
    for name in ("study.md", "study.json", "loss_curves.png"):
        assert (tmp_path / "study" / name).exists()
    text = (tmp_path / "docs" / "precision-study.md").read_text()
    assert "![loss curves](precision-study.png)" in text
    assert (tmp_path / "docs" / "precision-study.png").exists()
    assert text.count("\n| ") >= 1 + len(names) and "## Findings" in text
    assert all(f"**{name}**" in text for name in names[1:])


def test_divergence_of_identical_and_of_misaligned_dumps(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    for name, scale in (("a", 1.0), ("b", 1.0), ("c", 3.0)):
        with opforge.precision.dump(model, tmp_path / name) as dumped:
            for _ in range(2):
                model(torch.ones(3, 4) * scale).sum().backward()
                dumped.step()
    same = study.divergence(tmp_path / "a", tmp_path / "b", [0, 1])
    assert same.step is None and same.compared_steps == 2
    moved = study.divergence(tmp_path / "a", tmp_path / "c", [0, 1])
    assert moved.step == 0 and moved.entry
    missing = study.divergence(tmp_path / "a", tmp_path / "b", [0, 7])
    assert missing.step is None and missing.compared_steps == 1 and "step7" in missing.error


def test_example_dir_says_where_it_looked(monkeypatch, tmp_path):
    monkeypatch.setenv("OPFORGE_EXAMPLE_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="tiny MoE language model is not at"):
        demo.example_dir()


def test_demo_command(tmp_path, capsys):
    code = cli.main(["demo", "--out", str(tmp_path), "--steps", "4", "--batch", "2",
                     "--model", "dim=32,layers=1,heads=2,hidden=32,experts=4,k=2",
                     "--profile-from", "2", "--profile-steps", "1", "--quiet"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "trained 4 steps" in printed and "report:" in printed
    assert (tmp_path / "index.html").exists()


def test_study_command(tmp_path, capsys):
    code = cli.main(["demo", "--study", "--out", str(tmp_path), "--study-steps", "3",
                     "--dump-every", "2", "--batch", "2", "--quiet",
                     "--model", "dim=32,layers=1,heads=2,hidden=32,experts=4,k=2"])
    assert code == 0
    assert "## Findings" in capsys.readouterr().out
    assert (tmp_path / "study" / "study.md").exists()


def test_certificate_reader(tmp_path):
    certificate = read_certificate(demo.default_certificate())
    assert certificate.totals.endswith("skipped.") and certificate.rows
    ops = {row["op"] for row in certificate.rows}
    assert {op.name for op in opforge.list_ops()} == ops
    rows = {row[0]: row for row in demo.report.certificate_by_op(certificate)}
    softmax = [r for r in certificate.rows if r["op"] == "softmax"]
    assert rows["softmax"][1] == str(sum(int(r["cases"]) for r in softmax))
    (tmp_path / "other.md").write_text("# notes\n")
    with pytest.raises(ValueError, match="not an opforge precision certificate"):
        read_certificate(tmp_path / "other.md")


def test_demo_refuses_unknown_model_sizes(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["demo", "--model", "width=3"])
    assert exit_.value.code == 2 and "NAME=INTEGER" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown model size"):
        demo.train(demo.RunConfig(steps=1, model={"depth": 2}))


def test_demo_model_runs_on_the_triton_kernels():
    """The same two steps on the Triton kernels (the interpreter on the CPU) as on the torch
    backend: every operator of the model has a Triton path, and the losses agree."""
    config = demo.RunConfig(steps=2, batch=2, seq=16, model=TINY)
    with opforge.use_backend("torch"):
        reference = demo.train(config, device=DEVICE)
    with opforge.use_backend("triton"):
        triton = demo.train(config, device=DEVICE)
    assert triton.losses == pytest.approx(reference.losses, rel=1e-4)
    assert triton.val_losses[0][1] == pytest.approx(reference.val_losses[0][1], rel=1e-4)


def test_validation_is_neither_monitored_nor_the_reported_expert_load(monkeypatch):
    """A validation pass between steps is not a training call: a NaN it makes raises no
    alert, and the reported expert load is the last training step's (the validation here
    routes a single token)."""
    from opforge.demo import training

    def poisoned_validation(model, data, config, device, dtype):
        weight = model.blocks[0].moe.gate.weight
        saved = weight.detach().clone()
        with torch.no_grad():
            weight.fill_(math.nan)
            model(torch.zeros(1, 1, dtype=torch.long, device=device))
            weight.copy_(saved)
        return 0.0

    monkeypatch.setattr(training, "_validation_loss", poisoned_validation)
    config = demo.RunConfig(steps=3, batch=2, seq=16, model=TINY, eval_every=1)
    run = demo.train(config, device=DEVICE)
    assert run.alerts == []
    assert [sum(load) for load in run.expert_load] == [2 * 16 * TINY["k"]]


def test_skipped_steps_are_the_steps_the_optimizer_did_not_take(monkeypatch):
    """A loss scale stuck at its floor skips every step without lowering the scale: the
    count comes from the optimizer, not from the scale's decreases."""

    class StuckScaler(torch.amp.GradScaler):
        def step(self, optimizer, *args, **kwargs):
            return None  # found Inf/NaN: the optimizer does not step

        def update(self, new_scale=None):
            pass  # the scale cannot go lower

    monkeypatch.setattr(torch.amp, "GradScaler", StuckScaler)
    config = demo.RunConfig(steps=3, batch=2, seq=16, model=TINY, loss_scaling=True)
    assert demo.train(config, device=DEVICE).skipped_steps == 3


def test_a_profile_window_past_the_run_is_no_profile(tmp_path):
    (tmp_path / "monitor.jsonl").write_text('{"kind": "nan", "step": 7}\n')
    run, index = demo.run_demo(tmp_path, steps=2, batch=2, device=DEVICE, model=TINY,
                               profile_steps=(10, 3), sample_chars=0)
    assert run.profile is None and "(not profiled)" in index.read_text()
    # A healthy run leaves no alert log, not the previous run's.
    assert not (tmp_path / "monitor.jsonl").exists()
    run, _ = demo.run_demo(tmp_path, steps=2, batch=2, device=DEVICE, model=TINY,
                           profile_steps=(0, 1), sample_chars=0)
    assert [s.step for s in run.profile.steps] == ["0"]


@pytest.mark.parametrize("arguments, message", [
    (["--steps", "0"], "not an integer >= 1"),
    (["--batch", "-1"], "not an integer >= 1"),
    (["--profile-from", "-1"], "not an integer >= 0"),
    (["--dump-every", "0"], "not an integer >= 1"),
])
def test_demo_refuses_bad_counts(arguments, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["demo", *arguments])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_demo_refuses_what_it_cannot_run_before_training(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    cases = [(["--device", "bogus"], "--device bogus"),
             (["--model", "dim=32,heads=3"], "heads of equal width"),
             (["--out", str(blocker / "reports")], "not a writable directory"),
             (["--study", "--doc", str(blocker / "study.md")], "not a writable directory")]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "no CUDA device"))
    for arguments, message in cases:
        assert cli.main(["demo", "--quiet", *arguments]) == 2, arguments
        assert message in capsys.readouterr().out, arguments


def test_demo_without_the_example_says_where_to_point_it(tmp_path, monkeypatch, capsys):
    """An installed package without the repository's examples/: one line naming the
    variable that points at them, exit 2 (a FileNotFoundError traceback before)."""
    monkeypatch.setenv("OPFORGE_EXAMPLE_DIR", str(tmp_path))
    monkeypatch.delitem(sys.modules, "tiny_moe_lm_model", raising=False)
    assert cli.main(["demo", "--quiet", "--out", str(tmp_path / "out")]) == 2
    assert "OPFORGE_EXAMPLE_DIR=<clone>/examples/tiny_moe_lm" in capsys.readouterr().out
