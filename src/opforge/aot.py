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

For an Ascend NPU (``--target ascend910b``, with triton-ascend installed in place of
Triton) the samples run through triton-ascend's own launcher, with a stand-in driver and
its compile step captured: each launch is checked as the NPU would check it (a function
passed as a constexpr is refused there), and the kernel it would compile is lowered
through TTIR to triton-ascend's linalg IR, then to a binary where CANN is installed
(``ASCEND_HOME_PATH``); without CANN the binary stage is reported as not run.

Kernels must be real ``JITFunction``s: run without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import json
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

    @property
    def spills(self) -> bool:
        """Whether the compiled kernel keeps values on its stack (registers ran out: each
        spilled value is a local-memory load and store)."""
        return bool(self.stack_bytes)


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
    except ImportError:  # Triton 3.2: the same rules, in Python
        return _portable_specialization(value, param)
    kind, key = native_specialize_impl(BaseBackend, value, False,
                                       not getattr(param, "do_not_specialize", False),
                                       not getattr(param, "do_not_specialize_on_alignment",
                                                   False))
    return kind, BaseBackend.parse_attr(key) if isinstance(key, str) else []


def _portable_specialization(value: Any, param: Any) -> tuple[str, list[list[Any]]]:
    """`_specialization` for a Triton without the native specialiser (3.2): integers
    equal to 1 and ``None`` become constexprs, 16-byte-aligned pointers and integers
    divisible by 16 get ``tt.divisibility`` 16, unless the parameter opts out."""
    specialize = not getattr(param, "do_not_specialize", False)
    on_alignment = not getattr(param, "do_not_specialize_on_alignment", False)
    divisible = [["tt.divisibility", 16]]
    if value is None or (specialize and type(value) is int and value == 1):
        return "constexpr", []
    if isinstance(value, torch.Tensor):
        aligned = specialize and on_alignment and value.data_ptr() % 16 == 0
        return _arg_type(value), divisible if aligned else []
    kind = _arg_type(value)
    if type(value) is int and specialize and value % 16 == 0:
        return kind, divisible
    return kind, []


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
                    capability: int | None = None,
                    shapes: Sequence[tuple[int, ...]] | None = None) -> list[KernelVariant]:
    """Run the operators' samples on the triton backend, tiled for ``hardware``, with
    kernel launches recorded instead of executed; return the distinct variants, in
    first-launch order (and the int64-offset twin of each). With ``candidates``, every
    tiling candidate autotuning could time is launched (recorded), not only the first
    that fits. With a compute ``capability`` (``90``), launches are those a GPU of that
    target makes (tensor-descriptor variants from 90 on). With ``shapes``, the calls are
    ``opforge bench``'s at those sizes and the gradient operators' calls their backward
    makes (`opforge.profiler.traffic.bench_cases`), instead of the samples: the variants
    a model of those widths launches.

    Raises:
        RuntimeError: the kernels are interpreted (``TRITON_INTERPRET`` is set).
    """
    calls = _samples(ops, dtypes) if shapes is None else _sized_calls(ops, dtypes, shapes)
    with recorded_launches(hardware) as recorder, \
            _every_candidate() if candidates else contextlib.nullcontext(), \
            judged_as_cuda(capability) if capability else contextlib.nullcontext():
        for op, case in calls:
            recorder.label = op.name
            plan(op, *case.inputs, **case.attrs).run(*case.inputs)
    recorded = list(recorder.variants.values())
    # Launchers never pair WIDE with DESCRIPTORS (descriptor coordinates are int32: such
    # tensors take the pointer kernel), so a descriptor variant has no int64 twin.
    return recorded + [_wide_twin(v) for v in recorded if v.constexprs.get("WIDE") is False
                       and not v.constexprs.get("DESCRIPTORS")]


def _samples(ops: Iterable[OpDef], dtypes: Sequence[torch.dtype]) -> Iterator[tuple[OpDef, Any]]:
    """Each operator's verification samples in each of ``dtypes`` it takes."""
    for op in ops:
        for dtype in dtypes:
            if dtype in op.inputs[0].dtypes:
                generator = torch.Generator().manual_seed(0)
                for case in op.samples(dtype, torch.device("cpu"), generator):
                    yield op, case


def _sized_calls(ops: Iterable[OpDef], dtypes: Sequence[torch.dtype],
                 shapes: Sequence[tuple[int, ...]]) -> list[tuple[OpDef, Any]]:
    """Each operator's bench calls at those of ``shapes`` it takes, then the calls of the
    gradient operators its backward makes there, in each of ``dtypes`` it takes. Built
    before any launch is recorded: the gradient calls run on the torch backend."""
    from opforge.profiler.traffic import bench_cases, gradient_calls

    calls = []
    for op in ops:
        for dtype in dtypes:
            if dtype in op.inputs[0].dtypes:
                for case in bench_cases(op, dtype, shapes):
                    calls += [(op, case), *gradient_calls(op, case)]
    return calls


def _wide_twin(variant: KernelVariant) -> KernelVariant:
    """The variant a tensor past 2^31 elements gets: kernels name their int64-offset
    switch ``WIDE``, and such calls pass 64-bit sizes. The samples never reach it (it
    would take gigabytes), so it is compiled from the recorded variant."""
    signature = {k: "i64" if t == "i32" else t for k, t in variant.signature.items()}
    return KernelVariant(variant.kernel, signature, {**variant.constexprs, "WIDE": True},
                         set(variant.ops), dict(variant.options), dict(variant.attrs))


def _cuobjdump(cubin: bytes, flag: str) -> str | None:
    """What Triton's own ``cuobjdump`` prints of ``cubin`` with ``flag``; ``None`` where
    this Triton ships none."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    if not os.path.exists(tool):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        return subprocess.run([tool, flag, handle.name], capture_output=True, text=True,
                              check=False).stdout


def _resource_usage(cubin: bytes) -> dict[str, int]:
    return {key: int(value) for key, value in re.findall(
        r"(REG|STACK|SHARED):(\d+)", _cuobjdump(cubin, "--dump-resource-usage") or "")}


def sass_instructions(variant: KernelVariant, target: Any) -> int:
    """The machine instructions of ``variant`` compiled for the CUDA ``target`` (its SASS,
    prologue and loop body: a kernel's issue work per loop step, over its values a thread,
    bounds what it spends a value).

    Raises:
        RuntimeError: this Triton ships no ``cuobjdump`` to disassemble with.
    """
    import triton
    from triton.compiler import ASTSource

    compiled = triton.compile(_ast_source(ASTSource, variant), target=target,
                              options=variant.options)
    sass = _cuobjdump(compiled.asm["cubin"], "-sass")
    if sass is None:
        raise RuntimeError("this Triton ships no cuobjdump to disassemble the kernel with")
    return len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", sass, re.MULTILINE))


# Ascend profiles and the triton-ascend architecture each is lowered for.
ASCEND_ARCHES = {"ascend910b": "Ascend910B3"}


def parse_target(text: str) -> tuple[Any, HardwareProfile]:
    """``cuda:90`` -> (``GPUTarget("cuda", 90, 32)``, the H100 profile whose tilings a
    compute capability 9.x device gets; A100's for 8.x); ``ascend910b`` -> (``GPUTarget(
    "npu", "Ascend910B3", 0)``, its profile).

    Raises:
        ValueError: neither ``cuda:<compute capability>`` nor an Ascend profile's name.
    """
    from triton.backends.compiler import GPUTarget

    if text in ASCEND_ARCHES:
        return GPUTarget("npu", ASCEND_ARCHES[text], 0), get_profile(text)
    match = re.fullmatch(r"cuda:(\d+)", text)
    if match is None:
        raise ValueError(f"unknown target {text!r}; expected cuda:<cc>, e.g. cuda:90, or "
                         f"{', '.join(ASCEND_ARCHES)}")
    capability = int(match.group(1))
    return (GPUTarget("cuda", capability, 32),
            get_profile("h100" if capability >= 90 else "a100"))


def _ast_source(ast_source: type, variant: KernelVariant) -> Any:
    """The variant as Triton's ``ASTSource``: Triton 3.2 names its constexprs
    ``constants=`` (later ones ``constexprs=``) and takes its attributes as a descriptor
    built from the specialisation (``{(index,): [["tt.divisibility", 16]]}``)."""
    parameters = inspect.signature(ast_source).parameters
    if "constexprs" in parameters:
        return ast_source(fn=variant.kernel, signature=variant.signature,
                          constexprs=variant.constexprs, attrs=variant.attrs)
    from triton.backends.compiler import AttrsDescriptor

    # 3.2 keeps an integer specialised to 1 in the signature and hints it as 1.
    hints = {index: 16 for (index,), attributes in variant.attrs.items()
             if ["tt.divisibility", 16] in attributes}
    signature = {}
    for index, param in enumerate(variant.kernel.params):
        kind = variant.signature[param.name]
        if kind == "constexpr" and not param.is_constexpr:
            value = variant.constexprs[param.name]
            kind = "i32" if value is not None else "*i8"
            hints[index] = 1
        if kind != "constexpr":
            signature[param.name] = kind
    return ast_source(fn=variant.kernel, signature=signature, constants=variant.constexprs,
                      attrs=AttrsDescriptor.from_hints(hints))


def compile_variants(variants: Iterable[KernelVariant], target: Any) -> list[CompileResult]:
    """Compile each variant for ``target``; a failure is recorded, not raised."""
    import triton
    from triton.compiler import ASTSource

    results = []
    for variant in variants:
        start = time.perf_counter()
        try:
            source = _ast_source(ASTSource, variant)
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


# ---------------------------------------------------------------------------------------------
# Ascend NPUs (triton-ascend)

# Lowering stages of triton-ascend, named by the error it raises when one fails.
_ASCEND_STAGES = {"MLIRCompile": "ttir", "ConvertTritonIRToLinalgIR": "linalg",
                  "ConvertLinalgRToBinary": "binary"}
# What each stage reached means in the report.
ASCEND_REACHED = ("launch", "ttir", "linalg", "binary")


@dataclass
class Lowering:
    """Outcome of one kernel launch lowered for an Ascend NPU.

    Attributes:
        kernel: the kernel's name.
        description: pointer dtypes and constexprs (``*bf16 NDIM=2 WIDE=False ...``).
        ops: the operators whose samples launched it.
        reached: the last stage passed: ``"launch"`` (triton-ascend's launcher took the
            arguments), ``"ttir"``, ``"linalg"`` (triton-ascend's IR), ``"binary"``; ``""``
            when even the launch was refused.
        ok: every stage this machine can run passed (without CANN: up to ``linalg``).
        error: the failing stage's last message line; ``binary stage needs CANN`` when
            only CANN was missing.
    """

    kernel: str
    description: str
    ops: set[str]
    reached: str
    ok: bool
    error: str = ""
    seconds: float = 0.0


class _CapturedCompileError(Exception):
    """Raised by the stand-in compile step: the launch got as far as compiling."""


@dataclass
class _NpuLaunch:
    source: Any
    options: dict[str, Any]
    ops: set[str] = field(default_factory=set)


class _StandInDriver:
    """What triton-ascend's launcher asks of the NPU driver before it compiles."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> Any:
        return self.target


def _describe_source(source: Any) -> str:
    pointers = ",".join(t for t in source.signature.values() if str(t).startswith("*"))
    consts = " ".join(f"{k}={_constexpr_text(v)}" for k, v in source.constants.items())
    return f"{pointers} {consts}".strip()


def record_npu_launches(ops: Iterable[OpDef], dtypes: Sequence[torch.dtype],
                        hardware: HardwareProfile, target: Any,
                        shapes: Sequence[tuple[int, ...]] | None = None
                        ) -> tuple[list[_NpuLaunch], list[Lowering]]:
    """Run the operators' samples (or their calls at ``shapes``, as `record_variants`) on
    the triton backend, tiled for ``hardware``, through triton-ascend's launcher with a
    stand-in driver; capture what each launch would compile instead of compiling it.
    Returns the distinct launches (in first-launch order) and the calls whose launch was
    refused (``reached=""``).

    Raises:
        RuntimeError: triton-ascend is not the installed Triton, or the kernels are
            interpreted.
    """
    import triton
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    if "ascend" not in triton.backends.backends:
        raise RuntimeError("lowering for an Ascend NPU needs triton-ascend in place of "
                           "Triton (`make ascend-check` builds that environment)")
    if backends.interpreter_enabled():
        raise RuntimeError("the AOT check needs compiled kernels: unset TRITON_INTERPRET")
    launches: dict[tuple[str, str], _NpuLaunch] = {}
    refused: dict[tuple[str, str], Lowering] = {}
    label = [""]

    def capture(source: Any, target: Any = None, options: Any = None) -> None:
        options = dict(options or {})
        key = (source.hash(), json.dumps(options, sort_keys=True, default=str))
        launches.setdefault(key, _NpuLaunch(source, options)).ops.add(label[0])
        raise _CapturedCompileError

    original_run = JITFunction.run
    calls = _samples(ops, dtypes) if shapes is None else _sized_calls(ops, dtypes, shapes)

    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original_run(self, *args, **kwargs)
        except _CapturedCompileError:
            return None

    driver.set_active(_StandInDriver(target))
    try:
        with mock.patch.object(triton.compiler, "compile", capture), \
                mock.patch.object(JITFunction, "run", run), \
                mock.patch.object(backends, "_triton_refusal", lambda device: None), \
                backends.use_backend("triton"), use_hardware(hardware):
            for op, case in calls:
                label[0] = op.name
                try:
                    plan(op, *case.inputs, **case.attrs).run(*case.inputs)
                except Exception as error:  # the launcher refused the arguments
                    message = str(error).strip().splitlines()
                    refused.setdefault((op.name, message[-1] if message else repr(error)),
                                       Lowering(op.name, f"{op.name}/{case.name}", {op.name},
                                                "", False, message[-1] if message
                                                else repr(error)))
    finally:
        driver.reset_active()
        clear_caches()
    return list(launches.values()), list(refused.values())


def _npu_wide_twin(launch: _NpuLaunch) -> _NpuLaunch:
    """The int64-offset twin of a launch (see `_wide_twin`)."""
    source = launch.source
    twin = type(source)(source.fn, {k: "i64" if v == "i32" else v
                                    for k, v in source.signature.items()},
                        {**source.constants, "WIDE": True}, source.attrs)
    return _NpuLaunch(twin, launch.options, set(launch.ops))


def _first_error_line(message: str) -> str:
    """The line of a compiler's output that says what failed: the first ``error:`` (or a
    failed assertion), else the last line that is not a banner or a stack frame."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    for line in lines:
        if ": error:" in line or "Assertion" in line:
            return line
    plain = [line for line in lines if not line.startswith(("///", "[INFO]", "#"))
             and not re.match(r"\d+\.\s", line)]
    return plain[-1] if plain else ""


def lower_npu_launches(launches: Iterable[_NpuLaunch], target: Any,
                       wide_twins: bool = True) -> list[Lowering]:
    """Lower each captured launch (and its int64-offset twin) with triton-ascend's
    compiler; a failure is recorded with the stage it stopped at, not raised."""
    launches = list(launches)
    if wide_twins:
        launches += [_npu_wide_twin(launch) for launch in launches
                     if launch.source.constants.get("WIDE") is False]
    results = []
    for launch in launches:
        start = time.perf_counter()
        reached, ok, error = _lowered(launch, target)
        if not ok and error.startswith(_CRASHED):
            # triton-adapter-opt crashed now and then (about once in 1200 lowerings here)
            # on kernels that lower when compiled again: a second crash is a failure.
            reached, ok, error = _lowered(launch, target)
            if ok:
                error = f"{error}; passed when tried again after the compiler crashed".lstrip("; ")
        results.append(Lowering(launch.source.fn.__name__, _describe_source(launch.source),
                                launch.ops, reached, ok, error[:300],
                                time.perf_counter() - start))
    return results


_CRASHED = "compiler crashed: "


def _lowered(launch: _NpuLaunch, target: Any) -> tuple[str, bool, str]:
    """(stage reached, ok, error) of one lowering."""
    import triton

    try:
        # triton-ascend prints a line per compile when CANN's compiler is absent; what
        # failed comes back in its exception.
        with contextlib.redirect_stdout(io.StringIO()):
            triton.compile(launch.source, target=target, options=launch.options)
        return "binary", True, ""
    except Exception as failure:
        message = str(failure)
        stage = _ASCEND_STAGES.get(getattr(failure, "stage_name", ""), "ttir")
        reached = ASCEND_REACHED[ASCEND_REACHED.index(stage) - 1]
        if stage == "binary" and "ASCEND_HOME_PATH" in message:
            return reached, True, "binary stage needs CANN (ASCEND_HOME_PATH is not set)"
        error = _first_error_line(message) or repr(failure)
        if "Stack dump" in message or "PLEASE submit a bug report" in message:
            error = _CRASHED + error
        return reached, False, error
