"""The cost (FLOPs, bytes moved) of torch's own operators, derived from a profile's records.

opforge's operators declare their cost in their `OpDef`; torch's do not, so the profiler
derives it from what ``record_shapes`` keeps: the input shapes and dtypes (and the scalar
arguments, for convolutions). Output shapes are not recorded, so each family of operators
states how its output follows from its inputs:

- matrix products (``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``matmul``, ``linear``):
  ``2 m n k`` FLOPs per product, the output from the operands;
- convolutions (``conv1d/2d/3d``, ``convolution``): ``2 x output elements x C_in/groups x
  kernel elements``, the output size from stride, padding and dilation;
- elementwise operators and the row-wise normalisations: the output has the broadcast shape
  of the tensor inputs; FLOPs are a per-element count;
- reductions: they read their input once; the (smaller) output is not counted;
- losses (``cross_entropy_loss``, ``nll_loss``): a scalar output, or one per target element
  with ``reduction="none"``;
- views and allocations move no data: zero cost (a ``view``'s output is the size it asks
  for); ``constant_pad_nd`` reads its input and writes the padded tensor;
- operators that may or may not copy (``to``, ``contiguous``, ``reshape``, ``flatten``,
  ``type_as``, ``clone``, ``_to_copy``) and convolutions whose padding is a string
  (``"same"``, ``"valid"``: the profiler does not record it) are `composite`: their cost is
  that of the operators they call (an ``aten::copy_``, a ``convolution`` with the padding
  resolved), which only the call tree knows (`opforge.profiler.timeline`); their output is
  their last callee's.

Bytes are the input bytes plus the output bytes: a kernel reads every input and writes
every output once (the memory roof's assumption). The output's dtype follows torch's
promotion (a 0-dim tensor does not widen a dimensioned one); an operator that overwrites
its first argument (``copy_``, ``fill_``) writes that argument's dtype. Operators outside
these families get no cost (``None``), and the profiler says so rather than guessing.
"""

from __future__ import annotations

import ast
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# The profiler writes dtypes as their C++ names.
_DTYPES = {
    "double": torch.float64, "float": torch.float32, "c10::Half": torch.float16,
    "c10::BFloat16": torch.bfloat16, "long int": torch.int64, "int": torch.int32,
    "short int": torch.int16, "signed char": torch.int8, "unsigned char": torch.uint8,
    "bool": torch.bool, "c10::complex<float>": torch.complex64,
    "c10::complex<double>": torch.complex128, "c10::Float8_e4m3fn": torch.float8_e4m3fn,
    "c10::Float8_e5m2": torch.float8_e5m2,
}
TORCH_DTYPE_NAMES = {name: str(dtype).removeprefix("torch.") for name, dtype in _DTYPES.items()}
# A factory's ``dtype`` argument is recorded as its c10::ScalarType code.
_SCALAR_TYPES = {0: torch.uint8, 1: torch.int8, 2: torch.int16, 3: torch.int32,
                 4: torch.int64, 5: torch.float16, 6: torch.float32, 7: torch.float64,
                 9: torch.complex64, 10: torch.complex128, 11: torch.bool,
                 15: torch.bfloat16, 23: torch.float8_e5m2, 24: torch.float8_e4m3fn}

# Views whose second argument is the size of the result (``-1`` for the inferred dim).
_RESHAPING_VIEWS = {"view", "_unsafe_view", "_reshape_alias"}
_VIEWS = {
    "view", "_reshape_alias", "_unsafe_view", "transpose", "t", "permute", "expand",
    "as_strided", "slice", "select", "unsqueeze", "squeeze", "detach", "detach_", "alias",
    "empty", "empty_like", "empty_strided", "resolve_conj", "resolve_neg", "split",
    "split_with_sizes", "chunk", "unbind", "narrow", "view_as", "unflatten", "lift_fresh",
    "set_", "result_type", "numpy_T", "mT", "mH", "matrix_H", "conj", "adjoint", "movedim",
    "moveaxis", "swapaxes", "swapdims",
}
# A view when the layout allows, a copy otherwise; only the operators they call tell.
_MAYBE_COPIES = {"to", "contiguous", "reshape", "flatten", "type_as", "clone", "_to_copy"}
_CONVOLUTIONS = {"conv1d", "conv2d", "conv3d", "convolution", "_convolution",
                 "_convolution_mode"}
# Their padding, the fifth argument, is a string in the ``padding="same"`` overload, and
# the profiler records no value for it.
_PADDED_BY_NAME = {"conv1d", "conv2d", "conv3d", "_convolution_mode"}
# FLOPs per output element of the elementwise and row-wise operators (one for a plain
# arithmetic operator; the transcendental ones are counted as one too, as rooflines do).
_PER_ELEMENT = {
    "add": 1, "add_": 1, "sub": 1, "sub_": 1, "mul": 1, "mul_": 1, "div": 1, "div_": 1,
    "neg": 1, "abs": 1, "pow": 1, "sqrt": 1, "rsqrt": 1, "exp": 1, "exp2": 1, "log": 1,
    "reciprocal": 1, "relu": 1, "relu_": 1, "gelu": 8, "silu": 4, "sigmoid": 4, "tanh": 4,
    "where": 1, "maximum": 1, "minimum": 1, "clamp": 1, "clamp_": 1, "addcmul_": 2,
    "addcdiv_": 2, "lerp_": 2, "sqrt_": 1, "mul_out": 1, "copy_": 0, "fill_": 0, "zero_": 0,
    "zeros_like": 0, "ones_like": 0, "masked_fill": 1,
    "masked_fill_": 1, "softmax": 5, "_softmax": 5, "log_softmax": 5, "_log_softmax": 5,
    "_softmax_backward_data": 4, "_log_softmax_backward_data": 4, "layer_norm": 8,
    "native_layer_norm": 8, "native_layer_norm_backward": 12, "rms_norm": 5,
    "_fused_rms_norm": 5, "gelu_backward": 10, "silu_backward": 6, "sigmoid_backward": 3,
    "tanh_backward": 3, "threshold_backward": 1, "dropout": 2, "native_dropout": 2,
    "normal_": 0, "uniform_": 0, "bernoulli_": 0, "random_": 0, "exponential_": 0,
}
_OVERWRITES = {"copy_", "fill_", "zero_", "normal_", "uniform_", "bernoulli_", "random_",
               "exponential_"}
# Factories write a tensor whose size is their first list argument; their dtype argument
# comes this many places after it.
_FACTORIES = {"randn": 1, "rand": 1, "zeros": 1, "ones": 1, "full": 2, "randint": 1,
              "empty_permuted": 2}
_REDUCTIONS = {"sum", "mean", "amax", "amin", "max", "min", "norm", "linalg_vector_norm",
               "var", "std", "var_mean", "argmax", "argmin", "logsumexp", "prod", "all", "any"}
# Losses: (FLOPs per element, the argument whose elements count: 0 the input, 1 the
# target). Their reduction argument (0 none, 1 mean, 2 sum) is the fourth.
_LOSSES = {"cross_entropy_loss": (6, 0), "nll_loss": (1, 1), "nll_loss_nd": (1, 1),
           "nll_loss_forward": (1, 1), "nll_loss2d_forward": (1, 1)}


@dataclass(frozen=True)
class OpCost:
    """FLOPs and bytes of one call, and the output shapes they imply (``()`` unknown)."""

    flops: float
    bytes_moved: float
    output_shapes: tuple[tuple[int, ...], ...] = ()


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def _broadcast(shapes: Sequence[Sequence[int]]) -> tuple[int, ...]:
    rank = max((len(s) for s in shapes), default=0)
    out = [1] * rank
    for shape in shapes:
        for i, size in enumerate(shape, start=rank - len(shape)):
            out[i] = max(out[i], size)
    return tuple(out)


def _matmul_output(a: Sequence[int], b: Sequence[int]) -> tuple[tuple[int, ...], int]:
    """(output shape, k) of torch.matmul's broadcasting product."""
    a2 = [1, *a] if len(a) == 1 else list(a)
    b2 = [*b, 1] if len(b) == 1 else list(b)
    batch = _broadcast([a2[:-2], b2[:-2]])
    shape = [*batch, a2[-2], b2[-1]]
    if len(a) == 1:
        shape.pop(-2)
    if len(b) == 1:
        shape.pop(-1)
    return tuple(shape), a2[-1]


def _scalars(concrete: Sequence[str], index: int, rank: int, default: int) -> list[int]:
    try:
        value = ast.literal_eval(concrete[index]) if concrete[index] else default
    except (IndexError, ValueError, SyntaxError):
        value = default
    values = list(value) if isinstance(value, list | tuple) else [value]
    return values * rank if len(values) == 1 else values


def _fill_type(text: str) -> torch.dtype:
    """The dtype ``torch.full`` infers from a recorded fill value."""
    if text in ("True", "False"):
        return torch.bool
    try:
        int(text)
    except ValueError:
        return torch.complex64 if "j" in text else torch.float32
    return torch.int64


def _scalar_type(text: str) -> torch.dtype | None:
    try:
        return _SCALAR_TYPES.get(int(text))
    except ValueError:
        return None


def _promoted(tensors: Sequence[tuple[Sequence[int], torch.dtype]]) -> torch.dtype:
    """torch's result dtype of an operator on ``tensors``: a 0-dim tensor widens the
    result only when it is of a higher category (float over integer), as in
    ``x_bf16 * torch.tensor(2.0)`` (bfloat16)."""
    dimensioned = [dtype for dims, dtype in tensors if len(dims)]
    zero_dim = [dtype for dims, dtype in tensors if not len(dims)]
    if not dimensioned or not zero_dim:
        return functools.reduce(torch.promote_types, dimensioned or zero_dim)
    return torch.result_type(
        torch.empty(1, dtype=functools.reduce(torch.promote_types, dimensioned),
                    device="meta"),
        torch.empty((), dtype=functools.reduce(torch.promote_types, zero_dim),
                    device="meta"))


def composite(name: str, types: Sequence[str]) -> bool:
    """Whether the cost of a call of ``name`` is the summed cost of the operators it calls:
    an operator that copies only for some layouts or dtypes (``aten::to``, ``contiguous``,
    ``reshape``, ...: a view, or an ``aten::copy_``), or a convolution whose padding is a
    string (not recorded; the ``convolution`` it calls has it resolved)."""
    short = name.split("::", 1)[-1]
    if short in _MAYBE_COPIES:
        return True
    return short in _PADDED_BY_NAME and len(types) > 4 and types[4] == ""


def _conv(name: str, dims: Sequence[Sequence[int]], concrete: Sequence[str]
          ) -> tuple[float, tuple[int, ...]] | None:
    """(FLOPs, output shape) of a forward convolution, or None for a transposed one."""
    x, w = dims[0], dims[1]
    spatial = len(w) - 2
    if spatial < 1 or len(x) != spatial + 2:
        return None
    if name == "convolution" or name == "_convolution":
        if len(concrete) > 6 and concrete[6] == "True":
            return None
        groups = _scalars(concrete, 8, 1, 1)[0]
    else:
        groups = _scalars(concrete, 6, 1, 1)[0]
    stride = _scalars(concrete, 3, spatial, 1)
    padding = _scalars(concrete, 4, spatial, 0)
    dilation = _scalars(concrete, 5, spatial, 1)
    out_spatial = [(size + 2 * pad - dil * (k - 1) - 1) // st + 1
                   for size, k, st, pad, dil in zip(x[2:], w[2:], stride, padding, dilation)]
    out = (x[0], w[0], *out_spatial)
    flops = 2.0 * _numel(out) * (x[1] // max(groups, 1)) * _numel(w[2:])
    return flops, out


def aten_cost(name: str, dims: Sequence[Sequence[int]], types: Sequence[str],
              concrete: Sequence[str] = ()) -> OpCost | None:
    """The cost of one call of a torch operator from its recorded inputs.

    Args:
        name: the operator as the profiler names it (``"aten::mm"``).
        dims: the recorded shape of each argument (``[]`` for scalars and ``None``).
        types: the recorded dtype of each argument (``"float"``, ``"c10::BFloat16"``,
            ``"Scalar"``, ``""``).
        concrete: the recorded values of scalar arguments (strides of a convolution).

    Returns:
        The cost, or ``None`` when the operator is outside the families this module knows,
        or is `composite` (its cost is its callees').
    """
    short = name.split("::", 1)[-1]
    if composite(name, types):
        return None
    tensors = [(list(d), _DTYPES[t]) for d, t in zip(dims, types) if t in _DTYPES]
    read = float(sum(_numel(d) * dtype.itemsize for d, dtype in tensors))
    if short in _RESHAPING_VIEWS and len(concrete) > 1 and len(dims) and dims[0]:
        # A view moves nothing; its shape is the size asked for, -1 resolved.
        size = _scalars(concrete, 1, 1, 0)
        known = (_numel(d for d in size if d != -1)
                 if all(isinstance(d, int) for d in size) else 0)
        if known:
            shape = tuple(_numel(dims[0]) // known if d == -1 else d for d in size)
            return OpCost(0.0, 0.0, (shape,))
    if short in _VIEWS:
        return OpCost(0.0, 0.0)
    if short in _FACTORIES:
        lists = [i for i, text in enumerate(concrete) if text.startswith("[")]
        if not lists:
            return None
        size = _scalars(concrete, lists[0], 1, 0)
        if not all(isinstance(d, int) for d in size):
            return None
        place = lists[0] + _FACTORIES[short]
        dtype = _scalar_type(concrete[place]) if place < len(concrete) else None
        # Without a dtype argument: torch's default float32 (randint: int64), and full's
        # follows its fill value (7: int64, True: bool).
        if dtype is None and short == "full" and lists[0] + 1 < len(concrete):
            dtype = _fill_type(concrete[lists[0] + 1])
        dtype = dtype or (torch.int64 if short == "randint" else torch.float32)
        return OpCost(0.0, float(dtype.itemsize * _numel(size)), (tuple(size),))
    if not tensors:
        return None
    itemsize = _promoted(tensors).itemsize
    shapes = [d for d, _ in tensors]
    if short in ("mm", "bmm", "matmul", "addmm", "baddbmm", "addbmm", "linear"):
        operands = shapes[-2:] if short in ("addmm", "baddbmm", "addbmm") else shapes[:2]
        if len(operands) < 2 or min(len(s) for s in operands) < 1:
            return None
        a, b = operands
        if short == "linear":
            out, k = (*a[:-1], b[0]), a[-1]
        else:
            out, k = _matmul_output(a, b)
        flops = 2.0 * _numel(out) * k
        return OpCost(flops, read + _numel(out) * itemsize, (tuple(out),))
    if short in _CONVOLUTIONS:
        conv = _conv(short, shapes, concrete) if len(shapes) >= 2 else None
        if conv is None:
            return None
        flops, out = conv
        return OpCost(flops, read + _numel(out) * itemsize, (out,))
    if short in _REDUCTIONS:
        return OpCost(float(_numel(shapes[0])), read)
    if short == "constant_pad_nd":
        # pad lists (before, after) pairs from the last dim backwards; negative ones crop.
        pads = _scalars(concrete, 1, 1, 0) if len(concrete) > 1 else []
        out = list(shapes[0])
        for index, (before, after) in enumerate(zip(pads[::2], pads[1::2])):
            out[-1 - index] += before + after
        return OpCost(0.0, read + _numel(out) * itemsize, (tuple(out),))
    if short in _LOSSES and len(shapes) >= 2:
        per_element, counted = _LOSSES[short]
        unreduced = _scalars(concrete, 3, 1, 1)[0] == 0
        out = tuple(shapes[1]) if unreduced else ()
        written = _numel(out) * tensors[0][1].itemsize
        return OpCost(float(per_element * _numel(shapes[counted])), read + written, (out,))
    if short == "embedding" and len(shapes) >= 2:
        table, index = shapes[0], shapes[1]
        out = (*index, table[-1])
        written = _numel(out) * tensors[0][1].itemsize
        return OpCost(0.0, 2.0 * written + _numel(index) * tensors[1][1].itemsize, (out,))
    if short in _PER_ELEMENT:
        out = _broadcast(shapes)
        if short in _OVERWRITES:
            # The destination is written in its own dtype, never read.
            itemsize = tensors[0][1].itemsize
            read -= _numel(shapes[0]) * itemsize
        written = _numel(out) * itemsize
        return OpCost(float(_PER_ELEMENT[short] * _numel(out)), read + written, (out,))
    return None
