"""Matmul: torch.matmul's shape rules, float32 accumulation at K = 8192 in float16,
gradients through broadcast and 1-D operands, tf32 only on request, nn.Linear, errors."""

from __future__ import annotations

import pytest
import torch

import opforge
import opforge.nn
from opforge.core.opdef import Case, Tiling
from opforge.profiler.session import kernel_costs

from .conftest import DEVICE, assert_golden, needs_descriptors

MATMUL = opforge.get_op("matmul")
SHAPES = [((5,), (5,)), ((3, 5), (5,)), ((5,), (5, 4)), ((2, 3, 5), (5,)), ((7,), (2, 7, 3)),
          ((2, 1, 3, 5), (4, 5, 6)), ((1, 5), (3, 5, 2)), ((0, 5), (5, 2)), ((3, 0), (0, 2))]


def _x(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(DEVICE, dtype)


@pytest.mark.parametrize("a_shape, b_shape", SHAPES, ids=str)
def test_shapes_follow_torch_matmul(a_shape, b_shape, backend):
    a, b = _x(*a_shape), _x(*b_shape, seed=1)
    out = opforge.matmul(a, b)
    assert out.shape == torch.matmul(a, b).shape
    assert_golden(MATMUL, Case("shape", (a, b)), out)


@pytest.mark.parametrize("layout", ["transposed", "column_step", "batched_transposed"])
def test_strided_operands(layout, backend):
    """Operands are read through their strides, not assumed contiguous: 2-D operands go
    to the kernel as they are (batch stride 0), batched ones as broadcast views."""
    if layout == "transposed":
        a, b = _x(37, 19).mT, _x(23, 37, seed=1).mT
    elif layout == "column_step":
        a, b = _x(19, 74)[:, ::2], _x(37, 46, seed=1)[:, 1::2]
    else:
        a, b = _x(3, 37, 19).mT, _x(23, 37, seed=1).mT
    assert not (a.is_contiguous() or b.is_contiguous())
    assert_golden(MATMUL, Case(layout, (a, b)), opforge.matmul(a, b))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_long_k_accumulates_in_float32(dtype, backend):
    """K = 8192 products summed in the operands' 16-bit dtype would drift by sqrt(K) eps16
    per output (measured below for float16 as a foil: over 20 float16 ulps off). opforge
    accumulates in float32 and rounds once: within 1 eps of the output dtype relative to
    sum |a||b| (max_eps <= 1), and within 1 ulp of the golden for most elements."""
    a, b = _x(16, 8192, dtype=dtype), _x(8192, 16, dtype=dtype, seed=1)
    golden = a.double() @ b.double()
    out = opforge.matmul(a, b)
    assert_golden(MATMUL, Case("k_8192", (a, b)), out)
    if dtype == torch.float16:
        naive = torch.zeros(16, 16, dtype=torch.float16, device=DEVICE)
        for start in range(0, 8192, 512):   # 16-bit running sums, as a 16-bit accumulator
            naive = (naive + (a[:, start:start + 512].float()
                              @ b[start:start + 512].float()).half())
        ulp = torch.finfo(dtype).eps * golden.abs().clamp_min(1.0)
        assert ((naive.double() - golden).abs() / ulp).max() > 2
    ulp = torch.finfo(dtype).eps * golden.abs().clamp_min(torch.finfo(dtype).tiny)
    assert ((out.double() - golden).abs() <= ulp).double().mean() > 0.99
    # No worse than torch.matmul on the same inputs (both errors reported).
    ours_error = (out.double() - golden).abs().max().item()
    torch_error = (torch.matmul(a, b).double() - golden).abs().max().item()
    assert ours_error <= torch_error * 1.01 + 1e-12, (ours_error, torch_error)


@pytest.mark.parametrize("a_shape, b_shape", SHAPES[:7], ids=str)
def test_gradients_match_torch(a_shape, b_shape, backend):
    a = _x(*a_shape).requires_grad_()
    b = _x(*b_shape, seed=1).requires_grad_()
    upstream = _x(*torch.matmul(a, b).shape, seed=2)
    got = torch.autograd.grad(opforge.matmul(a, b), (a, b), upstream)
    wide = [t.detach().double().requires_grad_() for t in (a, b)]
    expected = torch.autograd.grad(torch.matmul(*wide), wide, upstream.double())
    for g, e in zip(got, expected, strict=True):
        assert g.shape == e.shape
        assert (g.double() - e).abs().max() <= 1e-5 * max(e.abs().max(), 1.0)


def test_gradcheck_in_float64():
    a = _x(2, 3, 4).double().requires_grad_()
    b = _x(4, 5, seed=1).double().requires_grad_()
    assert torch.autograd.gradcheck(opforge.matmul, (a, b))


def test_tf32_only_on_request(monkeypatch, fresh_plans):
    """float32 products are IEEE by default; allow_tf32 asks for tf32 (which only a GPU's
    compiled kernel honours)."""
    from opforge.ops import matmul as module

    seen = []
    kernel = module._matmul_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append(kwargs["PRECISION"])
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(module, "_matmul_kernel", Spy())
    a, b = _x(8, 16), _x(16, 8, seed=1)
    with opforge.use_backend("triton"):
        opforge.matmul(a, b)
        opforge.matmul(a, b, allow_tf32=True)
        opforge.matmul(a.half(), b.half(), allow_tf32=True)
    assert seen == ["ieee", "tf32", "ieee"]


def test_tiling_follows_the_problem_and_the_device():
    """On an H200, 128 x 256 tiles with two warpgroups when they give each SM two tiles,
    else 128 x 128 ones; 16-row tiles for a few rows."""
    bf16 = {"dtype": torch.bfloat16, "device": DEVICE}
    a, b = torch.empty(4096, 4096, **bf16), torch.empty(4096, 4096, **bf16)
    rows, weight = torch.empty(1024, 8192, **bf16), torch.empty(8192, 2048, **bf16)
    skinny = torch.empty(4, 4096, **bf16)
    with opforge.use_backend("triton"), opforge.use_hardware("h200"):
        big = opforge.plan(MATMUL, a, b).tiling
        few_tiles = opforge.plan(MATMUL, rows, weight).tiling
        small = opforge.plan(MATMUL, skinny, b).tiling
    assert big.blocks == {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64}
    assert (big.options["warps"], big.options["stages"]) == (8, 3)
    assert few_tiles.blocks == {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}
    assert (few_tiles.options["warps"], few_tiles.options["stages"]) == (8, 4)
    assert small.blocks["BLOCK_M"] == 16
    with opforge.use_backend("triton"), opforge.use_hardware("cpu"):
        assert opforge.plan(MATMUL, a, b).tiling.options["stages"] is None


@pytest.mark.parametrize("splits", [3, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("a_shape, b_shape", [((17, 300), (300, 130)), ((3, 5, 200), (200, 7)),
                                              ((2, 1, 9, 70), (3, 70, 33))], ids=str)
def test_k_slices_sum_to_the_golden(a_shape, b_shape, dtype, splits, monkeypatch):
    """Split K (the skinny-problem tiling of GPUs) forced on the Triton kernels: whole
    BLOCK_K steps per slice, a last slice shorter than the others, more slices asked for
    than K has steps, broadcast batches; the products write float32 partials into the
    poisoned workspace and the second kernel sums them in slice order, so the result is
    the golden's within the usual bound and the same on every run."""
    from opforge.ops import matmul

    monkeypatch.setattr(matmul, "work_splits", lambda *args, **kwargs: splits)
    a, b = _x(*a_shape, dtype=dtype), _x(*b_shape, dtype=dtype, seed=1)
    opforge.clear_caches()
    opforge.set_poison(True)
    try:
        with opforge.use_backend("triton"):
            plan = opforge.plan(MATMUL, a, b)
            outs = [plan.run(a, b) for _ in range(2)]
    finally:
        opforge.set_poison(False)
        opforge.clear_caches()
    k = a_shape[-1]
    steps = -(-k // plan.tiling.blocks["BLOCK_K"])
    assert plan.grid[2] == -(-steps // -(-steps // splits)) > 1
    assert plan.workspace_bytes == 4 * plan.grid[2] * outs[0].numel()
    costs = kernel_costs(plan)  # what the profiler gives each of the two kernels
    assert costs["_matmul_kernel"][0] == plan.cost.flops
    assert costs["_sum_slices_kernel"][1] > 0
    assert torch.equal(outs[0], outs[1])
    assert_golden(MATMUL, Case("k_slices", (a, b)), outs[0])


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("layout", ["transposed", "batch_in_the_middle", "unmergeable_batch"])
def test_strided_out_is_written_through_its_strides(layout, splits, monkeypatch):
    """``out=`` may be a view of another layout (MlaProlog writes its absorbed queries
    into the (T, N, Hckv) output as an (N, T, Hckv) view): the Triton kernels, the K-slice
    sum included, write it through its strides; batch dims whose strides do not merge
    go through a buffer copied back. Outputs start as NaN: every element must be
    written, with the golden's values."""
    from opforge.ops import matmul

    monkeypatch.setattr(matmul, "work_splits", lambda *args, **kwargs: splits)
    if layout == "transposed":
        a, b = _x(13, 300), _x(300, 9, seed=1)
        out = torch.full((9, 13), torch.nan, device=DEVICE).t()
    elif layout == "batch_in_the_middle":
        a, b = _x(5, 13, 300), _x(300, 9, seed=1)
        out = torch.full((13, 5, 9), torch.nan, device=DEVICE).transpose(0, 1)
    else:
        a, b = _x(2, 3, 13, 300), _x(300, 9, seed=1)
        out = torch.full((3, 2, 13, 9), torch.nan, device=DEVICE).transpose(0, 1)
    assert not out.is_contiguous()
    opforge.clear_caches()
    try:
        with opforge.use_backend("triton"):
            plan = opforge.plan(MATMUL, a, b)
            result = plan.run(a, b, out=out)
    finally:
        opforge.clear_caches()
    assert result is out and plan.grid[2] == min(splits, 3)
    assert_golden(MATMUL, Case(layout, (a, b)), out)


@needs_descriptors
@pytest.mark.parametrize("variant", ["tiles_tma", "tiles_tma_ws"])
@pytest.mark.parametrize("a_shape, b_shape, dtype, splits, by_descriptor", [
    ((33, 200), (200, 72), torch.bfloat16, 1, True),
    ((32, 104), (104, 24), torch.float16, 1, True),
    ((17, 100), (100, 20), torch.float32, 1, False),  # descriptors serve 16-bit operands
    ((3, 9, 200), (200, 40), torch.bfloat16, 3, True),  # K slices end inside K
    ((9, 70), (70, 33), torch.bfloat16, 1, False),  # 140-byte rows: not TMA-aligned
], ids=str)
def test_descriptor_variants_match_the_golden(variant, a_shape, b_shape, dtype, splits,
                                              by_descriptor, monkeypatch):
    """The variants that read operand blocks by tensor descriptor (with and without a
    warp-specialized K loop), forced on the Triton kernels with small blocks: the
    descriptors' bounds replace the masks, so rows past M, columns past N and K past its
    end must read 0, and a K slice must stop at its own end. Operands whose rows
    descriptors cannot address take the pointer kernel."""
    from opforge.ops import matmul

    launches = []
    kernel = matmul._matmul_kernel

    class Recorded:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((kwargs["DESCRIPTORS"], kwargs["WARP_SPECIALIZE"]))
                return kernel[grid](*args, **kwargs)
            return launch

    blocks = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32}
    monkeypatch.setattr(MATMUL, "tiling", lambda *args: [Tiling(variant, blocks, 0,
                                                                double_buffered=False)])
    monkeypatch.setattr(matmul, "work_splits", lambda *args, **kwargs: splits)
    monkeypatch.setattr(matmul, "_matmul_kernel", Recorded())
    a, b = _x(*a_shape, dtype=dtype), _x(*b_shape, dtype=dtype, seed=1)
    opforge.clear_caches()
    try:
        with opforge.use_backend("triton"):
            out = opforge.matmul(a, b)
    finally:
        opforge.clear_caches()
    assert launches == [(by_descriptor, by_descriptor and variant.endswith("ws"))]
    assert_golden(MATMUL, Case(variant, (a, b)), out)


def test_out_that_shares_memory_is_refused_and_odd_layouts_are_copied(monkeypatch):
    """An expanded ``out`` (stride 0: every element one address) is refused with a typed
    error before any kernel runs; a layout whose elements are distinct but interleaved
    (strides (3, 2) for a 2 x 2 result), which the launcher's stride test cannot vouch
    for, is filled through a contiguous buffer and a copy."""
    from opforge.ops import matmul

    launched = []
    kernel = matmul._matmul_kernel

    class Recorded:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append(args[2])
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(matmul, "_matmul_kernel", Recorded())
    a, b = _x(2, 5), _x(5, 2, seed=1)
    with opforge.use_backend("triton"):
        plan = opforge.plan(MATMUL, a, b)
        with pytest.raises(opforge.OpError, match="share memory") as raised:
            plan.run(a, b, out=torch.zeros(1, device=DEVICE).expand(2, 2))
        assert raised.value.param == "out" and not launched
        storage = torch.full((6,), torch.nan, device=DEVICE)
        odd = storage.as_strided((2, 2), (3, 2))
        plan.run(a, b, out=odd)
    assert launched[0] is not odd  # a contiguous buffer, copied into odd
    assert_golden(MATMUL, Case("interleaved_out", (a, b)), odd)


def test_skinny_products_on_a_gpu_profile_split_k():
    """A decode step's down-projection (16 tokens, K 7168, N 1536) has 12 output tiles
    for an H200's 132 cores: the grid cuts K into slices for up to two programs a core
    (whole BLOCK_K steps, at least 4 a slice, so every core gets one), and sizes the
    workspace for their float32 partials. A square product that fills the cores, and any
    product on the CPU, is not split."""
    x = _x(16, 7168, dtype=torch.bfloat16)
    w = _x(7168, 1536, dtype=torch.bfloat16, seed=1)
    square = _x(4096, 4096, dtype=torch.bfloat16)
    with opforge.use_backend("triton"), opforge.use_hardware("h200"):
        skinny = opforge.plan(MATMUL, x, w)
        big = opforge.plan(MATMUL, square, square)
    tiles = skinny.grid[0] * skinny.grid[1]
    assert tiles == 12 and 132 <= tiles * skinny.grid[2] <= 2 * 132 + tiles
    assert 7168 // skinny.grid[2] >= 4 * skinny.tiling.blocks["BLOCK_K"]
    assert skinny.workspace_bytes == 4 * skinny.grid[2] * 16 * 1536
    assert big.grid[2] == 1 and big.workspace_bytes == 0
    with opforge.use_backend("triton"), opforge.use_hardware("cpu"):
        assert opforge.plan(MATMUL, x, w).grid[2] == 1


def test_linear_is_a_drop_in_for_torch():
    torch.manual_seed(0)
    ours, theirs = opforge.nn.Linear(12, 5).to(DEVICE), torch.nn.Linear(12, 5).to(DEVICE)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    assert ours.extra_repr() == theirs.extra_repr()
    ours.load_state_dict(theirs.state_dict())
    x = _x(3, 4, 12)
    assert torch.allclose(ours(x), theirs(x), rtol=1e-5, atol=1e-6)
    (ours(x).sum()).backward()
    (theirs(x).sum()).backward()
    assert torch.allclose(ours.weight.grad, theirs.weight.grad, rtol=1e-5, atol=1e-5)
    assert torch.allclose(ours.bias.grad, theirs.bias.grad, rtol=1e-5, atol=1e-5)
    assert opforge.nn.Linear(3, 2, bias=False).bias is None


def test_errors_come_before_any_kernel():
    with pytest.raises(opforge.ShapeError, match="inner"):
        opforge.matmul(_x(3, 4), _x(5, 2))
    with pytest.raises(opforge.ShapeError):
        opforge.matmul(torch.tensor(1.0, device=DEVICE), _x(3))
    with pytest.raises(opforge.ShapeError):
        opforge.matmul(_x(2, 3, 4), _x(3, 4, 5))
    with pytest.raises(opforge.DtypeError, match="dtype"):
        opforge.matmul(_x(3, 4), _x(4, 2, dtype=torch.float16))
    with pytest.raises(opforge.DtypeError, match="float32_out"):
        opforge.matmul(_x(3, 4, dtype=torch.float64), _x(4, 2, dtype=torch.float64),
                       float32_out=True)


def test_float32_out_is_the_unrounded_accumulator_and_differentiable(backend):
    """bfloat16 operands with float32_out: a float32 result within float32's rounding of
    the float64 product (the bfloat16 result is 2^-9 away), and gradients in bfloat16
    equal to those of the bfloat16 product (the float32 gradient rounded once)."""
    a = _x(33, 300, dtype=torch.bfloat16).requires_grad_()
    b = _x(300, 17, dtype=torch.bfloat16).requires_grad_()
    wide = opforge.matmul(a, b, float32_out=True)
    exact = a.double() @ b.double()
    scale = a.double().abs() @ b.double().abs()
    assert wide.dtype == torch.float32
    assert ((wide.double() - exact).abs() / scale).max() < 1e-4
    upstream = _x(33, 17, dtype=torch.bfloat16)
    grads = torch.autograd.grad(wide, (a, b), upstream.float())
    want = torch.autograd.grad(opforge.matmul(a, b), (a, b), upstream)
    for grad, expected in zip(grads, want, strict=True):
        assert grad.dtype == torch.bfloat16 and torch.equal(grad, expected)
