"""torch.library registration: every `OpDef` becomes ``torch.ops.<namespace>.<name>``.

The schema, the fake implementation and the autocast rule are derived from the OpDef; the
real implementation is ``plan(...).run(...)``; the autograd formula is the one the operator
module attached with `OpDef.autograd`. The op works in eager mode, under
``torch.compile(fullgraph=True)``, with ``torch.export`` and with `torch.library.opcheck`.
With ``OPFORGE_TRACE_COMPILED=1``, a call compiled for a CUDA device with static shapes on
the Triton backend is traced into its kernel launches (`Plan.traced`, the decomposition
`torch.library.triton_op` makes), so the compiled program launches the kernels itself;
every other compiled call keeps the op as one opaque node, whose fake gives the shapes
(symbolic ones included).

Registration is the one `torch.library.custom_op` makes (a schema tagged pt2-compliant, a
``CompositeExplicitAutograd`` kernel, a fake, an ``Autograd`` kernel applying an
``autograd.Function``, an ``ADInplaceOrView`` kernel that bumps the version of mutated
inputs), written with the `torch.library.Library` primitives. Why: custom_op's generic
wrappers (argument re-binding, aliasing checks, a dynamo guard per kernel) cost about as
much host time as the whole plan lookup and run of a small call; these kernels know their
operator and skip them. The backward sees ``ctx.needs_input_grad`` over the full prototype
(tensors, then attributes), defaults included: the dispatcher drops trailing arguments
equal to their defaults before a kernel sees them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.autograd import forward_ad

from opforge.core import autotune, registry
from opforge.core.errors import OpError, UnsupportedError
from opforge.core.opdef import Attr, AutocastPolicy, OpDef
from opforge.core.plan import Plan, plan_for_call, validate

AUTOCAST_DEVICES = ("cpu", "cuda")
# Dispatch keys after which nothing but the device kernel runs (npu is PrivateUse1).
DEVICE_KEYS = frozenset((torch._C.DispatchKey.CPU, torch._C.DispatchKey.CUDA,
                         torch._C.DispatchKey.XPU, torch._C.DispatchKey.PrivateUse1))
_libraries: dict[str, torch.library.Library] = {}


def _schema_default(attr: Attr) -> str:
    value = attr.default
    if value is None:
        return "None"
    if attr.kind == "str":
        return f'"{value}"'
    if attr.kind == "ints":
        return "[" + ", ".join(str(v) for v in value) + "]"
    return repr(value)


def schema_for(opdef: OpDef) -> str:
    """The torch schema of an OpDef: tensors first, then attributes with defaults."""
    aliases = iter("abcdefghijklmnopqrstuvwxyz")
    args = [f"Tensor{f'({next(aliases)}!)' if arg.mutated else ''}{'?' if arg.optional else ''}"
            f" {arg.name}" for arg in opdef.inputs]
    args += [f"{attr.schema_type} {attr.name}={_schema_default(attr)}" for attr in opdef.attrs]
    returns = ("Tensor" if len(opdef.outputs) == 1
               else "(" + ", ".join("Tensor" for _ in opdef.outputs) + ")")
    return f"({', '.join(args)}) -> {returns}"


def _split(opdef: OpDef, args: tuple[Any, ...]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    count = len(opdef.inputs)
    return args[:count], dict(zip((a.name for a in opdef.attrs), args[count:]))


def _lower_autocast(namespace: str, opdef: OpDef, device_type: str) -> None:
    # register_autocast takes a fixed dtype; LOWER casts to the dtype of the enclosing
    # autocast region (fp16 or bf16), read at call time, so it needs its own kernel.
    key = "Autocast" + torch._C._dispatch_key_for_device(device_type)
    keyset = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))

    def kernel(_keyset: Any, *args: Any) -> Any:
        dtype = torch.get_autocast_dtype(device_type)
        # torch's eligibility rule: floating tensors of this device, float64 excepted.
        cast = [a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point()
                and a.dtype != torch.float64 and a.device.type == device_type else a
                for a in args]
        with torch._C._ExcludeDispatchKeyGuard(keyset):
            return opdef.torch_op(*cast)

    _library(namespace).impl(opdef.name, kernel, key, with_keyset=True)


def _library(namespace: str) -> torch.library.Library:
    return _libraries.setdefault(namespace, torch.library.Library(namespace, "FRAGMENT"))


def _autograd_function(opdef: OpDef, below_autograd: Callable[[Any, Sequence[Any]], Any]
                       ) -> type[torch.autograd.Function]:
    """The ``autograd.Function`` of an operator whose call needs a gradient. ``forward``
    takes how to run the call, then the full prototype's arguments: a `Plan` (the eager
    entry: it runs the plan it was given) or a dispatch keyset (the ``Autograd`` kernel:
    it redispatches below autograd, so that fake and functional tensors reach their own
    kernels under torch.compile). ``backward`` is the OpDef's formula."""
    count = len(opdef.inputs)
    constants = [index for index, output in enumerate(opdef.outputs)
                 if not output.differentiable]

    def forward(ctx: Any, runner: Any, *args: Any) -> Any:
        result = (runner.run_planned(args[:count]) if isinstance(runner, Plan)
                  else below_autograd(runner, args))
        if constants:
            ctx.mark_non_differentiable(*(result[index] for index in constants))
            # A statistic's gradient reaches the formula as None, not as zeros (a fill
            # kernel per backward); an unused differentiable output still gets zeros.
            ctx.set_materialize_grads(False)
            ctx.differentiable = [(index, out.shape, out.dtype, out.device)
                                  for index, out in enumerate(result)
                                  if index not in constants]
        if opdef.setup_context_fn is not None:
            needs = ctx.needs_input_grad
            ctx.needs_input_grad = needs[1:]  # the runner is not an input
            try:
                opdef.setup_context_fn(ctx, args, result)
            finally:
                ctx.needs_input_grad = needs
        elif opdef.backward_fn is None:
            ctx.input_specs = [(a.shape, a.dtype) if isinstance(a, torch.Tensor) else None
                               for a in args]
        return result

    def backward(ctx: Any, *grads: Any) -> Any:
        if opdef.backward_fn is None:
            # Raised by an operator when the gradients run, not here: torch.compile traces
            # this backward whenever an input requires grad, also for a call never
            # differentiated (an inference loop over parameters).
            grad = next(g for g in grads if g is not None)
            return (None, *(torch.ops.opforge._no_gradient(grad, spec[0], spec[1], opdef.name)
                            if spec is not None and need else None
                            for spec, need in zip(ctx.input_specs,
                                                  ctx.needs_input_grad[1:])))
        if constants:
            grads = list(grads)
            for index, shape, dtype, device in ctx.differentiable:
                if grads[index] is None:
                    grads[index] = torch.zeros(shape, dtype=dtype, device=device)
        needs = ctx.needs_input_grad
        ctx.needs_input_grad = needs[1:]  # the runner is not an input
        try:
            result = opdef.backward_fn(ctx, *grads)
        finally:
            ctx.needs_input_grad = needs
        return (None, *result) if isinstance(result, tuple) else (None, result)

    return type(f"{opdef.name}_autograd", (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward)})


def _autograd_kernel(opdef: OpDef, op: Any, full: Callable[[tuple[Any, ...]], tuple[Any, ...]],
                     implementation: Callable[..., Any]
                     ) -> tuple[Callable[..., Any], type[torch.autograd.Function]]:
    """The ``Autograd`` kernel, and the operator's ``autograd.Function``. When an input
    needs a gradient: the Function (redispatching below autograd). Otherwise below
    autograd: straight to ``implementation`` when only a device kernel is left to run
    (plain tensors, no mode, no version bump), else by redispatch."""
    def below_autograd(keyset: Any, args: Sequence[Any]) -> Any:
        raw = keyset.raw_repr()
        direct = _device_only.get(raw)
        if direct is None:
            direct = _device_only[raw] = _below_is_device(keyset)
        if direct:
            return implementation(*args)
        with torch._C._AutoDispatchBelowAutograd():
            return op.redispatch(keyset & _AFTER_AUTOGRAD, *args)

    function = _autograd_function(opdef, below_autograd)

    def kernel(keyset: Any, *args: Any) -> Any:
        if forward_ad._current_level >= 0 and _has_tangent(args):
            raise _unsupported_transform(opdef, "forward-mode AD (torch.func.jvp, "
                                         "torch.autograd.forward_ad)")
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
            if torch._C._functorch.peek_interpreter_stack() is not None:
                raise _unsupported_transform(opdef, "torch.func transforms (grad, vjp, "
                                             "jacrev)")
            return function.apply(keyset, *full(args))
        return below_autograd(keyset, args)

    # Dynamo must not trace into opforge's kernels when an eager call reaches them from a
    # compiled region (after a graph break).
    return torch.compiler.disable(kernel), function


_AFTER_AUTOGRAD = torch._C._after_autograd_keyset
# Whether a kernel's dispatch keyset (its raw bits) has nothing but a device kernel left
# below autograd. NOTE: the keyset operations cost 0.9 µs a call, the memo's lookup 0.2.
_device_only: dict[int, bool] = {}


def _below_is_device(keyset: Any) -> bool:
    return (keyset & _AFTER_AUTOGRAD).highestPriorityTypeId() in DEVICE_KEYS


def _has_tangent(args: Sequence[Any]) -> bool:
    """Whether a tensor argument carries a forward-mode tangent (a dual level is open)."""
    return any(isinstance(a, torch.Tensor) and forward_ad.unpack_dual(a).tangent is not None
               for a in args)


def _unsupported_transform(opdef: OpDef, transform: str) -> UnsupportedError:
    # Without this the tangent would be dropped silently (a zero or missing derivative).
    return UnsupportedError(f"cannot be differentiated by {transform}", op=opdef.name,
                            param="inputs", expected="torch.autograd reverse mode "
                            "(backward, torch.autograd.grad)", got=transform)


def _version_bump_kernel(opdef: OpDef, op: Any) -> Callable[..., Any]:
    """The ``ADInplaceOrView`` kernel of an operator that mutates inputs: autograd must see
    their new versions (a tensor saved for backward and then overwritten is an error)."""
    after_inplace = torch._C._after_ADInplaceOrView_keyset

    def kernel(keyset: Any, *args: Any) -> Any:
        for index in opdef.mutated_inputs:
            torch.autograd.graph.increment_version(args[index])
        return op.redispatch(keyset & after_inplace, *args)

    return kernel


try:
    # The mode AOTAutograd traces a compiled graph under (private: what
    # torch.library.triton_op registers its decomposition for).
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
except ImportError:  # pragma: no cover - a torch without it: compiled calls stay opaque
    FunctionalTensorMode = FunctionalTensor = None


# Opt-in until a GPU run has compiled every traced operator (tests/test_compiled_launches.py
# on CUDA): a launch Inductor cannot compile would fail the whole compile.
TRACE_VARIABLE = "OPFORGE_TRACE_COMPILED"


def tracing_compiled_calls() -> bool:
    """Whether calls compiled for a CUDA device are traced into their kernel launches:
    ``OPFORGE_TRACE_COMPILED`` is ``1``, ``true``, ``yes`` or ``on``, read when a call is
    compiled (default off: one opaque operator)."""
    return os.environ.get(TRACE_VARIABLE, "").strip().lower() in ("1", "true", "yes", "on")


def _static_cuda(types: Sequence[type], tensors: Sequence[Any]) -> bool:
    """Whether a traced call can be decomposed: plain or functional tensors, all on a
    CUDA device (Inductor compiles Triton launches for it), every size and stride an int
    (a plan is made for concrete shapes), outside ``torch.export`` (an exported program
    keeps the operator: kernels are no part of its serialised form)."""
    if any(t is not torch.Tensor and not issubclass(t, FunctionalTensor) for t in types):
        return False
    present = [t for t in tensors if t is not None]
    if not present or not all(t.device.type == "cuda" and all(
            type(n) is int for n in (*t.shape, *t.stride())) for t in present):
        return False
    return bool(getattr(torch._functorch.config, "decompose_custom_triton_ops", True))


def _decomposition(opdef: OpDef, full: Callable[[tuple[Any, ...]], tuple[Any, ...]]
                   ) -> Callable[..., Any]:
    """The operator's rule under `FunctionalTensorMode`: its call as the kernel launches
    of its plan (`Plan.traced`), which Inductor makes from its own generated code. Why: a
    compiled graph calls an opaque Python operator through the dispatcher and its Python
    kernel, about 24 µs a call on a CPU before the operator's own host path (the compiled
    torch softmax costs 24 µs in all); a launch Inductor makes costs what its own kernels'
    launches cost. Calls that cannot be decomposed get the mode's own handling."""
    count = len(opdef.inputs)

    def rule(mode: Any, op: Any, types: Sequence[type], args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Any:
        called = full(tuple(args))
        outputs = None
        # With autotuning on, the call stays opaque: its tiling is timed on the first real
        # call (a plan made here, on fake tensors, would take the first fitting tiling
        # and be cached for eager calls too).
        if tracing_compiled_calls() and _static_cuda(types, called[:count]) \
                and not autotune.autotune_enabled():
            # Whatever fails here leaves the call to the opaque operator, which raises what
            # a real call raises. The launchers' host reads of addresses (tensor
            # descriptors' alignment) and data come before their first launch, so a failed
            # trace leaves no launch in the graph.
            try:
                with mode:
                    outputs = plan_for_call(opdef, called).traced(called[:count])
            except Exception:
                outputs = None
        if outputs is None:
            return mode.__torch_dispatch__(op, types, args, kwargs)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    return rule


def register_op(opdef: OpDef, namespace: str = "opforge") -> Any:
    """Register ``opdef`` as ``torch.ops.<namespace>.<name>`` (and in the opforge registry
    when ``namespace`` is ``"opforge"``). Returns the op (an `OpOverload`) and stores it as
    ``opdef.torch_op``."""
    qualname = f"{namespace}::{opdef.name}"
    library = _library(namespace)
    library.define(opdef.name + schema_for(opdef), tags=(torch.Tag.pt2_compliant_tag,))
    op = getattr(getattr(torch.ops, namespace), opdef.name).default
    defaults = tuple(attr.default for attr in opdef.attrs)
    arity = len(opdef.inputs) + len(defaults)

    def full(args: tuple[Any, ...]) -> tuple[Any, ...]:
        return args if len(args) == arity else (*args, *defaults[len(args) - arity:])

    count = len(opdef.inputs)

    def implementation(*args: Any) -> Any:
        return plan_for_call(opdef, args).run_planned(args[:count])

    def fake(*args: Any) -> Any:
        tensors, attrs = _split(opdef, full(args))
        signature = validate(opdef, tensors, attrs)
        outs = [torch.empty(s.shape, dtype=s.dtype, device=s.device) for s in signature.outputs]
        return outs[0] if len(outs) == 1 else tuple(outs)

    # Dynamo must not trace into the implementation when an eager call reaches it from a
    # compiled region (after a graph break).
    library.impl(opdef.name, torch.compiler.disable(implementation),
                 "CompositeExplicitAutograd")
    torch.library.register_fake(qualname, fake, lib=library)
    kernel, function = _autograd_kernel(opdef, op, full, implementation)
    library.impl(opdef.name, kernel, "Autograd", with_keyset=True)
    if opdef.mutated_inputs:
        library.impl(opdef.name, _version_bump_kernel(opdef, op), "ADInplaceOrView",
                     with_keyset=True)
    elif FunctionalTensorMode is not None:
        torch.library.register_torch_dispatch(qualname, FunctionalTensorMode,
                                              _decomposition(opdef, full), lib=library)
    opdef.torch_op = op
    opdef.call = _entry(opdef, op, function, full)
    for device_type in AUTOCAST_DEVICES:
        if opdef.autocast is AutocastPolicy.FP32:
            torch.library.register_autocast(qualname, device_type, torch.float32)
        elif opdef.autocast is AutocastPolicy.LOWER:
            _lower_autocast(namespace, opdef, device_type)
    if namespace == "opforge":
        registry.add(opdef)
    return op


# Python types an attribute value of each kind has as given (any other goes through
# `Attr.validate`): the dispatcher would convert a few others silently (None or 1 for a
# bool, True for a float or an element of a list of ints), which `plan` rejects. A list
# of ints is always validated: its elements are what matters.
_GIVEN_TYPES = {"bool": (bool,), "int": (int,), "float": (float, int), "str": (str,),
                "ints": (int,)}
# Tensors an eager call runs its plan on directly (an nn.Parameter is a plain tensor; meta
# tensors go to the fake implementation).
PLAIN_TENSORS = frozenset((torch.Tensor, torch.nn.Parameter))


def _dispatched_features() -> Callable[[], bool]:
    """A check of what only the dispatcher honours, active in this thread: a dispatch mode
    (FakeTensorMode, FlopCounterMode), a functorch transform (vmap, grad), forward-mode AD,
    torch's profiler (its operator events). Private hooks, each read in about 0.1 µs; a
    torch without one of them gets a check that is always true, so every call dispatches
    (correct, and slower)."""
    try:
        dispatch_modes = torch._C._len_torch_dispatch_stack
        transforms = torch._C._functorch.peek_interpreter_stack
        profiling = torch._C._autograd._profiler_enabled
        forward_ad._current_level  # noqa: B018 - the hook must exist
    except AttributeError:  # pragma: no cover - a torch without the hooks
        return lambda: True

    def active() -> bool:
        return bool(dispatch_modes() or transforms() is not None
                    or forward_ad._current_level >= 0 or profiling())

    return active


_features_active = _dispatched_features()


def _entry(opdef: OpDef, op: Any, function: type[torch.autograd.Function],
           full: Callable[[tuple[Any, ...]], tuple[Any, ...]]) -> Callable[..., Any]:
    """`OpDef.__call__`: the operator called with the torch operator's arguments.

    An eager call of plain strided tensors with nothing active that lives in the dispatcher
    (no torch.compile or torch.jit tracing, no mode, subclass, negative view, meta device,
    transform, forward-mode AD, profiler, nor an autocast region for an operator with an
    autocast rule) runs its plan directly:
    `plan_for_call`, then `Plan.run_planned`, or the operator's ``autograd.Function`` when
    an input needs a gradient. The dispatcher round trip it skips (torch.ops, the Autograd
    kernel, the implementation's argument split, the plan's keyword key) cost about 12 µs
    of a 23 µs softmax call. Every other call goes through ``torch.ops.opforge.<name>``,
    its attribute types checked first (the dispatcher would convert ``None`` or ``1`` for
    a bool silently), its schema errors raised as `plan`'s typed errors.
    """
    count = len(opdef.inputs)
    arity = count + len(opdef.attrs)
    types = tuple(frozenset(_GIVEN_TYPES[attr.kind]) | (
        {type(None)} if attr.default is None else set()) for attr in opdef.attrs)
    autocast = opdef.autocast is not AutocastPolicy.KEEP
    mutated = opdef.mutated_inputs
    attrs, attr_owner = opdef.attrs, opdef.name

    def dispatched(args: tuple[Any, ...]) -> Any:
        # No read of `opdef` here: torch.compile would guard that the closure's OpDef is
        # the one it was called through (a Python guard: 0.15 µs a compiled call).
        for attr, allowed, value in zip(attrs, types, args[count:]):
            if type(value) not in allowed:
                attr.validate(value, attr_owner)
        try:
            return op(*args)
        except RuntimeError:
            try:
                validate(opdef, *_split(opdef, args))
            except OpError as typed:
                raise typed from None
            raise

    def call(*args: Any) -> Any:
        # Every tensor given, no argument too many: the schema reports the others.
        if torch.compiler.is_compiling() or torch.jit.is_tracing() \
                or not count <= len(args) <= arity:
            return dispatched(args)
        tensors = args[:count]
        device = None
        for tensor in tensors:
            if tensor is not None:
                # A negative view is materialised by the dispatcher's fallback only.
                if type(tensor) not in PLAIN_TENSORS or tensor.layout is not torch.strided \
                        or tensor.is_neg() or tensor.is_meta:
                    return dispatched(args)
                device = tensor.device
        if device is None or _features_active() \
                or torch.overrides.has_torch_function([t for t in tensors if t is not None]) \
                or (autocast and device.type in AUTOCAST_DEVICES  # where its rule lives
                    and torch.is_autocast_enabled(device.type)):
            return dispatched(args)
        planned = plan_for_call(opdef, args)
        for index in mutated:  # autograd must see the update (the ADInplaceOrView kernel's)
            torch.autograd.graph.increment_version(tensors[index])
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                           for t in tensors):
            return function.apply(planned, *full(args))
        return planned.run_planned(tensors)

    return call


def _no_gradient(grad: torch.Tensor, shape: Sequence[int], dtype: torch.dtype,
                 op: str) -> torch.Tensor:
    raise UnsupportedError("has no backward (a forward-only operator): its inputs cannot "
                           "receive gradients", op=op, param="inputs",
                           expected="no gradient through the operator", got="a backward pass")


def _no_gradient_fake(grad: torch.Tensor, shape: Sequence[int], dtype: torch.dtype,
                      op: str) -> torch.Tensor:
    return grad.new_empty(shape, dtype=dtype)


# The gradient of a forward-only operator's input: an operator whose kernel raises, so that
# a graph holding it compiles and fails only if the gradient is computed.
_library("opforge").define("_no_gradient(Tensor grad, SymInt[] shape, ScalarType dtype, "
                           "str op) -> Tensor")
_library("opforge").impl("_no_gradient", _no_gradient, "CompositeExplicitAutograd")
torch.library.register_fake("opforge::_no_gradient", _no_gradient_fake,
                            lib=_library("opforge"))

