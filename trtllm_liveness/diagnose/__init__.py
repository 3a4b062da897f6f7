"""Where is every rank stuck: bounded snapshots for an operator and for a fatal error.

- :mod:`._process_selection`: which processes to sample (name, parent, cgroup filters);
- :mod:`._scan`: sampling of processes over a window (state, ``D`` time, wait channel) behind
  ``trtllm-liveness scan``;
- :mod:`._diagnosis`: :func:`diagnose`, per rank its activity, stacks and the odd rank out;
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
    from ._diagnosis import Diagnosis as Diagnosis
    from ._diagnosis import OddRankOut as OddRankOut
    from ._diagnosis import RankDiagnosis as RankDiagnosis
    from ._diagnosis import diagnose as diagnose
    from ._faulthandler_stacks import register_stack_dump as register_stack_dump
    from ._faulthandler_stacks import take_faulthandler_stacks as take_faulthandler_stacks
    from ._process_selection import Selection as Selection
    from ._process_selection import select as select
    from ._py_spy import take_stacks as take_stacks
    from ._scan import ProcessReport as ProcessReport
    from ._scan import ScanResult as ScanResult
    from ._scan import scan as scan
    from ._stalled_rank import StalledRank as StalledRank
    from ._stalled_rank import name_stalled_rank as name_stalled_rank
    from ._stalled_rank import stalled_rank_of as stalled_rank_of

__all__ = [
    "Diagnosis",
    "OddRankOut",
    "ProcessReport",
    "RankDiagnosis",
    "ScanResult",
    "Selection",
    "StalledRank",
    "diagnose",
    "name_stalled_rank",
    "register_stack_dump",
    "scan",
    "select",
    "stalled_rank_of",
    "take_faulthandler_stacks",
    "take_stacks",
]

_SOURCES = {
    "Diagnosis": "_diagnosis",
    "RankDiagnosis": "_diagnosis",
    "OddRankOut": "_diagnosis",
    "diagnose": "_diagnosis",
    "take_stacks": "_py_spy",
    "register_stack_dump": "_faulthandler_stacks",
    "take_faulthandler_stacks": "_faulthandler_stacks",
    "StalledRank": "_stalled_rank",
    "name_stalled_rank": "_stalled_rank",
    "stalled_rank_of": "_stalled_rank",
    "ScanResult": "_scan",
    "ProcessReport": "_scan",
    "scan": "_scan",
    "select": "_process_selection",
    "Selection": "_process_selection",
}

if not TYPE_CHECKING:
    from .._lazy import lazy_exports

    __getattr__, __dir__ = lazy_exports(__name__, _SOURCES, globals())
