"""Point-in-time diagnosis of processes for an operator: the engine behind ``trtllm-liveness scan``.

A scan samples each process several times over a short window (default 1 s, 5 samples) and
reports, per process and per thread: the state letter, how long a thread was seen in ``D``
(uninterruptible sleep) without interruption, whether SIGKILL is pending, the kernel wait channel,
and whether the process is a zombie. From those it gives a verdict and the action to take:

- ``unkillable``: SIGKILL pending on two consecutive samples, whatever the state (a thread in ``D``
  must not have run between them: the monitor's :class:`~trtllm_liveness.monitor._wedge.WedgeTracker`
  rule; docs/diagnosis.md, "Unkillable in any state", has the rest). Nothing in user space can end
  it; it still holds its GPU/NIC, so the host must be drained and recycled.
- ``d-state``: a thread in ``D`` on every sample of the window without a context switch between
  them (the kernel's hung-task rule, docs/diagnosis.md "When ``D`` is a wedge"): probably wedged in
  a driver, NCCL or RDMA.
- ``stopped``: ``T``/``t`` (SIGSTOP or a tracer): alive, stuck, but killable.
- ``zombie``: exited, not yet reaped by its parent. ``gone``: vanished or PID reused during the scan.

Reading never hangs the scan: the command line goes through
:class:`~trtllm_liveness.process._mm_read.MmReader` (docs/cli.md, "``scan`` never hangs on a wedged
host"). Which processes to scan is :mod:`._process_selection`'s job.

Parsing stays in :mod:`trtllm_liveness.process._procfs`; the ``D`` rules come from
:mod:`trtllm_liveness.monitor._wedge`. Standard library only; this module never sends a signal.
"""

from __future__ import annotations

import contextlib
import enum
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .._record_fields import JsonRecord
from ..monitor._wedge import WedgeTracker
from ..process import _procfs
from ..process._mm_read import DEFAULT_TIMEOUT_S, MmReader, SkippedRead, read_cmdline
from ..process._thread_sampler import sample_d_state

RECYCLE_ADVICE = (
    "recycle the host: drain it, then reboot it; a task in D with SIGKILL pending keeps its GPU/NIC "
    "until the kernel lets go, and no signal will end it; do not start new workers on this host"
)


class Verdict(str, enum.Enum):
    """What a scan concludes about one process, from best to worst within its kind."""

    OK = "ok"
    STOPPED = "stopped"
    D_STATE = "d-state"
    UNKILLABLE = "unkillable"
    ZOMBIE = "zombie"
    GONE = "gone"
    ACCESS_DENIED = "access-denied"

    @property
    def is_stuck(self) -> bool:
        """Alive but not making progress (stopped, in ``D``, unkillable)."""
        return self in (Verdict.STOPPED, Verdict.D_STATE, Verdict.UNKILLABLE)

    @property
    def is_dead(self) -> bool:
        """Exited (zombie) or no longer there."""
        return self in (Verdict.ZOMBIE, Verdict.GONE)


@dataclass(frozen=True)
class ThreadReport(JsonRecord):
    """One thread at the last sample of a scan.

    ``d_seconds`` is how long the thread had been seen in ``D`` without interruption up to the
    last sample (a lower bound: it may have been in ``D`` before the first one); 0 when it was not
    in ``D`` at the last sample. ``d_samples`` counts the samples that saw it in ``D``.
    """

    json_keys: ClassVar[Mapping[str, str]] = {"kill_pending": "sigkill_pending"}
    json_round: ClassVar[Mapping[str, int]] = {"d_seconds": 3}

    tid: int
    name: str
    state: str
    d_seconds: float
    d_samples: int
    kill_pending: bool
    wchan: str


@dataclass(frozen=True)
class ProcessReport(JsonRecord):
    """The result of scanning one process: what was seen, the verdict, and what to do."""

    json_form = ("pid", "comm", "cmdline", "ppid", "state", "verdict", "unkillable", "zombie", "detail", "advice",
                 "kill_pending", "d_seconds", "samples", "exit_status", "threads", "skipped")
    json_keys = ThreadReport.json_keys
    json_round = ThreadReport.json_round

    pid: int
    comm: str
    cmdline: tuple[str, ...]
    ppid: int
    state: str
    verdict: Verdict
    detail: str
    advice: str
    kill_pending: bool
    d_seconds: float
    samples: int
    exit_status: str = ""
    threads: tuple[ThreadReport, ...] = ()
    # Reads that take the target's mm lock and were not made or timed out (cmdline is then empty).
    skipped: tuple[SkippedRead, ...] = ()

    @property
    def unkillable(self) -> bool:
        """SIGKILL pending in ``D`` across samples: only recycling the host ends it."""
        return self.verdict is Verdict.UNKILLABLE

    @property
    def zombie(self) -> bool:
        """Exited, not yet reaped by its parent."""
        return self.verdict is Verdict.ZOMBIE

    @property
    def flagged(self) -> bool:
        """Anything other than a healthy running or sleeping process."""
        return self.verdict is not Verdict.OK


@dataclass(frozen=True)
class ScanResult:
    """Every process of one scan, in the order given."""

    window_s: float
    samples: int
    processes: tuple[ProcessReport, ...]

    @property
    def unkillable(self) -> list[ProcessReport]:
        """The processes only a host recycle will end."""
        return [report for report in self.processes if report.unkillable]

    @property
    def skipped(self) -> list[SkippedRead]:
        """Every read skipped in the reports, in process order."""
        return [skip for report in self.processes for skip in report.skipped]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        unkillable = self.unkillable
        return {
            "window_s": self.window_s,
            "samples": self.samples,
            "processes": [report.to_dict() for report in self.processes],
            "flagged": sum(1 for report in self.processes if report.flagged),
            "unkillable": len(unkillable),
            "skipped_reads": len(self.skipped),
            "advice": RECYCLE_ADVICE if unkillable else "",
        }


@dataclass
class _ThreadTrack:
    d_since: float | None = None
    d_samples: int = 0


@dataclass
class _ProcessSampler:
    """Accumulates the samples of one process. Not thread-safe; one scan owns it."""

    pid: int
    start_time: int | None = None
    info: _procfs.StatInfo | None = None
    gone: str = ""
    denied: bool = False
    samples: int = 0
    kill_pending_samples: int = 0  # consecutive samples with SIGKILL pending and no thread in D
    first_now: float = 0.0
    last_now: float = 0.0
    wedge: WedgeTracker = field(default_factory=lambda: WedgeTracker(math.inf))
    threads: dict[int, _ThreadTrack] = field(default_factory=dict)
    last_states: dict[int, str] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return bool(self.gone) or self.denied

    @property
    def saw_d(self) -> bool:
        """A thread was in D at the last sample."""
        return any(state in _procfs.UNINTERRUPTIBLE_STATES for state in self.last_states.values())

    def sample(self, now: float) -> None:
        if self.finished:
            return
        try:
            info = _procfs.read_stat(self.pid)
            if self.start_time is None:
                self.start_time = info.start_time
            elif info.start_time != self.start_time:
                self.gone = "exited during the scan (PID already reused)"
                return
            states = _procfs.read_thread_states(self.pid)
            d_sample = sample_d_state(self.pid) if info.state not in _procfs.EXITED_STATES else None
            pending = _procfs.sigkill_stuck(self.pid, info)  # the any-state rule; D is the tracker's
        except (FileNotFoundError, ProcessLookupError):
            self.gone = "no such process" if self.samples == 0 else "exited during the scan"
            return
        except PermissionError:
            self.denied = True
            return
        self.info = info
        if self.samples == 0:
            self.first_now = now
        self.samples += 1
        self.last_now = now
        self.last_states = states
        # The tracker's rules are the monitor's: a thread stuck (D, no context switch) since a
        # sample, and UNKILLABLE (SIGKILL pending on two consecutive samples, a thread stuck across
        # them); its WEDGED timeout is infinite here because the scan judges "stuck since the first
        # sample" itself. A process with a thread in D is judged by those rules alone.
        self.wedge.observe(d_sample, now)
        self.kill_pending_samples = self.kill_pending_samples + 1 if pending and d_sample is None else 0
        for tid, state in states.items():
            track = self.threads.setdefault(tid, _ThreadTrack())
            if state in _procfs.UNINTERRUPTIBLE_STATES:
                track.d_samples += 1
                if track.d_since is None:
                    track.d_since = now
            else:
                track.d_since = None
        for tid in list(self.threads):
            if tid not in states:
                del self.threads[tid]

    def report(self, window_s: float, reader: MmReader) -> ProcessReport:
        if self.denied or (self.info is None and not self.gone):
            return ProcessReport(
                self.pid, "", (), 0, "", Verdict.ACCESS_DENIED,
                "permission denied reading its /proc entry", "run the scan as root or as the process owner",
                False, 0.0, self.samples,
            )
        info = self.info
        if info is None:
            return ProcessReport(self.pid, "", (), 0, "", Verdict.GONE, self.gone, "", False, 0.0, 0)
        threads = tuple(self._thread_reports())
        # The freshest thread states (just read): a thread in D may hold the mm lock the command
        # line read needs, so it is not read at all; otherwise it is read with a deadline.
        d_threads = [thread for thread in threads if thread.state in _procfs.UNINTERRUPTIBLE_STATES]
        cmdline, skip = read_cmdline(self.pid, reader, [thread.tid for thread in d_threads])
        skipped = () if skip is None else (skip,)
        if self.gone:
            return ProcessReport(
                self.pid, info.comm, cmdline, info.ppid, "", Verdict.GONE, self.gone, "", False, 0.0,
                self.samples, threads=threads, skipped=skipped,
            )
        kill_pending = _thread_kill_pending(self.pid, None) or any(
            thread.kill_pending for thread in threads
        )
        d_seconds = self.wedge.stuck_seconds(self.last_now)
        # The thread the rules single out (stuck longest; the unkillable one), else the first in D.
        named = self.wedge.unkillable_tid or self.wedge.stuck_tid()
        first_d = next((thread for thread in d_threads if thread.tid == named), d_threads[0] if d_threads else None)
        where = "" if first_d is None else f"thread {first_d.tid} ({first_d.name}) wchan {first_d.wchan or '?'}"

        def judged(verdict: Verdict, detail: str, advice: str = "", d_seconds: float = 0.0,
                   exit_status: str = "") -> ProcessReport:
            return ProcessReport(info.pid, info.comm, cmdline, info.ppid, info.state, verdict, detail, advice,
                                 kill_pending, d_seconds, self.samples, exit_status, threads, skipped)

        if info.state in _procfs.EXITED_STATES:
            status = "" if info.exit_code is None else _procfs.describe_wait_status(info.exit_code)
            detail = "exited, not yet reaped" + (f" ({status})" if status else "")
            advice = (
                f"its parent (pid {info.ppid}) has not reaped it; if the parent is the engine, the engine "
                "has not noticed the death: restart the engine"
            )
            return judged(Verdict.ZOMBIE, detail, advice, exit_status=status)
        held_d = self.wedge.unkillable_tid is not None and first_d is not None
        if held_d or self.kill_pending_samples >= 2:
            from ..stop._survivor import sample_survivor  # state, wait channel, kernel stack (root)

            seen = sample_survivor(self.pid, reader=reader).describe()
            detail = (f"in D with SIGKILL pending and no context switch for at least {d_seconds:.1f}s: {where} ({seen})"
                      if held_d else
                      f"SIGKILL pending on {self.kill_pending_samples} consecutive samples, not in D: {seen}")
            return judged(Verdict.UNKILLABLE, detail, RECYCLE_ADVICE, d_seconds)
        # Stuck since the first sample: in D on every sample, never switching in between.
        stuck_all_along = self.wedge.stuck_since == self.first_now and first_d is not None
        if stuck_all_along and (self.samples >= 2 or window_s <= 0):
            pending = "; SIGKILL pending" if kill_pending else ""
            how = (f"on every sample with no context switch, at least {d_seconds:.1f}s" if self.samples >= 2 else
                   "at the only sample (one sample cannot tell a wedge from slow I/O)")
            detail = f"in uninterruptible sleep (D) {how}: {where}{pending}"
            advice = (
                "probably wedged in a driver, NCCL or RDMA; scan again with a longer --window; if it stays "
                "in D, SIGKILL it and scan again: if SIGKILL stays pending, " + RECYCLE_ADVICE
            )
            return judged(Verdict.D_STATE, detail, advice, d_seconds)
        if info.state in _procfs.STOPPED_STATES:
            how = "by a tracer" if info.state == "t" else "by a signal (SIGSTOP/SIGTSTP)"
            return judged(Verdict.STOPPED, f"stopped {how}", "SIGCONT resumes it; SIGKILL ends it")
        seen_d = max((track.d_samples for track in self.threads.values()), default=0)
        detail = ""
        if seen_d == self.samples > 1:
            detail = f"in D on {seen_d} of {self.samples} samples, with context switches between them (making progress)"
        elif seen_d:
            detail = f"briefly in D ({seen_d} of {self.samples} samples)"
        return judged(Verdict.OK, detail, "", d_seconds)

    def _thread_reports(self) -> Iterable[ThreadReport]:
        for tid in sorted(self.last_states):
            track = self.threads.get(tid, _ThreadTrack())
            try:
                stat = _procfs.read_stat(self.pid, tid)
            except OSError:
                continue  # the thread exited since the last sample
            in_d = stat.state in _procfs.UNINTERRUPTIBLE_STATES
            d_seconds = self.last_now - track.d_since if in_d and track.d_since is not None else 0.0
            yield ThreadReport(
                tid=tid,
                name=stat.comm,
                state=stat.state,
                d_seconds=d_seconds,
                d_samples=track.d_samples,
                kill_pending=_thread_kill_pending(self.pid, tid),
                wchan=wchan_or_empty(self.pid, tid),
            )


def _thread_kill_pending(pid: int, tid: int | None) -> bool:
    try:
        return _procfs.sigkill_pending(pid, tid)
    except OSError:
        return False


def wchan_or_empty(pid: int, tid: int) -> str:
    """Thread ``tid``'s wait channel; ``""`` when it cannot be read (gone, not permitted)."""
    try:
        return _procfs.read_wchan(pid, tid)
    except OSError:
        return ""


def scan(
    pids: Sequence[int],
    *,
    window_s: float = 1.0,
    samples: int = 5,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    read_timeout_s: float = DEFAULT_TIMEOUT_S,
    reader: MmReader | None = None,
) -> ScanResult:
    """Sample ``pids`` ``samples`` times, evenly over ``window_s`` seconds, and judge each one.

    Blocks for about ``window_s`` seconds (one deadline; the reads themselves take microseconds
    per thread), plus at most ``read_timeout_s`` per process whose command line read hangs on its
    mm lock, up to the reader's bound on stuck helpers (then such reads are skipped at once). The
    command line of a process with a thread in ``D`` is not read; every skip is in the report's
    ``skipped``. ``reader`` (default: a fresh :class:`MmReader` with ``read_timeout_s``) lets a
    caller share one bound on stuck helpers with :func:`select`. ``window_s <= 0`` or
    ``samples == 1`` takes one sample, which cannot confirm a wedge or an unkillable process.
    When the first sample sees no thread in D and no SIGKILL pending in any process, the scan ends there (nothing is
    left to confirm; a healthy scan then takes milliseconds): ``ScanResult.samples`` is 1 and
    ``window_s`` 0.
    Never raises for a process that is gone or unreadable: that is its verdict. Raises
    ``ValueError`` for ``samples < 1`` or ``read_timeout_s <= 0``. Thread-safe (no shared state).
    """
    if samples < 1:
        raise ValueError("samples must be at least 1")
    mm_reader = MmReader(read_timeout_s) if reader is None else reader
    if window_s <= 0:
        samples = 1
    samplers = [_ProcessSampler(pid) for pid in pids]
    start = clock()
    interval = window_s / (samples - 1) if samples > 1 else 0.0
    taken = 0
    for index in range(samples):
        now = clock()
        for sampler in samplers:
            sampler.sample(now)
        taken += 1
        # The window only confirms what a sample saw in D (D on every sample) or with SIGKILL
        # pending (twice, in any state): when the first sample sees neither, no later one can make
        # a d-state or unkillable verdict, and every other verdict is read from one sample. Ending
        # here keeps a healthy scan well under a probe's timeout (Kubernetes: 1 s).
        if index == 0 and not any(sampler.saw_d or sampler.kill_pending_samples for sampler in samplers):
            break
        if index + 1 < samples:
            remaining = start + interval * (index + 1) - clock()
            if remaining > 0:
                sleep(remaining)
    with mm_reader if reader is None else contextlib.nullcontext():  # a reader of its own is closed after
        reports = tuple(sampler.report(window_s, mm_reader) for sampler in samplers)
    return ScanResult(window_s if taken > 1 else 0.0, taken, reports)
