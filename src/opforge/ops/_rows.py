"""Pieces shared by the row-reduction operators (softmax, the norms)."""

from __future__ import annotations

from opforge.core.opdef import KnownLimitation

SHARED_ROW_STATISTIC = KnownLimitation(
    "Every output of a row is computed from one rounded row statistic (a sum, its log, a "
    "norm, or the gradient's row sum), so a row's errors lean the way that statistic was "
    "rounded, and rows of equal inputs round all their outputs the same way: the error "
    "balance of a few rows says which way their statistics happened to round, for opforge "
    "and torch alike. The errors themselves stay within the max eps bound of the test "
    "suite.", failures="eb ratio*")
OVERFLOWING_ROW_SUM = KnownLimitation(
    "Row sums of gradients are accumulated in float32: gradients near the float32 maximum "
    "overflow them to Inf although the exact sum is finite (torch's kernels accumulate in "
    "float32 too).", case="large_*", failures="*NaN/Inf*")
CANCELLING_GRADIENT = (
    "The gradient cancels at some elements (grad_x = rstd (g - x_hat mean(g x_hat)), "
    "grad_weight = sum over rows of grad x_hat): there an error of an ulp of the terms is a "
    "large relative error of the result. opforge and torch both compute in float32 and lose "
    "the same absolute accuracy; which has the larger worst relative error is rounding "
    "luck. Errors against the condition-aware scale stay within the test suite's bound.")
OVERFLOWING_ROW_SUMS = KnownLimitation(
    "The row mean is a float32 sum: a row whose sum passes 3.4e38 (values within a factor "
    "of N of float32's largest, as these cases' 0.25-0.5 x 3.4e38) overflows it to Inf, "
    "and the row's outputs are NaN, although float64 holds them. The squares no longer "
    "overflow or underflow (a row whose variance comes out Inf, NaN or below 2^-100 is "
    "summed again, scaled by a power of two), but such rows also have an rstd below "
    "float32's smallest normal, which keeps fewer bits. Only inputs within a factor of N of "
    "float32's largest value reach this.", case="large_*",
    failures=("*NaN/Inf*", "*ratio*"))
