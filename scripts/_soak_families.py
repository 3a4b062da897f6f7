"""The rounds of scripts/soak_healthy.py: per family, a hard but healthy condition and a real fault.

A round is a fresh engine on fresh test hosts (``tests/support/multihost_engine.py``: the
upstream-shaped engine under ``mpirun``, one long request in flight, every step needing every rank
over the data network, a ``progress`` record every 0.25 s) with ranks 0 (the proxy, its hub) and 1
on hostA, 2 (hostB's agent) and 3 on hostB. The condition runs for its seconds; any fatal error
before the real fault is a false verdict; then the real fault, timed to the engine's fatal error.
:func:`run_round` runs one and returns a :class:`RoundResult`; everything it made (test hosts,
cgroups, FUSE mounts, the children carrying files to the rank) is removed in its ``finally``, and
what the removal found left is the round's ``leftovers``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import _multihost_agents as agents

from tests.support import netem
from tests.support.cgroups import CpuGroup, limit_hits
from tests.support.fuse_stall import SLOW_READ_PERIOD, FuseStall
from tests.support.multihost_engine import TWO_ON_B, Engine, StartFailed, start_hosts, timed_fatal
from tests.support.rank_loader import HandOver, hand_over
from tests.support.slow_reads import SlowReadResult
from tests.support.testhosts import TestHosts, wait_for
from trtllm_liveness.demo._cgroup_faults import MemoryGroup

D_STATE_TIMEOUT_S = 3.0
SCAN_INTERVAL_S = 1.0
STOPPED_TIMEOUT_S = 5.0
HEARTBEAT_TIMEOUT_S = 1.0
# quarantine_dir: a directory of the test hosts' own /run (never the machine's, nor the caller's
# TRTLLM_LIVENESS_QUARANTINE_DIR): a wedge of the proxy's host would otherwise quarantine the next round.
SETTINGS = (f"d_state_timeout_s={D_STATE_TIMEOUT_S:g},scan_interval_s={SCAN_INTERVAL_S:g},"
            f"stopped_timeout_s={STOPPED_TIMEOUT_S:g},heartbeat_timeout_s={HEARTBEAT_TIMEOUT_S:g},"
            "shutdown_term_s=1,shutdown_kill_s=1,quarantine_dir=/run/trtllm-liveness-soak")
MARGIN_S = 1.0  # the verdict crosses the network from hostB's agent; 2 shared cores
PROGRESS_S = 0.25
SETTLE_S = 1.0  # after the condition ends, still no verdict before the real fault
FATAL_WAIT_S = 10.0  # how long past its bound a real fault's verdict is still waited for (reported, not detected)
LOADER_RANK = 3  # hostB, not its agent's rank: the agent samples the other ranks of its host
STOP_RANK = 1  # hostA, the proxy's host: the stopped-rank rule watches the proxy's local ranks
SHORT_STOP_S = 2.0  # well under stopped_timeout_s
SHORT_STOP_RUN_S = 3.0  # running between two stops
CPU_SHARE = 0.1  # of one CPU: cpu.cfs_quota_us 10000 per cpu.cfs_period_us 100000 (v2: cpu.max "10000 100000")
MEMORY_LIMIT = 32 << 20  # the rank's memory group
DATA_FILE_SIZE = 64 << 20  # streamed through the page cache: twice the limit
ALLOCATION = 96 << 20  # the real fault: anonymous memory past the limit

FAMILIES = ("slow-io", "cpu-throttle", "short-stops", "mgmt-netem", "mgmt-outage", "memory")
CONDITIONS = {
    "slow-io": "rank 3's loader reads a FUSE file, each READ answered after 0.1-0.3 s (in D most of the time)",
    "cpu-throttle": f"rank 1 throttled to {CPU_SHARE:.0%} of a CPU (cgroup v1 cpu.cfs_quota_us)",
    "short-stops": f"rank 1 SIGSTOPped {SHORT_STOP_S:g} s then continued, every {SHORT_STOP_S + SHORT_STOP_RUN_S:g} s",
    "mgmt-netem": "hostB's management link: 1% loss, 0-0.2 s jitter each way, 2 of every 5 frames in dropped",
    "mgmt-outage": "hostB's management network down (data network up)",
    "memory": f"rank 3 in a {MEMORY_LIMIT >> 20} MiB memory group streaming a {DATA_FILE_SIZE >> 20} MiB file",
}
FAULTS = {
    "slow-io": "rank 3's loader reads a FUSE file never answered",
    "cpu-throttle": "rank 1 SIGSTOPped, held",
    "short-stops": "rank 1 SIGSTOPped, held",
    "mgmt-netem": "hostB partitioned (both networks)",
    "mgmt-outage": "hostB partitioned (both networks)",
    "memory": f"rank 3 allocates {ALLOCATION >> 20} MiB: the kernel's OOM kill",
}
EXPECTED = {"slow-io": "wedged", "cpu-throttle": "stalled", "short-stops": "stalled", "mgmt-netem": "lost",
            "mgmt-outage": "lost", "memory": "died"}
VICTIM_HOST = {"slow-io": "hostB", "cpu-throttle": "hostA", "short-stops": "hostA", "mgmt-netem": "hostB",
               "mgmt-outage": "hostB", "memory": "hostB"}
BOUND_S = {
    "slow-io": D_STATE_TIMEOUT_S + SCAN_INTERVAL_S + MARGIN_S,  # the hung-task rule's timeout plus one scan
    "cpu-throttle": STOPPED_TIMEOUT_S + SCAN_INTERVAL_S + MARGIN_S,  # T at every scan for the bound
    "short-stops": STOPPED_TIMEOUT_S + SCAN_INTERVAL_S + MARGIN_S,
    "mgmt-netem": HEARTBEAT_TIMEOUT_S + 0.5,  # silent and no progress for the timeout
    "mgmt-outage": HEARTBEAT_TIMEOUT_S + 0.5,
    "memory": 1.0,  # a death: the agent's pidfd, then the network
}


@dataclass
class RoundResult:
    """One round: the condition, how long it ran, a false verdict (at most one: it ends the
    engine), the engine's progress under it, the condition's own evidence, then the real fault."""

    family: str
    condition: str
    seconds: float = 0.0
    false_verdicts: int = 0
    false_verdict: str = ""
    iterations: int = 0  # rank 0's executor iterations under the condition (each needed every rank)
    longest_pause_s: float | None = None  # the longest stretch under it without one
    evidence: dict[str, Any] = field(default_factory=dict)
    fault: str = ""
    expected: str = ""
    bound_ms: float = 0.0
    injected: bool = False
    kind: str = ""  # the verdict's kind after the fault ("" none within the wait)
    host: str = ""
    ms: float | None = None
    reported: bool = False  # the expected kind naming the victim's host, within the wait
    detected: bool = False  # and within the bound
    message: str = ""
    error: str = ""  # why the round did not run (the hosts or the engine did not start, a step failed)
    leftovers: list[str] = field(default_factory=list)

    @property
    def served(self) -> bool:
        """Whether the engine kept making progress under the condition."""
        return self.iterations > 0


class StateSampler:
    """A thread sampling every thread's state of one process (root-namespace pid) every 0.1 s:
    the share of samples with a thread in ``D`` and in ``T``. ``stop()`` joins it (bounded)."""

    def __init__(self, pid: int | None, interval: float = 0.1) -> None:
        self.pid, self.interval = pid, interval
        self.samples = self.in_d = self.in_t = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-state-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while self.pid is not None and not self._stop.wait(self.interval):
            states = set()
            try:
                for tid in os.listdir(f"/proc/{self.pid}/task"):
                    with contextlib.suppress(OSError, IndexError), open(f"/proc/{self.pid}/task/{tid}/stat") as handle:
                        states.add(handle.read().rpartition(")")[2].split()[0])
            except OSError:
                return
            self.samples += 1
            self.in_d += "D" in states
            self.in_t += "T" in states

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(5)
        total = self.samples
        return {"state_samples": total, "share_in_d": round(self.in_d / total, 3) if total else None,
                "share_in_t": round(self.in_t / total, 3) if total else None}


def write_data_file(path: str) -> None:
    """The memory round's file: :data:`DATA_FILE_SIZE` bytes of the slow-read pattern (byte ``i``
    is ``i % SLOW_READ_PERIOD``, so the reader checks what it got), flushed and dropped from the
    page cache (its pages are then charged to the rank that reads them, not to this process)."""
    chunk = 1 << 20
    pattern = bytes(range(SLOW_READ_PERIOD)) * (chunk // SLOW_READ_PERIOD + 2)
    with open(path, "wb") as handle:
        for offset in range(0, DATA_FILE_SIZE, chunk):
            start = offset % SLOW_READ_PERIOD
            handle.write(pattern[start:start + chunk])
        handle.flush()
        os.fsync(handle.fileno())
        os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _pauses(engine: Engine, begin: float, end: float) -> tuple[int, float | None]:
    """Rank 0's iterations between ``begin`` and ``end`` and the longest stretch without one (to
    the progress records' resolution: one every :data:`PROGRESS_S`)."""
    records = [p for p in engine.progress() if begin <= p["t"] <= end]
    if len(records) < 2:
        return 0, None
    longest, last_t, last_n = 0.0, records[0]["t"], records[0]["iterations"]
    for record in records[1:]:
        if record["iterations"] != last_n:
            longest = max(longest, record["t"] - last_t)
            last_t, last_n = record["t"], record["iterations"]
    longest = max(longest, records[-1]["t"] - last_t)
    return records[-1]["iterations"] - records[0]["iterations"], round(longest, 3)


class _Round:
    """The state of one engine round: what it made, so that its ``finally`` can remove it."""

    def __init__(self, family: str, seconds: float, data_file: str, cgroup_prefix: str) -> None:
        self.family, self.seconds, self.data_file, self.prefix = family, seconds, data_file, cgroup_prefix
        self.hosts = TestHosts(("hostA", "hostB"))
        self.stall: FuseStall | None = None
        self.groups: list[CpuGroup | MemoryGroup] = []
        self.hand_overs: list[HandOver] = []
        self.socket = ""
        self.stopped: tuple[str, int] | None = None  # a rank left SIGSTOPped by a short stop, to continue

    def rank_pid(self, engine: Engine, rank: int) -> int:
        pid = self.hosts.root_pid(engine.host_of(rank), engine.pid_of(rank))
        if pid is None:
            raise StartFailed(f"rank {rank} is gone before the condition")
        return pid

    def hand(self, request: dict[str, Any], file: str = "") -> HandOver:
        handed = hand_over(self.socket, request, file)
        self.hand_overs.append(handed)
        started = handed.line(30)
        if started is None or not started.startswith("started "):
            raise RuntimeError(f"rank {LOADER_RANK}'s loader did not take {request}: {started!r} {handed.error()}")
        return handed

    # ---------------------------------------------------------------- conditions

    def condition(self, engine: Engine) -> dict[str, Any]:
        """Run the family's condition for :attr:`seconds`; its evidence."""
        family, seconds = self.family, self.seconds
        if family == "slow-io":
            assert self.stall is not None
            sampler = StateSampler(self.rank_pid(engine, LOADER_RANK))
            reader = self.hand({"op": "read", "seconds": seconds, "size": 4096, "check": True},
                               self.stall.slow_read_path)
            line = reader.line(seconds + 30)
            return {**_read_evidence(line), **sampler.stop()}
        if family == "memory":
            group = MemoryGroup(MEMORY_LIMIT, self.prefix)
            self.groups.append(group)
            pid = self.rank_pid(engine, LOADER_RANK)
            group.add(pid)
            sampler = StateSampler(pid)
            reader = self.hand({"op": "read", "seconds": seconds, "size": 1 << 20, "pause_s": 0.02, "check": True},
                               self.data_file)
            line = reader.line(seconds + 30)
            return {**_read_evidence(line), "limit_hits": limit_hits(group), **sampler.stop()}
        if family == "cpu-throttle":
            group = CpuGroup(CPU_SHARE, prefix=self.prefix)
            self.groups.append(group)
            pid = self.rank_pid(engine, STOP_RANK)
            group.add(pid)
            sampler = StateSampler(pid)
            try:
                time.sleep(seconds)
            finally:
                periods, waited = group.throttled()
                group.remove()  # back to the root group: unthrottled
            return {"throttled_periods": periods, "throttled_s": round(waited, 3), **sampler.stop()}
        if family == "short-stops":
            sampler = StateSampler(self.rank_pid(engine, STOP_RANK))
            stops, end = 0, time.monotonic() + seconds
            while time.monotonic() + SHORT_STOP_S <= end:
                self.stopped = ("hostA", engine.pid_of(STOP_RANK))
                self.hosts.kill(*self.stopped, signal.SIGSTOP)
                stops += 1
                time.sleep(SHORT_STOP_S)
                self.hosts.kill(*self.stopped, signal.SIGCONT)
                self.stopped = None
                time.sleep(max(0.0, min(SHORT_STOP_RUN_S, end - time.monotonic())))
            time.sleep(max(0.0, end - time.monotonic()))
            return {"stops": stops, "stop_s": SHORT_STOP_S, **sampler.stop()}
        if family == "mgmt-netem":
            time.sleep(seconds)
            suspect = sum(any(view[0] == "suspect" for view in p["hosts"].values()) for p in engine.progress())
            return {"frames_dropped": netem.dropped(self.hosts, "hostB"), "progress_records_with_suspect": suspect}
        raise ValueError(f"no condition {family!r}")

    # ---------------------------------------------------------------- real faults

    def fault(self, engine: Engine) -> float:
        """Inject the family's real fault; the time it happened (monotonic)."""
        family = self.family
        if family == "slow-io":
            assert self.stall is not None
            t0 = time.monotonic()  # before the hand-over: its child's start is counted too
            self.hand({"op": "read", "seconds": 3600, "size": 4096}, self.stall.read_path)
            return t0
        if family in ("cpu-throttle", "short-stops"):
            t0 = time.monotonic()
            self.hosts.kill("hostA", engine.pid_of(STOP_RANK), signal.SIGSTOP)
            return t0
        if family == "mgmt-netem":
            t0 = time.monotonic()
            self.hosts.partition("hostB")
            return t0
        if family == "memory":
            group = self.groups[-1]
            assert isinstance(group, MemoryGroup)
            self.hand({"op": "allocate", "bytes": ALLOCATION})
            # The kernel's kill: the group's oom_kill counter moves (sampled every 10 ms; the fault
            # time is the last sample before it did, so the time is never shortened).
            before = time.monotonic()
            while group.oom_kills() == 0:
                if time.monotonic() - before > 30:
                    raise RuntimeError(f"no OOM kill in {group.path} within 30 s")
                before = time.monotonic()
                time.sleep(0.01)
            return before
        raise ValueError(f"no fault {family!r}")

    def close(self) -> list[str]:
        """Remove everything the round made, also after a failure; what was left."""
        left: list[str] = []
        if self.stopped is not None:
            with contextlib.suppress(OSError):
                self.hosts.kill(*self.stopped, signal.SIGCONT)
        if self.stall is not None:
            self.stall.release()  # first: a loader thread held in D can then end
        for handed in self.hand_overs:
            handed.close()
        for group in self.groups:
            if not group.remove():
                left.append(f"cgroup {group.path}")
        return left + self.hosts.close()


def _read_evidence(line: str | None) -> dict[str, Any]:
    try:
        read = SlowReadResult.parse(line or "")
    except ValueError:
        return {"reader": line}
    return {"reads": read.reads, "bytes_read": read.nbytes, "wrong_reads": read.mismatches,
            "longest_read_s": read.longest_read_s}


def _engine_round(result: RoundResult, data_file: str, cgroup_prefix: str) -> None:
    state = _Round(result.family, result.seconds, data_file, cgroup_prefix)
    result.seconds = 0.0
    try:
        start_hosts(state.hosts)
        if result.family == "mgmt-netem":
            netem.impair(state.hosts, ("hostB",))
            netem.bursts(state.hosts, "hostB")
        if result.family == "slow-io":
            state.stall = FuseStall().__enter__()
        state.socket = os.path.join(state.hosts.shared, "loader.sock")
        engine = Engine(state.hosts, TWO_ON_B, SETTINGS,
                        program={"progress_s": PROGRESS_S, "loader": {"rank": LOADER_RANK, "socket": state.socket}})
        if not wait_for(lambda: bool(engine.progress()), 10):
            raise StartFailed(f"no progress record:\n{engine.diagnostics()}")
        begin = time.monotonic()
        result.evidence = state.condition(engine)
        end = time.monotonic()
        result.seconds = round(end - begin, 3)
        time.sleep(SETTLE_S)
        result.iterations, result.longest_pause_s = _pauses(engine, begin, end)
        fatal = engine.record("fatal")
        if fatal is not None:
            result.false_verdicts, result.false_verdict = 1, str(fatal.get("fatal"))
            return
        t0 = state.fault(engine)
        result.injected = True
        verdict = timed_fatal(engine, t0, BOUND_S[result.family] + FATAL_WAIT_S, shutdown=False)
        result.kind, result.host, result.message = verdict.kind, verdict.host, verdict.message
        result.ms = None if verdict.ms is None else round(verdict.ms, 1)
    except (StartFailed, RuntimeError, OSError) as exc:
        result.error = f"{type(exc).__name__}: {str(exc)[-1500:]}"
    finally:
        result.leftovers = state.close()


def _outage_round(result: RoundResult) -> None:
    """The 30 s outage is scripts/_multihost_agents.py's, with the soak's settings (3 hosts there)."""
    try:
        control = agents.false_alarms_mgmt_outage(result.seconds, liveness=SETTINGS)
    except StartFailed as exc:
        result.error = f"StartFailed: {str(exc)[-1500:]}"
        return
    result.false_verdicts, result.false_verdict = control.alarms, control.alarm
    result.iterations = control.iterations_during
    result.evidence = {"suspect_seen": control.suspect_seen, "alive_again_s": control.alive_again_s}
    result.leftovers = list(control.leftovers)
    result.injected = control.alarms == 0  # no verdict during the outage: then hostB was partitioned
    result.kind, result.host, result.ms = control.real_fault_kind, control.real_fault_host, control.real_fault_ms
    result.message = control.real_fault_message


def run_round(family: str, seconds: float, data_file: str, cgroup_prefix: str) -> RoundResult:
    """One round of ``family`` with its condition for ``seconds``."""
    result = RoundResult(family, CONDITIONS[family], seconds, fault=FAULTS[family], expected=EXPECTED[family],
                         bound_ms=BOUND_S[family] * 1000)
    if family == "mgmt-outage":
        _outage_round(result)
    else:
        _engine_round(result, data_file, cgroup_prefix)
    result.reported = result.injected and result.kind == result.expected and result.host == VICTIM_HOST[family]
    result.detected = result.reported and result.ms is not None and result.ms <= result.bound_ms
    return result
