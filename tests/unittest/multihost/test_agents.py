"""The engine's per-host agents, on real mpirun jobs across namespace test hosts.

Each test runs the upstream-shaped engine (``tests/programs/proxy_death_child.py``, comm session:
the fake TensorRT-LLM main tree, ``MpiCommSession`` under ``mpirun``, liveness on, one long
request in flight) across the ``test_hosts`` fixture: rank 0, the proxy and its agent hub, on
hostA; the lowest rank of hostB and of hostC runs that host's agent. Rank 0 prints a ready line
with the monitor's per-rank view, then the engine's fatal error (kind, rank, host, pid, whether
the pending request failed, health), then what its bounded ``llm.shutdown()`` reported.

The launch, and why: tests/support/multihost_engine.py (shared with the bench and the demo).

Every wait is bounded; no timing is asserted (``scripts/bench_multihost.py`` measures).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.facilities import needs, require_facility
from tests.support.multihost_engine import (
    AGENT_EXIT_STATUS,
    FATAL_S,
    LIVENESS,
    QUIET_S,
    TWO_ON_B,
    Engine,
)
from tests.support.process_tracker import ProcessTracker
from tests.support.stuck_processes import Freezer
from tests.support.testhosts import TestHosts, wait_for
from tests.support.waits import WAIT_SCALE, wait_until
from trtllm_liveness.integrations.trtllm._engine_shutdown import UPSTREAM_SHUTDOWN_THREAD

pytestmark = [pytest.mark.multihost, pytest.mark.real_process, pytest.mark.mpi, needs("testhosts", "mpi")]

def _before(engine: Engine) -> None:
    """Every rank watched and alive at the start, by the method expected of its host."""
    hosts = engine.ready["hosts"]
    for rank, (state, host, _pid, method) in hosts.items():
        assert state == "alive", hosts
        assert method == ("pidfd" if host == "hostA" else "agent"), (rank, hosts)


# --------------------------------------------------------------------------- a rank dies


@pytest.mark.timeout(120)
def test_a_lost_host_on_v12_leaves_no_thread_of_the_extension_but_upstreams_named_runner(test_hosts: TestHosts) -> None:
    """The partition on 1.2.x, whose executor reports no iterations: only sampled output is
    progress, so the partitioned host is lost once ``heartbeat_ceiling_s`` passed without it. When
    ``shutdown()`` returns every thread of the engine has ended within its bound, as on main
    (:func:`test_partition_is_a_lost_host_and_its_ranks_end`), but upstream's ``shutdown()``
    runner: 1.2.x joins its futures, its dispatch thread and its session's pool without a bound, and
    rank 0's task runs in this process, waiting on the lost rank; so the runner may be left
    blocked, named by its one WARNING (as after a wedge there)."""
    engine = Engine(test_hosts, program={"tree": "trtllm_v12"})
    _before(engine)
    test_hosts.partition("hostB")
    fatal = engine.wait_fatal()
    engine.assert_fatal(fatal, ["lost"], 2)
    assert "host hostB" in fatal["fatal"] and "beyond heartbeat_ceiling_s" in fatal["fatal"], fatal
    done = engine.assert_shutdown()
    assert {stop["host"]: stop["outcome"] for stop in done["host_stops"]}["hostB"] == "lost", done
    # Rank 0's iteration reporter belongs to its rank process (as in main's partition test).
    left = set(done["extension_threads"]) - {"trtllm-liveness-iterations"}
    assert left <= {UPSTREAM_SHUTDOWN_THREAD}, done
    if left:  # its WARNING was written before shutdown() returned; rank 0's stderr reaches its file apart
        assert wait_until(lambda: "upstream shutdown still blocked" in engine.stderr(), 10 * WAIT_SCALE), \
            engine.diagnostics()
        assert engine.stderr().count("upstream shutdown still blocked") == 1, engine.diagnostics()
    assert "threads still running after their bound" not in engine.stderr(), engine.diagnostics()


@pytest.mark.timeout(120)
def test_sigkill_of_the_agents_own_rank(test_hosts: TestHosts) -> None:
    """SIGKILL of rank 2 (hostB's agent runs in it): its connection closes, the hub reports it dead."""
    engine = Engine(test_hosts)
    _before(engine)
    test_hosts.kill("hostB", engine.pid_of(2), signal.SIGKILL)
    fatal = engine.wait_fatal()
    engine.assert_fatal(fatal, ["died"], 2)
    assert "hostB" in fatal["fatal"] and "agent" in fatal["fatal"], fatal
    assert fatal["statuses"]["2"][0] == "exited", fatal
    engine.assert_shutdown()


@pytest.mark.timeout(120)
def test_sigkill_of_a_rank_the_agent_watches(test_hosts: TestHosts) -> None:
    """hostB runs ranks 2 (the agent) and 3; SIGKILL of rank 3: the agent's pidfd sees it and
    reports it; the hub names rank 3 and the agent that reported it."""
    engine = Engine(test_hosts, TWO_ON_B)
    _before(engine)
    assert engine.host_of(2) == engine.host_of(3) == "hostB"
    test_hosts.kill("hostB", engine.pid_of(3), signal.SIGKILL)
    fatal = engine.wait_fatal()
    engine.assert_fatal(fatal, ["died"], 3)
    assert "reported by the agent on host hostB" in fatal["fatal"], fatal
    assert fatal["statuses"]["2"][0] == "alive", fatal  # the agent's own rank is fine
    done = engine.assert_shutdown()
    stops = {stop["host"]: stop for stop in done["host_stops"]}
    assert stops["hostB"]["ranks"] == [2, 3], done


# --------------------------------------------------------------------------- a host goes away


@pytest.mark.timeout(120)
def test_host_crash(test_hosts: TestHosts) -> None:
    """hostB's PID 1 SIGKILLed: every process of the host dies and its connections are closed.

    PRRTE ends the whole job when it loses a daemon ("We cannot recover from this failure"),
    within milliseconds, racing the proxy's fatal line (measured: the proxy wrote it 2 ms before
    PRRTE's SIGCONT/SIGTERM, and the line was lost with the job). mpirun (PRRTE's head, in the
    head host) is stopped across the crash, so that what is observed is the engine's reaction,
    not PRRTE's; it is let go at the end (and ends the job then)."""
    engine = Engine(test_hosts)
    _before(engine)
    mpirun = engine.job.popen.pid
    os.kill(mpirun, signal.SIGSTOP)
    try:
        test_hosts.crash("hostB")
        fatal = engine.wait_fatal()
        engine.assert_fatal(fatal, ["died", "lost"], 2)
        assert "hostB" in fatal["fatal"], fatal
        done = engine.assert_shutdown()
        stops = {stop["host"]: stop for stop in done["host_stops"]}
        assert stops["hostB"]["outcome"] == "lost", done
    finally:
        os.kill(mpirun, signal.SIGCONT)


@pytest.mark.timeout(120)
def test_partition_is_a_lost_host_and_its_ranks_end(test_hosts: TestHosts) -> None:
    """hostB's links down (both networks): nothing is closed, the hub hears nothing for
    heartbeat_timeout_s and the engine, whose every step waits for every rank, stops progressing:
    the host is lost, naming it, its ranks and both signals; on hostB the agent hears nothing from
    the hub either and, its ranks making no progress, ends them past heartbeat_ceiling_s (its own
    with status 75)."""
    engine = Engine(test_hosts)
    _before(engine)
    on_b = engine.ranks_on("hostB")
    test_hosts.partition("hostB")
    fatal = engine.wait_fatal()
    engine.assert_fatal(fatal, ["lost"], 2)
    assert "host hostB" in fatal["fatal"] and "unreachable ranks: 2 (pid" in fatal["fatal"], fatal
    assert "no heartbeat from host hostB's agent" in fatal["fatal"], fatal
    assert "and no progress of the engine" in fatal["fatal"], fatal
    assert fatal["statuses"]["3"][0] == "alive", fatal  # hostC is not concerned
    done = engine.assert_shutdown()
    stops = {stop["host"]: stop for stop in done["host_stops"]}
    assert stops["hostB"]["outcome"] == "lost", done
    # Every thread of the engine ended (the hub's and the remote stop's too). Rank 0 of this mpirun
    # session runs in the proxy's process: its iteration reporter belongs to that rank process, which
    # reports to the next engine it serves, not to this engine.
    assert set(done["extension_threads"]) <= {"trtllm-liveness-iterations"}, done
    # The ranks on hostB are gone, ended by their own agent (seen from the root PID namespace).
    left = engine.wait_gone(on_b)
    assert left == [], f"ranks of the partitioned hostB still run: {left}\n{engine.rank_log('hostB', 2)[-3000:]}"
    log = engine.rank_log("hostB", 2)
    assert f"with status {AGENT_EXIT_STATUS}" in log and "nothing from the proxy's hub" in log, log[-3000:]
    test_hosts.heal("hostB")


@pytest.mark.timeout(120)
def test_a_management_outage_while_the_engine_serves_is_suspect_not_lost(test_hosts: TestHosts) -> None:
    """The healthy look-alike of a partition: hostB's management network (the hub's and agents'
    traffic) down for longer than heartbeat_ceiling_s while its data network (the ranks' steps)
    stays up. The engine keeps making progress, so hostB is suspect (its ranks show it), never
    lost, and its agent ends nothing; healed, hostB is heard again, and a real fault after it (the
    data network cut as well) is still found."""
    engine = Engine(test_hosts, program={"progress_s": 0.25})
    _before(engine)
    on_b = engine.ranks_on("hostB")
    test_hosts.partition("hostB", network="mgmt")
    try:
        suspect = lambda: any(p["hosts"]["2"][0] == "suspect" for p in engine.progress())  # noqa: E731
        assert wait_for(suspect, 10 * WAIT_SCALE), engine.diagnostics()
        cut_at = time.monotonic()
        time.sleep(6 + 1)  # bounded observation past the test's heartbeat_ceiling_s (5 s) plus a timeout
        assert engine.record("fatal") is None, engine.diagnostics()
        during = [p for p in engine.progress() if p["t"] >= cut_at]
        assert during and during[-1]["iterations"] > during[0]["iterations"], during  # it kept serving
        assert engine.wait_gone(on_b, 0.1) == on_b  # hostB's ranks still run
    finally:
        test_hosts.heal("hostB")
    assert wait_for(lambda: engine.progress()[-1]["hosts"]["2"][0] == "alive", 20 * WAIT_SCALE), \
        f"{engine.diagnostics()}\n{engine.rank_log('hostB', 2)[-3000:]}"
    assert engine.record("fatal") is None, engine.diagnostics()
    test_hosts.partition("hostB")
    fatal = engine.wait_fatal()
    engine.assert_fatal(fatal, ["lost"], 2)


@pytest.mark.timeout(120)
def test_silent_host_loss(test_hosts: TestHosts) -> None:
    """hostB cut off, then crashed: no FIN ever comes; the hub reports the host lost."""
    engine = Engine(test_hosts)
    _before(engine)
    test_hosts.silent_loss("hostB")
    fatal = engine.wait_fatal()
    engine.assert_fatal(fatal, ["lost"], 2)
    assert "host hostB" in fatal["fatal"], fatal
    done = engine.assert_shutdown()
    stops = {stop["host"]: stop for stop in done["host_stops"]}
    assert stops["hostB"]["outcome"] == "lost", done


# --------------------------------------------------------------------------- the proxy dies


@pytest.mark.timeout(120)
def test_remote_ranks_end_when_the_proxy_is_killed(test_hosts: TestHosts) -> None:
    """SIGKILL of rank 0 (the proxy, and its hub): each remote agent's connection closes; it ends
    its host's ranks; every rank on hostB and hostC is gone within a bound."""
    engine = Engine(test_hosts)
    _before(engine)
    remote = engine.ranks_on("hostB", "hostC")
    assert len(remote) == 2, engine.ready
    test_hosts.kill("hostA", int(engine.ready["proxy"][0]), signal.SIGKILL)
    left = engine.wait_gone(remote)
    assert left == [], f"remote ranks outlived their proxy: {left}\n{engine.diagnostics()}"
    for host, rank in (("hostB", 2), ("hostC", 3)):
        log = engine.rank_log(host, rank)
        assert f"with status {AGENT_EXIT_STATUS}" in log, log[-3000:]


# --------------------------------------------------------------------------- the hub's port


BAD_MESSAGES = r"""
import os, sys, time, zmq
endpoint = sys.argv[1]
ctx = zmq.Context()

def dealer():
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(endpoint)
    return sock

def sent(frames):
    sock = dealer()
    sock.send_multipart(frames)
    time.sleep(0.3)
    sock.close()

body = b'{"k":"hello","sid":"' + b"0" * 32 + b'","n":1,"host":"hostB","rank":2,"port":0,"ranks":[]}'
just_connected = dealer(); time.sleep(0.3); just_connected.close()  # nothing sent
sent([b"TLH1" + os.urandom(32) + body])  # a wrong MAC
sent([os.urandom(200)])  # garbage
sent([b"TLH1"])  # a header and nothing else
sent([b"TLH1" + os.urandom(32) + body, b"second", b"third"])  # several frames
sent([b"x" * (1 << 20)])  # 1 MiB: over the socket's size cap, the connection is dropped
ctx.term()
print("sent")
"""


@pytest.mark.timeout(120)
def test_bad_messages_on_the_hub_port_are_rejected(test_hosts: TestHosts) -> None:
    """Connections from the head that send nothing, a wrong MAC, garbage, a 1 MiB frame or
    several frames: each is rejected (rate-limited WARNINGs), the engine stays healthy, and the
    hub still reports a real death afterwards."""
    engine = Engine(test_hosts)
    _before(engine)
    match = re.search(r"agent hub listening on (tcp://hostA:\d+)", engine.stderr())
    assert match is not None, engine.diagnostics()
    out = test_hosts.run("head", [sys.executable, "-c", BAD_MESSAGES, match.group(1)], timeout=30 * WAIT_SCALE)
    assert out.returncode == 0 and "sent" in out.stdout, (out.stdout, out.stderr)

    def rejections() -> list[str]:
        return [line for line in engine.stderr().splitlines() if "agent hub rejected a message" in line]

    assert wait_until(lambda: len(rejections()) >= 4, 10), engine.diagnostics()
    text = "\n".join(rejections())
    assert "authentication failed" in text and "frames instead of 1" in text and "not a hub message" in text, text
    # Bounded observation window: the engine is still up and nothing was reported.
    deadline = time.monotonic() + QUIET_S
    while time.monotonic() < deadline:
        assert engine.record("fatal") is None, engine.diagnostics()
        assert engine.job.popen.poll() is None, engine.diagnostics()
        time.sleep(0.1)
    assert "Traceback" not in engine.stderr() and "the agent hub failed" not in engine.stderr(), engine.diagnostics()
    # The hub survived: a real death is still reported.
    test_hosts.kill("hostB", engine.pid_of(2), signal.SIGKILL)
    fatal = engine.wait_fatal()
    engine.assert_fatal(fatal, ["died"], 2)
    engine.assert_shutdown()


# --------------------------------------------------------------------------- a remote rank in D


@pytest.mark.timeout(120)
@pytest.mark.freezer
def test_remote_rank_frozen_in_d_is_wedged(test_hosts: TestHosts, freezer: Freezer) -> None:
    """hostB runs ranks 2 (the agent) and 3; rank 3 frozen in D (cgroup v1 freezer, all of its
    threads) for longer than d_state_timeout_s: the agent reports it wedged."""
    engine = Engine(test_hosts, TWO_ON_B, liveness=f"{LIVENESS},d_state_timeout_s=2")
    _before(engine)
    victim = test_hosts.root_pid("hostB", engine.pid_of(3))
    assert victim is not None
    try:
        assert freezer.freeze([victim]), "the freezer group did not reach FROZEN"
        fatal = engine.wait_fatal(FATAL_S + 2)
        engine.assert_fatal(fatal, ["wedged"], 3)
        assert "reported by the agent on host hostB" in fatal["fatal"], fatal
        done = engine.assert_shutdown()  # the agent's stop finds rank 3 unkillable while frozen: bounded
        stops = {stop["host"]: stop for stop in done["host_stops"]}
        assert stops["hostB"]["outcome"] == "stopped", done
        assert [item[0] for item in stops["hostB"]["unkillable"]] == [3], done
        assert "did not exit" in stops["hostB"]["unkillable"][0][2], done
    finally:
        freezer.thaw()
        freezer.remove()


@pytest.mark.timeout(120)
@pytest.mark.freezer
def test_the_agents_own_rank_frozen_in_d_is_its_host_lost(test_hosts: TestHosts, freezer: Freezer) -> None:
    """hostB runs ranks 2 (the agent) and 3; rank 2 frozen in D with all its threads: its agent
    (a thread of it) and its ZMQ I/O thread stop, the heartbeats stop, and the hub reports hostB
    lost, naming both of its ranks (the agent is unresponsive: nothing can tell more)."""
    engine = Engine(test_hosts, TWO_ON_B)
    _before(engine)
    victim = test_hosts.root_pid("hostB", engine.pid_of(2))
    assert victim is not None
    try:
        assert freezer.freeze([victim]), "the freezer group did not reach FROZEN"
        fatal = engine.wait_fatal()
        engine.assert_fatal(fatal, ["lost"], 2)
        text = fatal["fatal"]
        assert "no heartbeat from host hostB's agent (rank 2" in text, fatal
        assert f"2 (pid {engine.pid_of(2)})" in text and f"3 (pid {engine.pid_of(3)})" in text, fatal
        assert fatal["statuses"]["3"][0] == "lost", fatal
        done = engine.assert_shutdown()
        stops = {stop["host"]: stop for stop in done["host_stops"]}
        assert stops["hostB"]["outcome"] == "lost", done
    finally:
        freezer.thaw()
        freezer.remove()


# --------------------------------------------------------------------------- the proxy's own host


@pytest.mark.timeout(120)
def test_the_proxy_hosts_own_ranks_are_still_watched_by_pidfd(test_hosts: TestHosts) -> None:
    """Rank 1 shares hostA with the proxy: no agent there; the proxy's own monitor reports it."""
    engine = Engine(test_hosts)
    _before(engine)
    test_hosts.kill("hostA", engine.pid_of(1), signal.SIGKILL)
    fatal = engine.wait_fatal()
    engine.assert_fatal(fatal, ["died"], 1)
    assert "reported by the agent" not in fatal["fatal"], fatal
    engine.assert_shutdown()


# --------------------------------------------------------------------------- mpirun's status 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("wrapped", [False, True], ids=["mpirun-alone", "under-launch"])
def test_launch_turns_mpiruns_zero_after_a_host_crash_into_the_engines_status(test_hosts: TestHosts,
                                                                              wrapped: bool) -> None:
    """A host crash that PRRTE learns of from its daemon link: mpirun alone exits **0** although
    the engine failed (the baseline this wrapper exists for); under ``trtllm-liveness launch`` (its
    outcome files in a directory the proxy's host sees) the job's status is the engine's
    ``exit_code`` (1), whether the proxy recorded its fatal error before PRRTE killed it or not."""
    wrapper = [sys.executable, "-m", "trtllm_liveness.cli", "launch", "--outcome-dir", test_hosts.shared, "--"]
    engine = Engine(test_hosts, wrapper=wrapper if wrapped else ())
    _before(engine)
    test_hosts.crash("hostB", launcher_notices=False)
    status = engine.job.wait_exit(60 * WAIT_SCALE)
    assert status == (1 if wrapped else 0), f"status {status}\n{engine.diagnostics()}"
    if wrapped:
        # Which line depends on a race the wrapper does not need to win: whether the proxy recorded
        # its fatal error (naming hostB) before PRRTE's teardown killed it, or was killed first.
        output = engine.job.output()
        assert ("exited 0, but the engine failed" in output and "hostB" in output) or \
            ("exited 0, but the engine (pid" in output and "never ended cleanly" in output), engine.diagnostics()


# --------------------------------------------------------------------------- no false alarm


CONTROL_S = 8.0
"""The loaded control's window: eight heartbeat timeouts (the 60 s windows and the healthy-chaos soak
are the benchmarks', scripts/bench_multihost.py and scripts/soak_healthy.py)."""


@pytest.mark.timeout(240)
def test_no_false_alarm_with_both_cores_busy(test_hosts: TestHosts, procs: ProcessTracker) -> None:
    """Every rank alive, a request streaming, both cores spinning, the default heartbeat timeout
    (1 s): no fatal error for :data:`CONTROL_S`, every rank still alive and watched."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
                for _ in range(os.cpu_count() or 2)]
    for spinner in spinners:
        procs.popens.append(spinner)
        procs.track(spinner.pid)
    engine = Engine(test_hosts, liveness="shutdown_term_s=1,shutdown_kill_s=1")
    _before(engine)
    assert engine.wait_record("fatal", CONTROL_S) is None, engine.diagnostics()
    assert engine.job.popen.poll() is None, engine.diagnostics()
    for spinner in spinners:
        spinner.kill()


# --------------------------------------------------------------------------- the demo


def _run_demo(procs: ProcessTracker, *args: str) -> str:
    """``scripts/demo_hosts.py --hosts 3 ARGS`` to its end (bounded); its output, its status checked 0."""
    require_facility("testhosts")
    script = Path(__file__).resolve().parents[3] / "scripts" / "demo_hosts.py"
    demo = subprocess.Popen([sys.executable, str(script), "--hosts", "3", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
    procs.popens.append(demo)
    procs.track(demo.pid)
    out, _ = demo.communicate(timeout=150 * WAIT_SCALE)
    assert demo.returncode == 0, out
    return out.decode()


@pytest.mark.timeout(180)
def test_the_multihost_demo_reports_a_remote_kill(procs: ProcessTracker) -> None:
    """``scripts/demo_hosts.py --hosts 3 --fault remote-kill --json`` (the README's command; ``bash
    scripts/demo.sh --hosts 3 ...`` runs it after its set-up): the killed rank of hostB named, the
    request failed, every host's shutdown reported."""
    result = json.loads(_run_demo(procs, "--fault", "remote-kill", "--json").strip().splitlines()[-1])
    assert (result["kind"], result["rank"], result["host"]) == ("died", 3, "hostB"), result
    assert result["pending_request_failed"] is True and "reported by the agent on host hostB" in result["message"]
    assert sorted(stop["host"] for stop in result["host_stops"]) == ["hostB", "hostC"], result


@pytest.mark.timeout(180)
def test_the_multihost_demo_names_a_stopped_remote_rank_and_its_host(procs: ProcessTracker) -> None:
    """``scripts/demo_hosts.py --hosts 3 --fault stop``: rank 3, on hostB beside its agent, is
    SIGSTOPped; the demo prints the fatal line naming rank 3 on hostB with its evidence (stopped),
    the snapshot taken before the stop naming it again and showing every rank with its host, and
    the timeline to each host's shutdown."""
    out = _run_demo(procs, "--fault", "stop")
    assert "fault: stop on hostB (rank 3 SIGSTOPped)" in out, out
    fatal = re.search(r"ms  engine fatal error \(stalled, rank 3 on hostB\): engine stalled \(named: MPI worker "
                      r"rank 3 \(pid (\d+)\) on host hostB; evidence: [^\n]*rank 3 is stopped", out)
    assert fatal is not None, out
    pid = fatal.group(1)
    assert re.search(rf"\n  stalled rank: rank 3 \(pid {pid}\) on host hostB: [^\n]*rank 3 is stopped", out), out
    assert re.search(rf"\n    rank 3 \(pid {pid}\) on host hostB: T, wchan \S+, stopped, ", out), out
    for rank, host in ((2, "hostB"), (4, "hostC")):
        assert re.search(rf"\n    rank {rank} \(pid \d+\) on host {host}: [A-Z], ", out), (rank, out)
    assert "pending request failed: True" in out and "shutdown, host hostB: stopped" in out, out
