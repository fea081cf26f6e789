"""EmbeddingDenseGrad: aten's result on both kernels, determinism over runs and grid sizes
with Zipf-repeated indices, padding and frequency scaling, index dtypes, errors."""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch

import opforge
import opforge.nn
from opforge.core import backends
from opforge.core.hardware import get_profile
from opforge.core.opdef import Case
from opforge.ops.embedding_dense_grad import SORTED_CHUNK, use_deterministic, zipf_indices

from .conftest import DEVICE, LOW_PRECISION, assert_golden, needs_triton

OP = opforge.get_op("embedding_dense_grad")


def _data(positions: int = 500, width: int = 24, rows: int = 40,
          dtype: torch.dtype = torch.float32, seed: int = 0
          ) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    grad = torch.randn(positions, width, generator=generator).to(DEVICE, dtype)
    return grad, zipf_indices((positions,), rows, generator).to(DEVICE)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_samples_match_the_golden(dtype, backend):
    for case in OP.samples(dtype, DEVICE, torch.Generator().manual_seed(1)):
        assert_golden(OP, case, opforge.plan(OP, *case.inputs, **case.attrs).run(
            *case.inputs))


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("padding_idx, freq", [(-1, False), (0, True), (3, False)])
def test_equals_aten(deterministic, padding_idx, freq, backend):
    grad, indices = _data(seed=2)
    ours = opforge.embedding_dense_grad(grad, indices, 40, padding_idx, freq, deterministic)
    expected = torch.ops.aten.embedding_dense_backward(grad, indices, 40, padding_idx, freq)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


def test_deterministic_kernel_is_bitwise_stable_over_runs_and_grids():
    """Zipf indices (index 0 holds over a tenth of 1200 positions): ten runs, and runs
    planned for a 1-core CPU and a 132-SM GPU (different grids), give the same bits."""
    grad, indices = _data(positions=1200, width=16, rows=300, dtype=torch.bfloat16, seed=3)
    assert (indices == 0).float().mean() > 0.1
    with opforge.use_backend("triton"):
        runs = [opforge.embedding_dense_grad(grad, indices, 300, deterministic=True)
                for _ in range(10)]
        grids = []
        for hardware in (dataclasses.replace(get_profile("cpu"), core_count=1), "h100"):
            with opforge.use_hardware(hardware):
                plan = opforge.plan(OP, grad, indices, num_weights=300, deterministic=True)
                grids.append(plan.grid)
                runs.append(plan.run(grad, indices))
    assert grids[0] != grids[1]
    assert all(torch.equal(run, runs[0]) for run in runs)


def _runs(lengths: list[int], seed: int) -> torch.Tensor:
    """Indices whose sorted order holds runs of these lengths (run i of index 2i, so that
    unused rows lie between them), at shuffled positions."""
    ids = torch.repeat_interleave(torch.arange(len(lengths)) * 2, torch.tensor(lengths))
    return ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(seed))]


@pytest.mark.parametrize("lengths", [
    [SORTED_CHUNK, SORTED_CHUNK, 1],            # runs ending exactly at chunk ends
    [SORTED_CHUNK - 1, 2, SORTED_CHUNK * 3, 5],  # runs across one and across three chunks
    [SORTED_CHUNK * 4 + 3],                      # one run over every chunk
    [1] * (SORTED_CHUNK + 1),                    # a run per position
    [3, SORTED_CHUNK * 2 - 3, 1, 1],             # a run from inside one chunk to another's end
], ids=["chunk_ends", "across", "one_run", "singles", "inside_to_end"])
@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_deterministic_runs_across_chunk_boundaries(lengths, dtype, backend):
    """Every way a run of equal indices can meet the deterministic kernel's chunks: the
    float64 golden within the dtype's bound, scaled by frequency too."""
    indices = _runs(lengths, seed=len(lengths)).to(DEVICE)
    grad = torch.randn(indices.numel(), 37, generator=torch.Generator().manual_seed(7)).to(
        DEVICE, dtype)
    for freq in (False, True):
        case = Case("runs", (grad, indices), {"num_weights": 2 * len(lengths),
                                              "deterministic": True,
                                              "scale_grad_by_freq": freq})
        assert_golden(OP, case, opforge.plan(OP, *case.inputs, **case.attrs).run(*case.inputs))


@pytest.mark.parametrize("deterministic", [True, False])
def test_a_non_finite_row_stays_in_its_own_index(deterministic, backend):
    """A NaN and an Inf gradient row, beside a hot index whose run spans chunks: only their
    own indices' rows are non-finite (a sum that multiplied by 0 to mask would spread the
    NaN to the whole chunk)."""
    indices = _runs([SORTED_CHUNK * 3, 2, 1, 4], seed=3).to(DEVICE)
    grad = torch.randn(indices.numel(), 5, device=DEVICE)
    grad[(indices == 2).nonzero()[0, 0], 1] = float("nan")
    grad[(indices == 4).nonzero()[0, 0], 3] = float("inf")
    out = opforge.embedding_dense_grad(grad, indices, 8, deterministic=deterministic)
    assert_golden(OP, Case("non_finite", (grad, indices),
                           {"num_weights": 8, "deterministic": deterministic}), out)
    assert out[[0, 6]].isfinite().all() and out[2, 1].isnan() and out[4, 3].isinf()


@needs_triton
@pytest.mark.parametrize("deterministic", [True, False])
def test_kernels_skip_indices_outside_the_table(deterministic):
    """What ``check_range=False`` leaves to the kernels on a GPU: an index outside the
    table adds nothing and writes nowhere (the launcher run on unchecked indices)."""
    grad = torch.randn(6, 8, device=DEVICE)
    indices = torch.tensor([1, -3, 2, 9, 1, 2**40], device=DEVICE)
    with opforge.use_backend("triton"):
        plan = opforge.plan(OP, grad, indices, num_weights=4, deterministic=deterministic)
        out = torch.full((4, 8), float("nan"), device=DEVICE)
        workspace = torch.empty(plan.workspace_bytes, dtype=torch.uint8, device=DEVICE)
        OP.launchers["triton"](plan, [grad, indices], [out], workspace)
    kept = torch.tensor([True, False, True, False, True, False], device=DEVICE)
    assert_golden(OP, Case("in_table", (grad[kept], indices[kept]),
                           {"num_weights": 4, "deterministic": deterministic}), out)


def test_index_dtypes_and_leading_shapes(backend):
    grad, indices = _data(positions=60, seed=4)
    expected = opforge.embedding_dense_grad(grad, indices, 40)
    for dtype in (torch.int32, torch.int16, torch.int8, torch.uint8):
        shaped = opforge.embedding_dense_grad(grad.view(3, 4, 5, 24),
                                              indices.to(dtype).view(3, 4, 5), 40)
        torch.testing.assert_close(shaped, expected)


@pytest.mark.parametrize("deterministic", [True, False])
def test_strided_indices_are_read_as_the_elements_they_hold(deterministic, backend):
    """``idx[::2]`` whose skipped elements lie outside the table: the kernels read the
    view's elements (they once read it as contiguous: rows on wrong table rows, then writes
    outside the table), and the range check passes on exactly those."""
    grad, indices = _data(positions=50, seed=6)
    storage = torch.full((100,), 10**9, dtype=torch.int64, device=DEVICE)
    strided = storage[::2]
    strided.copy_(indices)
    ours = opforge.embedding_dense_grad(grad, strided, 40, deterministic=deterministic)
    expected = torch.ops.aten.embedding_dense_backward(grad, indices, 40, -1, False)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


def test_none_follows_torch_deterministic_setting():
    attrs = OP.bind_attrs({"num_weights": 4})
    previous = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        assert use_deterministic(attrs)
        torch.use_deterministic_algorithms(False)
        assert not use_deterministic(attrs)
    finally:
        torch.use_deterministic_algorithms(previous)
    assert use_deterministic({**attrs, "deterministic": True})


@needs_triton
def test_one_plan_with_none_follows_torch_s_setting_at_every_run():
    """A plan made with ``deterministic=None`` runs the kernels torch's setting asks for
    at each run, also after its launches could have been held (a replay would keep the
    first run's kernels)."""
    from opforge.ops import embedding_dense_grad as module

    grad, indices = _data(positions=100, seed=8)
    sorted_kernel = module._sorted_chunk_kernel
    sorted_runs = []
    original = type(sorted_kernel).run

    def spy(self, *args, **kwargs):
        sorted_runs.append(self is sorted_kernel)
        return original(self, *args, **kwargs)

    previous = torch.are_deterministic_algorithms_enabled()
    try:
        with opforge.use_backend("triton"), \
                mock.patch.object(type(sorted_kernel), "run", spy):
            plan = opforge.plan(OP, grad, indices, num_weights=40)
            torch.use_deterministic_algorithms(False)
            for _ in range(3):
                plan.run(grad, indices)
            assert not any(sorted_runs)
            torch.use_deterministic_algorithms(True)
            out = plan.run(grad, indices)
            assert any(sorted_runs)
    finally:
        torch.use_deterministic_algorithms(previous)
    assert_golden(OP, Case("none", (grad, indices), {"num_weights": 40}), out)


@pytest.mark.parametrize("bad", [-1, 40])
def test_out_of_range_indices_raise(bad, backend):
    grad, indices = _data(positions=10, seed=5)
    indices[4] = bad
    with pytest.raises(opforge.IndexRangeError) as raised:
        opforge.embedding_dense_grad(grad, indices, 40)
    assert raised.value.param == "indices"


@pytest.mark.parametrize("num_weights, width", [(0, 4), (3, 0)])
def test_out_of_range_indices_raise_when_the_table_is_empty(num_weights, width, backend):
    """No output element to write does not skip the check."""
    grad = torch.randn(3, width, device=DEVICE)
    indices = torch.tensor([0, 5, 1], device=DEVICE)
    with pytest.raises(opforge.IndexRangeError):
        opforge.embedding_dense_grad(grad, indices, num_weights)


def test_padding_index_may_lie_outside_the_table_check(backend):
    """Positions at padding_idx are skipped before the range check: padding 39 in a table
    of 40 rows, and padding 0 of an empty table (aten gives the empty gradient too)."""
    grad, indices = _data(positions=10, seed=6)
    indices[2] = 39
    out = opforge.embedding_dense_grad(grad, indices, 40, padding_idx=39)
    assert (out[39] == 0).all()
    empty = opforge.embedding_dense_grad(grad[:3], torch.zeros(3, dtype=torch.long,
                                                               device=DEVICE), 0, padding_idx=0)
    assert empty.shape == (0, grad.shape[1])


@pytest.mark.parametrize("backend_name", ["torch", "triton"] if backends.interpreter_enabled()
                         else ["torch"])
def test_check_range_false_still_checks_off_the_gpu(backend_name):
    """check_range=False skips the host check on CUDA only: elsewhere (the CPU, the
    interpreter) an index past the table is still an IndexRangeError, never a write
    outside it."""
    grad = torch.ones(3, 4)
    indices = torch.tensor([0, 1, 40])
    with opforge.use_backend(backend_name), pytest.raises(opforge.IndexRangeError):
        opforge.embedding_dense_grad(grad, indices, 40, check_range=False, deterministic=True)


def test_shape_mismatch_raises():
    with pytest.raises(opforge.ShapeError):
        opforge.embedding_dense_grad(torch.randn(5, 4), torch.zeros(6, dtype=torch.long), 3)


def test_nn_embedding_matches_torch_and_uses_the_operator(backend):
    torch.manual_seed(7)
    ours = opforge.nn.Embedding(30, 8, padding_idx=2, scale_grad_by_freq=True).to(DEVICE)
    theirs = torch.nn.Embedding(30, 8, padding_idx=2, scale_grad_by_freq=True).to(DEVICE)
    theirs.load_state_dict(ours.state_dict())
    indices = zipf_indices((4, 9), 30, torch.Generator().manual_seed(8)).to(DEVICE)
    upstream = torch.randn(4, 9, 8).to(DEVICE)
    (ours(indices) * upstream).sum().backward()
    (theirs(indices) * upstream).sum().backward()
    torch.testing.assert_close(ours.weight.grad, theirs.weight.grad)
    assert (ours.weight.grad[2] == 0).all()
    for max_norm in (1.0, 0.0):
        with pytest.raises(opforge.UnsupportedError) as raised:
            opforge.nn.Embedding(3, 2, max_norm=max_norm)
        assert (raised.value.param, raised.value.got) == ("max_norm", max_norm)
    with pytest.raises(opforge.UnsupportedError) as raised:
        opforge.nn.Embedding(3, 2, sparse=True)
    assert (raised.value.param, raised.value.got) == ("sparse", True)
    for padding_idx in (3, -4):
        with pytest.raises(opforge.AttrError) as raised:
            opforge.nn.Embedding(3, 2, padding_idx=padding_idx)
        assert raised.value.param == "padding_idx"


def test_nn_embedding_under_torch_func_as_torch(backend):
    """vmap and torch.func.grad run the module as they run torch.nn.Embedding, the weight
    gradient still from embedding_dense_grad."""
    from torch.func import functional_call, grad, vmap

    ours = opforge.nn.Embedding(6, 4, padding_idx=1).to(DEVICE)
    theirs = torch.nn.Embedding(6, 4, padding_idx=1).to(DEVICE)
    theirs.load_state_dict(ours.state_dict())
    indices = torch.tensor([[0, 2, 2, 5], [1, 3, 0, 0]], device=DEVICE)
    upstream = torch.randn(2, 4, 4, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    gradients = [grad(lambda p, m=module: (functional_call(m, p, (indices,)) * upstream).sum())(
        dict(module.named_parameters()))["weight"] for module in (ours, theirs)]
    torch.testing.assert_close(gradients[0], gradients[1])
    assert gradients[0].abs().sum() > 0 and not gradients[0][1].any()
    torch.testing.assert_close(vmap(ours)(indices), vmap(theirs)(indices))


def test_nn_embedding_from_pretrained_as_torch():
    """from_pretrained keeps the given tensor as the frozen (or trainable) table, with
    torch's attributes, repr and padding handling; reset_parameters zeroes the padding row."""
    table = torch.randn(7, 4, generator=torch.Generator().manual_seed(13))
    for freeze in (True, False):
        ours = opforge.nn.Embedding.from_pretrained(table, freeze=freeze, padding_idx=-2)
        theirs = torch.nn.Embedding.from_pretrained(table, freeze=freeze, padding_idx=-2)
        assert ours.weight.data_ptr() == table.data_ptr()
        assert ours.weight.requires_grad == theirs.weight.requires_grad == (not freeze)
        for name in ("num_embeddings", "embedding_dim", "padding_idx", "max_norm",
                     "norm_type", "scale_grad_by_freq", "sparse"):
            assert getattr(ours, name) == getattr(theirs, name), name
        assert repr(ours) == repr(theirs)
    assert repr(opforge.nn.Embedding(3, 2)) == repr(torch.nn.Embedding(3, 2))
    fresh = opforge.nn.Embedding(7, 4, padding_idx=5)
    fresh.reset_parameters()
    assert not fresh.weight[5].any() and fresh.weight.std() > 0.5
    with pytest.raises(opforge.ShapeError):
        opforge.nn.Embedding.from_pretrained(torch.randn(3))
    with pytest.raises(opforge.AttrError):
        opforge.nn.Embedding(7, 5, _weight=table)


def test_nn_embedding_in_float64_for_gradcheck(backend):
    """A float64 table (gradcheck's) takes the torch backend's float64 path."""
    table = opforge.nn.Embedding(6, 3, padding_idx=1, dtype=torch.float64)
    indices = torch.tensor([[0, 1, 5], [5, 2, 0]])
    (table(indices) * torch.arange(18.0, dtype=torch.float64).view(2, 3, 3)).sum().backward()
    expected = torch.zeros(6, 3, dtype=torch.float64)
    for position, index in enumerate(indices.flatten().tolist()):
        if index != 1:
            expected[index] += torch.arange(3.0, dtype=torch.float64) + 3 * position
    assert torch.equal(table.weight.grad, expected)
