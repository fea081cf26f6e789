"""RoPE: each mode against an independent formulation, the relation between the CANN and
DeepSeek forms, relative-position invariance, broadcast tables, gradients, errors."""

from __future__ import annotations

import pytest
import torch

import opforge
from opforge.core.opdef import Case
from opforge.ops.rope import MODES, rope_tables

from .conftest import DEVICE, assert_golden

ROPE = opforge.get_op("rope")


def _x(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(DEVICE, dtype)


def _tables(positions: torch.Tensor, d: int, mode: str, dtype: torch.dtype = torch.float32):
    cos, sin = rope_tables(positions, d, mode)
    return cos.to(DEVICE, dtype), sin.to(DEVICE, dtype)


def test_interleave_is_complex_multiplication(backend):
    """GPT-J / DeepSeek: adjacent pairs are complex numbers multiplied by e^(i theta)."""
    x = _x(2, 5, 16)
    cos, sin = _tables(torch.arange(5), 16, "interleave")
    angles = torch.atan2(sin[:, 0::2].double(), cos[:, 0::2].double())
    expected = torch.view_as_real(torch.view_as_complex(x.double().unflatten(-1, (8, 2)))
                                  * torch.polar(torch.ones_like(angles), angles)).flatten(-2)
    out = opforge.rope(x, cos, sin, "interleave")
    assert (out.double() - expected).abs().max() < 1e-5


def test_half_is_the_neox_rotation(backend):
    x = _x(3, 7, 32)
    cos, sin = _tables(torch.arange(7), 32, "half")
    wide = x.double()
    rotated = torch.cat([-wide[..., 16:], wide[..., :16]], -1)
    expected = wide * cos.double() + rotated * sin.double()
    assert (opforge.rope(x, cos, sin).double() - expected).abs().max() < 1e-5


def test_interleave_half_is_deepseek_rope_deinterleaved(backend):
    """CANN's interleave_half output equals DeepSeek's interleaved rotation with its evens
    then its odds (the same values in a fixed permutation, so q . k is preserved)."""
    x = _x(4, 9, 64)
    cos_h, sin_h = _tables(torch.arange(9), 64, "interleave_half")
    cos_i, sin_i = _tables(torch.arange(9), 64, "interleave")
    cann = opforge.rope(x, cos_h, sin_h, "interleave_half")
    deepseek = opforge.rope(x, cos_i, sin_i, "interleave")
    assert torch.equal(cann, torch.cat([deepseek[..., 0::2], deepseek[..., 1::2]], -1))


@pytest.mark.parametrize("mode", MODES)
def test_scores_depend_only_on_relative_position(mode, backend):
    """<rope(q, m), rope(k, n)> is a function of m - n: shifting both positions by 1000
    changes the score by float32 rounding only."""
    q, k = _x(1, 64, dtype=torch.float64).float(), _x(1, 64, seed=1)
    scores = []
    for offset in (0, 1000):
        cos_q, sin_q = _tables(torch.tensor([offset + 7]), 64, mode)
        cos_k, sin_k = _tables(torch.tensor([offset + 3]), 64, mode)
        scores.append((opforge.rope(q, cos_q, sin_q, mode).double()
                       @ opforge.rope(k, cos_k, sin_k, mode).double().T).item())
    assert abs(scores[0] - scores[1]) < 1e-4 * max(abs(scores[0]), 1.0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout, table_shape, copied", [
    ("bhsd", (5, 8), False),            # repeated over batch and heads: a period
    ("bhsd", (2, 1, 5, 8), True),       # a hole between table dims: expanded (a copy)
    ("bhsd", (2, 3, 5, 8), False),      # x's own shape
    ("bshd", (5, 1, 8), False),         # broadcast over heads: a step
    ("bshd", (2, 5, 1, 8), False),      # per batch and position, broadcast over heads
    ("bshd", (1, 5, 1, 8), False),      # a period and a step
])
def test_broadcast_tables_match_the_golden(mode, layout, table_shape, copied, backend):
    """Position tables broadcast over batch or heads, in either layout: rows repeat (a
    period) or one row serves several heads (a step) without a copy of the table; a
    broadcast the kernel's row rule cannot express is expanded."""
    from opforge.ops.rope import _tables as table_rows

    x = _x(*((2, 3, 5, 8) if layout == "bhsd" else (2, 5, 3, 8)), dtype=torch.bfloat16)
    # Arbitrary tables: the kernel must pick the right row, whatever it holds.
    cos = _x(*table_shape, dtype=torch.bfloat16, seed=1)
    sin = _x(*table_shape, dtype=torch.bfloat16, seed=2)
    assert (table_rows(x, cos)[0].data_ptr() != cos.data_ptr()) == copied
    out = opforge.rope(x, cos, sin, mode)
    assert_golden(ROPE, Case("broadcast", (x, cos, sin), {"mode": mode}), out)


@pytest.mark.parametrize("mode", MODES)
def test_gradient_is_the_exact_transpose(mode, backend):
    """With arbitrary (not rotation) tables the backward must still be the transpose; tables
    that require grad (broadcast over x's leading dim) get theirs, summed over it."""
    x = _x(3, 4, 10).requires_grad_()
    cos, sin = _x(4, 10, seed=1).requires_grad_(), _x(4, 10, seed=2).requires_grad_()
    upstream = _x(3, 4, 10, seed=3)
    got = torch.autograd.grad(opforge.rope(x, cos, sin, mode), (x, cos, sin), upstream)
    wide = [t.detach().double().requires_grad_() for t in (x, cos, sin)]
    expected_y = ROPE.reference_fn(*wide, compute_dtype=torch.float64, mode=mode)
    expected = torch.autograd.grad(expected_y, wide, upstream.double())
    for mine, exact in zip(got, expected, strict=True):
        assert mine.shape == exact.shape
        assert (mine.double() - exact).abs().max() <= 1e-5 * exact.abs().max()


@pytest.mark.parametrize("mode", MODES)
def test_tables_hold_the_standard_frequencies(mode):
    """rope_tables' angles are ``position * base^(-2i / dim)`` (i the pair index), laid out
    as the mode reads them: repeated halves, or each angle twice in a row."""
    positions = torch.tensor([0.0, 1.0, 7.0])
    cos, sin = rope_tables(positions, 8, mode, base=100.0)
    pairs = positions.double()[:, None] * 100.0 ** (-torch.arange(4).double() * 2 / 8)
    layout = (pairs.repeat_interleave(2, -1) if mode == "interleave"
              else torch.cat([pairs, pairs], -1))
    assert torch.allclose(cos.double(), layout.cos(), atol=1e-7)
    assert torch.allclose(sin.double(), layout.sin(), atol=1e-7)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tables", ["wide_head", "sin_row_strided", "column_strided"])
def test_any_table_layout_matches_the_golden(mode, tables, backend):
    """Heads wider than one column tile (2050 > 1024 columns), a sin table whose rows are
    further apart than cos's, and tables with a column stride: every column is computed
    from the right table entries."""
    d = 2050 if tables == "wide_head" else 8
    x = _x(3, d)
    cos, sin = _x(3, d, seed=1), _x(3, d, seed=2)
    if tables == "sin_row_strided":
        sin = torch.cat([sin, torch.zeros_like(sin)], -1)[:, :d]
    elif tables == "column_strided":
        cos, sin = cos.t().contiguous().t(), sin.t().contiguous().t()
    out = opforge.rope(x, cos, sin, mode)
    assert_golden(ROPE, Case(tables, (x, cos, sin), {"mode": mode}), out)


def test_gradcheck_in_float64():
    x = _x(2, 6).double().requires_grad_()
    cos, sin = (_x(6, seed=seed).double().requires_grad_() for seed in (1, 2))
    for mode in MODES:
        assert torch.autograd.gradcheck(lambda *t, m=mode: opforge.rope(*t, m), (x, cos, sin))


@pytest.mark.parametrize("mode", MODES)
def test_float64_gradients_are_float64_exact(mode, backend):
    """Operands with float64's full mantissa (float32 would round them) and a dense
    upstream gradient: x's and the tables' gradients equal autograd through the float64
    reference to float64 rounding (gradcheck's unit upstream vectors cannot see a float32
    step)."""
    generator = torch.Generator().manual_seed(5)
    x, cos, sin, upstream = (torch.randn(shape, generator=generator, dtype=torch.float64)
                             .to(DEVICE) for shape in ((4, 3, 6), (3, 6), (3, 6), (4, 3, 6)))
    leaves = [t.requires_grad_() for t in (x, cos, sin)]
    ours = torch.autograd.grad(opforge.rope(*leaves, mode), leaves, upstream)
    golden = torch.autograd.grad(ROPE.reference_fn(*leaves, compute_dtype=torch.float64,
                                                   mode=mode), leaves, upstream)
    for got, want in zip(ours, golden):
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)


def test_errors_come_before_any_kernel():
    with pytest.raises(opforge.ShapeError, match="even"):
        opforge.rope(_x(3, 5), _x(5), _x(5))
    with pytest.raises(opforge.ShapeError, match="last dim"):
        opforge.rope(_x(3, 6), _x(4), _x(4))
    with pytest.raises(opforge.ShapeError, match="cos's shape"):
        opforge.rope(_x(3, 6), _x(6), _x(3, 6))
    with pytest.raises(opforge.ShapeError):
        opforge.rope(_x(3, 6), _x(4, 6), _x(4, 6))
    with pytest.raises(opforge.ShapeError, match="broadcast to x's shape"):
        opforge.rope(_x(3, 6), _x(2, 3, 6), _x(2, 3, 6))  # more dims than x
    with pytest.raises(opforge.AttrError, match="mode"):
        opforge.rope(_x(3, 6), _x(6), _x(6), "neox")
