"""The engine's progress clock (monitor/_progress_clock.py): the second signal of the verdicts a
state or a silence alone could fake. Real clocks, real threads; bounds asserted, never timings."""

from __future__ import annotations

import threading
import time

import pytest

from trtllm_liveness.monitor._progress_clock import GAP_MARGIN, ProgressClock
from trtllm_liveness.multihost._host_silence import LATE_SILENCE_TIMEOUTS, ONSET_SHARE, SilenceRule

pytestmark = [pytest.mark.timeout(60)]


def test_an_idle_engine_has_no_quiet_time_and_a_busy_ones_grows_until_progress() -> None:
    pending = [0]
    activity = [0]
    clock = ProgressClock(lambda: pending[0], lambda: activity[0])
    assert clock.quiet_s() is None
    pending[0] = 1
    clock.note_submitted(was_idle=True)
    first = clock.quiet_s()
    assert first is not None and first >= 0
    time.sleep(0.05)
    later = clock.quiet_s()
    assert later is not None and later >= first + 0.05
    activity[0] += 1  # upstream's dispatch thread ran: output reached the proxy
    after_output = clock.quiet_s()
    assert after_output is not None and after_output < later
    assert not clock.iterations_seen
    clock.note_iteration(time.monotonic() + 60)  # a time in the future counts as now
    assert clock.iterations_seen and clock.last_progress() <= time.monotonic()
    activity[0] += 1
    assert clock.sample_output() == 0.0  # with iterations reported, they are the progress


def test_a_long_step_raises_the_quiet_bound_and_a_silent_host_is_not_lost_for_it() -> None:
    """A 0.5 s step (a long prefill) between two iterations: the bound a verdict needs becomes at
    least 1.5 times it, so a host silent for the timeout while the engine sits in such a step stays
    suspect; short steps leave the bound at the timeout."""
    clock = ProgressClock(lambda: 1)
    clock.note_submitted(was_idle=True)
    clock.note_iteration(time.monotonic())
    for _ in range(5):  # short steps
        time.sleep(0.01)
        clock.note_iteration(time.monotonic())
    assert clock.quiet_bound(0.2) == 0.2
    time.sleep(0.5)  # one long step
    clock.note_iteration(time.monotonic())
    assert clock.longest_gap_s() >= 0.5
    assert clock.quiet_bound(0.2) >= GAP_MARGIN * 0.5
    rule = SilenceRule(0.2, 60.0, clock)
    assert rule.lost_because(silence_s=0.3, quiet_s=0.3) is None  # one long step's worth: suspect only
    why = rule.lost_because(silence_s=0.8, quiet_s=0.8)
    assert why is not None and "no progress of the engine" in why


def test_a_host_silent_only_after_the_engine_stopped_is_lost_only_after_its_late_bound() -> None:
    """Another host's rank stops the engine; later a third host's agent misses its heartbeats for
    the timeout (a blip on a loaded machine): its silence began after the engine stopped, so it
    may not be why the engine stopped: suspect, and lost only once silent for five timeouts. A
    host whose silence began with the stop, or up to a quarter of the timeout after it, is lost at
    the timeout as before; after long steps, up to 1.5 of the longest."""
    clock = ProgressClock(lambda: 1)
    clock.note_submitted(was_idle=True)
    busy_since = clock.last_progress()
    time.sleep(0.06)
    for step in range(1, 6):  # five 10 ms steps, dated exactly: the bounds stay the timeout's
        clock.note_iteration(busy_since + step * 0.01)
    rule = SilenceRule(1.0, 60.0, clock)
    assert clock.quiet_bound(1.0) == 1.0 and clock.quiet_bound(1.0 * ONSET_SHARE) == 0.25
    # (silence, quiet): the host went silent quiet - silence seconds after the engine's last progress.
    for silence_s, quiet_s in [(1.0, 2.93), (1.0, 1.3), (2.5, 2.93), (4.9, 6.93)]:
        assert rule.lost_because(silence_s=silence_s, quiet_s=quiet_s) is None, (silence_s, quiet_s)
    for silence_s, quiet_s in [(2.93, 2.93), (1.0, 1.0), (1.0, 1.2), (1.5, 1.0)]:
        why = rule.lost_because(silence_s=silence_s, quiet_s=quiet_s)
        assert why is not None and why.endswith("every step needs every rank"), (silence_s, quiet_s, why)
    assert LATE_SILENCE_TIMEOUTS == 5
    why = rule.lost_because(silence_s=5.0, quiet_s=6.93)  # the silence that lasts: its late bound
    assert why is not None and "the host went silent 1.93 s after the engine stopped" in why, why
    assert "its silence had to last 5 heartbeat timeouts" in why, why
    # The hub looks again when the late bound comes (at most half a timeout apart before it).
    assert rule.recheck_s(silence_s=4.9, quiet_s=6.83) == pytest.approx(0.1)
    # A ceiling shorter than the late bound comes first.
    why = SilenceRule(1.0, 3.0, clock).lost_because(silence_s=3.0, quiet_s=4.93)
    assert why is not None and "beyond heartbeat_ceiling_s (3 s), no engine progress for 4.93 s" in why, why
    # Long steps widen how late the silence may begin, as they widen the quiet bound.
    time.sleep(0.5)
    clock.note_iteration(time.monotonic())
    onset = GAP_MARGIN * clock.longest_gap_s()
    assert onset >= GAP_MARGIN * 0.5
    assert rule.lost_because(silence_s=1.0, quiet_s=1.0 + onset - 0.01) is not None  # within 1.5 steps
    assert rule.lost_because(silence_s=1.0, quiet_s=1.0 + onset + 0.01) is None


def test_without_iterations_only_the_ceiling_loses_a_silent_host() -> None:
    """Output alone cannot show that a long non-streaming request is being worked on."""
    clock = ProgressClock(lambda: 1)
    rule = SilenceRule(0.2, 5.0, clock)
    assert rule.lost_because(silence_s=1.0, quiet_s=1.0) is None
    why = rule.lost_because(silence_s=5.0, quiet_s=5.0)
    assert why is not None and "beyond heartbeat_ceiling_s (5 s)" in why
    # Quiet past its bound decided nothing here: the next look is at half a timeout or the
    # ceiling, never at once (the hub would turn 200 times a second until the ceiling).
    assert rule.recheck_s(silence_s=1.0, quiet_s=1.0) == pytest.approx(0.1)
    assert rule.recheck_s(silence_s=4.95, quiet_s=4.95) == pytest.approx(0.05)
    idle = SilenceRule(0.2, 5.0, ProgressClock(lambda: 0))
    assert idle.lost_because(silence_s=4.9, quiet_s=None) is None
    assert "the engine idle" in (idle.lost_because(silence_s=5.0, quiet_s=None) or "")


def test_racing_notes_and_reads_keep_progress_monotonic_and_the_longest_gap_a_real_one() -> None:
    """Writers (iterations from several ranks' beats, outputs, submissions) race readers (the
    hub's and the monitor's bounds) for a while: no reader ever sees the last progress go back, no
    call raises, and the longest gap read at the end is no longer than the longest any writer made."""
    activity = [0]
    clock = ProgressClock(lambda: 1, lambda: activity[0])
    stop = threading.Event()
    errors: list[BaseException] = []
    made: list[float] = []

    def iterations(seed: int) -> None:
        try:
            last = time.monotonic()
            while not stop.is_set():
                time.sleep(0.001 * (1 + seed))
                now = time.monotonic()
                clock.note_iteration(now)
                made.append(now - last)
                last = now
        except BaseException as exc:
            errors.append(exc)

    def other_writers() -> None:
        try:
            while not stop.is_set():
                activity[0] += 1
                clock.sample_output()
                clock.note_submitted(was_idle=False)
        except BaseException as exc:
            errors.append(exc)

    seen_back: list[tuple[float, float]] = []

    def reader() -> None:
        try:
            previous = 0.0
            while not stop.is_set():
                current = clock.last_progress()
                if current < previous:
                    seen_back.append((previous, current))
                previous = current
                clock.quiet_bound(1.0)
                clock.quiet_s()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=iterations, args=(i,)) for i in range(3)]
    threads += [threading.Thread(target=other_writers), threading.Thread(target=reader),
                threading.Thread(target=reader)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)
    stop.set()
    for thread in threads:
        thread.join(10)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == [] and seen_back == []
    # Each writer's own gap bounds the engine's (the max over ranks moves at least as often).
    assert 0 < clock.longest_gap_s() <= max(made) + 0.001


def test_the_first_iteration_never_moves_the_last_progress_back_behind_output_already_seen() -> None:
    """Output dated by a read, then the first iteration report of a moment before that read (its
    beat was on its way): iterations take over as the clock's progress, and the last progress a
    reader saw stays where it was."""
    activity = [0]
    clock = ProgressClock(lambda: 1, lambda: activity[0])
    before = time.monotonic()
    activity[0] += 1
    seen = clock.last_progress()  # the change dates output at this read
    assert seen > before
    clock.note_iteration(before)
    assert clock.last_progress() >= seen
    later = time.monotonic()
    clock.note_iteration(later)
    assert clock.last_progress() == later


def test_output_is_the_dispatch_threads_activity_and_a_stall_timer_samples_it() -> None:
    """1.2.x reports no iterations: output is the only progress, seen as the context switches of
    upstream's dispatch thread (a real thread blocked in a real ZMQ receive). The count moves for
    each message it receives and stays while nothing arrives; a stall timer that only samples it
    declares no stall while messages keep coming, and one once they stop."""
    import weakref

    import zmq

    from trtllm_liveness.integrations.trtllm._engine_stall import dispatch_activity
    from trtllm_liveness.monitor._stall_timer import StallDetector

    context = zmq.Context()
    server, client = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    server.bind("inproc://dispatch-activity")
    client.connect("inproc://dispatch-activity")
    received: list[bytes] = []

    def dispatch() -> None:
        while (message := server.recv()) != b"end":
            received.append(message)

    class Proxy:  # upstream's attribute, as the fakes' proxy holds it
        dispatch_result_thread = threading.Thread(target=dispatch, name="proxy_dispatch_result_thread")

    proxy = Proxy()
    activity = dispatch_activity(weakref.ref(proxy))
    assert activity() is None  # no thread yet (upstream starts it with the first request)
    proxy.dispatch_result_thread.start()
    stalls: list[object] = []
    try:
        client.send(b"0")
        while len(received) < 1:
            time.sleep(0.001)
        first, settled = activity(), False
        for _ in range(200):  # until the thread is back in its receive: two reads 50 ms apart agree
            time.sleep(0.05)
            now = activity()
            settled, first = now == first, now
            if settled:
                break
        assert first is not None and settled  # nothing arrives: the thread stays in its receive
        client.send(b"1")
        while len(received) < 2:
            time.sleep(0.001)
        assert activity() != first

        clock = ProgressClock(lambda: 1, activity)
        detector = StallDetector(1.5, lambda: 1, on_stall=stalls.append, probe=clock.sample_output).start()
        try:
            for index in range(60):  # 3 s of output, a message every 0.05 s: no stall
                client.send(str(index).encode())
                time.sleep(0.05)
            assert stalls == []
            deadline = time.monotonic() + 30
            while not stalls and time.monotonic() < deadline:  # output stops: a stall
                time.sleep(0.05)
            assert len(stalls) == 1
        finally:
            detector.close()
    finally:
        client.send(b"end")
        proxy.dispatch_result_thread.join(10)
        server.close(0)
        client.close(0)
        context.term()
