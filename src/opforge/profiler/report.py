"""A profile's report: its files, its summary, its verdicts; `analyse` reads one back.

Files written into the profile directory:

==========================  ===================================================================
``trace_view.json``         Chrome trace (Perfetto, chrome://tracing): one process per layer —
                            Python/framework, operators, runtime, kernels — with flows from
                            each operator to the kernels it launched; ``ts`` in µs from the
                            start, as numbers
``kernel_details.csv``      one row per kernel: torch_npu's columns, then FLOPs, Bytes,
                            Achieved GB/s, Achieved TFLOP/s, Bound, Roofline %
``operator_details.csv``    one row per operator call: host and device self/total time,
                            opforge's backend, tiling, grid and cost
``op_statistic.csv``        kernels grouped by operator type: count, total/avg/min/max, ratio,
                            the group's verdict
``step_trace_time.csv``     per step: computing, communication, overlap, free time
``roofline.png``            kernels against the bandwidth and compute roofs
``report.html``             one self-contained page: summary, steps, top kernels, verdicts,
                            operator statistics, the plot, advice
``profile_meta.json``       device, hardware profile, versions (what `analyse` re-reads)
``operator_memory.csv``     with ``profile_memory``: one row per allocation (operator, size,
                            allocation and release times, the allocator's totals)
==========================  ===================================================================
"""

from __future__ import annotations

import base64
import html
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from opforge.core.hardware import HardwareProfile
from opforge.profiler import roofline, tables
from opforge.profiler.tables import (
    KernelRow,
    MemoryRow,
    OperatorRow,
    ProfileMeta,
    Statistic,
    StepRow,
)

FILES = ("trace_view.json", "kernel_details.csv", "operator_details.csv", "op_statistic.csv",
         "step_trace_time.csv", "roofline.png", "report.html", "profile_meta.json")
TOP = 15
_LAYERS = {"framework": (1, "Python / framework"), "operator": (2, "Operators"),
           "runtime": (3, "Runtime (launches)"), "kernel": (4, "Kernels")}


@dataclass
class Report:
    """A profile's rows and the hardware they are judged against."""

    meta: ProfileMeta
    kernels: list[KernelRow]
    operators: list[OperatorRow]
    steps: list[StepRow]
    memory: list[MemoryRow] = field(default_factory=list)

    @property
    def hardware(self) -> HardwareProfile:
        """The profile the verdicts are judged against."""
        return self.meta.hardware_profile()

    def by_type(self) -> list[Statistic]:
        """Kernels grouped by operator type (``op_statistic.csv``)."""
        return tables.statistics(self.kernels, self.hardware, "type")

    def by_name(self) -> list[Statistic]:
        """Kernels grouped by kernel name, largest total time first."""
        return tables.statistics(self.kernels, self.hardware, "name")

    def flagged(self, top: int = TOP) -> list[tuple[Statistic, str]]:
        """The kernels among the ``top`` by time that reach no roof, with advice."""
        avg = {s.type: s.avg_us for s in self.by_name()}
        return [(s, roofline.advice(s.verdict, self.hardware, avg[s.type], s.block_num))
                for s in self.by_name()[:top]
                if s.verdict.bound in (roofline.LATENCY, roofline.UNKNOWN)]

    def verdict_shares(self) -> dict[str, tuple[int, float]]:
        """(kernel groups, share of kernel time in %) per bound."""
        shares: dict[str, tuple[int, float]] = {}
        for stat in self.by_name():
            count, share = shares.get(stat.verdict.bound, (0, 0.0))
            shares[stat.verdict.bound] = (count + 1, share + stat.ratio)
        return shares

    # -- files ----------------------------------------------------------------------------

    def write(self, out_dir: Path, timeline: Any | None = None) -> None:
        """Write every file of `FILES` (``trace_view.json`` needs the parsed timeline)."""
        out_dir.mkdir(parents=True, exist_ok=True)
        hardware = self.hardware
        if timeline is not None:
            write_trace_view(out_dir / "trace_view.json", timeline, self.kernels, hardware)
        tables.write_kernels(out_dir / "kernel_details.csv", self.kernels, hardware)
        tables.write_operators(out_dir / "operator_details.csv", self.operators)
        tables.write_statistics(out_dir / "op_statistic.csv", self.by_type(),
                                self.meta.device)
        tables.write_steps(out_dir / "step_trace_time.csv", self.steps)
        tables.write_meta(out_dir / "profile_meta.json", self.meta)
        if self.memory:
            tables.write_memory(out_dir / "operator_memory.csv", self.memory)
        else:
            # `analyse` reads the file whenever it exists: a previous profile's must go.
            (out_dir / "operator_memory.csv").unlink(missing_ok=True)
        self.plot(out_dir / "roofline.png")
        (out_dir / "report.html").write_text(self.html(out_dir / "roofline.png"))

    def plot(self, path: Path) -> Path:
        """``roofline.png``: each kernel group against the roofs."""
        stats = [s for s in self.by_name() if s.verdict.bound != roofline.UNKNOWN]
        points = [(s.type, s.verdict.intensity or 0.0, (s.verdict.tflops or 0.0) * 1e12,
                   s.ratio / 100, s.verdict.bound) for s in stats]
        dtypes = list(dict.fromkeys(k.dtype for k in self.kernels)) or [torch.float32]
        title = (f"{len(points)} kernels on {self.hardware.name} "
                 f"({self.hardware.source} ceilings); marker area: share of kernel time")
        return roofline.plot(points, self.hardware, dtypes, path, title)

    # -- summary --------------------------------------------------------------------------

    def summary_lines(self) -> list[str]:
        """Device, ceilings, steps and totals, with notes on the ceilings' trust."""
        hw = self.hardware
        kernel_us = sum(k.duration_us for k in self.kernels)
        stage_us = sum(s.stage for s in self.steps)
        peaks = ", ".join(f"{k} {v / 1e12:.3g} TFLOP/s"
                          for k, v in self.meta.hardware["peak_flops"].items())
        lines = [
            f"device {self.meta.device}, recorded with {self.meta.source} "
            f"(torch {self.meta.torch}) on {self.meta.created}",
            f"hardware profile {hw.name} ({hw.source}): {hw.memory_bandwidth / 1e9:.1f} GB/s,"
            f" {peaks}, {hw.core_count} cores",
            f"{len(self.steps)} step(s), {stage_us / 1e3:.3f} ms; {len(self.kernels)} kernel "
            f"launches, {kernel_us / 1e3:.3f} ms of kernel time; {len(self.operators)} "
            "operator calls",
        ]
        lines.extend(self.meta.notes)
        lines.extend(self.memory_lines())
        if hw.source in ("estimate", "runtime", "datasheet"):
            lines.append(f"the ceilings are {hw.source} figures: `opforge calibrate`, run on "
                         "the profiled device, measures its copy bandwidth and matmul rate")
        if any((s.verdict.roofline_pct or 0) > 100 for s in self.by_name()):
            lines.append("a roofline % above 100 means the data sat in a cache, or the "
                         "ceilings are too low for this device")
        return lines

    def memory_lines(self) -> list[str]:
        """Per device: the allocator's peak, and the operator allocating at that moment."""
        lines = []
        for device in dict.fromkeys(r.device for r in self.memory):
            rows = [r for r in self.memory if r.device == device]
            peak = max(rows, key=lambda r: r.allocation_total_allocated_mb)
            held = sum(1 for r in rows if r.release_us is None)
            lines.append(f"memory on {device}: {len(rows)} allocations, peak "
                         f"{peak.allocation_total_allocated_mb:.2f} MB allocated (reached in "
                         f"{peak.name}); {held} still held at the end")
        return lines

    def print_summary(self, console: Console | None = None, top: int = TOP) -> None:
        """Print the summary, the top kernels with their verdicts, and the advice."""
        console = console or Console(width=160)
        for line in self.summary_lines():
            console.print(line)
        table = Table(title=f"Top kernels by total time (of {len(self.by_name())})")
        for column in ("Kernel", "Type", "Calls", "Total ms", "%", "Avg us", "TFLOP/s",
                       "GB/s", "Roofline %", "Bound"):
            table.add_column(column, overflow="fold")
        for stat in self.by_name()[:top]:
            table.add_row(*_stat_cells(stat, self._type_of(stat.type)))
        console.print(table)
        shares = self.verdict_shares()
        console.print("Verdicts: " + "; ".join(
            f"{bound} {share:.1f}% of kernel time ({count} kernels)"
            for bound, (count, share) in sorted(shares.items(), key=lambda kv: -kv[1][1])))
        for stat, line in self.flagged(top):
            console.print(f"[bold]{stat.type}[/bold]: {line}")

    def _type_of(self, name: str) -> str:
        """The operator type of the kernels called ``name``."""
        return next((k.type for k in self.kernels if k.name == name), "")

    # -- HTML -----------------------------------------------------------------------------

    def html_sections(self, plot_path: Path | None = None, top: int = TOP
                      ) -> list[tuple[str, str, str]]:
        """``(id, title, HTML)`` of each section of the report page."""
        esc = html.escape
        stats = self.by_name()[:top]
        shares = self.verdict_shares()
        flagged = self.flagged(top)
        return [
            ("summary", "Summary", "".join(f"<p>{esc(line)}</p>"
                                           for line in self.summary_lines())),
            ("steps", "Steps", html_table(
                ["Step", "Stage ms", "Computing ms", "Communication ms", "Overlapped ms",
                 "Free ms", "Preparing ms"],
                [[s.step, *(f"{v / 1e3:.3f}" for v in (s.stage, s.computing, s.communication,
                                                       s.overlapped, s.free, s.preparing))]
                 for s in self.steps])),
            ("top-kernels", "Top kernels", html_table(
                ["Kernel", "Type", "Calls", "Total ms", "%", "Avg us", "TFLOP/s", "GB/s",
                 "Roofline %", "Bound"],
                [_stat_cells(s, self._type_of(s.type)) for s in stats])),
            ("verdicts", "Verdicts", html_table(
                ["Bound", "Kernels", "Share of kernel time %"],
                [[bound, str(count), f"{share:.1f}"]
                 for bound, (count, share) in sorted(shares.items(),
                                                     key=lambda kv: -kv[1][1])])
             + "<p>compute- or memory-bound: at 80% or more of that roof; latency-bound: "
               "below 80% of both; unknown: no cost known.</p>"),
            ("operators", "Operator statistics", html_table(
                ["Type", "Core", "Count", "Total ms", "Avg us", "Min us", "Max us", "Ratio %",
                 "Bound"],
                [[s.type, s.core, str(s.count), f"{s.total_us / 1e3:.3f}", f"{s.avg_us:.1f}",
                  f"{s.min_us:.1f}", f"{s.max_us:.1f}", f"{s.ratio:.1f}", s.verdict.bound]
                 for s in self.by_type()[:top]])),
            ("roofline", "Roofline", embedded_image(plot_path, "roofline")),
            ("advice", "Advice", "<ul>" + "".join(
                f"<li><b>{esc(stat.type)}</b>: {esc(line)}</li>" for stat, line in flagged)
             + "</ul>" if flagged else "<p>Every kernel among the top reaches a roof.</p>"),
        ] + ([("memory", "Largest allocations", html_table(
            ["Operator", "Size KB", "Allocated at us", "Held us", "Total allocated MB",
             "Device"],
            [[r.name, f"{r.size_kb:.1f}", f"{r.allocation_us:.1f}",
              "to the end" if r.duration_us is None else f"{r.duration_us:.1f}",
              f"{r.allocation_total_allocated_mb:.2f}", r.device]
             for r in sorted(self.memory, key=lambda r: -r.size_kb)[:top]]))]
             if self.memory else [])

    def html(self, plot_path: Path | None = None) -> str:
        """One self-contained page (styles inline, the plot embedded as a data URI)."""
        return html_page("opforge profile", self.html_sections(plot_path))


STYLE = ("body{font-family:sans-serif;margin:2em;max-width:1200px}"
         "table{border-collapse:collapse;font-size:13px}"
         "td,th{border:1px solid #ccc;padding:3px 6px;text-align:left}"
         "th{background:#eee}img{max-width:100%}pre{background:#f6f6f6;padding:1em;"
         "white-space:pre-wrap}section{margin-bottom:2em}")


def html_page(title: str, sections: Sequence[tuple[str, str, str]], intro: str = "") -> str:
    """A self-contained page: ``sections`` as ``(id, heading, HTML)``, styles inline."""
    esc = html.escape
    body = "".join(f'<section id="{key}"><h2>{esc(heading)}</h2>{content}</section>'
                   for key, heading, content in sections)
    return (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>{esc(title)}"
            f"</title><style>{STYLE}</style></head><body><h1>{esc(title)}</h1>{intro}"
            f"{body}</body></html>")


def embedded_image(path: Path | None, alt: str) -> str:
    """An ``<img>`` holding the PNG at ``path`` as a data URI (a note when it is missing)."""
    if path is None or not path.exists():
        return "<p>(no plot)</p>"
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _stat_cells(stat: Statistic, kind: str) -> list[str]:
    v = stat.verdict
    return [stat.type, kind, str(stat.count), f"{stat.total_us / 1e3:.3f}",
            f"{stat.ratio:.1f}", f"{stat.avg_us:.1f}",
            "" if v.tflops is None else f"{v.tflops:.4f}",
            "" if v.gbs is None else f"{v.gbs:.2f}",
            "" if v.roofline_pct is None else f"{v.roofline_pct:.1f}", v.bound]


def html_table(header: Sequence[str] | None, rows: Sequence[Sequence[str]]) -> str:
    """An HTML table of text cells (escaped); no header row when ``header`` is None."""
    esc = html.escape
    head = ("<thead><tr>" + "".join(f"<th>{esc(h)}</th>" for h in header) + "</tr></thead>"
            if header is not None else "")
    body = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>"
                   for row in rows)
    return f"<table>{head}<tbody>{body}</tbody></table>"


def write_trace_view(path: Path, timeline: Any, kernels: Sequence[KernelRow],
                     hardware: HardwareProfile) -> Path:
    """The Chrome trace: one process per layer, numeric ``ts``/``dur`` in µs from the start,
    flows (small integer ids) from each operator to its kernels, events in time order."""
    threads: dict[tuple[str, Any], int] = {}
    metadata: list[dict[str, Any]] = []
    for pid, label in _LAYERS.values():
        metadata.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                         "args": {"name": label}})
        metadata.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                         "args": {"sort_index": pid}})

    def place(layer: str, event: Any) -> tuple[int, int]:
        key = (layer, (event.pid, event.tid))
        if key not in threads:
            threads[key] = sum(1 for k in threads if k[0] == layer) + 1
            metadata.append({"ph": "M", "name": "thread_name", "pid": _LAYERS[layer][0],
                             "tid": threads[key],
                             "args": {"name": f"{event.pid}/{event.tid}"}})
        return _LAYERS[layer][0], threads[key]

    timed: list[dict[str, Any]] = []
    for event in timeline.events:
        if event.layer == "kernel":
            continue
        pid, tid = place(event.layer, event)
        args = dict(event.record) if event.record is not None else {}
        if "Input Dims" in event.args:
            args["Input Dims"] = event.args["Input Dims"]
        timed.append({"ph": "X", "name": event.name, "cat": event.layer, "pid": pid,
                      "tid": tid, "ts": round(event.ts, 3), "dur": round(event.dur, 3),
                      "args": args})
    for flow, (kernel, row) in enumerate(zip(timeline.kernels, kernels), start=1):
        pid, tid = place("kernel", kernel)
        verdict = row.verdict(hardware)
        timed.append({"ph": "X", "name": kernel.name, "cat": "kernel", "pid": pid, "tid": tid,
                      "ts": round(kernel.ts, 3), "dur": round(kernel.dur, 3),
                      "args": {"Type": row.type, "Block Num": row.block_num,
                               "FLOPs": row.flops, "Bytes": row.bytes_moved,
                               "Bound": verdict.bound,
                               "Roofline %": verdict.roofline_pct}})
        owner = kernel.owner
        if owner is not None and owner.layer == "operator":
            opid, otid = place("operator", owner)
            timed.append({"ph": "s", "name": "launch", "cat": "flow", "id": flow,
                          "pid": opid, "tid": otid, "ts": round(owner.ts, 3)})
            timed.append({"ph": "f", "bp": "e", "name": "launch", "cat": "flow", "id": flow,
                          "pid": pid, "tid": tid, "ts": round(kernel.ts, 3)})
    timed.sort(key=lambda e: e["ts"])
    path.write_text(json.dumps({"traceEvents": metadata + timed, "displayTimeUnit": "ms",
                                "otherData": {"producer": "opforge", "time_unit": "us"}}))
    return path


def analyse(directory: str | Path, hardware: HardwareProfile | None = None) -> Report:
    """Read a profile directory back; judge it against ``hardware`` when given (else the
    profile it was recorded with).

    Raises:
        FileNotFoundError: the directory lacks a file the report needs.
        ValueError: a CSV does not have opforge's columns.
    """
    directory = Path(directory)
    needed = ("profile_meta.json", "kernel_details.csv", "operator_details.csv",
              "step_trace_time.csv")
    missing = [name for name in needed if not (directory / name).exists()]
    if missing:
        raise FileNotFoundError(f"{directory} is not an opforge profile: missing "
                                f"{', '.join(missing)}")
    meta = tables.read_meta(directory / "profile_meta.json")
    if hardware is not None:
        meta.hardware = ProfileMeta.describe(hardware)
    memory = directory / "operator_memory.csv"
    return Report(meta, tables.read_kernels(directory / "kernel_details.csv"),
                  tables.read_operators(directory / "operator_details.csv"),
                  tables.read_steps(directory / "step_trace_time.csv"),
                  tables.read_memory(memory) if memory.exists() else [])
