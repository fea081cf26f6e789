"""Run as ``python -m tests.compiled_trace`` in a process without Triton's interpreter:
each operator's first float32 sample traced as AOTAutograd traces a compiled call
(FunctionalTensorMode over fake CUDA tensors, Triton's analysis against a stand-in sm_90
driver, tiled for the H200), beside the launches its eager call records on CPU tensors.
Prints one JSON object per operator (`test_compiled_launches.py` reads them).

    python -m tests.compiled_trace [--default OP ...]
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any
from unittest import mock

import torch
import triton
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
from torch._subclasses.fake_tensor import FakeTensorMode
from torch._subclasses.functional_tensor import dispatch_functionalize
from torch.fx.experimental.proxy_tensor import make_fx
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver

import opforge
from opforge.aot import _StandInDriver
from opforge.core import backends, launches
from opforge.core.hardware import use_hardware
from opforge.core.plan import Plan
from opforge.library import TRACE_VARIABLE

WRAPPER = "triton_kernel_wrapper_functional"


class _Driver(_StandInDriver):
    def get_benchmarker(self) -> None:  # Triton 3.2's autotuner asks for it when made
        return None


def _describe(value: Any) -> Any:
    if isinstance(value, torch.Tensor):  # an empty tensor's strides are never read
        return ["tensor", list(value.shape), list(value.stride()) if value.numel() else None,
                str(value.dtype)]
    if isinstance(value, torch.fx.Node):
        return _describe(value.meta["val"])
    return value if isinstance(value, (int, float, bool, str, type(None))) else repr(value)


def _traced_launch(node: torch.fx.Node) -> dict[str, Any]:
    kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
    options = {}
    if hasattr(kernel, "configs"):  # launch options travel as a one-config autotuner
        (config,) = kernel.configs
        options = {"num_warps": config.num_warps}
        # A config's default stages (3; Triton 3.2's: 2) stand for a launch that names none.
        if config.num_stages != triton.Config({}).num_stages:
            options["num_stages"] = config.num_stages
        kernel = kernel.fn
    arguments = {**kernel_side_table.get_constant_args(node.kwargs["constant_args_idx"]),
                 **node.kwargs["kwargs"]}
    (grid,) = node.kwargs["grid"]
    return {"kernel": kernel.fn.__name__, "grid": list(grid), "options": options,
            "arguments": {name: _describe(value) for name, value in arguments.items()},
            "cloned": list(node.kwargs["tensors_to_clone"])}


def _eager_launch(kernel: Any, arguments: tuple[Any, ...], keywords: dict[str, Any],
                  inputs: list[torch.Tensor]) -> dict[str, Any]:
    keywords = dict(keywords)
    grid = keywords.pop("grid")
    keywords.pop("warmup", None)
    options = {name: keywords.pop(name) for name in ("num_warps", "num_stages")
               if name in keywords}
    if options.get("num_stages") == triton.Config({}).num_stages:
        del options["num_stages"]  # as a traced launch's config reads
    named = {**dict(zip(kernel.arg_names, arguments)), **keywords}
    # Empty tensors all sit at address 0: none of them tells an input.
    addresses = {t.untyped_storage().data_ptr() for t in inputs if t.numel()}
    return {"kernel": kernel.fn.__name__, "grid": list(grid), "options": options,
            "arguments": {name: _describe(value) for name, value in named.items()},
            "inputs": sorted(name for name, value in named.items()
                             if isinstance(value, torch.Tensor) and value.numel()
                             and value.untyped_storage().data_ptr() in addresses)}


def _graph_of(function: Any, inputs: list[Any], fake: FakeTensorMode) -> torch.fx.GraphModule:
    with fake:
        return make_fx(dispatch_functionalize(function), tracing_mode="real")(*inputs)


def _summary(graph: torch.fx.GraphModule) -> tuple[list[dict[str, Any]], list[str]]:
    """The graph's kernel launches, and the opforge operators it calls (an operator that
    writes into its inputs is called through ``auto_functionalized``)."""
    nodes = [n for n in graph.graph.nodes if n.op == "call_function"]
    called = {str(target) for n in nodes for target in (n.target, *n.args[:1])}
    return ([_traced_launch(n) for n in nodes if WRAPPER in str(n.target)],
            sorted(name for name in called if "opforge" in name))


# Why the traces of the current sample fell back to the opaque operator.
refusals: list[str] = []


def _recording_refusals(traced: Any) -> Any:
    """`Plan.traced` that notes the exception a fallback swallows."""
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return traced(self, *args, **kwargs)
        except Exception as error:
            refusals.append(f"{self.op.name}: {type(error).__name__}: {error}")
            raise
    return run


def _traced_case(op: opforge.OpDef, case: Any) -> dict[str, Any]:
    """One sample: its traced launches and opaque operators, and its eager launches."""
    attrs = [case.attrs.get(attr.name, attr.default) for attr in op.attrs]
    fake = FakeTensorMode()

    def on_cuda(tensor: Any) -> Any:
        if not isinstance(tensor, torch.Tensor):
            return tensor
        with fake:
            return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype,
                                       device="cuda")

    planned = opforge.plan(op, *case.inputs, **case.attrs)
    result: dict[str, Any] = {
        "case": case.name, "backend": planned.backend,
        "empty": not any(spec.numel for spec in planned.outputs),
        # The views torch makes of an empty tensor (strides of its empty dims) differ
        # between fake and real tensors: their launches are compared but for arguments.
        "empty_input": any(isinstance(t, torch.Tensor) and not t.numel()
                           for t in case.inputs)}
    refusals.clear()
    forward = _graph_of(lambda *ts: op(*ts, *attrs), [on_cuda(t) for t in case.inputs], fake)
    result["traced"], result["opaque"] = _summary(forward)
    result["refusal"] = "; ".join(refusals)
    result["eager"] = []
    if planned.backend == "triton" and not op.mutated_inputs:
        inputs = [t for t in case.inputs if isinstance(t, torch.Tensor)]
        outputs = [torch.empty(s.shape, dtype=s.dtype) for s in planned.outputs]
        scratch = (torch.empty(planned.workspace_bytes, dtype=torch.uint8)
                   if planned.workspace_bytes else None)
        recorded, _ = launches._recorded(planned.op.launchers["triton"],
                                         (planned, case.inputs, outputs, scratch))
        result["eager"] = [_eager_launch(*launch, inputs) for launch in recorded]
    return result


def trace(op: opforge.OpDef) -> dict[str, Any]:
    """Every float32 sample of ``op`` (float32: no tensor descriptors, whose alignment test
    keeps a call opaque; see `Plan.traced`)."""
    cases = op.samples(torch.float32, torch.device("cpu"), torch.Generator().manual_seed(0))
    return {"op": op.name, "cases": [_traced_case(op, case) for case in cases]}


def main() -> None:
    """Every operator traced with ``OPFORGE_TRACE_COMPILED=1``; with ``--default OP ...``
    those operators as the environment has it (unset: the default)."""
    named = sys.argv[2:] if sys.argv[1:2] == ["--default"] else None
    if named is None:
        os.environ[TRACE_VARIABLE] = "1"
    logging.getLogger("torch._higher_order_ops.triton_kernel_wrap").setLevel(logging.ERROR)
    driver.set_active(_Driver(GPUTarget("cuda", 90, 32)))
    with mock.patch.object(backends, "_triton_refusal", lambda device: None), \
            mock.patch.object(Plan, "traced", _recording_refusals(Plan.traced)), \
            mock.patch.object(torch.cuda, "get_device_capability", lambda *a: (9, 0)), \
            backends.use_backend("triton"), use_hardware("h200"):
        for op in opforge.list_ops() if named is None else map(opforge.get_op, named):
            try:
                print(json.dumps(trace(op)), flush=True)
            except Exception as error:  # reported, and the test names it
                print(json.dumps({"op": op.name, "error": f"{type(error).__name__}: {error}"}),
                      flush=True)


if __name__ == "__main__":
    main()
