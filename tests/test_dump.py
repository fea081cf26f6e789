"""Dump and compare: identical runs agree, a planted divergence is found at its layer,
fp32 vs bf16 and torch vs triton runs agree, truncated or misaligned dumps fail closed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import opforge
from opforge.cli import main
from opforge.precision.dump import DumpError, dump, entry_key, read_step, step_folders


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
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "c"), str(tmp_path / "b"), "--plot", ""]) == 2
    _assert_one_line_error(capsys, "tensor 0.linear#0.forward.input.0 has no entry")
    _run(tmp_path / "d", _model(), mode="statistics", steps=1)
    _run(tmp_path / "e", _model(), mode="statistics", steps=1)
    manifest = tmp_path / "e" / "rank0" / "step0" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["entries"] = data["entries"][1:]
    manifest.write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "d"), str(tmp_path / "e"), "--plot", ""]) == 2
    _assert_one_line_error(capsys, "do not line up",
                           "first only in the reference: 0.linear#0.forward.input.0")


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


def _step(path) -> object:
    return read_step(path / "rank0" / "step0")


def test_zero_size_tensors_are_recorded(tmp_path, capsys):
    for name in ("a", "b"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8))
        with dump(model, tmp_path / name, mode="tensor") as d:
            model(torch.randn(0, 8, requires_grad=True)).sum().backward()
            d.step()
    entries = _step(tmp_path / "a").manifest["entries"]
    assert entries and all(e["shape"][0] == 0 for e in entries)
    assert all(e["stats"]["nan"] == e["stats"]["inf"] == 0 for e in entries)
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--plot", ""]) == 0


def test_a_failing_dump_hook_never_breaks_training(tmp_path, monkeypatch, caplog):
    import sys

    module = sys.modules["opforge.precision.dump"]   # the package's `dump` is the function
    model = _model()
    calls = [0]
    real = module.summary_stats

    def flaky(tensor):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("statistics bug")
        return real(tensor)

    monkeypatch.setattr(module, "summary_stats", flaky)
    generator = torch.Generator().manual_seed(1)
    with caplog.at_level("ERROR", logger="opforge"), dump(model, tmp_path / "a") as d:
        for _ in range(2):
            model(torch.randn(8, 32, generator=generator)).sum().backward()
            d.step()
    # The step with a failed record is not written (it would not line up); the next is.
    assert [f.name for f in step_folders(tmp_path / "a")] == ["step1"]
    assert sum("step 0 is not written" in r.getMessage() for r in caplog.records) == 1


def test_float16_and_bfloat16_rank_by_precision_not_by_order(tmp_path):
    from opforge.precision.dump import _lower_precision, compare_steps

    assert _lower_precision("float16", "bfloat16") == torch.bfloat16
    assert _lower_precision("bfloat16", "float16") == torch.bfloat16
    assert _lower_precision("float16", "float16", torch.bfloat16) == torch.bfloat16
    assert _lower_precision("float32", "float16") == torch.float16
    _run(tmp_path / "a", _model(dtype=torch.float16), mode="statistics", steps=1,
         dtype=torch.float16)
    a = _step(tmp_path / "a")
    assert {r.dtype for r in compare_steps(a, a, torch.bfloat16)} == {"bfloat16"}


def _assert_one_line_error(capsys, *words):
    out = capsys.readouterr().out.strip()
    assert out.startswith("error:") and "\n" not in out, out
    assert all(word in out for word in words), out


@pytest.mark.parametrize("manifest", [
    {"format": "opforge-dump/1"},
    {"format": "opforge-dump/1", "mode": "statistics", "entries": [{"key": "x"}]},
    {"format": "opforge-dump/1", "mode": "tensor", "entries": []},
    ["not", "an", "object"],
])
def test_malformed_manifests_exit_2_with_one_line(tmp_path, capsys, manifest):
    _run(tmp_path / "a", _model(), mode="statistics", steps=1)
    _run(tmp_path / "b", _model(), mode="statistics", steps=1)
    (tmp_path / "b" / "rank0" / "step0" / "manifest.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--plot", ""]) == 2
    _assert_one_line_error(capsys, "malformed manifest")


def test_tensor_file_without_an_entry_and_stray_folders(tmp_path, capsys):
    _run(tmp_path / "a", _model(), steps=1)
    _run(tmp_path / "b", _model(), steps=1)
    (tmp_path / "a" / "rank0" / "step0_old").mkdir()     # not a step: left out
    folder = tmp_path / "b" / "rank0" / "step0"
    data = json.loads((folder / "manifest.json").read_text())
    data["entries"][0]["module"] = "renamed"
    data["entries"][0]["key"] = entry_key(data["entries"][0])
    (folder / "manifest.json").write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--plot", ""]) == 2
    _assert_one_line_error(capsys, f"no tensor for entry {data['entries'][0]['key']}")


class Up(torch.nn.Module):
    """Returns its input itself in float32, a new tensor otherwise."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float()


def test_entries_match_by_key_when_aliasing_changes_hook_order(tmp_path, capsys):
    for name, low in (("fp32", False), ("bf16", True)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), Up(), torch.nn.Linear(8, 8))
        x = torch.randn(4, 8)
        if low:
            model[0].to(torch.bfloat16)
            x = x.bfloat16()
        with dump(model, tmp_path / name) as d:
            model(x).sum().backward()
            d.step()
    keys = [[e["key"] for e in _step(tmp_path / n).manifest["entries"]]
            for n in ("fp32", "bf16")]
    assert keys[0] != keys[1] and sorted(keys[0]) == sorted(keys[1])   # order differs
    assert main(["compare", str(tmp_path / "fp32"), str(tmp_path / "bf16"), "--plot", "",
                 "--dtype", "bfloat16"]) == 0


def test_activation_checkpointing_lines_up(tmp_path):
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(torch.nn.Module):
        def __init__(self, reentrant: bool | None) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
            self.reentrant = reentrant

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x) if self.reentrant is None else checkpoint(
                    block, x, use_reentrant=self.reentrant)
            return x

    for name, reentrant in (("plain", None), ("checkpoint", False), ("reentrant", True)):
        model = Checkpointed(reentrant)
        torch.manual_seed(1)
        with dump(model, tmp_path / name) as d:
            model(torch.randn(4, 8, requires_grad=True)).sum().backward()
            d.step()
    # A reentrant checkpoint backpropagates through its recomputation; the gradient hooks
    # on the original inputs still fire.
    for name in ("checkpoint", "reentrant"):
        assert main(["compare", str(tmp_path / "plain"), str(tmp_path / name),
                     "--plot", ""]) == 0


def test_an_all_nan_entry_shows_nan_not_agreement(tmp_path):
    from opforge.precision.dump import compare_steps, first_divergence

    class Poison(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * float("nan")

    for name, layer in (("ref", torch.nn.Identity()), ("nan", Poison())):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), layer, torch.nn.Linear(8, 8))
        with dump(model, tmp_path / name) as d:
            model(torch.randn(4, 8)).sum().backward()
            d.step()
    results = compare_steps(_step(tmp_path / "ref"), _step(tmp_path / "nan"))
    first = results[first_divergence(results)]
    assert first.key == "1#0.forward.output.0"
    assert math.isnan(first.cosine) and math.isnan(first.max_abs)
    assert all(r.cosine == pytest.approx(1.0) for r in results if not r.diverged)


def test_multi_rank_compare_reports_the_earliest_step(tmp_path, capsys):
    import shutil

    _run(tmp_path / "a" / "x", _model(), mode="statistics", steps=2)
    _run(tmp_path / "b" / "x", _model(), mode="statistics", steps=2)
    _run(tmp_path / "b" / "y", _model(diverge_at=2), mode="statistics", steps=2)
    for run in ("a", "b"):
        shutil.copytree(tmp_path / run / "x" / "rank0", tmp_path / run / "rank0")
        shutil.copytree(tmp_path / run / "x" / "rank0", tmp_path / run / "rank1")
    # rank 0 diverges at step 1 only, rank 1 already at step 0.
    shutil.rmtree(tmp_path / "b" / "rank0" / "step1")
    shutil.copytree(tmp_path / "b" / "y" / "rank0" / "step1", tmp_path / "b" / "rank0" / "step1")
    shutil.rmtree(tmp_path / "b" / "rank1" / "step0")
    shutil.copytree(tmp_path / "b" / "y" / "rank0" / "step0", tmp_path / "b" / "rank1" / "step0")
    for run in ("a", "b"):
        shutil.rmtree(tmp_path / run / "x")
    shutil.rmtree(tmp_path / "b" / "y")
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--plot", ""]) == 1
    assert "diverged at rank1/step0" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# Fail closed by construction: random damage to valid dumps


@pytest.fixture(scope="module")
def valid_dumps(tmp_path_factory):
    """Two agreeing runs of one step in each mode: ``{mode: (run_a, run_b)}``."""
    root = tmp_path_factory.mktemp("dumps")
    runs = {}
    for mode in ("tensor", "statistics"):
        for name in ("a", "b"):
            _run(root / mode / name, _model(), mode=mode, steps=1)
        runs[mode] = (root / mode / "a", root / mode / "b")
    return runs


# JSON kinds: a replacement of another kind than a field's is never valid for it.
def _kind(value: object) -> str:
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, (int, float)):
        return "number"
    return type(value).__name__


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                 max_size=3), max_leaves=6)
INTEGER_FIELDS = ("call", "index", "nan", "inf", "bytes")


def _fields(manifest: dict) -> list[tuple[dict, str]]:
    """Every (object, field) of a manifest that a comparison reads."""
    fields = [(manifest, name) for name in ("format", "mode", "entries", "tensors")
              if name in manifest]
    for entry in manifest["entries"]:
        fields += [(entry, name) for name in entry]
        fields += [(entry["stats"], name) for name in entry["stats"]]
    if "tensors" in manifest:
        fields += [(manifest["tensors"], name) for name in manifest["tensors"]]
    return fields


def _rehash(folder, manifest: dict, data: bytes) -> None:
    import hashlib

    (folder / "tensors.safetensors").write_bytes(data)
    manifest["tensors"].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())


@st.composite
def damage(draw, mode: str):
    """A function that damages a copied step folder, and whether the damage must make the
    dump malformed (exit 2) or may leave a valid dump of other values (exit 0, 1 or 2)."""
    from safetensors.torch import load, save

    kinds = ["field", "entries", "truncate_manifest", "directory"]
    if mode == "tensor":
        kinds += ["truncate_tensors", "flip_tensor_byte", "tensor_shape", "tensor_dtype"]
    kind = draw(st.sampled_from(kinds))
    pick, value = draw(st.integers(0, 10**6)), draw(JSON_VALUES)
    delete, rehash = draw(st.booleans()), draw(st.booleans())
    note(f"damage {kind}: pick {pick}, value {value!r}, delete {delete}, rehash {rehash}")

    def apply(folder) -> None:
        path = folder / "manifest.json"
        manifest = json.loads(path.read_text())
        tensors = (folder / "tensors.safetensors").read_bytes() if mode == "tensor" else b""
        if kind == "field":
            owner, name = _fields(manifest)[pick % len(_fields(manifest))]
            if delete:
                del owner[name]
            else:
                owner[name] = value
        elif kind == "entries":
            entries = manifest["entries"]
            manifest["entries"] = [] if delete else [*entries, entries[pick % len(entries)]]
        elif kind == "truncate_manifest":
            path.write_bytes(path.read_bytes()[:pick % path.stat().st_size])
            return
        elif kind == "directory":
            target = folder / ("manifest.json" if delete or mode != "tensor"
                               else "tensors.safetensors")
            target.unlink()
            target.mkdir()
            return
        elif kind == "truncate_tensors":
            cut = tensors[:pick % len(tensors)]
            if rehash:
                _rehash(folder, manifest, cut)
            else:
                (folder / "tensors.safetensors").write_bytes(cut)
        elif kind == "flip_tensor_byte":
            flipped = bytearray(tensors)
            flipped[pick % len(flipped)] ^= 1 << (pick % 8)
            if rehash:
                _rehash(folder, manifest, bytes(flipped))
            else:
                (folder / "tensors.safetensors").write_bytes(bytes(flipped))
        else:
            loaded = load(tensors)
            key = sorted(loaded)[pick % len(loaded)]
            loaded[key] = (loaded[key].reshape(-1)[:-1] if kind == "tensor_shape" and
                           loaded[key].numel() else loaded[key].reshape(1, -1).to(torch.int64)
                           if kind == "tensor_dtype" else torch.zeros(1))
            _rehash(folder, manifest, save(loaded))
        path.write_text(json.dumps(manifest))

    # The damage that may still leave a valid dump: a field given another value of its own
    # kind (the text of a name, a finite statistic), a flipped tensor byte re-hashed.
    def must_fail(original: dict) -> bool:
        if kind == "field":
            owner, name = _fields(original)[pick % len(_fields(original))]
            if delete:
                return True
            if name in INTEGER_FIELDS and isinstance(value, float):
                return True
            return _kind(value) != _kind(owner[name])
        return not (kind == "flip_tensor_byte" and rehash)

    return apply, must_fail


@pytest.mark.parametrize("mode", ["tensor", "statistics"])
@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_damaged_dumps_fail_closed(valid_dumps, mode, data, capsys):
    """Any damage to either run ends in exit 0, 1 or 2 without a traceback, and in 2 with
    one ``error:`` line for every damage that makes a dump malformed."""
    import shutil
    import tempfile

    apply, must_fail = data.draw(damage(mode))
    damaged_side = data.draw(st.sampled_from((0, 1)))
    with tempfile.TemporaryDirectory() as scratch:
        runs = [Path(shutil.copytree(run, Path(scratch) / str(side)))
                for side, run in enumerate(valid_dumps[mode])]
        folder = runs[damaged_side] / "rank0" / "step0"
        original = json.loads((folder / "manifest.json").read_text())
        apply(folder)
        capsys.readouterr()
        status = main(["compare", str(runs[0]), str(runs[1]), "--plot", ""])
    out = capsys.readouterr().out
    assert status in (0, 1, 2)
    if must_fail(original):
        assert status == 2, out
    if status == 2:
        assert out.startswith("error:") and out.count("\n") == 1, out


def _damaged(folder, damage: str) -> None:
    from safetensors.torch import load, save

    manifest = json.loads((folder / "manifest.json").read_text())
    entries = manifest["entries"]
    if damage in ("int64", "bool", "float8_e4m3fn"):
        entries[0]["dtype"] = damage
    elif damage == "shape":
        tensors = load((folder / "tensors.safetensors").read_bytes())
        tensors[entries[0]["key"]] = tensors[entries[0]["key"]][:-1].clone()
        _rehash(folder, manifest, save(tensors))
    elif damage == "empty":
        manifest["entries"] = []
    elif damage == "huge_norm":
        entries[0]["stats"]["norm"] = 10**400
    elif damage == "surrogate":
        entries[0]["module"] = "\udcff"
        entries[0]["key"] = entry_key(entries[0])
    elif damage == "duplicate":
        entries.append(dict(entries[0]))
    if damage in ("manifest_directory", "tensors_directory"):
        target = folder / ("manifest.json" if damage == "manifest_directory"
                           else "tensors.safetensors")
        target.unlink()
        target.mkdir()
    else:
        (folder / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("damage, words", [
    ("int64", "not one a comparison has a standard for"), ("bool", "'bool'"),
    ("float8_e4m3fn", "'float8_e4m3fn'"), ("shape", "has shape [7, 32], its entry [8, 32]"),
    ("manifest_directory", "manifest.json: not a file"),
    ("tensors_directory", "tensors.safetensors: not a file"),
    ("empty", "no entries"), ("duplicate", "appears twice"),
    ("huge_norm", "stats need numbers"), ("surrogate", "field 'key' is missing or invalid")])
def test_malformed_dumps_of_every_kind_exit_2(valid_dumps, tmp_path, capsys, damage, words):
    """The damages that once ended in a traceback and exit 1, or compared as agreement
    (no entries, a key twice)."""
    import shutil

    runs = [shutil.copytree(run, tmp_path / name)
            for name, run in zip("ab", valid_dumps["tensor"])]
    _damaged(runs[1] / "rank0" / "step0", damage)
    capsys.readouterr()
    assert main(["compare", str(runs[0]), str(runs[1]), "--plot", ""]) == 2
    _assert_one_line_error(capsys, words)


def test_names_with_markup_and_unsupported_plot_formats(tmp_path, capsys):
    """A module named like rich markup is shown as it is (it crashed the table); a plot
    file of a format matplotlib cannot write is bad input (exit 2), not a divergence."""
    for name in ("a", "b"):
        torch.manual_seed(0)
        model = torch.nn.ModuleDict({"x[/]": torch.nn.Linear(4, 4)})
        with dump(model, tmp_path / name, mode="tensor") as d:
            model["x[/]"](torch.ones(2, 4)).sum().backward()
            d.step()
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--plot", ""]) == 0
    assert "x[/]#0" in capsys.readouterr().out
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--plot",
                 str(tmp_path / "out.xyz")]) == 2
    assert capsys.readouterr().out.splitlines()[-1].startswith("error: --plot")


class _Gated(torch.nn.Module):
    """A module calling torch functions three ways: a functional (inside its Linear), a
    name imported from torch, and a tensor method."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch import relu  # the way that defeats patching torch.relu

        return relu(self.proj(x)).mul(x)


def _gated_step(path: Path, **options) -> tuple[dict, torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Gated())
    x = torch.randn(3, 6, requires_grad=True)
    with dump(model, path, mode="tensor", **options) as dumper:
        model(x).square().sum().backward()
        dumper.step()
    step = read_step(step_folders(path)[0])
    return {e["key"]: e for e in step.manifest["entries"]}, step, model


def test_api_entries_catch_every_torch_call_inside_the_modules(tmp_path):
    entries, step, _ = _gated_step(tmp_path / "a", apis=True)
    apis = [key for key in entries if not key.startswith(("0#", "#", "0.proj"))]
    assert {key.split("#")[0] for key in apis} == {"Functional.linear", "Torch.relu",
                                                   "Tensor.mul"}
    linear = entries["Functional.linear#0.forward.input.1"]
    assert linear["scope"] == "0.proj" and linear["shape"] == [6, 6]
    assert entries["Torch.relu#0.forward.input.0"]["scope"] == "0"
    assert torch.equal(step.tensors["Torch.relu#0.forward.output.0"],
                       step.tensors["Tensor.mul#0.forward.input.0"])
    # The loss outside the model, and the dump's own statistics, are not API entries.
    assert not any(key.startswith(("Tensor.square", "Tensor.sum", "Tensor.amin"))
                   for key in entries)


def test_api_names_filter_and_data_mode_select(tmp_path):
    entries, _, _ = _gated_step(tmp_path / "a", apis=["Torch.relu"], data_mode=["forward"])
    assert {key.split("#")[0] for key in entries} == {"Torch.relu", "0", "0.proj", ""}
    assert all(entry["phase"] == "forward" for entry in entries.values())
    entries, _, _ = _gated_step(tmp_path / "b", data_mode=["output"], parameters=True,
                                output_grads=True)
    assert {entry["io"] for entry in entries.values()} == {"output"}
    with pytest.raises(ValueError, match="data mode"):
        dump(torch.nn.Linear(2, 2), tmp_path / "c", data_mode=["inputs"])


def test_parameters_their_gradients_and_output_gradients(tmp_path):
    entries, step, model = _gated_step(tmp_path / "a", parameters=True, output_grads=True)
    weight = model[0].proj.weight
    assert torch.equal(step.tensors["0.proj.weight#0.forward.parameter.0"], weight.detach())
    assert torch.equal(step.tensors["0.proj.weight#0.backward.parameter.0"], weight.grad)
    # The gradient reaching the model's output: d(sum y^2)/dy = 2y.
    output = step.tensors["0#0.forward.output.0"]
    torch.testing.assert_close(step.tensors["0#0.backward.output.0"], 2 * output)
    assert entries["0.proj.bias#0.forward.parameter.0"]["io"] == "parameter"


def test_stacks_name_the_caller_without_machine_paths_unless_asked(tmp_path):
    entries, _, _ = _gated_step(tmp_path / "a", stacks=True)
    stack = entries["0#0.forward.input.0"]["stack"]
    assert any(frame.startswith("test_dump.py:") for frame in stack), stack
    assert not any("/" in frame.split(":")[0] for frame in stack)
    entries, _, _ = _gated_step(tmp_path / "b", stacks=True, absolute_paths=True)
    assert any(frame.startswith(str(Path(__file__).resolve().parent))
               for frame in entries["0#0.forward.input.0"]["stack"])


_CALLER = """
import torch
from opforge.precision import dump


def train(model, path):
    with dump(model, path, mode="statistics", stacks=True) as dumper:
        model(torch.randn(3, 6)).sum().backward()
        dumper.step()
"""


def test_stacks_keep_a_caller_in_a_folder_named_like_a_library(tmp_path):
    """A user's project folder named opforge (or torch) is not the library's: the caller's
    frames stay in the stack."""
    import runpy

    script = tmp_path / "opforge" / "train.py"
    script.parent.mkdir()
    script.write_text(_CALLER)
    runpy.run_path(str(script))["train"](torch.nn.Sequential(_Gated()), tmp_path / "dump")
    entries = {e["key"]: e for e in read_step(step_folders(tmp_path / "dump")[0])
               .manifest["entries"]}
    assert any(frame.startswith("train.py:") and frame.endswith(" train")
               for frame in entries["0#0.forward.input.0"]["stack"])
