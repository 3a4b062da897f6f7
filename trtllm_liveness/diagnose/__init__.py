"""Where is every rank stuck: bounded snapshots for an operator and for a fatal error.

- :mod:`._process_selection`: which processes to sample (name, parent, cgroup filters);
- :mod:`._scan`: sampling of processes over a window (state, ``D`` time, wait channel) behind
  ``trtllm-liveness scan``;
- :mod:`._diagnosis_record`: the diagnosis record, one per snapshot and one per rank (also on
  the hosts' wire), and one per remote host;
- :mod:`._diagnosis`: :func:`diagnose`, per rank its activity, stacks and the odd rank out, and
  the remote hosts' ranks merged in;
- :mod:`._stack_records`: a rank's Python stacks as records, whichever source took them;
- :mod:`._py_spy`: a rank's Python stacks by ``py-spy``, bounded;
- :mod:`._faulthandler_stacks`: a rank's Python stacks by its own ``faulthandler`` dump (no
  ptrace): registered at the rank's start, signalled and read by a snapshot;
- :mod:`._stack_sources`: which of the two takes each rank's stacks;
- :mod:`._stalled_rank`: the rank a stall is named after, from evidence;
- :mod:`._diagnosis_text`: the diagnosis's plain-text rendering.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ._diagnosis import diagnose, stalled_rank_of
    from ._diagnosis_record import Diagnosis, OddRankOut, RankDiagnosis, StalledRank
    from ._faulthandler_stacks import register_stack_dump, take_faulthandler_stacks
    from ._process_selection import Selection, select
    from ._py_spy import take_stacks
    from ._scan import ProcessReport, ScanResult, scan
    from ._stalled_rank import name_stalled_rank

__all__ = ["Diagnosis", "OddRankOut", "ProcessReport", "RankDiagnosis", "ScanResult", "Selection", "StalledRank",
           "diagnose", "name_stalled_rank", "register_stack_dump", "scan", "select", "stalled_rank_of",
           "take_faulthandler_stacks", "take_stacks"]

_SOURCES = {
    "._diagnosis": ("diagnose", "stalled_rank_of"),
    "._diagnosis_record": ("Diagnosis", "OddRankOut", "RankDiagnosis", "StalledRank"),
    "._faulthandler_stacks": ("register_stack_dump", "take_faulthandler_stacks"),
    "._process_selection": ("Selection", "select"),
    "._py_spy": ("take_stacks",),
    "._scan": ("ProcessReport", "ScanResult", "scan"),
    "._stalled_rank": ("name_stalled_rank",),
}

if not TYPE_CHECKING:
    from .._lazy import lazy_exports

    __getattr__, __dir__ = lazy_exports(__name__, _SOURCES, globals())
