"""`opforge verify`: every operator's samples, on each backend and dtype, against the
float64 golden (the operator's reference at float64 on the CPU).

Outputs are poisoned with NaN before the kernel writes them, so an unwritten element fails.
A case passes when NaN/Inf positions match the golden and ``max_eps`` (the error in units
of the output dtype's eps relative to the operator's error scale, see
`opforge.precision.metrics`) is within the dtype's bound.
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from opforge.core import backends
from opforge.core.errors import OpError
from opforge.core.opdef import Case, OpDef, dtype_name
from opforge.core.plan import plan, set_poison
from opforge.precision.metrics import Metrics, compare_tensors

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Bounds on max_eps. float16/bfloat16 outputs come from a float32 computation rounded once:
# at most 0.5 eps with round-to-nearest, 1 eps where the Triton interpreter truncates bf16
# stores. float32 outputs carry the computation's own error (exp, polynomial fits,
# summation order, and on the torch backend torch's float32 transcendental kernels, whose
# results vary by a few ulps with the library path taken): the bound is 32, the per-element
# float32 threshold of the Ascend ULP standard.
EPS_BOUNDS = {torch.float32: 32.0, torch.float16: 1.0, torch.bfloat16: 1.0,
              torch.float64: 32.0}


@dataclass
class CaseResult:
    """One case of one operator on one backend and dtype."""

    op: str
    case: str
    backend: str
    dtype: str
    status: str  # "pass", "fail", "error" or "skip"
    max_abs: float = 0.0
    max_rel: float = 0.0
    max_eps: float = 0.0
    bound: float = 0.0
    nan_inf_mismatch: int = 0
    detail: str = ""


def backend_refusal(backend: str, device: torch.device) -> str | None:
    """Why ``backend`` cannot run on ``device`` in this process (None when it can)."""
    if backend == "triton":
        if not backends.triton_available():
            return "triton is not installed"
        if device.type == "cpu" and not backends.interpreter_enabled():
            return "CPU runs need TRITON_INTERPRET=1"
    return None


def golden_of(opdef: OpDef, case: Case) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(golden outputs, error scales) of a case, in float64 on the CPU."""
    wide = [None if t is None else t.detach().to("cpu", torch.float64) for t in case.inputs]
    full_attrs = opdef.bind_attrs(case.attrs)
    outputs = opdef.reference_fn(*wide, compute_dtype=torch.float64, **full_attrs)
    goldens = list(outputs) if isinstance(outputs, tuple) else [outputs]
    scales = [opdef.error_scale(opdef, wide, full_attrs, g) for g in goldens]
    return goldens, scales


def _judge(opdef: OpDef, case: Case, backend: str, dtype: torch.dtype) -> CaseResult:
    result = CaseResult(opdef.name, case.name, backend, dtype_name(dtype), "pass")
    goldens, scales = golden_of(opdef, case)
    with backends.use_backend(backend):
        outputs = plan(opdef, *case.inputs, **case.attrs).run(*case.inputs)
    outputs = list(outputs) if isinstance(outputs, tuple) else [outputs]
    worst: Metrics | None = None
    for out, golden, scale in zip(outputs, goldens, scales):
        stats = compare_tensors(out, golden, scale=scale)
        result.bound = EPS_BOUNDS[out.dtype]
        if worst is None or stats.max_eps > worst.max_eps or stats.nan_inf_mismatch:
            worst = stats
        result.max_abs = max(result.max_abs, stats.max_abs)
        result.max_rel = max(result.max_rel, stats.max_rel)
        result.max_eps = max(result.max_eps, stats.max_eps)
        result.nan_inf_mismatch += stats.nan_inf_mismatch
    if result.nan_inf_mismatch or result.max_eps > result.bound:
        result.status = "fail"
        if worst is not None:
            result.detail = (f"worst element {worst.worst_index}; "
                             f"{result.nan_inf_mismatch} NaN/Inf mismatches")
    return result


def verify_op(opdef: OpDef, dtypes: Sequence[torch.dtype] = DTYPES,
              backend_names: Sequence[str] = ("torch", "triton"),
              device: torch.device | str = "cpu", seed: int = 0) -> list[CaseResult]:
    """Run every sample of ``opdef`` on each backend and dtype; never raises for a failing
    case (errors are recorded as ``status="error"`` with the message)."""
    device = torch.device(device)
    results = []
    for backend in backend_names:
        refusal = backend_refusal(backend, device)
        for dtype in dtypes:
            if dtype not in opdef.inputs[0].dtypes:
                continue
            if refusal:
                results.append(CaseResult(opdef.name, "*", backend, dtype_name(dtype), "skip",
                                          detail=refusal))
                continue
            generator = torch.Generator().manual_seed(seed)
            for case in opdef.samples(dtype, device, generator):
                try:
                    results.append(_judge(opdef, case, backend, dtype))
                except (OpError, RuntimeError, ValueError) as error:
                    results.append(CaseResult(opdef.name, case.name, backend,
                                              dtype_name(dtype), "error",
                                              detail=f"{type(error).__name__}: {error}"
                                              + "\n" + traceback.format_exc(limit=3)))
    return results


def verify(ops: Iterable[OpDef], dtypes: Sequence[torch.dtype] = DTYPES,
           backend_names: Sequence[str] = ("torch", "triton"),
           device: torch.device | str = "cpu", seed: int = 0) -> list[CaseResult]:
    """`verify_op` over several operators, with output poisoning on."""
    set_poison(True)
    try:
        return [r for op in ops for r in verify_op(op, dtypes, backend_names, device, seed)]
    finally:
        set_poison(False)


def summarize(results: Sequence[CaseResult]) -> list[dict[str, object]]:
    """One row per (op, backend, dtype): worst errors over its cases and the verdict."""
    rows: dict[tuple[str, str, str], dict[str, object]] = {}
    for r in results:
        key = (r.op, r.backend, r.dtype)
        row = rows.setdefault(key, {"op": r.op, "backend": r.backend, "dtype": r.dtype,
                                    "cases": 0, "max_abs": 0.0, "max_rel": 0.0,
                                    "max_eps": 0.0, "bound": r.bound, "status": "pass",
                                    "failed": [], "detail": ""})
        row["cases"] = int(row["cases"]) + (r.status != "skip")
        for field in ("max_abs", "max_rel"):
            row[field] = max(float(row[field]), getattr(r, field))
        # Cases of one row may have different bounds (a float32 output among bf16 ones):
        # show the case closest to its bound.
        if r.bound and r.max_eps / r.bound >= float(row["max_eps"]) / max(float(row["bound"]),
                                                                          1e-30):
            row["max_eps"], row["bound"] = r.max_eps, r.bound
        if r.status in ("fail", "error"):
            row["status"] = "FAIL"
            first_line = r.detail.splitlines()[0] if r.detail else ""
            row["failed"].append(f"{r.case}: {r.status} {first_line}")
        elif r.status == "skip":
            row["status"] = "skip"
            row["detail"] = r.detail
    return list(rows.values())


def write_report(results: Sequence[CaseResult], directory: Path | str) -> Path:
    """Write ``verify.json`` (every case) and ``verify.md`` (the summary) under
    ``directory``; returns the Markdown path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__,
            "interpreter": backends.interpreter_enabled()}
    (directory / "verify.json").write_text(json.dumps(
        {"meta": meta, "cases": [asdict(r) for r in results]}, indent=1))
    lines = [f"# opforge verify — {meta['date']}", "",
             f"torch {meta['torch']}, Triton interpreter: {meta['interpreter']}. "
             "max_eps: error in eps of the output dtype relative to the error scale; "
             "a case passes when max_eps <= bound and NaN/Inf match the golden.", "",
             "| op | backend | dtype | cases | max abs | max rel | max eps | bound | status |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in summarize(results):
        lines.append(f"| {row['op']} | {row['backend']} | {row['dtype']} | {row['cases']} | "
                     f"{row['max_abs']:.3g} | {row['max_rel']:.3g} | {row['max_eps']:.3g} | "
                     f"{row['bound']:g} | {row['status']} |")
    failures = [r for r in results if r.status in ("fail", "error")]
    if failures:
        lines += ["", "## Failures", ""]
        lines += [f"- {r.op} / {r.case} / {r.backend} / {r.dtype}: {r.status}: {r.detail}"
                  for r in failures]
    path = directory / "verify.md"
    path.write_text("\n".join(lines) + "\n")
    return path
