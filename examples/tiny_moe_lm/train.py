"""Train the tiny MoE language model of `model.py`: a plain run, printed step by step.

    python examples/tiny_moe_lm/train.py [--steps 50] [--dtype bfloat16] [--device cuda]
    opforge profile -- python examples/tiny_moe_lm/train.py --steps 5     # profiled

`opforge demo` trains the same model and writes a report with a profiled window; this
script is the same loop (`opforge.demo.train`, the anomaly monitor included: a profile of
it shows the monitor's hooks) printed step by step, e.g. to run under `opforge profile`.
"""

from __future__ import annotations

import argparse

from opforge.demo import RunConfig, train
from opforge.demo.training import MODEL_SIZES


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if any)")
    for size in MODEL_SIZES:
        parser.add_argument(f"--{size}", type=int, default=None, help="model size")
    args = parser.parse_args()
    for name in ("steps", "batch", "seq"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    model = {size: getattr(args, size) for size in MODEL_SIZES
             if getattr(args, size) is not None}
    config = RunConfig("train", args.dtype, loss_scaling=args.dtype == "float16",
                       steps=args.steps, batch=args.batch, seq=args.seq, model=model,
                       eval_every=args.steps)
    run = train(config, device=args.device,
                on_step=lambda step, loss: print(f"step {step}: loss {loss:.4f}"))
    print(f"{run.config.steps} steps on {run.device} in {run.seconds:.1f} s; validation loss "
          f"{run.val_losses[-1][1]:.4f}; monitor: {run.monitor_summary}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
