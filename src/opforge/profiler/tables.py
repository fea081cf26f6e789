"""The rows of a profile's files, and how they are written and read back.

The CSV files keep torch_npu.profiler's names and leading columns (`kernel_details.csv`,
`operator_details.csv`, `op_statistic.csv`, `step_trace_time.csv`), so that readers of
Ascend profiles find what they know; opforge's columns follow them. Times are microseconds
since the profile started. `profile_meta.json` records the device and the hardware profile
the verdicts were judged against, so that ``opforge analyse`` can re-read a directory.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from opforge.core.hardware import HardwareProfile
from opforge.profiler.roofline import Verdict, judge

KERNEL_COLUMNS = (
    "Name", "Type", "Accelerator Core", "Start Time(us)", "Duration(us)", "Wait Time(us)",
    "Block Num", "Input Shapes", "Input Data Types", "Output Shapes", "FLOPs", "Bytes",
    "Achieved GB/s", "Achieved TFLOP/s", "Bound", "Roofline %")
OPERATOR_COLUMNS = (
    "Name", "Input Shapes", "Call Stack", "Host Self Duration(us)", "Host Total Duration(us)",
    "Device Self Duration(us)", "Device Total Duration(us)",
    "Device Self Duration With AICore(us)", "Device Total Duration With AICore(us)",
    "Backend", "Tiling", "Grid", "FLOPs", "Bytes")
STATISTIC_COLUMNS = (
    "Device_id", "OP Type", "Core Type", "Count", "Total Time(us)", "Avg Time(us)",
    "Min Time(us)", "Max Time(us)", "Ratio(%)", "FLOPs", "Bytes", "Achieved GB/s",
    "Achieved TFLOP/s", "Bound", "Roofline %")
STEP_COLUMNS = (
    "Step", "Computing", "Communication(Not Overlapped)", "Overlapped", "Communication",
    "Free", "Stage", "Bubble", "Preparing")
MEMORY_COLUMNS = (
    "Name", "Size(KB)", "Allocation Time(us)", "Release Time(us)", "Duration(us)",
    "Allocation Total Allocated(MB)", "Allocation Total Reserved(MB)",
    "Release Total Allocated(MB)", "Release Total Reserved(MB)", "Device Type")
FLOATING = ("float32", "float16", "bfloat16", "float64")


@dataclass
class KernelRow:
    """One kernel launch: a device kernel, or on the CPU one operator call that runs alone.

    ``flops``/``bytes_moved`` are ``None`` where no cost is known (a kernel of an operator
    that launched several kernels shares the operator's cost, which the operator row keeps).
    """

    name: str
    type: str
    core: str
    start_us: float
    duration_us: float
    wait_us: float = 0.0
    block_num: int | None = None
    input_shapes: str = ""
    input_dtypes: str = ""
    output_shapes: str = ""
    flops: float | None = None
    bytes_moved: float | None = None

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype whose roof applies: the first floating input's."""
        for name in self.input_dtypes.split(";"):
            if name in FLOATING:
                return getattr(torch, name)
        return torch.float32

    def verdict(self, hardware: HardwareProfile) -> Verdict:
        """This launch against ``hardware``'s roofline."""
        return judge(self.flops, self.bytes_moved, self.duration_us * 1e-6, hardware,
                     self.dtype)


@dataclass
class OperatorRow:
    """One operator call (torch's or opforge's) with its host and device times."""

    name: str
    input_shapes: str
    call_stack: str
    host_self_us: float
    host_total_us: float
    device_self_us: float
    device_total_us: float
    backend: str = ""
    tiling: str = ""
    grid: str = ""
    flops: float | None = None
    bytes_moved: float | None = None


@dataclass
class StepRow:
    """The time split of one profiler step, in microseconds."""

    step: str
    computing: float
    communication_not_overlapped: float
    overlapped: float
    communication: float
    free: float
    stage: float
    bubble: float = 0.0
    preparing: float = 0.0


@dataclass
class MemoryRow:
    """One allocation: the operator that made it, its size, when it was released (``None``:
    still held when the profile ended) and the allocator's totals at both moments."""

    name: str
    size_kb: float
    allocation_us: float
    release_us: float | None
    duration_us: float | None
    allocation_total_allocated_mb: float
    allocation_total_reserved_mb: float
    release_total_allocated_mb: float | None
    release_total_reserved_mb: float | None
    device: str


@dataclass
class ProfileMeta:
    """What a profile was taken on and judged against."""

    device: str
    hardware: dict[str, Any]
    torch: str
    created: str
    steps: int
    source: str = "torch.profiler"
    notes: list[str] = field(default_factory=list)

    @staticmethod
    def describe(hardware: HardwareProfile) -> dict[str, Any]:
        """``hardware`` as JSON-ready figures (what `hardware_profile` rebuilds)."""
        return {"name": hardware.name, "device_type": hardware.device_type,
                "memory_bandwidth": hardware.memory_bandwidth,
                "peak_flops": {str(d).removeprefix("torch."): v
                               for d, v in hardware.peak_flops.items()},
                "core_count": hardware.core_count, "onchip_bytes": hardware.onchip_bytes,
                "source": hardware.source}

    def hardware_profile(self) -> HardwareProfile:
        """The `HardwareProfile` the verdicts are judged against."""
        h = self.hardware
        return HardwareProfile(h["name"], h["device_type"], float(h["memory_bandwidth"]),
                               {getattr(torch, k): float(v) for k, v in h["peak_flops"].items()},
                               onchip_bytes=int(h["onchip_bytes"]),
                               core_count=int(h["core_count"]), source=h["source"])


@dataclass
class Statistic:
    """The kernels of one type: count, times and their aggregated verdict."""

    type: str
    core: str
    count: int
    total_us: float
    min_us: float
    max_us: float
    ratio: float
    flops: float | None
    bytes_moved: float | None
    block_num: int | None
    verdict: Verdict

    @property
    def avg_us(self) -> float:
        """Mean duration of a call."""
        return self.total_us / self.count


def statistics(kernels: Sequence[KernelRow], hardware: HardwareProfile,
               key: str = "type") -> list[Statistic]:
    """Kernels grouped by ``key`` (``"type"`` or ``"name"``), largest total time first.

    A group's cost is the sum of its calls' costs when every call has one; its verdict is
    judged on the summed cost and time.
    """
    groups: dict[tuple[str, str], list[KernelRow]] = {}
    for row in kernels:
        groups.setdefault((getattr(row, key), row.core), []).append(row)
    total = sum(row.duration_us for row in kernels) or 1.0
    result = []
    for (name, core), rows in groups.items():
        time_us = sum(r.duration_us for r in rows)
        costed = all(r.flops is not None and r.bytes_moved is not None for r in rows)
        flops = sum(r.flops or 0.0 for r in rows) if costed else None
        moved = sum(r.bytes_moved or 0.0 for r in rows) if costed else None
        blocks = {r.block_num for r in rows}
        result.append(Statistic(
            name, core, len(rows), time_us, min(r.duration_us for r in rows),
            max(r.duration_us for r in rows), 100.0 * time_us / total, flops, moved,
            blocks.pop() if len(blocks) == 1 else None,
            judge(flops, moved, time_us * 1e-6, hardware, rows[0].dtype)))
    return sorted(result, key=lambda s: -s.total_us)


def _number(value: float | None, digits: int = 3) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def _count(value: float | None) -> str:
    return "" if value is None else f"{value:.0f}"


def _verdict_cells(verdict: Verdict) -> list[str]:
    return [_number(verdict.gbs), _number(verdict.tflops, 4), verdict.bound,
            _number(verdict.roofline_pct, 1)]


def _write(path: Path, header: Sequence[str], rows: Iterable[Sequence[Any]]) -> Path:
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def write_kernels(path: Path, kernels: Sequence[KernelRow], hardware: HardwareProfile) -> Path:
    """``kernel_details.csv``: one row per launch, verdicts against ``hardware``."""
    return _write(path, KERNEL_COLUMNS, (
        [k.name, k.type, k.core, _number(k.start_us), _number(k.duration_us),
         _number(k.wait_us), "" if k.block_num is None else k.block_num, k.input_shapes,
         k.input_dtypes, k.output_shapes, _count(k.flops), _count(k.bytes_moved),
         *_verdict_cells(k.verdict(hardware))] for k in kernels))


def write_operators(path: Path, operators: Sequence[OperatorRow]) -> Path:
    """``operator_details.csv``: one row per operator call."""
    return _write(path, OPERATOR_COLUMNS, (
        [o.name, o.input_shapes, o.call_stack, _number(o.host_self_us),
         _number(o.host_total_us), _number(o.device_self_us), _number(o.device_total_us),
         _number(o.device_self_us), _number(o.device_total_us), o.backend, o.tiling, o.grid,
         _count(o.flops), _count(o.bytes_moved)] for o in operators))


def write_statistics(path: Path, stats: Sequence[Statistic], device_id: str) -> Path:
    """``op_statistic.csv``: one row per kernel group."""
    return _write(path, STATISTIC_COLUMNS, (
        [device_id, s.type, s.core, s.count, _number(s.total_us), _number(s.avg_us),
         _number(s.min_us), _number(s.max_us), _number(s.ratio, 2), _count(s.flops),
         _count(s.bytes_moved), *_verdict_cells(s.verdict)] for s in stats))


def write_steps(path: Path, steps: Sequence[StepRow]) -> Path:
    """``step_trace_time.csv``: one row per step."""
    return _write(path, STEP_COLUMNS, (
        [s.step, *(_number(v) for v in (s.computing, s.communication_not_overlapped,
                                         s.overlapped, s.communication, s.free, s.stage,
                                         s.bubble, s.preparing))] for s in steps))


def write_memory(path: Path, rows: Sequence[MemoryRow]) -> Path:
    """``operator_memory.csv``: one row per allocation."""
    return _write(path, MEMORY_COLUMNS, (
        [r.name, _number(r.size_kb), _number(r.allocation_us), _number(r.release_us),
         _number(r.duration_us), _number(r.allocation_total_allocated_mb),
         _number(r.allocation_total_reserved_mb), _number(r.release_total_allocated_mb),
         _number(r.release_total_reserved_mb), r.device] for r in rows))


def write_meta(path: Path, meta: ProfileMeta) -> Path:
    """``profile_meta.json``."""
    path.write_text(json.dumps(asdict(meta), indent=2))
    return path


def _read(path: Path, header: Sequence[str]) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        if tuple(reader.fieldnames or ()) != tuple(header):
            raise ValueError(f"{path} does not have the columns of an opforge profile: "
                             f"expected {', '.join(header)}; found "
                             f"{', '.join(reader.fieldnames or ())}")
        return list(reader)


def _optional(text: str) -> float | None:
    return float(text) if text else None


def read_kernels(path: Path) -> list[KernelRow]:
    """Rows of a ``kernel_details.csv`` (`ValueError` on other columns)."""
    return [KernelRow(r["Name"], r["Type"], r["Accelerator Core"], float(r["Start Time(us)"]),
                      float(r["Duration(us)"]), float(r["Wait Time(us)"] or 0),
                      int(r["Block Num"]) if r["Block Num"] else None, r["Input Shapes"],
                      r["Input Data Types"], r["Output Shapes"], _optional(r["FLOPs"]),
                      _optional(r["Bytes"])) for r in _read(path, KERNEL_COLUMNS)]


def read_operators(path: Path) -> list[OperatorRow]:
    """Rows of an ``operator_details.csv`` (`ValueError` on other columns)."""
    return [OperatorRow(r["Name"], r["Input Shapes"], r["Call Stack"],
                        float(r["Host Self Duration(us)"]), float(r["Host Total Duration(us)"]),
                        float(r["Device Self Duration(us)"]),
                        float(r["Device Total Duration(us)"]), r["Backend"], r["Tiling"],
                        r["Grid"], _optional(r["FLOPs"]), _optional(r["Bytes"]))
            for r in _read(path, OPERATOR_COLUMNS)]


def read_steps(path: Path) -> list[StepRow]:
    """Rows of a ``step_trace_time.csv`` (`ValueError` on other columns)."""
    return [StepRow(r["Step"], *(float(r[c]) for c in STEP_COLUMNS[1:]))
            for r in _read(path, STEP_COLUMNS)]


def read_memory(path: Path) -> list[MemoryRow]:
    """Rows of an ``operator_memory.csv`` (`ValueError` on other columns)."""
    return [MemoryRow(r["Name"], float(r["Size(KB)"]), float(r["Allocation Time(us)"]),
                      _optional(r["Release Time(us)"]), _optional(r["Duration(us)"]),
                      float(r["Allocation Total Allocated(MB)"]),
                      float(r["Allocation Total Reserved(MB)"]),
                      _optional(r["Release Total Allocated(MB)"]),
                      _optional(r["Release Total Reserved(MB)"]), r["Device Type"])
            for r in _read(path, MEMORY_COLUMNS)]


def read_meta(path: Path) -> ProfileMeta:
    """A ``profile_meta.json``."""
    return ProfileMeta(**json.loads(path.read_text()))
