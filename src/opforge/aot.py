"""Ahead-of-time compile check: build every Triton kernel variant that the operators launch
for a GPU target, on a machine that does not have that GPU.

The interpreter runs kernels as numpy and so cannot see what only the compiler sees:
globals that are not constexprs, type mismatches between loop-carried values, layouts a
target rejects, register pressure. Triton compiles to PTX and cubin with the ptxas it
bundles, without a device, so this check runs on a development machine.

How it finds the variants: it runs each operator's verification samples through `plan` and
`Plan.run` on the ``triton`` backend with ``JITFunction.run`` replaced by a recorder, so
each launch's arguments (pointer dtypes, integer widths, constexpr values, the ``FN`` a
kernel is specialised with) are captured instead of executed. Each distinct signature is
then compiled for the target; ``cuobjdump --dump-resource-usage`` reports registers, stack
(spills) and shared memory per kernel.

Kernels must be real ``JITFunction``s: run without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch

from opforge.core import autotune, backends
from opforge.core.hardware import HardwareProfile, get_profile, use_hardware
from opforge.core.opdef import OpDef
from opforge.core.plan import clear_caches, plan
from opforge.ops._descriptors import judged_as_cuda

_POINTER_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
                  torch.float64: "fp64", torch.uint8: "u8", torch.int8: "i8",
                  torch.int32: "i32", torch.int64: "i64", torch.bool: "i1"}


# Launch keywords that are compile options rather than kernel arguments.
LAUNCH_OPTIONS = ("num_warps", "num_stages")


@dataclass
class KernelVariant:
    """One compiled specialisation of a kernel: its argument types, constexpr values,
    attributes (16-divisible pointers and integers) and GPU launch options
    (``num_warps``)."""

    kernel: Any
    signature: dict[str, str]
    constexprs: dict[str, Any]
    ops: set[str] = field(default_factory=set)
    options: dict[str, int] = field(default_factory=dict)
    attrs: dict[tuple[int, ...], list[list[Any]]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__

    def describe(self) -> str:
        """Pointer dtypes and constexprs, e.g. ``*bf16,*bf16 NDIM=2 FN=_gelu_erf``."""
        pointers = ",".join(t for t in self.signature.values() if t.startswith("*"))
        consts = " ".join(f"{k}={_constexpr_text(v)}" for k, v in self.constexprs.items())
        options = " ".join(f"{k}={v}" for k, v in self.options.items())
        return f"{pointers} {consts} {options}".strip()


def _constexpr_text(value: Any) -> str:
    function = getattr(value, "fn", value)  # a JITFunction wraps the Python function
    return getattr(function, "__name__", str(value))


@dataclass
class CompileResult:
    """Outcome of compiling one `KernelVariant`."""

    variant: KernelVariant
    ok: bool
    seconds: float
    registers: int | None = None
    stack_bytes: int | None = None
    shared_bytes: int | None = None  # what a launch asks for (Triton allocates it dynamically)
    error: str = ""


def _specialization(value: Any, param: Any) -> tuple[str, list[list[Any]]]:
    """(type, attributes) of one argument as Triton's JIT specialises it at a launch:
    integers equal to 1 (and ``None``) become the constexpr ``"constexpr"``, pointers
    16-byte aligned and integers divisible by 16 get ``tt.divisibility`` 16. Without those
    the compiler cannot vectorise loads or pipeline them into shared memory, and the
    registers, spills and shared memory it reports are not those of the launched kernel.
    Falls back to the bare types where this Triton lacks the native specialiser."""
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend
    except ImportError:
        return _arg_type(value), []
    kind, key = native_specialize_impl(BaseBackend, value, False,
                                       not getattr(param, "do_not_specialize", False),
                                       not getattr(param, "do_not_specialize_on_alignment",
                                                   False))
    return kind, BaseBackend.parse_attr(key) if isinstance(key, str) else []


def _arg_type(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _POINTER_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"cannot type kernel argument {value!r}")


@dataclass
class LaunchRecorder:
    """The distinct kernel variants launched in a `recorded_launches` block, in
    first-launch order; ``label`` names the operator the next launches belong to."""

    variants: dict[tuple[Any, ...], KernelVariant] = field(default_factory=dict)
    label: str = ""


@contextlib.contextmanager
def recorded_launches(hardware: HardwareProfile) -> Iterator[LaunchRecorder]:
    """Within the block, operators run on the triton backend, tiled for ``hardware``, and
    their kernel launches are recorded instead of executed.

    Raises:
        RuntimeError: the kernels are interpreted (``TRITON_INTERPRET`` is set).
    """
    from triton.runtime.jit import JITFunction

    if backends.interpreter_enabled():
        raise RuntimeError("the AOT check needs compiled kernels: unset TRITON_INTERPRET")
    recorder = LaunchRecorder()

    def record(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        options = {k: kwargs.pop(k) for k in LAUNCH_OPTIONS if k in kwargs}
        bound = dict(zip((p.name for p in self.params), args))
        bound.update(kwargs)
        signature, constexprs, attrs = {}, {}, {}
        for index, param in enumerate(self.params):
            value = bound[param.name]
            kind, attributes = (("constexpr", []) if param.is_constexpr
                                else _specialization(value, param))
            signature[param.name] = kind
            if kind == "constexpr":
                constexprs[param.name] = value
            elif attributes:
                attrs[(index,)] = attributes
        key = (self, tuple(signature.items()),
               tuple((k, id(v) if callable(v) else v) for k, v in constexprs.items()),
               tuple(options.items()), tuple(attrs))
        variant = recorder.variants.setdefault(key, KernelVariant(
            self, signature, constexprs, options=options, attrs=attrs))
        variant.ops.add(recorder.label)

    # The launch path checks that CPU tensors may run Triton kernels; recording needs that
    # check to pass even though nothing is interpreted.
    try:
        with mock.patch.object(JITFunction, "run", record), \
                mock.patch.object(backends, "_triton_refusal", lambda device: None), \
                backends.use_backend("triton"), use_hardware(hardware):
            yield recorder
    finally:
        clear_caches()  # the plans chose triton for CPU tensors only for this recording


@contextlib.contextmanager
def _every_candidate() -> Iterator[None]:
    """Plans made in the block launch each tiling candidate autotuning would time, once,
    untimed (the first is kept); no choice is stored."""
    with mock.patch.dict(os.environ, {"OPFORGE_AUTOTUNE_CACHE": ""}), \
            mock.patch.object(autotune, "_seconds", lambda run, device: 0.0), \
            autotune.autotuning():
        try:
            yield
        finally:
            autotune.clear_tuning()


def record_variants(ops: Iterable[OpDef], dtypes: Sequence[torch.dtype],
                    hardware: HardwareProfile, candidates: bool = False,
                    capability: int | None = None) -> list[KernelVariant]:
    """Run the operators' samples on the triton backend, tiled for ``hardware``, with
    kernel launches recorded instead of executed; return the distinct variants, in
    first-launch order (and the int64-offset twin of each). With ``candidates``, every
    tiling candidate autotuning could time is launched (recorded), not only the first
    that fits. With a compute ``capability`` (``90``), launches are those a GPU of that
    target makes (tensor-descriptor variants from 90 on).

    Raises:
        RuntimeError: the kernels are interpreted (``TRITON_INTERPRET`` is set).
    """
    with recorded_launches(hardware) as recorder, \
            _every_candidate() if candidates else contextlib.nullcontext(), \
            judged_as_cuda(capability) if capability else contextlib.nullcontext():
        for op in ops:
            recorder.label = op.name
            for dtype in dtypes:
                if dtype not in op.inputs[0].dtypes:
                    continue
                generator = torch.Generator().manual_seed(0)
                for case in op.samples(dtype, torch.device("cpu"), generator):
                    plan(op, *case.inputs, **case.attrs).run(*case.inputs)
    recorded = list(recorder.variants.values())
    # Launchers never pair WIDE with DESCRIPTORS (descriptor coordinates are int32: such
    # tensors take the pointer kernel), so a descriptor variant has no int64 twin.
    return recorded + [_wide_twin(v) for v in recorded if v.constexprs.get("WIDE") is False
                       and not v.constexprs.get("DESCRIPTORS")]


def _wide_twin(variant: KernelVariant) -> KernelVariant:
    """The variant a tensor past 2^31 elements gets: kernels name their int64-offset
    switch ``WIDE``, and such calls pass 64-bit sizes. The samples never reach it (it
    would take gigabytes), so it is compiled from the recorded variant."""
    signature = {k: "i64" if t == "i32" else t for k, t in variant.signature.items()}
    return KernelVariant(variant.kernel, signature, {**variant.constexprs, "WIDE": True},
                         set(variant.ops), dict(variant.options), dict(variant.attrs))


def _resource_usage(cubin: bytes) -> dict[str, int]:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    if not os.path.exists(tool):
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        done = subprocess.run([tool, "--dump-resource-usage", handle.name],
                              capture_output=True, text=True, check=False)
    return {key: int(value) for key, value in re.findall(r"(REG|STACK|SHARED):(\d+)",
                                                         done.stdout)}


def parse_target(text: str) -> tuple[Any, HardwareProfile]:
    """``cuda:90`` -> (``GPUTarget("cuda", 90, 32)``, the H100 profile whose tilings a
    compute capability 9.x device gets; A100's for 8.x).

    Raises:
        ValueError: not ``cuda:<compute capability>``.
    """
    from triton.backends.compiler import GPUTarget

    match = re.fullmatch(r"cuda:(\d+)", text)
    if match is None:
        raise ValueError(f"unknown target {text!r}; expected cuda:<cc>, e.g. cuda:90")
    capability = int(match.group(1))
    return (GPUTarget("cuda", capability, 32),
            get_profile("h100" if capability >= 90 else "a100"))


def compile_variants(variants: Iterable[KernelVariant], target: Any) -> list[CompileResult]:
    """Compile each variant for ``target``; a failure is recorded, not raised."""
    import triton
    from triton.compiler import ASTSource

    results = []
    for variant in variants:
        start = time.perf_counter()
        try:
            source = ASTSource(fn=variant.kernel, signature=variant.signature,
                               constexprs=variant.constexprs, attrs=variant.attrs)
            compiled = triton.compile(source, target=target, options=variant.options)
        except Exception as error:
            message = str(error).strip().splitlines()
            results.append(CompileResult(variant, False, time.perf_counter() - start,
                                         error=message[-1] if message else repr(error)))
            continue
        usage = _resource_usage(compiled.asm["cubin"]) if "cubin" in compiled.asm else {}
        results.append(CompileResult(variant, True, time.perf_counter() - start,
                                     usage.get("REG"), usage.get("STACK"),
                                     compiled.metadata.shared))
    return results
