"""What one engine does about stalls and diagnoses: progress in, stall out, evidence kept.

:class:`EngineStall` ties together, for one proxy:

- the progress sources: executor iterations reported by the ranks
  (:class:`._progress.ProgressChannel`), submissions on an idle engine (the clock starts), and,
  where no rank reports iterations, output: the activity of upstream's dispatch thread, sampled
  (:func:`dispatch_activity`; nothing runs per response);
- the :class:`~trtllm_liveness.monitor._stall_timer.StallDetector` (armed at READY: nothing is pending before);
- what a stall does (``stall_action``; docs/stalls.md says what each shows): ``report`` sets the
  ranks ``stalled`` in the monitor's statuses and logs the WARNING; ``fatal`` delivers a
  ``stalled`` event through the monitor, which takes the fatal path a death takes.

:class:`Diagnoser` takes the bounded snapshot of the local ranks (``_diagnosis.diagnose``, with
Python stacks from ``py-spy`` or the ranks' own faulthandler dumps, and their iteration counts) in
a daemon thread at a stall, a wedge and every fatal error (that one quick, and before the bounded
stop signals a rank: the stop waits for it, ``diagnosis_before_stop_s`` at most), keeps the latest
for ``liveness_diagnosis()`` and logs it. One diagnosis runs at a time;
a request while one runs is dropped (the running one is as fresh).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ..._events import EventKind, WorkerEvent
from ...diagnose._stalled_rank import StalledRank, stalled_rank_now  # procfs reads only: ready before the first stall
from ...exit._process_ending import OwnedThreads
from ...monitor._progress_clock import ProgressClock
from ...monitor._stall_timer import ProgressSource, StallDetector, StallInfo
from ...process._identity import ProcessIdentity
from ...process._procfs import read_status

if TYPE_CHECKING:
    from ...diagnose._diagnosis import Diagnosis
    from ...diagnose._diagnosis_record import HostSnapshot, RankDiagnosis
    from ...monitor._monitor import WorkerProcessMonitor
    from ._progress import IterationBeat, ProgressChannel
    from ._worker_spec import ProgressSpec

logger = logging.getLogger(__name__.rpartition(".")[0])

BEAT_INTERVAL_MAX_S = 1.0
DIAGNOSIS_BOUND_S = 5.0
"""How long a diagnosis may run before its owner stops waiting for it: the thread window and
py-spy's deadline (2 s, plus its kill), and py-spy's one-time probe."""
SNAPSHOT_CPU_WINDOW_S = 0.1
"""The fatal verdict's snapshot measures each thread's CPU over this long (10 ticks at 100 Hz)."""
SNAPSHOT_STACKS_S = 0.15
"""The fatal verdict's snapshot gives the ranks' Python stacks this long (py-spy or their dumps)."""
REMOTE_STACKS_S = 0.3
"""Each remote host's agent gives its ranks' stacks this long in the fatal verdict's snapshot."""
AFTER_FATAL_DELAY_S = 0.05
"""A diagnosis after a fatal error starts this much later: the threads that observe the failure
(health probes, the readers of the failed requests) get the interpreter first."""


def pending_count(proxy: Any) -> int:
    """How many requests of ``proxy`` (None: a dropped engine, none) wait for their final response."""
    # Upstream's _results holds every request whose final response has not been dispatched
    # (docs/upstream-contract.md); len() of a dict is atomic, so any thread may read it.
    results = getattr(proxy, "_results", None)
    return len(results) if isinstance(results, dict) else 0


def dispatch_activity(ref: weakref.ReferenceType[Any]) -> Callable[[], int | None]:
    """The context switches of upstream's dispatch thread (``dispatch_result_thread``): it blocks
    in its receive between responses, so the count changes whenever output reached the proxy.
    None while there is no such thread (it starts with the first request)."""
    def activity() -> int | None:
        thread = getattr(ref(), "dispatch_result_thread", None)
        tid = getattr(thread, "native_id", None)
        if not isinstance(tid, int):
            return None
        try:
            return read_status("self", tid).context_switches
        except (OSError, ValueError):
            return None

    return activity


def beat_interval(*bounds_s: float) -> float:
    """How often a rank reports iterations: a quarter of the shortest bound that reads them (the
    stall timeout; the heartbeat timeout where a silent host waits for the engine's progress), at
    most once a second and at least once a millisecond. Each beat carries its rank's last iteration
    time: the beats not yet sent hide at most this much progress from those bounds."""
    return max(0.001, min([BEAT_INTERVAL_MAX_S, *(bound / 4 for bound in bounds_s if bound > 0)]))


class Diagnoser:
    """Bounded snapshots of the engine's local ranks, one at a time, each in a thread it owns and
    joins (:meth:`close`). With ``remote`` (the agent hub's
    :meth:`~trtllm_liveness.multihost.AgentHub.snapshot`), every remote host's snapshot is taken at
    the same time (within ``remote_bound_s`` for the fatal verdict's) and merged into the one
    :class:`~trtllm_liveness.diagnose.Diagnosis`."""

    def __init__(self, identities: Callable[[], list[ProcessIdentity]],
                 iterations: Callable[[], Mapping[int, int]] | None = None) -> None:
        self._identities = identities
        self._iterations = iterations
        self._lock = threading.Lock()
        self._running = False
        self._snapshot_on_finish = False
        self._snapshot_done: Callable[[Diagnosis], None] | None = None
        self._threads = OwnedThreads()
        self.remote: Callable[..., list[HostSnapshot]] | None = None
        self.remote_bound_s = 1.0
        self.latest: Diagnosis | None = None
        self.done = threading.Event()  # set after each finished diagnosis (tests wait on it)
        self.snapshot_taken = threading.Event()
        """Set once the snapshot of a fatal verdict (``request(..., snapshot=True)``) ended: the
        bounded stop waits for it before it signals a rank."""

    def request(self, reason: str, on_done: Callable[[Diagnosis], None] | None = None,
                delay_s: float = 0.0, *, snapshot: bool = False) -> bool:
        """Start a diagnosis for ``reason`` (after ``delay_s``) unless one runs; True if started.
        ``snapshot``: the fatal verdict's, taken quickly (one sample, 0.1 s of CPU time, stacks
        within ``SNAPSHOT_STACKS_S``) and announced through :attr:`snapshot_taken`; where one
        runs already, that one is the snapshot: it is announced, and handed to ``on_done`` too,
        when it ends. Never blocks."""
        with self._lock:
            if self._running:
                self._snapshot_on_finish |= snapshot
                if snapshot and on_done is not None:
                    self._snapshot_done = on_done
                return False
            self._running = True
            self._snapshot_on_finish = snapshot
        if self._threads.start(self._run, name="trtllm-liveness-diagnosis", bound_s=delay_s + DIAGNOSIS_BOUND_S,
                               args=(reason, on_done, delay_s, snapshot)) is None:
            with self._lock:
                self._running = False
            if snapshot:
                self.snapshot_taken.set()
            logger.warning("liveness: could not start a diagnosis thread (%s)", reason)
            return False
        return True

    def await_snapshot(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for the fatal verdict's snapshot; True once it ended."""
        return self.snapshot_taken.wait(timeout) if timeout > 0 else self.snapshot_taken.is_set()

    def close(self) -> list[str]:
        """Join the diagnosis under way, if any, until its deadline; the names of threads left."""
        return self._threads.join()

    def take(self, *, snapshot: bool) -> Diagnosis | None:
        """One diagnosis now, in this thread (:meth:`request` runs it in its own): every rank's,
        the remote hosts' merged in; ``snapshot``: the fatal verdict's quick one. None without a
        rank to look at. Blocks for the bounds of the module's constants (``remote_bound_s`` for
        the remote part of a snapshot)."""
        from ...diagnose._diagnosis import diagnose, merge_hosts

        started = time.monotonic()
        identities = [identity for identity in self._identities() if identity.pid > 1]
        if not identities and self.remote is None:
            return None
        iterations = dict(self._iterations()) if self._iterations is not None else None
        remote = self._remote_start(snapshot, started)
        if snapshot:  # before the bounded stop signals the ranks: quick
            diagnosis = diagnose(identities, stacks=True, window_s=0.0, cpu_window_s=SNAPSHOT_CPU_WINDOW_S,
                                 stacks_timeout_s=SNAPSHOT_STACKS_S, iterations=iterations)
        else:
            diagnosis = diagnose(identities, stacks=True, iterations=iterations)
        if remote is not None:
            remote[0].join(remote[2])
            diagnosis = dataclasses.replace(merge_hosts(diagnosis, list(remote[1]), iterations),
                                            elapsed_ms=(time.monotonic() - started) * 1000)
        return diagnosis

    def _remote_start(self, snapshot: bool, started: float
                      ) -> tuple[threading.Thread, list[HostSnapshot], float] | None:
        """Ask every remote host for its snapshot, in a thread beside the local one: (the thread,
        the list its answer fills, how long to join it). None without a hub."""
        remote = self.remote
        if remote is None:
            return None
        bound = self.remote_bound_s - 0.05 if snapshot else DIAGNOSIS_BOUND_S / 2
        found: list[HostSnapshot] = []
        window, stacks_s = (SNAPSHOT_CPU_WINDOW_S, REMOTE_STACKS_S) if snapshot else (0.2, 1.0)

        def ask() -> None:
            try:
                found.extend(remote(max(0.0, bound - (time.monotonic() - started)), cpu_window_s=window,
                                    stacks=True, stacks_timeout_s=stacks_s))
            except Exception:
                logger.warning("liveness: the remote hosts' snapshot failed", exc_info=True)

        thread = self._threads.start(ask, name="trtllm-liveness-remote-snapshot", bound_s=bound + 0.1)
        return None if thread is None else (thread, found, bound + 0.1)

    def _run(self, reason: str, on_done: Callable[[Diagnosis], None] | None, delay_s: float,
             snapshot: bool) -> None:
        diagnosis: Diagnosis | None = None
        try:
            if delay_s > 0:
                time.sleep(delay_s)
            diagnosis = self.take(snapshot=snapshot)
            if diagnosis is None:
                return
            self.latest = diagnosis
            if on_done is not None:
                on_done(diagnosis)
            else:
                logger.warning("liveness: diagnosis (%s): %s", reason, diagnosis.summary())
        except Exception as exc:  # the failure it is about has its one ERROR already
            logger.warning("liveness: diagnosis failed (%s): %s", reason, exc, exc_info=True)
        finally:
            with self._lock:
                self._running = False
                announce, self._snapshot_on_finish = self._snapshot_on_finish, False
                late, self._snapshot_done = self._snapshot_done, None
            if late is not None and diagnosis is not None:
                try:  # a fatal verdict's, asked while this one ran: this one is its snapshot
                    late(diagnosis)
                except Exception as exc:
                    logger.warning("liveness: reporting the snapshot failed (%s): %s", reason, exc, exc_info=True)
            if announce:
                self.snapshot_taken.set()
            self.done.set()


class EngineStall:
    """The progress of one engine and its stall detection (see the module docstring). The
    :attr:`clock` runs whenever liveness is on (a suspect host and a stopped rank wait for it); the
    stall timer only with ``timeout_s`` > 0. Thread-safe."""

    def __init__(self, *, timeout_s: float, fatal: bool, monitor: WorkerProcessMonitor,
                 pending: Callable[[], int], diagnoser: Diagnoser,
                 activity: Callable[[], int | None] | None = None) -> None:
        self.timeout_s = timeout_s
        self.fatal = fatal
        self._monitor = monitor
        self._pending = pending
        self._diagnoser = diagnoser
        self.clock = ProgressClock(pending, activity)
        self._lock = threading.Lock()
        self._iterations: dict[int, IterationBeat] = {}  # each rank's last report
        self.channel: ProgressChannel | None = None
        self.detector: StallDetector | None = None
        self.remote_states: Callable[[], Mapping[int, RankDiagnosis]] | None = None  # the remote ranks' (hub)
        self.named: StalledRank | None = None  # the last stall's naming, remote ranks' evidence included
        self._closed = False

    # -- progress ------------------------------------------------------------------------

    def open_channel(self, interval_s: float) -> ProgressSpec | None:
        """Listen for the ranks' iteration beats, sent once per ``interval_s``; the spec to pass to
        them (None on failure)."""
        from ._progress import ProgressChannel

        try:
            self.channel = ProgressChannel(self._on_beat, interval_s)
        except Exception:
            logger.warning("liveness: no iteration reports (progress channel failed); only output counts as "
                           "progress", exc_info=True)
            return None
        return self.channel.spec

    def _on_beat(self, beat: IterationBeat) -> None:
        with self._lock:
            known = self._iterations.get(beat.rank)
            if known is not None and known.count >= beat.count:
                return  # stale or replayed
            self._iterations[beat.rank] = beat
        self.clock.note_iteration(beat.at)
        detector = self.detector
        if detector is not None:
            detector.note_progress(ProgressSource.ITERATION, beat.at)

    def note_remote_iteration(self, rank: int, count: int, at: float) -> None:
        """A remote rank's iterations as its host's agent forwarded them (``at`` on this clock)."""
        from ._progress import IterationBeat

        self._on_beat(IterationBeat(rank, count, at))

    def note_submitted(self, was_idle: bool) -> None:
        self.clock.note_submitted(was_idle=was_idle)
        detector = self.detector
        if detector is not None:
            detector.note_submitted(was_idle=was_idle)

    def note_registered(self) -> None:
        detector = self.detector
        if detector is not None:
            detector.note_registered()

    def iterations(self) -> dict[int, IterationBeat]:
        """Each rank's last report (``count`` executor iterations, the last at ``at``), by rank."""
        with self._lock:
            return dict(self._iterations)

    # -- the timer -----------------------------------------------------------------------

    def arm(self) -> None:
        """Start the stall timer (at READY) where ``timeout_s`` > 0. Idempotent."""
        with self._lock:
            if self._closed or self.detector is not None or self.timeout_s <= 0:
                return
            self.detector = StallDetector(self.timeout_s, self._pending, on_stall=self._on_stall,
                                          on_resume=self._on_resume,
                                          probe=lambda: self.clock.sample_output(always=True))
        self.detector.start()

    def _on_stall(self, info: StallInfo) -> None:
        monitor = self._monitor
        detail = f"engine stalled: {info.describe()}"
        monitor.set_stalled(info.last_progress_at, detail, since_wall=info.detected_wall - info.quiet_s)
        if self.fatal:
            event = self._event(info)
            if event is not None:
                # The mixin's subscriber takes the fatal path: its ERROR line and its snapshot's
                # WARNING are this failure's two lines.
                monitor.report_stall(event)
                return
        # The line first, whatever the diagnosis does (it may be busy with another request, or
        # find no local rank); the diagnosis follows in a line of its own.
        logger.warning("liveness: %s%s", detail,
                       "" if self.fatal else " (stall_action=report: the engine keeps serving; health stays green)")
        self._diagnoser.request(f"stall {info.number}", lambda diagnosis: logger.warning(
            "liveness: diagnosis of stall %d: %s", info.number, diagnosis.summary()))

    def _on_resume(self, info: StallInfo) -> None:
        self._monitor.set_stalled(None)
        if info.ended_at is not None:
            logger.warning("liveness: stall %d ended: progress after %.2fs without", info.number,
                           info.ended_at - info.last_progress_at)

    def _event(self, info: StallInfo) -> WorkerEvent | None:
        """The stall as one event, naming the rank the evidence singles out (gone, stopped or in D,
        then behind in iterations, then spinning: diagnose/_stalled_rank.py); without evidence, the
        rank whose iterations stopped first (else the first identity)."""
        identities = self._monitor.identities
        if not identities:
            logger.error("liveness: engine stalled but no rank identity is known: not turned into a fatal error")
            return None
        iterations = self.iterations()
        by_rank = {identity.rank: identity for identity in identities}
        named = identities[0]
        known = [(last.at, rank) for rank, last in iterations.items() if rank in by_rank]
        cause = info.describe()
        try:  # the ranks' thread states, read now (microseconds per thread)
            counts = {rank: last.count for rank, last in iterations.items()}
            remote = self.remote_states() if self.remote_states is not None else None  # bounded (the hub)
            verdict = stalled_rank_now(identities, iterations=counts, remote=remote)
        except Exception:
            logger.debug("liveness: naming the stalled rank failed", exc_info=True)
            verdict = None
        if verdict is not None and verdict.rank in by_rank:
            self.named = verdict
            named = by_rank[verdict.rank]
            cause += f"; {verdict.evidence}"
        elif known:
            at, rank = min(known)
            named = by_rank[rank]
            cause += f"; rank {rank}'s last executor iteration was {time.monotonic() - at:.2f}s ago"
        return WorkerEvent(EventKind.STALLED, named, cause, fault_at=info.last_progress_at)

    def close(self) -> None:
        """Stop the timer and the channel. Idempotent."""
        with self._lock:
            self._closed = True
            detector, self.detector = self.detector, None
        if detector is not None:
            detector.close()
        if self.channel is not None:
            self.channel.close()
