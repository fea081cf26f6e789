"""The training anomaly monitor: planted NaN and fp16 overflow found at the right module and
step, nothing in a healthy run, hooks harmless and removed."""

from __future__ import annotations

import json
import math

import pytest
import torch

from opforge.precision.monitor import Monitor


class Poison(torch.nn.Module):
    """Identity that plants a value at one step."""

    def __init__(self, value: float, at_step: int) -> None:
        super().__init__()
        self.value, self.at_step, self.calls = value, at_step, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls - 1 == self.at_step:
            x = x.clone()
            x.view(-1)[0] = self.value
        return x


def _model(dtype: torch.dtype = torch.float32, poison: torch.nn.Module | None = None):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 16), torch.nn.GELU(), poison or torch.nn.Identity(),
              torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)]
    return torch.nn.Sequential(*layers).to(dtype)


def _train(model: torch.nn.Module, mon: Monitor, steps: int, dtype=torch.float32) -> None:
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(4, 8, generator=generator).to(dtype)
        model(x).float().sum().backward()
        mon.step()
        model.zero_grad()


def test_healthy_run_raises_nothing(tmp_path):
    model = _model()
    with Monitor(model, log_path=tmp_path / "alerts.jsonl") as mon:
        _train(model, mon, 6)
    assert mon.alerts == [] and mon.steps == 6
    assert "no anomalies" in mon.summary()
    assert not (tmp_path / "alerts.jsonl").exists()


def test_planted_nan_is_found_at_its_origin(tmp_path):
    model = _model(poison=Poison(float("nan"), at_step=3))
    seen = []
    with Monitor(model, callbacks=[seen.append], log_path=tmp_path / "a.jsonl") as mon:
        _train(model, mon, 5)
    nans = [a for a in mon.alerts if a.kind == "nan"]
    assert nans, mon.summary()
    first = nans[0]
    # The NaN appears in the output of module "2" (the poison) at step 3, not downstream.
    assert (first.module, first.phase, first.io, first.step) == ("2", "forward", "output", 3)
    assert all(a.step == 3 for a in nans) and seen == mon.alerts
    def strict_constant(name: str) -> None:
        raise AssertionError(f"bare {name} in the log: not strict JSON")

    logged = [json.loads(line, parse_constant=strict_constant)
              for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert logged[0]["module"] == "2" and logged[0]["rank"] is None
    assert "| nan | 3 |" in mon.summary()
    # Non-finite statistics are written as strings that float() reads back.
    for record, alert in zip(logged, mon.alerts, strict=True):
        value = float(record["value"])
        assert value == alert.value or (math.isnan(value) and math.isnan(alert.value))


def test_planted_fp16_overflow():
    class Amplify(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return x * (1e6 if self.calls == 3 else 1.0)   # fp16 max is 65504

    model = _model(torch.float16, poison=Amplify())
    with Monitor(model) as mon:
        for step in range(4):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step)).half()
            model(x)
            mon.step()
    overflow = [a for a in mon.alerts if a.kind == "overflow"]
    assert overflow and (overflow[0].module, overflow[0].step) == ("2", 2), mon.summary()


def test_backward_nan_origin():
    class BadGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad * float("nan")

    class Layer(torch.nn.Module):
        def forward(self, x):
            return BadGrad.apply(x)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), Layer(), torch.nn.Linear(4, 1))
    with Monitor(model) as mon:
        model(torch.randn(2, 4)).sum().backward()
        mon.step()
    backward = [a for a in mon.alerts if a.phase == "backward"]
    assert backward and backward[0].kind == "nan"
    # Layer's backward makes the first NaN gradient: the gradient of its input.
    assert (backward[0].module, backward[0].io) == ("1", "input"), mon.summary()


def test_spike_rule():
    model = _model(poison=Poison(1e4, at_step=5))
    with Monitor(model, spike_threshold=4.0, warmup=2) as mon:
        _train(model, mon, 6)
    spikes = [a for a in mon.alerts if a.kind == "spike"]
    assert spikes and (spikes[0].step, spikes[0].module) == (5, "2"), mon.summary()


def test_gradient_norm_and_loss_scale_rules():
    model = _model()
    generator = torch.Generator().manual_seed(2)
    with Monitor(model, spike_threshold=4.0, warmup=2, min_loss_scale=1.0) as mon:
        for step in range(6):
            loss = model(torch.randn(4, 8, generator=generator)).sum()
            (loss * (1e3 if step == 4 else 1.0)).backward()   # an exploding gradient
            mon.step(loss_scale=0.5 if step == 5 else 2.0**16)
            model.zero_grad()
    by_kind = {a.kind: a for a in mon.alerts}
    assert by_kind["grad_norm"].step == 4 and by_kind["loss_scale"].step == 5, mon.summary()
    assert {a.kind for a in mon.alerts} <= {"grad_norm", "loss_scale", "spike"}
    limited = Monitor(model, grad_norm_limit=1e-9)
    with limited:
        model(torch.randn(4, 8)).sum().backward()
        limited.step()
    assert [a.kind for a in limited.alerts] == ["grad_norm"]


def test_monitor_changes_nothing_and_removes_its_hooks():
    model = _model()
    x = torch.randn(3, 8, requires_grad=True)
    expected = model(x)
    expected.sum().backward()
    expected_grad = x.grad.clone()
    x.grad = None
    with Monitor(model) as mon:
        out = model(x)
        out.sum().backward()
        mon.step()
    assert torch.equal(out, expected) and torch.equal(x.grad, expected_grad)
    assert all(not m._forward_hooks for m in model.modules())


def test_failing_callback_does_not_stop_training():
    def broken(alert):
        raise RuntimeError("callback bug")

    model = _model(poison=Poison(float("inf"), at_step=0))
    with Monitor(model, callbacks=[broken]) as mon:
        _train(model, mon, 1)
    assert mon.alerts[0].kind == "inf"


def test_tensor_stats_match_hand_computed_values():
    from opforge.precision.monitor import STATS, tensor_stats

    x = torch.tensor([[1.0, -2.0], [3.0, 70000.0]])
    fast = dict(zip(STATS, tensor_stats(x).tolist()))
    assert len(fast) == 2
    assert fast["norm"] == pytest.approx(float(x.norm()))
    assert fast["max_abs"] == fast["norm"]      # float32: the norm stands for max |x|
    half = dict(zip(STATS, tensor_stats(torch.tensor([1.0, -3000.0, 2.0]).half()).tolist()))
    assert half["max_abs"] == 3000.0
    assert half["norm"] == pytest.approx(math.sqrt(1 + 3000.0**2 + 4))
    full = dict(zip(STATS, tensor_stats(x, detailed=True).tolist()))
    assert (full["min"], full["max"]) == (-2.0, 70000.0)
    assert full["mean"] == pytest.approx((1 - 2 + 3 + 70000) / 4)
    # NaN and Inf propagate into the norm, so the fast pair sees them.
    assert math.isinf(tensor_stats(torch.tensor([1.0, float("inf")]))[0])
    assert math.isinf(tensor_stats(torch.tensor([float("inf"), float("-inf"), 1.0]))[0])
    assert math.isnan(tensor_stats(torch.tensor([1.0, float("nan")]))[0])
    x[0, 0] = float("nan")
    x[0, 1] = float("inf")
    full = dict(zip(STATS, tensor_stats(x, detailed=True).tolist()))
    assert (full["nan"], full["inf"]) == (1.0, 1.0)
    assert full["near_overflow"] == 0.25      # 70000 > 65504 / 2, finite
    tiny = tensor_stats(torch.tensor([1e-6, 0.0, 1.0, 2.0]), detailed=True)
    assert dict(zip(STATS, tiny.tolist()))["near_underflow"] == 0.25   # below fp16 tiny


def test_detailed_mode_reports_counts():
    model = _model(poison=Poison(float("nan"), at_step=1))
    with Monitor(model, detailed=True) as mon:
        _train(model, mon, 2)
    first = next(a for a in mon.alerts if a.kind == "nan")
    assert (first.module, first.step, first.value) == ("2", 1, 1.0)


def test_internal_failure_never_reaches_the_training_loop(monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("statistics bug")

    monkeypatch.setattr("opforge.precision.monitor._stat_scalars", broken)
    model = _model()
    with caplog.at_level("ERROR", logger="opforge"), Monitor(model) as mon:
        _train(model, mon, 3)
    assert mon.steps == 3 and mon.alerts == []
    assert sum("recording failed" in r.getMessage() for r in caplog.records) == 1


def test_alerts_carry_the_distributed_rank(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}",
                            rank=0, world_size=1)
    try:
        model = _model(poison=Poison(float("nan"), at_step=0))
        with Monitor(model) as mon:
            _train(model, mon, 1)
        assert mon.alerts and all(a.rank == 0 for a in mon.alerts)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("factor", [1.0, 1e-6])
def test_detailed_mode_keeps_the_gradients_nearest_underflow(factor):
    """Scaling the loss by 1e-6 pushes the gradients below float16's normal range: the
    peak share says so, and names a gradient (backward) record and its step."""
    model = _model()
    generator = torch.Generator().manual_seed(1)
    with Monitor(model, detailed=True) as mon:
        for _ in range(2):
            (model(torch.randn(4, 8, generator=generator)).sum() * factor).backward()
            mon.step()
            model.zero_grad()
    peak = mon.peaks["near_underflow"]
    assert peak.phase == "backward" and peak.step in (0, 1)
    if factor == 1.0:
        assert peak.value < 0.05
    else:
        assert peak.value > 0.9
    assert "near_overflow" in mon.peaks
    assert Monitor(model).peaks == {}


def _nan_at(step: int):
    """Inputs of 4 features with a NaN at the given step."""
    generator = torch.Generator().manual_seed(3)
    for i in range(step + 1):
        x = torch.randn(2, 4, generator=generator)
        if i == step:
            x[0, 0] = float("nan")
        yield x


def test_an_inference_mode_pass_does_not_stop_monitoring(caplog):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with caplog.at_level("ERROR", logger="opforge"), Monitor(model) as mon:
        for i, x in enumerate(_nan_at(2)):
            if i == 0:
                with torch.inference_mode():
                    model(torch.randn(2, 4))
            model(x).sum().backward()
            mon.step()
    assert not caplog.records
    nans = [a for a in mon.alerts if a.kind == "nan"]
    assert nans and (nans[0].module, nans[0].phase, nans[0].step) == ("0", "forward", 2)


def test_inference_tensors_are_measured_after_in_place_changes():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(inplace=True))
    with Monitor(model) as mon, torch.inference_mode():
        model(torch.full((2, 4), -1.0))
        records = list(mon._records)
        mon.step()
    # The Linear's output is the ReLU's input, then zeroed in place: measured twice.
    linear_out = next(r for r in records if (r.module, r.io) == ("0", "output"))
    relu_out = next(r for r in records if (r.module, r.io) == ("1", "output"))
    assert linear_out.stats is not relu_out.stats


def test_float16_gradient_norm_is_accumulated_in_float32():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(300, 300)).half()
    with Monitor(model) as mon:
        (model(torch.randn(64, 300).half()).float().sum() * 100).backward()
        expected = torch.stack([p.grad.float().norm() for p in model.parameters()]).norm()
        assert all(p.grad.isfinite().all() for p in model.parameters())
        assert expected > torch.finfo(torch.float16).max   # a float16 norm would be Inf
        assert float(mon._grad_norm()) == pytest.approx(float(expected), rel=1e-4)
        mon.step()
    assert not [a for a in mon.alerts if a.kind == "grad_norm"], mon.summary()


@pytest.mark.parametrize("dtype, value", [(torch.float64, 1e20), (torch.float64, 1e150),
                                          (torch.float32, 1e18), (torch.bfloat16, 1e18)],
                         ids=str)
def test_large_finite_values_are_not_inf(dtype, value):
    """Float64 tensors keep their float64 sums (casting them to float32 made every value
    above 1.8e19 an Inf), the others accumulate in float32: finite values whose squares
    fit the accumulator give the exact norm, mean and max |x| (the norm, its bound, for
    float32/float64) and no inf or overflow alert."""
    from opforge.precision.monitor import STATS, tensor_stats

    x = torch.full((3, 4), value, dtype=dtype)
    x[0, 0] = -value / 2
    exact = float(x.double().norm())
    for detailed in (False, True):
        stats = dict(zip(STATS, tensor_stats(x, detailed=detailed).tolist()))
        assert stats["norm"] == pytest.approx(exact, rel=1e-5)
        low = dtype == torch.bfloat16
        assert stats["max_abs"] == (float(x.double().abs().max()) if low else stats["norm"])
    stats = dict(zip(STATS, tensor_stats(x, detailed=True).tolist()))
    assert stats["mean"] == pytest.approx(float(x.double().mean()), rel=1e-5)
    assert (stats["nan"], stats["inf"]) == (0.0, 0.0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4)).to(dtype)
    with Monitor(model) as mon:
        model(x)
        mon.step()
    assert not [a for a in mon.alerts if a.kind in ("inf", "overflow") and a.io == "input"]


def test_backward_nan_made_by_a_parent_names_the_parent():
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.proj(x)
            return torch.sqrt(h * h)        # its gradient is NaN where h == 0

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), Block(), torch.nn.Linear(4, 4))
    with torch.no_grad():
        model[1].proj.weight.zero_()
        model[1].proj.bias.zero_()
    with Monitor(model) as mon:
        model(torch.randn(2, 4)).sum().backward()
        mon.step()
    nan = next(a for a in mon.alerts if a.kind == "nan")
    # Block's output gradient is finite and its input gradient is NaN; its child proj
    # received a NaN output gradient and only propagated it.
    assert (nan.module, nan.phase, nan.io) == ("1", "backward", "input"), mon.summary()


def test_a_bad_loss_gradient_is_named_at_the_model_output():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)).half()
    with Monitor(model) as mon:
        (model(torch.randn(4, 16).half()).float().sum() * 1e6).backward()  # fp16 max 65504
        mon.step()
    overflow = next(a for a in mon.alerts if a.kind == "overflow")
    assert (overflow.module, overflow.phase, overflow.io) == ("", "backward", "output")


class Shared(torch.nn.Module):
    """One layer called twice a step, at very different scales."""

    def __init__(self, spike_at: int | None = None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 8)
        self.spike_at, self.calls = spike_at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls - 1 == self.spike_at:
            x = x * 100
        return self.layer(x) + self.layer(x * 300)


def test_spike_history_is_per_call_and_warmup_counts_steps():
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    for spike_at, expected in ((None, []), (6, [6])):
        model = Shared(spike_at)
        with Monitor(model) as mon:
            for _ in range(8):
                model(torch.randn(4, 8, generator=generator)).sum().backward()
                mon.step()
        assert [a.step for a in mon.alerts if a.kind == "spike"] == expected, mon.summary()
    # Warm-up counts steps: after one step every record has been seen once, not twice.
    assert set(mon._seen.values()) == {8}


def test_an_eval_pass_keeps_the_training_calls_history():
    """A no-grad eval pass before the training forward of every other step: its calls are
    counted apart, so the training records keep their keys (and spike histories) and the
    eval records have their own."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    with Monitor(model) as mon:
        keys = []
        for step in range(4):
            if step % 2:
                with torch.no_grad():
                    model(100 * torch.randn(4, 8, generator=generator))
            model(torch.randn(4, 8, generator=generator)).sum().backward()
            keys.append({r.key for r in mon._records if r.graph})
            evals = {r.key for r in mon._records if not r.graph}
            mon.step()
    assert keys[0] == keys[1] == keys[2] == keys[3]
    assert evals and not evals & keys[0]
    assert not [a for a in mon.alerts if a.kind == "spike"], mon.summary()


def test_activation_checkpointing_adds_no_forward_records():
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    def records(checkpointed: bool) -> list[tuple[str, int, str, str, int]]:
        model = torch.nn.Sequential(*layers)
        with Monitor(model) as mon:
            x = torch.randn(4, 8, requires_grad=True)
            for layer in layers:
                x = checkpoint(layer, x, use_reentrant=False) if checkpointed else layer(x)
            x.sum().backward()
            keys = [r.key for r in mon._records]
            mon.step()
        return keys

    assert sorted(records(True)) == sorted(records(False))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_model_split_over_devices_is_analysed():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))

    class Split(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = model[0], model[1].cuda()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.second(self.first(x).cuda())

    split = Split()
    with Monitor(split) as mon:
        for x in _nan_at(1):
            split(x).sum().backward()
            mon.step()
    nans = [a for a in mon.alerts if a.kind == "nan"]
    assert nans and (nans[0].module, nans[0].step) == ("first", 1), mon.summary()


def _adam_run(steps: int, optimizer_hook=None) -> tuple[Monitor, torch.nn.Module]:
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(3)
    with Monitor(model, optimizer=optimizer) as mon:
        for step in range(steps):
            if optimizer_hook is not None:
                optimizer_hook(step, model, optimizer)
            model(torch.randn(4, 8, generator=generator)).sum().backward()
            optimizer.step()
            mon.step()
            optimizer.zero_grad()
    return mon, model


def test_optimizer_statistics_are_each_parameter_s_update_ratio_and_state_norms():
    """After an Adam step: every parameter's |dw| / |w| and the norms of its moments, the
    ratio what a copy taken before the step gives."""
    before = {}

    def keep(step, model, optimizer):
        before.update({name: p.detach().clone() for name, p in model.named_parameters()})

    mon, model = _adam_run(3, keep)
    names = {name for name, _ in model.named_parameters()}
    assert set(mon.optimizer_stats) == names and mon.alerts == []
    for name, parameter in model.named_parameters():
        stats = mon.optimizer_stats[name]
        assert {"update_ratio", "exp_avg_norm", "exp_avg_sq_norm"} <= stats.keys()
        expected = (parameter.detach() - before[name]).norm() / before[name].norm()
        assert stats["update_ratio"] == pytest.approx(float(expected), rel=1e-5)
        assert 0 < stats["update_ratio"] < 1


def test_a_nan_in_the_optimizer_state_is_named():
    def poison(step, model, optimizer):
        if step == 2:
            optimizer.state[model[0].weight]["exp_avg"][0, 0] = float("nan")

    mon, _ = _adam_run(4, poison)
    alert = next(a for a in mon.alerts if a.kind == "optimizer_state")
    assert (alert.module, alert.io, alert.step) == ("0.weight", "exp_avg_norm", 2)


def test_an_update_spike_after_the_warmup_is_found():
    """The learning rate raised 10^4-fold at step 6: an update alert that step, none
    before (the first steps of Adam are the warm-up's)."""
    def raise_lr(step, model, optimizer):
        if step == 6:
            for group in optimizer.param_groups:
                group["lr"] *= 1e4

    mon, _ = _adam_run(7, raise_lr)
    updates = [a for a in mon.alerts if a.kind == "update"]
    assert updates and all(a.step == 6 for a in updates), mon.summary()
