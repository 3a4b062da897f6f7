"""The fault-injection helpers (cgroup v1 freezer, memory and cpu groups) and the scenario's faults.

Scenario faults run the reference executor on real MPI workers in a child process in its own
session (``run_scenario``), which kills and reports whatever it left behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from typing import Any

import pytest

from tests.support.cgroups import CpuGroup, limit_hits, remove_leftover_groups
from tests.support.facilities import needs
from tests.support.process_tracker import ProcessTracker, state_of
from tests.support.victims import named_in, names_a_victim
from tests.support.waits import WAIT_SCALE, wait_until
from trtllm_liveness.demo._cgroup_faults import FreezerGroup, MemoryGroup
from trtllm_liveness.demo._scenario_launcher import run_scenario
from trtllm_liveness.demo._scenario_records import ScenarioResult

needs_mpi = needs("mpi")
needs_freezer = needs("freezer")
needs_memory = needs("memcg")
needs_cpu = needs("cpucg")

# A thread spins until stdin closes.
SPINNER = """import sys, threading
def spin():
    while True:
        pass
threading.Thread(target=spin, daemon=True).start()
sys.stdout.write('ready\\n'); sys.stdout.flush(); sys.stdin.read()"""
# Once a line comes on stdin, streams argv[1] (a file larger than the group's limit) through the
# page cache, over and over, until stdin closes.
STREAMER = """import os, sys, threading
def stream():
    fd = os.open(sys.argv[1], os.O_RDONLY)
    while True:
        offset = 0
        while os.pread(fd, 1 << 20, offset):
            offset += 1 << 20
sys.stdin.readline()
threading.Thread(target=stream, daemon=True).start()
sys.stdout.write('ready\\n'); sys.stdout.flush(); sys.stdin.read()"""

pytestmark = [pytest.mark.timeout(120), pytest.mark.real_process]


@needs_freezer
@pytest.mark.freezer
def test_freezer_group_makes_d_state_and_remove_releases_the_killed_task(procs: ProcessTracker) -> None:
    child = procs.sleeper()
    with FreezerGroup("trtllm-liveness-test") as group:
        assert group.freeze([child.pid])
        assert wait_until(lambda: state_of(child.pid) == "D", 10)
        os.kill(child.pid, signal.SIGKILL)
        assert state_of(child.pid) == "D"  # SIGKILL stays pending while frozen
    assert group.removed and not os.path.exists(group.path)
    assert child.wait(10) == -signal.SIGKILL


@needs_freezer
@pytest.mark.freezer
def test_freezer_remove_moves_a_live_task_back_and_is_idempotent(procs: ProcessTracker) -> None:
    child = procs.sleeper()
    group = FreezerGroup("trtllm-liveness-test")
    try:
        group.add(child.pid)
        assert child.pid in group.tasks()
    finally:
        assert group.remove()
    assert group.remove()
    assert not os.path.exists(group.path)
    assert state_of(child.pid) == "S"  # thawed and back in the root group, alive


@needs_memory
def test_memory_group_remove_moves_survivors_back(procs: ProcessTracker) -> None:
    child = procs.sleeper()
    group = MemoryGroup(64 << 20, "trtllm-liveness-test")
    try:
        group.add(child.pid)
        assert child.pid in group.tasks()
        assert group.oom_kills() == 0
    finally:
        assert group.remove()
    assert not os.path.exists(group.path)
    assert state_of(child.pid) == "S"


@needs_cpu
def test_cpu_group_throttles_a_spinning_task_and_remove_moves_it_back(procs: ProcessTracker) -> None:
    """A process spinning in a group limited to 10% of a CPU is throttled period after period (the
    group's ``cpu.stat``), stays alive and runnable, and leaves the group alive on remove()."""
    child = subprocess.Popen([sys.executable, "-c", SPINNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             start_new_session=True)
    procs.adopt(child)
    assert child.stdout is not None and child.stdout.readline() == b"ready\n"
    group = CpuGroup(0.1, prefix="trtllm-liveness-test")
    try:
        with open(os.path.join(group.path, "cpu.cfs_quota_us")) as handle:
            assert int(handle.read()) == 10_000
        group.add(child.pid)
        assert child.pid in group.tasks()
        assert wait_until(lambda: group.throttled()[0] >= 3, 10), group.throttled()
        assert group.throttled()[1] > 0
    finally:
        assert group.remove()
    assert not os.path.exists(group.path)
    assert child.poll() is None and state_of(child.pid) in ("R", "S")


def test_cpu_group_rejects_a_share_outside_one_cpu() -> None:
    for share in (0.0, 1.5):
        with pytest.raises(ValueError, match="share"):
            CpuGroup(share, prefix="trtllm-liveness-test")


@needs_memory
def test_a_memory_group_at_its_limit_reclaims_page_cache_without_killing(procs: ProcessTracker, tmp_path: Any) -> None:
    """The pressure the soak puts on a rank: a process streaming a 32 MiB file through the page
    cache in a group limited to 8 MiB keeps hitting the limit (``limit_hits``: reclaim first) and is
    never OOM-killed: page cache can be reclaimed, unlike anonymous memory without swap."""
    data = tmp_path / "stream.bin"
    with open(data, "wb") as handle:
        handle.write(os.urandom(32 << 20))
        handle.flush()
        os.fsync(handle.fileno())  # clean pages, so that the kernel drops them from the cache now
        os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # the reader's reads charge its group
    group = MemoryGroup(8 << 20, "trtllm-liveness-test")
    try:
        child = subprocess.Popen([sys.executable, "-c", STREAMER, str(data)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, start_new_session=True)
        procs.adopt(child)
        group.add(child.pid)  # before it reads: what it reads is charged to the group
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write(b"go\n")
        child.stdin.flush()
        assert child.stdout.readline() == b"ready\n"
        assert wait_until(lambda: (limit_hits(group) or 0) >= 100, 20), limit_hits(group)
        assert child.poll() is None and group.oom_kills() == 0
    finally:
        assert group.remove()
    assert not os.path.exists(group.path)


@needs_freezer
@needs_cpu
@pytest.mark.freezer
def test_remove_leftover_groups_takes_only_its_prefix(procs: ProcessTracker) -> None:
    prefix = f"trtllm-liveness-test-left-{uuid.uuid4().hex[:6]}"
    mine, other = FreezerGroup(prefix), FreezerGroup("trtllm-liveness-test")
    mine_cpu = CpuGroup(0.5, prefix=prefix)
    try:
        child = procs.sleeper()
        mine.freeze([child.pid])
        mine_cpu.add(child.pid)
        assert remove_leftover_groups(prefix) == [mine.path, mine_cpu.path]
        assert not os.path.exists(mine.path) and not os.path.exists(mine_cpu.path) and os.path.exists(other.path)
        assert wait_until(lambda: state_of(child.pid) == "S", 10)
    finally:
        mine.remove()
        mine_cpu.remove()
        other.remove()


def scenario(**options: Any) -> ScenarioResult:
    options.setdefault("observe_s", 15 * WAIT_SCALE)
    options.setdefault("tokens", 300)
    run = run_scenario(options, 60 * WAIT_SCALE)
    assert run.survivors == (), f"processes left behind: {run.survivors}"
    assert run.results and run.done, f"scenario failed: {run.problems()}"
    assert run.results[0].survivors == () and run.results[0].pidfds_open == 0
    return run.results[0]


def assert_death_named(out: ScenarioResult, rank: int) -> None:
    assert out.detection is not None and out.shutdown is not None and out.victim is not None
    assert out.detection.health_false_ms is not None and out.pending_not_done == 0
    assert out.victim.rank == rank and named_in(out.victim, out.fatal_error)
    assert out.events[0].kind == "died"
    assert out.shutdown.shutdown_ms is not None and out.shutdown.pre_shutdown_runs == 1


@needs_mpi
@pytest.mark.mpi
def test_sigsegv_is_a_death_with_the_signal_named() -> None:
    out = scenario(mode="main", fault="segv", fault_rank=1)
    assert_death_named(out, 1)
    assert out.events[0].cause.startswith("process exited")


@needs_mpi
@pytest.mark.mpi
def test_clean_exit_mid_request_is_still_a_death() -> None:
    out = scenario(mode="main", fault="exit0", fault_rank=1)
    assert out.in_flight is not None and out.in_flight > 0
    assert_death_named(out, 1)


@needs_mpi
@needs_memory
@pytest.mark.mpi
def test_oom_killed_rank_is_reported_as_oom() -> None:
    out = scenario(mode="main", fault="oom", fault_rank=1, oom_limit_mb=64)
    assert_death_named(out, 1)
    assert "OOM killer" in out.events[0].cause
    assert out.oom_kills == 1
    assert out.memory_cgroup_path is not None and not os.path.exists(out.memory_cgroup_path)


@needs_mpi
@pytest.mark.mpi
def test_two_ranks_killed_at_once_one_fatal_error() -> None:
    out = scenario(mode="main", workers=3, fault="kill", fault_ranks=[1, 2])
    assert out.detection is not None and out.shutdown is not None
    assert {v.rank for v in out.victims} == {1, 2}
    assert out.detection.health_false_ms is not None and out.pending_not_done == 0
    assert names_a_victim(out, out.fatal_error)
    # One fatal error for two deaths: upstream's pre_shutdown() body runs once; its entries are
    # the fatal path's helper and shutdown()'s own, so at most two.
    assert out.shutdown.pre_shutdown_runs == 1 and 1 <= out.shutdown.pre_shutdown_calls <= 2


@needs_mpi
@pytest.mark.mpi
def test_death_during_shutdown_keeps_shutdown_bounded() -> None:
    out = scenario(mode="main", fault="kill", fault_phase="shutdown", fault_rank=1, shutdown_grace_s=2.0)
    assert out.shutdown is not None and out.shutdown.report is not None and out.victim is not None
    assert out.shutdown.hung is False
    assert out.shutdown.report.outcome_of(out.victim.pid) == "already-gone"
    assert out.shutdown.unkillable == ()


@needs_mpi
@pytest.mark.mpi
def test_no_fault_control_under_load_raises_no_alarm() -> None:
    out = scenario(mode="main", fault="none", control_s=3.0, tokens=50, d_state_timeout_s=1.0, scan_interval_s=0.05)
    assert out.control is not None
    assert out.control.requests_completed > 0
    assert out.control.alarms == 0 and out.events == () and out.fatal_error is None
    assert out.control.wrong_tokens == 0 and out.pending_not_done == 0


@needs_mpi
@pytest.mark.mpi
def test_the_kernel_floor_is_timed_on_the_same_kill_by_a_bare_pidfd() -> None:
    out = scenario(mode="main", fault="kill", fault_rank=1)
    assert out.detection is not None
    assert out.detection.floor_ms is not None and out.detection.floor_ms > 0
    assert out.fault_at is not None


@needs_mpi
@pytest.mark.mpi
def test_a_server_ending_exits_with_the_guard_status_after_its_sigint() -> None:
    run = run_scenario({"mode": "main", "fault": "kill", "fault_rank": 0, "ending": "serve_until_sigint",
                        "exit_on_fatal": True, "exit_code": 3, "exit_timeout_s": 5.0, "tokens": 300,
                        "observe_s": 15 * WAIT_SCALE}, 60 * WAIT_SCALE)
    assert run.survivors == (), f"processes left behind: {run.survivors}"
    assert run.results and run.done, f"scenario failed: {run.problems()}"
    out = run.results[0]
    assert out.ending is not None and out.ending.sigints >= 1  # the exit guard asked for a graceful shutdown
    assert out.victim is not None and named_in(out.victim, out.fatal_error)
    assert run.returncode == 3 and not run.timed_out  # a clean exit after an engine death is the guard's status
    assert run.exit_ms is not None
