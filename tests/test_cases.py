"""opforge.precision.cases: each kind has the property it promises, deterministically."""

from __future__ import annotations

import math

import pytest
import torch

from opforge.precision.cases import KINDS, LONG_ROW, SHAPES, generate, sweep

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _gen(kind, shape=(63, 1000), dtype=torch.float32, seed=0):
    return generate(kind, shape, dtype, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_shape_dtype_and_determinism(kind, dtype):
    x = _gen(kind, dtype=dtype)
    assert x.dtype == dtype
    assert x.shape == ((63, LONG_ROW) if kind == "long_rows" else (63, 1000))
    assert torch.equal(x, _gen(kind, dtype=dtype))
    assert not torch.equal(x.nan_to_num(), _gen(kind, dtype=dtype, seed=1).nan_to_num())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_large_values_are_within_a_factor_4_of_overflow(dtype):
    x = _gen("large", dtype=dtype).double().abs()
    largest = torch.finfo(dtype).max
    assert torch.isfinite(x).all()
    assert x.min() >= largest / 4 * 0.99 and x.max() <= largest / 2 * 1.01
    assert not torch.isinf((x * 2).to(dtype)).any()
    assert torch.isinf((x * 4.5).to(dtype)).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tiny_values_reach_subnormals(dtype):
    x = _gen("tiny", dtype=dtype)
    tiny = torch.finfo(dtype).tiny
    magnitude = x.double().abs()
    assert (magnitude < tiny).any() and (magnitude >= tiny).any()
    assert (magnitude <= tiny * 16).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cancellation_pairs_cancel(dtype):
    """Every pair of every sweep shape sums to a few eps of its magnitude, in every dtype:
    the partner's offset stays within 8 eps however many pairs the tensor holds."""
    for shape in SHAPES:
        x = _gen("cancellation", shape, dtype).double().reshape(-1)
        first, second = x[0::2][: x[1::2].numel()], x[1::2]
        assert ((first + second).abs() <= 10 * torch.finfo(dtype).eps * first.abs()).all()


def test_outliers_share_and_masked_rows():
    x = _gen("outliers").abs()
    share = float((x > 100).double().mean())
    assert 0.005 < share < 0.02
    rows = _gen("masked_rows")
    fully = rows.isinf().all(dim=-1)
    half = rows.isinf().any(dim=-1) & ~fully
    assert fully.any() and half.any() and (~rows.isinf().any(dim=-1)).any()
    assert (rows[rows.isinf()] == -math.inf).all()


def test_sweep_and_errors():
    pairs = list(sweep())
    assert ("normal", (4097,)) in pairs and ("tiny", (0, 5)) in pairs
    assert sum(kind == "long_rows" for kind, _ in pairs) < len(SHAPES)
    assert generate("normal", (0, 5), torch.float32).shape == (0, 5)
    with pytest.raises(ValueError, match="kind"):
        generate("gaussian", (3,), torch.float32)
    with pytest.raises(ValueError, match="floating"):
        generate("normal", (3,), torch.int32)
