"""The monitor under concurrency: public calls raced from several threads against real events.

Every test here plays the adversary of one promise of :class:`WorkerProcessMonitor`:

- synchronous checks (``check()``, ``find_dead_worker()``, ``statuses()``) never steal the
  watcher's wakeup, so a health probe right after ``register()`` cannot switch wedge detection off
  and cannot make ``stop()`` time out;
- every death and wedge reaches every subscriber exactly once per (rank, kind), also subscribers
  that arrive while a delivery is under way or after it;
- the per-thread wedge clocks (a thread in ``D`` with no context switch since a sample), re-armed
  while the watcher samples outside the lock, never make a slow reader wedged and never lose or
  repeat a real wedge;
- descriptors are released exactly once, whichever of the closer and the watcher finishes last;
- ``stop()``/``close()`` return within their bounds (the return value says so) under probing.

Real processes, real SIGKILLs, real ``D`` state (cgroup v1 freezer or an unanswered FUSE lookup),
bounded by pytest-timeout; no timed assertions.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from tests.support.fuse_stall import FuseStall
from tests.support.process_tracker import ProcessTracker, state_of
from tests.support.stuck_processes import Freezer
from tests.support.waits import wait_until
from trtllm_liveness import EventKind, WorkerEvent, WorkerState
from trtllm_liveness.monitor import WorkerProcessMonitor
from trtllm_liveness.process import capture_identity

pytestmark = [pytest.mark.real_process, pytest.mark.timeout(240)]


def _open_fds() -> set[int]:
    """This process's pidfds, epoll sets and pipes: the kinds of descriptor a monitor owns.

    Pipes that test children write to (their stdout, held by the ``procs`` fixture) are left out.
    """
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target in ("anon_inode:[pidfd]", "anon_inode:[eventpoll]") or target.startswith("pipe:"):
            fds.add(int(name))
    return fds - _CHILD_PIPES


_CHILD_PIPES: set[int] = set()


def _sleeper(procs: ProcessTracker) -> subprocess.Popen[bytes]:
    child = procs.sleeper()
    assert child.stdout is not None
    _CHILD_PIPES.add(child.stdout.fileno())
    return child


@dataclass
class StuckChild:
    popen: subprocess.Popen[bytes]
    release: Callable[[], None]


@pytest.fixture(params=[pytest.param("freezer", marks=pytest.mark.freezer),
                        pytest.param("fuse", marks=pytest.mark.fuse)])
def d_source(request: pytest.FixtureRequest, procs: ProcessTracker) -> Callable[[], StuckChild]:
    """Makes real processes in ``D`` from one source (freezer or FUSE); all released at teardown."""
    if request.param == "freezer":
        freezer: Freezer = request.getfixturevalue("freezer")

        def frozen() -> StuckChild:
            child = _sleeper(procs)
            freezer.add(child.pid)
            assert freezer.freeze()
            return StuckChild(child, freezer.thaw)

        return frozen
    request.getfixturevalue("fuse_stall")  # skips where FUSE is missing; checks for leftovers
    stalls: list[FuseStall] = []

    def release_all() -> None:
        for stall in stalls:
            stall.release()
            stall.__exit__(None, None, None)

    request.addfinalizer(release_all)

    def in_fuse() -> StuckChild:
        # A released stall answers every later request: each stuck child gets a stall of its own.
        stall = FuseStall()
        stall.__enter__()
        stalls.append(stall)
        return StuckChild(procs.stuck_in_fuse(stall), stall.release)

    return in_fuse


class Prober:
    """Threads that call the monitor's synchronous, non-mutating API in a tight loop."""

    def __init__(self, monitor: WorkerProcessMonitor, threads: int = 3) -> None:
        self.monitor = monitor
        self.stop_event = threading.Event()
        self.errors: list[BaseException] = []
        self.calls = 0
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def _run(self, index: int) -> None:
        calls = (self.monitor.check, self.monitor.find_dead_worker, self.monitor.statuses)
        n = 0
        try:
            while not self.stop_event.is_set():
                calls[(index + n) % len(calls)]()
                n += 1
        except BaseException as exc:  # surfaced by the test
            self.errors.append(exc)
        self.calls += n

    def __enter__(self) -> Prober:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop_event.set()
        for thread in self.threads:
            thread.join(10)
        assert not any(t.is_alive() for t in self.threads), "a prober thread hung in a monitor call"
        assert not self.errors, self.errors


class Tally:
    """A subscriber that counts what it was given per (rank, kind)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: Counter[tuple[int, EventKind]] = Counter()

    def __call__(self, event: WorkerEvent) -> None:
        with self.lock:
            self.counts[(event.identity.rank, event.kind)] += 1

    def snapshot(self) -> Counter[tuple[int, EventKind]]:
        with self.lock:
            return Counter(self.counts)


def test_probe_right_after_register_does_not_switch_wedge_detection_off(
    procs: ProcessTracker, d_source: Callable[[], StuckChild]
) -> None:
    """A health check racing the watcher's wakeup must not eat it: the wedge is still seen."""
    for attempt in range(6):
        stuck = d_source()
        monitor = WorkerProcessMonitor(d_state_timeout_s=0.2, scan_interval_s=0.05)
        try:
            monitor.start()
            monitor.register([capture_identity(0, stuck.popen.pid)])
            monitor.find_dead_worker()  # what check_health() does at any moment
            with Prober(monitor):
                assert wait_until(lambda m=monitor: m.failure is not None, 10), f"wedge never seen (try {attempt})"
            assert monitor.failure is not None and monitor.failure.kind is EventKind.WEDGED
        finally:
            assert monitor.stop(5.0), "watcher did not stop"
            monitor.close()
            stuck.release()
            os.kill(stuck.popen.pid, signal.SIGKILL)
            stuck.popen.wait(10)


def _watcher_asleep_in_epoll() -> bool:
    """Whether this process's watcher thread is blocked in epoll_wait (its wait channel says so)."""
    for thread in threading.enumerate():
        if thread.name == "trtllm-liveness-watcher" and thread.native_id is not None:
            try:
                with open(f"/proc/self/task/{thread.native_id}/wchan") as f:
                    return "epoll" in f.read()
            except OSError:
                return False
    return False


def test_stop_returns_within_its_bound_under_probing(procs: ProcessTracker) -> None:
    """stop() wakes the watcher; a probe that drained the wakeup left it asleep and stop() timed out."""
    children = [procs.sleeper() for _ in range(2)]
    for _ in range(20):
        monitor = WorkerProcessMonitor()
        monitor.register([capture_identity(rank, child.pid) for rank, child in enumerate(children)])
        with Prober(monitor):
            monitor.start()
            assert wait_until(_watcher_asleep_in_epoll, 10)
            assert monitor.stop(2.0), "stop() timed out: the watcher slept through its wakeup"
            assert not monitor.watcher_alive
            monitor.start()  # restartable after stop
            monitor.close(2.0)
            assert not monitor.watcher_alive


class Subscribers:
    """A first subscriber plus a thread that keeps adding new ones while events are delivered."""

    def __init__(self, monitor: WorkerProcessMonitor) -> None:
        self.monitor = monitor
        self.lock = threading.Lock()
        self.tallies: list[Tally] = [Tally()]
        monitor.subscribe(self.tallies[0])
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self.stop_event.is_set():
            self.add()

    def add(self) -> None:
        tally = Tally()
        with self.lock:
            self.tallies.append(tally)
        self.monitor.subscribe(tally)

    def stop(self) -> None:
        self.stop_event.set()
        if self.thread.ident is not None:
            self.thread.join(10)
            assert not self.thread.is_alive()


def _exactly_once_round(procs: ProcessTracker, d_source: Callable[[], StuckChild]) -> None:
    sleepers = [_sleeper(procs) for _ in range(6)]
    stuck = d_source()
    identities = [capture_identity(rank, child.pid) for rank, child in enumerate(sleepers)]
    wedged_rank = len(identities)
    identities.append(capture_identity(wedged_rank, stuck.popen.pid))
    expected = {(rank, EventKind.DIED) for rank in range(len(sleepers))} | {(wedged_rank, EventKind.WEDGED)}
    monitor = WorkerProcessMonitor(d_state_timeout_s=0.2, scan_interval_s=0.02)
    subscribers = Subscribers(monitor)
    first = subscribers.tallies[0]
    try:
        monitor.start()
        monitor.register(identities[:3])
        with Prober(monitor):
            subscribers.thread.start()
            monitor.register(identities[3:])
            for child in sleepers:
                os.kill(child.pid, signal.SIGKILL)
            assert wait_until(lambda: set(first.snapshot()) >= expected, 20), first.snapshot()
            subscribers.stop()
            subscribers.add()  # late: given the whole story at once
            assert monitor.stop(5.0)
        for tally in subscribers.tallies:
            counts = tally.snapshot()
            twice = {key: n for key, n in counts.items() if n != 1}
            assert not twice, f"delivered more than once: {twice}"
            # Every subscriber, early or late, ends up with the whole story.
            assert set(counts) == expected, (set(counts) ^ expected)
        assert len(subscribers.tallies) > 2
        for child in sleepers:
            child.wait(10)
        states = {s.identity.rank: s.state for s in monitor.statuses()}
        assert all(states[r].is_dead for r in range(len(sleepers)))
        assert states[wedged_rank] is WorkerState.WEDGED
    finally:
        subscribers.stop()
        monitor.close()
        stuck.release()
        os.kill(stuck.popen.pid, signal.SIGKILL)
        stuck.popen.wait(10)


def test_every_event_reaches_every_subscriber_exactly_once(
    procs: ProcessTracker, d_source: Callable[[], StuckChild]
) -> None:
    """Probes, subscribes and kills race the watcher; each subscriber sees each (rank, kind) once.

    Subscribers are added before, during and after the deliveries (late ones are given the past
    events at subscribe time); the switch interval is tiny so threads interleave inside the
    monitor's critical sections as much as CPython allows.
    """
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    fds_before = _open_fds()
    try:
        for _ in range(3):
            _exactly_once_round(procs, d_source)
    finally:
        sys.setswitchinterval(old_interval)
    assert wait_until(lambda: _open_fds() <= fds_before, 10), _open_fds() - fds_before


def test_descriptors_are_released_once_when_close_times_out(procs: ProcessTracker) -> None:
    """close() whose join times out (a subscriber blocks the watcher): the watcher releases on exit."""
    child = _sleeper(procs)
    fds_before = _open_fds()
    release = threading.Event()
    entered = threading.Event()

    def blocking_subscriber(event: WorkerEvent) -> None:
        entered.set()
        release.wait(30)

    monitor = WorkerProcessMonitor()
    monitor.subscribe(blocking_subscriber)
    monitor.register([capture_identity(0, child.pid)])
    monitor.start()
    os.kill(child.pid, signal.SIGKILL)
    assert entered.wait(10), "the watcher never delivered"
    monitor.close(timeout=0.05)  # the watcher is stuck in the subscriber: close cannot join it
    assert monitor.watcher_alive
    release.set()
    assert wait_until(lambda: not monitor.watcher_alive, 10)
    assert wait_until(lambda: _open_fds() <= fds_before, 10), _open_fds() - fds_before
    child.wait(10)


def _act(action: Callable[[], object], barrier: threading.Barrier, errors: list[BaseException]) -> None:
    """Run ``action`` once all racers are ready; collect anything but the 'closed' refusal."""
    barrier.wait(5)
    try:
        action()
    except RuntimeError as exc:
        if "closed" not in str(exc):
            errors.append(exc)
    except BaseException as exc:
        errors.append(exc)


def test_close_and_stop_race_from_many_threads(procs: ProcessTracker) -> None:
    """stop/close/start/register from several threads at once: no exception but 'closed', no leak."""
    children = [_sleeper(procs) for _ in range(3)]
    identities = [capture_identity(rank, child.pid) for rank, child in enumerate(children)]
    fds_before = _open_fds()
    for _ in range(30):
        monitor = WorkerProcessMonitor(d_state_timeout_s=1.0, scan_interval_s=0.01)
        monitor.register(identities[:1])
        errors: list[BaseException] = []
        barrier = threading.Barrier(5)
        actions: list[Callable[[], object]] = [
            monitor.start, lambda m=monitor: m.register(identities), lambda m=monitor: m.stop(2.0),
            lambda m=monitor: m.close(2.0), monitor.check,
        ]
        threads = [threading.Thread(target=_act, args=(a, barrier, errors), daemon=True) for a in actions]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert not any(t.is_alive() for t in threads)
        assert not errors, errors
        monitor.close(2.0)
        assert wait_until(lambda m=monitor: not m.watcher_alive, 5)
    assert wait_until(lambda: _open_fds() <= fds_before, 10), _open_fds() - fds_before


@pytest.fixture
def many_sleepers(procs: ProcessTracker) -> Iterator[list[subprocess.Popen[bytes]]]:
    yield [procs.sleeper() for _ in range(4)]


def test_unsubscribe_during_delivery_and_resubscribe(many_sleepers: list[subprocess.Popen[bytes]]) -> None:
    """A subscriber that unsubscribes itself and subscribes another from inside a delivery."""
    identities = [capture_identity(rank, child.pid) for rank, child in enumerate(many_sleepers)]
    second = Tally()
    first_calls: list[WorkerEvent] = []

    with WorkerProcessMonitor() as monitor:
        def first(event: WorkerEvent) -> None:
            first_calls.append(event)
            monitor.unsubscribe(first)
            monitor.subscribe(second)

        monitor.subscribe(first)
        monitor.register(identities)
        monitor.start()
        for child in many_sleepers:
            os.kill(child.pid, signal.SIGKILL)
        assert wait_until(lambda: len(second.snapshot()) == len(identities), 10), second.snapshot()
        assert len(first_calls) == 1
        assert all(n == 1 for n in second.snapshot().values())
    for child in many_sleepers:
        child.wait(10)
    assert all(state_of(child.pid) is None for child in many_sleepers)


def test_a_failed_thread_start_leaves_the_watcher_startable(
    procs: ProcessTracker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Out of threads at start(): the error says so, and a later start() works (no phantom thread)."""
    child = _sleeper(procs)
    fds_before = _open_fds()
    real_start = threading.Thread.start

    def failing_start(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monitor = WorkerProcessMonitor()
    monitor.register([capture_identity(0, child.pid)])
    monkeypatch.setattr(threading.Thread, "start", failing_start)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        monitor.start()
    monkeypatch.setattr(threading.Thread, "start", real_start)
    assert monitor.stop(1.0) and not monitor.watcher_alive
    monitor.start()
    assert monitor.watcher_alive
    monitor.close(2.0)
    assert not monitor.watcher_alive
    assert wait_until(lambda: _open_fds() <= fds_before, 10), _open_fds() - fds_before


def test_a_subscriber_raising_system_exit_does_not_end_the_watcher(procs: ProcessTracker) -> None:
    children = [_sleeper(procs) for _ in range(2)]
    after = Tally()

    def exits(event: WorkerEvent) -> None:
        raise SystemExit(1)

    with WorkerProcessMonitor() as monitor:
        monitor.subscribe(exits)
        monitor.subscribe(after)
        monitor.register([capture_identity(rank, child.pid) for rank, child in enumerate(children)])
        monitor.start()
        os.kill(children[0].pid, signal.SIGKILL)
        assert wait_until(lambda: len(after.snapshot()) == 1, 10)
        assert monitor.watcher_alive and monitor.watcher_error is None
        os.kill(children[1].pid, signal.SIGKILL)  # still delivered by the watcher, to the later subscriber
        assert wait_until(lambda: len(after.snapshot()) == 2, 10)
    for child in children:
        child.wait(10)


def _arm_repeatedly(monitor: WorkerProcessMonitor, times: int, timeout_s: float) -> None:
    """Re-arm ``times`` times at random moments (each gives every rank a fresh wedge tracker)."""
    rng = random.Random(times)
    for _ in range(times):
        monitor.arm_wedge_detection(timeout_s)
        time.sleep(rng.uniform(0, 0.05))


def test_rearming_and_probes_race_the_per_thread_wedge_clocks(
    procs: ProcessTracker, fuse_stall: FuseStall, d_source: Callable[[], StuckChild]
) -> None:
    """Re-arming (fresh trackers: time in D so far does not count) and the synchronous probes race
    scans whose samples are taken outside the lock and applied inside it, 50 times a second. A thread
    reading through the slow FUSE (in D at nearly every sample, often across two samples of the same
    read) is never wedged; a thread that never runs is wedged once re-arming stops, exactly once also
    while re-arms go on after it, then unkillable once."""
    timeout_s = 2.0
    reader, _ = procs.slow_reader(fuse_stall, 600.0)
    stuck = d_source()
    tally = Tally()
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    monitor = WorkerProcessMonitor(d_state_timeout_s=timeout_s, scan_interval_s=0.02)
    try:
        monitor.subscribe(tally)
        monitor.register([capture_identity(0, reader.pid), capture_identity(1, stuck.popen.pid)])
        monitor.start()
        with Prober(monitor):
            armer = threading.Thread(target=_arm_repeatedly, args=(monitor, 40, timeout_s))
            armer.start()
            armer.join(60)
            assert not armer.is_alive()
            assert wait_until(lambda: tally.snapshot()[(1, EventKind.WEDGED)] == 1, 10 + timeout_s)
            _arm_repeatedly(monitor, 40, timeout_s)  # fresh trackers reach the verdict again: not reported again
            assert not wait_until(lambda: any(rank == 0 for rank, _ in tally.snapshot()), 2 * timeout_s)
        os.kill(stuck.popen.pid, signal.SIGKILL)
        assert wait_until(lambda: tally.snapshot()[(1, EventKind.UNKILLABLE)] == 1, 10)
        assert not wait_until(lambda: sum(tally.snapshot().values()) > 2, 1.0)
        assert tally.snapshot() == Counter({(1, EventKind.WEDGED): 1, (1, EventKind.UNKILLABLE): 1})
        assert monitor.statuses()[0].state is WorkerState.ALIVE
    finally:
        sys.setswitchinterval(old_interval)
        assert monitor.stop(5.0), "watcher did not stop"
        monitor.close()
        stuck.release()
        stuck.popen.wait(10)
