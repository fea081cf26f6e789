"""Profiling for operator developers: timeline, kernel and operator tables, roofline verdicts.

``with opforge.profile("prof_dir") as prof: ...; prof.step()`` records a run with
torch.profiler (torch_npu.profiler on Ascend) and writes torch_npu-style files plus a
self-contained ``report.html``; ``opforge.profiler.analyse(dir)`` reads them back.
``opforge bench`` (`opforge.profiler.bench`) measures operators against their peers.
"""

from opforge.profiler.report import FILES, Report, analyse
from opforge.profiler.roofline import Verdict, judge
from opforge.profiler.session import Profile, profile

__all__ = ["FILES", "Profile", "Report", "Verdict", "analyse", "judge", "profile"]
