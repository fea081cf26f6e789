"""`opforge verify`: every operator x dtype x case on the selected backends, judged by the
operator's precision standard against a float64 golden and compared with torch's own
operator on the same inputs.

The cases of an operator are its own samples (`OpDef.samples`: extremes, broadcasting,
strides) and the sweep: every kind of `opforge.precision.cases` over `SWEEP_SHAPES`, built by
its `PrecisionSpec.sweep`. For each case:

- the golden is the operator's reference at float64 on the CPU; goldens beyond the output
  dtype's range count as the ±Inf that a correctly rounded result is;
- outputs are poisoned with NaN before the kernel writes them, so an unwritten element
  fails;
- each floating output is judged by `opforge.precision.standards.judge` with the OpDef's
  category and level, the peer (torch's operator in the same dtype) measured against the
  same golden; integer and bool outputs by binary consistency;
- a case that misses its standard is ``known`` when one of the OpDef's known limitations
  covers it (the report shows the reason), else ``fail``; an exception is ``error``.

``max_eps`` (the error in eps of the output dtype relative to the operator's error scale,
see `opforge.precision.metrics`) is reported next to the standard's metrics: it is the
condition-aware measure the test suite bounds with `EPS_BOUNDS`.
"""

from __future__ import annotations

import json
import math
import time
import traceback
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from opforge.core import backends
from opforge.core.opdef import Case, OpDef, dtype_name
from opforge.core.plan import plan, set_poison
from opforge.precision.cases import KINDS, generate, sweep
from opforge.precision.metrics import Metrics, compare_tensors
from opforge.precision.standards import judge

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Bounds on max_eps used by the test suite. float16/bfloat16 outputs come from a float32
# computation rounded once to nearest: 0.5 eps, plus the float32 computation's own error
# carried into the rounding: the bound is 1. float32 outputs carry the computation's own error (exp,
# polynomial fits, summation order, and on the torch backend torch's float32 transcendental
# kernels, whose results vary by a few ulps with the library path taken): the bound is 32,
# the per-element float32 threshold of the Ascend ULP standard.
EPS_BOUNDS = {torch.float32: 32.0, torch.float16: 1.0, torch.bfloat16: 1.0,
              torch.float64: 32.0}
SWEEP_SHAPES: tuple[tuple[int, ...], ...] = ((7,), (4097,), (33, 17), (63, 1000), (4, 7, 33),
                                             (0, 5))
# Long rows once, three of them: each is 65537 elements, and more rows add time, not cases.
LONG_ROWS_SHAPE = (3, 1)
CASE_SETS = ("samples", "sweep")
STATUSES = ("pass", "warning", "known", "fail", "error", "skip")
_SEVERITY = {"pass": 0, "warning": 1, "error": 2}


@dataclass
class CaseResult:
    """One case of one operator on one backend and dtype.

    ``status``: ``pass``, ``warning``, ``known`` (misses the standard, covered by a known
    limitation whose reason is ``detail``), ``fail`` (misses the standard), ``error`` (an
    exception, in ``detail``) or ``skip`` (the backend cannot run here). The error fields
    are the worst over the case's outputs; ``peer_*`` are torch's operator's (NaN without
    a peer).
    """

    op: str
    case: str
    backend: str
    dtype: str
    status: str
    category: str = ""
    max_abs: float = 0.0
    max_rel: float = 0.0
    mean_rel: float = 0.0
    max_eps: float = 0.0
    peer_max_rel: float = math.nan
    peer_mean_rel: float = math.nan
    peer_max_eps: float = math.nan
    nan_inf_mismatch: int = 0
    reasons: list[str] = field(default_factory=list)
    detail: str = ""


def backend_refusal(backend: str, device: torch.device) -> str | None:
    """Why ``backend`` cannot run on ``device`` in this process (None when it can)."""
    if backend == "triton":
        if not backends.triton_available():
            return "triton is not installed"
        if device.type == "cpu" and not backends.interpreter_enabled():
            return "CPU runs need TRITON_INTERPRET=1"
    return None


def case_name(kind: str, shape: Sequence[int]) -> str:
    """``"normal_33x17"``: the name of a sweep case (``long_rows`` names its real shape)."""
    if kind == "long_rows":
        from opforge.precision.cases import LONG_ROW

        shape = (*(tuple(shape[:-1]) or (1,)), LONG_ROW)
    return f"{kind}_{'x'.join(map(str, shape))}"


def default_sweep(opdef: OpDef) -> Callable[..., list[Case]]:
    """The sweep of an operator without its own: each required tensor input drawn from the
    kind and shape independently, attributes at their defaults."""
    def build(kind: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
              generator: torch.Generator) -> list[Case]:
        inputs = tuple(None if arg.optional else
                       generate(kind, shape, dtype, device=device, generator=generator)
                       for arg in opdef.inputs)
        return [Case("", inputs)]
    return build


def verification_cases(opdef: OpDef, dtype: torch.dtype, device: torch.device | str = "cpu",
                       seed: int = 0, case_sets: Sequence[str] = CASE_SETS,
                       kinds: Sequence[str] = KINDS,
                       shapes: Sequence[Sequence[int]] = SWEEP_SHAPES) -> list[Case]:
    """The cases ``opforge verify`` runs for ``opdef`` in ``dtype``: its samples and/or
    its sweep over ``kinds`` x ``shapes`` (``long_rows`` once, as `LONG_ROWS_SHAPE`). The
    samples draw from a generator seeded with ``seed``, each sweep point (kind, shape) from
    its own (`sweep_seed`): a case has the same inputs whichever case sets run with it.

    Raises:
        ValueError: an unknown case set.
    """
    unknown = set(case_sets) - set(CASE_SETS)
    if unknown:
        raise ValueError(f"unknown case set(s) {sorted(unknown)}; expected {CASE_SETS}")
    device = torch.device(device)
    cases: list[Case] = []
    if "samples" in case_sets:
        cases += opdef.samples(dtype, device, torch.Generator().manual_seed(seed))
    if "sweep" in case_sets:
        build = opdef.precision.sweep or default_sweep(opdef)
        pairs = [*sweep([k for k in kinds if k != "long_rows"], shapes),
                 *sweep([k for k in kinds if k == "long_rows"], [LONG_ROWS_SHAPE])]
        for kind, shape in pairs:
            generator = torch.Generator().manual_seed(sweep_seed(seed, kind, shape))
            for case in build(kind, shape, dtype, device, generator):
                name = case_name(kind, shape)
                cases.append(Case(f"{name}_{case.name}" if case.name else name,
                                  case.inputs, case.attrs))
    return cases


def sweep_seed(seed: int, kind: str, shape: Sequence[int]) -> int:
    """The seed of one sweep point: the same on every machine and in every selection."""
    return (seed * 1_000_003 + zlib.crc32(f"{kind}:{tuple(shape)}".encode())) % 2**63


def golden_of(opdef: OpDef, case: Case) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(golden outputs, error scales) of a case, in float64 on the CPU."""
    # Indices, masks and mutated inputs (caches: state, whose dtype can define their
    # layout) keep their dtype; floating inputs are widened.
    wide = [None if t is None else t.detach().to("cpu", torch.float64)
            if t.is_floating_point() and i not in opdef.mutated_inputs
            else t.detach().to("cpu") for i, t in enumerate(case.inputs)]
    full_attrs = opdef.bind_attrs(case.attrs)
    outputs = opdef.reference_fn(*wide, compute_dtype=torch.float64, **full_attrs)
    goldens = list(outputs) if isinstance(outputs, tuple) else [outputs]
    scales = [opdef.error_scale(opdef, wide, full_attrs, g, name)
              for g, name in zip(goldens, result_names(opdef))]
    return goldens, scales


def result_names(opdef: OpDef) -> list[str]:
    """The outputs' names, then the mutated inputs': what a call produces, in order."""
    return [*(out.name for out in opdef.outputs),
            *(opdef.inputs[i].name for i in opdef.mutated_inputs)]


def rounded_range(golden: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``golden`` with the values that overflow ``dtype`` when rounded set to the ±Inf a
    correctly rounded result is (a float64 golden of 1e39 is Inf in float32)."""
    if not dtype.is_floating_point or dtype == golden.dtype:
        return golden
    rounded = golden.to(dtype)
    return torch.where(rounded.isinf() & golden.isfinite(), rounded.to(golden.dtype), golden)


def _as_list(outputs: object) -> list[torch.Tensor]:
    return list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]


def judge_case(opdef: OpDef, case: Case, backend: str, dtype: torch.dtype) -> CaseResult:
    """Run one case on ``backend`` and judge every output (see the module docstring)."""
    spec = opdef.precision
    result = CaseResult(opdef.name, case.name, backend, dtype_name(dtype), "pass",
                        category=spec.category)
    goldens, scales = golden_of(opdef, case)
    inputs = [t.clone() if i in opdef.mutated_inputs else t
              for i, t in enumerate(case.inputs)]
    with backends.use_backend(backend):
        outputs = _as_list(plan(opdef, *inputs, **case.attrs).run(*inputs))
    outputs += [inputs[i] for i in opdef.mutated_inputs]
    peers: list[torch.Tensor | None] = [None] * len(outputs)
    if spec.peer is not None:
        with torch.no_grad():
            peers = _as_list(spec.peer(*case.inputs, **opdef.bind_attrs(case.attrs)))
    worst: Metrics | None = None
    worst_name = ""
    severity = 0
    names = result_names(opdef)
    for name, out, golden, scale, peer_out in zip(names, outputs, goldens, scales, peers):
        golden = rounded_range(golden, out.dtype)
        ours = compare_tensors(out, golden, scale=scale)
        theirs = None if peer_out is None else compare_tensors(peer_out, golden, scale=scale)
        category = spec.category if out.dtype.is_floating_point else "binary"
        verdict = judge(ours, out.dtype, category, peer=theirs, level=spec.level)
        severity = max(severity, _SEVERITY[verdict.status])
        # Each reason ends with the output it is about (limitations' patterns end in *).
        result.reasons += [f"{reason} [{name}]" if len(names) > 1 else reason
                           for reason in verdict.reasons]
        if worst is None or ours.max_eps > worst.max_eps or ours.nan_inf_mismatch:
            worst, worst_name = ours, name
        result.max_abs = max(result.max_abs, ours.max_abs)
        result.max_rel = max(result.max_rel, ours.max_rel)
        result.mean_rel = max(result.mean_rel, ours.mean_rel)
        result.max_eps = max(result.max_eps, ours.max_eps)
        result.nan_inf_mismatch += ours.nan_inf_mismatch
        if theirs is not None:
            result.peer_max_rel = max(_or_zero(result.peer_max_rel), theirs.max_rel)
            result.peer_mean_rel = max(_or_zero(result.peer_mean_rel), theirs.mean_rel)
            result.peer_max_eps = max(_or_zero(result.peer_max_eps), theirs.max_eps)
    result.status = ("pass", "warning", "fail")[severity]
    if result.status == "fail":
        known = spec.limitation(case.name, backend, result.dtype, result.reasons)
        if known is not None:
            result.status, result.detail = "known", known.reason
        elif worst is not None and worst.worst:
            element = worst.worst[0]
            result.detail = (f"worst element {element.index}"
                             + (f" of {worst_name}" if len(names) > 1 else "")
                             + f": {element.actual!r} vs golden {element.golden!r}")
    return result


def _or_zero(value: float) -> float:
    return 0.0 if math.isnan(value) else value


def verify(ops: Iterable[OpDef], dtypes: Sequence[torch.dtype] = DTYPES,
           backend_names: Sequence[str] = ("torch", "triton"),
           device: torch.device | str = "cpu", seed: int = 0,
           case_sets: Sequence[str] = CASE_SETS,
           progress: Callable[[int, CaseResult | None], None] | None = None
           ) -> list[CaseResult]:
    """Judge every case of every operator on each backend and dtype, with output poisoning
    on. Never raises for a failing case: exceptions become ``status="error"`` results.

    ``progress(total, result)`` is called once with ``result=None`` when the number of
    cases is known, then after each case.
    """
    device = torch.device(device)
    plan_of_work = []
    for opdef in ops:
        for dtype in dtypes:
            if dtype in opdef.inputs[0].dtypes:
                plan_of_work.append((opdef, dtype, verification_cases(
                    opdef, dtype, device, seed, case_sets)))
    total = sum(len(cases) for _, _, cases in plan_of_work) * len(backend_names)
    if progress is not None:
        progress(total, None)
    results: list[CaseResult] = []
    set_poison(True)
    try:
        for opdef, dtype, cases in plan_of_work:
            for backend in backend_names:
                refusal = backend_refusal(backend, device)
                for case in cases:
                    if refusal:
                        result = CaseResult(opdef.name, case.name, backend, dtype_name(dtype),
                                            "skip", category=opdef.precision.category,
                                            detail=refusal, max_rel=math.nan,
                                            max_eps=math.nan)
                    else:
                        result = _guarded(opdef, case, backend, dtype)
                    results.append(result)
                    if progress is not None:
                        progress(total, result)
    finally:
        set_poison(False)
    return results


def _guarded(opdef: OpDef, case: Case, backend: str, dtype: torch.dtype) -> CaseResult:
    try:
        return judge_case(opdef, case, backend, dtype)
    except Exception as error:  # one broken case must not end the sweep: it is reported
        return CaseResult(opdef.name, case.name, backend, dtype_name(dtype), "error",
                          category=opdef.precision.category,
                          detail=f"{type(error).__name__}: {error}\n"
                                 + traceback.format_exc(limit=3))


def summarize(results: Sequence[CaseResult]) -> list[dict[str, object]]:
    """One row per (op, backend, dtype): case counts per status, the worst errors of
    opforge and of torch's operator, and the row's status (the worst of its cases:
    FAIL > known > warning > pass; skip when the backend could not run)."""
    rows: dict[tuple[str, str, str], dict[str, object]] = {}
    for r in results:
        row = rows.setdefault((r.op, r.backend, r.dtype), {
            "op": r.op, "backend": r.backend, "dtype": r.dtype, "category": r.category,
            "cases": 0, **{status: 0 for status in STATUSES}, "max_rel": math.nan,
            "peer_max_rel": math.nan, "max_eps": math.nan, "peer_max_eps": math.nan,
            "status": "pass", "detail": ""})
        row["cases"] = int(row["cases"]) + 1
        row[r.status] = int(row[r.status]) + 1
        for name in ("max_rel", "max_eps", "peer_max_rel", "peer_max_eps"):
            value = getattr(r, name)
            if not math.isnan(value):
                row[name] = max(_or_zero(float(row[name])), value)
        if r.status == "skip":
            row["detail"] = r.detail
    for row in rows.values():
        row["status"] = ("FAIL" if row["fail"] or row["error"] else
                         "known" if row["known"] else "warning" if row["warning"] else
                         "skip" if row["skip"] == row["cases"] else "pass")
    return list(rows.values())


def _environment(device: str) -> dict[str, object]:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:  # pragma: no cover
        triton_version = "not installed"
    accelerator = (torch.cuda.get_device_name() if device.startswith("cuda")
                   and torch.cuda.is_available() else "CPU")
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__,
            "triton": triton_version, "device": device, "accelerator": accelerator,
            "interpreter": backends.interpreter_enabled()}


def _fmt(value: float) -> str:
    return "—" if math.isnan(value) else f"{value:.3g}"


@dataclass(frozen=True)
class Certificate:
    """A precision certificate read back: its provenance line, its totals line and its
    results table (one dict per row: op, backend, dtype, cases, pass, ..., status)."""

    provenance: str
    totals: str
    rows: tuple[dict[str, str], ...]


RESULT_COLUMNS = ("op", "backend", "dtype", "cases", "pass", "warning", "known", "fail",
                  "error", "max rel", "max eps", "status")


def read_certificate(path: Path | str) -> Certificate:
    """Read a certificate written by `render_markdown` (``docs/precision-certificate.md``).

    Raises:
        ValueError: the file lacks the provenance line, the totals or the results table.
    """
    lines = Path(path).read_text().splitlines()
    provenance = next((line for line in lines if line.startswith("Generated by")), None)
    totals = next((line.strip("*") for line in lines if line.startswith("**")), None)
    header = "| " + " | ".join(RESULT_COLUMNS) + " |"
    if provenance is None or totals is None or header not in lines:
        raise ValueError(f"{path} is not an opforge precision certificate")
    start = lines.index(header) + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows.append(dict(zip(RESULT_COLUMNS, cells)))
    return Certificate(provenance, totals, tuple(rows))


def render_markdown(results: Sequence[CaseResult], meta: dict[str, object],
                    ops: Sequence[OpDef], plot_name: str | None) -> str:
    """The verification report / precision certificate as Markdown."""
    counts = {status: sum(r.status == status for r in results) for status in STATUSES}
    lines = [
        "# opforge precision certificate", "",
        f"Generated by `opforge verify` on {meta['date']}: torch {meta['torch']}, "
        f"triton {meta['triton']}, device {meta['device']} ({meta['accelerator']}), "
        f"Triton interpreter {'on' if meta['interpreter'] else 'off'}, seed {meta['seed']}, "
        f"case sets: {', '.join(meta['case_sets'])}.", "",
        "Each case runs opforge and torch's own operator on the same inputs and compares "
        "both with the float64 golden; the operator's standard (`docs/precision.md`) "
        "decides. *max rel*: the largest relative error; *max eps*: the largest error in "
        "eps of the output dtype relative to the operator's error scale (0.5 is a correctly "
        "rounded result). Each column shows opforge / torch.", "",
        f"**{len(results)} cases: {counts['pass']} pass, {counts['warning']} warning, "
        f"{counts['known']} known limitation, {counts['fail']} fail, {counts['error']} "
        f"error, {counts['skip']} skipped.**", "",
        "## Standards", "",
        "| op | category | level | peer |", "|---|---|---|---|",
    ]
    for opdef in ops:
        spec = opdef.precision
        peer = "—" if spec.peer is None else (spec.peer.__doc__ or spec.peer.__name__)
        lines.append(f"| {opdef.name} | {spec.category} | {spec.level} | "
                     f"{peer.strip().splitlines()[0]} |")
    lines += ["", "## Results", "",
              "| op | backend | dtype | cases | pass | warning | known | fail | error | "
              "max rel | max eps | status |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in summarize(results):
        lines.append(
            f"| {row['op']} | {row['backend']} | {row['dtype']} | {row['cases']} | "
            f"{row['pass']} | {row['warning']} | {row['known']} | {row['fail']} | "
            f"{row['error']} | {_fmt(float(row['max_rel']))} / "
            f"{_fmt(float(row['peer_max_rel']))} | {_fmt(float(row['max_eps']))} / "
            f"{_fmt(float(row['peer_max_eps']))} | {row['status']} |")
    if plot_name:
        lines += ["", f"![error per case, opforge vs torch]({plot_name})"]
    lines += ["", "## Known limitations", ""]
    known_lines = []
    for opdef in ops:
        for limit in opdef.precision.known_limitations:
            # The cases this limitation decided: the first that matches, as judge_case
            # chose it (a case matching two is counted once).
            hits = [r for r in results if r.op == opdef.name and r.status == "known"
                    and opdef.precision.limitation(r.case, r.backend, r.dtype,
                                                   r.reasons) is limit]
            known_lines.append(
                f"- **{opdef.name}** (case `{limit.case}`, backend `{limit.backend}`, dtype "
                f"`{limit.dtype}`, failures `{' | '.join(limit.patterns)}`): {limit.reason} — "
                f"{len(hits)} case(s) here"
                + (": " + ", ".join(f"{r.case}/{r.backend}/{r.dtype}" for r in hits[:6])
                   + (" ..." if len(hits) > 6 else "") if hits else "."))
    lines += known_lines or ["None."]
    failures = [r for r in results if r.status in ("fail", "error", "warning")]
    lines += ["", "## Failures and warnings", ""]
    lines += [f"- {r.op} / {r.case} / {r.backend} / {r.dtype}: **{r.status}**: "
              + "; ".join(r.reasons + ([r.detail.splitlines()[0]] if r.detail else []))
              for r in failures] or ["None."]
    return "\n".join(lines) + "\n"


def plot_errors(results: Sequence[CaseResult], path: Path | str) -> Path:
    """A PNG with one panel per dtype: for each operator, the distribution over cases of
    the max error in eps for opforge on each backend and for torch's operator."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    judged = [r for r in results if r.status not in ("skip", "error")]
    dtypes = sorted({r.dtype for r in judged})
    ops = sorted({r.op for r in judged})
    backend_names = sorted({r.backend for r in judged})
    series = [(f"opforge ({b})", b, "max_eps") for b in backend_names] + \
             [("torch operator", backend_names[0] if backend_names else "", "peer_max_eps")]
    floor = 1e-3
    figure, axes = plt.subplots(max(len(dtypes), 1), 1, figsize=(max(6, 1.6 * len(ops)),
                                                                  3.2 * max(len(dtypes), 1)),
                                squeeze=False)
    width = 0.8 / len(series)
    for axis, dtype in zip(axes[:, 0], dtypes):
        for index, (label, backend, field_name) in enumerate(series):
            data, positions = [], []
            for position, op in enumerate(ops):
                values = [max(getattr(r, field_name), floor) for r in judged
                          if r.op == op and r.dtype == dtype and r.backend == backend
                          and not math.isnan(getattr(r, field_name))]
                if values:
                    data.append(values)
                    positions.append(position + (index - (len(series) - 1) / 2) * width)
            if data:
                boxes = axis.boxplot(data, positions=positions, widths=width * 0.9,
                                     patch_artist=True, showfliers=True)
                colour = f"C{index}"
                for box in boxes["boxes"]:
                    box.set_facecolor(colour)
                axis.plot([], [], color=colour, linewidth=6, label=label)
        axis.set_yscale("log")
        axis.set_xticks(range(len(ops)), ops, fontsize=8)
        axis.set_ylabel("max error (eps)")
        axis.set_title(f"{dtype}: error per case vs the float64 golden", fontsize=9)
        axis.legend(fontsize=7, loc="upper right")
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return path


def _json_safe(value: object) -> object:
    """``value`` with every non-finite float as None (JSON has no NaN or Infinity)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    return value


def write_report(results: Sequence[CaseResult], directory: Path | str,
                 ops: Sequence[OpDef] = (), device: str = "cpu", seed: int = 0,
                 case_sets: Sequence[str] = CASE_SETS,
                 certificate: Path | str | None = None) -> Path:
    """Write ``verify.json`` (every case), ``verify.md`` and ``verify.png`` under
    ``directory``, and the same Markdown and plot as ``certificate`` (``.md``) and its
    ``.png`` twin when given; returns the Markdown path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    meta = {**_environment(device), "seed": seed, "case_sets": list(case_sets)}
    (directory / "verify.json").write_text(json.dumps(
        _json_safe({"meta": meta, "cases": [asdict(r) for r in results]}), indent=1,
        allow_nan=False))
    plot = plot_errors(results, directory / "verify.png")
    path = directory / "verify.md"
    path.write_text(render_markdown(results, meta, ops, plot.name))
    if certificate is not None:
        certificate = Path(certificate)
        certificate.parent.mkdir(parents=True, exist_ok=True)
        plot_errors(results, certificate.with_suffix(".png"))
        certificate.write_text(render_markdown(results, meta, ops,
                                               certificate.with_suffix(".png").name))
    return path
