"""The upstream-shaped engine across test hosts, with its agents: start it, fault it, read its output.

Shared by tests/unittest/multihost/test_agents.py, scripts/bench_multihost.py (through
scripts/_multihost_agents.py) and the multi-host demo (``trtllm-liveness demo --hosts N``, from a
checkout). The engine is ``tests/programs/proxy_death_child.py`` in comm mode (the fake TensorRT-LLM
main tree, ``MpiCommSession`` under a real ``mpirun``, liveness on, the agent hub on by default)
with one long request in flight, every step acknowledged by every rank over the data network
(``step_acks``, as a tensor-parallel step needs every rank): rank 0, the proxy and its agent hub,
on hostA; the lowest rank of every other host runs that host's agent. Rank 0 prints a ready line
with the monitor's per-rank view, then the engine's fatal error (kind, rank, host, pid, the
monotonic time it was recorded: CLOCK_MONOTONIC is the machine's one clock; whether the pending
request failed; health), then what its bounded ``llm.shutdown()`` reported of every host.

The launch, and why:

* ``--runtime-options recoverable,error-nonzero-status=false``: PRRTE does not end the job when a
  rank dies (recoverable) nor when one exits with a non-zero status (an agent's rank ends with 75
  after a stop), so the proxy lives to shut down and print its last line;
* ULFM on (``fault_tolerant=True``, ``OMPI_MCA_mpi_ft_enable=1``): without it the survivors' TCP
  BTL calls a dead peer's closed socket fatal and Open MPI aborts the job ("An error occurred in
  Socket closed ... MPI_ERRORS_ARE_FATAL"), killing the proxy right after its fatal line;
* ``OMPI_MCA_mpi_yield_when_idle=1``: the test hosts share this machine's 2 cores, and Open MPI's
  blocking calls spin: 4 or 5 ranks spinning would starve the proxy's threads for tens of
  milliseconds at a time. Open MPI yields by itself where it knows a host is oversubscribed; here
  each host looks like a whole machine to it (a real cluster gives each rank its own cores);
* ``--output file=<the test hosts' shared directory>/...``: the ranks' output is written to files by
  each host's own PRRTE daemon, not forwarded to mpirun: when a host crashes
  PRRTE ends the whole job ("lost communication with a remote daemon ... will terminate the job";
  no runtime option changes that) and drops what the proxy wrote meanwhile.

Every wait is bounded. Raises :class:`EngineError` (with the job's output) when the engine does not
start or a line does not come.
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from tests.support.testhosts import MpiJob, TestHosts, TestHostsError, wait_for
from tests.support.waits import sigkill_and_time_exit

REPO = Path(__file__).resolve().parents[2]


class EngineError(RuntimeError):
    """The engine did not start, or a line it should print did not come (output in the message)."""


class StartFailed(EngineError):
    """The test hosts or the engine did not start: nothing was measured (a failed start, not a miss)."""


def start_hosts(hosts: TestHosts) -> None:
    """``hosts.start()``, its failure raised as :class:`StartFailed`."""
    try:
        hosts.start()
    except TestHostsError as exc:
        raise StartFailed(f"the test hosts did not start: {exc}") from exc


START_S = 60.0  # the engine across 3 hosts starts in ~2 s; 2 shared cores under load
FATAL_S = 20.0  # a death is reported in milliseconds, a silence after heartbeat_timeout_s (1 s)
SHUTDOWN_S = 20.0  # shutdown_term_s + shutdown_kill_s + a few seconds at most
GONE_S = 20.0  # a host's ranks end within about heartbeat_timeout_s + the stop's bounds
QUIET_S = 2.0  # bounded observation window: no fatal error after bad messages
LIVENESS = "heartbeat_timeout_s=1,heartbeat_ceiling_s=5,shutdown_term_s=1,shutdown_kill_s=1"  # the tests'
DEFAULTS = "shutdown_term_s=1,shutdown_kill_s=1"  # the timed trials': the default heartbeat
RUNTIME_OPTIONS = ["--runtime-options", "recoverable,error-nonzero-status=false"]
LAYOUT = (("hostA", 2), ("hostB", 1), ("hostC", 1))  # ranks 0, 1 | 2 | 3
TWO_ON_B = (("hostA", 2), ("hostB", 2))  # ranks 0, 1 | 2 (agent), 3
AGENT_EXIT_STATUS = 75


class Engine:
    """One engine job across the test hosts; rank 0's (the proxy's) output read from its file."""

    def __init__(self, hosts: TestHosts, layout: Sequence[tuple[str, int]] = LAYOUT, liveness: str = LIVENESS, *,
                 request: bool = True, wrapper: Sequence[str] = (), executor_cls: bool = True,
                 fault_tolerant: bool = True, env: Mapping[str, str] | None = None,
                 exit_statuses: bool = False, program: Mapping[str, Any] | None = None,
                 node_names: bool = False) -> None:
        """``fault_tolerant=False``: Open MPI's default error handling (the engine may then be
        aborted by MPI, see the module docstring); ``env``: more of the ranks' environment;
        ``exit_statuses``: a shell in front of each rank writes its exit status where the head
        reads it (:meth:`exit_status`; mpirun's own status says little: it is 0 after a host
        crash, and the runtime options below keep the job going when a rank ends); ``program``:
        more options of tests/programs/proxy_death_child.py (``step_acks``, ``snapshots``);
        ``node_names``: each rank's ``SLURMD_NODENAME`` and ``NODE_NAME`` are its host's name, as
        slurmd and the Kubernetes downward API give every node's processes their own."""
        self.hosts = hosts
        # PRRTE writes <out>.<job>.<rank>.out|err, making (and chmod-ing to 0750!) the directory of
        # <out> where it runs, mpirun's head included: never a directory shared with anybody else,
        # such as /tmp. The test hosts' shared directory is seen by the head and every host.
        self.out = os.path.join(hosts.shared, f"out-{len(hosts.jobs)}", "rank")
        # executor_cls: LLM(executor_cls=liveness_executor_class()); else upstream's own executor, which
        # only the import hook (the autoload) can make the liveness one: a trtllm-serve.
        # step_acks: every step waits for every rank over the data network, as a tensor-parallel
        # step does; a rank or host that stops taking part stops the engine's progress.
        options = {"session": "comm", "tree": "trtllm_main", "liveness": executor_cls, "watch_fatal": True,
                   "no_request": not request, "step_acks": True, **(program or {})}
        program = [sys.executable, "-u", "-m", "tests.programs.proxy_death_child", json.dumps(options)]
        if node_names:
            program = ["/bin/sh", "-c", 'SLURMD_NODENAME=$(hostname) NODE_NAME=$(hostname) exec "$@"', "rank",
                       *program]
        if exit_statuses:
            status = os.path.join(os.path.dirname(self.out), "status-$OMPI_COMM_WORLD_RANK")
            program = ["/bin/sh", "-c", f'"$@"; echo $? > "{status}"', "rank", *program]
        self.job: MpiJob = hosts.mpirun(
            layout, program, mpirun_args=[*RUNTIME_OPTIONS, "--output", f"file={self.out}"],
            fault_tolerant=fault_tolerant, wrapper=wrapper,
            env={"TRTLLM_WORKER_LIVENESS": liveness, "PYTHONPATH": str(REPO), "OMPI_MCA_mpi_yield_when_idle": "1",
                 **(env or {})})
        ready = self.wait_record("ready", START_S)
        if ready is None:
            self.job.kill()
            raise StartFailed(f"the engine did not start:\n{self.diagnostics()}")
        self.ready: dict[str, Any] = ready

    def _file(self, host: str, suffix: str) -> str:
        del host  # every host's daemon writes into the shared directory
        found = glob.glob(f"{self.out}.*.{suffix}")
        return found[0] if found else ""

    def _read(self, host: str, suffix: str) -> str:
        path = self._file(host, suffix)
        try:
            with open(path, errors="replace") as handle:
                return handle.read()
        except OSError:
            return ""

    def stdout(self) -> str:
        return self._read("hostA", "0.out")

    def stderr(self) -> str:
        return self._read("hostA", "0.err")

    def records(self) -> list[dict[str, Any]]:
        out = []
        for line in self.stdout().splitlines():
            if line.startswith("{") and line.endswith("}"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
        return out

    def record(self, key: str) -> dict[str, Any] | None:
        return next((record for record in self.records() if key in record), None)

    def wait_record(self, key: str, timeout: float) -> dict[str, Any] | None:
        found: list[dict[str, Any]] = []

        def seen() -> bool:
            record = self.record(key)
            if record is not None:
                found.append(record)
            return record is not None

        wait_for(seen, timeout, 0.02)
        return found[0] if found else None

    def progress(self) -> list[dict[str, Any]]:
        """The ``progress`` records so far (``program={"progress_s": ...}``): time, rank 0's
        iterations, the per-rank view."""
        return [record["progress"] for record in self.records() if "progress" in record]

    def pid_of(self, rank: int) -> int:
        return int(self.ready["hosts"][str(rank)][2])

    def host_of(self, rank: int) -> str:
        return str(self.ready["hosts"][str(rank)][1])

    def rank_log(self, host: str, rank: int) -> str:
        tmp = os.environ.get("TMPDIR", "/tmp")
        try:
            with open(f"/proc/{self.hosts.host(host).pid1}/root{tmp}/rank-{rank}.log", errors="replace") as handle:
                return handle.read()
        except OSError:
            return ""

    def exit_status(self, rank: int) -> int | None:
        """Rank ``rank``'s exit status (128 + N: killed by signal N), or None while it runs (or
        without ``exit_statuses``)."""
        try:
            with open(os.path.join(os.path.dirname(self.out), f"status-{rank}")) as handle:
                return int(handle.read().strip())
        except (OSError, ValueError):
            return None

    def hub_port(self) -> int:
        """The agent hub's TCP port, as hostB's agent logged it (0 if it did not)."""
        match = re.search(r"reporting to tcp://[^:\s]+:(\d+)", self.rank_log("hostB", 2))
        return int(match.group(1)) if match else 0

    def diagnostics(self) -> str:
        return (f"mpirun status {self.job.popen.poll()}\n--- mpirun:\n{self.job.output()[-3000:]}\n"
                f"--- rank 0 stdout:\n{self.stdout()[-3000:]}\n--- rank 0 stderr:\n{self.stderr()[-6000:]}")

    def wait_fatal(self, timeout: float = FATAL_S) -> dict[str, Any]:
        fatal = self.wait_record("fatal", timeout)
        if fatal is None or fatal["fatal"] is None:
            raise EngineError(f"no fatal error within {timeout:.0f} s:\n{self.diagnostics()}")
        return fatal

    def assert_fatal(self, fatal: dict[str, Any], kinds: Sequence[str], rank: int) -> None:
        """The fatal line names ``rank`` as the ready line placed it; the request failed, health false."""
        context = f"{fatal}\n{self.diagnostics()}"
        assert fatal["kind"] in kinds, context
        assert fatal["rank"] == rank, context
        assert fatal["host"] == self.host_of(rank), context
        assert fatal["pid"] == self.pid_of(rank), context
        assert fatal["pending_failed"] is True, context
        assert fatal["health"] is False, context

    def assert_shutdown(self) -> dict[str, Any]:
        done = self.wait_record("shutdown_s", SHUTDOWN_S)
        assert done is not None, f"llm.shutdown() did not return:\n{self.diagnostics()}"
        assert isinstance(done["shutdown_s"], float), done
        return done

    def ranks_on(self, *hosts: str) -> list[tuple[str, int]]:
        return [(host, int(pid)) for _rank, (_state, host, pid, _method) in self.ready["hosts"].items()
                if host in hosts]

    def wait_gone(self, ranks: Sequence[tuple[str, int]], timeout: float = GONE_S) -> list[tuple[str, int]]:
        """Wait (bounded) until no process of ``ranks`` (host, pid in host) is left; return those left.
        A zombie counts as gone."""
        def left() -> list[tuple[str, int]]:
            out = []
            for host, pid in ranks:
                root = self.hosts.root_pid(host, pid)
                if root is not None and _state(root) not in ("Z", "X", None):
                    out.append((host, pid))
            return out

        wait_for(lambda: not left(), timeout, 0.05)
        return left()


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return None




# --------------------------------------------------------------------------- timed trials (bench, demo)


class Fatal(NamedTuple):
    """One trial: fault -> the engine's fatal error recorded (``ms``; None: none within the wait)."""

    ms: float | None
    kind: str
    host: str
    rank: int | None
    pending_failed: bool
    message: str
    host_stops: list[dict[str, Any]]
    shutdown_s: float | None = None  # the bounded shutdown after it returned in this long (None: no line)
    exit_ms: float | None = None  # remote kill: fault -> the victim's exit seen from here (the kernel's floor)
    statuses: dict[str, Any] | None = None  # the monitor's per-rank view when the fatal error was printed
    leftovers: tuple[str, ...] = ()  # what the test hosts' removal found left (processes, namespaces)
    failed_start: str = ""  # why the hosts or the engine did not start: no fault was injected (never a miss)
    fatal_line: str = ""  # the fatal ERROR line's text (named rank, host, evidence), as the shutdown record has it
    snapshot: dict[str, Any] | None = None  # the fatal verdict's snapshot before the stop (FatalSnapshot.to_dict())


def failed_start(exc: Exception) -> Fatal:
    """The trial whose hosts or engine did not start: a failed start, reported as such."""
    return Fatal(None, "", "", None, False, "", [], failed_start=f"{type(exc).__name__}: {str(exc)[-1500:]}")


def timed_fatal(engine: Engine, t0: float, wait: float = FATAL_S, *, shutdown: bool = True) -> Fatal:
    """The fatal error after a fault injected at ``t0`` (monotonic), and the shutdown's reports."""
    fatal = engine.wait_record("fatal", wait)
    if fatal is None or fatal["fatal"] is None:
        return Fatal(None, "", "", None, False, "", [])
    done = engine.wait_record("shutdown_s", SHUTDOWN_S) if shutdown else None
    return Fatal((fatal["detected_at"] - t0) * 1000, fatal["kind"], fatal["host"], fatal["rank"],
                 fatal["pending_failed"], fatal["fatal"], done["host_stops"] if done else [],
                 done["shutdown_s"] if done else None, statuses=fatal.get("statuses"),
                 fatal_line=(done.get("fatal_line") or "") if done else "",
                 snapshot=done.get("fatal_snapshot") if done else None)





def remote_kill(layout: Sequence[tuple[str, int]] = LAYOUT, victim: int = 2) -> Fatal:
    """SIGKILL of rank ``victim`` on hostB (rank 2 runs hostB's agent) on fresh test hosts."""
    hosts = TestHosts(tuple(name for name, _count in layout))
    try:
        start_hosts(hosts)
        engine = Engine(hosts, layout, DEFAULTS)
        fd, _pid = hosts.pidfd_of("hostB", engine.pid_of(victim))  # opened and verified before the clock
        try:
            t0, exited = sigkill_and_time_exit(fd, FATAL_S)
        finally:
            os.close(fd)
        fatal = timed_fatal(engine, t0)
        fatal = fatal._replace(exit_ms=None if exited is None else (exited - t0) * 1000)
    except StartFailed as exc:
        fatal = failed_start(exc)
    finally:
        left = hosts.close()
    return fatal._replace(leftovers=tuple(left))


def layout_of(names: Sequence[str]) -> tuple[tuple[str, int], ...]:
    """hostA and hostB with 2 ranks each (hostB: its agent's and one more), the others with 1."""
    return tuple((name, 2 if name in ("hostA", "hostB") else 1) for name in names)


def host_fault(kind: str, names: Sequence[str] = ("hostA", "hostB", "hostC"),
               layout: Sequence[tuple[str, int]] | None = None) -> Fatal:
    """``crash``, ``partition`` or ``silent`` (cut, then crash) of hostB, on fresh test hosts.

    For a crash, mpirun is stopped across it (SIGSTOP, then SIGCONT): PRRTE ends the whole job
    within milliseconds of losing a daemon, racing the proxy's own lines; what is measured is the
    engine's reaction, not PRRTE's (``trtllm-liveness launch`` deals with PRRTE's status 0)."""
    hosts = TestHosts(tuple(names))
    try:
        start_hosts(hosts)
        if layout is None:
            layout = LAYOUT if tuple(names) == ("hostA", "hostB", "hostC") else layout_of(names)
        engine = Engine(hosts, layout, DEFAULTS)
        mpirun = engine.job.popen.pid
        if kind == "crash":
            os.kill(mpirun, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            if kind == "crash":
                hosts.crash("hostB")
            elif kind == "partition":
                hosts.partition("hostB")
            else:
                hosts.silent_loss("hostB")
            fatal = timed_fatal(engine, t0)
        finally:
            if kind == "crash":
                os.kill(mpirun, signal.SIGCONT)
    except StartFailed as exc:
        fatal = failed_start(exc)
    finally:
        left = hosts.close()
    return fatal._replace(leftovers=tuple(left))


def remote_stop(names: Sequence[str] = ("hostA", "hostB", "hostC"), stall_timeout_s: float = 3.0) -> Fatal:
    """hostB runs ranks 2 (its agent) and 3; rank 3 SIGSTOPped (by its pid, verified on hostB)
    while every step waits for every rank (``step_acks``): the engine stalls, and the fatal verdict
    names rank 3 on hostB from the thread states hostB's agent reads, then snapshots every host
    before the stop. Measured from the SIGSTOP; the bound is the stall timeout plus one tick. The
    snapshot's bound before the stop is generous (5 s): the shared cores of a loaded machine."""
    hosts = TestHosts(tuple(names))
    try:
        start_hosts(hosts)
        engine = Engine(hosts, layout_of(names), f"{DEFAULTS},stall_timeout_s={stall_timeout_s},stall_action=fatal,"
                                                 "diagnosis_before_stop_hosts_s=5", program={"step_acks": True})
        t0 = time.monotonic()
        hosts.kill("hostB", engine.pid_of(3), signal.SIGSTOP)
        fatal = timed_fatal(engine, t0, FATAL_S + stall_timeout_s)
    except StartFailed as exc:
        fatal = failed_start(exc)
    finally:
        left = hosts.close()
    return fatal._replace(leftovers=tuple(left))


def remote_wedge(d_state_timeout_s: float = 2.0, scan_interval_s: float = 1.0,
                 names: Sequence[str] = ("hostA", "hostB")) -> Fatal:
    """hostB runs ranks 2 (its agent) and 3; rank 3 frozen in D (cgroup v1 freezer) -> wedged.
    Measured from the freeze; the bound is the D timeout plus one scan."""
    from trtllm_liveness.demo._cgroup_faults import FreezerGroup

    hosts = TestHosts(tuple(names))
    try:
        start_hosts(hosts)
        engine = Engine(hosts, layout_of(names), liveness=f"{DEFAULTS},d_state_timeout_s={d_state_timeout_s},"
                                                 f"scan_interval_s={scan_interval_s}")
        victim = hosts.root_pid("hostB", engine.pid_of(3))
        group = FreezerGroup()
        try:
            if victim is None:
                raise EngineError("rank 3 is gone before the freeze")
            t0 = time.monotonic()
            group.freeze([victim])
            fatal = timed_fatal(engine, t0, FATAL_S + d_state_timeout_s)
        finally:
            group.remove()  # thawed first: a frozen process would keep its host's PID 1 from ending
    except StartFailed as exc:
        fatal = failed_start(exc)
    finally:
        left = hosts.close()
    return fatal._replace(leftovers=tuple(left))
