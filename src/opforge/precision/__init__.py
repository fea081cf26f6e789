"""Precision tooling: metrics against a float64 golden, vendor standards, verification,
and the training anomaly monitor."""

from opforge.precision.metrics import Metrics, WorstElement, compare_tensors
from opforge.precision.monitor import Alert, Monitor
from opforge.precision.standards import CATEGORIES, THRESHOLDS, Verdict, judge

__all__ = ["CATEGORIES", "THRESHOLDS", "Alert", "Metrics", "Monitor", "Verdict", "WorstElement",
           "compare_tensors", "judge"]
