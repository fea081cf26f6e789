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
OVERFLOWING_SQUARES = KnownLimitation(
    "Row statistics are float32 sums of squares: they overflow once the row's sum of "
    "squares passes 3.4e38 (one value beyond 1.8e19, or N values beyond 1.8e19 / sqrt(N): "
    "2.6e17 in a row of 5000), although float64 holds them; the variance becomes Inf and "
    "rstd 0, so the row's outputs are 0 (or NaN), and subnormal rows with eps = 0 give a "
    "variance of 0 and Inf outputs. torch's CPU LayerNorm keeps such rows finite; rescaling "
    "each row by its largest magnitude before squaring would too, and is not done yet. "
    "Only inputs within a few orders of float32's extremes reach this.", case="large_*",
    failures=("*NaN/Inf*", "*ratio*"))
