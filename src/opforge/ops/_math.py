"""Portable float32 math for Triton kernels, from primitives only (no libdevice, which
triton-ascend and the interpreter lack): a sigmoid that never overflows, the normal
distribution's CDF and density with full float32 relative accuracy in the tails, and exact
bfloat16 conversions.

bfloat16 <-> float32 conversions go through integer bit operations (`widen`,
`rounded_for`): bfloat16 is the top half of a float32, so the conversions are a shift and
a round-to-nearest-even on the dropped half. The Triton interpreter's own casts truncate on
the way down and mangle subnormals both ways; the integer form gives the same bits as a
GPU's ``cvt.rn`` everywhere, and kernels compiled for a CUDA GPU round with ``cvt.rn``
itself.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable

from opforge.core.backends import interpreter_enabled

try:
    import triton
    import triton.backends
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = tl = None


def jit(function: Callable) -> Callable:
    """``triton.jit``, or the function as it is where Triton is not installed: the torch
    backend never calls a kernel, so an operator module needs no import guard."""
    return function if triton is None else triton.jit(function)


@functools.cache
def bind_functions(kernel: Callable, **functions: Callable) -> Callable:
    """``triton.jit`` of ``kernel`` (a plain function, not yet a kernel) whose globals
    named in ``functions`` are those jit functions: one kernel per set, made once.
    Why not a function passed as a ``tl.constexpr`` argument: triton-ascend's launcher
    refuses it ("Callable constexpr ... is not supported"). The copy keeps ``kernel``'s
    name and source (Triton and its interpreter read both)."""
    scope = {**kernel.__globals__, **functions}
    copy = types.FunctionType(kernel.__code__, scope, kernel.__name__, kernel.__defaults__,
                              kernel.__closure__)
    # The annotations say which parameters are constexprs.
    for attribute in ("__annotations__", "__kwdefaults__", "__qualname__", "__module__",
                      "__doc__"):
        setattr(copy, attribute, getattr(kernel, attribute))
    return jit(copy)


@jit
def finite_shift(m):
    """The value to subtract from a row (or chunk) of max ``m`` before exponentiating: 0
    for a row of only -inf, so that its exponentials are 0 (its log-sum-exp -inf, and a
    softmax's final 0 / 0 the NaN torch gives) rather than exp(-inf + inf) = NaN."""
    return tl.where(m == float("-inf"), 0.0, m)


@jit
def sigmoid_pair(z):
    """(sigmoid(z), sigmoid(-z)) without overflow: exp is only taken of -|z|."""
    e = tl.exp(-tl.abs(z))
    r = 1.0 / (1.0 + e)
    positive = z >= 0
    return tl.where(positive, r, e * r), tl.where(positive, e * r, r)


if triton is not None:
    # Triton reads module globals only as constexprs.
    INV_SQRT2 = tl.constexpr(0.7071067811865476)
    INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
    # Split factor 2^12 + 1: x * 4097 - (x * 4097 - x) keeps the top 12 bits of a float32,
    # so the square of the high part is exact.
    VELTKAMP = tl.constexpr(4097.0)
    # Beyond |x| = 10 sqrt(2), erfc(|x| / sqrt(2)) underflows float32 (erfc(10) ~ 2e-45).
    ERFC_UNDERFLOW_X = tl.constexpr(14.142135623730951)
    # Beyond |x| = 15, exp(-x^2/2) underflows float32 (exp(-112.5) ~ 1e-49).
    PDF_UNDERFLOW_X = tl.constexpr(15.0)
    # The 16-bit erfc (`_erfc_16bit`): 1 / (2 sqrt 2), log2(e) / 4, and
    # log2(1 / sqrt(2 pi)) / 2 (the density as the square of one exp2).
    INV_2_SQRT2 = tl.constexpr(0.35355339059327373)
    QUARTER_LOG2E = tl.constexpr(0.36067376022224085)
    LOG2_INV_SQRT_2PI_HALF = tl.constexpr(-0.6628740323680796)
    # |z| below this uses erf's Taylor series; above, erfc's Chebyshev fit.
    ERF_SERIES_LIMIT = tl.constexpr(0.84375)

    # Rounding increment of the 16 dropped bits (ties go to the even kept bit) and the
    # canonical bfloat16 NaN.
    BF16_HALF_ULP = tl.constexpr(0x7FFF)
    BF16_NAN = tl.constexpr(0x7FC0)
    # bfloat16 rounding in integer operations only where a cast may not round to nearest
    # even (the interpreter's truncates; triton-ascend's is not checked): compiled for a
    # CUDA GPU, cvt.rn.bf16.f32 (F2FP.BF16.F32.PACK_AB in SASS) gives the same bits for two
    # values in one instruction where the integer form takes about seven a value (sm_90
    # SASS of sigmoid's kernel, 16 values a thread: 376 -> 280 instructions;
    # silu_mul_backward's 688 -> 504).
    INTEGER_BF16_ROUNDING = tl.constexpr(interpreter_enabled()
                                         or "ascend" in triton.backends.backends)

    @triton.jit
    def widen(x):
        """``x`` (a loaded block) as float32, exactly."""
        if x.dtype == tl.bfloat16:
            return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32,
                                                                          bitcast=True)
        else:
            return x.to(tl.float32)

    @triton.jit
    def rounded_for(x, ptr):
        """float32 ``x`` rounded to nearest even in the element type of ``ptr``."""
        if INTEGER_BF16_ROUNDING:  # nested: triton-ascend (Triton 3.2) fails on an `and` here
            if ptr.dtype.element_ty == tl.bfloat16:
                bits = x.to(tl.uint32, bitcast=True)
                bits = bits + BF16_HALF_ULP + ((bits >> 16) & 1)
                upper = tl.where(x != x, BF16_NAN, bits >> 16).to(tl.uint16)
                return upper.to(tl.bfloat16, bitcast=True)
            else:
                return x.to(ptr.dtype.element_ty)
        else:
            return x.to(ptr.dtype.element_ty)

    @triton.jit
    def dot_operand(ptrs, mask, UPCAST: tl.constexpr):
        """A block loaded for ``tl.dot``: in its storage dtype for the tensor cores, or
        widened to float32 where the dot needs it (``UPCAST``: the interpreter's dot has no
        bf16)."""
        if UPCAST:
            return widen(tl.load(ptrs, mask=mask, other=0.0))
        else:
            return tl.load(ptrs, mask=mask, other=0.0)  # dot operand, kept in its dtype

    @triton.jit
    def as_dot_operand(x, like_ptr, UPCAST: tl.constexpr):
        """float32 ``x`` rounded to the element type of ``like_ptr`` to meet an operand of
        that type in ``tl.dot`` (the probabilities of attention, say); widened back under
        ``UPCAST`` so that the interpreter sees the same rounded values."""
        if UPCAST:
            return widen(rounded_for(x, like_ptr))
        else:
            return x.to(like_ptr.dtype.element_ty)

    @triton.jit
    def exp_neg_half_square(x, shift):
        """exp(shift - x*x/2) with the rounding error of x*x removed: x = hi + lo with hi
        of 12 bits, so hi*hi is exact and the small rest goes into a second exp. Without
        this, the relative error grows as x*x * 2^-24 (1e-6 at |x| = 5). ``shift`` (of
        order 1) joins the small rest, so that a caller's extra factor exp(shift) costs no
        third exp."""
        c = x * VELTKAMP
        hi = c - (c - x)
        return tl.exp(-0.5 * hi * hi) * tl.exp(shift - 0.5 * (x - hi) * (x + hi))

    @triton.jit
    def _erfc_tail(ax):
        """erfc(|x| / sqrt(2)) for |x| >= 0: Chebyshev fit with relative error < 1.2e-7
        (Numerical Recipes' erfcc), exp(-z^2) through `exp_neg_half_square`."""
        z = ax * INV_SQRT2
        t = 1.0 / (1.0 + 0.5 * z)
        p = 0.17087277
        p = p * t - 0.82215223
        p = p * t + 1.48851587
        p = p * t - 1.13520398
        p = p * t + 0.27886807
        p = p * t - 0.18628806
        p = p * t + 0.09678418
        p = p * t + 0.37409196
        p = p * t + 1.00002368
        p = p * t - 1.26551223
        safe = tl.minimum(ax, ERFC_UNDERFLOW_X)
        value = t * exp_neg_half_square(safe, p)
        return tl.where(ax > ERFC_UNDERFLOW_X, 0.0, value)

    @triton.jit
    def _erf_series(z):
        """erf(z) for |z| < 0.85: Taylor series to the z^21 term (error < 1e-9)."""
        z2 = z * z
        p = 1.4807192815879218e-08
        p = p * z2 - 1.6365844691234924e-07
        p = p * z2 + 1.6462114365889246e-06
        p = p * z2 - 1.492565035840625e-05
        p = p * z2 + 0.00012055332981789664
        p = p * z2 - 0.0008548327023450852
        p = p * z2 + 0.005223977625442188
        p = p * z2 - 0.026866170645131252
        p = p * z2 + 0.11283791670955126
        p = p * z2 - 0.37612638903183754
        p = p * z2 + 1.1283791670955126
        return z * p

    @triton.jit
    def _erfc_16bit(x):
        """erfc(|x| / sqrt(2)) = t E^2 for 16-bit results, with t = 1 / (1 + |x| /
        (2 sqrt 2)) and E = 2^(Q(t) - x^2 log2(e) / 4). Q is a near-minimax degree-8 fit
        (Lawson's reweighted least squares over |x| <= 14.2) of (log2(erfc(z) / t) +
        z^2 log2(e)) / 2, z = |x| / sqrt 2: error 1.8e-8 for |x| < 2, where gelu's
        derivative cancels (near x = -0.75 an error of Phi grows 300-fold), 5.5e-7
        beyond. Q(1) = 0 holds in float32: the constant coefficient is minus the Horner
        sum of the others at t = 1, so erfc(0) is exactly 1 and the gelu of a subnormal x,
        x / 2 at a rounding midpoint, rounds to even as the golden's does (no bias).

        On a GPU the rsqrt and the exp2 are one MUFU instruction each, where 1 / d and exp
        take eight and five (their range fix-ups: d lies in [1, inf)). exp2 flushes
        subnormal results to zero there; E stays normal up to |x| = 18.7, past erfc's
        underflow at 14.1, so t E E still rounds into the subnormals as the golden does.
        Relative error (float32 simulation against float64): 6.2e-7 for |x| < 2, 2.1e-6
        for |x| < 5, 1e-5 out to the underflow (the rounding of x^2 log2(e) / 4)."""
        t = tl.math.rsqrt(1.0 + tl.abs(x) * INV_2_SQRT2)
        t = t * t
        q = 0.09082246
        q = q * t - 0.56525856
        q = q * t + 1.4003243
        q = q * t - 1.6620203
        q = q * t + 0.86671346
        q = q * t - 0.27255344
        q = q * t + 0.3412979
        q = q * t + 0.713154
        q = q * t - 0.9124799
        root = tl.exp2(q - x * (x * QUARTER_LOG2E))
        return t * root * root

    @triton.jit
    def normal_cdf(x, EXACT: tl.constexpr):
        """Phi(x) = (1 + erf(x / sqrt(2))) / 2 with float32 relative accuracy everywhere:
        the left tail is erfc(|x|/sqrt(2)) / 2 directly, never 1 + erf (which cancels).
        ``EXACT`` (float32 results): erf's series near 0 and the split exp of the tails;
        else (16-bit results) `_erfc_16bit` everywhere: within 4.2e-7 relative for
        x >= 0 and 1e-5 in the left tail, where a 16-bit ulp is 5e-4 or more."""
        if EXACT:
            half_tail = 0.5 * _erfc_tail(tl.abs(x))
            tail = tl.where(x < 0, half_tail, 1.0 - half_tail)
            z = x * INV_SQRT2
            series = 0.5 + 0.5 * _erf_series(tl.minimum(tl.maximum(z, -1.0), 1.0))
            return tl.where(tl.abs(z) < ERF_SERIES_LIMIT, series, tail)
        else:
            tail = _erfc_16bit(x)
            return 0.5 * tl.where(x < 0, tail, 2.0 - tail)

    @triton.jit
    def normal_pdf(x, EXACT: tl.constexpr):
        """phi(x) = exp(-x^2/2) / sqrt(2 pi). ``EXACT``: through `exp_neg_half_square`,
        exactly 0 beyond |x| = 15 (where the split of x, x * 4097, would overflow for huge
        |x|); else as the square of one exp2 (as in `_erfc_16bit`, whose x^2 product
        it shares): relative error grows with x^2 (float32 simulation against float64:
        3.7e-7 for |x| < 2, 1.3e-6 for |x| < 5, 1.1e-5 to the subnormals at |x| = 13.1)."""
        if EXACT:
            safe = tl.minimum(tl.maximum(x, -PDF_UNDERFLOW_X), PDF_UNDERFLOW_X)
            return exp_neg_half_square(safe, 0.0) * INV_SQRT_2PI
        else:
            # The tensor first: a constexpr minus a tensor stays a constexpr in the
            # interpreter.
            root = tl.exp2(-x * (x * QUARTER_LOG2E) + LOG2_INV_SQRT_2PI_HALF)
            return root * root
else:  # pragma: no cover - without Triton the torch backend runs and calls no kernel
    widen = rounded_for = None
