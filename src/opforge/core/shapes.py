"""Shape algebra shared by every operator's `infer_shape`.

Shapes are tuples of dims. As in the Ascend graph engine, a dim of ``-1`` is unknown and the
shape ``(-2,)`` means "unknown rank". Dims may also be ``torch.SymInt`` (fake tensors under
``torch.compile(dynamic=True)``); the functions below only compare them, which records shape
guards but never reads data.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from opforge.core.errors import AttrError, ShapeError

UNKNOWN_DIM = -1
UNKNOWN_RANK: tuple[int, ...] = (-2,)

Shape = tuple[int, ...]


def is_unknown_rank(shape: Sequence[int]) -> bool:
    """True for the unknown-rank shape ``(-2,)``."""
    return len(shape) == 1 and _is_const(shape[0], -2)


def _is_const(dim: object, value: int) -> bool:
    # A SymInt compared to a constant installs a guard; plain ints compare directly.
    return isinstance(dim, int) and dim == value


def broadcast_shapes(*shapes: Sequence[int], op: str | None = None,
                     names: Sequence[str] | None = None) -> Shape:
    """NumPy broadcasting of any number of shapes.

    Shapes are padded with 1s on the left; a dim of 1 stretches to the other size; unknown
    dims (``-1``) broadcast against anything (the result is the known size if one is > 1,
    else unknown); an unknown-rank shape makes the result unknown-rank.

    Raises:
        ShapeError: two known dims differ and neither is 1; the message names every shape
            and the offending dim (counted from the right, as broadcasting aligns them).
    """
    if any(is_unknown_rank(s) for s in shapes):
        return UNKNOWN_RANK
    rank = max((len(s) for s in shapes), default=0)
    padded = [(1,) * (rank - len(s)) + tuple(s) for s in shapes]
    out: list[int] = []
    for axis in range(rank):
        size: object = 1
        for shape in padded:
            dim = shape[axis]
            if _is_const(dim, 1):
                continue
            if _is_const(dim, UNKNOWN_DIM):
                size = UNKNOWN_DIM if _is_const(size, 1) else size
            elif _is_const(size, 1) or _is_const(size, UNKNOWN_DIM):
                size = dim
            elif dim != size:
                labels = names or [f"input{i}" for i in range(len(shapes))]
                listing = ", ".join(f"{n}={tuple(s)}" for n, s in zip(labels, shapes))
                raise ShapeError(
                    f"shapes {listing} cannot be broadcast: dim {axis - rank} "
                    f"(dim {axis} of the broadcast shape) is {size} in one and {dim} in another",
                    op=op, param=",".join(labels), expected="equal sizes or 1",
                    got=f"{size} vs {dim}")
        out.append(size)  # type: ignore[arg-type]
    return tuple(out)


def broadcast_dims(shape: Sequence[int], out_shape: Sequence[int]) -> tuple[int, ...]:
    """The dims of ``out_shape`` over which an input of ``shape`` was stretched or padded.

    Summing a gradient of ``out_shape`` over these dims (keepdim) and viewing it as ``shape``
    gives the input's gradient.
    """
    lead = len(out_shape) - len(shape)
    stretched = [lead + i for i, d in enumerate(shape) if d == 1 and out_shape[lead + i] != 1]
    return tuple(range(lead)) + tuple(stretched)


def normalize_dim(dim: int, rank: int, *, op: str | None = None, param: str = "dim") -> int:
    """Map a possibly negative ``dim`` into ``[0, rank)``; a scalar (rank 0) accepts -1 and 0.

    Raises:
        AttrError: ``dim`` is outside ``[-rank, rank)``.
    """
    bound = max(rank, 1)
    if not -bound <= dim < bound:
        raise AttrError(f"dim {dim} is out of range for a tensor of rank {rank}",
                        op=op, param=param, expected=f"an int in [{-bound}, {bound - 1}]",
                        got=dim)
    return dim % bound


def normalize_dims(dims: Iterable[int], rank: int, *, op: str | None = None,
                   param: str = "dim") -> tuple[int, ...]:
    """Normalise several dims (sorted, duplicates rejected).

    Raises:
        AttrError: a dim is out of range or appears twice.
    """
    given = tuple(dims)
    seen: list[int] = []
    for dim in given:
        norm = normalize_dim(dim, rank, op=op, param=param)
        if norm in seen:
            raise AttrError(f"dim {dim} appears more than once", op=op, param=param,
                            expected="distinct dims", got=given)
        seen.append(norm)
    return tuple(sorted(seen))


def numel(shape: Sequence[int]) -> int:
    """Number of elements of a known shape (1 for a scalar)."""
    count = 1
    for dim in shape:
        count *= dim
    return count


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
