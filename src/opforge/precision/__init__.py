"""Precision tooling: metrics against a float64 golden, vendor standards, verification."""

from opforge.precision.metrics import Metrics, WorstElement, compare_tensors
from opforge.precision.standards import CATEGORIES, THRESHOLDS, Verdict, judge

__all__ = ["CATEGORIES", "THRESHOLDS", "Metrics", "Verdict", "WorstElement", "compare_tensors",
           "judge"]
