"""Dump and compare: identical runs agree, a planted divergence is found at its layer,
fp32 vs bf16 and torch vs triton runs agree, truncated or misaligned dumps fail closed."""

from __future__ import annotations

import json

import pytest
import torch

import opforge
from opforge.cli import main
from opforge.precision.dump import DumpError, dump, read_step, step_folders


class Block(torch.nn.Module):
    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(32, 32)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return opforge.gelu(self.linear(x)) * self.scale


def _model(diverge_at: int | None = None, dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    blocks = [Block(1.5 if i == diverge_at else 1.0) for i in range(4)]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(32, 1)).to(dtype)


def _run(path, model, mode="tensor", steps=2, dtype=torch.float32):
    generator = torch.Generator().manual_seed(1)
    with dump(model, path, mode=mode) as d:
        for _ in range(steps):
            model(torch.randn(8, 32, generator=generator).to(dtype)).float().sum().backward()
            d.step()


def test_dump_layout_and_manifest(tmp_path):
    _run(tmp_path / "a", _model(), steps=2)
    folders = step_folders(tmp_path / "a")
    assert [f"{f.parent.name}/{f.name}" for f in folders] == ["rank0/step0", "rank0/step1"]
    step = read_step(folders[0])
    entries = step.manifest["entries"]
    assert entries[0]["key"] == "0.linear#0.forward.input.0"
    assert any(e["phase"] == "backward" for e in entries)
    assert set(step.tensors) == {e["key"] for e in entries}
    assert not list((tmp_path / "a").rglob("*.tmp"))
    assert not list((tmp_path / "a").rglob("*.pt"))   # no pickle anywhere


@pytest.mark.parametrize("mode", ["tensor", "statistics"])
def test_identical_runs_exit_zero(tmp_path, mode, capsys):
    _run(tmp_path / "a", _model(), mode=mode)
    _run(tmp_path / "b", _model(), mode=mode)
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--plot",
                 str(tmp_path / "plot.png")]) == 0
    assert "no divergence" in capsys.readouterr().out
    assert (tmp_path / "plot.png").stat().st_size > 0


@pytest.mark.parametrize("mode", ["tensor", "statistics"])
def test_planted_divergence_is_found_at_its_layer(tmp_path, mode, capsys):
    _run(tmp_path / "a", _model(), mode=mode)
    _run(tmp_path / "b", _model(diverge_at=2), mode=mode)
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--plot", ""]) == 1
    out = capsys.readouterr().out
    assert "first divergent module 2 " in out, out


def test_fp32_and_bf16_runs_agree_within_bf16(tmp_path):
    _run(tmp_path / "a", _model())
    _run(tmp_path / "b", _model(dtype=torch.bfloat16), dtype=torch.bfloat16)
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--plot", ""]) == 0


def test_torch_and_triton_backends_agree(tmp_path):
    with opforge.use_backend("torch"):
        _run(tmp_path / "a", _model(), steps=1)
    with opforge.use_backend("triton"):
        _run(tmp_path / "b", _model(), steps=1)
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--plot", ""]) == 0


def test_truncated_dump_fails_closed(tmp_path, capsys):
    _run(tmp_path / "a", _model(), steps=1)
    _run(tmp_path / "b", _model(), steps=1)
    tensors = tmp_path / "b" / "rank0" / "step0" / "tensors.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:-100])
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--plot", ""]) == 2
    assert "truncated" in capsys.readouterr().out
    with pytest.raises(DumpError, match="truncated"):
        read_step(tensors.parent)


def test_missing_and_misaligned_dumps_fail_closed(tmp_path, capsys):
    _run(tmp_path / "a", _model(), steps=2)
    _run(tmp_path / "b", _model(), steps=1)
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--plot", ""]) == 2
    assert "different steps" in capsys.readouterr().out
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "none"), "--plot", ""]) == 2
    manifest = tmp_path / "b" / "rank0" / "step0" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["entries"] = data["entries"][1:]
    manifest.write_text(json.dumps(data))
    _run(tmp_path / "c", _model(), steps=1)
    assert main(["compare", str(tmp_path / "c"), str(tmp_path / "b"), "--plot", ""]) == 2
    assert "do not line up" in capsys.readouterr().out


def test_step_and_module_filters(tmp_path):
    model = _model()
    generator = torch.Generator().manual_seed(1)
    with dump(model, tmp_path / "a", mode="statistics", steps=[1], modules=["2."]) as d:
        for _ in range(3):
            model(torch.randn(8, 32, generator=generator)).sum().backward()
            d.step()
    folders = step_folders(tmp_path / "a")
    assert [f.name for f in folders] == ["step1"]
    entries = read_step(folders[0]).manifest["entries"]
    assert entries and all(e["module"].startswith("2.") for e in entries)
    assert read_step(folders[0]).tensors is None
    with pytest.raises(ValueError, match="mode"):
        dump(model, tmp_path / "x", mode="everything")


@pytest.mark.parametrize("mode", ["tensor", "statistics"])
def test_loss_scaled_gradients_are_dumped_unscaled(tmp_path, mode):
    """A run whose loss is multiplied by 1024 matches the unscaled run once its gradients
    are divided by the scale, and diverges in the backward without that."""
    from opforge.precision.dump import compare_steps, first_divergence

    def scaled_run(path, scale, grad_scale):
        model = _model()
        generator = torch.Generator().manual_seed(1)
        with dump(model, path, mode=mode, grad_scale=grad_scale) as d:
            (model(torch.randn(8, 32, generator=generator)).sum() * scale).backward()
            d.step()

    scaled_run(tmp_path / "plain", 1.0, None)
    scaled_run(tmp_path / "unscaled", 1024.0, lambda: 1024.0)
    scaled_run(tmp_path / "scaled", 1024.0, None)
    plain = read_step(tmp_path / "plain" / "rank0" / "step0")
    results = compare_steps(plain, read_step(tmp_path / "unscaled" / "rank0" / "step0"))
    assert first_divergence(results) is None
    results = compare_steps(plain, read_step(tmp_path / "scaled" / "rank0" / "step0"))
    first = first_divergence(results)
    assert first is not None and results[first].phase == "backward"
    assert results[first].norm_error == pytest.approx(1023.0, rel=1e-3)


def test_tolerance_of_the_compute_dtype(tmp_path):
    """float32 entries 0.5% apart diverge by float32's tolerance (0.1%) and agree by that
    of a bfloat16 compute dtype (5%); `opforge compare --dtype` applies it."""
    from opforge.precision.dump import compare_steps, first_divergence

    for name, factor in (("a", 1.0), ("b", 1.005)):
        model = _model()
        with torch.no_grad():
            model[-1].weight.mul_(factor)
        _run(tmp_path / name, model, mode="statistics", steps=1)
    a, b = (read_step(tmp_path / n / "rank0" / "step0") for n in ("a", "b"))
    first = first_divergence(compare_steps(a, b))
    assert first is not None and compare_steps(a, b)[first].key.startswith("4#0")
    assert first_divergence(compare_steps(a, b, torch.bfloat16)) is None
    plot = str(tmp_path / "c.png")
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--plot", plot]) == 1
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--dtype", "bfloat16",
                 "--plot", plot]) == 0
