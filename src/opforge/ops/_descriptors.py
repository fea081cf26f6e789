"""Tensor-descriptor (TMA) plumbing shared by the kernels that read blocks by on-device
tensor descriptor: whether the tensors allow it, the scratch allocator descriptors need on
a GPU, and the descriptors of a pair of matrices."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from opforge.core import backends

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

if triton is not None and hasattr(tl, "make_tensor_descriptor"):

    @triton.jit
    def descriptor_pair(a_base, a_rows, a_cols, a_stride, b_base, b_rows, b_cols, b_stride,
                        DESCRIPTORS: tl.constexpr, A_ROWS: tl.constexpr,
                        A_COLS: tl.constexpr, B_ROWS: tl.constexpr, B_COLS: tl.constexpr):
        """Tensor descriptors of two row-major matrices (``a_rows x a_cols`` read in blocks
        of ``A_ROWS x A_COLS``, and b alike); the base pointers themselves without
        ``DESCRIPTORS``. A descriptor's bounds are its matrix's, so blocks past the last
        row or column read 0 without a mask (the launcher checked `descriptors_usable`)."""
        if DESCRIPTORS:
            a = tl.make_tensor_descriptor(a_base, shape=[a_rows, a_cols],
                                          strides=[a_stride, 1], block_shape=[A_ROWS, A_COLS])
            b = tl.make_tensor_descriptor(b_base, shape=[b_rows, b_cols],
                                          strides=[b_stride, 1], block_shape=[B_ROWS, B_COLS])
        else:
            a, b = a_base, b_base
        return a, b

elif triton is not None:

    @triton.jit
    def descriptor_pair(a_base, a_rows, a_cols, a_stride, b_base, b_rows, b_cols, b_stride,
                        DESCRIPTORS: tl.constexpr, A_ROWS: tl.constexpr,
                        A_COLS: tl.constexpr, B_ROWS: tl.constexpr, B_COLS: tl.constexpr):
        """A Triton without on-device descriptors (3.2): the base pointers (the launchers
        never ask for descriptors there, `descriptors_usable`). The kernel above would not
        even hash there: Triton's dependency walk resolves every ``tl.`` name, pruned
        branches included."""
        return a_base, b_base

_scratch_allocator_set = False
# The compute capability CPU tensors are judged for while `opforge compile-check` records
# launches for a GPU target (empty: none).
_recording_capability: list[int] = []


@contextlib.contextmanager
def judged_as_cuda(capability: int) -> Iterator[None]:
    """Inside the block, CPU tensors are judged by `descriptors_usable` as tensors of a
    CUDA device of ``capability`` (``90`` for Hopper): the AOT check records the launches
    a GPU of that target would make."""
    _recording_capability.append(capability)
    try:
        yield
    finally:
        _recording_capability.pop()


def descriptors_usable(*tensors: torch.Tensor) -> bool:
    """Whether blocks of ``tensors`` can be read by tensor descriptor: a Triton that has
    on-device descriptors, a Hopper-or-newer GPU (or the interpreter), unit stride in the
    last dim, and a base and every other stride on 16 bytes (TMA's alignment rule)."""
    if triton is None or not hasattr(tl, "make_tensor_descriptor"):
        return False
    device = tensors[0].device
    if device.type == "cuda" or (device.type == "cpu" and _recording_capability):
        major = (torch.cuda.get_device_capability(device)[0] if device.type == "cuda"
                 else _recording_capability[-1] // 10)
        if major < 9 or not hasattr(triton, "set_allocator"):
            return False
    elif not backends.interpreter_enabled():
        return False
    return all(t.stride(-1) == 1 and t.data_ptr() % 16 == 0
               and all(stride * t.element_size() % 16 == 0 for stride in t.stride()[:-1])
               for t in tensors)


def use_scratch_allocator(device: torch.device) -> None:
    """On-device descriptors live in global scratch memory that Triton asks its allocator
    for; on a GPU, set one (torch's caching allocator, replacing any set before) the first
    time a descriptor kernel runs. The interpreter needs none."""
    global _scratch_allocator_set
    if device.type == "cuda" and not _scratch_allocator_set:
        triton.set_allocator(lambda size, alignment, stream: torch.empty(
            size, dtype=torch.int8, device="cuda"))
        _scratch_allocator_set = True
