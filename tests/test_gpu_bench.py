"""benchmarks/gpu_bench.py's row functions, run on the CPU at tiny sizes with one call in
place of each timing: a Python error in a script only the GPU machine runs would cost a
GPU session its few minutes. Every row is ``ok`` or ``n/a`` (a backend that refuses the
CPU), but for CUDA-graph capture, which needs a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import opforge

from .conftest import needs_triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

pytestmark = needs_triton


@pytest.fixture
def gpu_bench(monkeypatch):
    import gpu_bench

    monkeypatch.setattr(gpu_bench, "bench_us", lambda fn, warmup_ms, rep_ms: (fn(), 1.0)[1])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    sizes = {"ATTENTION_SHAPES": ((1, 2, 2, 32, 32, 32, True), (1, 4, 2, 1, 80, 32, False)),
             "PACKED_LENGTHS": (20, 12), "PACKED_HEADS": (2, 1, 32),
             "WINDOW_SHAPE": (1, 2, 1, 48, 32), "WINDOWS": (16,),
             "MLA_SIZES": {"he": 64, "hcq": 32, "hckv": 32, "n": 2, "d": 16, "dr": 16},
             "MLA_TOKENS": (4,), "GATING_TOKENS": (3,), "EMBEDDING_SHAPE": (64, 32, 40),
             "MATMUL_SHAPES": ((32, torch.bfloat16), (16, torch.float32))}
    for name, value in sizes.items():
        assert hasattr(gpu_bench, name), name  # a renamed constant would go unnoticed
        monkeypatch.setattr(gpu_bench, name, value)
    return gpu_bench


def _failures(rows) -> list[str]:
    return [f"{row.op} {row.shape} {row.impl}: {row.status} {row.detail}" for row in rows
            if row.status not in ("ok", "n/a") and "CUDA graph" not in row.impl]


def test_the_row_functions_run(gpu_bench, monkeypatch):
    """On the Triton backend (its interpreter here), as the GPU machine runs them."""
    device = torch.device("cpu")
    monkeypatch.setattr(opforge.core.backends, "_triton_refusal", lambda device: None)
    with opforge.use_backend("triton"):
        rows = _rows(gpu_bench, device)
    assert _failures(rows) == []
    timed = {row.op for row in rows if row.kind == "time" and row.median_us}
    assert {"attention fwd", "attention fwd+bwd", "attention_varlen fwd+bwd",
            "attention window fwd+bwd", "mla_prolog", "moe_gating_top_k",
            "moe_gating_top_k fwd+bwd", "embedding_dense_grad", "matmul",
            "rms_norm fwd+bwd", "cross_entropy fwd+bwd", "softmax", "silu_mul",
            "silu_mul fwd+bwd", "gelu_tanh_mul", "gelu_tanh_mul fwd+bwd"} <= timed


def _rows(gpu_bench, device: torch.device) -> list:
    rows = [*gpu_bench.attention_rows(device, 1, 1, gpu_bench.ATTENTION_SHAPES),
            *gpu_bench.packed_attention_rows(device, 1, 1),
            *gpu_bench.windowed_attention_rows(device, 1, 1),
            *gpu_bench.mla_rows(device, False, 1, 1),
            *gpu_bench.routing_rows(device, False, 1, 1),
            *gpu_bench.matmul_rows(device, False, 1, 1),
            *gpu_bench.forward_backward_rows((6, 64), torch.bfloat16, device, 1.0, False,
                                             1, 1)]
    generator = torch.Generator().manual_seed(0)
    for case in gpu_bench.make_cases((6, 64), torch.bfloat16, device, generator):
        rows += gpu_bench.measure_case(case, None, 1.0, 1, 1)
    return rows


def test_the_cache_hint_variants_run(tmp_path, monkeypatch):
    """benchmarks/cache_hints.py on the CPU: every hint variant of both kernels compiles
    for the interpreter and matches torch (its check), and the report is written."""
    import cache_hints

    monkeypatch.setattr(sys, "argv", ["cache_hints.py", "--device", "cpu", "--out",
                                      str(tmp_path)])
    cache_hints.main()
    (report,) = tmp_path.glob("cache_hints_*.md")
    rows = [line for line in report.read_text().splitlines() if line.startswith("| copy")
            or line.startswith("| softmax")]
    assert len(rows) == 1 + 2 * len(cache_hints.HINTS)


def test_the_loss_breakdown_tells_products_from_the_rest(monkeypatch):
    """benchmarks/linear_cross_entropy_memory.py's CUDA table: each implementation's step
    runs once under the profiler (faked here), matmuls and GEMMs count as products,
    every other kernel as the rest."""
    import kernel_breakdown
    import linear_cross_entropy_memory as memory

    ran = []

    def kernel_times(step, iterations):
        step()
        return [("_matmul_kernel", 10.0, 4), ("sm90_xmma_gemm_bf16bf16", 5.0, 1),
                ("_merge_block_kernel", 2.0, 1), ("vectorized_elementwise_kernel", 1.0, 2)]

    monkeypatch.setattr(kernel_breakdown, "kernel_times", kernel_times)
    lines = memory.kernel_breakdown([("fused", lambda *tensors: ran.append(len(tensors)))],
                                    [torch.ones(1), torch.ones(1)], torch.zeros(1))
    assert ran == [3]
    assert lines[2].startswith("| fused | 15 | 3 | _matmul_kernel 10 (4); ")
