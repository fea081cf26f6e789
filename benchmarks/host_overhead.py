"""Host cost of one opforge call on the Triton path, layer by layer, beside torch eager.

Tiny shapes, so that the device finishes each kernel long before the host issues the next
one: the time per call is the host's. On the CPU the Triton backend runs with kernel
launches stubbed out (``JITFunction.run`` counts and returns), so the figures are opforge's
own host path: dispatcher registration, plan lookup, argument checks, output allocation
and each launcher's argument preparation, without Triton's launcher. On a GPU the
launches are real and each repeat ends with a synchronisation.

Layers, from the outside in:

* ``functional``   ``opforge.<op>(...)``: ``torch.ops.opforge.<op>`` through the dispatcher
* ``plan+run``     ``opforge.plan(op, ...).run(...)``: a plan-cache hit, then the run
* ``run(out=)``    a held plan's ``run`` into held outputs: no lookup, no allocation
* ``fwd+bwd``      ``torch.autograd.grad`` of the functional's output: both operators and
                   the autograd plumbing

Usage::

    python benchmarks/host_overhead.py [--device cpu|cuda] [--calls 2000] [--repeats 7]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch.nn import functional

import opforge
from gpu_bench import mla_torch
from opforge.core import backends
from opforge.ops.mla_prolog import mla_inputs
from opforge.profiler.results import environment, write_results


@contextlib.contextmanager
def stubbed_launches() -> Iterator[list[int]]:
    """Triton backend on CPU tensors with every kernel launch replaced by a counter."""
    from triton.runtime.jit import JITFunction

    count = [0]

    def launch(self: Any, *args: Any, **kwargs: Any) -> None:
        count[0] += 1

    with mock.patch.object(JITFunction, "run", launch), \
            mock.patch.object(backends, "_triton_refusal", lambda device: None), \
            backends.use_backend("triton"):
        yield count


def per_call_us(call: Callable[[], Any], calls: int, repeats: int,
                device: torch.device) -> float:
    """Median over ``repeats`` of the wall time of ``calls`` calls, per call, in µs."""
    for _ in range(max(10, calls // 10)):
        call()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        if device.type == "cuda":
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def cases(device: torch.device) -> list[dict[str, Any]]:
    """Each case: opforge's functional, the operator name and inputs for plan, torch's
    eager counterpart, and which inputs get gradients in fwd+bwd (empty: forward only)."""
    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator).to(device)

    x, weight, bias = randn(8, 256), randn(256), randn(256)
    a, b = randn(16, 64), randn(64, 64)
    q, k, v = randn(1, 2, 16, 32), randn(1, 2, 16, 32), randn(1, 2, 16, 32)
    mla = mla_inputs(16, torch.float32, device, generator)
    return [
        {"op": "softmax", "inputs": (x,), "attrs": {"dim": -1},
         "ours": lambda t: opforge.softmax(t), "torch": lambda t: torch.softmax(t, -1),
         "grad": (0,)},
        {"op": "rms_norm", "inputs": (x, weight), "attrs": {"eps": 1e-6},
         "ours": lambda t, w: opforge.rms_norm(t, w, 1e-6),
         "torch": lambda t, w: functional.rms_norm(t, t.shape[-1:], w, 1e-6), "grad": (0, 1)},
        {"op": "layer_norm", "inputs": (x, weight, bias), "attrs": {"eps": 1e-5},
         "ours": lambda t, w, c: opforge.layer_norm(t, 256, w, c, 1e-5),
         "torch": lambda t, w, c: functional.layer_norm(t, (256,), w, c, 1e-5),
         "grad": (0, 1, 2)},
        {"op": "gelu", "inputs": (x,), "attrs": {}, "ours": lambda t: opforge.gelu(t),
         "torch": lambda t: functional.gelu(t), "grad": (0,)},
        {"op": "broadcast_add", "inputs": (x, bias), "attrs": {},
         "ours": lambda t, c: opforge.broadcast_add(t, c),
         "torch": lambda t, c: torch.add(t, c), "grad": (0, 1)},
        {"op": "matmul", "inputs": (a, b), "attrs": {},
         "ours": lambda s, t: opforge.matmul(s, t), "torch": lambda s, t: s @ t,
         "grad": (0, 1)},
        {"op": "attention", "inputs": (q, k, v), "attrs": {"causal": True},
         "ours": lambda s, t, u: opforge.attention(s, t, u, causal=True),
         "torch": lambda s, t, u: functional.scaled_dot_product_attention(
             s, t, u, is_causal=True), "grad": (0, 1, 2)},
        {"op": "mla_prolog", "inputs": mla, "attrs": {},
         "ours": lambda *t: opforge.mla_prolog(*t), "torch": mla_torch, "grad": ()},
    ]


def _first(result: Any) -> torch.Tensor:
    return result[0] if isinstance(result, tuple) else result


def measure(case: dict[str, Any], device: torch.device, calls: int, repeats: int,
            launches: list[int]) -> list[dict[str, Any]]:
    """The rows of one case: each layer of opforge and torch eager, forward, then fwd+bwd."""
    inputs, ours, theirs = case["inputs"], case["ours"], case["torch"]
    held = opforge.plan(case["op"], *inputs, **case["attrs"])
    outs = held.run(*inputs)
    outs = list(outs) if isinstance(outs, tuple) else [outs]
    launches[0] = 0
    ours(*inputs)
    per_call = launches[0]
    layers = [("functional", lambda: ours(*inputs)),
              ("plan+run", lambda: opforge.plan(case["op"], *inputs,
                                                **case["attrs"]).run(*inputs)),
              ("run(out=)", lambda: held.run(*inputs, out=outs)),
              ("torch eager", lambda: theirs(*inputs))]
    if case["grad"]:
        leaves = [t.detach().requires_grad_(i in case["grad"]) for i, t in enumerate(inputs)]
        wanted = [leaves[i] for i in case["grad"]]
        upstream = torch.ones_like(_first(ours(*inputs)))
        for name, function in (("fwd+bwd", ours), ("torch eager fwd+bwd", theirs)):
            def step(function: Callable[..., Any] = function) -> Any:
                return torch.autograd.grad(_first(function(*leaves)), wanted, upstream)
            layers.append((name, step))
    rows = []
    for layer, call in layers:
        us = per_call_us(call, calls, repeats, device)
        ours = layer in ("functional", "plan+run", "run(out=)")
        rows.append({"op": case["op"], "layer": layer, "us_per_call": round(us, 2),
                     "launches": per_call if ours and device.type == "cpu" else ""})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--calls", type=int, default=2000, help="calls per repeat")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--ops", default="", help="comma-separated subset")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    device = torch.device(args.device)
    context = stubbed_launches() if device.type == "cpu" else contextlib.nullcontext([0])
    rows = []
    with context as launches:
        for case in cases(device):
            if args.ops and case["op"] not in args.ops.split(","):
                continue
            measured = measure(case, device, args.calls, args.repeats, launches)
            for row in measured:
                print(f"{row['op']:14s} {row['layer']:20s} {row['us_per_call']:8.2f}")
            rows += measured
    env = environment(device)
    how = ("Triton kernel launches stubbed (counted, not run): opforge's own host path"
           if device.type == "cpu" else "real kernel launches, synchronised per repeat")
    lines = ["# Host cost of an opforge call", "",
             f"{env['date']} · {env['device']} · torch {env['torch']} · {how}; "
             f"{args.calls} calls per repeat, median of {args.repeats} repeats.", "",
             "| op | layer | µs per call | Triton launches |", "|---|---|---:|---:|"]
    lines += [f"| {r['op']} | {r['layer']} | {r['us_per_call']} | {r['launches'] or '-'} |"
              for r in rows]
    if device.type == "cpu":
        lines += ["", "torch eager rows run their kernels on this CPU: on tiny shapes that is "
                  "mostly host time too, except mla_prolog's (matmuls of a 64-wide model)."]
    text = "\n".join(lines) + "\n"
    csv_path, md_path = write_results(args.out, "host_overhead",
                                      [{**env, **row} for row in rows], text)
    print(f"wrote {csv_path} and {md_path}")


if __name__ == "__main__":
    main()
