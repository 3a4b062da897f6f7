"""Many hosts' agents on one machine: the host columns of the growth table and the NVL72 shape.

A host here is ``tests/programs/host_agent_child.py``, either simulated, in a UTS namespace of its
own (``unshare --uts``; the hostname is the host's), or on a real test host (tests/support/testhosts.py:
a network, PID, UTS and mount namespace each on a private bridge, the hub on one more; the default for
the 4-host column where this machine can make them): the real :class:`~trtllm_liveness.multihost.HostAgent` (its
monitor's pidfds and per-thread ``D`` sampling, the authenticated wire, hello, ZMTP heartbeats) as
its host's rank 0, over 3 real sleeper processes, the host's other ranks. So every host has 4
ranks, and 18 hosts are the 72 ranks of an NVL72 rack (one agent more than a real rack, whose
proxy's own host needs none: the hub's side is counted high). The proxy's side is
``scripts/_rig_hub.py``: a real :class:`~trtllm_liveness.multihost.AgentHub` over a real monitor,
alone in its process. Nothing is canned: every hello, heartbeat and event comes from the agent code.

What the hosts share with a real cluster: the hub, its wire and its work per host. What they do
not: cores (every agent on this machine's; a real host's agent has its host's) and, simulated, a
network (loopback). Per column (``host_column``):

  detect     SIGKILL of a remote rank (a sleeper; pidfd opened and verified before the clock)
             -> the hub's monitor delivers its event (through the agent, the wire and the hub);
             beside the victim's own exit seen through that pidfd (same kills)
  check      one ``find_dead_worker()`` of the hub's monitor, every host's ranks merged in it
  steady CPU the hub's process (all its threads, ZMQ's included) while progress flows on every host
             (no request, no fault: heartbeats and each agent's iterations once per 15 s, the
             interval at the recommended stall_timeout_s=120), minus the same hub with no host in
             the same run; and each agent's process (median), which its own host pays
  snapshot   the whole engine's snapshot, stacks on (AgentHub.snapshot: every agent diagnoses its
             host's ranks, their stacks from py-spy or their own faulthandler dumps), the second of two,
             and the ranks whose stacks came within the agents' default stacks bound (0.3 s); then
             the same with that bound at SHARED_CORES_STACKS_S, since here every host's py-spy runs
             share this machine's cores
  memory     the hub's Python heap (``tracemalloc``) and descriptors added for the hosts, and its
             RSS beside the no-host hub's
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import _bench

from tests.support.testhosts import TestHosts, TestHostsError
from tests.support.testhosts import unavailable as testhosts_unavailable
from tests.support.waits import sigkill_and_time_exit
from trtllm_liveness.process import _procfs

REPO = Path(__file__).resolve().parent.parent
RANKS_PER_HOST = 4  # the agent's own rank and 3 sleepers
NVL72_HOSTS = 18
SHARED_CORES_STACKS_S = 1.5
"""The agents' stacks bound in the rig's second snapshot: every simulated host's py-spy runs share
this machine's cores (each host of an NVL72 rack has its own)."""
PROGRESS_EVERY_S = 0.5
"""Progress flows on every host: each agent is told an iteration of each of its ranks this often
(as its host's progress channel would) and forwards them at :data:`ITERATIONS_EVERY_S`."""
ITERATIONS_EVERY_S = 15.0
"""The agents' interval between two iteration messages at the recommended ``stall_timeout_s=120``
(an eighth of it, at most 15 s: trtllm_liveness/integrations/trtllm/_hosts.py)."""
HOST_COUNTS = (4, 18, 128)
EVENT_WAIT_S = 10.0


class RigFailed(RuntimeError):
    """The hub or the hosts did not start (nothing was measured: a failed start, not a miss)."""


def unavailable() -> str | None:
    """None where this machine can make the rig's hosts (UTS namespaces), else why not."""
    try:
        done = subprocess.run(["unshare", "--uts", "true"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare --uts failed: {exc}"
    return None if done.returncode == 0 else f"unshare --uts failed: {done.stderr.strip()[:200]}"


def process_cpu_ns(pid: int) -> int:
    """CPU time of every thread of ``pid`` now (ns, ``schedstat``; 0 once it is gone)."""
    return sum(_bench.thread_cpu_ns(pid, tid) or 0 for tid in _bench.task_tids(pid))


def _line(stream: IO[bytes], timeout: float) -> bytes:
    ready, _, _ = select.select([stream], [], [], timeout)
    return stream.readline() if ready else b""


class Simulated:
    """Hosts in UTS namespaces of their own, on this machine's network and PID namespace."""

    kind = "simulated"
    bind = "127.0.0.1"

    def host(self, index: int) -> str:
        return f"sim{index:03d}"

    def hub_argv(self, argv: list[str]) -> list[str]:
        return argv

    def agent_argv(self, index: int, argv: list[str]) -> list[str]:
        return ["unshare", "--uts", *argv]

    def root_pid(self, host: str | None, pid: int) -> int | None:
        return pid


class OnTestHosts:
    """Real test hosts (tests/support/testhosts.py: a network, PID, UTS and mount namespace each, on
    a private bridge): the hub on the first, each agent on one of the others."""

    kind = "test hosts"

    def __init__(self, hosts: TestHosts) -> None:
        self.hosts = hosts
        self.hub_host = hosts.names[0]
        self.bind = hosts.address_of(self.hub_host)

    def host(self, index: int) -> str:
        return self.hosts.names[1 + index]

    def hub_argv(self, argv: list[str]) -> list[str]:
        return self.hosts.host(self.hub_host).nsenter_argv(argv, wd=str(REPO))

    def agent_argv(self, index: int, argv: list[str]) -> list[str]:
        return self.hosts.host(self.host(index)).nsenter_argv(argv, wd=str(REPO))

    def root_pid(self, host: str | None, pid: int) -> int | None:
        return self.hosts.root_pid(host or self.hub_host, pid)


Placement = Simulated | OnTestHosts


class Rig:
    """A hub process and ``hosts`` agent processes (each with its 3 sleepers), as a context
    manager: everything it started is ended on exit (agents first: their sleepers die with them,
    and are also killed by pid, verified against their start time; the hub last). Pids here are
    this machine's root namespace's (``placement.root_pid``)."""

    def __init__(self, hosts: int, start_timeout: float = 120.0, placement: Placement | None = None,
                 heartbeat_timeout_s: float | None = None) -> None:
        self.count = hosts
        self.heartbeat_timeout_s = heartbeat_timeout_s  # the hub's; None: its default
        self.placement: Placement = placement or Simulated()
        self.agent_pids: list[int] = []
        self.start_timeout = start_timeout
        self.log = tempfile.TemporaryFile(prefix="trtllm-host-scale-")
        self.env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.hub: subprocess.Popen[bytes] | None = None
        self.hub_pid = 0
        self.spec: dict[str, Any] = {}
        self.agents: list[subprocess.Popen[bytes]] = []
        self.ranks: list[list[tuple[int, int, int]]] = []  # per host: (rank, pid, start time) of its sleepers
        self.connected: dict[str, Any] = {}

    def __enter__(self) -> Rig:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def ask(self, command: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
        """Send the hub one command and return its answer (:class:`RigFailed` if none comes)."""
        assert self.hub is not None and self.hub.stdin is not None and self.hub.stdout is not None
        self.hub.stdin.write((json.dumps(command) + "\n").encode())
        self.hub.stdin.flush()
        line = _line(self.hub.stdout, timeout)
        if not line:
            raise RigFailed(f"the hub did not answer {command} within {timeout:.0f} s:\n{self.log_tail()}")
        answer: dict[str, Any] = json.loads(line)
        if "error" in answer:
            raise RigFailed(f"the hub refused {command}: {answer['error']}")
        return answer

    def log_tail(self, size: int = 1500) -> str:
        self.log.seek(0, os.SEEK_END)
        self.log.seek(max(0, self.log.tell() - size))
        return self.log.read().decode(errors="replace")

    def _start(self) -> None:
        place = self.placement
        argv = [sys.executable, str(REPO / "scripts" / "_rig_hub.py"), place.bind]
        if self.heartbeat_timeout_s is not None:
            argv.append(str(self.heartbeat_timeout_s))
        self.hub = subprocess.Popen(place.hub_argv(argv),
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=self.env,
                                    cwd=REPO, start_new_session=True)
        assert self.hub.stdout is not None
        first = _line(self.hub.stdout, 30.0)
        if not first:
            raise RigFailed(f"the hub did not start:\n{self.log_tail()}")
        hello = json.loads(first)
        self.spec = hello["spec"]
        self.hub_pid = place.root_pid(None, int(hello["pid"])) or 0
        for index in range(self.count):
            options = {"host": place.host(index), "endpoint": self.spec["endpoint"], "secret": self.spec["secret"],
                       "ranks": RANKS_PER_HOST - 1, "first_rank": RANKS_PER_HOST * index,
                       "heartbeat_timeout_s": self.spec["heartbeat_timeout_s"], "die_with_agent": True,
                       "dumps": True,  # every rank registers its stack dump at start, as the worker hook does
                       "beats": [10**7, PROGRESS_EVERY_S], "iterations_interval_s": ITERATIONS_EVERY_S}
            self.agents.append(subprocess.Popen(
                place.agent_argv(index, [sys.executable, "-m", "tests.programs.host_agent_child", json.dumps(options)]),
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self.log, env=self.env, cwd=REPO,
                start_new_session=True))
        deadline = time.monotonic() + self.start_timeout
        for index, agent in enumerate(self.agents):
            assert agent.stdout is not None
            line = _line(agent.stdout, max(0.1, deadline - time.monotonic()))
            record = json.loads(line) if line else {"ready": False}
            if not record.get("ready"):
                raise RigFailed(f"host {len(self.ranks)} of {self.count} was not welcomed by the hub "
                                f"({record}):\n{self.log_tail()}")
            host = place.host(index)
            self.agent_pids.append(place.root_pid(host, int(record["pid"])) or 0)
            self.ranks.append([(int(r), place.root_pid(host, int(p)) or 0, int(s)) for r, p, s in record["ranks"]])
        self.connected = self.ask({"cmd": "wait", "hosts": self.count, "timeout": 30})
        if self.connected["hosts"] != self.count:
            raise RigFailed(f"{self.connected['hosts']} of {self.count} hosts connected:\n{self.log_tail()}")

    def close(self) -> None:
        for agent in self.agents:
            agent.kill()
        for agent in self.agents:
            with contextlib.suppress(subprocess.TimeoutExpired):
                agent.wait(10)
        for host in self.ranks:
            for _rank, pid, start in host:
                kill_verified(pid, start)
        if self.hub is not None:
            with contextlib.suppress(OSError):
                assert self.hub.stdin is not None
                self.hub.stdin.close()
            try:
                self.hub.wait(5)
            except subprocess.TimeoutExpired:
                self.hub.kill()
                self.hub.wait(10)
        self.log.close()

    def cpu_ms_per_s(self, window: float) -> tuple[float, float | None, dict[str, float]]:
        """(the hub's CPU, the median agent's CPU, the hub's by thread name), ms per s over
        ``window`` s of idle."""
        pids = self.agent_pids
        tids = _bench.task_tids(self.hub_pid)
        threads0 = {tid: _bench.thread_cpu_ns(self.hub_pid, tid) or 0 for tid in tids}
        hub0, agents0, t0 = process_cpu_ns(self.hub_pid), [process_cpu_ns(pid) for pid in pids], time.monotonic()
        time.sleep(window)
        hub1, agents1, t1 = process_cpu_ns(self.hub_pid), [process_cpu_ns(pid) for pid in pids], time.monotonic()
        by_thread: dict[str, float] = {}
        for tid, before in threads0.items():
            name = _bench.thread_name(self.hub_pid, tid) or str(tid)
            spent = ((_bench.thread_cpu_ns(self.hub_pid, tid) or before) - before) / 1e6 / (t1 - t0)
            by_thread[name] = by_thread.get(name, 0.0) + round(spent, 3)
        per_agent = [(b - a) / 1e6 / (t1 - t0) for a, b in zip(agents0, agents1, strict=True)]
        return (hub1 - hub0) / 1e6 / (t1 - t0), statistics.median(per_agent) if per_agent else None, by_thread

    def kills(self, count: int) -> tuple[list[float], list[float]]:
        """SIGKILL ``count`` sleepers, round-robin over the hosts (at most every sleeper once):
        (kill -> the hub's event, ms; kill -> the victim's exit seen through its pidfd, ms), both
        lists from the same kills (a kill whose event or exit did not come within the wait is left
        out of both)."""
        victims = [host[j] for j in range(RANKS_PER_HOST - 1) for host in self.ranks][:count]
        detect: list[float] = []
        exits: list[float] = []
        seen = len(self.ask({"cmd": "events"})["events"])
        for rank, pid, start in victims:
            fd = pidfd_verified(pid, start)
            if fd is None:
                continue
            try:
                t0, exited = sigkill_and_time_exit(fd, EVENT_WAIT_S)
            finally:
                os.close(fd)
            at = None
            deadline = time.monotonic() + EVENT_WAIT_S
            while at is None and time.monotonic() < deadline:
                events = self.ask({"cmd": "events", "since": seen})["events"]
                seen += len(events)
                at = next((event[4] for event in events if event[0] == rank), None)  # its pid is the host's
                if at is None:
                    time.sleep(0.005)
            if at is not None and exited is not None:
                detect.append((at - t0) * 1000)
                exits.append((exited - t0) * 1000)
        return detect, exits


def pidfd_verified(pid: int, start: int) -> int | None:
    """A pidfd of ``pid`` if it is still the process that started at ``start``, else None."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return None
    try:
        if _procfs.read_start_time(pid) == start:
            return fd
    except (OSError, ValueError):
        pass
    os.close(fd)
    return None


def kill_verified(pid: int, start: int) -> None:
    fd = pidfd_verified(pid, start)
    if fd is not None:
        try:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
        finally:
            os.close(fd)


def no_host_hub(window: float, settle: float) -> dict[str, float]:
    """The baseline, same run: the hub with no host, idle CPU over ``window`` s and RSS (KiB)."""
    with Rig(0) as rig:
        time.sleep(settle)
        cpu, _, _ = rig.cpu_ms_per_s(window)
        return {"cpu_ms_per_s": cpu, "rss_kib": float(_bench.rss_kib(rig.hub_pid) or 0)}


def hub_cpu_by_heartbeat(hosts: int, timeouts: tuple[float, ...], window: float, settle: float,
                         baseline: dict[str, float]) -> dict[str, float]:
    """The hub's steady CPU (ms/s, the no-host hub's subtracted) with ``hosts`` simulated hosts at
    each heartbeat timeout in ``timeouts``, keyed ``hub_cpu_ms_per_s_hosts_{hosts}_heartbeat_{t}``:
    the hub PINGs every agent four times per timeout, so the cost follows hosts / timeout."""
    out: dict[str, float] = {}
    for timeout in timeouts:
        with Rig(hosts, heartbeat_timeout_s=timeout) as rig:
            time.sleep(settle)
            cpu, _, _ = rig.cpu_ms_per_s(window)
        out[f"hub_cpu_ms_per_s_hosts_{hosts}_heartbeat_{timeout:g}"] = cpu - baseline["cpu_ms_per_s"]
    return out


def host_column(hosts: int, kills: int, window: float, settle: float, baseline: dict[str, float],
                real: bool = False) -> dict[str, Any]:
    """One column (see the module docstring): the figures of ``hosts`` hosts, keyed by metric;
    ``real``: on real test hosts (the hub on one more) instead of simulated ones."""
    with contextlib.ExitStack() as stack:
        placement: Placement = Simulated()
        if real:
            test_hosts = TestHosts(tuple(f"host{chr(ord('A') + index)}" for index in range(hosts + 1)))
            stack.callback(test_hosts.close)  # removes everything in the hosts, also on failure
            try:
                test_hosts.start()
            except TestHostsError as exc:
                raise RigFailed(f"the test hosts did not start: {exc}") from exc
            placement = OnTestHosts(test_hosts)
        rig = stack.enter_context(Rig(hosts, placement=placement))
        time.sleep(settle)
        hub_cpu, agent_cpu, by_thread = rig.cpu_ms_per_s(window)
        rss = _bench.rss_kib(rig.hub_pid)
        check = rig.ask({"cmd": "check", "calls": 2000})["us"]
        rig.ask({"cmd": "snapshot", "timeout": 5.0}, 30.0)  # the first warms up (imports, py-spy's probe)
        snap = rig.ask({"cmd": "snapshot", "timeout": 5.0}, 30.0)
        # The agents' default stacks bound (0.3 s) is for a host's own cores; here every host's
        # py-spy runs share this machine's: the same snapshot with the bound widened to fit them.
        wide = rig.ask({"cmd": "snapshot", "timeout": 5.0, "stacks_timeout": SHARED_CORES_STACKS_S}, 30.0)
        detect, exits = rig.kills(kills)
        still = rig.ask({"cmd": "hosts"})
    return {
        "detect_p50_us": us(detect, 0.5), "detect_p99_us": us(detect, 0.99),
        "exit_p50_us": us(exits, 0.5), "exit_p99_us": us(exits, 0.99),
        "kills": len(detect),
        "check_us": check,
        "diagnosis_ms": snap["ms"], "diagnosis_ranks": snap["ranks"],
        "diagnosis_ranks_with_stacks": snap["ranks_with_stacks"],
        "diagnosis_wide_ms": wide["ms"], "diagnosis_wide_ranks_with_stacks": wide["ranks_with_stacks"],
        "idle_cpu_ms_per_s": hub_cpu - baseline["cpu_ms_per_s"],
        "hub_cpu_ms_per_s_raw": hub_cpu,
        "hub_cpu_ms_per_s_by_thread": by_thread,
        "agent_cpu_ms_per_s": agent_cpu,
        "memory_kib": rig.connected["heap_kib"],
        "fds": rig.connected["fds"],
        "rss_added_kib": None if rss is None else rss - baseline["rss_kib"],
        "ranks": hosts * RANKS_PER_HOST,
        "hosts_connected_at_end": still["connected"],
        "placement": placement.kind,
    }


def us(ms: list[float], q: float) -> float | None:
    value = _bench.percentile(ms, q)
    return None if value is None else value * 1000


def host_columns(counts: tuple[int, ...] = HOST_COUNTS, *, kills: int = 20, window: float = 20.0,
                 settle: float = 3.0, real: tuple[int, ...] = (4,),
                 heartbeats: tuple[float, ...] = ()) -> dict[str, Any]:
    """Every column and the no-host baseline, as flat keys: ``growth_<metric>_hosts_<n>`` (the
    growth table's), ``hub_cpu_ms_per_s_no_hosts``, ``hub_rss_kib_no_hosts``; a column whose rig
    did not start is null, with its error under ``host_scale_failed_starts``. With ``heartbeats``,
    the largest column's hub CPU again at each of those heartbeat timeouts
    (:func:`hub_cpu_by_heartbeat`)."""
    baseline = no_host_hub(window, settle)
    out: dict[str, Any] = {"hub_cpu_ms_per_s_no_hosts": baseline["cpu_ms_per_s"],
                           "hub_rss_kib_no_hosts": baseline["rss_kib"], "host_scale_window_s": window}
    failed: dict[str, str] = {}
    for count in counts:
        try:
            column: dict[str, Any] = host_column(count, kills, window, settle, baseline,
                                                 real=count in real and testhosts_unavailable() is None)
        except RigFailed as exc:
            failed[str(count)] = str(exc)[-1500:]
            column = dict.fromkeys(COLUMN_KEYS)
        for metric, value in column.items():
            out[f"growth_{metric}_hosts_{count}"] = value
    if heartbeats and counts:
        try:
            out.update(hub_cpu_by_heartbeat(max(counts), heartbeats, window, settle, baseline))
        except RigFailed as exc:
            failed[f"{max(counts)} (heartbeats {heartbeats})"] = str(exc)[-1500:]
    out["host_scale_failed_starts"] = failed
    return out


def window_seconds(text: str) -> float:
    """``--host-window``'s value: seconds, more than 0 (argparse's type)."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {text!r}")
    return value


def windows(quick: bool, window: float | None) -> tuple[float, float]:
    """The CPU window and the settle before it, s: ``window`` where given (the settle then at most
    as long), else the benchmark's (5 and 2 with ``quick``, 20 and 3)."""
    chosen = window if window is not None else (5.0 if quick else 20.0)
    return chosen, min(2.0 if quick else 3.0, chosen)


COLUMN_KEYS = ("detect_p50_us", "detect_p99_us", "exit_p50_us", "exit_p99_us", "kills", "check_us",
               "diagnosis_ms", "diagnosis_ranks", "diagnosis_ranks_with_stacks", "diagnosis_wide_ms",
               "diagnosis_wide_ranks_with_stacks",
               "idle_cpu_ms_per_s", "hub_cpu_ms_per_s_raw", "hub_cpu_ms_per_s_by_thread",
               "agent_cpu_ms_per_s", "memory_kib", "fds",
               "rss_added_kib", "ranks", "hosts_connected_at_end", "placement")


HOST_ROWS = (("remote rank SIGKILL -> hub event p50 ms", "detect_p50_us", 0.001, 2),
             ("  p99 ms", "detect_p99_us", 0.001, 2),
             ("  the victim's own exit p50 / p99 ms", ("exit_p50_us", "exit_p99_us"), 0.001, 2),
             ("find_dead_worker (hub's monitor) us", "check_us", 1, 1),
             ("whole-engine snapshot, stacks on, ms", "diagnosis_ms", 1, 0),
             ("  ranks with stacks", "diagnosis_ranks_with_stacks", 1, 0),
             (f"  stacks bound {SHARED_CORES_STACKS_S} s (shared cores), ms", "diagnosis_wide_ms", 1, 0),
             ("  ranks with stacks", "diagnosis_wide_ranks_with_stacks", 1, 0),
             ("hub steady CPU ms/s (no-host hub's off)", "idle_cpu_ms_per_s", 1, 2),
             ("  as measured, ms/s", "hub_cpu_ms_per_s_raw", 1, 2),
             ("each agent's idle CPU ms/s (median)", "agent_cpu_ms_per_s", 1, 2),
             ("hub Python heap added KiB", "memory_kib", 1, 0),
             ("hub RSS added KiB", "rss_added_kib", 1, 0),
             ("hub descriptors added", "fds", 1, 0))


def print_host_table(result: dict[str, Any], hosts: list[int]) -> None:
    """The host columns as a text table (``result``: :func:`host_columns`' keys)."""
    def cell(metric: str, count: int, scale: float, digits: int) -> str:
        value = result.get(f"growth_{metric}_hosts_{count}")
        return "-" if not isinstance(value, (int, float)) else f"{value * scale:.{digits}f}"

    base = result.get("hub_cpu_ms_per_s_no_hosts")
    print("many hosts, 4 ranks each (the real agent code over 3 sleeper ranks; the real hub alone in a process; "
          "one machine's cores); the hub with no host: "
          + ("-" if not isinstance(base, (int, float)) else f"{base:.2f} ms/s"))
    print(f"{'':42}" + "".join(f"{f'{count} hosts':>14}" for count in hosts))
    print(f"{'  on':42}" + "".join(f"{result.get(f'growth_placement_hosts_{count}') or '-'!s:>14}"
                                   for count in hosts))
    for label, metric, scale, digits in HOST_ROWS:
        metrics = metric if isinstance(metric, tuple) else (metric,)
        cells = [" / ".join(cell(m, count, scale, digits) for m in metrics) for count in hosts]
        print(f"{label:42}" + "".join(f"{c:>14}" for c in cells))
