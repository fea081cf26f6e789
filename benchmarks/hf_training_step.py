"""Training step of a Llama-shaped transformers model: unpatched, `opforge.patch`ed and
Liger-Kernel-patched, side by side.

Each implementation runs in its own process (the patches swap module-level functions), on
the same model built from one config and seed, the same batch and AdamW: ``--warmup``
steps, then ``--steps`` timed ones (forward with labels, backward, optimizer step). Rows:

* ``transformers (sdpa)``  the model as transformers builds it
* ``opforge.patch``        `opforge.patch(model)`: RMSNorm, SwiGLU, attention, RoPE, and in
                           training the fused linear cross-entropy (no logits)
* ``opforge.patch, sdpa attention``  the same with ``attention=False``: what opforge's
                           attention kernels add or cost against transformers' SDPA
* ``Liger-Kernel``         ``apply_liger_kernel_to_llama`` (when installed and able to patch
                           this transformers; else the row says why)

Reported: median step time, its ratio to the unpatched step, peak memory (CUDA: the
allocator's peak above the model, gradients and optimizer state), and the first and last
losses (the three must train alike).

Usage::

    PYTHONPATH=src python benchmarks/hf_training_step.py [--device cuda] [--layers 4]
        [--hidden 4096 --heads 32 --kv-heads 8 --intermediate 14336 --vocab 128256]
        [--batch 2 --seq 4096 --dtype bfloat16] [--steps 10 --warmup 3]

CPU defaults are a small Llama (hidden 512, vocabulary 32000, 4 x 256 tokens, float32);
CUDA defaults the shapes of Llama-3-8B's layers (4 of them), bf16, 2 x 4096 tokens.
Writes ``<out>/hf_training_step_<date>_<time>.{csv,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

IMPLEMENTATIONS = ("transformers (sdpa)", "opforge.patch", "opforge.patch, sdpa attention",
                   "Liger-Kernel")
# The report's columns: (title, row key).
COLUMNS = (("implementation", "implementation"), ("median step ms", "step_ms"),
           ("fastest ms", "fastest_ms"), ("speed vs unpatched", "vs_unpatched"),
           ("peak MiB", "peak_mib"), ("first loss", "first_loss"), ("last loss", "last_loss"),
           ("note", "note"))
# Model and batch sizes: (CPU default, CUDA default).
SIZES = {"layers": (4, 4), "hidden": (512, 4096), "heads": (8, 32), "kv_heads": (4, 8),
         "intermediate": (1408, 14336), "vocab": (32000, 128256), "batch": (4, 2),
         "seq": (256, 4096)}


def build(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq,
        tie_word_embeddings=False, attn_implementation="sdpa")
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            config, dtype=getattr(torch, args.dtype))
    return model.train()


def patched(name: str, args: argparse.Namespace, device: torch.device
            ) -> tuple[torch.nn.Module | None, str]:
    """The model with ``name``'s patch applied, or None and why not."""
    if name == "Liger-Kernel":
        try:
            from liger_kernel.transformers import apply_liger_kernel_to_llama
        except ImportError as error:
            return None, f"not installed ({error})"
        try:
            apply_liger_kernel_to_llama()  # before the model is built: class-level swaps
            return build(args, device), ""
        except Exception as error:  # a Liger that does not know this transformers
            return None, f"{type(error).__name__}: {str(error).splitlines()[0][:100]}"
    model = build(args, device)
    if name.startswith("opforge.patch"):
        import opforge

        opforge.patch(model, attention=name == "opforge.patch")
    return model, ""


def run_one(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Time ``name``'s training steps in this process."""
    device = torch.device(args.device)
    model, why = patched(name, args, device)
    if model is None:
        return {"implementation": name, "note": why}
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    losses, times = [], []
    peak = None
    for index in range(args.warmup + args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
            if index == args.warmup:
                # Model, gradients and optimizer state exist from here on.
                held = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if index >= args.warmup:
            times.append(time.perf_counter() - start)
        losses.append(float(loss))
    if device.type == "cuda":
        peak = (torch.cuda.max_memory_allocated() - held) / 2**20
    return {"implementation": name, "step_ms": round(statistics.median(times) * 1e3, 2),
            "fastest_ms": round(min(times) * 1e3, 2),
            "peak_mib": "" if peak is None else round(peak, 1),
            "first_loss": round(losses[0], 5), "last_loss": round(losses[-1], 5), "note": ""}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    for name, (cpu, cuda) in SIZES.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                            help=f"CPU {cpu}, CUDA {cuda}")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="CPU float32, CUDA bfloat16")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--only", choices=IMPLEMENTATIONS, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path,
                        default=Path(os.environ.get("OUT", "benchmarks/results")))
    args = parser.parse_args(argv)
    gpu = args.device.startswith("cuda")
    for name, (cpu, cuda) in SIZES.items():
        if getattr(args, name) is None:
            setattr(args, name, cuda if gpu else cpu)
    args.dtype = args.dtype or ("bfloat16" if gpu else "float32")
    if args.only is not None:
        print(json.dumps(run_one(args.only, args)))
        return 0

    given = list(argv if argv is not None else sys.argv[1:])
    rows = []
    for name in IMPLEMENTATIONS:
        done = subprocess.run([sys.executable, __file__, *given, "--only", name],
                              capture_output=True, text=True, check=False)
        lines = done.stdout.strip().splitlines()
        if done.returncode or not lines:
            error = (done.stderr.strip().splitlines() or ["no output"])[-1]
            rows.append({"implementation": name, "note": f"failed: {error[:120]}"})
        else:
            rows.append(json.loads(lines[-1]))
        print(rows[-1], flush=True)
    base = next((r.get("step_ms") for r in rows if r["implementation"] == IMPLEMENTATIONS[0]),
                None)
    for row in rows:
        step = row.get("step_ms")
        row["vs_unpatched"] = round(base / step, 3) if base and step else ""
    from opforge.profiler.results import environment, write_results

    env = environment(torch.device(args.device))
    config = {k: getattr(args, k) for k in (*SIZES, "dtype", "steps", "warmup")}
    lines = [f"# Training step of a Llama-shaped model, {args.device}", "",
             ", ".join(f"{k} {v}" for k, v in config.items()), "",
             "| " + " | ".join(title for title, _ in COLUMNS) + " |",
             "|---|" + "---:|" * (len(COLUMNS) - 2) + "---|"]
    lines += ["| " + " | ".join(str(r.get(key, "")) or "-" for _, key in COLUMNS) + " |"
              for r in rows]
    lines += ["", "Speed vs unpatched: the unpatched median step over this one's (above 1: "
              "faster). Peak (CUDA): the allocator's peak during the timed steps above what "
              "the model, its gradients and AdamW's state hold.", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    text = "\n".join(lines) + "\n"
    written = write_results(
        args.out, "hf_training_step",
        [{**env, **config, **{key: r.get(key, "") for _, key in COLUMNS}} for r in rows], text)
    print(text + "wrote " + " and ".join(str(path) for path in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
