"""`OpDef`: the one declaration of an operator that every other layer reads.

An operator module declares its prototype (named tensor inputs with their dtypes, outputs,
typed attributes with defaults and ranges), its pure functions over `TensorSpec`s
(``infer_shape``, ``infer_dtype``, ``check``, ``cost``, ``tiling``, ``grid``, ``workspace``),
its autocast policy, its verification samples and its precision standard. It then attaches,
with decorators, its ``reference`` (plain torch, parameterised by compute dtype), its backend
launchers and its autograd formula. `opforge.plan` validates, infers and tiles from the declaration;
`opforge.library` derives the ``torch.ops.opforge.*`` schema, fake and autograd from it.
"""

from __future__ import annotations

import enum
import fnmatch
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from opforge.core.errors import PARAM_NULLPTR, AttrError, DtypeError, OpError

if TYPE_CHECKING:
    from opforge.core.hardware import HardwareProfile
    from opforge.core.plan import Plan

FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16,
                                         torch.float64)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class TensorSpec:
    """Shape, dtype and device of a tensor, without its data.

    ``shape`` may hold ``-1`` (unknown dim), be ``(-2,)`` (unknown rank) or hold SymInts.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device | None = None

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSpec:
        return cls(tuple(tensor.shape), tensor.dtype, tensor.device)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    def __str__(self) -> str:
        return f"{tuple(self.shape)} {dtype_name(self.dtype)}"


@dataclass(frozen=True)
class TensorArg:
    """A tensor input: its name, the dtypes it accepts, whether it may be ``None`` and
    whether the operator writes into it in place (``mutated``: a cache the call updates;
    its new value is part of the result, after the outputs, in the reference's return).
    ``write_only`` (with ``mutated``): the operator never reads what it holds, only
    overwrites some of its elements from the other inputs (rows scattered into a cache),
    so running the call again on the same inputs leaves the same contents; autotuning
    may then time the operator on the call's own tensors."""

    name: str
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
    optional: bool = False
    doc: str = ""
    mutated: bool = False
    write_only: bool = False


@dataclass(frozen=True)
class OutputArg:
    """A tensor output; ``differentiable=False`` for a statistic saved for the backward
    (a norm's rstd): autograd marks it non-differentiable, so it never requires grad and a
    loss on it fails loudly instead of getting a silently dropped gradient."""

    name: str
    doc: str = ""
    differentiable: bool = True


_ATTR_TYPES = {"int": "int", "float": "float", "bool": "bool", "str": "str", "ints": "int[]"}


@dataclass(frozen=True)
class Attr:
    """A scalar attribute.

    Attributes:
        name: keyword name.
        kind: ``"int"``, ``"float"``, ``"bool"``, ``"str"`` or ``"ints"`` (a tuple of ints).
        default: default value; ``None`` makes the attribute optional.
        range: inclusive ``(low, high)`` bounds for numbers; either side may be ``None``.
        choices: allowed values (strings, usually).
    """

    name: str
    kind: str
    default: Any = None
    range: tuple[float | None, float | None] | None = None
    choices: tuple[Any, ...] | None = None
    doc: str = ""

    def __post_init__(self) -> None:
        if self.kind not in _ATTR_TYPES:
            raise ValueError(f"attribute {self.name}: unknown kind {self.kind!r}")

    @property
    def schema_type(self) -> str:
        base = _ATTR_TYPES[self.kind]
        return base + "?" if self.default is None else base

    def describe(self) -> str:
        """``alpha: float = 1.0`` with its range or choices."""
        text = f"{self.name}: {self.kind} = {self.default!r}"
        if self.choices is not None:
            text += " in {" + ", ".join(map(str, self.choices)) + "}"
        elif self.range is not None:
            low, high = self.range
            text += f" in [{'-inf' if low is None else low}, {'inf' if high is None else high}]"
        return text

    def validate(self, value: Any, op: str) -> Any:
        """Return ``value`` normalised (ints widened to float, lists to tuples).

        Raises:
            AttrError: wrong type, out of range, or not one of the choices.
        """
        if value is None:
            if self.default is None:
                return None
            raise AttrError("may not be None", op=op, param=self.name,
                            expected=self.kind, got=None)
        value = self._coerce(value, op)
        if self.choices is not None and value not in self.choices:
            raise AttrError("is not one of the allowed values", op=op, param=self.name,
                            expected=f"one of {self.choices}", got=repr(value))
        if self.range is not None:
            low, high = self.range
            items = value if isinstance(value, tuple) else (value,)
            for item in items:
                if (low is not None and item < low) or (high is not None and item > high):
                    raise AttrError("is out of range", op=op, param=self.name,
                                    expected=f"a value in [{low}, {high}]", got=item)
        return value

    def _coerce(self, value: Any, op: str) -> Any:
        def fail() -> AttrError:
            return AttrError("has the wrong type", op=op, param=self.name,
                             expected=self.kind, got=_brief(value))

        if self.kind == "bool":
            if not isinstance(value, bool):
                raise fail()
            return value
        if self.kind == "int":
            if isinstance(value, bool) or not isinstance(value, int):
                raise fail()
            return value
        if self.kind == "float":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise fail()
            # An int past float's range is no finite float (math.isfinite would overflow).
            if (isinstance(value, int) and abs(value) > sys.float_info.max) \
                    or not math.isfinite(value):
                raise AttrError("must be finite", op=op, param=self.name,
                                expected="a finite number", got=value)
            return float(value)
        if self.kind == "str":
            if not isinstance(value, str):
                raise fail()
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return (value,)
        if not isinstance(value, (list, tuple)) or any(
                isinstance(v, bool) or not isinstance(v, int) for v in value):
            raise fail()
        return tuple(value)


def _brief(value: Any) -> str:
    """A wrong attribute as its error names it: a tensor by its shape and dtype, a sequence
    holding tensors by its length (a tensor's repr prints its data, and cannot be taken
    while torch.compile traces)."""
    if isinstance(value, torch.Tensor):
        return f"Tensor of shape {tuple(value.shape)}, {value.dtype}"
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return f"{type(value).__name__} of {len(value)} items, tensors among them"
    return f"{type(value).__name__} {value!r}"


@dataclass(frozen=True)
class Cost:
    """Work of one call, from the shapes: floating-point operations and bytes moved to and
    from main memory (inputs read once, outputs written once)."""

    flops: int
    bytes_moved: int

    @property
    def intensity(self) -> float:
        """FLOP per byte; compare with `HardwareProfile.ridge_point`."""
        return self.flops / self.bytes_moved if self.bytes_moved else 0.0


@dataclass(frozen=True)
class Tiling:
    """How a call is cut into programs.

    Attributes:
        variant: kernel variant name (``"persistent"``, ``"split_k"``...).
        blocks: compile-time block sizes passed to the kernel (``{"BLOCK": 1024}``).
        onchip_bytes: bytes one program keeps live on chip (UB, shared memory, registers).
        double_buffered: the kernel overlaps copy-in with compute, so only half the
            on-chip memory is available to one tile.
        options: other choices of the variant (split counts, ...).
    """

    variant: str
    blocks: Mapping[str, int]
    onchip_bytes: int
    double_buffered: bool = True
    options: Mapping[str, Any] = field(default_factory=dict)


class AutocastPolicy(enum.Enum):
    """What an operator does inside ``torch.autocast``.

    ``KEEP``: run in the inputs' dtypes (the kernels already compute in float32).
    ``FP32``: cast floating inputs to float32 (numerically sensitive reductions).
    ``LOWER``: cast floating inputs to the autocast dtype (matmul-like operators).
    """

    KEEP = "keep"
    FP32 = "fp32"
    LOWER = "lower"


@dataclass
class Case:
    """One verification sample: inputs (``None`` for an absent optional) and attributes."""

    name: str
    inputs: tuple[torch.Tensor | None, ...]
    attrs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class KnownLimitation:
    """Verification cases known to miss their precision standard, and why.

    ``case``, ``backend`` and ``dtype`` are `fnmatch` patterns over the case name (sweep
    cases are named ``<kind>_<shape>``), the backend and the dtype name; ``failures`` is
    one (or a tuple of them) over the standard's reasons (``"eb ratio*"``): the limitation
    covers a case only when every reason it failed for matches one of them. A covered case
    that misses its standard is reported as ``known`` with ``reason``, never silently.
    ``interpreter``: the limitation is one of Triton's interpreter (its arithmetic is
    numpy's), so it covers nothing where the kernels are compiled for a device.
    """

    reason: str
    case: str = "*"
    backend: str = "*"
    dtype: str = "*"
    failures: str | tuple[str, ...] = "*"
    interpreter: bool = False

    def matches(self, case: str, backend: str, dtype: str,
                failures: Sequence[str] = ()) -> bool:
        if self.interpreter:
            from opforge.core.backends import interpreter_enabled

            if not interpreter_enabled():
                return False
        return (fnmatch.fnmatchcase(case, self.case)
                and fnmatch.fnmatchcase(backend, self.backend)
                and fnmatch.fnmatchcase(dtype, self.dtype)
                and all(any(fnmatch.fnmatchcase(f, pattern) for pattern in self.patterns)
                        for f in failures))

    @property
    def patterns(self) -> tuple[str, ...]:
        return (self.failures,) if isinstance(self.failures, str) else self.failures


@dataclass(frozen=True)
class PrecisionSpec:
    """How `opforge verify` judges an operator (see `opforge.precision.standards`).

    Attributes:
        category: the standard for its floating outputs: ``"absolute"``, ``"binary"``,
            ``"ulp"``, ``"dual_thousandth"`` or ``"benchmark_ratio"``. Integer and bool
            outputs are always judged ``"binary"``.
        level: ``"L0"``, ``"L1"`` or ``"L2"``: the benchmark-ratio limits.
        peer: torch's own operator, ``peer(*inputs, **attrs)`` in the inputs' dtype: the
            benchmark opforge's error is compared with (same float64 golden).
        sweep: ``sweep(kind, shape, dtype, device, generator) -> list[Case]``: the cases
            built from a `opforge.precision.cases` kind and shape (empty: the kind does not
            apply). ``None``: every tensor input is generated from the kind and shape.
        known_limitations: cases allowed to miss the standard, each with its reason.
    """

    category: str = "benchmark_ratio"
    level: str = "L0"
    peer: Callable[..., Any] | None = None
    sweep: Callable[..., list[Case]] | None = None
    known_limitations: tuple[KnownLimitation, ...] = ()

    def limitation(self, case: str, backend: str, dtype: str,
                   failures: Sequence[str] = ()) -> KnownLimitation | None:
        """The first known limitation covering the case and its failure reasons, if any."""
        return next((known for known in self.known_limitations
                     if known.matches(case, backend, dtype, failures)), None)


@dataclass(frozen=True)
class BenchSpec:
    """How ``opforge bench`` sweeps an operator against its peers.

    Attributes:
        shapes: the sizes swept on an accelerator, passed to ``case``.
        cpu_shapes: the sizes swept on the CPU (the torch backend or the interpreter).
        case: ``case(shape, dtype, device, generator) -> Case``: the inputs at one size.
            ``None``: the first case of the operator's precision sweep for the ``normal``
            kind at that shape.
        metric: what is plotted: ``"GB/s"`` (memory-bound operators) or ``"TFLOP/s"``.
        peers: implementations besides torch's peer (``PrecisionSpec.peer``) and its
            ``torch.compile``: ``name -> factory(case)`` returning a callable of no
            arguments, or ``None`` when the peer is not installed (e.g. Liger-Kernel).
    """

    shapes: tuple[tuple[int, ...], ...] = ((4096, 1024), (16384, 1024), (16384, 4096),
                                           (65536, 4096))
    cpu_shapes: tuple[tuple[int, ...], ...] = ((64, 1024), (512, 1024), (2048, 1024))
    case: Callable[..., Case] | None = None
    metric: str = "GB/s"
    peers: Mapping[str, Callable[[Case], Callable[[], Any] | None]] = field(
        default_factory=dict)


Specs = Sequence["TensorSpec | None"]
Attrs = Mapping[str, Any]
Launcher = Callable[["Plan", Sequence["torch.Tensor | None"], Sequence[torch.Tensor],
                     "torch.Tensor | None"], None]


def _no_check(inputs: Specs, attrs: Attrs) -> None:
    return None


def magnitude_scale(opdef: OpDef, inputs: Sequence[torch.Tensor | None], attrs: Attrs,
                    golden: torch.Tensor, output: str) -> torch.Tensor:
    """Default `OpDef.error_scale`: errors are judged relative to |golden|."""
    return golden.abs()


def _no_workspace(tiling: Tiling, grid: tuple[int, ...], inputs: Specs, outputs: Specs,
                  attrs: Attrs) -> int:
    return 0


@dataclass(eq=False)
class OpDef:
    """The declaration of one operator.

    Pure functions (they see specs, never data):
        infer_shape(inputs, attrs) -> output shapes; dims may be -1 / (-2,) / SymInt.
        infer_dtype(inputs, attrs) -> output dtypes.
        check(inputs, attrs): cross-input validation beyond dtypes and attribute ranges.
        cost(inputs, outputs, attrs) -> `Cost`.
        tiling(inputs, outputs, attrs, hw) -> candidate `Tiling`s, preferred first. It sees
            shapes rounded up to powers of two, so that nearby shapes share one tiling (and
            one compiled kernel).
        grid(tiling, inputs, outputs, attrs, hw) -> launch grid for the exact shapes.
        workspace(tiling, grid, inputs, outputs, attrs) -> workspace bytes.
        kernel_costs(tiling, grid, inputs, outputs, attrs) -> {kernel name: `Cost` of one
            launch} of the Triton kernels a call launches, for operators that launch
            several (the profiler gives each its own roofline verdict); ``None``: one
            kernel carries the whole cost.
        samples(dtype, device, generator) -> verification `Case`s.
        error_scale(opdef, inputs, attrs, golden, output) -> float64 tensor: the magnitude
            the errors of the output named ``output`` are judged against (|golden| by
            default; a condition-aware scale where rounding of the inputs is amplified,
            e.g. sum(|x|) for a reduction).
        precision: the standard `opforge verify` judges it by, its torch peer, its sweep
            cases and known limitations (`PrecisionSpec`).
        bench: how ``opforge bench`` sweeps it (`BenchSpec`); ``None``: not benchmarked.
        strided_out: the launchers write outputs through their strides, so
            ``Plan.run(out=)`` hands them a non-contiguous ``out`` as it is (a transposed
            view filled without a copy); otherwise the plan gives them a contiguous buffer
            and copies it into ``out``.
        check_values(plan, inputs): checks that need the inputs' data (index ranges), run
            by `Plan.run` before anything is launched, on every backend, also when the
            outputs are empty; raises `OpError` subclasses.
        held_launches: a plan records the kernel launches its launcher makes per layout
            and replays them (`opforge.core.launches`); ``False`` for a launcher whose
            launches a replay cannot hold (arguments it makes per call), or a predicate
            on the plan's attributes (launches that follow a global setting under some
            attribute values).
        inplace_out: each program reads the input elements it writes over before it writes
            them, so ``Plan.run(out=)`` may hand the launchers an ``out`` that is an input
            itself (the same elements, ``out=x``: elementwise and row operators); any
            other ``out`` overlapping an input is filled through a fresh buffer and a copy.

    Attached by decorators in the operator module: `reference`, `launcher`, `declines`,
    `autograd`.
    """

    name: str
    doc: str
    inputs: tuple[TensorArg, ...]
    outputs: tuple[OutputArg, ...]
    attrs: tuple[Attr, ...]
    infer_shape: Callable[[Specs, Attrs], Sequence[tuple[int, ...]]]
    infer_dtype: Callable[[Specs, Attrs], Sequence[torch.dtype]]
    cost: Callable[[Specs, Specs, Attrs], Cost]
    tiling: Callable[[Specs, Specs, Attrs, HardwareProfile], Sequence[Tiling]]
    grid: Callable[[Tiling, Specs, Specs, Attrs, HardwareProfile], tuple[int, ...]]
    samples: Callable[[torch.dtype, torch.device, torch.Generator], list[Case]]
    check: Callable[[Specs, Attrs], None] = _no_check
    check_values: Callable[[Any, Sequence[torch.Tensor | None]], None] | None = None
    workspace: Callable[[Tiling, tuple[int, ...], Specs, Specs, Attrs], int] = _no_workspace
    kernel_costs: Callable[[Tiling, tuple[int, ...], Specs, Specs, Attrs],
                           Mapping[str, Cost]] | None = None
    autocast: AutocastPolicy = AutocastPolicy.KEEP
    error_scale: Callable[..., torch.Tensor] = magnitude_scale
    precision: PrecisionSpec = field(default_factory=PrecisionSpec)
    bench: BenchSpec | None = None
    strided_out: bool = False
    inplace_out: bool = False
    held_launches: bool | Callable[[Attrs], bool] = True
    reference_fn: Callable[..., Any] | None = None
    launchers: dict[str, Launcher] = field(default_factory=dict)
    decliners: dict[str, Callable[[Specs, Attrs], str | None]] = field(default_factory=dict)
    setup_context_fn: Callable[..., None] | None = None
    backward_fn: Callable[..., Any] | None = None
    torch_op: Any = None
    call: Callable[..., Any] | None = None  # the fast entry, set by `register_op`
    functional: Callable[..., Any] | None = None  # ``opforge.<name>``, see `exported`
    attr_names: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        self.attr_names = tuple(attr.name for attr in self.attrs)

    def __call__(self, *args: Any) -> Any:
        """Call the operator: tensors, then attribute values in prototype order (trailing
        defaults may be left out), as ``torch.ops.opforge.<name>`` takes them. Eager
        calls run their held plan directly; see `opforge.library.register_op`."""
        return self.call(*args)

    # -- decorators used by the operator module ------------------------------------------

    def reference(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Attach the plain-torch reference: ``fn(*inputs, compute_dtype, **attrs)`` returns
        the outputs in ``compute_dtype`` (float64: the golden; float32: the torch backend),
        followed by the new values of the `mutated_inputs` (it never writes its inputs)."""
        self.reference_fn = fn
        return fn

    def launcher(self, backend: str) -> Callable[[Launcher], Launcher]:
        """Attach a backend launcher ``fn(plan, inputs, outputs, workspace)`` that writes
        every element of the preallocated ``outputs`` (and updates the mutated inputs in
        place). A ``"torch"`` launcher replaces the generic torch backend (the reference
        copied into the outputs) for operators that must not copy a mutated input whole."""
        def attach(fn: Launcher) -> Launcher:
            self.launchers[backend] = fn
            return fn
        return attach

    def declines(self, backend: str) -> Callable[[Callable[[Specs, Attrs], str | None]],
                                                 Callable[[Specs, Attrs], str | None]]:
        """Attach ``fn(inputs, attrs) -> reason | None``: why ``backend`` cannot run a call."""
        def attach(fn: Callable[[Specs, Attrs], str | None]) -> Callable[[Specs, Attrs],
                                                                         str | None]:
            self.decliners[backend] = fn
            return fn
        return attach

    def exported(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Make ``fn`` the operator's functional: after ``import opforge`` it is
        ``opforge.<fn.__name__>`` and ``opforge.functional.<fn.__name__>``, with nothing
        else to edit (`opforge.core.registry.functionals`)."""
        self.functional = fn
        return fn

    def autograd(self, setup_context: Callable[..., None]) -> Callable[[Callable[..., Any]],
                                                                       Callable[..., Any]]:
        """Attach the autograd formula in `torch.library.register_autograd` form."""
        def attach(backward: Callable[..., Any]) -> Callable[..., Any]:
            self.setup_context_fn = setup_context
            self.backward_fn = backward
            return backward
        return attach

    # -- validation used by plan and by the fake implementation --------------------------

    @property
    def backends(self) -> tuple[str, ...]:
        return ("torch", *(name for name in self.launchers if name != "torch"))

    @property
    def mutated_inputs(self) -> tuple[int, ...]:
        """Positions of the inputs the operator updates in place."""
        return tuple(i for i, arg in enumerate(self.inputs) if arg.mutated)

    @property
    def reruns_alike(self) -> bool:
        """Whether a second run on the same inputs leaves every input as the first run
        left it: no input is updated in place, or each one is only overwritten
        (`TensorArg.write_only`)."""
        return all(self.inputs[i].write_only for i in self.mutated_inputs)

    def bind_attrs(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """Validate attribute values and fill in defaults.

        Raises:
            AttrError: unknown attribute name, or a value `Attr.validate` rejects.
        """
        known = {attr.name: attr for attr in self.attrs}
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise AttrError(f"unknown attribute(s) {', '.join(unknown)}", op=self.name,
                            param=unknown[0], expected=f"one of {sorted(known)}",
                            got=unknown)
        return {name: attr.validate(given.get(name, attr.default), self.name)
                for name, attr in known.items()}

    def bind_inputs(self, tensors: Sequence[Any]) -> list[torch.Tensor | None]:
        """Check the positional tensors against the prototype (count, presence, dtype).

        Raises:
            OpError: too many inputs, or a required input is missing (code 161001).
            DtypeError: a tensor's dtype is not one the input accepts.
            TypeError: a non-tensor is passed where a tensor is expected.
        """
        if len(tensors) > len(self.inputs):
            raise OpError("too many tensor inputs", op=self.name, param="inputs",
                          expected=f"at most {len(self.inputs)} "
                                   f"({', '.join(a.name for a in self.inputs)})",
                          got=len(tensors))
        bound: list[torch.Tensor | None] = []
        for index, arg in enumerate(self.inputs):
            tensor = tensors[index] if index < len(tensors) else None
            if tensor is None:
                if not arg.optional:
                    raise OpError("required input is missing", op=self.name, param=arg.name,
                                  expected="a tensor", got=None, code=PARAM_NULLPTR)
            elif not isinstance(tensor, torch.Tensor):
                raise DtypeError("is not a tensor", op=self.name, param=arg.name,
                                 expected="torch.Tensor", got=type(tensor).__name__)
            elif tensor.dtype not in arg.dtypes:
                raise DtypeError("has an unsupported dtype", op=self.name, param=arg.name,
                                 expected=" | ".join(dtype_name(d) for d in arg.dtypes),
                                 got=dtype_name(tensor.dtype))
            bound.append(tensor)
        return bound


def bucket_specs(specs: Specs) -> list[TensorSpec | None]:
    """Round every known dim up to a power of two: the key under which tilings are shared."""
    def bucket(dim: int) -> int:
        return 1 << (dim - 1).bit_length() if dim > 1 else dim
    return [None if s is None else TensorSpec(tuple(bucket(d) for d in s.shape), s.dtype,
                                              s.device) for s in specs]
