"""Precision tooling: metrics against a float64 golden, vendor standards, verification,
the training anomaly monitor, and dump-and-compare."""

from opforge.precision import cases
from opforge.precision.dump import Dump, DumpError, dump
from opforge.precision.metrics import Metrics, WorstElement, compare_tensors
from opforge.precision.monitor import Alert, Monitor
from opforge.precision.standards import CATEGORIES, THRESHOLDS, Verdict, judge

__all__ = ["CATEGORIES", "THRESHOLDS", "Alert", "Dump", "DumpError", "Metrics", "Monitor",
           "Verdict", "WorstElement", "cases", "compare_tensors", "dump", "judge"]
