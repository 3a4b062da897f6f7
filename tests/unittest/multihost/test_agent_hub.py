"""The agent hub and the host agent on one machine: real agent processes in UTS namespaces of their
own (another hostname, so their ranks are another host's to the hub), real ranks, real signals,
real TCP on loopback. The same code across real test hosts is in tests/unittest/multihost/.

Each agent child (tests/programs/host_agent_child.py) runs a HostAgent in its own process (its
rank) over sleeper children (its host's other ranks), and prints its ranks once welcomed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from tests.support.facilities import needs
from tests.support.process_tracker import ProcessTracker, start_time_or_none, state_of
from tests.support.waits import WAIT_SCALE, wait_until
from trtllm_liveness._events import EventKind, WorkerEvent, WorkerState
from trtllm_liveness.monitor import WorkerProcessMonitor
from trtllm_liveness.monitor._progress_clock import ProgressClock
from trtllm_liveness.multihost import _wire
from trtllm_liveness.multihost._hub import AgentHub
from trtllm_liveness.multihost._placement import plan
from trtllm_liveness.process._identity import ProcessIdentity, capture_identity, parse_identities

pytestmark = [needs("mpi", "testhosts"), pytest.mark.real_process, pytest.mark.timeout(60)]

REPO = str(Path(__file__).resolve().parents[3])
BOUND_S = 10.0 * WAIT_SCALE
QUIET_S = 1.0


class Engine:
    """A monitor with a hub, the engine's progress clock, and every event it delivers.

    ``progress``: ``busy`` (a request pending, ranks that report iterations, none since the start:
    an engine that stopped), ``flowing`` (the same, with an iteration noted every 50 ms by a thread
    of the engine's: an engine serving) or ``idle`` (nothing pending)."""

    def __init__(self, heartbeat_timeout_s: float = 1.0, *, progress: str = "busy", ceiling_s: float = 60.0,
                 hub_class: type[AgentHub] = AgentHub, **hub_options: Any) -> None:
        self.monitor = WorkerProcessMonitor()
        self.monitor.start()
        self.events: list[WorkerEvent] = []
        self.monitor.subscribe(self.events.append)
        self.pending = 0 if progress == "idle" else 1
        self.clock = ProgressClock(lambda: self.pending)
        if progress != "idle":
            self.clock.note_iteration(time.monotonic())
        self._stop = threading.Event()
        self._feeder: threading.Thread | None = None
        if progress == "flowing":
            self._feeder = threading.Thread(target=self._feed, daemon=True)
            self._feeder.start()
        self.hub = hub_class(self.monitor, bind="127.0.0.1", heartbeat_timeout_s=heartbeat_timeout_s,
                             d_state_timeout_s=None, grace_s=0.5, kill_s=1.0, heartbeat_ceiling_s=ceiling_s,
                             progress=self.clock, **hub_options).start()

    def _feed(self) -> None:
        while not self._stop.wait(0.05):
            self.clock.note_iteration(time.monotonic())

    def halt(self) -> None:
        """A ``flowing`` engine makes no more progress: every step now waits for a rank that does
        not take part (a host that went silent, another host's stopped rank)."""
        self._stop.set()
        if self._feeder is not None:
            self._feeder.join(5)
        assert self._feeder is None or not self._feeder.is_alive()

    def lose_host(self, agent_pid: int) -> None:
        """The host of ``agent_pid`` goes silent (its agent SIGSTOPped, as a host cut off or frozen
        would), and with it the engine's progress stops: a lost host stops every step at once (the
        step under way when it went silent still ends: its progress is the last)."""
        os.kill(agent_pid, signal.SIGSTOP)
        self.halt()
        self.clock.note_iteration(time.monotonic())

    def close(self) -> None:
        self._stop.set()
        if self._feeder is not None:
            self._feeder.join(5)
        self.hub.close()
        self.monitor.close()

    def kinds(self) -> list[tuple[int, str]]:
        return [(event.identity.rank, event.kind.value) for event in self.events]


@pytest.fixture
def engine() -> Iterator[Engine]:
    made = Engine()
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def serving() -> Iterator[Engine]:
    """An engine making progress until a test halts it (:meth:`Engine.lose_host`)."""
    made = Engine(progress="flowing")
    try:
        yield made
    finally:
        made.close()


class Agent:
    def __init__(self, popen: subprocess.Popen[bytes], record: dict[str, Any]) -> None:
        self.popen = popen
        self.pid = int(record["pid"])
        self.ranks = [(int(rank), int(pid)) for rank, pid, _start in record["ranks"]]

    def line(self, timeout: float) -> dict[str, Any] | None:
        assert self.popen.stdout is not None
        got: list[bytes] = []
        reader = threading.Thread(target=lambda: got.append(self.popen.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(timeout)
        return json.loads(got[0]) if got and got[0] else None


def start_agent(procs: ProcessTracker, engine: Engine, *, host: str = "fakehostB", ranks: int = 1,
                first_rank: int = 2, slow_poll: bool = False, env: dict[str, str] | None = None,
                stderr: IO[bytes] | None = None, **more: Any) -> Agent:
    """An agent child (``more``: its other options, tests/programs/host_agent_child.py; ``env``:
    its whole environment, default this process's; ``stderr``: where its log goes)."""
    hub = engine.hub
    options = {"host": host, "endpoint": hub.endpoint, "secret": hub.secret.hex(), "ranks": ranks,
               "first_rank": first_rank, "heartbeat_timeout_s": hub.heartbeat_timeout_s, "slow_poll": slow_poll,
               **more}
    popen = subprocess.Popen(["unshare", "--uts", sys.executable, "-m", "tests.programs.host_agent_child",
                              json.dumps(options)], stdout=subprocess.PIPE, start_new_session=True, cwd=REPO,
                             env=env, stderr=stderr)
    procs.popens.append(popen)
    procs.track(popen.pid)
    agent = Agent(popen, {"pid": popen.pid, "ranks": []})
    record = agent.line(BOUND_S * 2)
    assert record is not None and record["ready"], record
    agent = Agent(popen, record)
    for _rank, pid in agent.ranks:
        procs.track(pid)
    return agent


def test_a_remote_rank_death_is_one_fatal_event_naming_host_rank_and_pid(procs: ProcessTracker,
                                                                         engine: Engine) -> None:
    agent = start_agent(procs, engine, ranks=2)
    statuses = {s.identity.rank: s for s in engine.monitor.statuses()}
    assert sorted(statuses) == [2, 3, 4]
    assert all(s.method == "agent" and s.state is WorkerState.ALIVE and s.identity.hostname == "fakehostB"
               for s in statuses.values())
    assert engine.monitor.verified_identities() == []  # never a signal target here
    victim_rank, victim = agent.ranks[0]
    os.kill(victim, signal.SIGKILL)
    assert wait_until(lambda: engine.events, BOUND_S)
    event = engine.events[0]
    assert (event.kind, event.identity.rank, event.identity.pid, event.identity.hostname) == \
        (EventKind.DIED, victim_rank, victim, "fakehostB")
    assert "reported by the agent on host fakehostB" in event.message and "SIGKILL" in event.message
    assert engine.monitor.failure == event
    # The agent's later state message about the same death adds no event.
    assert wait_until(lambda: "exited" in next(s.detail for s in engine.monitor.statuses()
                                               if s.identity.rank == victim_rank) or True, 1)
    time.sleep(0.3)
    assert engine.kinds() == [(victim_rank, "died")]


def test_a_subscriber_asking_the_hub_from_its_callback_gets_every_hosts_answer(procs: ProcessTracker,
                                                                              engine: Engine) -> None:
    """A subscriber acts on a remote rank's death by asking the hub for every host's snapshot and
    stop, from its callback (as an engine's fatal path may): the hub must still read the agents'
    replies meanwhile, so both come back answered, not timed out with ``no-answer``."""
    agent = start_agent(procs, engine, ranks=2)
    answers: list[tuple[list[str], list[str]]] = []

    def ask(event: WorkerEvent) -> None:
        if not answers:
            snaps = engine.hub.snapshot(BOUND_S, stacks=False)
            stops = engine.hub.stop_hosts(BOUND_S)
            answers.append(([s.outcome for s in snaps], [s.outcome for s in stops]))

    engine.monitor.subscribe(ask)
    os.kill(agent.ranks[0][1], signal.SIGKILL)
    assert wait_until(lambda: answers, 3 * BOUND_S)
    assert answers == [(["answered"], ["stopped"])], answers
    assert agent.popen.wait(BOUND_S) == 75


def test_the_agents_own_death_closes_its_connection_and_its_host_ranks_are_lost(procs: ProcessTracker,
                                                                                engine: Engine) -> None:
    agent = start_agent(procs, engine, ranks=1)
    os.kill(agent.pid, signal.SIGKILL)
    assert wait_until(lambda: len(engine.events) >= 2, BOUND_S)
    first = engine.events[0]
    assert (first.kind, first.identity.rank, first.identity.pid) == (EventKind.DIED, 2, agent.pid)
    assert "closed (FIN/RST)" in first.cause
    assert engine.kinds()[1] == (3, "lost")
    assert engine.hub.hosts()[0].connection == "closed"


def test_a_silent_agent_whose_silence_stops_the_engine_is_a_lost_host_naming_every_rank(procs: ProcessTracker,
                                                                                        serving: Engine) -> None:
    """SIGSTOP of the agent's process: its ZMQ I/O thread stops PINGing, as a host cut off or a rank
    frozen in D would, and with it the engine's progress stops with a request pending (every step
    needs every rank). Every rank of the host is lost, the cause naming both signals; nothing is
    called dead."""
    engine = serving
    agent = start_agent(procs, engine, ranks=2)
    engine.lose_host(agent.pid)
    try:
        assert wait_until(lambda: len(engine.events) >= 3, BOUND_S)
    finally:
        os.kill(agent.pid, signal.SIGKILL)
    assert engine.kinds() == [(2, "lost"), (3, "lost"), (4, "lost")]
    cause = engine.events[0].cause
    assert "no heartbeat from host fakehostB's agent (rank 2" in cause
    assert "and no progress of the engine" in cause and "1 request(s) pending" in cause, cause
    assert "every step needs every rank" in cause and "after the engine stopped" not in cause, cause  # on time
    assert all(f"{rank} (pid {pid})" in cause for rank, pid in agent.ranks)
    assert engine.events[0].fault_at is not None and engine.events[0].fault_at < engine.events[0].detected_at
    assert engine.hub.hosts()[0].connection == "lost"


def test_a_host_silent_after_another_fault_stopped_the_engine_is_lost_only_after_its_late_bound(
        procs: ProcessTracker, caplog: pytest.LogCaptureFixture) -> None:
    """The healthy look-alike of a lost host: the engine's progress stopped first (another host's
    rank stalls every step), and only then a healthy host misses its heartbeats (a loaded machine).
    Both signals read true, but the silence began after the stop, so it may not be why the engine
    stopped: the host is suspect, no verdict through three timeouts, its WARNING saying why; heard
    again it is connected. A host that stays silent is lost after five timeouts, the cause saying so."""
    engine = Engine(progress="flowing")
    try:
        blip = start_agent(procs, engine, host="fakehostC", ranks=1, first_rank=4)
        engine.halt()  # another host's fault stops every step
        assert wait_until(lambda: engine.hub.silence.engine_stalled(), BOUND_S)
        time.sleep(1.5)  # the stall's own age before the blip (bounded), far beyond one 50 ms step
        timeout = engine.hub.heartbeat_timeout_s
        os.kill(blip.pid, signal.SIGSTOP)
        silenced = time.monotonic()

        def warned() -> list[str]:
            return [r.getMessage() for r in caplog.records if "is suspect" in r.getMessage()]

        try:
            assert wait_until(lambda: engine.hub.hosts()[0].connection == "suspect", BOUND_S), \
                (engine.hub.hosts(), [event.message for event in engine.events])
            assert wait_until(lambda: warned(), BOUND_S)  # at twice the timeout
            # Bounded observation up to 3 timeouts from the SIGSTOP (the hub counts from the last
            # PING, up to 0.75 of a timeout before it; the late bound is 5): no verdict.
            time.sleep(max(0.0, silenced + 3 * timeout - time.monotonic()))
            assert engine.kinds() == [], [event.message for event in engine.events]
        finally:
            os.kill(blip.pid, signal.SIGCONT)
        assert wait_until(lambda: engine.hub.hosts()[0].connection == "connected", BOUND_S)
        assert engine.kinds() == []
        assert len(warned()) == 1 and "when the host went silent (another fault may have stopped it)" in warned()[0], \
            warned()
        assert "the host is lost after 5 s without contact" in warned()[0], warned()
        os.kill(blip.pid, signal.SIGSTOP)  # silent for good now: the late bound decides
        try:
            assert wait_until(lambda: len(engine.events) >= 2, BOUND_S)
        finally:
            os.kill(blip.pid, signal.SIGKILL)
        assert engine.kinds() == [(4, "lost"), (5, "lost")]
        cause = engine.events[0].cause
        assert "after the engine stopped, so its silence had to last 5 heartbeat timeouts" in cause, cause
    finally:
        engine.close()


def test_the_hub_waits_while_the_engine_is_stalled_instead_of_turning_without_a_wait(engine: Engine) -> None:
    """A stalled engine (a request pending, no progress for the timeout): the moment its stall was
    due is past, and the hub's loop waits for its next due decision or its poll bound from then
    on, never polling without a wait (a hub that spins takes a core from the engine, and on a small
    machine the agents' heartbeats with it)."""
    channel = engine.hub._channel
    assert channel is not None
    waits: list[int] = []
    poll = channel.poll

    def counted(timeout_ms: int) -> tuple[bool, bool]:
        waits.append(timeout_ms)
        return poll(timeout_ms)

    channel.poll = counted  # type: ignore[method-assign]
    assert wait_until(lambda: engine.hub.silence.engine_stalled(), BOUND_S)
    seen = len(waits)
    time.sleep(1.0)  # bounded observation of the stalled engine's hub
    window = waits[seen:]
    assert window.count(0) <= 1, f"{window.count(0)} of {len(window)} polls without a wait"


@pytest.mark.parametrize("progress", ["flowing", "idle"])
def test_a_silent_agent_of_a_serving_or_idle_engine_is_suspect_and_heard_again(procs: ProcessTracker,
                                                                               progress: str) -> None:
    """The healthy look-alike: the agent's process silent for 3 timeouts (its management network
    down, a long pause) while the engine makes progress, or while it is idle: the host is suspect
    (its ranks show it, one WARNING), never lost; heard again, it is connected and its ranks alive."""
    engine = Engine(progress=progress)
    try:
        agent = start_agent(procs, engine, ranks=1)
        os.kill(agent.pid, signal.SIGSTOP)
        try:
            assert wait_until(lambda: engine.hub.hosts()[0].connection == "suspect", BOUND_S)
            states = {s.identity.rank: s.state for s in engine.monitor.statuses()}
            assert states == {2: WorkerState.SUSPECT, 3: WorkerState.SUSPECT}, states
            time.sleep(3 * engine.hub.heartbeat_timeout_s)  # bounded observation: no verdict
            assert engine.kinds() == [], [event.message for event in engine.events]
        finally:
            os.kill(agent.pid, signal.SIGCONT)
        assert wait_until(lambda: engine.hub.hosts()[0].connection == "connected", BOUND_S)
        states = {s.identity.rank: s.state for s in engine.monitor.statuses()}
        assert states == {2: WorkerState.ALIVE, 3: WorkerState.ALIVE}, states
        assert engine.kinds() == [] and engine.hub.silence.suspect_episodes == 1
    finally:
        engine.close()


def test_a_silent_agent_of_an_idle_engine_is_lost_after_the_ceiling(procs: ProcessTracker) -> None:
    """Nothing corroborates a silence while the engine is idle: the host is lost only once
    ``heartbeat_ceiling_s`` passed without contact, and the cause says so."""
    engine = Engine(progress="idle", ceiling_s=3.0)
    try:
        agent = start_agent(procs, engine, ranks=1)
        os.kill(agent.pid, signal.SIGSTOP)
        try:
            assert wait_until(lambda: engine.hub.hosts()[0].connection == "suspect", BOUND_S)
            assert engine.kinds() == []
            assert wait_until(lambda: len(engine.events) >= 2, BOUND_S)
        finally:
            os.kill(agent.pid, signal.SIGKILL)
        assert engine.kinds() == [(2, "lost"), (3, "lost")]
        assert "beyond heartbeat_ceiling_s (3 s), the engine idle" in engine.events[0].cause, engine.events[0].cause
    finally:
        engine.close()


def test_when_the_hub_goes_away_the_agent_stops_its_ranks_and_ends_its_own(procs: ProcessTracker,
                                                                          engine: Engine) -> None:
    agent = start_agent(procs, engine, ranks=2)
    engine.hub.close()  # the proxy is gone (no "expect" was sent)
    assert agent.popen.wait(BOUND_S) == 75
    assert all(wait_until(lambda p=pid: state_of(p) in (None, "Z"), BOUND_S) for _rank, pid in agent.ranks)


@pytest.mark.parametrize("slow_poll", [False, True], ids=["idle-agent", "busy-agent"])
def test_after_a_clean_stop_the_hubs_going_away_leaves_the_ranks_alone(procs: ProcessTracker, engine: Engine,
                                                                      slow_poll: bool) -> None:
    """``expect`` then the hub's close: the agent must read the ``expect`` before it acts on the
    close. A busy agent (slow polls) finds both in one round; acting on the close first would kill
    its host's ranks and end its own with 75."""
    agent = start_agent(procs, engine, ranks=1, slow_poll=slow_poll)
    engine.hub.expect_exits()
    engine.hub.close()
    time.sleep(1.0)  # bounded: time for an agent that got it wrong to act (it would within ~0.3 s)
    assert agent.popen.poll() is None or agent.popen.returncode != 75
    assert state_of(agent.ranks[0][1]) not in (None, "Z")


def test_an_unmatched_connection_is_found_by_probing_when_it_ends(engine: Engine) -> None:
    """A hello whose port matches no accepted connection (address or port translation on the way):
    a WARNING, and when a connection the hub cannot match ends, it probes the unmatched sessions;
    the one whose connection is gone is reported (here its agent's rank, as dead)."""
    sid = "12" * 16
    sock = _raw_dealer(engine.hub.endpoint, sid.encode())
    sock.send(_wire.encode(engine.hub.secret, _wire.TO_HUB, "hello", sid, 1, host="fakehostY", rank=30, port=1,
                           ranks=[[30, 4343, 1, "fakehostY", 1]]))
    assert wait_until(lambda: any(s.identity.rank == 30 for s in engine.monitor.statuses()), BOUND_S)
    sock.close(0)
    assert wait_until(lambda: engine.events, BOUND_S)
    assert engine.kinds() == [(30, "died")]
    assert engine.hub.hosts()[0].connection == "closed"


class StillRoutedOnce(AgentHub):
    """A hub whose first probe after an unmatched close finds the routing id still in place (the
    ROUTER drops it a moment after the monitor's event: measured, some probes succeed)."""

    first = True

    def _probe_unbound_locked(self, ending: Any) -> bool:
        if self.first:
            self.first = False
            return False
        return super()._probe_unbound_locked(ending)


def test_an_unmatched_connection_is_probed_again_until_found(procs: ProcessTracker) -> None:
    """One probe is not enough: when it still reaches the routing id, the session would stay
    "connected" forever and its rank's death never be reported; the hub probes again until found."""
    engine = Engine()
    engine.hub.close()
    engine.hub = StillRoutedOnce(engine.monitor, bind="127.0.0.1", heartbeat_timeout_s=1.0).start()
    try:
        sid = "34" * 16
        sock = _raw_dealer(engine.hub.endpoint, sid.encode())
        sock.send(_wire.encode(engine.hub.secret, _wire.TO_HUB, "hello", sid, 1, host="fakehostX", rank=40, port=1,
                               ranks=[[40, 4545, 1, "fakehostX", 1]]))
        assert wait_until(lambda: any(s.identity.rank == 40 for s in engine.monitor.statuses()), BOUND_S)
        sock.close(0)
        assert wait_until(lambda: engine.events, BOUND_S)
        assert engine.kinds() == [(40, "died")]
    finally:
        engine.close()


def test_stop_hosts_stops_through_the_agent_and_reports(procs: ProcessTracker, engine: Engine) -> None:
    agent = start_agent(procs, engine, ranks=2)
    stops = engine.hub.stop_hosts(BOUND_S)
    assert [(s.host, s.agent_rank, s.outcome) for s in stops] == [("fakehostB", 2, "stopped")]
    assert sorted(rank for rank, _pid, _outcome in stops[0].stopped) == [3, 4]
    assert agent.popen.wait(BOUND_S) == 75
    assert all(state_of(pid) in (None, "Z") for _rank, pid in agent.ranks)


class SlowAfterStop(AgentHub):
    """A hub whose thread is busy for a moment right after it sent a stop, so that an agent's
    report and the close of its connection arrive together, in one poll round."""

    def _flush_commands_locked(self) -> None:
        stopping = any(isinstance(command, _wire.StopCommand) for command in self._commands)
        super()._flush_commands_locked()
        if stopping:
            time.sleep(0.5)


def test_a_report_that_arrives_with_the_close_of_its_connection_counts(procs: ProcessTracker) -> None:
    """The agent sends its report, then ends its rank: the report and the connection's close reach
    the hub together when it is busy. The report counts: handling the close first would report the
    host lost and the agent's rank "exited unexpectedly"."""
    engine = Engine()
    engine.hub.close()
    engine.hub = SlowAfterStop(engine.monitor, bind="127.0.0.1", heartbeat_timeout_s=1.0, grace_s=0.5,
                               kill_s=1.0).start()
    try:
        agent = start_agent(procs, engine, ranks=1)
        stops = engine.hub.stop_hosts(BOUND_S)
        assert agent.popen.wait(BOUND_S) == 75
        assert [(s.host, s.outcome) for s in stops] == [("fakehostB", "stopped")]
        assert wait_until(lambda: engine.hub.hosts()[0].connection != "connected", BOUND_S)
        assert engine.hub.hosts()[0].connection == "stopped"
        assert engine.events == []
    finally:
        engine.close()


def test_a_host_whose_connection_closes_during_the_stop_before_its_report(procs: ProcessTracker,
                                                                          engine: Engine) -> None:
    """The agent's rank ended during the extension's stop (its connection closed), before its
    report: that rank ended with the stop; the host's other ranks were not verified stopped (lost),
    and stop_hosts has this host's answer at once (lost, closed before its report)."""
    agent = start_agent(procs, engine, ranks=1)
    os.kill(agent.pid, signal.SIGSTOP)  # the stop reaches it, no report leaves it
    results: list[Any] = []
    stopper = threading.Thread(target=lambda: results.append(engine.hub.stop_hosts(BOUND_S * 3)), daemon=True)
    stopper.start()
    assert wait_until(lambda: engine.hub._lasting["stop"] is not None, BOUND_S)
    os.kill(agent.pid, signal.SIGKILL)
    stopper.join(BOUND_S * 2)
    ((stop,),) = results
    assert (stop.outcome, stop.detail) == ("lost", "connection closed before its report"), stop
    states = {s.identity.rank: s for s in engine.monitor.statuses()}
    assert states[2].state is WorkerState.EXITED_EXPECTED, states[2]
    assert states[3].state is WorkerState.LOST and "not verified" in states[3].detail, states[3]


def test_stop_hosts_reports_a_lost_host_as_lost_and_returns(procs: ProcessTracker, serving: Engine) -> None:
    engine = serving
    agent = start_agent(procs, engine, ranks=1)
    engine.lose_host(agent.pid)
    try:
        assert wait_until(lambda: engine.hub.hosts()[0].connection == "lost", BOUND_S)
        stops = engine.hub.stop_hosts(2.0)
    finally:
        os.kill(agent.pid, signal.SIGKILL)
    assert [s.outcome for s in stops] == ["lost"]


# --------------------------------------------------------------------------- the network is untrusted

def _raw_dealer(endpoint: str, identity: bytes | None = None) -> Any:
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        sock.setsockopt(zmq.ROUTING_ID, identity)
    sock.connect(endpoint)
    return sock


def _next_command(sock: Any, secret: bytes) -> _wire.Message:
    """The next message the hub sent this raw agent (within the bound)."""
    assert sock.poll(int(BOUND_S * 1000)), "no message from the hub"
    return _wire.decode(secret, _wire.TO_AGENT, sock.recv())


def test_the_lasting_commands_reach_a_late_agent_once_each_in_order(engine: Engine) -> None:
    """arm, expect and stop are queued as typed commands: repeats are dropped (a second stop_hosts
    asks no second stop), a later agent gets the lasting ones after its welcome, and each is on
    the wire as the agents read it (``d``; ``grace``, ``kill``, ``req``). A marker command sent
    last shows nothing else came in between."""
    hub = engine.hub
    hub.arm(5.0)
    hub.arm(5.0)
    hub.expect_exits()
    hub.expect_exits()
    sid = "56" * 16
    sock = _raw_dealer(hub.endpoint, sid.encode())
    try:
        sock.send(_wire.encode(hub.secret, _wire.TO_HUB, "hello", sid, 1, host="fakehostW", rank=50, port=0,
                               ranks=[[50, 4646, 1, "fakehostW", 1]]))
        got = [_next_command(sock, hub.secret) for _ in range(3)]
        assert [(m.kind, m.body.get("d")) for m in got] == [("welcome", None), ("arm", 5.0), ("expect", None)]
        assert [m.seq for m in got] == [1, 2, 3]
        for _ in range(2):
            stops = hub.stop_hosts(0.0)
            assert [(s.host, s.outcome) for s in stops] == [("fakehostW", "no-answer")]
        hub.arm(9.0)  # the marker
        stop, marker = _next_command(sock, hub.secret), _next_command(sock, hub.secret)
        assert (stop.kind, stop.body["grace"], stop.body["kill"], stop.body["req"]) == ("stop", 0.5, 1.0, 1)
        assert (marker.kind, marker.body["d"]) == ("arm", 9.0)
    finally:
        sock.close(0)


def test_a_snapshot_waits_only_for_the_hosts_it_asked(engine: Engine) -> None:
    """A host whose hello comes after the snapshot request went out was never asked: the snapshot
    ends with the replies of those asked, and says that host was not asked (not a no-answer)."""
    hub = engine.hub
    asked_sid, late_sid = "57" * 16, "58" * 16
    asked, late = _raw_dealer(hub.endpoint, asked_sid.encode()), _raw_dealer(hub.endpoint, late_sid.encode())
    try:
        asked.send(_wire.encode(hub.secret, _wire.TO_HUB, "hello", asked_sid, 1, host="fakehostA", rank=60, port=0,
                                ranks=[[60, 4660, 1, "fakehostA", 1]]))
        assert _next_command(asked, hub.secret).kind == "welcome"
        results: list[Any] = []
        caller = threading.Thread(target=lambda: results.append(hub.snapshot(BOUND_S * 3, stacks=False)), daemon=True)
        caller.start()
        request = _next_command(asked, hub.secret)
        assert request.kind == "snapreq"
        late.send(_wire.encode(hub.secret, _wire.TO_HUB, "hello", late_sid, 1, host="fakehostL", rank=70, port=0,
                               ranks=[[70, 4670, 1, "fakehostL", 1]]))
        assert _next_command(late, hub.secret).kind == "welcome"
        asked.send(_wire.encode(hub.secret, _wire.TO_HUB, "snap", asked_sid, 2, req=request.body["req"], el=1.0,
                                ranks=[]))
        caller.join(BOUND_S * 4)
        ((first, second),) = results
        assert (first.host, first.outcome) == ("fakehostA", "answered"), first
        assert (second.host, second.outcome) == ("fakehostL", "not-asked"), second
    finally:
        asked.close(0)
        late.close(0)


def test_bad_messages_are_rejected_and_logged_and_the_hub_keeps_working(
        procs: ProcessTracker, engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    endpoint = engine.hub.endpoint
    secret = engine.hub.secret
    sid = "ab" * 16
    other = b"\x01" * 32
    quiet = _raw_dealer(endpoint)  # connects, sends nothing
    raw = _raw_dealer(endpoint, sid.encode())
    me = capture_identity(7)
    remote = [7, 4242, 1, "fakehostZ", 1]
    hello = _wire.encode(secret, _wire.TO_HUB, "hello", sid, 1, host="fakehostZ", rank=7, port=0, ranks=[remote])
    bad = [
        b"",  # empty
        b"garbage" * 10,
        _wire.encode(other, _wire.TO_HUB, "hello", sid, 1, host="x", rank=0, port=0, ranks=[]),  # wrong secret
        _wire.encode(secret, _wire.TO_AGENT, "hello", sid, 1, host="x", rank=0, port=0, ranks=[]),  # reflected
        hello[:50] + bytes([hello[50] ^ 1]) + hello[51:],  # tampered
        _wire.encode(secret, _wire.TO_HUB, "event", sid, 1, what="died", rank=7, pid=1, cause="", age=0),  # no hello
    ]
    for frame in bad:
        raw.send(frame)
    raw.send_multipart([b"a", b"b"])  # two frames
    assert wait_until(lambda: engine.hub.rejected.count >= len(bad) + 1, BOUND_S)
    huge = _raw_dealer(endpoint)
    huge.send(b"x" * (2 << 20))  # oversized: libzmq drops the connection (MAXMSGSIZE), nothing is read
    assert wait_until(lambda: engine.hub.closed_without_hello.count >= 1, BOUND_S)
    # A valid session, then a replayed message of it, a replayed hello, a wrong-host rank.
    sid = "ef" * 16  # a new connection (the ROUTER refuses a second one with a routing id in use)
    hello = _wire.encode(secret, _wire.TO_HUB, "hello", sid, 1, host="fakehostZ", rank=7, port=0, ranks=[remote])
    good = _raw_dealer(endpoint, sid.encode())
    good.send(hello)
    assert wait_until(lambda: any(s.identity.rank == 7 for s in engine.monitor.statuses()), BOUND_S)
    state = _wire.encode(secret, _wire.TO_HUB, "state", sid, 2, rank=7, state="alive", detail="x")
    before = engine.hub.rejected.count
    good.send(state)
    good.send(state)  # replayed
    good.send(hello)  # hello of a session already seen
    good.send(_wire.encode(secret, _wire.TO_HUB, "event", sid, 3, what="died", rank=8, pid=9, cause="", age=0))
    good.send(_wire.encode(secret, _wire.TO_HUB, "event", sid, 4, what="exploded", rank=7, pid=9, cause="", age=0))
    good.send(_wire.encode(secret, _wire.TO_HUB, "event", sid, 5, what="died", rank=7, pid=9, cause=7, age=0))
    good.send(_wire.encode(secret, _wire.TO_HUB, "state", sid, 6, rank=7, state="wedged", detail="no"))  # events only
    assert wait_until(lambda: engine.hub.rejected.count >= before + 6, BOUND_S)
    assert engine.events == [] and engine.monitor.failure is None
    # A hello claiming this host's ranks is refused (they are watched here).
    local = _raw_dealer(endpoint, ("cd" * 16).encode())
    local.send(_wire.encode(secret, _wire.TO_HUB, "hello", "cd" * 16, 1, host=me.hostname, rank=me.rank, port=0,
                            ranks=[list(me)]))
    assert local.poll(int(BOUND_S * 1000))
    refusal = _wire.decode(secret, _wire.TO_AGENT, local.recv())
    assert refusal.kind == "reject" and "ranks of the proxy's own host" in refusal.body["why"]
    assert "rejected a message" in caplog.text and "authentication failed" in caplog.text
    for sock in (quiet, raw, huge, good, local):
        sock.close(0)
    # The hub still works: a real agent's rank death is reported.
    # The hand-made session's connection closed with its socket: found by probing (it said port 0).
    assert wait_until(lambda: (7, "died") in engine.kinds(), BOUND_S)
    agent = start_agent(procs, engine, ranks=1, first_rank=20)
    os.kill(agent.ranks[0][1], signal.SIGKILL)
    assert wait_until(lambda: (21, "died") in engine.kinds(), BOUND_S)
    assert engine.kinds() == [(7, "died"), (21, "died")]


# --------------------------------------------------------------------------- concurrency

def test_racing_callers_against_deaths_and_a_silent_host_deliver_each_event_once(procs: ProcessTracker,
                                                                                 serving: Engine) -> None:
    """7 threads call the hub's public methods (hosts, arm; expect_exits and stop_hosts are left
    out: they would make the deaths expected, see the next test) while two ranks of one agent die
    and the other agent falls silent. Every (rank, kind) is delivered once; the hub never raises."""
    engine = serving
    one = start_agent(procs, engine, host="fakehostB", ranks=2, first_rank=2)
    two = start_agent(procs, engine, host="fakehostC", ranks=1, first_rank=10)
    stop = threading.Event()
    errors: list[BaseException] = []

    def hammer() -> None:
        try:
            while not stop.is_set():
                engine.hub.hosts()
                engine.hub.arm(None)
                engine.monitor.statuses()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=hammer, daemon=True) for _ in range(7)]
    for thread in threads:
        thread.start()
    for _rank, pid in one.ranks:
        os.kill(pid, signal.SIGKILL)
    engine.lose_host(two.pid)
    try:
        assert wait_until(lambda: {(r, k) for r, k in engine.kinds()} >= {(3, "died"), (4, "died"), (10, "lost"),
                                                                           (11, "lost")}, BOUND_S)
    finally:
        stop.set()
        for thread in threads:
            thread.join(5)
        os.kill(two.pid, signal.SIGKILL)
    kinds = engine.kinds()
    assert len(kinds) == len(set(kinds)), kinds
    assert errors == []


def test_concurrent_stops_ask_once_and_all_get_every_hosts_report(procs: ProcessTracker, engine: Engine) -> None:
    """6 threads call stop_hosts at once while a third host's agent is killed: each gets one report
    per host (stopped, stopped, and the killed one closed before its report: lost), the agents are
    asked once (each ends its rank once, status 75), and the killed agent's rank is one event."""
    one = start_agent(procs, engine, host="fakehostB", ranks=1, first_rank=2)
    two = start_agent(procs, engine, host="fakehostC", ranks=1, first_rank=10)
    three = start_agent(procs, engine, host="fakehostD", ranks=1, first_rank=20)
    results: list[list[tuple[str, str]]] = []
    barrier = threading.Barrier(7)

    def stop() -> None:
        barrier.wait(BOUND_S)
        results.append([(s.host, s.outcome) for s in engine.hub.stop_hosts(BOUND_S)])

    threads = [threading.Thread(target=stop, daemon=True) for _ in range(6)]
    for thread in threads:
        thread.start()
    os.kill(three.pid, signal.SIGSTOP)  # neither answers nor closes: must not hold the stop past its bound
    barrier.wait(BOUND_S)
    for thread in threads:
        thread.join(BOUND_S * 2)
    os.kill(three.pid, signal.SIGKILL)
    assert len(results) == 6
    for result in results:
        assert sorted(result)[:2] == [("fakehostB", "stopped"), ("fakehostC", "stopped")], result
        assert sorted(result)[2][0] == "fakehostD" and sorted(result)[2][1] in ("no-answer", "lost"), result
    assert one.popen.wait(BOUND_S) == 75 and two.popen.wait(BOUND_S) == 75
    kinds = engine.kinds()
    assert len(kinds) == len(set(kinds)), kinds


# --------------------------------------------------------------------------- placement, identities

def test_the_lowest_rank_of_each_other_host_runs_its_agent() -> None:
    def ident(rank: int, host: str, ns: int = 5) -> ProcessIdentity:
        return ProcessIdentity(rank, 100 + rank, 1, host, ns)

    everyone = [(ident(0, "a"), "boot-a"), (ident(1, "a"), "boot-a"), (ident(2, "b"), "boot-b"),
                (ident(3, "b"), "boot-b"), (ident(4, "c"), "boot-c"), (ident(5, "b", ns=6), "boot-b")]
    proxy = ("a", "boot-a", 5)
    chosen = {rank: plan(everyone, rank, proxy) for rank in range(6)}
    assert chosen[0] is None and chosen[1] is None  # the proxy's host: watched by the proxy
    assert chosen[2] is not None and [i.rank for i in chosen[2][1]] == [3]
    assert chosen[3] is None
    assert chosen[4] is not None and chosen[4][1] == []
    assert chosen[5] is not None and chosen[5][1] == []  # another PID namespace: another host to pidfds


def test_a_remote_identity_with_the_proxys_pid_is_kept() -> None:
    """Every host numbers its own pids: a remote rank may have the proxy's pid (seen across test
    hosts: each host's first rank is pid 27). Only the local one is the proxy itself."""
    me = capture_identity(0)
    remote = [1, me.pid, 1, "fakehostB", 1]
    kept = parse_identities([list(me), remote], exclude_pids=[me.pid], own_pid=0)
    assert [identity.rank for identity in kept] == [1]


def test_a_remote_report_never_overrides_a_local_rank() -> None:
    with WorkerProcessMonitor() as monitor:
        me = capture_identity(3, os.getppid())
        assert not monitor.apply_remote_many([(me, WorkerState.EXITED, "hearsay")], via="agent")
        assert monitor.failure is None
        start = start_time_or_none(os.getpid())
        remote = ProcessIdentity(4, os.getpid(), start, "fakehostB", 1)
        assert monitor.apply_remote_many([(remote, WorkerState.ALIVE, "ok")], via="agent")
        other_pid = remote._replace(pid=remote.pid + 1)
        assert not monitor.apply_remote_many([(other_pid, WorkerState.EXITED, "x")], via="agent")
        assert monitor.apply_remote_many([(remote, WorkerState.EXITED, "gone")], via="agent")
        assert not monitor.apply_remote_many([(remote, WorkerState.ALIVE, "late")], via="agent") or \
            monitor.statuses()[0].state is WorkerState.EXITED
        assert [event.kind for event in monitor.events] == [EventKind.DIED]
