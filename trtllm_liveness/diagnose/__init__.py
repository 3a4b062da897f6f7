"""Where is every rank stuck: bounded snapshots for an operator and for a fatal error.

- :mod:`._scan`: sampling of processes over a window (state, ``D`` time, wait channel) behind
  ``trtllm-liveness scan``, and the selection of processes to sample;
- :mod:`._diagnosis`: :func:`diagnose`, per rank its activity, stacks (py-spy) and the odd rank out;
- :mod:`._diagnosis_text`: its plain-text rendering.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ._diagnosis import Diagnosis as Diagnosis
    from ._diagnosis import OddRankOut as OddRankOut
    from ._diagnosis import RankDiagnosis as RankDiagnosis
    from ._diagnosis import diagnose as diagnose
    from ._diagnosis import take_stacks as take_stacks
    from ._scan import ProcessReport as ProcessReport
    from ._scan import ScanResult as ScanResult
    from ._scan import scan as scan
    from ._scan import select as select

__all__ = [
    "Diagnosis",
    "OddRankOut",
    "ProcessReport",
    "RankDiagnosis",
    "ScanResult",
    "diagnose",
    "scan",
    "select",
    "take_stacks",
]

_SOURCES = {
    "Diagnosis": "_diagnosis",
    "RankDiagnosis": "_diagnosis",
    "OddRankOut": "_diagnosis",
    "diagnose": "_diagnosis",
    "take_stacks": "_diagnosis",
    "ScanResult": "_scan",
    "ProcessReport": "_scan",
    "scan": "_scan",
    "select": "_scan",
}

if not TYPE_CHECKING:
    from .._lazy import lazy_exports

    __getattr__, __dir__ = lazy_exports(__name__, _SOURCES, globals())
