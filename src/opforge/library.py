"""torch.library registration: every `OpDef` becomes ``torch.ops.<namespace>.<name>``.

The schema, the fake implementation and the autocast rule are derived from the OpDef; the
real implementation is ``plan(...).run(...)``; the autograd formula is the one the operator
module attached with `OpDef.autograd`. Registration uses `torch.library.custom_op`, which
works in eager mode, under ``torch.compile(fullgraph=True)`` (the op is opaque and the fake
gives shapes, symbolic ones included), with ``torch.export`` and with
`torch.library.opcheck`.
"""

from __future__ import annotations

from typing import Any

import torch

from opforge.core import registry
from opforge.core.opdef import Attr, AutocastPolicy, OpDef
from opforge.core.plan import plan, validate

AUTOCAST_DEVICES = ("cpu", "cuda")
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


def _split(opdef: OpDef, args: tuple[Any, ...], kwargs: dict[str, Any]
           ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    count = len(opdef.inputs)
    tensors = args[:count]
    attrs = dict(zip((a.name for a in opdef.attrs), args[count:]))
    attrs.update(kwargs)
    return tensors, attrs


def _lower_autocast(namespace: str, opdef: OpDef, device_type: str) -> None:
    # register_autocast takes a fixed dtype; LOWER casts to the dtype of the enclosing
    # autocast region (fp16 or bf16), read at call time, so it needs its own kernel.
    key = "Autocast" + torch._C._dispatch_key_for_device(device_type)
    keyset = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))

    def kernel(_keyset: Any, *args: Any) -> Any:
        dtype = torch.get_autocast_dtype(device_type)
        cast = [a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point()
                and a.device.type == device_type else a for a in args]
        with torch._C._ExcludeDispatchKeyGuard(keyset):
            return opdef.torch_op(*cast)

    library = _libraries.setdefault(namespace, torch.library.Library(namespace, "FRAGMENT"))
    library.impl(opdef.name, kernel, key, with_keyset=True)


def register_op(opdef: OpDef, namespace: str = "opforge") -> Any:
    """Register ``opdef`` as ``torch.ops.<namespace>.<name>`` (and in the opforge registry
    when ``namespace`` is ``"opforge"``). Returns the op (an `OpOverloadPacket`-like
    callable) and stores it as ``opdef.torch_op``."""
    qualname = f"{namespace}::{opdef.name}"

    def implementation(*args: Any, **kwargs: Any) -> Any:
        tensors, attrs = _split(opdef, args, kwargs)
        return plan(opdef, *tensors, **attrs).run(*tensors)

    def fake(*args: Any, **kwargs: Any) -> Any:
        tensors, attrs = _split(opdef, args, kwargs)
        signature = validate(opdef, tensors, attrs)
        outs = [torch.empty(s.shape, dtype=s.dtype, device=s.device) for s in signature.outputs]
        return outs[0] if len(outs) == 1 else tuple(outs)

    mutated = tuple(opdef.inputs[i].name for i in opdef.mutated_inputs)
    custom = torch.library.custom_op(qualname, implementation, mutates_args=mutated,
                                     schema=schema_for(opdef))
    custom.register_fake(fake)
    if opdef.backward_fn is not None:
        custom.register_autograd(opdef.backward_fn, setup_context=opdef.setup_context_fn)
    opdef.torch_op = getattr(getattr(torch.ops, namespace), opdef.name).default
    for device_type in AUTOCAST_DEVICES:
        if opdef.autocast is AutocastPolicy.FP32:
            torch.library.register_autocast(qualname, device_type, torch.float32)
        elif opdef.autocast is AutocastPolicy.LOWER:
            _lower_autocast(namespace, opdef, device_type)
    if namespace == "opforge":
        registry.add(opdef)
    return opdef.torch_op
