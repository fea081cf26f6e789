"""`opforge compare` on dumps written by MindStudio Probe itself (`tests/fixtures/msprobe`,
made by its `generate.py` with mindstudio-probe 26.2.0): the planted weight named as the
origin at module (L0) and API (mix) level, an msprobe dump against an opforge dump of the
same model, and every way a dump can be broken refused with exit 2."""

from __future__ import annotations

import collections
import importlib.util
import json
import shutil
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

from opforge.cli import main
from opforge.precision import msprobe
from opforge.precision.dump import DumpError, dump, read_step, step_folders

FIXTURES = Path(__file__).parent / "fixtures" / "msprobe"
TENSOR_STEP = Path("step0/proc0")


def _fixture_model(perturbed: bool = False) -> torch.nn.Module:
    spec = importlib.util.spec_from_file_location("msprobe_fixture_model",
                                                  FIXTURES / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Net(perturbed), module.batch


def _compare(a: Path, b: Path, capsys: pytest.CaptureFixture, *extra: str) -> tuple[int, str]:
    code = main(["compare", str(a), str(b), "--plot", "", *extra])
    return code, capsys.readouterr().out


def _copy(name: str, tmp_path: Path) -> Path:
    target = tmp_path / name.replace("/", "_")
    shutil.copytree(FIXTURES / name, target)
    return target


def test_module_level_tensor_dumps_name_the_planted_weight(capsys):
    code, out = _compare(FIXTURES / "l0_tensor/clean", FIXTURES / "l0_tensor/perturbed",
                         capsys)
    assert code == 1
    assert "first divergent module layers.1.fc2.weight " in out, out


def test_api_level_statistics_dumps_name_the_api_and_its_module(capsys):
    """Mix level: the APIs run inside the modules are entries too; the first divergent one
    is the linear whose weight (its input 1) was changed, in the module construct.json
    gives it."""
    code, out = _compare(FIXTURES / "mix_statistics/clean",
                         FIXTURES / "mix_statistics/perturbed", capsys)
    assert code == 1
    assert "first divergent module Functional.linear (in layers.1.fc2)" in out, out
    assert "Functional.linear#3.forward.input.1" in out


@pytest.mark.parametrize("name", ["l0_tensor/clean", "mix_statistics/clean"])
def test_a_dump_agrees_with_itself_and_a_step_folder_can_be_named(name, capsys):
    root = FIXTURES / name
    assert _compare(root, root / TENSOR_STEP, capsys)[0] == 0


def test_entries_follow_msprobe_s_orientation_converted():
    """A backward's ``input`` (the gradient reaching the module's output) is opforge's
    backward output, its ``output`` the module's share of its input's gradient
    (``local_input``); parameters and their gradients are entries of
    ``<module>.<name>``."""
    step = msprobe.read_step(FIXTURES / "l0_tensor/clean" / TENSOR_STEP)
    by_key = {entry["key"]: entry for entry in step.manifest["entries"]}
    raw = json.loads((step.folder / "dump.json").read_text())["data"]
    backward = raw["Module.layers.1.fc1.Linear.backward.0"]
    assert by_key["layers.1.fc1#0.backward.local_input.0"]["shape"] == \
        backward["output"][0]["shape"] == [2, 8]
    assert by_key["layers.1.fc1#0.backward.output.0"]["shape"] == \
        backward["input"][0]["shape"] == [2, 16]
    assert by_key["layers.1.fc2.weight#0.backward.parameter.0"]["shape"] == [8, 16]
    assert by_key["layers.1.fc2.weight#0.forward.parameter.0"]["stats"]["max"] == \
        raw["Module.layers.1.fc2.Linear.forward.0"]["parameters"]["weight"]["Max"]
    assert torch.equal(step.tensors["layers.1.fc2.weight#0.forward.parameter.0"],
                       _fixture_model()[0].layers[1].fc2.weight.detach())


def test_an_msprobe_dump_against_an_opforge_dump_of_the_same_run(tmp_path, capsys):
    """The same model and batch dumped by opforge: the entries both hold (forward inputs
    and outputs) agree; opforge's own (the root model, tensors' whole gradients) and
    msprobe's (parameters, output gradients, modules' gradient shares) are refused without
    --intersection and counted with it."""
    model, batch = _fixture_model()
    with dump(model, tmp_path / "opforge", mode="tensor") as dumper:
        model(batch()).square().sum().backward()
        dumper.step()
    code, out = _compare(tmp_path / "opforge", FIXTURES / "l0_tensor/clean", capsys)
    assert code == 2 and "do not line up" in out
    code, out = _compare(tmp_path / "opforge", FIXTURES / "l0_tensor/clean", capsys,
                         "--intersection")
    assert code == 0 and "left out" in out and "no divergence" in out, out
    code, out = _compare(tmp_path / "opforge", FIXTURES / "l0_tensor/perturbed", capsys,
                         "--intersection")
    assert code == 1 and "first divergent module layers.1.fc2 " in out, out


def _break_missing_tensor(folder: Path) -> None:
    (folder / "dump_tensor_data" / "Module.layers.1.fc2.Linear.forward.0.output.0.pt").unlink()


def _break_truncated_tensor(folder: Path) -> None:
    path = folder / "dump_tensor_data" / "Module.layers.1.fc2.Linear.forward.0.output.0.pt"
    path.write_bytes(path.read_bytes()[:200])


def _break_truncated_json(folder: Path) -> None:
    path = folder / "dump.json"
    path.write_bytes(path.read_bytes()[:-300])


def _break_missing_entry(folder: Path) -> None:
    path = folder / "dump.json"
    data = json.loads(path.read_text())
    del data["data"]["Module.layers.2.fc1.Linear.forward.0"]
    path.write_text(json.dumps(data))


def _break_path_in_data_name(folder: Path) -> None:
    path = folder / "dump.json"
    data = json.loads(path.read_text())
    data["data"]["Module.head.Linear.forward.0"]["output"][0]["data_name"] = "../dump.json"
    path.write_text(json.dumps(data))


def _break_shape(folder: Path) -> None:
    path = folder / "dump.json"
    data = json.loads(path.read_text())
    data["data"]["Module.head.Linear.forward.0"]["output"][0]["shape"] = [4, 2]
    path.write_text(json.dumps(data))


def _break_statistic(folder: Path) -> None:
    path = folder / "dump.json"
    data = json.loads(path.read_text())
    data["data"]["Module.head.Linear.forward.0"]["output"][0]["Norm"] = None
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("breaks, message", [
    (_break_missing_tensor, "missing (a tensor of the dump)"),
    (_break_truncated_tensor, "not a readable tensor file"),
    (_break_truncated_json, "not readable JSON"),
    (_break_missing_entry, "do not line up"),
    (_break_path_in_data_name, "no tensor file name"),
    (_break_shape, "its record says"),
    (_break_statistic, "statistic Norm is None"),
])
def test_broken_dumps_are_refused_with_one_error_line(breaks, message, tmp_path, capsys):
    broken = _copy("l0_tensor/clean", tmp_path)
    breaks(broken / TENSOR_STEP)
    code, out = _compare(FIXTURES / "l0_tensor/clean", broken, capsys)
    assert code == 2
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], out


def test_an_entry_on_one_side_only_is_compared_with_intersection(tmp_path, capsys):
    broken = _copy("l0_tensor/clean", tmp_path)
    _break_missing_entry(broken / TENSOR_STEP)
    code, out = _compare(FIXTURES / "l0_tensor/clean", broken, capsys, "--intersection")
    assert code == 0 and "left out 4 of the reference only and 0 of the other run only" in out


def test_a_pickle_that_runs_code_is_refused_unrun(tmp_path):
    marker = tmp_path / "ran"

    class Exploit:
        def __reduce__(self):
            return (Path.touch, (marker,))

    path = tmp_path / "evil.pt"
    torch.save(Exploit(), path)
    with pytest.raises(DumpError, match="not a readable tensor file"):
        msprobe.load_tensor(path)
    assert not marker.exists()


def test_an_npu_tensor_loads_to_the_cpu_through_the_mapped_rebuild(tmp_path, monkeypatch):
    """A file whose tensor names torch_npu's rebuild function (as an NPU run saves it)
    loads without torch_npu, as the CPU tensor it holds."""
    def _rebuild_npu_tensor(*args):  # what torch_npu registers, by name
        raise AssertionError("the real torch_npu function must not be needed")

    package, utils = types.ModuleType("torch_npu"), types.ModuleType("torch_npu.utils")
    storage = types.ModuleType("torch_npu.utils.storage")
    storage._rebuild_npu_tensor = _rebuild_npu_tensor
    _rebuild_npu_tensor.__module__ = storage.__name__
    _rebuild_npu_tensor.__qualname__ = "_rebuild_npu_tensor"
    for module in (package, utils, storage):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    values = torch.arange(6.0).reshape(2, 3)
    with warnings.catch_warnings():  # the typed storage a tensor pickles, as torch does
        warnings.simplefilter("ignore", UserWarning)
        typed = torch.TypedStorage(wrap_storage=values.untyped_storage(), dtype=torch.float32)

    class SavedOnNpu:
        def __reduce_ex__(self, protocol):
            return (_rebuild_npu_tensor, (typed, 0, (2, 3), (3, 1), False,
                                          collections.OrderedDict(), True))

    path = tmp_path / "npu.pt"
    torch.save(SavedOnNpu(), path)
    for module in (package, utils, storage):
        monkeypatch.delitem(sys.modules, module.__name__)
    assert torch.equal(msprobe.load_tensor(path), values)


def test_not_an_msprobe_or_opforge_dump(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code, out = _compare(tmp_path / "empty", FIXTURES / "l0_tensor/clean", capsys)
    assert code == 2 and "not an opforge dump" in out


def test_csv_has_msprobe_s_columns_and_one_row_per_entry(tmp_path, capsys):
    import csv

    path = tmp_path / "compare.csv"
    code, _ = _compare(FIXTURES / "l0_tensor/clean", FIXTURES / "l0_tensor/perturbed", capsys,
                       "--csv", str(path))
    rows = list(csv.DictReader(path.open()))
    step = msprobe.read_step(FIXTURES / "l0_tensor/clean" / TENSOR_STEP)
    assert code == 1 and len(rows) == len(step.manifest["entries"])
    first = next(row for row in rows if row["Result"] == "diverged")
    assert first["NPU Name"] == "layers.1.fc2.weight#0.forward.parameter.0"
    assert first["Data_name"] == "Module.layers.1.fc2.Linear.forward.0.parameters.weight.pt"
    assert float(first["MaxAbsErr"]) == pytest.approx(0.5)
    assert {"Cosine", "EucDist", "One Thousandth Err Ratio", "Bench l2norm"} <= rows[0].keys()


def test_an_opforge_api_dump_against_msprobe_s_mix_dump(tmp_path, capsys):
    """opforge's dump with parameters, output gradients and APIs holds what msprobe's mix
    level does under the same keys (the functionals' and torch functions' counters, the
    parameters and their gradients): more than a hundred entries compared, the planted
    weight named as the linear's input 1 in layers.1.fc2."""
    for variant, perturbed in (("clean", False), ("perturbed", True)):
        model, batch = _fixture_model(perturbed)
        with dump(model, tmp_path / variant, parameters=True, output_grads=True,
                  apis=True) as dumper:
            model(batch()).square().sum().backward()
            dumper.step()
    reference = msprobe.read_step(FIXTURES / "mix_statistics/clean" / TENSOR_STEP)
    ours = read_step(step_folders(tmp_path / "clean")[0])
    shared = {e["key"] for e in ours.manifest["entries"]} & \
        {e["key"] for e in reference.manifest["entries"]}
    assert len(shared) > 100
    code, out = _compare(tmp_path / "clean", FIXTURES / "mix_statistics/clean", capsys,
                         "--intersection")
    assert code == 0, out
    code, out = _compare(FIXTURES / "mix_statistics/clean", tmp_path / "perturbed", capsys,
                         "--intersection")
    assert code == 1
    assert "first divergent module Functional.linear (in layers.1.fc2)" in out, out
