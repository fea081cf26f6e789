"""Host cost of one opforge call, for every operator, beside its floor and its peers.

Tiny shapes, so that the device finishes each kernel long before the host issues the next
one: the time per call is the host's. On the CPU the Triton backend runs with kernel
launches stubbed out (the kernel's ``run`` counts and returns), so the figures are
opforge's own host path and the floor's, without Triton's launcher; on a GPU the launches
are real and each repeat ends with a synchronisation. Rows, per operator:

* ``torch eager``       the operator's torch peer (on the CPU it also computes)
* ``floor``             a bare ``torch.autograd.Function`` around the operator's launcher
                        with a held plan: allocate the outputs, launch (Liger-Kernel's
                        pattern, the least a PyTorch-facing kernel call costs)
* ``functional``        the operator as ``opforge.<op>`` calls it (`OpDef.__call__`)
* ``dispatched``        ``torch.ops.opforge.<op>``: the dispatcher's path (compiled graphs,
                        modes, subclasses)
* ``direct launch``     the launcher alone on held inputs, outputs and workspace
* ``run(out=)``         a held plan's ``run`` into held outputs
* ``floor fwd+bwd``, ``fwd+bwd``, ``torch eager fwd+bwd``: ``torch.autograd.grad`` through
  the floor (its backward replays the backward launches opforge makes), opforge, torch
* ``compiled torch``, ``compiled opforge``: ``torch.compile(fullgraph=True)`` of a function
  making the one call (opforge's operator, or its torch peer; a peer that breaks the graph
  is compiled without fullgraph, and its row says so); on a GPU ``compiled traced``
  compiles opforge's call with ``OPFORGE_TRACE_COMPILED=1``: traced into its kernel launches

The ratios the targets name (functional / floor, fwd+bwd / floor fwd+bwd, run(out=) /
direct launch, compiled opforge / compiled torch) are printed in a second table.

Usage::

    python benchmarks/host_overhead.py [--device cpu|cuda] [--ops softmax,gelu]
        [--calls 1000] [--repeats 7] [--no-compile]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import torch

import opforge
from opforge.core import backends
from opforge.core.opdef import Case, OpDef
from opforge.core.plan import Plan
from opforge.library import TRACE_VARIABLE
from opforge.ops.mla_prolog import mla_inputs
from opforge.profiler.results import environment, write_results


@contextlib.contextmanager
def stubbed_launches() -> Iterator[list[int]]:
    """The Triton backend on CPU tensors with every kernel launch replaced by a counter."""
    from opforge.ops.softmax import _softmax_rows_kernel

    kernel_type = type(_softmax_rows_kernel)  # JITFunction, or the interpreter's
    count = [0]

    def launch(self: Any, *args: Any, **kwargs: Any) -> None:
        count[0] += 1

    with mock.patch.object(kernel_type, "run", launch), \
            mock.patch.object(backends, "_triton_refusal", lambda device: None), \
            backends.use_backend("triton"):
        opforge.clear_caches()  # plans hold the backend they were made for
        yield count
    opforge.clear_caches()


def per_call_us(layers: dict[str, Callable[[], Any]], calls: int, repeats: int,
                device: torch.device) -> dict[str, float | str]:
    """Per layer, the least over ``repeats`` of the wall time of ``calls`` calls, per call,
    in µs, or the error its call raised: a host path's cost is its fastest repeat (a slower
    one met another process or the garbage collector). The repeats take the layers in turn,
    so that a drift of the machine's speed reaches every layer of an operator alike (timed
    one layer after the other, a row moved by up to 5 µs between runs of the same code)."""
    samples: dict[str, list[float]] = {}
    failed: dict[str, str] = {}
    for name, call in layers.items():
        try:
            for _ in range(max(10, calls // 10)):
                call()
            samples[name] = []
        except Exception as error:  # reported in its row, the other layers still run
            failed[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:80]}"
    for _ in range(repeats):
        for name in samples:
            call = layers[name]
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                call()
            if device.type == "cuda":
                torch.cuda.synchronize()
            samples[name].append((time.perf_counter() - start) / calls * 1e6)
    return {**failed, **{name: min(times) for name, times in samples.items()}}


# Every operator's common call, on shapes of a decode step or a small row block: the
# backward operators on what their forward's case saves (the smallest verification sample
# is often an edge case, a reduction over dim 0 or a transposed input, that copies).
def curated(device: torch.device) -> dict[str, Case]:
    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator).to(device)

    def saved(op: str, *inputs: torch.Tensor | None, **attrs: Any) -> list[torch.Tensor]:
        """Tensors of the shapes and dtypes of ``op``'s outputs (what a forward saves)."""
        return [torch.randn(spec.shape, generator=generator).to(device, spec.dtype)
                for spec in opforge.plan(op, *inputs, **attrs).outputs]

    x, grad, weight, bias = randn(8, 256), randn(8, 256), randn(256), randn(256)
    q, k, v = randn(1, 2, 16, 32), randn(1, 2, 16, 32), randn(1, 2, 16, 32)
    rows, cos, sin = randn(1, 2, 16, 64), randn(16, 64), randn(16, 64)
    hidden, classes = randn(8, 64), randn(256, 64)
    target = torch.randint(0, 256, (8,), generator=generator).to(device)
    _, rstd = saved("rms_norm", x, weight)
    _, mean, layer_rstd = saved("layer_norm", x, weight, bias, normalized_shape=[256])
    out, lse = saved("attention", q, k, v, None, causal=True)
    _, row_lse = saved("cross_entropy", x, target)
    _, head_lse = saved("fused_linear_cross_entropy", hidden, classes, target)
    loss = torch.ones((), device=device)
    router = randn(1, 64)
    chosen = torch.randperm(64, generator=generator)[:8].view(1, 8).to(device, torch.int32)
    return {
        "softmax": Case("8x256", (x,), {"dim": -1}),
        "softmax_backward": Case("8x256", (grad, x), {"dim": -1}),
        "log_softmax": Case("8x256", (x,), {"dim": -1}),
        "log_softmax_backward": Case("8x256", (grad, x), {"dim": -1}),
        "rms_norm": Case("8x256", (x, weight), {"eps": 1e-6}),
        "rms_norm_backward": Case("8x256", (grad, x, rstd, weight), {"eps": 1e-6}),
        "add_rms_norm": Case("8x256", (x, grad, weight), {"eps": 1e-6}),
        "layer_norm": Case("8x256", (x, weight, bias), {"normalized_shape": [256]}),
        "layer_norm_backward": Case("8x256", (grad, x, mean, layer_rstd, weight, bias),
                                    {"normalized_shape": [256]}),
        "gelu": Case("8x256", (x,), {}),
        "gelu_backward": Case("8x256", (grad, x), {}),
        "sigmoid": Case("8x256", (x,), {}),
        "sigmoid_backward": Case("8x256", (grad, x), {}),
        "silu": Case("8x256", (x,), {}),
        "silu_backward": Case("8x256", (grad, x), {}),
        "swiglu": Case("8x512", (randn(8, 512),), {}),
        "swiglu_backward": Case("8x512", (grad, randn(8, 512)), {}),
        "silu_mul": Case("8x256", (x, randn(8, 256)), {}),
        "silu_mul_backward": Case("8x256", (grad, x, randn(8, 256)), {}),
        "broadcast_add": Case("8x256+256", (x, bias), {}),
        "reduce_sum": Case("8x256 rows", (x,), {"dims": [-1]}),
        "matmul": Case("16x64@64x64", (randn(16, 64), randn(64, 64)), {}),
        "rope": Case("b1h2s16d64", (rows, cos, sin), {}),
        "rope_backward": Case("b1h2s16d64", (rows, cos, sin), {}),
        "attention": Case("b1h2s16d32", (q, k, v, None), {"causal": True}),
        "attention_backward": Case("b1h2s16d32", (randn(1, 2, 16, 32), q, k, v, out, lse, None,
                                                          None),
                                   {"causal": True}),
        "cross_entropy": Case("8x256", (x, target), {}),
        "cross_entropy_backward": Case("8x256", (loss, x, target, row_lse), {}),
        "fused_linear_cross_entropy": Case("8x64@256x64", (hidden, classes, target), {}),
        "fused_linear_cross_entropy_backward": Case("8x64@256x64",
                                                    (loss, hidden, classes, target,
                                                     head_lse), {}),
        # The functional's call: it resolves deterministic=None by torch's setting.
        "embedding_dense_grad": Case("t8 v256", (hidden, target),
                                     {"num_weights": 256, "deterministic": False}),
        "mla_prolog": Case("t16", mla_inputs(16, torch.float32, device, generator), {}),
        "moe_gating_top_k": Case("t1e256", (randn(1, 256), None),
                                 {"k": 8, "k_group": 4, "group_count": 8,
                                  "norm_type": 1}),
        "moe_gating_top_k_softmax": Case("t1e64", (randn(1, 64), None), {"k": 8}),
        "moe_gating_top_k_backward": Case("t1e64", (randn(1, 8), router, chosen, None),
                                          {"renormalised": True}),
    }


# Floating inputs a common call does not differentiate (rope's tables come from the
# rotary module's buffers); every other floating input requires grad in the fwd+bwd rows.
CONSTANT_INPUTS = {"rope": ("cos", "sin")}


def case_of(opdef: OpDef, device: torch.device) -> Case:
    chosen = curated(device).get(opdef.name)
    if chosen is not None:
        return chosen
    samples = opdef.samples(torch.float32, device, torch.Generator().manual_seed(0))
    sized = [c for c in samples if all(t is None or t.numel() for t in c.inputs)]
    return min(sized, key=lambda c: sum(t.numel() for t in c.inputs if t is not None))


# ---------------------------------------------------------------------------------------------
# The floor: the operator's own launches in a bare autograd.Function


Launch = tuple[OpDef, Plan, tuple[Any, ...], list[torch.Tensor], Any]


@contextlib.contextmanager
def recorded_launches(phases: dict[str, list[Launch]], phase: list[str]) -> Iterator[None]:
    """Record the outermost launcher call of every operator (a composite's steps run
    inside its own) into ``phases[phase[0]]``."""
    depth = [0]
    originals = {op: dict(op.launchers) for op in opforge.list_ops()}

    def recording(op: OpDef, launcher: Callable[..., None]) -> Callable[..., None]:
        def run(plan: Plan, inputs: Sequence[Any], outputs: Sequence[torch.Tensor],
                workspace: Any) -> None:
            if depth[0] == 0:
                phases.setdefault(phase[0], []).append(
                    (op, plan, tuple(inputs), list(outputs), workspace))
            depth[0] += 1
            try:
                launcher(plan, inputs, outputs, workspace)
            finally:
                depth[0] -= 1
        return run

    for op, launchers in originals.items():
        for name, launcher in launchers.items():
            op.launchers[name] = recording(op, launcher)
    opforge.clear_caches()
    try:
        yield
    finally:
        for op, launchers in originals.items():
            op.launchers.update(launchers)
        opforge.clear_caches()


def _replay(launches: Sequence[Launch]) -> list[torch.Tensor]:
    """Each launch into fresh outputs, as a hand-written launcher would allocate them."""
    made: list[torch.Tensor] = []
    for op, plan, inputs, outputs, workspace in launches:
        fresh = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in outputs]
        op.launchers[plan.backend](plan, inputs, fresh, workspace)
        made += fresh
    return made


def floor_function(forward: Sequence[Launch], backward: Sequence[Launch]
                   ) -> type[torch.autograd.Function]:
    """A bare ``autograd.Function`` making the recorded launches: the floor."""

    class Floor(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, *inputs: torch.Tensor) -> Any:
            ctx.shapes = [(t.shape, t.dtype) if isinstance(t, torch.Tensor) else None
                          for t in inputs]
            made = _replay(forward)
            return made[0] if len(made) == 1 else tuple(made)

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> Any:
            made = _replay(backward)
            result = []
            for spec, need in zip(ctx.shapes, ctx.needs_input_grad):
                match = next((t for t in made if spec is not None and need
                              and (t.shape, t.dtype) == spec), None)
                if match is not None:
                    made.remove(match)
                result.append(match)
            return tuple(result)

    return Floor


# ---------------------------------------------------------------------------------------------
# Rows


def _first(result: Any) -> torch.Tensor:
    return result[0] if isinstance(result, tuple) else result


def _compiled(function: Callable[..., Any], inputs: Sequence[Any], fullgraph: bool
              ) -> Callable[[], Any] | str:
    try:
        compiled = torch.compile(function, fullgraph=fullgraph, dynamic=False)
        compiled(*inputs)
        return lambda: compiled(*inputs)
    except Exception as error:  # a peer torch.compile cannot trace: reported, not timed
        return f"{type(error).__name__}: {str(error).splitlines()[0][:80]}"


def measure(opdef: OpDef, device: torch.device, calls: int, repeats: int,
            compile_calls: bool, stubbed: bool) -> list[dict[str, Any]]:
    case = case_of(opdef, device)
    attrs = opdef.bind_attrs(case.attrs)
    args = (*case.inputs, *attrs.values())
    held = opforge.plan(opdef, *case.inputs, **case.attrs)
    outs = held.run(*case.inputs)
    outs = list(outs) if isinstance(outs, tuple) else [outs]
    workspace = torch.empty(held.workspace_bytes, dtype=torch.uint8, device=device) \
        if held.workspace_bytes else None
    peer = opdef.precision.peer
    differentiable = opdef.backward_fn is not None
    fixed = CONSTANT_INPUTS.get(opdef.name, ())
    leaves = [t.detach().requires_grad_(differentiable and t.is_floating_point()
                                        and arg.name not in fixed)
              if isinstance(t, torch.Tensor) else t
              for t, arg in zip(case.inputs, opdef.inputs, strict=False)]
    wanted = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
    phases: dict[str, list[Launch]] = {}
    phase = ["forward"]
    unmeasured = ""
    with recorded_launches(phases, phase):
        result = _first(opdef(*leaves, *attrs.values()))
        upstream = torch.ones_like(result)
        if wanted:
            phase[0] = "backward"
            try:
                torch.autograd.grad(result, wanted, upstream)
            except RuntimeError as error:
                if not stubbed:
                    raise
                # moe_gating_top_k's backward gathers by the indices its stubbed forward
                # never wrote.
                unmeasured = (f"{type(error).__name__}: {str(error).splitlines()[0][:60]} "
                              "(a backward reading what a stubbed kernel never wrote)")
    floor = floor_function(phases.get("forward", []), phases.get("backward", []))
    layers: list[tuple[str, Callable[[], Any] | str]] = [
        ("torch eager", lambda: peer(*case.inputs, **attrs)),
        ("floor", lambda: floor.apply(*case.inputs)),
        ("functional", lambda: opdef(*args)),
        ("dispatched", lambda: opdef.torch_op(*args)),
        ("direct launch", lambda: opdef.launchers[held.backend](held, case.inputs, outs,
                                                                 workspace)),
        ("run(out=)", lambda: held.run(*case.inputs, out=outs, workspace=workspace)),
    ]
    if wanted:
        for name, function in (("floor fwd+bwd", floor.apply),
                               ("fwd+bwd", lambda *t: opdef(*t, *attrs.values())),
                               ("torch eager fwd+bwd", lambda *t: peer(*t, **attrs))):
            def step(function: Callable[..., Any] = function) -> Any:
                return torch.autograd.grad(_first(function(*leaves)), wanted, upstream,
                                           allow_unused=True)
            layers.append((name, step if name.startswith("torch") else unmeasured or step))
    notes: dict[str, str] = {}
    if compile_calls:
        # Every operator's functions share their code objects: without a reset, the
        # ninth operator would exceed dynamo's recompile limit.
        torch._dynamo.reset()
        tensors = [t for t in case.inputs]
        # Both compiled with fullgraph=True: the flag itself costs about 2.3 µs a call.
        peer_compiled = _compiled(lambda *t: peer(*t, **attrs), tensors, fullgraph=True)
        if not callable(peer_compiled):  # a peer with a graph break
            peer_compiled = _compiled(lambda *t: peer(*t, **attrs), tensors, fullgraph=False)
            notes["compiled torch"] = "fullgraph=False (the peer breaks the graph)"
        layers.append(("compiled torch", peer_compiled))
        layers.append(("compiled opforge", _compiled(
            lambda *t: opdef(*t, *attrs.values()), tensors, fullgraph=True)))
        if device.type == "cuda":
            # The same call traced into its kernel launches (OPFORGE_TRACE_COMPILED): what
            # the tracing saves against the opaque operator above.
            with mock.patch.dict(os.environ, {TRACE_VARIABLE: "1"}):
                layers.append(("compiled traced", _compiled(
                    lambda *t: opdef(*t, *attrs.values()), tensors, fullgraph=True)))
    timed = per_call_us({layer: call for layer, call in layers if callable(call)}, calls,
                        repeats, device)
    rows = []
    for layer, call in layers:
        result = timed.get(layer, call)
        us = result if isinstance(result, float) else None
        note = notes.get(layer, "") if us is not None else result
        rows.append({"op": opdef.name, "case": case.name, "layer": layer,
                     "us_per_call": "" if us is None else round(us, 2), "note": note})
        print(f"{opdef.name:26s} {layer:22s} "
              f"{'-' if us is None else f'{us:8.2f}'} {rows[-1]['note']}", flush=True)
    return rows


TARGETS = (("functional", "floor", 1.3), ("fwd+bwd", "floor fwd+bwd", 1.3),
           ("run(out=)", "direct launch", 1.1), ("compiled opforge", "compiled torch", 1.5),
           ("compiled traced", "compiled torch", 1.5))


def ratios(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The target ratios per operator, as Markdown rows."""
    by_op: dict[str, dict[str, float]] = {}
    for row in rows:
        if row["us_per_call"] != "":
            by_op.setdefault(row["op"], {})[row["layer"]] = row["us_per_call"]
    lines = ["| op | " + " | ".join(f"{a} / {b} (target ≤ {t})" for a, b, t in TARGETS)
             + " |", "|---|" + "---:|" * len(TARGETS)]
    for op, layers in by_op.items():
        cells = [f"{layers[a] / layers[b]:.2f}" if a in layers and b in layers else "-"
                 for a, b, _ in TARGETS]
        lines.append(f"| {op} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--calls", type=int, default=1000, help="calls per repeat")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--ops", default="", help="comma-separated subset")
    parser.add_argument("--no-compile", action="store_true",
                        help="skip the torch.compile rows (each compiles two functions)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    device = torch.device(args.device)
    wanted = [name for name in args.ops.split(",") if name]
    ops = [op for op in opforge.list_ops() if not wanted or op.name in wanted]
    context = stubbed_launches() if device.type == "cpu" else contextlib.nullcontext([0])
    rows = []
    with context:
        for opdef in ops:
            rows += measure(opdef, device, args.calls, args.repeats, not args.no_compile,
                            stubbed=device.type == "cpu")
    env = environment(device)
    how = ("Triton kernel launches stubbed (counted, not run): opforge's own host path"
           if device.type == "cpu" else "real kernel launches, synchronised per repeat")
    lines = ["# Host cost of an opforge call", "",
             f"{env['date']} · {env['device']} · torch {env['torch']} · triton "
             f"{env.get('triton', '-')} · {how}; {args.calls} calls per repeat, the least "
             f"of {args.repeats} repeats (an operator's layers timed in turn in each).", "",
             "## Targets", "", *ratios(rows), "",
             "## Every row (µs per call)", "",
             "| op | case | layer | µs per call | note |", "|---|---|---|---:|---|"]
    lines += [f"| {r['op']} | {r['case']} | {r['layer']} | {r['us_per_call'] or '-'} | "
              f"{r['note']} |" for r in rows]
    if device.type == "cpu":
        lines += ["", "torch rows run their kernels on this CPU (eager and compiled): on "
                  "tiny shapes that is mostly host time too."]
    text = "\n".join(lines) + "\n"
    print("\n".join(ratios(rows)))
    csv_path, md_path = write_results(args.out, "host_overhead",
                                      [{**env, **row} for row in rows], text)
    print(f"wrote {csv_path} and {md_path}")


if __name__ == "__main__":
    main()
