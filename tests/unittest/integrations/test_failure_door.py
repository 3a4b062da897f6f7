"""One door from the monitor to the engine's reaction: health checks racing the delivery.

The engine reacts to a failure (fatal path, unrestartable note, diagnosis) in the monitor's
subscriber only; ``check_health()`` and a shutdown's clean-stop check make the monitor deliver
(``monitor.check()``, then ``monitor.flush()``) and read the result, never call the reaction
beside it. Here several threads call ``check_health()`` in a loop while a registered rank really
dies (SIGKILL) or really wedges (``D`` from the freezer or FUSE). The reaction is slowed by a
delay between the monitor's claim of the event and the engine's record of it: the window in
which a health check sees the monitor's sticky failure while the delivering thread (the watcher,
or the health check that found the death) is still on its way, as on a loaded host where that
thread is descheduled. Each event must get exactly one reaction: one unrestartable note, one
diagnosis, never two reactions at the same time, and every health check after the failure says
False.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support.bare_proxy import BareUpstreamProxy
from tests.support.process_tracker import ProcessTracker
from tests.support.quarantine import config_for, fresh_quarantine_state  # noqa: F401 - an autouse fixture
from tests.support.stuck_processes import StuckChild
from tests.support.waits import WAIT_SCALE
from trtllm_liveness._events import EventKind, WorkerEvent, WorkerFailedError
from trtllm_liveness.integrations.trtllm import _mixin, liveness_proxy_class
from trtllm_liveness.integrations.trtllm._state import EngineLiveness
from trtllm_liveness.process._identity import ProcessIdentity, capture_identity

pytestmark = [pytest.mark.timeout(90), pytest.mark.real_process]

CHECKERS = 6
REACTION_DELAY_S = 0.2  # between the monitor's claim and the engine's record (below the door's wait)


@dataclass
class Reactions:
    """What the engine did per event, and how many reactions ran at once at most."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    notes: list[WorkerEvent] = field(default_factory=list)
    diagnoses: list[str] = field(default_factory=list)
    running: int = 0
    most_at_once: int = 0

    def enter(self) -> None:
        with self.lock:
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)

    def leave(self) -> None:
        with self.lock:
            self.running -= 1


@pytest.fixture
def engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, Reactions]]:
    """A liveness proxy (wedge verdicts after 0.3 s in D) whose reaction is counted and slowed."""
    config = config_for(tmp_path / "quarantine", d_state_timeout_s=0.3, scan_interval_s=0.02, termination_log="",
                        shutdown_grace_s=0.1, shutdown_term_s=0.1, shutdown_kill_s=0.3)
    reactions = Reactions()
    note = _mixin.note_unrestartable

    def counted_note(state: EngineLiveness, events: Any) -> None:
        events = list(events)
        with reactions.lock:
            reactions.notes.extend(events)
        note(state, events)

    monkeypatch.setattr(_mixin, "note_unrestartable", counted_note)
    proxy = liveness_proxy_class(BareUpstreamProxy, config=config)({"llm_args": None})
    state: EngineLiveness = proxy.liveness_state
    record = state.fatal_path.record

    def slow_record(event: WorkerEvent) -> WorkerFailedError | None:
        reactions.enter()
        try:
            time.sleep(REACTION_DELAY_S)
            return record(event)
        finally:
            reactions.leave()

    state.fatal_path.record = slow_record  # type: ignore[method-assign]
    assert state.diagnoser is not None
    request = state.diagnoser.request

    def counted_request(reason: str, *args: Any, **kwargs: Any) -> bool:
        with reactions.lock:
            reactions.diagnoses.append(reason)
        return request(reason, *args, **kwargs)

    state.diagnoser.request = counted_request  # type: ignore[method-assign]
    try:
        yield proxy, reactions
    finally:
        proxy.shutdown()
        assert state.diagnoser.done.wait(10 * WAIT_SCALE) or not reactions.diagnoses


def race_health_checks(proxy: Any, fault: Any) -> list[bool]:
    """Start the health checkers, apply ``fault``, and return what each check said after the
    first False (each checker stops after a few answers past its first False)."""
    start = threading.Barrier(CHECKERS + 1, timeout=10 * WAIT_SCALE)
    after: list[bool] = []
    errors: list[BaseException] = []
    deadline = time.monotonic() + 30 * WAIT_SCALE

    def check() -> None:
        try:
            start.wait()
            seen_false = 0
            while seen_false < 20 and time.monotonic() < deadline:
                healthy = proxy.check_health()
                if not healthy or seen_false:
                    seen_false += 1
                    after.append(healthy)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=check, name=f"health-checker-{n}") for n in range(CHECKERS)]
    for thread in threads:
        thread.start()
    start.wait()
    fault()
    for thread in threads:
        thread.join(40 * WAIT_SCALE)
    assert not any(thread.is_alive() for thread in threads), "a health check never returned"
    assert not errors, errors
    return after


def assert_one_reaction(proxy: Any, reactions: Reactions, identity: ProcessIdentity, kind: EventKind,
                        after: list[bool]) -> None:
    assert len(after) == CHECKERS * 20, "a checker never saw the failure"
    assert not any(after), "check_health() said healthy after it had said failed"
    fatal = proxy.liveness_fatal_error
    assert fatal is not None and fatal.event.identity.pid == identity.pid and fatal.event.kind is kind
    # The checkers say False from the fatal error's record on; the reaction's later steps (the
    # note, the diagnosis) may still be running in the delivering thread: the door waits for it.
    state = proxy.liveness_state
    assert proxy.liveness_monitor.flush(state.subscriber, 10 * WAIT_SCALE), "the delivery never ended"
    with reactions.lock:
        notes = [event for event in reactions.notes if event.identity.pid == identity.pid and event.kind is kind]
        diagnoses = list(reactions.diagnoses)
        most = reactions.most_at_once
    assert len(notes) == 1, f"the reaction ran {len(notes)} times for one {kind.value}"
    assert len(diagnoses) == 1, diagnoses
    assert most == 1, f"{most} reactions ran at the same time"


def test_a_death_gets_one_reaction_however_many_health_checks_race_it(
        procs: ProcessTracker, engine: tuple[Any, Reactions]) -> None:
    proxy, reactions = engine
    child = procs.sleeper()
    identity = capture_identity(1, child.pid)
    proxy.liveness_monitor.register([identity])
    after = race_health_checks(proxy, lambda: os.kill(child.pid, signal.SIGKILL))
    assert_one_reaction(proxy, reactions, identity, EventKind.DIED, after)


def test_a_wedge_gets_one_reaction_and_one_unrestartable_note(
        stuck_child: StuckChild, engine: tuple[Any, Reactions]) -> None:
    proxy, reactions = engine
    identity = capture_identity(1, stuck_child.popen.pid)
    # The wedge timer counts from the registration on (the engine is READY): the verdict comes
    # while the checkers run.
    after = race_health_checks(proxy, lambda: proxy.liveness_monitor.register([identity]))
    assert_one_reaction(proxy, reactions, identity, EventKind.WEDGED, after)


def test_the_monitors_flush_waits_for_a_delivery_in_flight_and_never_for_itself(procs: ProcessTracker) -> None:
    """The door's monitor half: ``flush()`` from another thread returns once the delivery under
    way ended (the subscriber was called once); from inside that delivery it returns at once."""
    from trtllm_liveness.monitor import WorkerProcessMonitor

    child = procs.sleeper()
    identity = capture_identity(0, child.pid)
    calls: list[WorkerEvent] = []
    inside = threading.Event()
    leave = threading.Event()
    from_inside: list[bool] = []

    with WorkerProcessMonitor() as monitor:
        def subscriber(event: WorkerEvent) -> None:
            calls.append(event)
            from_inside.append(monitor.flush(subscriber, 10 * WAIT_SCALE))  # re-entrant: must not wait
            inside.set()
            leave.wait(10 * WAIT_SCALE)

        monitor.subscribe(subscriber)
        monitor.register([identity])
        monitor.start()
        os.kill(child.pid, signal.SIGKILL)
        assert inside.wait(10 * WAIT_SCALE), "the watcher never delivered the death"
        assert from_inside == [False]
        assert monitor.check() is not None
        assert monitor.flush(subscriber, 0.05) is False  # the watcher is still inside the subscriber
        releaser = threading.Timer(0.1, leave.set)
        releaser.start()
        assert monitor.flush(subscriber, 10 * WAIT_SCALE) is True
        releaser.join(10)
        assert len(calls) == 1 and calls[0].identity == identity
