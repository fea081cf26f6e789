"""Hardware profiles: what tiling and the roofline need to know about a device.

A profile holds the memory bandwidth, the peak FLOP/s per dtype, the on-chip memory of one
core (UB on Ascend, shared memory per SM on GPUs, L2 per core on CPUs) and the core count.
Datasheet profiles ship for H100, H200, A100 and Ascend 910B; CPUs and unknown GPUs get a
profile built from what the runtime reports. ``opforge calibrate`` measures the real copy
bandwidth and matmul rate of the current device and caches them; `profile_for` merges the
cached figures over the datasheet ones.

Select a profile explicitly with ``OPFORGE_HARDWARE=<name>`` or `use_hardware`, e.g. to plan
Ascend tilings on a development machine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from opforge.core import settings
from opforge.core.errors import AttrError, DeviceError

KiB = 1024
TB = 1e12


@dataclass(frozen=True)
class HardwareProfile:
    """Ceilings and on-chip sizes of one device.

    Attributes:
        name: profile name (``"h100"``, ``"ascend910b"``, ``"cpu"``).
        device_type: torch device type it describes (``"cuda"``, ``"npu"``, ``"cpu"``).
        memory_bandwidth: bytes per second of main memory (HBM, DRAM).
        peak_flops: FLOP/s per compute dtype (dense).
        onchip_bytes: on-chip memory one program (core) may use: UB, shared memory, L2 slice.
        core_count: programs that run at once: SMs, AI vector cores, CPU cores.
        memories: other on-chip memories by name (L1, L0A, ...), for reports.
        max_tile_elements: elements one program works on at a time. On GPUs a tile lives
            in registers (default 4 warps: 2048 elements is 16 a thread), so larger tiles
            cost occupancy; on Ascend and CPUs the on-chip budget alone decides.
        source: where the figures come from: ``datasheet``, ``runtime``, ``estimate`` or
            ``calibrated`` (measured by ``opforge calibrate``).
        reduced_fp32_dot: the ``tl.dot`` input precision that rounds float32 operands for
            the matrix unit: ``"tf32"`` on NVIDIA GPUs (10 mantissa bits), ``"hf32"`` on
            Ascend (11 bits, float32's range; triton-ascend rejects ``"tf32"``).
    """

    name: str
    device_type: str
    memory_bandwidth: float
    peak_flops: Mapping[torch.dtype, float]
    onchip_bytes: int
    core_count: int
    memories: Mapping[str, int] = field(default_factory=dict)
    max_tile_elements: int = 1 << 16
    source: str = "datasheet"
    reduced_fp32_dot: str = "tf32"

    def onchip_limit(self, double_buffered: bool) -> int:
        """Bytes one program may keep live: half the on-chip memory when double-buffered
        (Ascend's UB rule: the second half holds the next tile's copy-in)."""
        return self.onchip_bytes // 2 if double_buffered else self.onchip_bytes

    def peak(self, dtype: torch.dtype) -> float:
        """Peak FLOP/s for a compute dtype (float32's when the dtype has no entry)."""
        return self.peak_flops.get(dtype, self.peak_flops[torch.float32])

    def ridge_point(self, dtype: torch.dtype) -> float:
        """Arithmetic intensity (FLOP/byte) above which a kernel is compute-bound."""
        return self.peak(dtype) / self.memory_bandwidth


GPU_TILE_ELEMENTS = 2048


def _gpu_flops(fp32: float, tensor16: float) -> dict[torch.dtype, float]:
    return {torch.float32: fp32, torch.float16: tensor16, torch.bfloat16: tensor16,
            torch.float64: fp32 / 2}


# Dense figures from the vendors' datasheets (SXM parts). The Ascend 910B's bandwidth and
# FLOP/s are not published officially: the figures are estimates (16^3 x 2 x 1.8 GHz x 24
# cube cores for fp16); run `opforge calibrate` on the device for real ceilings.
PROFILES: dict[str, HardwareProfile] = {
    "h100": HardwareProfile("h100", "cuda", 3.35 * TB, _gpu_flops(67e12, 989e12),
                            onchip_bytes=228 * KiB, core_count=132,
                            memories={"L2": 50 * 1024 * KiB},
                            max_tile_elements=GPU_TILE_ELEMENTS),
    "h200": HardwareProfile("h200", "cuda", 4.8 * TB, _gpu_flops(67e12, 989e12),
                            onchip_bytes=228 * KiB, core_count=132,
                            memories={"L2": 50 * 1024 * KiB},
                            max_tile_elements=GPU_TILE_ELEMENTS),
    "a100": HardwareProfile("a100", "cuda", 2.039 * TB, _gpu_flops(19.5e12, 312e12),
                            onchip_bytes=164 * KiB, core_count=108,
                            memories={"L2": 40 * 1024 * KiB},
                            max_tile_elements=GPU_TILE_ELEMENTS),
    "ascend910b": HardwareProfile(
        "ascend910b", "npu", 1.6 * TB,
        {torch.float16: 354e12, torch.bfloat16: 354e12, torch.float32: 88e12},
        onchip_bytes=192 * KiB, core_count=48,
        memories={"UB": 192 * KiB, "L1": 512 * KiB, "L0A": 64 * KiB, "L0B": 64 * KiB,
                  "L0C": 128 * KiB},
        source="estimate", reduced_fp32_dot="hf32"),
}

_override = threading.local()
_lock = threading.Lock()
_runtime_profiles: dict[torch.device, HardwareProfile] = {}


def _cpu_l2_bytes() -> int:
    # sysfs reports the per-core L2; fall back to a common 1 MiB when it cannot be read.
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for index in sorted(base.glob("index*")) if base.exists() else []:
        try:
            if (index / "level").read_text().strip() == "2":
                size = (index / "size").read_text().strip().upper()
                scale = {"K": KiB, "M": KiB * KiB}.get(size[-1], 1)
                return int(size.rstrip("KM")) * scale
        except (OSError, ValueError):
            continue
    return 1024 * KiB


def _cpu_profile() -> HardwareProfile:
    cores = os.cpu_count() or 1
    # Nominal figures until `opforge calibrate` measures them: ~10 GB/s per core of DRAM
    # bandwidth and 32 fp32 FLOP/cycle/core (AVX2 FMA) at ~2.5 GHz.
    fp32 = cores * 32 * 2.5e9
    return HardwareProfile("cpu", "cpu", 10e9 * cores,
                           {torch.float32: fp32, torch.float64: fp32 / 2,
                            torch.bfloat16: fp32, torch.float16: fp32},
                           onchip_bytes=_cpu_l2_bytes(), core_count=cores, source="estimate")


def _cuda_profile(device: torch.device) -> HardwareProfile:
    props = torch.cuda.get_device_properties(device)
    name = props.name.lower()
    for key in ("h200", "h100", "a100"):
        if key in name:
            return PROFILES[key]
    smem = getattr(props, "shared_memory_per_block_optin", 48 * KiB)
    # Unknown GPU: take the runtime's core count and shared memory, a nominal bandwidth and
    # FLOP/s until calibrated.
    return HardwareProfile(props.name, "cuda", 1.0 * TB, _gpu_flops(20e12, 100e12),
                           onchip_bytes=int(smem), core_count=props.multi_processor_count,
                           max_tile_elements=GPU_TILE_ELEMENTS,
                           source="runtime")


def _builtin_profile(device: torch.device) -> HardwareProfile:
    if device.type == "cuda":
        return _cuda_profile(device)
    if device.type == "npu":
        return PROFILES["ascend910b"]
    return _cpu_profile()


def profile_for(device: torch.device | str | None = None) -> HardwareProfile:
    """The profile that tiling uses for ``device`` (CPU when ``None``).

    Order: `use_hardware` override, ``OPFORGE_HARDWARE`` (read once), the device's built-in
    profile with calibrated figures merged over it. Profiles are computed once per device
    and cached.
    """
    forced = getattr(_override, "profile", None)
    if forced is not None:
        return forced
    env = settings.environment("OPFORGE_HARDWARE")
    if env:
        return get_profile(env)
    if not isinstance(device, torch.device):
        device = torch.device(device if device is not None else "cpu")
    cached = _runtime_profiles.get(device)
    if cached is None:
        with _lock:
            cached = _runtime_profiles.get(device)
            if cached is None:
                cached = _with_calibration(_builtin_profile(device))
                _runtime_profiles[device] = cached
    return cached


def get_profile(name: str) -> HardwareProfile:
    """A shipped profile by name (``h100``, ``h200``, ``a100``, ``ascend910b``, ``cpu``).

    Raises:
        AttrError: no profile of that name; the message lists the known ones.
    """
    if name == "cpu":
        return _with_calibration(_cpu_profile())
    try:
        return PROFILES[name]
    except KeyError:
        raise AttrError("unknown hardware profile", param="hardware",
                        expected=", ".join([*PROFILES, "cpu"]), got=repr(name)) from None


@contextlib.contextmanager
def use_hardware(profile: HardwareProfile | str) -> Iterator[HardwareProfile]:
    """Plan with ``profile`` inside the block (this thread only)."""
    chosen = get_profile(profile) if isinstance(profile, str) else profile
    previous = getattr(_override, "profile", None), getattr(_override, "key", None)
    _override.profile, _override.key = chosen, repr(chosen)
    settings.changed()
    try:
        yield chosen
    finally:
        _override.profile, _override.key = previous
        settings.changed()


def hardware_setting() -> str | None:
    """What, besides the device, decides `profile_for`: the `use_hardware` profile (its
    repr: profiles of one name may differ), else ``OPFORGE_HARDWARE``; ``None`` when the
    device's own profile applies."""
    forced = getattr(_override, "key", None)
    return forced if forced is not None else settings.environment("OPFORGE_HARDWARE") or None


# ---------------------------------------------------------------------------------------------
# Calibration


def calibration_path() -> Path:
    """Where measured ceilings are cached (``$OPFORGE_CACHE_DIR`` or ``~/.cache/opforge``)."""
    root = os.environ.get("OPFORGE_CACHE_DIR") or Path.home() / ".cache" / "opforge"
    return Path(root) / "calibration.json"


def _calibration_key(profile: HardwareProfile) -> str:
    return f"{profile.device_type}:{profile.name}"


def _read_calibration() -> dict[str, dict[str, object]]:
    """The cached entries; none when the file is missing or unreadable (`calibrate`
    rewrites it)."""
    try:
        entries = json.loads(calibration_path().read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def _with_calibration(profile: HardwareProfile) -> HardwareProfile:
    """``profile`` with the cached measurements of its device. A dtype that was not
    measured (float64 and 16-bit types on the CPU, float64 on GPUs) keeps its ratio to
    float32 in ``profile``: its peak is scaled by measured / nominal float32."""
    entry = _read_calibration().get(_calibration_key(profile))
    if not isinstance(entry, dict):
        return profile
    try:
        measured = {getattr(torch, name): float(value)
                    for name, value in entry["peak_flops"].items()}
        bandwidth = float(entry["memory_bandwidth"])
        scale = measured[torch.float32] / profile.peak_flops[torch.float32]
    except (KeyError, AttributeError, TypeError, ValueError):
        return profile
    flops = {dtype: measured.get(dtype, peak * scale)
             for dtype, peak in profile.peak_flops.items()}
    return dataclasses.replace(profile, memory_bandwidth=bandwidth,
                               peak_flops={**flops, **measured}, source="calibrated")


def median_seconds(fn: object, device: torch.device, repeats: int) -> float:
    """The median wall time of ``repeats`` calls of ``fn()``, synchronising a GPU around
    each call."""
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def calibrate(device: torch.device | str = "cpu", *, copy_bytes: int = 256 * 2**20,
              matmul_size: int = 2048, repeats: int = 7) -> dict[str, object]:
    """Measure the copy bandwidth and matmul FLOP/s of ``device`` and cache them.

    Copy: ``dst.copy_(src)`` of ``copy_bytes`` (reads and writes: 2x bytes moved).
    Matmul: ``n x n @ n x n`` in float32, and in bf16/fp16 on GPUs.

    Returns the cached entry: ``{"memory_bandwidth": B/s, "peak_flops": {dtype: FLOP/s}}``.
    A calibration file that cannot be read is rewritten.

    Raises:
        DeviceError: ``device`` is not available on this machine.
    """
    try:
        device = torch.device(device)
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as error:  # torch's words for a missing device
        raise DeviceError("device not usable here", param="device",
                          expected="cpu or an available accelerator",
                          got=f"{device} ({str(error).splitlines()[0]})") from None
    src = torch.empty(copy_bytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = median_seconds(lambda: dst.copy_(src), device, repeats)
    bandwidth = 2 * copy_bytes / seconds
    dtypes = [torch.float32] + ([torch.bfloat16, torch.float16] if device.type == "cuda" else [])
    flops: dict[str, float] = {}
    for dtype in dtypes:
        a = torch.randn(matmul_size, matmul_size, dtype=dtype, device=device)
        b = torch.randn_like(a)
        torch.mm(a, b)
        seconds = median_seconds(lambda a=a, b=b: torch.mm(a, b), device, repeats)
        flops[str(dtype).removeprefix("torch.")] = 2 * matmul_size**3 / seconds
    entry: dict[str, object] = {"memory_bandwidth": bandwidth, "peak_flops": flops,
                                "measured": time.strftime("%Y-%m-%dT%H:%M:%S")}
    path = calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    entries = _read_calibration()
    entries[_calibration_key(_builtin_profile(device))] = entry
    path.write_text(json.dumps(entries, indent=2))
    with _lock:
        _runtime_profiles.clear()
    return entry
