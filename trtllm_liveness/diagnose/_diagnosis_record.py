"""The diagnosis record: one per snapshot (:class:`Diagnosis`), one per rank (:class:`RankDiagnosis`).

What :func:`~._diagnosis.diagnose` takes of every rank, what a host's agent sends its hub (the
records' JSON form, read back by :meth:`RankDiagnosis.from_dict`; one :class:`HostSnapshot` per
host), what the engine merges into its one view (:func:`~._diagnosis.merge_hosts`), what names a stalled rank
(:mod:`._stalled_rank`) and what the fatal verdict's log line, outcome record and termination
message are made of (:func:`~._diagnosis_text.snapshot_record`). Records only: taking a snapshot
is :mod:`._diagnosis`'s.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from .._record_fields import JsonRecord
from . import _scan
from ._stack_records import RankStacks, StackFrame

__all__ = ["Activity", "Diagnosis", "HostSnapshot", "NamingBasis", "OddRankOut", "RankDiagnosis", "StalledRank",
           "ThreadDiagnosis"]


class Activity(str, enum.Enum):
    """What one thread (or, worst of its threads, one rank) did over the window."""

    SPINNING = "spinning"  # on CPU (or runnable) through the window
    RUNNING = "running"  # some CPU, not continuously
    SLEEPING = "sleeping"
    IN_D = "in-d"
    STOPPED = "stopped"
    EXITED = "exited"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class ThreadDiagnosis(JsonRecord):
    """One thread: the scan's view (state, wchan, D time, SIGKILL) plus its CPU use over the window.

    ``cpu_fraction`` is the share of one core used over the window (None when the thread was not
    there at both CPU samples).
    """

    json_keys: ClassVar[Mapping[str, str]] = {"kill_pending": "sigkill_pending"}
    json_round: ClassVar[Mapping[str, int]] = {"cpu_fraction": 3, "d_seconds": 3}

    tid: int
    name: str
    state: str
    activity: Activity
    cpu_fraction: float | None
    wchan: str
    d_seconds: float
    kill_pending: bool


@dataclass(frozen=True)
class RankDiagnosis(JsonRecord):
    """One rank: its scan verdict, its threads, its activity and (maybe) its Python stacks.

    ``stacks`` is None when stacks were not asked for. ``report`` is the scan's report (None for a
    rank that was not scanned: remote, or its PID reused before the snapshot), not in the JSON
    form. ``host`` names the rank's host when its host's agent took it (multi-host), else is empty.
    The form's ``stuck_in`` (:attr:`stuck_where`) is derived, so recomputed on reading, never
    compared: it rests on the standard library's paths, which differ between the host that wrote
    it and this one.
    """

    json_form = ("rank", "pid", "host", "verdict", "detail", "activity", "stuck_where", "threads", "stacks")
    json_keys: ClassVar[Mapping[str, str]] = {"stuck_where": "stuck_in"}
    json_unchecked = ("stuck_where",)

    rank: int
    pid: int
    verdict: _scan.Verdict | None  # None: not scanned here (another host or PID namespace)
    detail: str
    activity: Activity
    threads: tuple[ThreadDiagnosis, ...]
    stacks: RankStacks | None = None
    report: _scan.ProcessReport | None = None
    host: str = ""  # the rank's host where its snapshot was taken by that host's agent; "" here

    @property
    def main_thread(self) -> ThreadDiagnosis | None:
        """The thread whose id is the pid."""
        return next((thread for thread in self.threads if thread.tid == self.pid), None)

    @property
    def stuck_in(self) -> StackFrame | None:
        """Where the main thread's Python code is (see :attr:`ThreadStack.stuck_in`), if known."""
        if self.stacks is None:
            return None
        main = self.stacks.main_thread(self.pid)
        return None if main is None else main.stuck_in

    @property
    def stuck_where(self) -> str | None:
        """:attr:`stuck_in` described (``function (file:line)``), if known."""
        stuck = self.stuck_in
        return None if stuck is None else stuck.describe()


@dataclass(frozen=True)
class OddRankOut(JsonRecord):
    """One rank that differs, in ``aspect``, from what all the other ranks share."""

    json_form = ("rank", "pid", "aspect", "value", "others_value", "others", "reason")

    rank: int
    pid: int
    aspect: str  # "activity", "python" (innermost Python function), "wchan" (main thread's)
    value: str
    others_value: str
    others: tuple[int, ...]

    @property
    def reason(self) -> str:
        """One line for people."""
        ranks = ", ".join(map(str, self.others))
        if self.aspect == "activity":
            return f"rank {self.rank} is {self.value} while ranks {ranks} are {self.others_value}"
        if self.aspect == "python":
            return f"rank {self.rank} is in {self.value} while ranks {ranks} are in {self.others_value}"
        return f"rank {self.rank} waits in {self.value or 'no wait channel'} while ranks {ranks} wait in " \
               f"{self.others_value or 'no wait channel'}"


@dataclass(frozen=True)
class HostSnapshot:
    """One remote host's part of a diagnosis, as its agent answered the hub
    (:meth:`~trtllm_liveness.multihost.AgentHub.snapshot`).

    ``outcome``: ``answered`` (its agent's reply to this request), ``verdict`` (no reply, but the
    snapshot its agent took at its own fatal verdict), ``lost`` (its connection is gone: nothing
    could be asked), ``no-answer`` (nothing within the bound), ``not-asked`` (its hello came after
    the request went out, or the request could not be sent to it: nothing was waited for). ``ranks`` holds one
    :class:`RankDiagnosis` per rank of the host (``host`` set; empty without an answer);
    ``iterations`` each rank's executor iterations as its agent counted them; ``truncated`` the
    ranks whose stacks were cut to fit the wire (their stacks' detail says so).
    """

    host: str
    agent_rank: int
    outcome: str
    ranks: tuple[RankDiagnosis, ...] = ()
    iterations: tuple[tuple[int, int], ...] = ()
    truncated: tuple[int, ...] = ()
    elapsed_ms: float = 0.0
    detail: str = ""

    def line(self) -> str:
        """``host b (agent rank 2): answered in 12 ms``: one host for :attr:`Diagnosis.hosts`."""
        return (f"host {self.host} (agent rank {self.agent_rank}): {self.outcome}"
                + (f" in {self.elapsed_ms:.0f} ms" if self.ranks else "")
                + (f"; stacks cut for ranks {list(self.truncated)}" if self.truncated else "")
                + (f" ({self.detail})" if self.detail else ""))


class NamingBasis(str, enum.Enum):
    """What a stalled rank's naming rests on, strongest first."""

    GONE = "gone"
    STOPPED = "stopped"
    IN_D = "in-d"
    BEHIND = "behind"
    SPINNING = "spinning"


@dataclass(frozen=True)
class StalledRank(JsonRecord):
    """The rank a stall is named after, the kind of evidence and that evidence in a few words."""

    rank: int
    pid: int
    basis: NamingBasis
    evidence: str


@dataclass(frozen=True)
class Diagnosis:
    """A snapshot of every rank; ``odd_ranks`` holds one entry per aspect that singles a rank out."""

    taken_at: float  # wall clock (time.time())
    window_s: float  # the CPU window actually measured
    elapsed_ms: float
    ranks: tuple[RankDiagnosis, ...]
    odd_ranks: tuple[OddRankOut, ...]
    scan: _scan.ScanResult
    py_spy: str  # the py-spy used, "" when none (or stacks not asked for)
    named: StalledRank | None = None  # the rank a stall of these ranks is named after, if any
    hosts: tuple[str, ...] = ()  # one line per remote host whose agent was asked (multi-host)

    @property
    def odd_rank_out(self) -> OddRankOut | None:
        """The most telling finding (activity before Python function before wait channel)."""
        return self.odd_ranks[0] if self.odd_ranks else None

    def rank(self, pid: int) -> RankDiagnosis | None:
        """The diagnosis of the rank with this pid."""
        return next((rank for rank in self.ranks if rank.pid == pid), None)

    def summary(self) -> str:
        """One line per finding, for a log record."""
        parts = [f"rank {r.rank} (pid {r.pid}{f' on host {r.host}' if r.host else ''}) {r.activity.value}"
                 + (f" in {r.stuck_in.describe()}" if r.stuck_in is not None else "") for r in self.ranks]
        odd = self.odd_rank_out
        named = f"; stalled rank: {self.named.evidence}" if self.named is not None else ""
        return "; ".join(parts) + (f"; odd rank out: {odd.reason}" if odd is not None else "") + named

    def to_dict(self, *, include_scan: bool = True) -> dict[str, Any]:
        """JSON-ready form (``include_scan=False`` when the caller prints the scan itself)."""
        data: dict[str, Any] = {
            "taken_at": self.taken_at, "window_s": round(self.window_s, 3), "elapsed_ms": round(self.elapsed_ms, 1),
            "py_spy": self.py_spy, "ranks": [rank.to_dict() for rank in self.ranks],
            "odd_ranks": [odd.to_dict() for odd in self.odd_ranks],
            "odd_rank_out": None if self.odd_rank_out is None else self.odd_rank_out.reason,
            "named": None if self.named is None else self.named.to_dict(), "hosts": list(self.hosts),
        }
        if include_scan:
            data["scan"] = self.scan.to_dict()
        return data
