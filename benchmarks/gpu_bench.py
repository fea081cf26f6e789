"""GPU bandwidth benchmark: opforge's Triton kernels vs torch eager vs torch.compile.

For a bias add ``(M, N) + (N,)``, GELU, sigmoid, softmax, log_softmax, layer_norm,
rms_norm (last dim), silu_mul and gelu_tanh_mul in bfloat16 at large sizes, this script

1. checks opforge's result against torch eager (max abs diff, bfloat16 tolerances);
2. times opforge (the functional API, which on CUDA tensors runs the triton backend), a
   pre-planned ``plan.run(..., out=...)``, torch eager and ``torch.compile`` with
   ``triton.testing.do_bench`` (median; do_bench flushes the L2 cache between calls);
3. reports achieved bandwidth, bytes read + written / time, and its fraction of the measured
   copy bandwidth (``dst.copy_(src)`` of a large buffer, 2 x bytes / time), the practical
   ceiling of a memory-bound elementwise kernel;
4. times bf16 attention (MHA at head dims 64/128/256, causal, GQA) forward and forward +
   backward in TFLOP/s against torch SDPA's FlashAttention backend (the reference of the
   speed ratio), its cuDNN backend and its default choice, after checking out, dq, dk and
   dv against SDPA,
   MlaProlog at DeepSeek-V3 sizes (T = 16 and 1024) against the same computation in
   torch ops, eager and compiled, DeepSeek-V3 routing (T = 1, 128, 16384; forward, and
   forward + backward) against its torch composition, and the embedding gradient
   (V 128256, D 4096, T 16384, uniform and Zipf indices, atomic and deterministic)
   against aten;
   times softmax, log_softmax, rms_norm, layer_norm, swiglu, silu_mul, gelu_tanh_mul and
   cross_entropy forward + backward against torch eager, torch.compile and Liger-Kernel
   (when installed; also beside the forwards it has), and square matmuls (bf16 4096³ and 8192³, fp32
   4096³) against cuBLAS and torch.compile in TFLOP/s;
5. captures ``plan.run(a, b, out=out, workspace=ws)`` in a ``torch.cuda.CUDAGraph``, writes
   new values into the captured inputs, replays, and checks the result equals an ordinary
   run of the same plan (for ``broadcast_add``, a split ``reduce_sum`` and a long-row
   ``softmax``, whose partial results live in the workspace).

Usage (on the GPU machine, from the repository root)::

    PYTHONPATH=src python benchmarks/gpu_bench.py [--out DIR] [--sizes 8192x8192,16384x8192]

``--autotune`` runs every opforge call under `opforge.autotuning` (each tiling bucket's
fitting candidates timed on first use, the tensor-descriptor variants among them) and adds
the choices, with every candidate's time, to the report; ``--skip-bandwidth`` leaves out
the memory-bound operators, their forward + backward rows and the graph checks;
``--targets`` keeps only the speed targets (attention at B 4, H 32, S 4096, D 128 causal
and MlaProlog at both token counts). Rows are printed as they are measured.

Writes ``<out>/gpu_bench_<date>_<time>.{csv,md}`` (``--out`` defaults to ``$OUT``, else
benchmarks/results) and exits non-zero when a correctness or graph check fails or a
measurement errors.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import opforge
from opforge.profiler.results import environment, write_results

ALPHA = 1.0
GELU_APPROXIMATE = "none"
# torch.testing.assert_close's defaults for bfloat16: about one bfloat16 ulp (2^-7) relative.
BF16_RTOL, BF16_ATOL = 1.6e-2, 1e-5
# A split reduce_sum for the graph check: few output columns and many rows make tiling split
# the reduced axis across programs, which needs a workspace for the partial sums.
REDUCE_SHAPE = (16384, 512)
# Rows too long for one program: the split softmax keeps chunk statistics in the workspace.
LONG_SOFTMAX_SHAPE = (4, 1 << 20)
Tensors = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class OpCase:
    """One operator at one size.

    Attributes:
        op: opforge operator name.
        shape: ``(M, N)`` of the main input.
        inputs: input tensors in prototype order.
        attrs: operator attributes (for `opforge.plan`).
        opforge_fn: the functional API call.
        eager_fn: the torch eager equivalent (also compiled with torch.compile).
        bytes_moved: bytes read plus bytes written by one call.
    """

    op: str
    shape: tuple[int, int]
    inputs: Tensors
    attrs: dict[str, Any]
    opforge_fn: Callable[..., torch.Tensor]
    eager_fn: Callable[..., torch.Tensor]
    bytes_moved: int


@dataclass
class Row:
    """One line of the report: a measurement or a check."""

    kind: str  # "copy", "check", "time" or "graph"
    op: str
    shape: str
    dtype: str
    impl: str
    median_us: float | None = None
    bytes_moved: int | None = None
    gb_per_s: float | None = None
    fraction_of_copy: float | None = None
    max_abs_diff: float | None = None
    status: str = "ok"
    detail: str = ""


def parse_shape(text: str) -> tuple[int, int]:
    """``"8192x4096"`` -> ``(8192, 4096)``.

    Raises:
        ValueError: not two positive integers joined by ``x``.
    """
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"expected a shape like 8192x8192, got {text!r}")
    return int(parts[0]), int(parts[1])


def _bias_add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.add(a, b, alpha=ALPHA)


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return functional.gelu(x, approximate=GELU_APPROXIMATE)


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    # A Python function, not torch.sigmoid itself: torch.compile traces Python frames, and
    # a builtin passed to it directly would run eagerly, uncompiled.
    return torch.sigmoid(x)


def _softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, -1)


def _log_softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(x, -1)


RMS_EPS = 1e-6
LN_EPS = 1e-5


def _swiglu(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, -1)
    return functional.silu(gate) * up


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return functional.silu(gate) * up


def _gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return functional.gelu(gate, approximate="tanh") * up


def _liger(op: str) -> Callable[..., torch.Tensor] | None:
    """Liger-Kernel's ``op`` with the arguments of this script's torch function for it
    (`make_cases`, `training_cases`), or None (not installed, or no such operator)."""
    try:
        if op == "softmax":
            from liger_kernel.ops.softmax import LigerSoftmaxFunction
            return LigerSoftmaxFunction.apply
        if op == "rms_norm":
            from liger_kernel.ops.rms_norm import LigerRMSNormFunction
            return lambda x, w: LigerRMSNormFunction.apply(x, w, RMS_EPS)
        if op == "layer_norm":
            from liger_kernel.ops.layer_norm import LigerLayerNormFunction
            return lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, LN_EPS)
        if op == "swiglu":
            from liger_kernel.ops.swiglu import LigerFusedGateUpSiLUMulFunction
            return LigerFusedGateUpSiLUMulFunction.apply
        if op == "silu_mul":
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction
            return LigerSiLUMulFunction.apply
        if op == "gelu_tanh_mul":
            from liger_kernel.ops.geglu import LigerGELUMulFunction
            return LigerGELUMulFunction.apply
        if op == "cross_entropy":
            from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction
            return lambda logits, target: LigerCrossEntropyFunction.apply(logits, target,
                                                                          None)[0]
    except ImportError:
        return None
    return None


def make_cases(shape: tuple[int, int], dtype: torch.dtype, device: torch.device,
               generator: torch.Generator) -> list[OpCase]:
    """The operators at ``shape``, with random normal inputs on ``device``."""
    m, n = shape
    item = torch.empty((), dtype=dtype).element_size()
    x = torch.randn(m, n, generator=generator, device=device, dtype=dtype)
    bias = torch.randn(n, generator=generator, device=device, dtype=dtype)
    weight = torch.randn(n, generator=generator, device=device, dtype=dtype)
    up = torch.randn(m, n, generator=generator, device=device, dtype=dtype)
    elementwise_bytes = 2 * m * n * item
    return [
        OpCase("broadcast_add", shape, (x, bias), {"alpha": ALPHA},
               lambda a, b: opforge.broadcast_add(a, b, ALPHA), _bias_add,
               elementwise_bytes + n * item),
        OpCase("gelu", shape, (x,), {"approximate": GELU_APPROXIMATE},
               lambda t: opforge.gelu(t, GELU_APPROXIMATE), _gelu, elementwise_bytes),
        OpCase("sigmoid", shape, (x,), {}, opforge.sigmoid, _sigmoid, elementwise_bytes),
        OpCase("softmax", shape, (x,), {}, opforge.softmax, _softmax, elementwise_bytes),
        OpCase("log_softmax", shape, (x,), {}, opforge.log_softmax, _log_softmax,
               elementwise_bytes),
        OpCase("layer_norm", shape, (x, weight, bias), {"eps": LN_EPS},
               lambda t, w, b: opforge.layer_norm(t, t.shape[-1], w, b, LN_EPS),
               lambda t, w, b: functional.layer_norm(t, t.shape[-1:], w, b, LN_EPS),
               elementwise_bytes + 2 * n * item),
        OpCase("rms_norm", shape, (x, weight), {"eps": RMS_EPS},
               lambda t, w: opforge.rms_norm(t, w, RMS_EPS),
               lambda t, w: functional.rms_norm(t, t.shape[-1:], w, RMS_EPS),
               elementwise_bytes + n * item),
        OpCase("silu_mul", shape, (x, up), {}, opforge.silu_mul, _silu_mul, 3 * m * n * item),
        OpCase("gelu_tanh_mul", shape, (x, up), {}, opforge.gelu_tanh_mul, _gelu_tanh_mul,
               3 * m * n * item),
    ]


def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a @ b


MATMUL_SHAPES = ((4096, torch.bfloat16), (8192, torch.bfloat16), (4096, torch.float32))


def matmul_rows(device: torch.device, compile_peers: bool, warmup_ms: int, rep_ms: int
                ) -> Iterator[Row]:
    """Square matmuls (bf16 4096^3 and 8192^3, fp32 4096^3 without tf32): opforge against
    torch.matmul (cuBLAS) and torch.compile, after a correctness check. GB/s is replaced by
    TFLOP/s (2 n^3 / time) in the ``gb_per_s`` column and the ratio to cuBLAS in
    ``fraction_of_copy``."""
    generator = torch.Generator(device=device).manual_seed(2)
    for n, dtype in MATMUL_SHAPES:
        shape, name = f"{n}x{n}x{n}", _dtype_text(dtype)
        try:
            a = torch.randn(n, n, generator=generator, device=device, dtype=dtype)
            b = torch.randn(n, n, generator=generator, device=device, dtype=dtype)
            torch.backends.cuda.matmul.allow_tf32 = False
            expected = torch.matmul(a, b)
            actual = opforge.matmul(a, b)
            scale = (a.float().abs() @ b.float().abs()).max().item()
            diff = max_abs_diff(actual, expected)
            eps = torch.finfo(dtype).eps
            yield (Row("check", "matmul", shape, name, "opforge vs torch.matmul",
                            max_abs_diff=diff, status="ok" if diff <= 4 * eps * scale
                            else "FAIL", detail=f"bound 4 eps * max(|a||b|) = "
                                                f"{4 * eps * scale:.3g}"))
            impls = [("opforge", functools.partial(opforge.matmul, a, b)),
                     ("torch.matmul (cuBLAS)", functools.partial(torch.matmul, a, b))]
            if compile_peers:
                compiled = torch.compile(_product, dynamic=False)
                impls.append(("torch.compile", functools.partial(compiled, a, b)))
            timings = {}
            for impl, call in impls:
                call()
                torch.cuda.synchronize()
                timings[impl] = bench_us(call, warmup_ms, rep_ms)
            cublas = timings["torch.matmul (cuBLAS)"]
            for impl, us in timings.items():
                yield (Row("time", "matmul", shape, name, impl, us, None,
                                2 * n**3 / (us * 1e-6) / 1e12, cublas / us,
                                detail="TFLOP/s; ratio to cuBLAS"))
        except Exception as error:  # reported; the next shape still runs
            yield (_error_row("time", "matmul", shape, name, "opforge", error))


@dataclass(frozen=True)
class TrainingCase:
    """One operator's forward + backward at one size.

    Attributes:
        op: opforge operator name.
        leaves: the differentiated inputs (x, and a norm's weight and bias).
        least_bytes: the least the pair must move: every input read once, the output and
            every gradient written once, the output's gradient read once (a loss: its
            logits read once and their gradient written once).
        impls: (name, function of the leaves) for opforge and each peer.
    """

    op: str
    leaves: Tensors
    least_bytes: int
    impls: list[tuple[str, Callable[..., torch.Tensor]]]


def training_cases(shape: tuple[int, int], dtype: torch.dtype, device: torch.device,
                   compile_peers: bool) -> list[TrainingCase]:
    """softmax, log_softmax, rms_norm and layer_norm (with their weight and bias as
    leaves, as in training), swiglu (``shape`` is its input, gate and up halves),
    silu_mul and gelu_tanh_mul (gate and up of ``shape`` each) and cross_entropy
    (``shape`` is (tokens, vocabulary), mean over int64 targets): opforge, torch eager,
    torch.compile and, when installed, Liger-Kernel."""
    generator = torch.Generator(device=device).manual_seed(1)
    m, n = shape
    x = torch.randn(shape, generator=generator, device=device, dtype=dtype)
    weight = torch.randn(n, generator=generator, device=device, dtype=dtype)
    bias = torch.randn(n, generator=generator, device=device, dtype=dtype)
    target = torch.randint(0, n, (m,), generator=generator, device=device)
    up = torch.randn(shape, generator=generator, device=device, dtype=dtype)
    size = x.numel() * x.element_size()
    row = n * x.element_size()
    specs = (
        ("softmax", (x,), 5 * size, opforge.softmax, _softmax),
        ("log_softmax", (x,), 5 * size, opforge.log_softmax, _log_softmax),
        ("rms_norm", (x, weight), 5 * size + 2 * row,
         lambda t, w: opforge.rms_norm(t, w, RMS_EPS),
         lambda t, w: functional.rms_norm(t, t.shape[-1:], w, RMS_EPS)),
        ("layer_norm", (x, weight, bias), 5 * size + 4 * row,
         lambda t, w, b: opforge.layer_norm(t, t.shape[-1], w, b, LN_EPS),
         lambda t, w, b: functional.layer_norm(t, t.shape[-1:], w, b, LN_EPS)),
        # Forward: x read, half its size written; backward: that gradient and x read,
        # x's gradient written.
        ("swiglu", (x,), 4 * size, opforge.swiglu, _swiglu),
        # Forward: gate and up read, the product written; backward: its gradient, gate
        # and up read, both gradients written.
        ("silu_mul", (x, up), 8 * size, opforge.silu_mul, _silu_mul),
        ("gelu_tanh_mul", (x, up), 8 * size, opforge.gelu_tanh_mul, _gelu_tanh_mul),
        ("cross_entropy", (x,), 2 * size, lambda t: opforge.cross_entropy(t, target),
         lambda t: functional.cross_entropy(t, target)))
    cases = []
    for op, leaves, least, ours, eager in specs:
        impls = [("opforge", ours), ("torch eager", eager)]
        if compile_peers:
            impls.append(("torch.compile", torch.compile(eager, dynamic=False)))
        liger = _liger(op)
        if liger is not None:
            if op == "cross_entropy":
                liger = functools.partial(liger, target=target)
            impls.append(("Liger-Kernel", liger))
        cases.append(TrainingCase(op, leaves, least, impls))
    return cases


def training_step(function: Callable[..., torch.Tensor], leaves: Tensors
                  ) -> Callable[[], Any]:
    """A zero-argument forward + backward of ``function`` at fresh leaves, with a fixed
    random upstream gradient (Liger's kernels may overwrite their inputs and the
    upstream gradient in place, hence the copies here, once)."""
    leaves = tuple(leaf.detach().clone().requires_grad_() for leaf in leaves)
    upstream = torch.randn_like(function(*leaves))

    def step() -> Any:
        return torch.autograd.grad(function(*leaves), leaves, upstream)
    return step


def forward_backward_rows(shape: tuple[int, int], dtype: torch.dtype, device: torch.device,
                          copy_gb_s: float, compile_peers: bool, warmup_ms: int,
                          rep_ms: int) -> list[Row]:
    """Forward + backward (``autograd.grad`` with respect to every leaf of
    `training_cases`) of each implementation; GB/s on the least the pair must move."""
    rows = []
    for case in training_cases(shape, dtype, device, compile_peers):
        for name, function in case.impls:
            try:
                step = training_step(function, case.leaves)
                step()
                torch.cuda.synchronize()
                us = bench_us(step, warmup_ms, rep_ms)
            except Exception as error:
                rows.append(_error_row("time", f"{case.op} fwd+bwd", _shape_text(shape),
                                       _dtype_text(dtype), name, error))
                continue
            gb_s = bandwidth(case.least_bytes, us)
            rows.append(Row("time", f"{case.op} fwd+bwd", _shape_text(shape),
                            _dtype_text(dtype), name, us, case.least_bytes, gb_s,
                            gb_s / copy_gb_s))
    return rows


# (B, H, Hkv, Sq, Sk, D, causal): MHA at head dims 64, 128 and 256, causal at 4k and 8k,
# GQA 4:1; then decoding with a KV cache (one and 16 new queries, GQA, forward only; a
# batch of 8 fills the cores, one sequence of 32k keys needs the key slices).
# B, H, H_kv, Sq, Sk, D, causal. The first is the speed target's shape (bf16, B 4, H 32,
# S 4096, D 128, causal), the one `--targets` keeps.
ATTENTION_SHAPES = ((4, 32, 32, 4096, 4096, 128, True),
                    (4, 16, 16, 4096, 4096, 64, False), (4, 16, 16, 4096, 4096, 128, False),
                    (4, 16, 16, 4096, 4096, 128, True), (2, 16, 16, 8192, 8192, 128, True),
                    (4, 32, 8, 4096, 4096, 128, True), (2, 8, 8, 4096, 4096, 256, False),
                    (8, 32, 8, 1, 8192, 128, False), (8, 32, 8, 16, 8192, 128, False),
                    (1, 32, 8, 1, 32768, 128, False))


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    # Causal rows have Sq == Sk, where SDPA's top-left mask equals opforge's bottom-right.
    return functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                   enable_gqa=k.shape[1] != q.shape[1])


def _sdpa_backend(backend: SDPBackend) -> Callable[..., torch.Tensor]:
    """SDPA restricted to one backend (its backward is that backend's too)."""
    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
             ) -> torch.Tensor:
        with sdpa_kernel([backend]):
            return _sdpa(q, k, v, causal)
    return call


def _opforge_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
                       ) -> torch.Tensor:
    return opforge.attention(q, k, v, causal=causal)


# The target's reference first: speeds are given relative to SDPA's FlashAttention backend.
ATTENTION_IMPLS = (("SDPA flash", _sdpa_backend(SDPBackend.FLASH_ATTENTION)),
                   ("opforge", _opforge_attention),
                   ("SDPA cuDNN", _sdpa_backend(SDPBackend.CUDNN_ATTENTION)),
                   ("SDPA default", _sdpa))


def _forward_backward(call: Callable[..., torch.Tensor], leaves: Sequence[torch.Tensor],
                      upstream: torch.Tensor, causal: bool) -> Any:
    return torch.autograd.grad(call(*leaves, causal), leaves, upstream)


def attention_rows(device: torch.device, warmup_ms: int, rep_ms: int,
                   shapes: Sequence[tuple[int, ...]] = ATTENTION_SHAPES) -> Iterator[Row]:
    """bf16 attention, forward and forward + backward (decoding shapes: forward only, a
    memory-bound case whose TFLOP/s are small by nature): opforge against torch SDPA's
    FlashAttention and cuDNN backends and its default choice, after a check of out, dq, dk
    and dv against SDPA's (max error relative to the largest magnitude, bound 2e-2).
    TFLOP/s by FlashAttention's convention: forward 4 B H S² D (halved when causal),
    forward + backward 3.5 times that; the ``fraction_of_copy`` column holds the speed
    relative to the FlashAttention backend. A backend that refuses a shape (cuDNN and
    grouped-query heads, say) gets an ``n/a`` row with its reason."""
    generator = torch.Generator(device=device).manual_seed(3)
    for b, h, hkv, sq, sk, d, causal in shapes:
        lengths = f"S{sk}" if sq == sk else f"Sq{sq} Sk{sk}"
        shape = f"B{b} H{h}/{hkv} {lengths} D{d}{' causal' if causal else ''}"
        try:
            q = torch.randn(b, h, sq, d, generator=generator, device=device,
                            dtype=torch.bfloat16)
            k, v = (torch.randn(b, hkv, sk, d, generator=generator, device=device,
                                dtype=torch.bfloat16) for _ in range(2))
            upstream = torch.randn_like(q)
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            ours = _opforge_attention(*leaves, causal)
            ours_grads = _forward_backward(_opforge_attention, leaves, upstream, causal)
            theirs = _sdpa(*leaves, causal)
            their_grads = _forward_backward(_sdpa, leaves, upstream, causal)
            worst = max(max_abs_diff(a, e) / e.float().abs().max().item()
                        for a, e in zip((ours, *ours_grads), (theirs, *their_grads)))
            yield (Row("check", "attention", shape, "bf16", "opforge vs SDPA (out, dq, "
                            "dk, dv)", max_abs_diff=worst,
                            status="ok" if worst <= 2e-2 else "FAIL",
                            detail="max |diff| / max |SDPA|, bound 2e-2"))
            flops = 4 * b * h * sq * sk * d * (0.5 if causal else 1.0)
            modes = (("fwd", flops), ("fwd+bwd", 3.5 * flops)) if sq == sk else (("fwd", flops),)
            for mode, work in modes:
                reference_us = None
                for impl, call in ATTENTION_IMPLS:
                    try:
                        if mode == "fwd":
                            with torch.no_grad():
                                us = bench_us(functools.partial(call, q, k, v, causal),
                                              warmup_ms, rep_ms)
                        else:
                            us = bench_us(functools.partial(_forward_backward, call, leaves,
                                                            upstream, causal),
                                          warmup_ms, rep_ms)
                    except RuntimeError as error:  # the backend refuses this shape
                        yield (Row("time", f"attention {mode}", shape, "bf16", impl,
                                        status="n/a", detail=str(error).splitlines()[0][:200]))
                        continue
                    reference_us = reference_us or (us if impl == "SDPA flash" else None)
                    yield (Row("time", f"attention {mode}", shape, "bf16", impl, us,
                                    None, work / (us * 1e-6) / 1e12,
                                    reference_us / us if reference_us else None,
                                    detail="TFLOP/s; ratio to SDPA flash"))
            torch.cuda.empty_cache()
        except Exception as error:  # reported; the next shape still runs
            yield (_error_row("time", "attention", shape, "bf16", "opforge", error))


# Packed sequences: lengths of a padding-free training batch (8192 tokens), heads, D.
PACKED_LENGTHS = (2048, 1500, 1200, 1000, 900, 700, 450, 250, 100, 44)
PACKED_HEADS = (32, 8, 128)


def packed_attention_rows(device: torch.device, warmup_ms: int, rep_ms: int
                          ) -> Iterator[Row]:
    """bf16 causal attention over packed sequences of `PACKED_LENGTHS`, forward and
    forward + backward: ``opforge.attention_varlen`` against the same sequences one call
    each (SDPA's FlashAttention backend, and opforge's dense attention), after a check of
    out and the gradients against SDPA's. TFLOP/s of the sequences' own causal work."""
    h, hkv, d = PACKED_HEADS
    lengths = PACKED_LENGTHS
    shape = f"T{sum(lengths)} ({len(lengths)} sequences) H{h}/{hkv} D{d} causal"
    try:
        generator = torch.Generator(device=device).manual_seed(5)
        leaves = [torch.randn(sum(lengths), heads, d, generator=generator, device=device,
                              dtype=torch.bfloat16).requires_grad_()
                  for heads in (h, hkv, hkv)]
        upstream = torch.randn_like(leaves[0])
        ends = torch.tensor([0, *lengths], device=device).cumsum(0).to(torch.int32)
        bounds = list(itertools.pairwise([0, *itertools.accumulate(lengths)]))

        def varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return opforge.attention_varlen(q, k, v, ends, ends, True, None, max(lengths),
                                            max(lengths))

        def one_by_one(call: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
            def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                return torch.cat([call(*(t[a:b].transpose(0, 1)[None] for t in (q, k, v)),
                                       True)[0].transpose(0, 1) for a, b in bounds])
            return run

        impls = (("SDPA flash per sequence", one_by_one(_sdpa_backend(SDPBackend.FLASH_ATTENTION))),
                 ("opforge varlen", varlen),
                 ("opforge per sequence", one_by_one(_opforge_attention)))
        yield _checked_pair("attention_varlen", shape, impls, leaves, upstream)
        flops = sum(2 * h * n * n * d for n in lengths)
        yield from _timed_passes("attention_varlen", shape, impls, leaves, upstream, flops,
                                 warmup_ms, rep_ms)
        torch.cuda.empty_cache()
    except Exception as error:  # reported; the other rows still run
        yield _error_row("time", "attention_varlen", shape, "bf16", "opforge", error)


def _checked_pair(op: str, shape: str, impls: Sequence[tuple[str, Callable[..., Any]]],
                  leaves: Sequence[torch.Tensor], upstream: torch.Tensor) -> Row:
    """The check row of ``impls``' second (opforge) against their first (SDPA): out and
    the gradients of ``leaves``, max error relative to SDPA's largest magnitude."""
    (theirs, their_grads), (ours, ours_grads) = [
        (call(*leaves), torch.autograd.grad(call(*leaves), leaves, upstream))
        for _, call in impls[:2]]
    worst = max(max_abs_diff(a, e) / e.float().abs().max().item()
                for a, e in zip((ours, *ours_grads), (theirs, *their_grads)))
    return Row("check", op, shape, "bf16", f"opforge vs {impls[0][0]} (out, dq, dk, dv)",
               max_abs_diff=worst, status="ok" if worst <= 2e-2 else "FAIL",
               detail="max |diff| / max |SDPA|, bound 2e-2")


def _timed_passes(op: str, shape: str, impls: Sequence[tuple[str, Callable[..., Any]]],
                  leaves: Sequence[torch.Tensor], upstream: torch.Tensor, flops: float,
                  warmup_ms: int, rep_ms: int) -> Iterator[Row]:
    """Forward and forward + backward rows of ``impls`` (the first the reference), TFLOP/s
    of ``flops`` (forward + backward 3.5 times them)."""
    for mode, work in (("fwd", flops), ("fwd+bwd", 3.5 * flops)):
        reference_us = None
        for impl, call in impls:
            if mode == "fwd":
                with torch.no_grad():
                    us = bench_us(functools.partial(call, *leaves), warmup_ms, rep_ms)
            else:
                us = bench_us(lambda call=call: torch.autograd.grad(
                    call(*leaves), leaves, upstream), warmup_ms, rep_ms)
            reference_us = reference_us or us
            yield Row("time", f"{op} {mode}", shape, "bf16", impl, us, None,
                      work / (us * 1e-6) / 1e12, reference_us / us,
                      detail=f"TFLOP/s; ratio to {impls[0][0]}")


# Sliding windows: B, H, Hkv, S, D, and the windows (Mistral-7B's 4096, and 1024).
WINDOW_SHAPE = (2, 32, 8, 8192, 128)
WINDOWS = (4096, 1024)


def windowed_attention_rows(device: torch.device, warmup_ms: int, rep_ms: int
                            ) -> Iterator[Row]:
    """bf16 causal attention under a sliding window of W keys (query i sees i - W < j <=
    i), forward and forward + backward: opforge's band (``window_left = W - 1``, the key
    blocks outside it skipped) against SDPA given the window as a boolean mask (what a
    library without a window runs) and against full causal attention (SDPA flash and
    opforge: the work the window saves), after a check of out and the gradients against
    SDPA's masked result. TFLOP/s of the window's own pairs."""
    b, h, hkv, s, d = WINDOW_SHAPE
    for window in WINDOWS:
        shape = f"B{b} H{h}/{hkv} S{s} D{d} causal window {window}"
        try:
            generator = torch.Generator(device=device).manual_seed(6)
            leaves = [torch.randn(b, heads, s, d, generator=generator, device=device,
                                  dtype=torch.bfloat16).requires_grad_()
                      for heads in (h, hkv, hkv)]
            upstream = torch.randn_like(leaves[0])
            positions = torch.arange(s, device=device)
            shift = positions[None, :] - positions[:, None]
            band = (shift <= 0) & (shift > -window)

            def banded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       left: int = window - 1) -> torch.Tensor:
                return opforge.attention(q, k, v, causal=True, window_left=left)

            def masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       mask: torch.Tensor = band) -> torch.Tensor:
                return functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                               enable_gqa=True)

            impls = (("SDPA band mask", masked), ("opforge window", banded),
                     ("SDPA flash causal (no window)",
                      lambda q, k, v: _sdpa_backend(SDPBackend.FLASH_ATTENTION)(q, k, v, True)),
                     ("opforge causal (no window)",
                      lambda q, k, v: _opforge_attention(q, k, v, True)))
            yield _checked_pair("attention window", shape, impls, leaves, upstream)
            pairs = s * window - window * (window - 1) // 2
            yield from _timed_passes("attention window", shape, impls, leaves, upstream,
                                     4 * b * h * pairs * d, warmup_ms, rep_ms)
            torch.cuda.empty_cache()
        except Exception as error:  # reported; the other rows still run
            yield _error_row("time", "attention window", shape, "bf16", "opforge", error)


# DeepSeek-V3's MLA sizes: He, Hcq, Hckv, N, D, Dr; token counts (decode, prefill).
MLA_SIZES = {"he": 7168, "hcq": 1536, "hckv": 512, "n": 128, "d": 128, "dr": 64}
MLA_TOKENS = (16, 1024)


def mla_torch(*inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """MlaProlog composed of torch ops (its OpDef's peer) at the default attributes."""
    from opforge.ops.mla_prolog import MLA_PROLOG

    return MLA_PROLOG.precision.peer(*inputs, 1e-5, 1e-5, "PA_BSND")


def _device_side(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` inside `opforge.device_side_checks` (no host read of indices)."""
    with opforge.device_side_checks():
        return function(*args)


def mla_rows(device: torch.device, compile_peers: bool, warmup_ms: int, rep_ms: int
             ) -> Iterator[Row]:
    """bf16 MlaProlog at DeepSeek-V3 sizes (T = 16 and 1024 tokens, 128 heads, a
    4096-slot cache) against the same computation composed of torch ops, eager and
    torch.compile (whose caches are functional copies: its scatter writes a new cache),
    and both opforge and the eager composition replayed from a CUDA graph (what a decode
    step does, without the host's launch costs); opforge also eagerly inside
    `opforge.device_side_checks` (no synchronisation for the slot check).
    After a check of query and query_rope against the composition (max error relative to
    the largest magnitude, bound 3e-2). TFLOP/s from the operator's cost; the
    ``fraction_of_copy`` column holds the speed relative to torch eager."""
    from opforge.ops.mla_prolog import mla_inputs

    for tokens in MLA_TOKENS:
        shape = f"T{tokens} He7168 N128"
        try:
            generator = torch.Generator().manual_seed(tokens)
            inputs = mla_inputs(tokens, torch.bfloat16, device, generator,
                                blocks=max(32, tokens // 16 + 1), block_size=128,
                                **MLA_SIZES)
            ours = opforge.mla_prolog(*[t.clone() for t in inputs])
            theirs = mla_torch(*inputs)
            worst = max(max_abs_diff(a, e) / e.float().abs().max().item()
                        for a, e in zip(ours[:2], theirs[:2]))
            yield (Row("check", "mla_prolog", shape, "bf16", "opforge vs torch ops",
                            max_abs_diff=worst, status="ok" if worst <= 3e-2 else "FAIL",
                            detail="max |diff| / max |torch|, bound 3e-2"))
            cost = opforge.plan("mla_prolog", *inputs).cost
            impls = [("opforge", functools.partial(opforge.mla_prolog, *inputs)),
                     ("torch eager", functools.partial(mla_torch, *inputs))]
            if compile_peers:
                impls.append(("torch.compile", functools.partial(
                    torch.compile(mla_torch, dynamic=False), *inputs)))
            # Decoding replays a captured step: both sides without their launch costs. The
            # torch composition's masked scatter (negative slots skip) synchronises, which
            # capture refuses: its row is n/a with the reason, opforge's would be an error.
            for name, call in impls[:2]:
                graphed = f"{name} (CUDA graph replay)"
                try:
                    impls.append((graphed, captured(call, device).replay))
                except Exception as error:  # a capture that fails is reported
                    row = _error_row("time", "mla_prolog", shape, "bf16", graphed, error)
                    yield row if name == "opforge" else replace(row, status="n/a")
            # Eager without the slot check's synchronisation: the host runs ahead.
            impls.append(("opforge (device-side checks)",
                          functools.partial(_device_side, opforge.mla_prolog, *inputs)))
            timings = {}
            for impl, call in impls:
                try:
                    call()
                    torch.cuda.synchronize()
                    timings[impl] = bench_us(call, warmup_ms, rep_ms)
                except Exception as error:  # reported; the other implementations still run
                    yield (_error_row("time", "mla_prolog", shape, "bf16", impl, error))
            eager_us = timings.get("torch eager")
            for impl, us in timings.items():
                yield (Row("time", "mla_prolog", shape, "bf16", impl, us, None,
                                cost.flops / (us * 1e-6) / 1e12,
                                eager_us / us if eager_us else None,
                                detail="TFLOP/s; ratio to torch eager"))
        except Exception as error:  # reported; the next size still runs
            yield (_error_row("time", "mla_prolog", shape, "bf16", "opforge", error))


GATING_TOKENS = (1, 128, 16384)
# The embedding gradient: V (Llama-3's vocabulary), D, T.
EMBEDDING_SHAPE = (128256, 4096, 16384)
DEEPSEEK_ROUTING = {"k_group": 4, "group_count": 8, "group_select_mode": 1, "norm_type": 1,
                    "routed_scaling_factor": 2.5}


def _gating_torch(x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, ...]:
    from opforge.ops.moe_gating import MOE_GATING_TOP_K

    return MOE_GATING_TOP_K.precision.peer(x, bias, 8, 4, 8, 1, 0, 1, False, 2.5, 1e-20,
                                           True, False)


def _routing_backward_rows(x: torch.Tensor, bias: torch.Tensor, shape: str,
                           compile_peers: bool, warmup_ms: int, rep_ms: int
                           ) -> Iterator[Row]:
    """Routing's forward + backward (the weights' gradient reaching the logits): opforge's
    backward kernel against autograd through the torch composition, eager and compiled,
    after a check of the logits' gradient."""
    leaf = x.detach().requires_grad_()
    upstream = torch.randn(x.shape[0], 8, device=x.device, dtype=x.dtype)

    def ours(t: torch.Tensor) -> torch.Tensor:
        return opforge.moe_gating_top_k(t, 8, bias=bias, **DEEPSEEK_ROUTING)[0]

    def theirs(t: torch.Tensor) -> torch.Tensor:
        return _gating_torch(t, bias)[0]

    impls = [("opforge", ours), ("torch eager", theirs)]
    if compile_peers:
        impls.append(("torch.compile", torch.compile(theirs, dynamic=False)))
    (got,) = torch.autograd.grad(ours(leaf), leaf, upstream)
    (expected,) = torch.autograd.grad(theirs(leaf), leaf, upstream)
    # Rows whose experts come in one order: the upstream gradient meets the same experts
    # (tied scores may be ordered either way, and then y's columns differ).
    same = (opforge.moe_gating_top_k(x, 8, bias=bias, **DEEPSEEK_ROUTING)[1].long()
            == _gating_torch(x, bias)[1]).all(-1)
    worst = ((got.float() - expected.float())[same].abs().max()
             / expected.float()[same].abs().max().clamp_min(1e-30)).item()
    yield Row("check", "moe_gating_top_k fwd+bwd", shape, "bf16", "dx vs torch eager",
              max_abs_diff=worst, status="ok" if worst <= 2e-2 else "FAIL",
              detail=f"max |diff| / max |torch| over the {int(same.sum())} of "
                     f"{same.numel()} rows in one order, bound 2e-2")
    timings = {impl: bench_us(lambda call=call: torch.autograd.grad(call(leaf), leaf,
                                                                    upstream),
                              warmup_ms, rep_ms) for impl, call in impls}
    moved = 2 * x.numel() * x.element_size()  # the logits read, their gradient written
    for impl, us in timings.items():
        yield Row("time", "moe_gating_top_k fwd+bwd", shape, "bf16", impl, us, moved,
                  bandwidth(moved, us), timings["torch eager"] / us,
                  detail="ratio to torch eager")


def routing_rows(device: torch.device, compile_peers: bool, warmup_ms: int, rep_ms: int
                 ) -> Iterator[Row]:
    """DeepSeek-V3 routing (E = 256, 8 groups, k_group 4, k 8, sigmoid, bias) at T = 1,
    128 and 16384 against the torch composition, eager and compiled, after a check that
    the experts agree; then the embedding gradient (V = 128256, D = 4096, T = 16384, bf16,
    uniform and Zipf indices), atomic and deterministic, against aten. The
    ``fraction_of_copy`` column holds the speed relative to torch eager."""
    from opforge.ops.embedding_dense_grad import zipf_indices

    generator = torch.Generator().manual_seed(4)
    for tokens in GATING_TOKENS:
        shape = f"T{tokens} E256"
        try:
            x = torch.randn(tokens, 256, generator=generator).to(device, torch.bfloat16)
            bias = (0.05 * torch.randn(256, generator=generator)).to(device, torch.bfloat16)
            ours = opforge.moe_gating_top_k(x, 8, bias=bias, **DEEPSEEK_ROUTING)
            theirs = _gating_torch(x, bias)
            same = torch.equal(ours[1].sort(-1)[0], theirs[1].sort(-1)[0])
            yield (Row("check", "moe_gating_top_k", shape, "bf16", "experts vs torch",
                            status="ok" if same else "FAIL", detail="same expert sets"))
            impls = [("opforge", functools.partial(opforge.moe_gating_top_k, x, 8, bias=bias,
                                                   **DEEPSEEK_ROUTING)),
                     ("torch eager", functools.partial(_gating_torch, x, bias))]
            if compile_peers:
                impls.append(("torch.compile", functools.partial(
                    torch.compile(_gating_torch, dynamic=False), x, bias)))
            timings = {impl: bench_us(call, warmup_ms, rep_ms) for impl, call in impls}
            for impl, us in timings.items():
                yield (Row("time", "moe_gating_top_k", shape, "bf16", impl, us,
                                x.numel() * 2, bandwidth(x.numel() * 2, us),
                                timings["torch eager"] / us, detail="ratio to torch eager"))
            yield from _routing_backward_rows(x, bias, shape, compile_peers, warmup_ms,
                                              rep_ms)
        except Exception as error:  # reported; the next size still runs
            yield (_error_row("time", "moe_gating_top_k", shape, "bf16", "opforge",
                                   error))
    vocabulary, width, tokens = EMBEDDING_SHAPE
    for name in ("uniform", "zipf"):
        shape = f"V{vocabulary} D{width} T{tokens} {name}"
        try:
            grad = torch.randn(tokens, width, generator=generator).to(device, torch.bfloat16)
            indices = (torch.randint(0, vocabulary, (tokens,), generator=generator)
                       if name == "uniform" else zipf_indices((tokens,), vocabulary,
                                                              generator))
            indices = indices.to(device)
            impls = [(f"opforge {mode}", functools.partial(
                opforge.embedding_dense_grad, grad, indices, vocabulary,
                deterministic=mode == "deterministic")) for mode in ("atomic",
                                                                     "deterministic")]
            impls.append(("torch aten", functools.partial(
                torch.ops.aten.embedding_dense_backward, grad, indices, vocabulary, -1,
                False)))
            expected = impls[2][1]().float()
            for impl, call in impls[:2]:
                diff = max_abs_diff(call(), expected)
                yield (Row("check", "embedding_dense_grad", shape, "bf16", impl,
                                max_abs_diff=diff, status="ok" if diff < 0.5 else "FAIL",
                                detail="vs aten, bf16 rows summed"))
            timings = {impl: bench_us(call, warmup_ms, rep_ms) for impl, call in impls}
            moved = grad.numel() * 2 + vocabulary * width * 2
            for impl, us in timings.items():
                yield (Row("time", "embedding_dense_grad", shape, "bf16", impl, us,
                                moved, bandwidth(moved, us), timings["torch aten"] / us,
                                detail="ratio to torch aten"))
        except Exception as error:  # reported; the next case still runs
            yield (_error_row("time", "embedding_dense_grad", shape, "bf16", "opforge",
                                   error))


def max_abs_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest ``|actual - expected|``, computed in float32."""
    return (actual.float() - expected.float()).abs().max().item()


def bench_us(fn: Callable[[], Any], warmup_ms: int, rep_ms: int) -> float:
    """Median microseconds of ``fn`` by `triton.testing.do_bench`."""
    return do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median") * 1e3


def bandwidth(bytes_moved: int, microseconds: float) -> float:
    """GB/s (10^9 bytes per second)."""
    return bytes_moved / (microseconds * 1e-6) / 1e9


def measure_copy(nbytes: int, device: torch.device, warmup_ms: int, rep_ms: int) -> Row:
    """Device-to-device copy of ``nbytes``: reads and writes ``nbytes`` each."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    us = bench_us(lambda: dst.copy_(src), warmup_ms, rep_ms)
    moved = 2 * nbytes
    return Row("copy", "copy_", f"{nbytes >> 20} MiB", "uint8", "torch", us, moved,
               bandwidth(moved, us), 1.0)


def _error_row(kind: str, op: str, shape: str, dtype: str, impl: str,
               error: Exception) -> Row:
    return Row(kind, op, shape, dtype, impl, status="ERROR",
               detail=f"{type(error).__name__}: {error}"[:300])


def check_case(case: OpCase) -> Row:
    """opforge vs torch eager on the case's inputs, with bfloat16 tolerances."""
    actual = case.opforge_fn(*case.inputs)
    expected = case.eager_fn(*case.inputs)
    torch.cuda.synchronize()
    diff = max_abs_diff(actual, expected)
    close = torch.allclose(actual.float(), expected.float(), rtol=BF16_RTOL, atol=BF16_ATOL)
    backend = opforge.plan(case.op, *case.inputs, **case.attrs).backend
    status = "ok" if close and backend == "triton" else "FAIL"
    detail = f"opforge backend={backend}" + ("" if close else "; outside bf16 tolerance")
    return Row("check", case.op, _shape_text(case.shape), _dtype_text(case.inputs[0].dtype),
               "opforge vs torch eager", max_abs_diff=diff, status=status, detail=detail)


def implementations(case: OpCase, compiled: Callable[..., torch.Tensor] | None
                    ) -> list[tuple[str, Callable[[], Any]]]:
    """(name, zero-argument call) for every implementation timed on ``case``."""
    inputs = case.inputs
    plan = opforge.plan(case.op, *inputs, **case.attrs)
    outs = [torch.empty(spec.shape, dtype=spec.dtype, device=inputs[0].device)
            for spec in plan.outputs]
    out = outs[0] if len(outs) == 1 else outs
    impls: list[tuple[str, Callable[[], Any]]] = [
        ("opforge functional", lambda: case.opforge_fn(*inputs)),
        # Planned once, output preallocated: the host path is just the launch, which tells
        # how much of the functional row is host overhead rather than kernel time.
        ("opforge plan.run(out=)", lambda: plan.run(*inputs, out=out)),
        ("torch eager", lambda: case.eager_fn(*inputs)),
    ]
    if compiled is not None:
        impls.append(("torch.compile", lambda: compiled(*inputs)))
    liger = _liger(case.op)
    if liger is not None:
        impls.append(("Liger-Kernel", lambda: liger(*inputs)))
    return impls


def time_case(case: OpCase, compiled: Callable[..., torch.Tensor] | None, copy_gb_s: float,
              warmup_ms: int, rep_ms: int) -> list[Row]:
    """One timing row per implementation; an implementation that raises gets an error row."""
    rows = []
    shape, dtype = _shape_text(case.shape), _dtype_text(case.inputs[0].dtype)
    for name, call in implementations(case, compiled):
        # A failing implementation (an inductor error, say) is reported and the others
        # still run: the machine time is scarce.
        try:
            # The first call compiles (Triton JIT, inductor): keep it out of do_bench's
            # estimate of how many calls fit in its time budget.
            call()
            torch.cuda.synchronize()
            us = bench_us(call, warmup_ms, rep_ms)
        except Exception as error:
            rows.append(_error_row("time", case.op, shape, dtype, name, error))
            continue
        gb_s = bandwidth(case.bytes_moved, us)
        rows.append(Row("time", case.op, shape, dtype, name, us, case.bytes_moved, gb_s,
                        gb_s / copy_gb_s))
    return rows


def measure_case(case: OpCase, compiled: Callable[..., torch.Tensor] | None,
                 copy_gb_s: float, warmup_ms: int, rep_ms: int) -> list[Row]:
    """The correctness check, then the timings, of one case; an error in the check or in
    planning becomes an ERROR row and the run goes on to the next case."""
    try:
        return [check_case(case), *time_case(case, compiled, copy_gb_s, warmup_ms, rep_ms)]
    except Exception as error:
        return [_error_row("check", case.op, _shape_text(case.shape),
                           _dtype_text(case.inputs[0].dtype), "opforge", error)]


def captured(call: Callable[[], Any], device: torch.device) -> torch.cuda.CUDAGraph:
    """``call`` captured in a CUDA graph, after a warm-up on a side stream as
    torch.cuda.graphs requires: the first launch compiles the Triton kernels, which must
    not happen during capture."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph


def graph_check(op: str, inputs: Tensors, attrs: dict[str, Any],
                reference: Callable[..., torch.Tensor], warmup_ms: int, rep_ms: int) -> Row:
    """Capture ``plan.run(*inputs, out=out, workspace=ws)`` in a CUDA graph, refill the
    captured inputs, replay, and compare with an ordinary run of the plan on the new values.

    The kernels are deterministic, so the replay must match the ordinary run exactly; the
    difference from torch is reported for information.
    """
    device = inputs[0].device
    plan = opforge.plan(op, *inputs, **attrs)
    spec = plan.outputs[0]
    out = torch.empty(spec.shape, dtype=spec.dtype, device=device)
    workspace = torch.empty(max(plan.workspace_bytes, 1), dtype=torch.uint8, device=device)
    graph = captured(functools.partial(plan.run, *inputs, out=out, workspace=workspace),
                     device)
    generator = torch.Generator(device=device).manual_seed(1)
    for tensor in inputs:
        tensor.copy_(torch.randn(tensor.shape, generator=generator, device=device,
                                 dtype=tensor.dtype))
    graph.replay()
    expected = plan.run(*inputs)
    torch.cuda.synchronize(device)
    identical = torch.equal(out, expected)
    us = bench_us(graph.replay, warmup_ms, rep_ms)
    detail = (f"backend={plan.backend}, tiling={plan.tiling.variant if plan.tiling else '-'}, "
              f"workspace={plan.workspace_bytes} B, replay equals run: {identical}")
    return Row("graph", op, _shape_text(tuple(inputs[0].shape)), _dtype_text(spec.dtype),
               "CUDA graph replay", us, max_abs_diff=max_abs_diff(out, reference(*inputs)),
               status="ok" if identical else "FAIL", detail=detail)


def graph_checks(dtype: torch.dtype, device: torch.device, warmup_ms: int, rep_ms: int
                 ) -> list[Row]:
    """Graph checks of a bias add (no workspace), a split reduce_sum and a long-row split
    softmax (both with a workspace)."""
    generator = torch.Generator(device=device).manual_seed(0)
    m, n = REDUCE_SHAPE
    a = torch.randn(m, n, generator=generator, device=device, dtype=dtype)
    b = torch.randn(n, generator=generator, device=device, dtype=dtype)
    x = torch.randn(m, n, generator=generator, device=device, dtype=dtype)
    long_rows = torch.randn(LONG_SOFTMAX_SHAPE, generator=generator, device=device,
                            dtype=dtype)
    cases = [
        ("broadcast_add", (a, b), {"alpha": ALPHA}, _bias_add),
        ("reduce_sum", (x,), {"dims": (0,)}, lambda t: t.sum(0)),
        ("softmax", (long_rows,), {}, _softmax),
    ]
    rows = []
    for op, inputs, attrs, reference in cases:
        try:
            rows.append(graph_check(op, inputs, attrs, reference, warmup_ms, rep_ms))
        except Exception as error:  # reported; the next check still runs
            rows.append(_error_row("graph", op, _shape_text((m, n)), _dtype_text(dtype),
                                   "CUDA graph replay", error))
    return rows


# ---------------------------------------------------------------------------------------------
# Report


def _shape_text(shape: tuple[int, ...]) -> str:
    return "x".join(str(d) for d in shape)


def _dtype_text(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(rows: Sequence[Row], env: dict[str, str], config: dict[str, Any]) -> str:
    """Environment, configuration, then one table each for copy, checks, timings, graphs."""
    lines = [f"# opforge GPU benchmark — {env['date']}", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in env.items()]
    lines += [f"| {k} | `{v}` |" for k, v in config.items()]
    copy = [r for r in rows if r.kind == "copy"]
    if copy:
        lines += ["", f"Copy bandwidth (`dst.copy_(src)`, {copy[0].shape}, "
                      f"2 x bytes / time): **{copy[0].gb_per_s:.0f} GB/s** "
                      f"({copy[0].median_us:.1f} µs)."]
    lines += ["", "## Correctness (opforge vs torch eager, before timing)", "",
              "| op | shape | dtype | max abs diff | status | detail |",
              "|---|---|---|---:|---|---|"]
    lines += [f"| {r.op} | {r.shape} | {r.dtype} | {_fmt(r.max_abs_diff, '.3g')} "
              f"| {r.status} | {r.detail} |" for r in rows if r.kind == "check"]
    lines += ["", "## Timings (do_bench median)", "",
              "| op | shape | dtype | implementation | µs | GB/s | of copy bw | status |",
              "|---|---|---|---|---:|---:|---:|---|"]
    lines += [f"| {r.op} | {r.shape} | {r.dtype} | {r.impl} | {_fmt(r.median_us, '.1f')} "
              f"| {_fmt(r.gb_per_s, '.0f')} | {_fmt(r.fraction_of_copy, '.1%')} "
              f"| {r.status}{' ' + r.detail if r.detail else ''} |"
              for r in rows if r.kind == "time"]
    lines += ["", "## CUDA graph capture of plan.run(..., out=, workspace=)", "",
              "| op | shape | dtype | replay µs | max abs diff vs torch | status | detail |",
              "|---|---|---|---:|---:|---|---|"]
    lines += [f"| {r.op} | {r.shape} | {r.dtype} | {_fmt(r.median_us, '.1f')} "
              f"| {_fmt(r.max_abs_diff, '.3g')} | {r.status} | {r.detail} |"
              for r in rows if r.kind == "graph"]
    lines += [
        "", "GB/s counts bytes read plus bytes written once each (the bias vector once). "
        "\"of copy bw\" divides by the copy bandwidth above. \"opforge functional\" includes "
        "the host path (torch.ops dispatch, plan-cache lookup, output allocation); when it "
        "is slower than \"opforge plan.run(out=)\", host overhead is not hidden behind the "
        "previous kernel. The graph rows' diff vs torch comes from summation order "
        "(reduce_sum) and is informational; the check is replay == ordinary run. "
        "matmul rows are compute-bound: their GB/s column holds TFLOP/s (2 n³ / time) and "
        "their \"of copy bw\" column the speed relative to torch.matmul (cuBLAS), with "
        "float32 run without tf32 on both sides. attention rows hold TFLOP/s in the GB/s "
        "column and the speed relative to SDPA's FlashAttention backend in the next; a "
        "backend that refuses a shape is marked n/a with its reason.",
    ]
    return "\n".join(lines) + "\n"


def _print_row(row: Row) -> None:
    # One line per result as it comes, so that a run cut short still leaves figures in
    # the log.
    print(" ".join(f"{k}={v}" for k, v in asdict(row).items() if v not in (None, "")),
          flush=True)


# ---------------------------------------------------------------------------------------------
# Command line


def tuning_markdown(records: Sequence[Any]) -> str:
    """The autotuning choices of the run: per bucket the chosen tiling and every
    candidate's time in µs (or the error that excluded it); empty without autotuning."""
    if not records:
        return ""
    lines = ["", "## Autotuning choices", "",
             "| operator | bucket | source | candidate | µs |", "|---|---|---|---|---:|"]
    for record in records:
        bucket = record.key.split(" | ")[1]
        for candidate, timing in record.timings_us.items():
            chosen = " **(chosen)**" if candidate == record.choice else ""
            lines.append(f"| {record.op} | `{bucket}` | {record.source} | "
                         f"`{candidate}`{chosen} | {timing} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path,
                        default=Path(os.environ.get("OUT") or
                                     Path(__file__).parent / "results"),
                        help="output directory (default: $OUT, else benchmarks/results)")
    parser.add_argument("--sizes", default="8192x8192,16384x8192",
                        help="comma-separated MxN shapes")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                        default="bfloat16")
    parser.add_argument("--warmup-ms", type=int, default=25, help="do_bench warmup (ms)")
    parser.add_argument("--rep-ms", type=int, default=100, help="do_bench measuring (ms)")
    parser.add_argument("--copy-mib", type=int, default=1024,
                        help="size of the copy-bandwidth buffer (MiB)")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--skip-attention", action="store_true",
                        help="skip the attention, MlaProlog, routing and embedding timings")
    parser.add_argument("--skip-bandwidth", action="store_true",
                        help="skip the memory-bound operators and the graph checks")
    parser.add_argument("--targets", action="store_true",
                        help="only the speed targets: attention at B 4, H 32, S 4096, D 128 "
                             "causal and MlaProlog at DeepSeek-V3 sizes")
    parser.add_argument("--autotune", action="store_true",
                        help="autotune opforge's tilings on first use; report the choices")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        args.shapes = [parse_shape(s) for s in args.sizes.split(",")]
    except ValueError as error:
        parser.error(str(error))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run checks and timings, write the results; 1 when anything failed."""
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_bench.py needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    # No "dtype" key: every row carries its dtype, and CSV columns must be unique.
    config = {"sizes": args.sizes, "warmup_ms": args.warmup_ms,
              "rep_ms": args.rep_ms, "copy_mib": args.copy_mib,
              "torch_compile": not args.no_compile, "seed": args.seed,
              "gelu_approximate": GELU_APPROXIMATE, "alpha": ALPHA,
              "autotune": args.autotune, "targets": args.targets}
    opforge.set_autotune(args.autotune)
    rows = [measure_copy(args.copy_mib << 20, device, args.warmup_ms, args.rep_ms)]
    _print_row(rows[0])
    copy_gb_s = rows[0].gb_per_s
    assert copy_gb_s is not None
    # Rows are printed as they come: a run stopped at its time limit keeps what it measured.
    parts: list[Iterator[Row]] = []
    if not args.skip_attention:
        parts += [attention_rows(device, args.warmup_ms, args.rep_ms,
                                 ATTENTION_SHAPES[:1] if args.targets else ATTENTION_SHAPES),
                  packed_attention_rows(device, args.warmup_ms, args.rep_ms),
                  windowed_attention_rows(device, args.warmup_ms, args.rep_ms),
                  mla_rows(device, not args.no_compile, args.warmup_ms, args.rep_ms)]
        if not args.targets:
            parts.append(routing_rows(device, not args.no_compile, args.warmup_ms,
                                      args.rep_ms))
    for row in itertools.chain(*parts):
        _print_row(row)
        rows.append(row)
    # One compiled function per operator: a new shape recompiles (dynamic=False), which
    # gives inductor's best kernel for each size, as a static-shape deployment would get.
    compiled: dict[str, Callable[..., torch.Tensor]] = {}
    generator = torch.Generator(device=device).manual_seed(args.seed)
    for shape in [] if args.skip_bandwidth or args.targets else args.shapes:
        for case in make_cases(shape, dtype, device, generator):
            if not args.no_compile and case.op not in compiled:
                compiled[case.op] = torch.compile(case.eager_fn, dynamic=False)
            new_rows = measure_case(case, compiled.get(case.op), copy_gb_s, args.warmup_ms,
                                    args.rep_ms)
            for row in new_rows:
                _print_row(row)
            rows += new_rows
        for row in forward_backward_rows(shape, dtype, device, copy_gb_s,
                                         not args.no_compile, args.warmup_ms, args.rep_ms):
            _print_row(row)
            rows.append(row)
        torch.cuda.empty_cache()
    for row in [] if args.targets else matmul_rows(device, not args.no_compile,
                                                   args.warmup_ms, args.rep_ms):
        _print_row(row)
        rows.append(row)
    skip_graphs = args.skip_bandwidth or args.targets
    for row in [] if skip_graphs else graph_checks(dtype, device, args.warmup_ms, args.rep_ms):
        _print_row(row)
        rows.append(row)
    env = environment(device)
    text = markdown(rows, env, config) + tuning_markdown(opforge.tuning_records())
    flat = [{**env, **config, **asdict(row)} for row in rows]
    csv_path, md_path = write_results(args.out, "gpu_bench", flat, text)
    print(text)
    print(f"wrote {csv_path} and {md_path}", file=sys.stderr)
    return 0 if all(r.status in ("ok", "n/a") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
