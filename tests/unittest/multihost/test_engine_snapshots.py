"""The whole engine's snapshot and stall naming across real test hosts: the upstream-shaped engine
(tests/support/multihost_engine.py) under a real ``mpirun``, each remote host's agent snapshotting
its own ranks (stack dumps registered by every rank at its start) and forwarding their iterations.

Every wait is bounded; no timing is asserted (scripts/bench_diagnosis.py measures the snapshot).
"""

from __future__ import annotations

import re
import signal

import pytest

from tests.support.facilities import needs
from tests.support.multihost_engine import LIVENESS, TWO_ON_B, Engine
from tests.support.testhosts import TestHosts

pytestmark = [pytest.mark.multihost, pytest.mark.real_process, pytest.mark.mpi, needs("testhosts", "mpi")]

SIX_ON_THREE = (("hostA", 2), ("hostB", 2), ("hostC", 2))  # ranks 0, 1 | 2 (agent), 3 | 4 (agent), 5


@pytest.mark.timeout(150)
def test_the_whole_engines_snapshot_has_every_ranks_stacks_and_their_source(test_hosts: TestHosts) -> None:
    """Also: every remote rank's executor iterations reach the proxy's stall timer (through its
    host's agent), as the proxy host's own ranks' do. The diagnosis' full bounds (its content is
    tested here; scripts/bench_diagnosis.py times the fatal verdict's)."""
    engine = Engine(test_hosts, SIX_ON_THREE, LIVENESS + ",stall_timeout_s=60",
                    program={"snapshots": 1, "iterations_wait_s": 20, "snapshot_full": True})
    found = engine.wait_record("snapshot", 60)
    assert found is not None, engine.diagnostics()
    snapshot = found["snapshot"]
    by_rank = {row[0]: row for row in snapshot["ranks"]}
    assert sorted(by_rank) == [1, 2, 3, 4, 5], snapshot  # rank 0 is the proxy's own process
    for rank, host in ((1, ""), (2, "hostB"), (3, "hostB"), (4, "hostC"), (5, "hostC")):
        _rank, where, _activity, status, source, _other = by_rank[rank]
        assert where == host, (rank, snapshot)
        assert status == "taken" and source in ("py-spy", "faulthandler"), (rank, snapshot)
    assert [line.split(":")[0] for line in snapshot["hosts"]] == ["host hostB (agent rank 2)",
                                                                  "host hostC (agent rank 4)"], snapshot
    assert all(": answered" in line for line in snapshot["hosts"]), snapshot
    iterations = {int(rank): count for rank, count in snapshot["iterations"].items()}
    assert sorted(iterations) == [0, 1, 2, 3, 4, 5] and all(count > 0 for count in iterations.values()), snapshot


@pytest.mark.timeout(150)
def test_a_stall_on_a_remote_rank_names_that_rank_and_its_host(test_hosts: TestHosts) -> None:
    """Every step waits for every rank (step_acks); rank 3, on hostB beside its agent (rank 2),
    is SIGSTOPped: the stall is named after rank 3 on hostB with its evidence (stopped), and the
    fatal snapshot taken before the stop shows it so, by its host's agent."""
    # Bounds generous for a loaded machine: the content is tested here, not the time.
    engine = Engine(test_hosts, TWO_ON_B,
                    LIVENESS + ",stall_timeout_s=3,stall_action=fatal,diagnosis_before_stop_hosts_s=5",
                    program={"step_acks": True})
    assert engine.host_of(3) == "hostB"
    test_hosts.kill("hostB", engine.pid_of(3), signal.SIGSTOP)
    fatal = engine.wait_fatal(60)
    engine.assert_fatal(fatal, ["stalled"], 3)
    assert "rank 3 is stopped" in fatal["fatal"], fatal
    engine.wait_record("shutdown_s", 30)
    log = engine.stderr()
    # The diagnosis WARNING of the snapshot taken before the stop: rank 3 as hostB's agent saw it.
    diagnosis = re.search(r"WARNING .*liveness: diagnosis \(stalled of rank 3\): (.*)", log)
    assert diagnosis is not None, log
    assert f"rank 3 (pid {engine.pid_of(3)}) on host hostB: T, wchan do_signal_stop, stopped" in diagnosis.group(1), log
    # The fatal ERROR line's evidence is the naming's (hostB's agent saw rank 3 stopped), not "no local rank".
    error = re.search(r"ERROR .*liveness: fatal: (engine stalled .*)", log)
    assert error is not None and "evidence: rank 3 is stopped" in error.group(1), log
    assert "named: rank 3 is stopped" in diagnosis.group(1), log
    loud = [line for line in log.splitlines() if " WARNING " in line and "diagnosis (" not in line]
    assert not [line for line in loud if re.search(r"rank [23]\b.*(exited|lost)", line)], log


THREE_ON_B = (("hostA", 2), ("hostB", 3))  # ranks 0, 1 | 2 (agent), 3, 4


@pytest.mark.timeout(150)
def test_remote_ranks_the_fatal_stop_ends_are_logged_once_at_info_not_as_deaths(test_hosts: TestHosts) -> None:
    """SIGKILL of rank 4 on hostB: one fatal ERROR naming it; hostB's agent then stops rank 3 and
    ends its own rank 2 for the extension's stop: rank 3 is logged once at INFO as stopped by it,
    and neither is logged as a new death or loss."""
    engine = Engine(test_hosts, THREE_ON_B)
    test_hosts.kill("hostB", engine.pid_of(4), signal.SIGKILL)
    fatal = engine.wait_fatal()
    engine.assert_fatal(fatal, ["died"], 4)
    done = engine.assert_shutdown()
    stops = {stop["host"]: stop for stop in done["host_stops"]}
    assert stops["hostB"]["outcome"] == "stopped", done
    log = engine.stderr()
    stopped = rf"INFO .*stopped rank 3 \(pid {engine.pid_of(3)}\) on host hostB: SIGTERM.*, exited"
    assert len(re.findall(stopped, log)) == 1, log
    loud = [line for line in log.splitlines() if " WARNING " in line or " ERROR " in line]
    assert not [line for line in loud if re.search(r"rank [23]\b", line) and "diagnosis (" not in line], log
    assert len([line for line in loud if " ERROR " in line]) == 1, log
