"""The extension's side of scripts/bench_multihost.py: the engine with its agents, on test hosts.

The fault trials are tests/support/multihost_engine.py's (fresh namespace test hosts per trial);
here: the CPU figure of a hub with three real agents (many hosts: scripts/_host_scale.py), the loaded
no-fault control and the lossy-network control (tests/support/netem.py), with the closest calls
(the longest silence each side of every hub connection saw, sampled with ``ss`` in the hosts).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

from tests.support import netem
from tests.support.multihost_engine import (
    DEFAULTS,
    Engine,
    Fatal,
    StartFailed,
    host_fault,
    remote_kill,
    remote_wedge,
    start_hosts,
    timed_fatal,
)
from tests.support.testhosts import TestHosts, wait_for
from trtllm_liveness.process import _procfs

REPO = Path(__file__).resolve().parent.parent

__all__ = ["Fatal", "NetemControl", "OutageControl", "StartFailed", "false_alarms_bursts", "false_alarms_loaded",
           "false_alarms_mgmt_outage", "false_alarms_netem", "heartbeat_cpu", "host_fault", "remote_kill",
           "remote_wedge"]


def heartbeat_cpu(window: float = 20.0) -> float:
    """CPU ms per s of a hub and three real agents, idle, over ``window`` s: the proxy's side and
    three remote hosts of 2 ranks each (the agent's own and one it watches; with the proxy's host
    of 2 ranks, 8 ranks on 4 hosts). Each agent is tests/programs/host_agent_child.py in a UTS
    namespace of its own; the ranks it watches are sleepers (their CPU is not counted). The
    engine's own ranks are left out on purpose: on these test hosts they share 2 cores and spin
    in MPI, so their CPU would drown the figure."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    hub = subprocess.Popen([sys.executable, "-c", SIM_HUB], stdout=subprocess.PIPE, env=env, start_new_session=True)
    agents: list[subprocess.Popen[bytes]] = []
    sleepers: list[int] = []
    try:
        assert hub.stdout is not None
        spec = json.loads(first_line(hub))
        for index in range(3):
            options = {"host": f"host{'BCD'[index]}", "endpoint": spec["endpoint"], "secret": spec["secret"],
                       "ranks": 1, "first_rank": 2 + 2 * index, "heartbeat_timeout_s": spec["heartbeat_timeout_s"]}
            agent = subprocess.Popen(["unshare", "--uts", sys.executable, "-m", "tests.programs.host_agent_child",
                                      json.dumps(options)], stdout=subprocess.PIPE, env=env, cwd=REPO,
                                     start_new_session=True)
            agents.append(agent)
            assert agent.stdout is not None
            record = json.loads(first_line(agent))
            sleepers += [pid for _rank, pid, _start in record["ranks"]]
        time.sleep(3.0)
        pids = [hub.pid, *(agent.pid for agent in agents)]
        before, t0 = sum(map(cpu_ticks, pids)), time.monotonic()
        time.sleep(window)
        after, t1 = sum(map(cpu_ticks, pids)), time.monotonic()
        return (after - before) * 1000 / os.sysconf("SC_CLK_TCK") / (t1 - t0)
    finally:
        for pid in sleepers:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        for proc in (*agents, hub):
            proc.kill()
            proc.wait(10)


def cpu_ticks(pid: int) -> int:
    """The process's utime + stime (all its threads), in clock ticks; 0 once it is gone."""
    try:
        return _procfs.read_stat(pid).cpu_ticks
    except (OSError, ValueError):
        return 0


def first_line(popen: subprocess.Popen[bytes], timeout: float = 30.0) -> bytes:
    """The child's first line of output, waited for at most ``timeout`` s (b"" if none came)."""
    assert popen.stdout is not None
    ready, _, _ = select.select([popen.stdout], [], [], timeout)
    return popen.stdout.readline() if ready else b""


SIM_HUB = r"""
import sys, time, json
from trtllm_liveness.monitor import WorkerProcessMonitor
from trtllm_liveness.multihost import AgentHub
hub = AgentHub(WorkerProcessMonitor(), bind="127.0.0.1").start()  # the default heartbeat timeout
latest = {}
hub.feed_iterations(lambda rank, count, at: latest.__setitem__(rank, (count, at)))  # as the stall timer's
spec = {"endpoint": hub.endpoint, "secret": hub.secret.hex(), "heartbeat_timeout_s": hub.heartbeat_timeout_s}
print(json.dumps(spec), flush=True)
time.sleep(600)
"""

def false_alarms_loaded(window: float) -> tuple[int, str, float | None]:
    """Both cores busy (two spinning processes) for ``window`` s, the default heartbeat, every rank
    alive: the number of fatal errors (0 expected), the first one's message, and the longest
    silence the hub saw on an agent's connection (the closest call; :class:`SilenceSampler`)."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
                for _ in range(os.cpu_count() or 2)]
    try:
        with TestHosts() as hosts:
            engine = Engine(hosts, liveness=DEFAULTS)  # the default heartbeat
            sampler = SilenceSampler(hosts, engine.hub_port()).start()
            try:
                fatal = timed_fatal(engine, time.monotonic(), window, shutdown=False)
            finally:
                sampler.stop()
            engine.job.kill()
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait(10)
    closest = round(sampler.hub_max, 3) if sampler.samples else None
    return (0, "", closest) if fatal.ms is None else (1, fatal.message, closest)

class NetemControl(NamedTuple):
    """The lossy-network control: fatal errors in the window (0 expected), the path as measured
    (UDP probes head -> hostB -> head before the engine starts), what the loss rules dropped, how
    late the jitter relay let frames go, and the closest calls: the longest silence the hub saw on
    an agent's connection and an agent on the hub's (sampled every 0.1 s with ``ss``), against the
    hub's heartbeat timeout and the agent's own bound."""

    window_s: float
    alarms: int
    alarm: str
    rtt_ms: dict[str, float | None]
    probes_lost_pct: float
    frames_dropped: int
    relay: dict[str, object]
    hub_max_silence_s: float | None
    agent_max_silence_s: float | None
    samples: int


class SilenceSampler:
    """A thread sampling, every ``interval`` s, ``ss -ti`` of the hub's connections in hostA (local
    port = the hub's) and of the agents' in hostB and hostC (peer port = the hub's): the longest
    silence (min of ``lastrcv`` and ``lastack``, ms) each side saw. Owns its thread; ``stop()``
    joins it (bounded)."""

    _FIELDS = re.compile(r"lastrcv:(\d+).*?lastack:(\d+)|lastrcv:(\d+)")

    def __init__(self, hosts: TestHosts, port: int, interval: float = 0.1) -> None:
        self.hosts, self.port, self.interval = hosts, port, interval
        self.hub_max = self.agent_max = 0.0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="silence-sampler", daemon=True)

    def start(self) -> SilenceSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _silences(self, host: str, side: str) -> list[float]:
        argv = ["nsenter", f"--net=/run/netns/{self.hosts.host(host).netns}", "ss", "-tinH", "state", "established",
                f"( {side} = :{self.port} )"]
        try:
            out = subprocess.run(argv, capture_output=True, text=True, timeout=5, check=False).stdout
        except subprocess.TimeoutExpired:
            return []
        found = []
        for match in self._FIELDS.finditer(out):
            rcv, ack, alone = match.groups()
            found.append((min(int(rcv), int(ack)) if alone is None else int(alone)) / 1000)
        return found

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.hub_max = max([self.hub_max, *self._silences("hostA", "sport")])
            self.agent_max = max([self.agent_max, *self._silences("hostB", "dport"), *self._silences("hostC", "dport")])
            self.samples += 1


def false_alarms_netem(window: float, loss_pct: float = netem.LOSS_PCT,
                       jitter_s: float = netem.JITTER_S) -> NetemControl:
    """hostB and hostC behind a link losing ``loss_pct`` % of the frames each way and delaying
    each by uniform(0, ``jitter_s``) s each way; the engine at the default heartbeat, every rank
    alive, for ``window`` s."""
    with TestHosts() as hosts:
        impairment = netem.impair(hosts, ("hostB", "hostC"), loss_pct=loss_pct, jitter_s=jitter_s)
        path = netem.measure_path(hosts, "hostB")
        engine = Engine(hosts, liveness=DEFAULTS)
        sampler = SilenceSampler(hosts, engine.hub_port()).start()
        try:
            fatal = timed_fatal(engine, time.monotonic(), window, shutdown=False)
        finally:
            sampler.stop()
        dropped = sum(netem.dropped(hosts, name) for name in ("hostB", "hostC"))
        relay = impairment.relay_stats()
        engine.job.kill()

    def ms(q: float) -> float | None:
        value = path.quantile(q)
        return None if value is None else round(value * 1000, 1)

    return NetemControl(window, 0 if fatal.ms is None else 1, fatal.message,
                        {"p10": ms(0.1), "p50": ms(0.5), "p90": ms(0.9), "max": ms(1.0)}, round(path.lost_pct, 2),
                        dropped, relay, round(sampler.hub_max, 3) if sampler.samples else None,
                        round(sampler.agent_max, 3) if sampler.samples else None, sampler.samples)


class OutageControl(NamedTuple):
    """One host's management network down for ``outage_s`` while the engine serves (its data
    network up): fatal errors from the cut until the host was heard again (0 expected); whether the
    engine kept making progress through the outage (rank 0's iterations, each needing every rank);
    whether the host showed ``suspect``; how long after the heal it was ``alive`` again (TCP's
    retransmission backoff keeps a connection quiet for a while after a long outage); then a real
    partition (both networks) of the same host: detected or not, how fast, the verdict (kind, host, text);
    and what the test hosts' removal found left."""

    outage_s: float
    alarms: int
    alarm: str
    iterations_during: int
    suspect_seen: bool
    alive_again_s: float | None
    real_fault_detected: bool
    real_fault_ms: float | None
    real_fault_kind: str = ""
    real_fault_host: str = ""
    real_fault_message: str = ""
    leftovers: tuple[str, ...] = ()


def false_alarms_mgmt_outage(outage_s: float = 30.0, recover_s: float = 60.0,
                             liveness: str = DEFAULTS) -> OutageControl:
    """See :class:`OutageControl`; the default heartbeat unless ``liveness`` says otherwise.
    Raises :class:`StartFailed`."""
    hosts = TestHosts()
    try:
        start_hosts(hosts)
        engine = Engine(hosts, liveness=liveness, program={"progress_s": 0.25})
        if not wait_for(lambda: bool(engine.progress()), 10):
            raise StartFailed(f"no progress record:\n{engine.diagnostics()}")
        cut = time.monotonic()
        hosts.partition("hostB", network="mgmt")
        try:
            during = timed_fatal(engine, cut, outage_s, shutdown=False)
        finally:
            hosts.heal("hostB")
        healed = time.monotonic()
        alive = wait_for(lambda: engine.record("fatal") is not None
                         or engine.progress()[-1]["hosts"]["2"][0] == "alive", recover_s, 0.05)
        fatal = engine.record("fatal")
        alarm = during.message or (str(fatal.get("fatal")) if fatal else "")
        records = [p for p in engine.progress() if cut <= p["t"] <= healed]
        grew = records[-1]["iterations"] - records[0]["iterations"] if len(records) > 1 else 0
        suspect = any(p["hosts"]["2"][0] == "suspect" for p in records)
        alive_again = next((p["t"] - healed for p in engine.progress() if p["t"] > healed
                            and p["hosts"]["2"][0] == "alive"), None) if alive and fatal is None else None
        real: Fatal | None = None
        if fatal is None:
            t0 = time.monotonic()
            hosts.partition("hostB")
            real = timed_fatal(engine, t0, shutdown=False)
        engine.job.kill()
    finally:
        left = hosts.close()
    return OutageControl(outage_s, 0 if not alarm else 1, alarm, grew, suspect,
                         None if alive_again is None else round(alive_again, 3),
                         real is not None and real.ms is not None and real.kind == "lost",
                         None if real is None or real.ms is None else round(real.ms, 1),
                         "" if real is None else real.kind, "" if real is None else real.host,
                         "" if real is None else real.message, tuple(left))


def false_alarms_bursts(runs: int, window: float = 12.0) -> tuple[int, int, list[str], int]:
    """``runs`` fresh engines, each ``window`` s behind the lossy, jittery management links of
    hostB and hostC plus bursts into hostB (2 of every 5 frames, :func:`~tests.support.netem.bursts`):
    (runs with a fatal error, runs started, their messages, frames the rules dropped)."""
    alarms, started, messages, dropped = 0, 0, [], 0
    for _ in range(runs):
        try:
            with TestHosts() as hosts:
                netem.impair(hosts, ("hostB", "hostC"))
                netem.bursts(hosts, "hostB")
                engine = Engine(hosts, liveness=DEFAULTS)
                started += 1
                fatal = timed_fatal(engine, time.monotonic(), window, shutdown=False)
                dropped += sum(netem.dropped(hosts, name) for name in ("hostB", "hostC"))
                engine.job.kill()
        except StartFailed:
            continue
        if fatal.ms is not None:
            alarms += 1
            messages.append(fatal.message)
    return alarms, started, messages, dropped
