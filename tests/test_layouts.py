"""No launcher trusts a layout it did not check: every operator, given each of its tensor
inputs as a non-contiguous view (every other element, transposed, expanded, at a storage
offset) with garbage in the memory around it, returns what it returns for contiguous
copies of the same values, on both backends, and writes nothing outside its outputs."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

import opforge
from opforge.core.errors import IndexRangeError
from opforge.core.opdef import OpDef

from .conftest import DEVICE

OPS = [op.name for op in opforge.list_ops()]


def _garbage(dtype: torch.dtype) -> float | int | bool:
    """What fills the memory a view skips: NaN poisons any float result that reads it; the
    largest integer is an index far outside every table."""
    if dtype.is_floating_point:
        return float("nan")
    return True if dtype == torch.bool else torch.iinfo(dtype).max


def _dims_over_one(tensor: torch.Tensor) -> list[int]:
    return [d for d, size in enumerate(tensor.shape) if size > 1]


def every_other(tensor: torch.Tensor) -> torch.Tensor | None:
    """The values at every other element of the last dim longer than one of a buffer
    full of garbage."""
    dims = _dims_over_one(tensor)
    if not dims:
        return None
    dim = dims[-1]
    shape = list(tensor.shape)
    shape[dim] *= 2
    buffer = torch.full(shape, _garbage(tensor.dtype), dtype=tensor.dtype, device=tensor.device)
    view = buffer.narrow(dim, 0, shape[dim]).unfold(dim, 1, 2).squeeze(-1)
    view.copy_(tensor)
    return view


def transposed(tensor: torch.Tensor) -> torch.Tensor | None:
    """The values in a buffer laid out with two dims exchanged."""
    dims = _dims_over_one(tensor)
    if len(dims) < 2:
        return None
    first, last = dims[0], dims[-1]
    return tensor.transpose(first, last).contiguous().transpose(first, last)


def expanded(tensor: torch.Tensor) -> torch.Tensor | None:
    """The first slice along the first dim longer than one, expanded over it (stride 0):
    the call's values change, to what the contiguous copy holds."""
    dims = _dims_over_one(tensor)
    if not dims:
        return None
    return tensor.narrow(dims[0], 0, 1).expand(tensor.shape)


def offset(tensor: torch.Tensor) -> torch.Tensor | None:
    """The values three elements into a buffer of garbage (a first element off the 16-byte
    boundary of a fresh tensor)."""
    buffer = torch.full((tensor.numel() + 5,), _garbage(tensor.dtype), dtype=tensor.dtype,
                        device=tensor.device)
    view = buffer[3:3 + tensor.numel()].view(tensor.shape)
    view.copy_(tensor)
    return view


VIEWS: dict[str, Callable[[torch.Tensor], torch.Tensor | None]] = {
    "every_other": every_other, "transposed": transposed, "expanded": expanded,
    "offset": offset}


# Kinds of view that are not contiguous: an input the call updates in place must be
# contiguous (it is written by offset), and is refused as such a view with an OpError.
STRIDED = ("every_other", "transposed", "expanded")


def _viewable(op: OpDef, index: int, tensor: torch.Tensor | None, kind: str) -> bool:
    if tensor is None or not tensor.numel():
        return False
    if index in op.mutated_inputs:
        return kind not in STRIDED
    # Repeated slots would make the rows a call scatters into its caches race.
    return not (kind == "expanded" and op.mutated_inputs and not tensor.dtype.is_floating_point)


def _run(op: OpDef, inputs: Sequence[torch.Tensor | None], attrs: dict
         ) -> tuple[list[torch.Tensor], str]:
    """The call's outputs, then the inputs it updates in place; and the backend that ran."""
    plan = opforge.plan(op, *inputs, **attrs)
    results = plan.run(*inputs)
    results = list(results) if isinstance(results, tuple) else [results]
    return [*results, *(inputs[i] for i in op.mutated_inputs)], plan.backend


def _difference(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor], backend: str
                ) -> str | None:
    """Why ``got`` is not ``want``: bitwise from the kernels (they read a view's elements
    in the order they read a copy's); within float32 rounding from torch's own operators,
    whose reductions may add a strided tensor in another order (a misread element is a
    NaN or an unrelated value)."""
    for index, (a, b) in enumerate(zip(got, want, strict=True)):
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"result {index}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
        try:
            exact = backend != "torch" or not a.is_floating_point()
            scale = 0.0 if exact or not b.numel() else float(b.nan_to_num(0, 0, 0).abs().max())
            torch.testing.assert_close(a, b, equal_nan=True, rtol=0.0 if exact else 1e-5,
                                       atol=1e-6 * scale)
        except AssertionError as error:
            return f"result {index}: {str(error).splitlines()[1:4]}"
    return None


@pytest.mark.parametrize("kind", VIEWS)
@pytest.mark.parametrize("name", OPS)
def test_views_equal_contiguous_copies(name, kind, backend):
    """All viewable inputs of each float32 sample as ``kind`` views at once; on a
    difference, each input alone names the one the launcher misreads."""
    op = opforge.get_op(name)
    generator = torch.Generator().manual_seed(0)
    checked = 0
    for case in op.samples(torch.float32, DEVICE, generator):
        views = [VIEWS[kind](t) if _viewable(op, i, t, kind) else None
                 for i, t in enumerate(case.inputs)]
        if all(v is None for v in views):
            continue
        checked += 1
        viewed = [t if v is None else v for t, v in zip(case.inputs, views)]
        pristine = [None if t is None else t.contiguous().clone() for t in viewed]

        def copies() -> list[torch.Tensor | None]:
            return [None if t is None else t.clone() for t in pristine]  # noqa: B023

        try:
            want, backend = _run(op, copies(), case.attrs)
        except IndexRangeError as error:
            if kind != "expanded":
                raise
            # An expanded view repeats a slice: values the operator refuses (cumulative
            # lengths that stop growing), and it refuses the view alike.
            with pytest.raises(type(error)):
                _run(op, viewed, case.attrs)
            continue
        storages = [None if v is None else _storage_copy(v) for v in views]
        got, _ = _run(op, viewed, case.attrs)
        problem = _difference(got, want, backend)
        if problem is not None:
            culprits = [op.inputs[i].name for i, v in enumerate(views) if v is not None
                        and _difference(_run(op, [v if j == i else c for j, c in
                                                  enumerate(copies())], case.attrs)[0],
                                        want, backend) is not None]
            pytest.fail(f"{name}/{case.name}: {kind} views of {culprits or 'all inputs'}: "
                        f"{problem}")
        for index, (v, before) in enumerate(zip(views, storages)):
            if v is None:
                continue
            if index in op.mutated_inputs:  # what the call wrote into its view is a result
                torch.empty(0, dtype=v.dtype, device=v.device).set_(
                    before, v.storage_offset(), v.shape, v.stride()).copy_(v)
            assert torch.equal(_bytes(v.untyped_storage()), _bytes(before)), (
                f"{name}/{case.name}: wrote into {op.inputs[index].name}'s storage "
                "outside the results")
    if not checked:
        pytest.skip(f"no {kind} view of {name}'s samples exists")


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _storage_copy(view: torch.Tensor) -> torch.UntypedStorage:
    """A copy of the memory a view lies in, the garbage around it included."""
    return view.untyped_storage().clone()


@pytest.mark.parametrize("kind", STRIDED)
def test_strided_caches_are_refused_untouched(kind, backend):
    """A cache the call updates in place, given as a strided view, is an OpError before
    anything is written into it."""
    op = opforge.get_op("mla_prolog")
    case = op.samples(torch.float32, DEVICE, torch.Generator().manual_seed(0))[0]
    for index in op.mutated_inputs:
        view = VIEWS[kind](case.inputs[index])
        inputs = [view if i == index else t.clone() if i in op.mutated_inputs else t
                  for i, t in enumerate(case.inputs)]
        before = _storage_copy(view)
        with pytest.raises(opforge.OpError, match="must be contiguous"):
            _run(op, inputs, case.attrs)
        assert torch.equal(_bytes(view.untyped_storage()), _bytes(before))


def test_outs_whose_elements_overlap_are_refused(backend):
    """An out with strides (1, 1) (no zero stride, yet elements on one address), and one
    tensor given as two outs, are OpErrors before any kernel: they were filled silently
    with whichever write came last."""
    x = torch.randn(3, 3, device=DEVICE)
    overlapping = torch.empty(5, device=DEVICE).as_strided((3, 3), (1, 1))
    with pytest.raises(opforge.OpError, match="share memory"):
        opforge.plan("sigmoid", x).run(x, out=overlapping)
    plan = opforge.plan("layer_norm", x, None, None, normalized_shape=[3])
    y, statistic = torch.empty(3, 3, device=DEVICE), torch.empty(3, device=DEVICE)
    with pytest.raises(opforge.OpError, match="shares memory with out mean"):
        plan.run(x, None, None, out=(y, statistic, statistic))
    # Interleaved outs share a span, not an element: accepted.
    storage = torch.empty(6, device=DEVICE)
    mean, rstd = storage[0::2], storage[1::2]
    _, got_mean, got_rstd = plan.run(x, None, None, out=(y, mean, rstd))
    torch.testing.assert_close(mean, x.mean(-1))
    assert got_mean is mean and got_rstd is rstd
