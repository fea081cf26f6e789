"""Attention over packed variable-length sequences (its samples' golden checks in low
precision are test_attention.py's): odd lengths against the golden, equality with
attention on each sequence alone (what packing must not change), the ``TND`` layout of
`opforge.attention`, the lengths' checks and their device-side clamp, 64-bit offsets,
autograd through the packed tensors, torch.compile, and CANN's TND fusion attention on
both of its paths."""

from __future__ import annotations

import pytest
import torch

import opforge
from opforge.compat.torch_npu import npu_fusion_attention
from opforge.core.opdef import Case
from opforge.ops import attention_varlen as varlen_module
from opforge.ops.attention_varlen import cumulative

from .conftest import DEVICE, assert_golden

VARLEN = opforge.get_op("attention_varlen")
VARLEN_BACKWARD = opforge.get_op("attention_varlen_backward")


def _packed(lengths: list[int], key_lengths: list[int], h: int = 4, hkv: int = 2,
            d: int = 32, dtype: torch.dtype = torch.float32, seed: int = 0
            ) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    t, tk = sum(lengths), sum(key_lengths)
    return [torch.randn(shape, generator=generator).to(DEVICE, dtype)
            for shape in ((t, h, d), (tk, hkv, d), (tk, hkv, d))]


@pytest.mark.parametrize("causal", [False, True])
def test_odd_lengths_forward_and_backward_in_bf16(causal, backend):
    """Sequences of 1, 0, 63 and 130 queries over 1, 5, 63 and 97 keys (GQA 4 over 2),
    bf16 (outputs poisoned, as in every test): the forward, then the backward from the
    forward's own out and lse, against the float64 golden."""
    lengths, key_lengths = [1, 0, 63, 130], [1, 5, 63, 97]
    q, k, v = _packed(lengths, key_lengths, dtype=torch.bfloat16, seed=3)
    cu_q, cu_k = cumulative(lengths, DEVICE), cumulative(key_lengths, DEVICE)
    attrs = {"causal": causal, "max_seqlen_q": 130, "max_seqlen_k": 97}
    out, lse = opforge.attention_varlen(q, k, v, cu_q, cu_k, causal, return_lse=True)
    assert_golden(VARLEN, Case("odd", (q, k, v, cu_q, cu_k), attrs), (out, lse))
    dout = torch.randn_like(out)
    grads = VARLEN_BACKWARD(dout, q, k, v, out, lse, None, cu_q, cu_k, causal, None, 130, 97)
    assert_golden(VARLEN_BACKWARD, Case("odd", (dout, q, k, v, out, lse, None, cu_q, cu_k),
                                        attrs), grads)


def _alone(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
           ) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = opforge.attention(q[None], k[None], v[None], causal, return_lse=True,
                                 layout="BSND")
    return out[0], lse[0]


@pytest.mark.parametrize("causal", [False, True])
def test_each_sequence_equals_attention_on_it_alone(causal, backend):
    """Packing changes nothing: each sequence's out, lse and gradients equal those of
    attention run on its rows alone (float32, tolerance of a different tile order); a
    sequence without keys gets 0 and -inf, and no gradient."""
    lengths, key_lengths = [7, 3, 40, 1], [7, 0, 52, 9]
    q, k, v = (t.requires_grad_() for t in _packed(lengths, key_lengths, seed=5))
    out, lse = opforge.attention(q, k, v, causal, return_lse=True, layout="TND",
                                 cu_seqlens_q=cumulative(lengths, DEVICE),
                                 cu_seqlens_k=cumulative(key_lengths, DEVICE))
    assert out.shape == (51, 4, 32) and lse.shape == (4, 51)
    (out.square().sum() + lse.nan_to_num(neginf=0).sum()).backward()
    first_q = first_k = 0
    for sq, sk in zip(lengths, key_lengths, strict=True):
        rows, keys = slice(first_q, first_q + sq), slice(first_k, first_k + sk)
        leaves = [t.detach()[index].requires_grad_() for t, index in ((q, rows), (k, keys),
                                                                     (v, keys))]
        alone_out, alone_lse = _alone(*leaves, causal)
        torch.testing.assert_close(out[rows], alone_out, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(lse[:, rows], alone_lse, rtol=1e-6, atol=1e-6)
        if sk:
            (alone_out.square().sum() + alone_lse.nan_to_num(neginf=0).sum()).backward()
            for packed, leaf, index in ((q, leaves[0], rows), (k, leaves[1], keys),
                                        (v, leaves[2], keys)):
                torch.testing.assert_close(packed.grad[index], leaf.grad, rtol=1e-5,
                                           atol=1e-5)
        else:
            assert (out[rows] == 0).all() and (lse[:, rows] == -torch.inf).all()
            assert (q.grad[rows] == 0).all()
        first_q, first_k = first_q + sq, first_k + sk


def test_int64_lengths_and_derived_longest_sequence(backend):
    """int64 lengths (as torch's cumsum gives) work as int32 ones (a value past int32's
    range is refused, not wrapped), and the longest sequence read from them sizes the grid
    like the given one."""
    lengths = [9, 33, 2]
    q, k, v = _packed(lengths, lengths, seed=7)
    given = opforge.attention_varlen(q, k, v, cumulative(lengths, DEVICE),
                                     cumulative(lengths, DEVICE), True, None, 33, 33)
    wide = torch.tensor([0, *lengths], device=DEVICE).cumsum(0)
    derived = opforge.attention_varlen(q, k, v, wide, wide, True)
    assert torch.equal(given, derived)
    plan = opforge.plan(VARLEN, q, k, v, cumulative(lengths, DEVICE),
                        cumulative(lengths, DEVICE), causal=True, max_seqlen_q=33)
    assert plan.grid[1] == 3 * 4
    beyond = torch.tensor([0, 9, 42, 2**32 + 44], device=DEVICE)
    with pytest.raises(opforge.IndexRangeError):
        opforge.attention_varlen(q, k, v, beyond, wide)


@pytest.mark.parametrize("ends, message", [
    ([1, 5, 12], "from 0"), ([0, 7, 5, 12], "from 0"), ([0, 5, 11], "from 0")])
def test_lengths_that_do_not_cover_the_tokens_are_refused(ends, message, backend):
    q, k, v = _packed([12], [12])
    bad = torch.tensor(ends, dtype=torch.int32, device=DEVICE)
    sequences = len(ends) - 1
    good = cumulative([12 - 6 * (sequences - 1)] + [6] * (sequences - 1), DEVICE)
    with pytest.raises(opforge.IndexRangeError, match=message) as caught:
        opforge.attention_varlen(q, k, v, bad, good)
    assert caught.value.param == "cu_seqlens_q"
    with pytest.raises(opforge.IndexRangeError) as caught:
        opforge.attention_varlen(q, k, v, good, bad)
    assert caught.value.param == "cu_seqlens_k"


def test_lengths_are_read_once_per_version(monkeypatch, backend):
    """A packing read once is not read again (a model's layers share it: one host read, a
    synchronisation on an accelerator, instead of one per layer and pass) until an in-place
    update changes it; a bad update is then refused."""
    monkeypatch.setattr(varlen_module, "_checked", {})  # no table filled by another test
    reads = []
    real = varlen_module._ends
    monkeypatch.setattr(varlen_module, "_ends", lambda cu: reads.append(1) or real(cu))
    q, k, v = (t.requires_grad_() for t in _packed([4, 6], [5, 5]))
    cu_q, cu_k = cumulative([4, 6], DEVICE), cumulative([5, 5], DEVICE)
    out = opforge.attention_varlen(q, k, v, cu_q, cu_k, True, None, 6, 5)
    assert len(reads) == 2
    out.sum().backward()  # the backward's check: the same packing
    opforge.attention_varlen(q, k, v, cu_q, cu_k, True, None, 6, 5)
    assert len(reads) == 2
    cu_q[1] = 11  # past the 10 tokens
    with pytest.raises(opforge.IndexRangeError):
        opforge.attention_varlen(q, k, v, cu_q, cu_k, True, None, 6, 5)
    assert len(reads) == 3


def test_fusion_attention_reads_repeated_lengths_once(monkeypatch, backend):
    """CANN's TND call with the lists of the previous call (every layer of a model) reuses
    their device tensors: the lengths are checked on the host on the first call only; new
    lists are checked again."""
    import opforge.compat.torch_npu as compat

    # Neither tensors nor checks kept from another test (a full table of checks is
    # cleared, which would read the kept key lengths again).
    monkeypatch.setattr(compat, "_length_tensors", {})
    monkeypatch.setattr(varlen_module, "_checked", {})
    reads = []
    real = varlen_module._ends
    monkeypatch.setattr(varlen_module, "_ends", lambda cu: reads.append(1) or real(cu))
    q, k, v = _packed([4, 6], [5, 5])
    for _ in range(3):
        npu_fusion_attention(q, k, v, 4, "TND", scale=0.3, sparse_mode=3,
                             actual_seq_qlen=[4, 10], actual_seq_kvlen=[5, 10])
    assert len(reads) == 2
    npu_fusion_attention(q, k, v, 4, "TND", scale=0.3, sparse_mode=3,
                         actual_seq_qlen=[3, 10], actual_seq_kvlen=[5, 10])
    assert len(reads) == 3


@pytest.mark.parametrize("change, error, param", [
    (lambda q, k, v, cq, ck: (q[None], k, v, cq, ck), opforge.ShapeError, "q"),
    (lambda q, k, v, cq, ck: (q, k, v, cq, ck[:-1]), opforge.ShapeError, "cu_seqlens_k"),
    (lambda q, k, v, cq, ck: (q, k, v, cq[None], ck), opforge.ShapeError, "cu_seqlens_q"),
    (lambda q, k, v, cq, ck: (q, k, v, cq.float(), ck), opforge.DtypeError, "cu_seqlens_q"),
    (lambda q, k, v, cq, ck: (q, k[:, :1].repeat(1, 3, 1), v[:, :1].repeat(1, 3, 1), cq, ck),
     opforge.ShapeError, "k"),
    (lambda q, k, v, cq, ck: (q, k.double(), v, cq, ck), opforge.DtypeError, "k"),
])
def test_bad_arguments_get_typed_errors(change, error, param, backend):
    q, k, v = _packed([4, 6], [4, 6])
    cu = cumulative([4, 6], DEVICE)
    with pytest.raises(error) as caught:
        opforge.attention_varlen(*change(q, k, v, cu, cu.clone()))
    assert caught.value.param == param


def test_tnd_layout_arguments_are_checked():
    q, k, v = _packed([4, 6], [4, 6])
    cu = cumulative([4, 6], DEVICE)
    with pytest.raises(opforge.AttrError, match="TND") as caught:
        opforge.attention(q[None], k[None], v[None], max_seqlen_q=6)
    assert caught.value.param == "max_seqlen_q"
    with pytest.raises(opforge.AttrError, match="TND") as caught:
        opforge.attention(q, k, v, layout="TND", cu_seqlens_q=cu, cu_seqlens_k=cu, heads=4)
    assert caught.value.param == "heads"
    with pytest.raises(opforge.AttrError, match="TND"):
        opforge.attention(q, k, v, layout="TND")
    with pytest.raises(opforge.AttrError, match="TND"):
        opforge.attention(q[None], k[None], v[None], cu_seqlens_q=cu, cu_seqlens_k=cu)
    with pytest.raises(opforge.AttrError, match="attn_mask"):
        opforge.attention(q, k, v, layout="TND", cu_seqlens_q=cu, cu_seqlens_k=cu,
                          attn_mask=torch.ones(10, 10, dtype=torch.bool, device=DEVICE))


@pytest.mark.parametrize("ends, clamped_ends", [
    ([0, 6, 4096], [0, 6, 12]),     # past the tokens
    ([0, -3, 12], [0, 0, 12]),      # a negative length: an empty first sequence
    ([0, 4], [0, 4]),               # rows 4.. in no sequence
])
def test_device_side_checks_clamp_bad_lengths_to_the_tokens(ends, clamped_ends, backend):
    """Inside `opforge.device_side_checks` the lengths are not read on the host: both
    backends clamp each sequence to the tokens there are (no memory outside the tensors is
    touched), compute it as for the clamped lengths, and give rows no sequence holds 0,
    lse -inf and no gradient."""
    q, k, v = (t.requires_grad_() for t in _packed([6, 6], [6, 6]))
    bad = torch.tensor(ends, dtype=torch.int32, device=DEVICE)
    with opforge.device_side_checks():
        out, lse = opforge.attention_varlen(q, k, v, bad, bad, True, None, 12, 12,
                                            return_lse=True)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
    covered = clamped_ends[-1]
    clamped = torch.tensor(clamped_ends, dtype=torch.int32, device=DEVICE)
    expected, expected_lse = opforge.attention_varlen(
        q[:covered], k[:covered], v[:covered], clamped, clamped, True, None, 12, 12,
        return_lse=True)
    expected_grads = torch.autograd.grad(expected.sum(), (q, k, v))
    torch.testing.assert_close(out[:covered], expected, rtol=0, atol=0)
    torch.testing.assert_close(lse[:, :covered], expected_lse, rtol=0, atol=0)
    assert (out[covered:] == 0).all() and (lse[:, covered:] == -torch.inf).all()
    for grad, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, want, rtol=0, atol=0)


def test_a_sequence_past_2_to_the_31_elements_takes_wide_offsets(backend):
    """Keys whose rows lie 2^22 elements apart (a view of 4 GiB of address space, never
    written but for the rows): one sequence of 600 keys spans more than 2^31 elements,
    and the kernels' offsets take 64 bits; the result is that of a contiguous copy."""
    length, dim, stride = 600, 16, 1 << 22
    generator = torch.Generator().manual_seed(13)
    buffer = torch.empty((length - 1) * stride + dim, dtype=torch.float16, device=DEVICE)
    k = buffer.as_strided((length, 1, dim), (stride, dim, 1))
    k.copy_(torch.randn(length, 1, dim, generator=generator))
    q, v = (torch.randn(length, 1, dim, generator=generator).to(DEVICE, torch.float16)
            for _ in range(2))
    cu = cumulative([length], DEVICE)
    strided = opforge.attention_varlen(q, k, v, cu, cu, False, None, length, length)
    copied = opforge.attention_varlen(q, k.contiguous(), v, cu, cu, False, None, length,
                                      length)
    torch.testing.assert_close(strided, copied, rtol=0, atol=0)


@pytest.mark.parametrize("longest", [11, None])
def test_under_torch_compile_fullgraph(longest):
    """Compiled with the longest sequence given, or not (then no host read: the tiles are
    sized for all tokens), the gradients equal eager ones."""
    lengths = [5, 11]
    q, k, v = (t.requires_grad_() for t in _packed(lengths, lengths, seed=9))
    cu = cumulative(lengths, DEVICE)

    def loss(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return opforge.attention_varlen(q, k, v, cu, cu, True, None, longest,
                                        longest).square().sum()

    eager = torch.autograd.grad(loss(q, k, v), (q, k, v))
    compiled = torch.autograd.grad(torch.compile(loss, fullgraph=True)(q, k, v), (q, k, v))
    for a, b in zip(eager, compiled, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("sparse_mode, pre, nxt, packed_kernel", [
    (3, None, None, True), (2, None, None, False), (4, 3, 0, True), (4, 2, -1, True),
    (0, None, None, True), (0, 4, 1, False)])
def test_fusion_attention_tnd_equals_each_sequence_alone(sparse_mode, pre, nxt, packed_kernel,
                                                         monkeypatch, backend):
    """CANN's TND fusion attention on packed sequences whose key lengths differ from their
    query lengths gives each sequence what BSND gives it alone: the varlen kernels run
    every rule that is one window from each sequence's bottom-right diagonal (modes 3 and
    4, mode 0 without a band), the per-sequence path the others (mode 2 and mode 0's band
    align top-left: their windows differ between sequences of other shapes)."""
    import opforge.compat.torch_npu as compat

    packed_calls = []
    real = compat.attention_varlen
    monkeypatch.setattr(compat, "attention_varlen",
                        lambda *args, **kwargs: packed_calls.append(kwargs) or real(*args,
                                                                                    **kwargs))
    lengths, key_lengths = [5, 9, 2], [8, 9, 4]
    q, k, v = _packed(lengths, key_lengths, seed=11)
    ends_q = torch.tensor(lengths).cumsum(0).tolist()
    ends_k = torch.tensor(key_lengths).cumsum(0).tolist()
    extra = {} if pre is None else {"pre_tockens": pre, "next_tockens": nxt}
    out = npu_fusion_attention(q, k, v, 4, "TND", scale=0.2, sparse_mode=sparse_mode,
                               actual_seq_qlen=ends_q, actual_seq_kvlen=ends_k, **extra)[0]
    first_q = first_k = 0
    for sq, sk in zip(lengths, key_lengths, strict=True):
        rows, keys = slice(first_q, first_q + sq), slice(first_k, first_k + sk)
        alone = npu_fusion_attention(q[None, rows], k[None, keys], v[None, keys], 4, "BSND",
                                     scale=0.2, sparse_mode=sparse_mode, **extra)[0]
        torch.testing.assert_close(out[rows], alone[0], rtol=1e-6, atol=1e-6)
        first_q, first_k = first_q + sq, first_k + sk
    assert len(packed_calls) == packed_kernel
