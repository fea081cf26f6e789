"""core/autotune.py: measured tiling choice among the candidates that fit, its file of
choices, and the calls it must not time. The Triton kernels run in the interpreter; the
timer is replaced where a test needs a given ranking."""

from __future__ import annotations

import csv
import dataclasses
import json
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import opforge
from opforge.core import autotune
from opforge.core.errors import ShapeError
from opforge.core.opdef import Case, OpDef
from opforge.core.plan import _observer, set_run_observer
from opforge.ops.mla_prolog import MLA_PROLOG, mla_inputs

from .conftest import DEVICE, assert_golden


@pytest.fixture(autouse=True)
def fresh(tmp_path, monkeypatch) -> Iterator[None]:
    """A choices file of the test's own, no choices or plans left from other tests."""
    monkeypatch.setenv("OPFORGE_AUTOTUNE_CACHE", str(tmp_path / "autotune.json"))
    monkeypatch.delenv("OPFORGE_AUTOTUNE", raising=False)
    monkeypatch.delenv("OPFORGE_AUTOTUNE_MAX", raising=False)
    autotune.set_autotune(None)
    autotune.clear_tuning()
    opforge.clear_caches()
    yield
    autotune.clear_tuning()
    autotune.set_autotune(None)
    opforge.clear_caches()


def _operands() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(48, 40, generator=generator).to(DEVICE),
            torch.randn(40, 24, generator=generator).to(DEVICE))


def _candidates(a: torch.Tensor, b: torch.Tensor, op: str = "matmul",
                **attrs: object) -> list[str]:
    """The distinct fitting tilings of the inputs' bucket on the current hardware profile,
    in preference order (the order autotuning times them in)."""
    from opforge.core.opdef import bucket_specs
    from opforge.core.plan import validate

    opdef = opforge.get_op(op)
    signature = validate(opdef, [a, b, *attrs.pop("more", ())], attrs)
    hardware = opforge.profile_for(a.device)
    names = [autotune.describe(t)
             for t in opdef.tiling(bucket_specs(signature.inputs),
                                   bucket_specs(signature.outputs), signature.attrs, hardware)
             if t.onchip_bytes <= hardware.onchip_limit(t.double_buffered)]
    return list(dict.fromkeys(names))


def _ranked(monkeypatch, seconds: list[float | Exception], op: str | None = None
            ) -> list[int]:
    """Replace the timer: the n-th candidate timed takes ``seconds[n]`` (or raises it).
    With ``op``, only that operator's candidates follow ``seconds``; the operators it
    tunes inside its own candidates' runs (a composite's steps) take 1 s per candidate,
    so their first fitting candidate wins. Returns the list the calls are counted in."""
    calls: list[int] = []
    tuning: list[str] = []
    measure = autotune._measure

    def tracked(name, *args):
        tuning.append(name)
        try:
            return measure(name, *args)
        finally:
            tuning.pop()

    def timer(run, device):
        run()
        if op is not None and tuning[-1] != op:
            return 1.0
        calls.append(1)
        value = seconds[len(calls) - 1]
        if isinstance(value, Exception):
            raise value
        return value

    monkeypatch.setattr(autotune, "_measure", tracked)
    monkeypatch.setattr(autotune, "_seconds", timer)
    return calls


def _assert_product(result: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """Within 4 eps of the output dtype of the float64 product, relative to the largest
    |a| @ |b| (float32 accumulation of K products)."""
    golden = a.double() @ b.double()
    bound = 4 * torch.finfo(result.dtype).eps * (a.double().abs() @ b.double().abs()).max()
    assert (result.double() - golden).abs().max() <= bound


def test_autotuning_keeps_the_fastest_candidate_and_its_result_is_right(monkeypatch):
    a, b = _operands()
    names = _candidates(a, b)
    assert len(names) >= 3, names
    _ranked(monkeypatch, [3e-3, 1e-3, 2e-3, *[5e-3] * len(names)])
    with opforge.use_backend("triton"), opforge.autotuning():
        plan = opforge.plan("matmul", a, b)
        _assert_product(plan.run(a, b), a, b)
    assert autotune.describe(plan.tiling) == names[1]
    (record,) = opforge.tuning_records()
    assert (record.op, record.choice, record.source) == ("matmul", names[1], "measured")
    assert list(record.timings_us) == names[:autotune.max_candidates()]
    assert record.timings_us[names[1]] == pytest.approx(1e3)


def test_without_autotuning_the_first_fitting_candidate_runs_untimed(monkeypatch):
    a, b = _operands()
    calls = _ranked(monkeypatch, [1.0] * 20)
    with opforge.use_backend("triton"):
        plan = opforge.plan("matmul", a, b)
        _assert_product(plan.run(a, b), a, b)
    assert autotune.describe(plan.tiling) == _candidates(a, b)[0]
    assert calls == [] and opforge.tuning_records() == []


def test_a_stored_choice_is_reused_by_a_later_process_without_timing(monkeypatch, tmp_path):
    a, b = _operands()
    names = _candidates(a, b)
    _ranked(monkeypatch, [2e-3, 3e-3, 1e-3, *[5e-3] * len(names)])
    with opforge.use_backend("triton"), opforge.autotuning():
        opforge.plan("matmul", a, b)
    stored = json.loads((tmp_path / "autotune.json").read_text())
    (entry,) = stored.values()
    assert entry["choice"] == names[2]
    # A later process: nothing in memory, the file on disk.
    autotune.clear_tuning()
    opforge.clear_caches()
    calls = _ranked(monkeypatch, [])
    with opforge.use_backend("triton"), opforge.autotuning():
        plan = opforge.plan("matmul", a, b)
        _assert_product(plan.run(a, b), a, b)
    assert autotune.describe(plan.tiling) == names[2] and calls == []
    assert opforge.tuning_records()[-1].source == "file"


def test_a_failing_candidate_is_skipped_and_recorded(monkeypatch):
    a, b = _operands()
    names = _candidates(a, b)
    _ranked(monkeypatch, [RuntimeError("out of resource: shared memory"), 2e-3,
                          *[5e-3] * len(names)])
    with opforge.use_backend("triton"), opforge.autotuning():
        plan = opforge.plan("matmul", a, b)
    assert autotune.describe(plan.tiling) == names[1]
    timings = opforge.tuning_records()[-1].timings_us
    assert timings[names[0]] == "RuntimeError: out of resource: shared memory"


def test_an_input_error_during_tuning_is_raised_not_skipped(monkeypatch):
    a, b = _operands()
    _ranked(monkeypatch, [ShapeError("bad", op="matmul", param="a", expected=1, got=2)])
    with opforge.use_backend("triton"), opforge.autotuning(), pytest.raises(ShapeError):
        opforge.plan("matmul", a, b)


def test_the_candidate_count_is_capped(monkeypatch):
    a, b = _operands()
    assert len(_candidates(a, b)) > 2
    monkeypatch.setenv("OPFORGE_AUTOTUNE_MAX", "2")
    calls = _ranked(monkeypatch, [2e-3, 1e-3])
    with opforge.use_backend("triton"), opforge.autotuning():
        opforge.plan("matmul", a, b)
    assert len(calls) == 2 and len(opforge.tuning_records()[-1].timings_us) == 2


def test_the_setting_nests_follows_the_environment_and_keys_the_plan_cache(monkeypatch):
    assert not autotune.autotune_enabled()
    monkeypatch.setenv("OPFORGE_AUTOTUNE", "1")
    assert not autotune.autotune_enabled()  # read once, and again by set_autotune(None)
    opforge.set_autotune(None)
    assert autotune.autotune_enabled()
    with opforge.autotuning(False):
        assert not autotune.autotune_enabled()
        with opforge.autotuning():
            assert autotune.autotune_enabled()
        assert not autotune.autotune_enabled()
    opforge.set_autotune(False)
    assert not autotune.autotune_enabled()
    opforge.set_autotune(None)
    assert autotune.autotune_enabled()
    monkeypatch.delenv("OPFORGE_AUTOTUNE")
    opforge.set_autotune(None)
    a, b = _operands()
    _ranked(monkeypatch, [3e-3, 1e-3, *[5e-3] * 20])
    with opforge.use_backend("triton"):
        untuned = opforge.plan("matmul", a, b)
        with opforge.autotuning():
            tuned = opforge.plan("matmul", a, b)
        assert opforge.plan("matmul", a, b) is untuned
    assert tuned.tiling != untuned.tiling


def test_calls_that_must_not_be_timed_are_not():
    x = torch.randn(4, 8)
    assert autotune.tunable([x, None], reruns_alike=True)
    assert not autotune.tunable([x], reruns_alike=False)
    assert not autotune.tunable([x.to("meta")], reruns_alike=True)
    assert not autotune.tunable([None], reruns_alike=True)
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(x)
    assert not autotune.tunable([fake], reruns_alike=True)


def _reading_caches() -> OpDef:
    """mla_prolog as if it read its caches before writing them (not write-only)."""
    inputs = tuple(dataclasses.replace(arg, write_only=False) for arg in MLA_PROLOG.inputs)
    return dataclasses.replace(MLA_PROLOG, name="mla_prolog_reading_caches", inputs=inputs)


def test_which_operators_rerun_alike():
    assert MLA_PROLOG.mutated_inputs == (10, 11) and MLA_PROLOG.reruns_alike
    assert opforge.get_op("matmul").reruns_alike  # updates nothing
    assert not _reading_caches().reruns_alike


def _mla_call(tokens: int) -> tuple[torch.Tensor, ...]:
    return mla_inputs(tokens, torch.float32, DEVICE, torch.Generator().manual_seed(3))


def test_an_operator_that_overwrites_its_caches_is_tuned_and_leaves_them_as_one_run(
        monkeypatch):
    """mla_prolog's caches are only written (rows scattered into them): the candidates run
    on the call's caches, which end as one run of the chosen tiling leaves them. A decode
    step times the fused query kernel against the matmul, norm and rope steps."""
    inputs = _mla_call(5)
    names = _candidates(*inputs[:2], op="mla_prolog", more=inputs[2:])
    variants = [name.split()[0] for name in names]
    assert variants[0] == "fused_kv_query" and "fused_kv" in variants, names
    steps = variants.index("fused_kv")
    monkeypatch.setenv("OPFORGE_AUTOTUNE_MAX", str(steps + 1))
    # The steps path is the fastest: the choice that differs from the untuned one.
    _ranked(monkeypatch, [2e-3] * steps + [1e-3], op="mla_prolog")
    fresh = [t.clone() for t in inputs]
    with opforge.use_backend("triton"), opforge.autotuning():
        tuned = opforge.mla_prolog(*inputs)
        plan = opforge.plan("mla_prolog", *inputs)
        once = plan.run(*fresh)
    (record,) = [r for r in opforge.tuning_records() if r.op == "mla_prolog"]
    assert record.choice == names[steps] == autotune.describe(plan.tiling)
    assert list(record.timings_us) == names[:steps + 1]
    for got, want in zip([*tuned, *inputs[10:]], [*once, *fresh[10:]]):
        assert torch.equal(got, want)


def _token_x_in_the_cache() -> list[torch.Tensor]:
    """A call whose token_x views kv_cache rows that its slots overwrite."""
    inputs = list(_mla_call(5))
    kv_cache = inputs[10].clone()
    x = kv_cache.view(-1)[:inputs[0].numel()].view(inputs[0].shape)
    x.copy_(inputs[0])
    inputs[0], inputs[10], inputs[11] = x, kv_cache, inputs[11].clone()
    inputs[9] = torch.arange(0, 10, 2, device=DEVICE)
    return inputs


def test_caches_that_hold_an_input_are_not_tuned(monkeypatch):
    """A rerun would read the rows the first run wrote over token_x."""
    expected = _token_x_in_the_cache()
    calls = _ranked(monkeypatch, [1e-3] * 16, op="mla_prolog")
    with opforge.use_backend("triton"):
        reference = opforge.mla_prolog(*expected)
        inputs = _token_x_in_the_cache()
        with opforge.autotuning():
            result = opforge.mla_prolog(*inputs)
    assert not calls and all(r.op != "mla_prolog" for r in opforge.tuning_records())
    for got, want in zip(result, reference):
        assert torch.equal(got, want)


def test_an_operator_that_updates_an_input_from_what_it_holds_is_not_tuned(monkeypatch):
    toy = _reading_caches()
    inputs = _mla_call(5)
    expected = [t.clone() for t in inputs]
    calls = _ranked(monkeypatch, [1e-3] * 16, op=toy.name)
    with opforge.use_backend("triton"):
        untuned = opforge.plan(toy, *expected)
        reference = untuned.run(*expected)
        with opforge.autotuning():
            tuned = opforge.plan(toy, *inputs)
            result = tuned.run(*inputs)
    # Its inner matmul plans are tuned (they update nothing); the operator itself is not.
    assert not calls and all(r.op != toy.name for r in opforge.tuning_records())
    assert tuned.tiling == untuned.tiling
    for got, want in zip([*result, *inputs[10:]], [*reference, *expected[10:]]):
        assert torch.equal(got, want)


def test_tuning_runs_are_not_observed_and_an_unwritable_file_is_no_error(monkeypatch,
                                                                          tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("OPFORGE_AUTOTUNE_CACHE", str(blocker / "autotune.json"))
    a, b = _operands()
    _ranked(monkeypatch, [2e-3, 1e-3, *[5e-3] * 20])
    observed = []

    class Count:
        def __init__(self, plan):
            observed.append(plan.op.name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    previous = set_run_observer(Count)
    try:
        with opforge.use_backend("triton"), opforge.autotuning():
            plan = opforge.plan("matmul", a, b)
            _assert_product(plan.run(a, b), a, b)
    finally:
        set_run_observer(previous)
    assert observed == ["matmul"] and _observer[0] is previous
    assert opforge.tuning_records()[-1].choice == autotune.describe(plan.tiling)


def _first_of(names: list[str], variant: str) -> int:
    return next(i for i, name in enumerate(names) if name.split()[0] == variant)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_on_a_cuda_profile_autotuning_may_choose_the_descriptor_matmul(monkeypatch, dtype):
    """The CUDA tilings list the tensor-descriptor variants after the pointer kernel; a
    ranking that favours one makes the plan run it (in the interpreter here), with the
    product still right."""
    generator = torch.Generator().manual_seed(1)
    a = torch.randn(40, 72, generator=generator).to(DEVICE, dtype)
    b = torch.randn(72, 56, generator=generator).to(DEVICE, dtype)
    with opforge.use_hardware("h200"):
        names = _candidates(a, b)
        assert names[0].startswith("tiles ")
        assert {"tiles_tma", "tiles_tma_ws"} <= {name.split()[0] for name in names}
        winner = _first_of(names, "tiles_tma")
        _ranked(monkeypatch, [1e-3 if i == winner else 2e-3 for i in range(len(names))])
        with opforge.use_backend("triton"), opforge.autotuning():
            plan = opforge.plan("matmul", a, b)
            result = plan.run(a, b)
    assert autotune.describe(plan.tiling) == names[winner]
    _assert_product(result, a, b)


def test_on_a_cuda_profile_autotuning_may_choose_the_descriptor_attention(monkeypatch):
    generator = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 24, 64, generator=generator).to(DEVICE, torch.bfloat16)
               for _ in range(3))
    with opforge.use_hardware("h200"):
        names = _candidates(q, k, "attention", more=(v,), causal=True)
        assert names[0].startswith("flash ")
        assert {"flash_tma", "flash_tma_ws"} <= {name.split()[0] for name in names}
        winner = _first_of(names, "flash_tma")
        _ranked(monkeypatch, [1e-3 if i == winner else 2e-3 for i in range(len(names))])
        with opforge.use_backend("triton"), opforge.autotuning():
            plan = opforge.plan("attention", q, k, v, causal=True)
            out, lse = plan.run(q, k, v)
    assert autotune.describe(plan.tiling) == names[winner]
    assert_golden(plan.op, Case("descriptors", (q, k, v, None), {"causal": True}), (out, lse))


@pytest.mark.parametrize("field, value", [
    ("choice", "tiles BLOCK_M=999"),  # no longer a candidate (the tiling changed)
    ("choice", 5), ("timings_us", [1, 2]), ("timings_us", "abc"), ("timings_us", None),
    ("timings_us", 5), ("timings_us", {"x": [1]}),
])
def test_a_stale_or_malformed_stored_entry_is_timed_again(monkeypatch, tmp_path, field,
                                                          value):
    a, b = _operands()
    names = _candidates(a, b)
    _ranked(monkeypatch, [2e-3, 1e-3, *[5e-3] * len(names)])
    with opforge.use_backend("triton"), opforge.autotuning():
        opforge.plan("matmul", a, b)
    path = tmp_path / "autotune.json"
    stored = json.loads(path.read_text())
    for entry in stored.values():
        entry[field] = value
    path.write_text(json.dumps(stored))
    autotune.clear_tuning()
    opforge.clear_caches()
    calls = _ranked(monkeypatch, [1e-3, *[5e-3] * len(names)])
    with opforge.use_backend("triton"), opforge.autotuning():
        plan = opforge.plan("matmul", a, b)
    assert autotune.describe(plan.tiling) == names[0]
    assert len(calls) == min(len(names), autotune.max_candidates())
    assert opforge.tuning_records()[-1].source == "measured"
    (entry,) = json.loads(path.read_text()).values()
    assert entry["choice"] == names[0] and isinstance(entry["timings_us"], dict)


def test_a_choice_is_recorded_once_and_other_processes_choices_are_kept(monkeypatch,
                                                                      tmp_path):
    a, b = _operands()
    calls = _ranked(monkeypatch, [2e-3, 1e-3, *[5e-3] * 20])
    opforge.set_plan_cache(False)
    try:
        with opforge.use_backend("triton"), opforge.autotuning():
            for _ in range(3):
                opforge.plan("matmul", a, b)
    finally:
        opforge.set_plan_cache(True)
    assert len(opforge.tuning_records()) == 1
    timed = len(calls)
    path = tmp_path / "autotune.json"
    # Another process adds its choice after this one read the file.
    stored = json.loads(path.read_text())
    stored["other | bucket"] = {"choice": "tiles BLOCK_M=16", "timings_us": {}}
    path.write_text(json.dumps(stored))
    _ranked(monkeypatch, [1e-3, *[5e-3] * 20])
    with opforge.use_backend("triton"), opforge.autotuning():
        opforge.plan("matmul", a[:7], b)  # a new bucket
    assert timed > 0 and len(json.loads(path.read_text())) == 3
    assert not list(tmp_path.glob("*.tmp"))


def test_two_threads_planning_one_bucket_time_it_once(monkeypatch):
    a, b = _operands()
    names = _candidates(a, b)
    calls = _ranked(monkeypatch, [2e-3, 1e-3, *[5e-3] * (2 * len(names))])
    plans = []

    def plan() -> None:
        with opforge.use_backend("triton"), opforge.autotuning():
            plans.append(opforge.plan("matmul", a, b))

    threads = [threading.Thread(target=plan) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == min(len(names), autotune.max_candidates())
    assert plans[0].tiling == plans[1].tiling and len(opforge.tuning_records()) == 1


@pytest.mark.parametrize("text, enabled", [("1", True), ("yes", True), ("ON", True),
                                           ("0", False), ("false", False), ("no", False),
                                           ("off", False), ("", False)])
def test_the_environment_setting_is_an_on_off_word(monkeypatch, text, enabled):
    monkeypatch.setenv("OPFORGE_AUTOTUNE", text)
    opforge.set_autotune(None)
    assert autotune.autotune_enabled() is enabled


def test_bad_settings_are_errors(monkeypatch):
    monkeypatch.setenv("OPFORGE_AUTOTUNE", "maybe")
    with pytest.raises(ValueError, match="OPFORGE_AUTOTUNE"):
        opforge.set_autotune(None)
    monkeypatch.setenv("OPFORGE_AUTOTUNE", "0")
    opforge.set_autotune(None)
    for bad in ("0", "-1", "abc", "\u00b2", "1.5"):
        monkeypatch.setenv("OPFORGE_AUTOTUNE_MAX", bad)
        with pytest.raises(ValueError, match="OPFORGE_AUTOTUNE_MAX"):
            autotune.max_candidates()
    monkeypatch.setenv("OPFORGE_AUTOTUNE_MAX", " 3")
    assert autotune.max_candidates() == 3

    def traced(x: torch.Tensor) -> torch.Tensor:
        with opforge.autotuning():
            return x + 1

    with pytest.raises(Exception, match=r"autotuning inside a torch\.compile"):
        torch.compile(traced, backend="eager", fullgraph=True)(torch.ones(2))


def test_the_choices_file_follows_the_cache_directory(monkeypatch, tmp_path):
    monkeypatch.delenv("OPFORGE_AUTOTUNE_CACHE")
    monkeypatch.setenv("OPFORGE_CACHE_DIR", str(tmp_path / "cache"))
    assert autotune.cache_path() == tmp_path / "cache" / "autotune.json"
    monkeypatch.setenv("OPFORGE_AUTOTUNE_CACHE", "")
    assert autotune.cache_path() is None


def test_a_profile_leaves_the_tuning_out_of_the_operator_s_time(monkeypatch, tmp_path):
    """The candidate runs of a profiled first call are compile-time work: the operator's
    time is its own run's, and the report's notes say how long tuning took."""
    a, b = _operands()
    names = _candidates(a, b)

    def slow(run, device):
        run()
        time.sleep(0.1)
        return 1e-3

    monkeypatch.setattr(autotune, "_seconds", slow)
    with opforge.use_backend("triton"), opforge.autotuning(), \
            opforge.profile(tmp_path / "profile") as session:
        opforge.matmul(a, b)
    tuning_s = 0.1 * min(len(names), autotune.max_candidates())
    with open(tmp_path / "profile" / "op_statistic.csv") as handle:
        (row,) = [r for r in csv.DictReader(handle) if r["OP Type"] == "opforge::matmul"]
    assert float(row["Total Time(us)"]) * 1e-6 < tuning_s / 2
    assert any("autotuned" in note for note in session.result.meta.notes)
