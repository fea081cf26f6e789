"""Every operator against its float64 golden, on both backends, in fp32/fp16/bf16, with odd,
zero-size and non-contiguous shapes, NaN-poisoned outputs and property tests."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import opforge
from opforge.core.opdef import Case
from opforge.precision.metrics import compare_tensors

from .conftest import DEVICE, LOW_PRECISION, assert_golden

try:
    import triton
    import triton.language as tl

    from opforge.ops._math import rounded_for, widen

    @triton.jit
    def _convert(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        tl.store(out_ptr + offsets, rounded_for(widen(tl.load(x_ptr + offsets, mask=mask)),
                                                out_ptr), mask=mask)
except ImportError:  # pragma: no cover
    triton = None

OPS = [op.name for op in opforge.list_ops()]
ODD_SIZES = (1, 7, 63, 1000, 4097)


def _generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
@pytest.mark.parametrize("name", OPS)
def test_samples_match_golden(name, dtype, backend):
    """Each operator's verification samples (odd sizes, extremes, broadcasting, transposed
    and zero-size inputs) are within the dtype's error bound of the float64 golden."""
    op = opforge.get_op(name)
    for case in op.samples(dtype, DEVICE, _generator()):
        result = opforge.plan(op, *case.inputs, **case.attrs)
        assert result.backend == (backend if not any(
            t is not None and t.dtype == torch.float64 for t in case.inputs) else "torch")
        # Mutated inputs (caches) are part of the result; the golden starts from the
        # untouched originals.
        inputs = [t.clone() if i in op.mutated_inputs else t
                  for i, t in enumerate(case.inputs)]
        outputs = result.run(*inputs)
        outputs = (*(outputs if isinstance(outputs, tuple) else (outputs,)),
                   *(inputs[i] for i in op.mutated_inputs))
        assert_golden(op, case, outputs)


@pytest.mark.parametrize("size", ODD_SIZES)
def test_odd_sizes_through_functional_api(size, backend):
    generator = _generator(size)
    a = torch.randn(3, size, generator=generator).to(DEVICE)
    b = torch.randn(size, generator=generator).to(DEVICE)
    for name, call, inputs, attrs in [
        ("broadcast_add", lambda: opforge.broadcast_add(a, b, 0.5), (a, b), {"alpha": 0.5}),
        ("sigmoid", lambda: opforge.sigmoid(a), (a,), {}),
        ("gelu", lambda: opforge.gelu(a, "tanh"), (a,), {"approximate": "tanh"}),
        ("reduce_sum", lambda: opforge.reduce_sum(a, 0), (a,), {"dims": (0,)}),
    ]:
        assert_golden(opforge.get_op(name), Case(f"size{size}", inputs, attrs), call())


def test_plan_done_when_example():
    plan = opforge.plan("broadcast_add", torch.ones(3, 1), torch.ones(4))
    assert [(tuple(s.shape), s.dtype) for s in plan.outputs] == [((3, 4), torch.float32)]
    assert torch.equal(plan.run(torch.ones(3, 1), torch.ones(4)),
                       torch.ones(3, 1) + torch.ones(4))


@pytest.mark.parametrize("view", ["transpose", "step_slice", "expanded", "offset"])
def test_non_contiguous_inputs(view, backend):
    base = torch.randn(64, 48, generator=_generator(1)).to(DEVICE)
    x = {"transpose": base.t(), "step_slice": base[::3, 1::2],
         "expanded": base[:1].expand(5, 48), "offset": base[7:, 5:]}[view]
    assert not x.is_contiguous()
    bias = torch.randn(x.shape[-1], generator=_generator(2)).to(DEVICE)[None, :]
    for name, inputs, attrs in [("broadcast_add", (x, bias), {"alpha": -1.5}),
                                ("gelu", (x,), {}), ("sigmoid", (x,), {}),
                                ("reduce_sum", (x,), {"dims": (0,)}),
                                ("reduce_sum", (x,), {"dims": (1,), "keepdim": True})]:
        op = opforge.get_op(name)
        assert_golden(op, Case(view, inputs, attrs),
                      opforge.plan(op, *inputs, **attrs).run(*inputs))


def test_elementwise_past_eight_uncollapsible_dims(backend):
    """Ten dims whose strides no two neighbours share (a reversed permutation) cannot be
    collapsed into the kernel's eight: the operand is copied contiguous first, for the
    unary operators and their gradients."""
    x = torch.randn(2 ** 10, generator=_generator(3)).to(DEVICE).view((2,) * 10)
    x = x.permute(*reversed(range(10)))
    grad = torch.randn((2,) * 10, generator=_generator(4)).to(DEVICE)
    for name, inputs in (("gelu", (x,)), ("sigmoid", (x,)), ("gelu_backward", (grad, x))):
        op = opforge.get_op(name)
        assert_golden(op, Case("ten_dims", inputs), opforge.plan(op, *inputs).run(*inputs))


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
def test_sigmoid_never_overflows(dtype, backend):
    big = torch.finfo(dtype).max
    x = torch.tensor([big, -big, 1e4, -1e4, 200.0, -200.0, math.inf, -math.inf],
                     dtype=dtype, device=DEVICE)
    y = opforge.sigmoid(x)
    assert torch.isfinite(y).all()
    assert y.tolist()[::2] == [1.0, 1.0, 1.0, 1.0] and y.tolist()[1::2] == [0.0] * 4


def test_sigmoid_keeps_the_float32_subnormal_tail(backend):
    """Below x = -88.7, float32 sigmoid is subnormal, not 0 (torch's float32 sigmoid
    flushes it): both backends round the float64 value."""
    x = torch.tensor([-88.0, -89.0, -95.0, -100.0, -103.0, -104.0], device=DEVICE)
    expected = torch.sigmoid(x.double()).float()
    assert expected[1:5].gt(0).all() and torch.equal(opforge.sigmoid(x), expected)


def test_gelu_reference_equals_torch_where_torch_is_accurate():
    """The golden rewrites gelu with erfc; where torch's float64 1 + erf does not cancel
    (x > -3), both agree to float64 rounding."""
    x = torch.linspace(-3, 8, 4001, dtype=torch.float64)
    op = opforge.get_op("gelu")
    for approximate in ("none", "tanh"):
        ours = op.reference_fn(x, compute_dtype=torch.float64, approximate=approximate)
        theirs = torch.nn.functional.gelu(x, approximate=approximate)
        stats = compare_tensors(ours, theirs, dtype=torch.float64)
        assert stats.max_rel < 1e-13, (approximate, stats)


def test_gelu_left_tail_keeps_relative_accuracy(backend):
    """In float32, 1 + erf(x/sqrt(2)) loses every digit below x = -5; opforge's gelu keeps
    full relative accuracy there."""
    x = torch.linspace(-13, -5, 801, device=DEVICE)
    golden = opforge.get_op("gelu").reference_fn(x.double().cpu(),
                                                  compute_dtype=torch.float64,
                                                  approximate="none")
    def max_relative_error(y: torch.Tensor) -> float:
        return float(((y.double().cpu() - golden).abs() / golden.abs()).max())

    # Triton splits x*x exactly; the torch backend's float32 erfc carries the rounding of
    # x/sqrt(2), amplified by 2 (x/sqrt(2))^2.
    assert max_relative_error(opforge.gelu(x)) < (2e-6 if backend == "triton" else 3e-5)
    assert max_relative_error(torch.nn.functional.gelu(x)) > 0.1


def _every_value(dtype: torch.dtype, low: float, high: float) -> torch.Tensor:
    """Every finite 16-bit value of ``dtype`` in ``[low, high]``."""
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    values = bits.view(dtype)
    return values[values.isfinite() & (values >= low) & (values <= high)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gelu_16bit_results_are_correctly_rounded(dtype, backend):
    """Over every 16-bit input from -14.5 (past erfc's underflow) to 8, the erf form's
    16-bit results, forward and backward, are the float64 golden rounded to nearest, or
    its neighbour where the golden lies within 2e-5 (of the terms' size) of a rounding
    midpoint: the float32 evaluation's error, not the 16-bit rounding."""
    x = _every_value(dtype, -14.5, 8.0).to(DEVICE)
    x64 = x.double().cpu()
    cdf = 0.5 * torch.special.erfc(-x64 / math.sqrt(2))
    pdf = torch.exp(-0.5 * x64 * x64) / math.sqrt(2 * math.pi)
    for name, ours, golden, size in (
            ("gelu", opforge.gelu(x), x64 * cdf, (x64 * cdf).abs()),
            ("gelu_backward", opforge.get_op("gelu_backward")(torch.ones_like(x), x, "none"),
             cdf + x64 * pdf,
             cdf + (x64 * pdf).abs())):
        assert ours.dtype == dtype
        error = (ours.cpu().double() - golden).abs()
        rounded = (golden.to(dtype).double() - golden).abs()
        excess = error - rounded
        worst = int(excess.argmax())
        assert (excess <= 2e-5 * size).all(), (name, float(x64[worst]),
                                               float(excess[worst] / size[worst]))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_special_values_follow_torch(approximate, backend):
    x = torch.tensor([math.inf, -math.inf, math.nan, 0.0, -0.0], device=DEVICE)
    ours = opforge.gelu(x, approximate)
    theirs = torch.nn.functional.gelu(x.double().cpu(), approximate=approximate)
    assert torch.equal(torch.isnan(ours.cpu()), torch.isnan(theirs))
    assert ours[0].item() == math.inf and ours[3].item() == 0.0


def test_reduce_sum_split_path_uses_workspace():
    x = torch.randn(4097, 3, generator=_generator(3)).to(DEVICE)
    with opforge.use_backend("triton"):
        plan = opforge.plan("reduce_sum", x, dims=(0,), scale=0.5)
        assert plan.tiling.variant == "split_k" and plan.grid[1] > 1
        assert plan.workspace_bytes == 4 * plan.grid[1] * 3
        assert_golden(plan.op, Case("split", (x,), {"dims": (0,), "scale": 0.5}), plan.run(x))


def test_reduce_sum_semantics_of_dims(backend):
    x = torch.randn(2, 3, 4, generator=_generator(4)).to(DEVICE)
    assert opforge.reduce_sum(x).shape == ()
    assert opforge.reduce_sum(x, (), scale=2.0).shape == (2, 3, 4)
    assert opforge.reduce_sum(x, (0, 2), keepdim=True).shape == (1, 3, 1)
    assert opforge.reduce_sum(x, -1).shape == (2, 3)
    scalar = torch.tensor(2.5, device=DEVICE)
    assert opforge.reduce_sum(scalar).item() == 2.5
    for dims in (0, -1, [0]):  # a 0-d tensor's dim 0, as torch.sum allows
        assert opforge.reduce_sum(scalar, dims).item() == 2.5
        leaf = scalar.clone().requires_grad_()
        (grad,) = torch.autograd.grad(opforge.reduce_sum(leaf, dims, False, 3.0), leaf)
        assert grad.shape == () and grad.item() == 3.0


# ---------------------------------------------------------------------------------------------
# Property tests

dims_strategy = st.integers(min_value=1, max_value=6)


@st.composite
def broadcast_pairs(draw):
    rank = draw(st.integers(min_value=0, max_value=5))
    out = [draw(dims_strategy) for _ in range(rank)]
    def operand():
        keep = draw(st.integers(min_value=0, max_value=rank))
        return tuple(1 if draw(st.booleans()) else d for d in out[rank - keep:])
    return operand(), operand()


@given(shapes=broadcast_pairs(), alpha=st.floats(-4, 4, allow_nan=False),
       dtype=st.sampled_from(LOW_PRECISION), backend=st.sampled_from(("torch", "triton")))
def test_broadcast_add_property(shapes, alpha, dtype, backend):
    a_shape, b_shape = shapes
    generator = _generator(len(a_shape) * 7 + len(b_shape))
    a = torch.randn(a_shape, generator=generator).to(DEVICE, dtype)
    b = torch.randn(b_shape, generator=generator).to(DEVICE, dtype)
    with opforge.use_backend(backend):
        out = opforge.broadcast_add(a, b, alpha)
    assert out.shape == torch.broadcast_shapes(a_shape, b_shape)
    assert_golden(opforge.get_op("broadcast_add"), Case("prop", (a, b), {"alpha": alpha}), out)


FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@pytest.mark.parametrize("a_shape, b_shape", [((3, 5), ()), ((), (4,)), ((), ()), ((2, 1), (1,))])
def test_broadcast_add_takes_torch_add_s_dtype(a_shape, b_shape, backend):
    """The result dtype is torch.add's for every pair of float dtypes, 0-d operands
    included (a 0-d float32 beside an fp16 tensor does not widen it), with the gradient
    of each operand in that operand's dtype."""
    generator = torch.Generator().manual_seed(11)
    for a_dtype in FLOATS:
        for b_dtype in FLOATS:
            a = torch.randn(a_shape, generator=generator).to(DEVICE, a_dtype).requires_grad_()
            b = torch.randn(b_shape, generator=generator).to(DEVICE, b_dtype).requires_grad_()
            out = opforge.broadcast_add(a, b, 0.5)
            assert out.dtype == torch.add(a.detach(), b.detach()).dtype, (a_dtype, b_dtype)
            golden = a.detach().double() + 0.5 * b.detach().double()
            scale = a.detach().double().abs() + 0.5 * b.detach().double().abs()
            assert ((out.double() - golden).abs() <= torch.finfo(out.dtype).eps * scale).all()
            grad_a, grad_b = torch.autograd.grad(out.sum(), (a, b))
            assert (grad_a.dtype, grad_b.dtype) == (a_dtype, b_dtype)


@given(a_shape=st.lists(st.integers(2, 5), min_size=1, max_size=4),
       b_dim=st.integers(6, 9))
def test_non_broadcastable_shapes_raise(a_shape, b_dim):
    a = torch.ones(a_shape)
    b = torch.ones(b_dim)
    with pytest.raises(opforge.ShapeError) as error:
        opforge.broadcast_add(a, b)
    assert str(tuple(a_shape)) in str(error.value) and f"({b_dim},)" in str(error.value)


@given(shape=st.lists(st.integers(1, 9), min_size=1, max_size=4), data=st.data(),
       keepdim=st.booleans(), backend=st.sampled_from(("torch", "triton")))
def test_reduce_sum_property(shape, data, keepdim, backend):
    dims = data.draw(st.lists(st.integers(-len(shape), len(shape) - 1), unique_by=lambda d:
                              d % len(shape), max_size=len(shape)))
    x = torch.randn(shape, generator=_generator(len(shape))).to(DEVICE)
    with opforge.use_backend(backend):
        out = opforge.reduce_sum(x, dims, keepdim)
    attrs = {"dims": tuple(dims), "keepdim": keepdim}
    assert_golden(opforge.get_op("reduce_sum"), Case("prop", (x,), attrs), out)


@given(scale=st.floats(0.01, 100), size=st.integers(0, 300),
       approximate=st.sampled_from(("none", "tanh")), dtype=st.sampled_from(LOW_PRECISION),
       backend=st.sampled_from(("torch", "triton")))
def test_unary_property(scale, size, approximate, dtype, backend):
    x = (torch.randn(size, generator=_generator(size)) * scale).to(DEVICE, dtype)
    with opforge.use_backend(backend):
        y_gelu, y_sigmoid = opforge.gelu(x, approximate), opforge.sigmoid(x)
    assert_golden(opforge.get_op("gelu"), Case("prop", (x,), {"approximate": approximate}),
                  y_gelu)
    assert_golden(opforge.get_op("sigmoid"), Case("prop", (x,)), y_sigmoid)


def test_poisoned_outputs_expose_unwritten_elements(replace_launcher):
    """A launcher that forgets half its output must fail the golden check: outputs start as
    NaN, so the unwritten half mismatches."""
    op = opforge.get_op("sigmoid")
    original = op.launchers["triton"]

    def half_launcher(plan, inputs, outputs, workspace):
        half = outputs[0].numel() // 2
        original(plan, [inputs[0].reshape(-1)[:half]], [outputs[0].reshape(-1)[:half]],
                 workspace)

    replace_launcher(op, "triton", half_launcher)
    x = torch.randn(1000, generator=_generator(9)).to(DEVICE)
    with opforge.use_backend("triton"):
        plan = opforge.plan(op, x)
    with pytest.raises(AssertionError, match="NaN/Inf mismatches"):
        assert_golden(op, Case("half", (x,)), plan.run(x))



def test_bfloat16_conversions_are_exact_in_every_range():
    """Kernels convert through `widen` / `rounded_for`: round-to-nearest-even as torch does,
    subnormals, overflow to Inf and NaN included (the interpreter's own casts truncate and
    mangle subnormals)."""
    if triton is None:
        pytest.skip("triton is not installed")
    generator = torch.Generator().manual_seed(0)
    exponents = torch.randint(-149, 128, (20000,), generator=generator).float()
    x = torch.randn(20000, generator=generator) * torch.exp2(exponents)
    x[:7] = torch.tensor([float("nan"), float("inf"), float("-inf"), 3.3961e38, -0.0,
                          1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8])   # ties go to the even neighbour
    for source, target in ((torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                           (torch.float32, torch.float16), (torch.float16, torch.float32)):
        given = x.to(source)
        out = torch.empty(x.shape, dtype=target)
        _convert[(triton.cdiv(x.numel(), 4096),)](given, out, x.numel(), BLOCK=4096)
        expected = given.to(target)
        assert torch.equal(out.isnan(), expected.isnan())
        assert torch.equal(out.nan_to_num(), expected.nan_to_num()), (source, target)
        numbers = ~expected.isnan()
        assert torch.equal(out[numbers].signbit(), expected[numbers].signbit())


ROW_SHAPES = st.lists(st.integers(1, 40), min_size=1, max_size=3).map(tuple)


@given(shape=ROW_SHAPES, scale=st.floats(0.01, 100), data=st.data(),
       dtype=st.sampled_from(LOW_PRECISION), backend=st.sampled_from(("torch", "triton")))
def test_row_operators_property(shape, scale, data, dtype, backend):
    """softmax/log_softmax over any dim, layer_norm and rms_norm over the last dim, with and
    without affine parameters, match the golden for any shape and scale."""
    x = (torch.randn(shape, generator=_generator(sum(shape))) * scale).to(DEVICE, dtype)
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    width = shape[-1]
    weight = data.draw(st.sampled_from((None, torch.randn(width, generator=_generator(1)))))
    weight = None if weight is None else weight.to(DEVICE, dtype)
    cases = [("softmax", (x,), {"dim": dim}), ("log_softmax", (x,), {"dim": dim}),
             ("rms_norm", (x, weight), {}), ("layer_norm", (x, weight, weight), {})]
    with opforge.use_backend(backend):
        for name, inputs, attrs in cases:
            op = opforge.get_op(name)
            out = opforge.plan(op, *inputs, **attrs).run(*inputs)
            assert_golden(op, Case("prop", inputs, attrs), out)


@given(m=st.integers(1, 40), k=st.integers(0, 70), n=st.integers(1, 40),
       batch=st.lists(st.integers(1, 3), max_size=2).map(tuple),
       dtype=st.sampled_from(LOW_PRECISION), backend=st.sampled_from(("torch", "triton")))
def test_matmul_property(m, k, n, batch, dtype, backend):
    generator = _generator(m * 100 + k + n)
    a = torch.randn((*batch, m, k), generator=generator).to(DEVICE, dtype)
    b = torch.randn((k, n), generator=generator).to(DEVICE, dtype)
    with opforge.use_backend(backend):
        out = opforge.matmul(a, b)
    assert out.shape == (*batch, m, n)
    assert_golden(opforge.get_op("matmul"), Case("prop", (a, b)), out)


NORMS = {"rms_norm": lambda x, w, b: opforge.rms_norm(x, w),
         "add_rms_norm": lambda x, w, b: opforge.add_rms_norm(x, x.flip(0), w)[0],
         "layer_norm": lambda x, w, b: opforge.layer_norm(x, x.shape[1:], w, b)}
NORM_GOLDEN = {
    "rms_norm": lambda x, w, b: torch.nn.functional.rms_norm(x, x.shape[1:], w, 1e-6),
    "add_rms_norm": lambda x, w, b: torch.nn.functional.rms_norm(x + x.flip(0), x.shape[1:],
                                                                 w, 1e-6),
    "layer_norm": lambda x, w, b: torch.nn.functional.layer_norm(x, x.shape[1:], w, b)}
NORM_INPUTS = {"rms_norm": lambda x: (x, None), "add_rms_norm": lambda x: (x, x, None),
               "layer_norm": lambda x: (x, None, None)}


@pytest.mark.parametrize("name, layout", [(name, layout) for name in NORMS
                                          for layout in ("strided", "expanded")]
                         + [("layer_norm", "two_dims_strided")])
def test_norms_read_strided_parameters(name, layout, backend):
    """Weights and biases that are views (a slice of a packed parameter, a stride-0
    expansion, a strided 2-D normalized shape): forward and gradients against float64
    autograd."""
    generator = _generator(7)
    shape = (5, 2, 12) if layout == "two_dims_strided" else (5, 24)
    if layout == "expanded":
        weight, bias = (torch.randn(1, generator=generator).expand(24) for _ in range(2))
    else:
        packed = torch.randn((*shape[1:-1], 2 * shape[-1]), generator=generator)
        weight, bias = packed[..., ::2], packed[..., 1::2]
    assert not weight.is_contiguous()
    x = torch.randn(shape, generator=generator)
    upstream = torch.randn(shape, generator=generator)
    leaves = [t.to(DEVICE).requires_grad_() for t in (x, weight, bias)]
    got = NORMS[name](*leaves)
    grads = torch.autograd.grad(got, leaves[:2], upstream.to(DEVICE))
    wide = [t.detach().double().requires_grad_() for t in (x, weight, bias)]
    expected = NORM_GOLDEN[name](*wide)
    expected_grads = torch.autograd.grad(expected, wide[:2], upstream.double())
    for mine, exact in zip((got, *grads), (expected, *expected_grads), strict=True):
        assert (mine.detach().cpu().double() - exact).abs().max() <= 1e-5 * exact.abs().max()


@pytest.mark.parametrize("name", NORMS)
def test_norms_of_rows_of_nothing(name, backend):
    """A zero-length normalized dim: empty y, statistics 0 (the reference's), on both
    backends; an empty batch through the module."""
    import opforge.nn

    inputs = NORM_INPUTS[name](torch.randn(3, 0, device=DEVICE))
    outputs = opforge.plan(name, *inputs).run(*inputs)
    assert outputs[0].shape == (3, 0)
    for statistic in outputs[1:3 if name == "layer_norm" else 2]:
        assert statistic.shape == (3,) and not statistic.any()
    module = opforge.nn.RMSNorm((3, 4)) if name == "rms_norm" else opforge.nn.LayerNorm(4)
    empty = torch.randn(2, 0, 3, 4, device=DEVICE)
    assert module.to(DEVICE)(empty).shape == empty.shape


def test_an_out_that_overlaps_an_input_is_written_through_a_copy(backend):
    """matmul's programs read tiles of a that other programs' output tiles overwrite: an out
    aliasing an input gets a fresh buffer and a copy, and the product is right. An
    elementwise operator (which reads each element before writing it) is right in place
    (out=x)."""
    generator = _generator(8)
    a, b = (torch.randn(160, 160, generator=generator).to(DEVICE) for _ in range(2))
    expected = a.double() @ b.double()
    for target in ("a", "b"):
        inputs = [a.clone(), b.clone()]
        out = inputs[0] if target == "a" else inputs[1]
        result = opforge.plan("matmul", *inputs).run(*inputs, out=out)
        assert result is out
        assert (result.double() - expected).abs().max() < 1e-3
    x = torch.randn(1000, generator=generator).to(DEVICE)
    golden = torch.sigmoid(x.double())
    result = opforge.plan("sigmoid", x).run(x, out=x)
    assert result is x and (result.double() - golden).abs().max() < 1e-6
    # Which outs the kernels write directly: an in-place operator's very input, not one
    # shifted over its inputs (programs running in another order would read overwritten
    # elements), nor any overlap for matmul.
    y = torch.randn(1001, generator=generator).to(DEVICE)
    add = opforge.plan("broadcast_add", y[1:], y[:-1])
    for out, direct in ((y[1:], True), (y[:-1], False), (torch.empty(1000), True)):
        targets, _ = add._outputs(out, [y[1:], y[1:]])
        assert (targets[0] is out) == direct
    targets, _ = opforge.plan("matmul", a, b)._outputs(a, [a, b])
    assert targets[0] is not a


@pytest.mark.parametrize("call, param", [
    (lambda x: opforge.broadcast_add(x, x, alpha=1e300), "alpha"),
    (lambda x: opforge.broadcast_add(x, x, alpha=-1e39), "alpha"),
    (lambda x: opforge.reduce_sum(x, scale=1e300), "scale"),
    (lambda x: opforge.attention(x, x, x, scale=1e39), "scale"),
])
def test_a_scalar_beyond_the_compute_dtype_is_an_attr_error(call, param, backend):
    """Kernels apply alpha and scale in float32: 1e300 would be inf there and inf * 0 NaN
    (torch.add refuses such an alpha too). Float64 inputs compute in float64, where it is
    finite and the result exact."""
    with pytest.raises(opforge.AttrError, match="not finite in float32") as raised:
        call(torch.zeros(1, 1, 2, 4, device=DEVICE))
    assert raised.value.param == param
    wide = torch.ones(3, dtype=torch.float64, device=DEVICE)
    assert torch.equal(opforge.broadcast_add(wide, wide * 0, alpha=1e300), wide)
