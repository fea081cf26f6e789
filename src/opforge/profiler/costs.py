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
- views and allocations move no data: zero cost.

Bytes are the input bytes plus the output bytes: a kernel reads every input and writes
every output once (the memory roof's assumption). Operators outside these families get
no cost (``None``), and the profiler says so rather than guessing.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Sequence
from dataclasses import dataclass

# The profiler writes dtypes as their C++ names.
ITEMSIZE = {
    "double": 8, "float": 4, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "int": 4,
    "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1,
    "c10::complex<float>": 8, "c10::complex<double>": 16,
    "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1,
}
TORCH_DTYPE_NAMES = {
    "double": "float64", "float": "float32", "c10::Half": "float16",
    "c10::BFloat16": "bfloat16", "long int": "int64", "int": "int32", "short int": "int16",
    "signed char": "int8", "unsigned char": "uint8", "bool": "bool",
    "c10::Float8_e4m3fn": "float8_e4m3fn", "c10::Float8_e5m2": "float8_e5m2",
}

_VIEWS = {
    "view", "reshape", "_reshape_alias", "_unsafe_view", "transpose", "t", "permute",
    "expand", "as_strided", "slice", "select", "unsqueeze", "squeeze", "detach", "alias",
    "empty", "empty_like", "empty_strided", "resolve_conj", "resolve_neg", "contiguous",
    "split", "split_with_sizes", "chunk", "unbind", "narrow", "view_as", "flatten",
    "unflatten", "lift_fresh", "set_", "result_type", "to", "type_as", "numpy_T",
}
# FLOPs per output element of the elementwise and row-wise operators (one for a plain
# arithmetic operator; the transcendental ones are counted as one too, as rooflines do).
_PER_ELEMENT = {
    "add": 1, "add_": 1, "sub": 1, "sub_": 1, "mul": 1, "mul_": 1, "div": 1, "div_": 1,
    "neg": 1, "abs": 1, "pow": 1, "sqrt": 1, "rsqrt": 1, "exp": 1, "exp2": 1, "log": 1,
    "reciprocal": 1, "relu": 1, "relu_": 1, "gelu": 8, "silu": 4, "sigmoid": 4, "tanh": 4,
    "where": 1, "maximum": 1, "minimum": 1, "clamp": 1, "clamp_": 1, "addcmul_": 2,
    "addcdiv_": 2, "lerp_": 2, "sqrt_": 1, "mul_out": 1, "copy_": 0, "clone": 0,
    "_to_copy": 0, "fill_": 0, "zero_": 0, "zeros_like": 0, "ones_like": 0, "masked_fill": 1,
    "masked_fill_": 1, "softmax": 5, "_softmax": 5, "log_softmax": 5, "_log_softmax": 5,
    "_softmax_backward_data": 4, "_log_softmax_backward_data": 4, "layer_norm": 8,
    "native_layer_norm": 8, "native_layer_norm_backward": 12, "rms_norm": 5,
    "_fused_rms_norm": 5, "gelu_backward": 10, "silu_backward": 6, "sigmoid_backward": 3,
    "tanh_backward": 3, "threshold_backward": 1, "dropout": 2, "native_dropout": 2,
    "cross_entropy_loss": 6, "nll_loss": 1, "nll_loss_forward": 1, "normal_": 0,
    "uniform_": 0, "bernoulli_": 0, "random_": 0, "exponential_": 0,
}
_OVERWRITES = {"copy_", "fill_", "zero_", "normal_", "uniform_", "bernoulli_", "random_",
               "exponential_"}
# Factories write a tensor whose size is their first (concrete) argument.
_FACTORIES = {"randn", "rand", "zeros", "ones", "full", "randint", "empty_permuted"}
_REDUCTIONS = {"sum", "mean", "amax", "amin", "max", "min", "norm", "linalg_vector_norm",
               "var", "std", "var_mean", "argmax", "argmin", "logsumexp", "prod", "all", "any"}


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
        The cost, or ``None`` when the operator is outside the families this module knows.
    """
    short = name.split("::", 1)[-1]
    tensors = [(list(d), ITEMSIZE[t]) for d, t in zip(dims, types) if t in ITEMSIZE]
    read = float(sum(_numel(d) * size for d, size in tensors))
    if short in _VIEWS:
        return OpCost(0.0, 0.0)
    if short in _FACTORIES:
        size = _scalars(concrete, 0, 1, 0)
        if not size or not all(isinstance(d, int) for d in size):
            return None
        # The dtype is not recorded: float32, torch's default.
        return OpCost(0.0, 4.0 * _numel(size), (tuple(size),))
    if not tensors:
        return None
    # The output takes the promoted dtype: the widest input's (a bool mask does not count).
    itemsize = max(size for _, size in tensors)
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
    if short in ("conv1d", "conv2d", "conv3d", "convolution", "_convolution"):
        conv = _conv(short, shapes, concrete) if len(shapes) >= 2 else None
        if conv is None:
            return None
        flops, out = conv
        return OpCost(flops, read + _numel(out) * itemsize, (out,))
    if short in _REDUCTIONS:
        return OpCost(float(_numel(shapes[0])), read)
    if short == "embedding" and len(shapes) >= 2:
        table, index = shapes[0], shapes[1]
        out = (*index, table[-1])
        written = _numel(out) * tensors[0][1]
        return OpCost(0.0, 2.0 * written + _numel(index) * tensors[1][1], (out,))
    if short in _PER_ELEMENT:
        out = _broadcast(shapes)
        written = _numel(out) * itemsize
        if short in _OVERWRITES:
            # The destination is written, never read.
            read -= _numel(shapes[0]) * tensors[0][1]
        return OpCost(float(_PER_ELEMENT[short] * _numel(out)), read + written, (out,))
    return None
