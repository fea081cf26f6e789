"""Peak memory and time of a language model's loss: fused linear cross-entropy against the
unfused pair.

For hidden states ``[N, H]``, an output head ``[V, H]`` and int64 targets (a tenth
ignored), one forward + backward (mean loss, gradients of both) of

- ``torch.nn.functional.cross_entropy(hidden @ weight.T, target)`` (the logits held),
- ``opforge.fused_linear_cross_entropy`` (blocks of classes),
- Liger-Kernel's fused linear cross-entropy, when installed (CUDA only),

reports the peak of the memory allocated during the step above what was allocated before
it (on CUDA the allocator's peak; on the CPU the live bytes of every tensor an operator
made, counted by a dispatch mode), against the unfused logits and loss (``N V`` elements
in the inputs' dtype, and N float32), the median time of ``--repeats`` steps, and the
loss's and gradients' errors against float64 (CPU) or against the float32 unfused pair
(CUDA); on CUDA, each implementation's device time in products (matmuls) and in the rest,
and its slowest kernels, from one profiled step.

Usage::

    PYTHONPATH=src python benchmarks/linear_cross_entropy_memory.py [--device cuda]
        [--tokens 8192 --hidden 4096 --classes 128256 --dtype bfloat16] [--golden float32]

Writes ``<out>/linear_cross_entropy_<date>_<time>.{csv,md}``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import opforge
from opforge.profiler.results import environment, write_results

Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes held by tensors that operators inside the block allocated:
    each new storage counts from the operator that made it until its last tensor dies."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, list[int]] = {}  # address -> [bytes, live tensors]
        self.current = self.peak = 0

    def _release(self, address: int) -> None:
        entry = self.storages[address]
        entry[1] -= 1
        if not entry[1]:
            self.current -= entry[0]
            del self.storages[address]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        out = func(*args, **(kwargs or {}))
        given = {id(a) for a in tree_flatten((args, kwargs))[0]}
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor) or id(tensor) in given:
                continue  # an in-place operator's own argument
            address = tensor.untyped_storage().data_ptr()
            entry = self.storages.get(address)
            if entry is None:
                if func.is_view:
                    continue  # a view of a tensor made before the block
                entry = self.storages[address] = [tensor.untyped_storage().nbytes(), 0]
                self.current += entry[0]
                self.peak = max(self.peak, self.current)
            entry[1] += 1
            weakref.finalize(tensor, self._release, address)
        return out


def unfused(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor
            ) -> tuple[torch.Tensor, ...]:
    loss = torch.nn.functional.cross_entropy(hidden @ weight.T, target)
    return (loss.detach(), *torch.autograd.grad(loss, (hidden, weight)))


def fused(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor
          ) -> tuple[torch.Tensor, ...]:
    loss = opforge.fused_linear_cross_entropy(hidden, weight, target)
    return (loss.detach(), *torch.autograd.grad(loss, (hidden, weight)))


def fused_planned(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor
                  ) -> tuple[torch.Tensor, ...]:
    """`fused` as its two plans run (the forward, then the backward of the mean): the
    CPU's dispatch-mode count sees inside a plan run directly, not inside an operator
    called through the dispatcher."""
    loss, lse = opforge.plan("fused_linear_cross_entropy", hidden, weight, target).run(
        hidden, weight, target)
    grad = torch.ones((), dtype=loss.dtype)
    return (loss, *opforge.plan("fused_linear_cross_entropy_backward", grad, hidden, weight,
                                target, lse).run(grad, hidden, weight, target, lse))


def liger() -> Step | None:
    """Liger-Kernel's fused linear cross-entropy, when installed."""
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import (
            LigerFusedLinearCrossEntropyFunction,
        )
    except ImportError:
        return None

    def step(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor
             ) -> tuple[torch.Tensor, ...]:
        loss = LigerFusedLinearCrossEntropyFunction.apply(hidden, weight, target)
        loss = loss[0] if isinstance(loss, tuple) else loss
        return (loss.detach(), *torch.autograd.grad(loss, (hidden, weight)))
    return step


def peak_bytes(step: Step, leaves: Sequence[torch.Tensor], target: torch.Tensor,
               device: torch.device) -> int:
    """Bytes allocated at the step's peak above those allocated before it (on the CPU
    opforge's step is counted through its plans, `fused_planned`)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        result = step(*leaves, target)
        torch.cuda.synchronize()
        del result
        return torch.cuda.max_memory_allocated() - before
    if step is fused:
        step, leaves = fused_planned, [leaf.detach() for leaf in leaves]
    with LiveBytes() as live:
        result = step(*leaves, target)
        del result
    return live.peak


def seconds(step: Step, leaves: Sequence[torch.Tensor], target: torch.Tensor,
            device: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step(*leaves, target)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.double()
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-300))


# Kernel names of the products: opforge's matmul, cuBLAS's and CUTLASS's GEMMs.
PRODUCT_KERNELS = ("matmul", "gemm", "cutlass", "xmma", "nvjet")


def kernel_breakdown(steps: Sequence[tuple[str, Step]], leaves: Sequence[torch.Tensor],
                     target: torch.Tensor, shown: int = 8) -> list[str]:
    """Markdown: per implementation, the device µs of one step's products (matmuls) and of
    the rest, then its slowest kernels (torch.profiler): where a step's time goes beyond
    the products it must make."""
    from kernel_breakdown import kernel_times

    lines = ["| implementation | products µs | rest µs | slowest kernels (µs per step, "
             "launches) |", "|---|---:|---:|---|"]
    for name, step in steps:
        kernels = kernel_times(lambda step=step: step(*leaves, target), iterations=1)
        products = sum(us for kernel, us, _ in kernels
                       if any(word in kernel.lower() for word in PRODUCT_KERNELS))
        rest = sum(us for _, us, _ in kernels) - products
        slowest = "; ".join(f"{kernel[:48]} {us:.0f} ({count})"
                            for kernel, us, count in kernels[:shown])
        lines.append(f"| {name} | {products:.0f} | {rest:.0f} | {slowest} |")
    return [*lines, ""]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=None, help="N (CPU 2048, CUDA 8192)")
    parser.add_argument("--hidden", type=int, default=None, help="H (CPU 256, CUDA 4096)")
    parser.add_argument("--classes", type=int, default=None,
                        help="V (CPU 32000, CUDA 128256)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="CPU float32, CUDA bfloat16")
    parser.add_argument("--golden", choices=("float64", "float32"), default=None,
                        help="the unfused pair's dtype for the errors: CPU float64, CUDA "
                             "float32 (float64 logits of 8k x 128k need 25 GiB)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path,
                        default=Path(os.environ.get("OUT", "benchmarks/results")))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    tokens = args.tokens or (8192 if gpu else 2048)
    hidden_size = args.hidden or (4096 if gpu else 256)
    classes = args.classes or (128256 if gpu else 32000)
    dtype = getattr(torch, args.dtype or ("bfloat16" if gpu else "float32"))
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, generator=generator).to(device, dtype)
    weight = (torch.randn(classes, hidden_size, generator=generator)
              * hidden_size ** -0.5).to(device, dtype)
    target = torch.randint(0, classes, (tokens,), generator=generator)
    target[torch.rand(tokens, generator=generator) < 0.1] = -100
    target = target.to(device)
    leaves = [t.requires_grad_() for t in (hidden, weight)]
    # The golden: float64 on the CPU; on a GPU the float32 unfused pair (float64 products
    # at 8k x 128k x 4k are out of reach there).
    wide = getattr(torch, args.golden or ("float32" if gpu else "float64"))
    golden = unfused(*(t.detach().to(wide).requires_grad_() for t in leaves), target)
    logits_and_loss = tokens * classes * hidden.element_size() + 4 * tokens
    gradients = (hidden.numel() + weight.numel()) * hidden.element_size()
    steps: list[tuple[str, Step]] = [("torch (logits held)", unfused),
                                     ("opforge fused_linear_cross_entropy", fused)]
    peer = liger() if gpu else None
    if peer is not None:
        steps.append(("Liger-Kernel fused linear cross-entropy", peer))
    rows = []
    for name, step in steps:
        result = step(*leaves, target)  # warm-up: compilation and plans
        errors = [relative_error(got, want) for got, want in zip(result, golden, strict=True)]
        del result
        peak = peak_bytes(step, leaves, target, device)
        rows.append({"implementation": name, "peak_mib": round(peak / 2**20, 1),
                     "peak_over_logits_and_loss": round(peak / logits_and_loss, 3),
                     "beyond_gradients_over_logits_and_loss": round(
                         (peak - gradients) / logits_and_loss, 3),
                     "seconds": round(seconds(step, leaves, target, device, args.repeats), 4),
                     "loss_rel_error": f"{errors[0]:.2e}",
                     "grad_hidden_rel_error": f"{errors[1]:.2e}",
                     "grad_weight_rel_error": f"{errors[2]:.2e}"})
        print(rows[-1], flush=True)
    breakdown = kernel_breakdown(steps, leaves, target) if gpu else []
    env = environment(device)
    config = {"tokens": tokens, "hidden": hidden_size, "classes": classes,
              "dtype": str(dtype).removeprefix("torch."), "golden": str(wide),
              "logits_and_loss_mib": round(logits_and_loss / 2**20, 1)}
    lines = [f"# Fused linear cross-entropy: memory and time, {device.type}", "",
             ", ".join(f"{k} {v}" for k, v in config.items()), "",
             "| implementation | peak MiB | peak / (logits + loss) | beyond the gradients / "
             "(logits + loss) | s | loss err | grad_hidden err | grad_weight err |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['implementation']} | {r['peak_mib']} | {r['peak_over_logits_and_loss']} "
              f"| {r['beyond_gradients_over_logits_and_loss']} | {r['seconds']} | "
              f"{r['loss_rel_error']} | {r['grad_hidden_rel_error']} | "
              f"{r['grad_weight_rel_error']} |" for r in rows]
    lines += ["", "Peak: bytes allocated during one forward + backward above those held "
              "before it, the gradients of hidden and weight included; \"beyond the "
              "gradients\" takes them out. Errors: relative L2 against the golden "
              f"({wide}).", ""] + breakdown + [f"- {k}: {v}" for k, v in env.items()]
    csv_path, md_path = write_results(args.out, "linear_cross_entropy",
                                      [{**env, **config, **r} for r in rows],
                                      "\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {csv_path} and {md_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
