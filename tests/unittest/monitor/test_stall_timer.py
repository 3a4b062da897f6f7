"""StallDetector (the stall timer), the monitor's stall view and event, and the progress channel.

Adversary tests: progress, submissions and close() raced from several threads against the timer's
own decisions; the exactly-once promises (one ``on_stall`` per stall, one ``on_resume`` after it,
one delivered ``stalled`` event per monitor) counted. No timing is asserted: clocks are compared as
values (a stall's last progress is never older than the submission that started its clock).
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from tests.support.process_tracker import ProcessTracker
from tests.support.waits import wait_until
from trtllm_liveness._events import EventKind, WorkerEvent, WorkerState
from trtllm_liveness.monitor._monitor import WorkerProcessMonitor
from trtllm_liveness.monitor._stall_timer import ProgressSource, StallDetector, StalledSince, StallInfo
from trtllm_liveness.process._identity import capture_identity

pytestmark = pytest.mark.timeout(60)


class Recorder:
    """Counts callbacks; fails if two run at once or they do not alternate stall/resume."""

    def __init__(self) -> None:
        self.stalls: list[StallInfo] = []
        self.resumes: list[StallInfo] = []
        self.errors: list[str] = []
        self._busy = threading.Lock()
        self.order: list[str] = []

    def on_stall(self, info: StallInfo) -> None:
        self._enter("stall")
        self.stalls.append(info)
        self._busy.release()

    def on_resume(self, info: StallInfo) -> None:
        self._enter("resume")
        self.resumes.append(info)
        self._busy.release()

    def _enter(self, what: str) -> None:
        if not self._busy.acquire(blocking=False):
            self.errors.append(f"{what} ran while another callback ran")
            self._busy.acquire()
        if self.order and self.order[-1] == what:
            self.errors.append(f"two {what} callbacks in a row")
        self.order.append(what)


def test_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError):
        StallDetector(0, lambda: 1, on_stall=lambda info: None)


def test_idle_engine_is_never_stalled_and_a_submission_starts_the_clock() -> None:
    pending = [0]
    rec = Recorder()
    detector = StallDetector(0.05, lambda: pending[0], on_stall=rec.on_stall, on_resume=rec.on_resume).start()
    try:
        # Idle for many timeouts: the timer must wait for work, not declare anything.
        assert not wait_until(lambda: rec.stalls, 0.5)
        submitted = time.monotonic()
        detector.note_submitted(was_idle=True)  # before the request is pending, as the mixin does
        pending[0] = 1
        assert wait_until(lambda: rec.stalls, 10)
        info = rec.stalls[0]
        assert info.last_progress_at >= submitted  # the idle time did not count
        assert info.last_progress_source == ProgressSource.SUBMITTED
        assert info.pending == 1 and info.number == 1 and info.quiet_s >= 0.05
        assert detector.current is info
        # A submission on a busy (stalled) engine is not progress.
        detector.note_submitted(was_idle=False)
        assert detector.current is info and not rec.resumes
        detector.note_progress(ProgressSource.OUTPUT)
        assert wait_until(lambda: rec.resumes, 10)
        assert rec.resumes[0].ended_at is not None and detector.current is None
    finally:
        detector.close()
    assert not rec.errors


def test_a_submission_that_still_saw_a_pending_request_wakes_an_idle_timer() -> None:
    """The submitter saw request A pending (was_idle False), A finished, the timer found nothing
    pending and went idle, then B was registered: the timer must be woken, or B's stall would be
    seen only when its idle wait runs out (60 s)."""
    pending = [0]
    rec = Recorder()
    detector = StallDetector(0.05, lambda: pending[0], on_stall=rec.on_stall).start()
    try:
        settled = time.monotonic() + 0.3  # past its first deadline: it found nothing pending, went idle
        assert wait_until(lambda: time.monotonic() > settled, 10)
        detector.note_submitted(was_idle=False)  # as the mixin: noted, registered, then note_registered
        pending[0] = 1
        detector.note_registered()
        assert wait_until(lambda: rec.stalls, 10)
        assert rec.stalls[0].pending == 1
    finally:
        detector.close()


def test_a_submission_while_the_timer_reads_pending_is_not_missed() -> None:
    """Request B is submitted while the timer reads pending(): the submitter still saw request A
    pending (was_idle False) and the timer not idle; A has finished and B is not registered yet, so
    the timer reads 0. It must not wait for work then (60 s): B's clock starts and its stall is seen."""
    pending = [0]
    rec = Recorder()
    submitted: list[float] = []

    def read_pending() -> int:
        if not submitted:  # B arrives and is registered exactly now, after this read took its count
            submitted.append(time.monotonic())
            detector.note_submitted(was_idle=False)
            pending[0] = 1
            detector.note_registered()
            return 0
        return pending[0]

    detector = StallDetector(0.05, read_pending, on_stall=rec.on_stall)
    detector.start()
    try:
        assert wait_until(lambda: rec.stalls, 10)
        info = rec.stalls[0]
        assert info.pending == 1 and info.last_progress_at >= submitted[0], info
        assert info.last_progress_source == ProgressSource.SUBMITTED
    finally:
        detector.close()


def test_a_request_noted_before_the_timer_looks_and_registered_after_it_read_pending_wakes_it() -> None:
    """Request B's note (the submitter still saw A pending) lands before the timer looks at the
    submission number; the timer then reads pending() as 0 (A finished, B not registered yet) and
    goes idle; B is registered after. Its registration must wake the timer, not leave it for 60 s."""
    pending = [0]
    reads = [0]
    rec = Recorder()
    noted: list[float] = []

    def probe() -> float:  # runs in the timer's step before it looks at the submission number
        if not noted:
            noted.append(time.monotonic())
            detector.note_submitted(was_idle=False)
        return 0.0

    def read_pending() -> int:
        reads[0] += 1
        return pending[0]

    detector = StallDetector(0.05, read_pending, on_stall=rec.on_stall, probe=probe).start()
    try:
        assert wait_until(lambda: reads[0] >= 1, 10)
        pending[0] = 1
        detector.note_registered()
        assert wait_until(lambda: rec.stalls, 10)
        assert rec.stalls[0].pending == 1
    finally:
        detector.close()


class CountingDetector(StallDetector):
    """A detector that counts its timer's decisions: each one is a wake-up of its thread."""

    steps = 0

    def _step_locked(self) -> Callable[[], None] | None:
        self.steps += 1
        return super()._step_locked()


def test_a_request_on_an_engine_that_just_emptied_does_not_wake_a_timing_timer() -> None:
    """Serving, a window's requests often finish together and the next one finds nothing pending
    (``was_idle``) while the timer still waits for its deadline. Moving the clock later only
    postpones that deadline: the timer must not be woken (a wake-up of its thread per such request
    is CPU and a GIL hand-over on the request path). Only an idle or a stalled timer is woken."""
    pending = [1]
    rec = Recorder()
    detector = CountingDetector(60, lambda: pending[0], on_stall=rec.on_stall, on_resume=rec.on_resume).start()
    try:
        assert wait_until(lambda: detector.steps == 1, 10)
        with detector._cond:  # taken: the timer is in its first step's wait (60 s, no probe)
            pass
        for _ in range(200):
            detector.note_submitted(was_idle=True)
            detector.note_registered()
            time.sleep(0.001)  # the GIL left to the timer, were it woken
        assert detector.last_progress[1] == ProgressSource.SUBMITTED  # each moved the clock
    finally:
        detector.close()  # wakes the timer out of that same wait: no further decision
    assert detector.steps == 1, f"{detector.steps - 1} wake-ups of the timer for 200 requests"
    assert not rec.stalls and not rec.errors


def test_a_timer_not_woken_by_a_request_declares_the_stall_it_postponed() -> None:
    """The other side of not waking the timer for a request on an emptied engine: the deadline it
    waits for is the old one, and at it the timer must find the later clock and wait again, so the
    stall comes a whole timeout after that request, never from the older progress. (A machine
    late past the first deadline finds the timer idle instead; the request wakes it, and the stall
    comes a timeout after the request all the same.)"""
    pending = [0]
    rec = Recorder()
    detector = CountingDetector(1.0, lambda: pending[0], on_stall=rec.on_stall).start()
    try:
        time.sleep(0.2)  # the timer waits for its first deadline, 1 s after its start (or, late, idle)
        submitted = time.monotonic()
        detector.note_submitted(was_idle=True)  # as the mixin: noted, then pending
        pending[0] = 1
        assert wait_until(lambda: rec.stalls, 10)
        info = rec.stalls[0]
        assert info.last_progress_source == ProgressSource.SUBMITTED and info.last_progress_at >= submitted, info
        assert info.quiet_s >= 1.0, info
    finally:
        detector.close()
    assert not rec.errors


def test_a_request_on_an_emptied_engine_ends_a_stall_under_way() -> None:
    """A stall under way ends when a request finds nothing pending (what was stalled is over):
    ``note_submitted`` must wake the stalled timer for that."""
    pending = [1]
    rec = Recorder()
    detector = StallDetector(0.05, lambda: pending[0], on_stall=rec.on_stall, on_resume=rec.on_resume).start()
    try:
        assert wait_until(lambda: rec.stalls, 10)
        pending[0] = 0  # the stalled requests failed or finished
        submitted = time.monotonic()
        detector.note_submitted(was_idle=True)
        assert wait_until(lambda: rec.resumes, 10)
        ended_at = rec.resumes[0].ended_at
        assert ended_at is not None and ended_at >= submitted, rec.resumes
        assert detector.last_progress[1] == ProgressSource.SUBMITTED
    finally:
        detector.close()
    assert not rec.errors


def test_busy_submission_does_not_restart_the_clock() -> None:
    pending = [1]
    rec = Recorder()
    detector = StallDetector(0.05, lambda: pending[0], on_stall=rec.on_stall).start()
    try:
        detector.note_progress(ProgressSource.OUTPUT)
        last, source = detector.last_progress
        for _ in range(20):
            detector.note_submitted(was_idle=False)
            detector.note_registered()
        assert wait_until(lambda: rec.stalls, 10)
        assert rec.stalls[0].last_progress_at == last and rec.stalls[0].last_progress_source == source
    finally:
        detector.close()


def test_iteration_time_counts_not_its_arrival() -> None:
    pending = [1]
    rec = Recorder()
    detector = StallDetector(30, lambda: pending[0], on_stall=rec.on_stall).start()
    try:
        started, _source = detector.last_progress
        at = started + 0.001  # an iteration a rank ran just after start, reported (much) later
        assert wait_until(lambda: time.monotonic() > at + 0.05, 10)
        detector.note_progress(ProgressSource.ITERATION, at)
        assert detector.last_progress == (at, ProgressSource.ITERATION)  # its own time, not the arrival's
        detector.note_progress(ProgressSource.ITERATION, at - 0.0005)  # older than the last: no change
        assert detector.last_progress == (at, ProgressSource.ITERATION)
        future = time.monotonic() + 1000
        detector.note_progress(ProgressSource.ITERATION, future)
        assert detector.last_progress[0] <= time.monotonic()  # a time from the future counts as now
    finally:
        detector.close()


def test_pending_that_raises_is_taken_as_idle(caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> int:
        raise RuntimeError("boom")

    rec = Recorder()
    detector = StallDetector(0.02, broken, on_stall=rec.on_stall).start()
    try:
        assert wait_until(lambda: "pending() raised" in caplog.text, 10)
        assert not rec.stalls
    finally:
        detector.close()


def test_close_raced_against_due_stalls_leaves_no_callback_running() -> None:
    """close() returns only once the timer thread is gone (its join has room): no callback may be
    running or start after that, however close() and a due stall interleave."""
    import random

    for attempt in range(30):
        ends: list[float] = []

        def on_stall(info: StallInfo, ends: list[float] = ends) -> None:
            time.sleep(0.002)  # a callback that takes a moment
            ends.append(time.monotonic())

        detector = StallDetector(0.001 + random.random() * 0.004, lambda: 1, on_stall=on_stall).start()
        time.sleep(random.random() * 0.01)
        detector.close(timeout=10)
        returned = time.monotonic()
        assert not detector._thread.is_alive(), attempt
        assert all(end <= returned for end in ends), attempt
        detector.close()  # idempotent
        detector.start()  # after close: nothing starts
        assert not detector._thread.is_alive()


def test_adversary_progress_and_submissions_race_the_timer() -> None:
    """Eight threads make progress in bursts with gaps longer than the timeout, submit on idle and
    busy engines and flip the pending count, while the timer declares and ends stalls. Every stall
    is reported once, every end once, in alternation, never two callbacks at once, numbered 1..n."""
    pending = [1]
    rec = Recorder()
    detector = StallDetector(0.02, lambda: pending[0], on_stall=rec.on_stall, on_resume=rec.on_resume).start()
    stop = threading.Event()
    rng_seed = random.randrange(1 << 30)

    def worker(index: int) -> None:
        rng = random.Random(rng_seed + index)
        while not stop.is_set():
            action = rng.random()
            if action < 0.5:
                detector.note_progress(rng.choice([ProgressSource.OUTPUT, ProgressSource.ITERATION]),
                                       time.monotonic() - rng.random() * 0.01)
            elif action < 0.7:
                detector.note_submitted(was_idle=rng.random() < 0.5)
                detector.note_registered()
            elif action < 0.8:
                pending[0] = rng.choice([0, 1, 2])
            else:
                time.sleep(rng.random() * 0.05)  # gaps: stalls happen

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    try:
        assert wait_until(lambda: len(rec.resumes) >= 5, 30), f"seed {rng_seed}: {len(rec.stalls)} stalls"
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
        detector.close()
    assert not rec.errors, (rng_seed, rec.errors)
    assert [info.number for info in rec.stalls] == list(range(1, len(rec.stalls) + 1))
    assert len(rec.stalls) - len(rec.resumes) in (0, 1)
    for stall, resume in zip(rec.stalls, rec.resumes, strict=False):
        assert resume.number == stall.number and resume.ended_at is not None
        assert resume.ended_at > stall.last_progress_at
        assert stall.quiet_s >= stall.timeout_s  # never declared before the timeout passed
    assert detector.stalls == len(rec.stalls)


# ----------------------------------------------------------------------------- the monitor's view


def test_monitor_shows_stalled_ranks_and_clears(procs: ProcessTracker) -> None:
    """Only a rank otherwise alive shows the stall; one not watched here keeps its own state."""
    child = procs.sleeper()
    remote = capture_identity(1, child.pid)._replace(hostname="other-host.example")
    with WorkerProcessMonitor() as monitor:
        monitor.register([capture_identity(0, child.pid), remote])
        assert monitor.stalled is None
        since = time.monotonic() - 2
        monitor.set_stalled(since, "engine stalled: test", since_wall=1000.0)
        assert monitor.stalled == StalledSince(since, 1000.0, "engine stalled: test")
        status, other = monitor.statuses()
        assert status.state is WorkerState.STALLED and status.detail == "engine stalled: test"
        assert (status.since, status.since_wall) == (since, 1000.0)
        assert other.state is WorkerState.UNMONITORED_REMOTE and "other-host.example" in other.detail
        monitor.set_stalled(None)
        assert monitor.stalled is None and monitor.statuses()[0].state is WorkerState.ALIVE
        assert monitor.failure is None  # a reported stall is no failure


def test_monitor_delivers_one_stall_event_however_many_threads_report_it(procs: ProcessTracker) -> None:
    child = procs.sleeper()
    delivered: list[WorkerEvent] = []
    with WorkerProcessMonitor() as monitor:
        identity = capture_identity(0, child.pid)
        monitor.register([identity])
        monitor.subscribe(delivered.append)
        events = [WorkerEvent(EventKind.STALLED, identity, f"stall seen by thread {i}") for i in range(16)]
        barrier = threading.Barrier(len(events))
        results: list[bool] = []

        def report(event: WorkerEvent) -> None:
            barrier.wait(10)
            results.append(monitor.report_stall(event))

        threads = [threading.Thread(target=report, args=(event,)) for event in events]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert results.count(True) == 1 and len(results) == 16
        assert len(delivered) == 1 and monitor.failure is delivered[0]
        assert delivered[0].restartable and "engine stalled" in delivered[0].message
        with pytest.raises(ValueError):
            monitor.report_stall(WorkerEvent(EventKind.DIED, identity, "not a stall"))


# ----------------------------------------------------------------------------- the progress channel


def _push(address: str) -> Any:
    import zmq

    context = zmq.Context.instance()
    sock = context.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(address)
    return sock


def test_progress_channel_takes_beats_and_rejects_bad_messages(caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("zmq")
    from trtllm_liveness.integrations.trtllm._progress import MAX_MESSAGE_BYTES, ProgressChannel

    beats: list[Any] = []
    channel = ProgressChannel(beats.append, 0.25)
    sock = _push(channel.address)
    try:
        token = channel.token
        good = {"token": token, "rank": 1, "count": 7, "at": time.monotonic()}
        bad: list[bytes] = [
            b"", b"garbage", b"[1, 2]", b"{", json.dumps({**good, "token": "x" * 32}).encode(),
            json.dumps({k: v for k, v in good.items() if k != "token"}).encode(),
            json.dumps({**good, "rank": -1}).encode(), json.dumps({**good, "rank": True}).encode(),
            json.dumps({**good, "count": "7"}).encode(), json.dumps({**good, "at": None}).encode(),
            json.dumps({**good, "at": 1e300}).encode(),
        ]
        for raw in bad:
            sock.send(raw)
        # Oversized: ZMQ's MAXMSGSIZE drops the message and that sender's connection, nobody else's.
        huge = _push(channel.address)
        huge.send(b"[" * 100000)
        huge.send(json.dumps({**good, "pad": "x" * MAX_MESSAGE_BYTES}).encode())
        sock.send(json.dumps(good).encode())
        assert wait_until(lambda: beats, 10)
        huge.close(0)
        assert beats[0].rank == 1 and beats[0].count == 7
        assert wait_until(lambda: channel.rejected.count >= 10, 10), channel.rejected.count
        assert "rejected a progress message" in caplog.text
    finally:
        sock.close(0)
        channel.close()
    assert not channel._thread.is_alive()


def test_engine_stall_ignores_replayed_beats() -> None:
    from trtllm_liveness.integrations.trtllm._engine_stall import Diagnoser, EngineStall
    from trtllm_liveness.integrations.trtllm._progress import IterationBeat

    with WorkerProcessMonitor() as monitor:
        stall = EngineStall(timeout_s=30, fatal=False, monitor=monitor, pending=lambda: 0,
                            diagnoser=Diagnoser(lambda: []))
        stall._on_beat(IterationBeat(0, 5, 100.0))
        stall._on_beat(IterationBeat(0, 5, 200.0))  # replayed count: ignored
        stall._on_beat(IterationBeat(0, 4, 300.0))  # older count: ignored
        assert stall.iterations() == {0: IterationBeat(0, 5, 100.0)}
        stall._on_beat(IterationBeat(0, 6, 150.0))
        assert stall.iterations() == {0: IterationBeat(0, 6, 150.0)}
        stall.close()


def test_a_rank_reporter_follows_a_new_engine() -> None:
    """A rank process that serves a later engine (mpirun's ranks outlive an engine) must report to
    that engine's proxy, not to the first one's deleted socket (it would then see no iterations
    and call a long non-streaming generation a stall)."""
    pytest.importorskip("zmq")
    from trtllm_liveness.integrations.trtllm._progress import IterationReporter, ProgressChannel

    first: list[Any] = []
    second: list[Any] = []
    one = ProgressChannel(first.append, 0.01)
    two = ProgressChannel(second.append, 0.01)
    try:
        reporter = IterationReporter(one.spec, 3)
        reporter.tick()
        assert wait_until(lambda: first, 10)
        one.close()
        reporter.retarget(two.spec, 1)
        reporter.tick()
        assert wait_until(lambda: second, 10)
        assert second[-1].rank == 1 and second[-1].count == 2 and reporter._target == (two.spec, 1)
    finally:
        one.close()
        two.close()


def test_adversary_every_tick_reaches_the_proxy_whatever_the_sender_is_doing() -> None:
    """Bursts of iterations with pauses shorter and longer than the beat interval catch the
    reporter's sender waiting, sleeping after a beat and between clearing its flag and reading the
    count: after each burst the proxy must get a beat carrying every iteration so far."""
    pytest.importorskip("zmq")
    from trtllm_liveness.integrations.trtllm._progress import IterationReporter, ProgressChannel

    beats: list[Any] = []
    channel = ProgressChannel(beats.append, 0.002)
    rng = random.Random(7)
    try:
        reporter = IterationReporter(channel.spec, 0)
        ticks = 0
        for _burst in range(60):
            for _ in range(rng.choice((1, 2, 50, 500))):
                reporter.tick()
                ticks += 1
            assert wait_until(lambda ticks=ticks: beats and beats[-1].count == ticks, 10), (ticks, beats[-1:])
            time.sleep(rng.choice((0.0, 0.0005, 0.002, 0.004)))
    finally:
        channel.close()


def test_progress_channel_falls_back_to_a_short_directory_for_a_long_tmpdir(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    pytest.importorskip("zmq")
    from trtllm_liveness.integrations.trtllm._progress import ProgressChannel

    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setattr("tempfile.tempdir", str(deep))
    channel = ProgressChannel(lambda beat: None, 0.1)
    try:
        assert len(channel.address) - len("ipc://") <= 100 and str(deep) not in channel.address
    finally:
        channel.close()
