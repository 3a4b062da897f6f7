"""``trtllm-liveness drill --hosts``: the drill across the test hosts, on the fakes of both versions.

The drill runs in the head as a user runs it on a login node: ``trtllm-liveness launch -- mpirun
--host hostA:2,hostB:2 -n 4 ... <launcher> python -m trtllm_liveness.drill._drill_engine``, the
README's multi-host line, with the fakes' stand-in for ``trtllm-llmapi-launch``
(tests/programs/fake_llmapi_launch.py). The proxy (rank 0) is on hostA; rank 2 runs hostB's agent;
the fault goes to rank 3 on hostB, made by that agent (the drill and the proxy never signal it).
The fake engine's leader waits for every rank's acknowledgement each step (``step_acks``), as a
tensor-parallel step waits for every rank.
Afterwards nothing of the drill may be left on any host (only each host's PID 1 and its holder), nor a freezer
group. ULFM and PRRTE's recoverable mode keep the proxy alive when a remote rank dies
(tests/support/multihost_engine.py says why). No timing is asserted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import tmpdir_runs as runs
from tests.support.cgroups import remove_leftover_groups
from tests.support.facilities import needs
from tests.support.process_tracker import ProcessTracker, state_of
from tests.support.testhosts import REPO_ROOT, TestHosts, netns_pids
from tests.support.waits import WAIT_SCALE, wait_until
from trtllm_liveness.demo._cgroup_faults import FREEZER_ROOT
from trtllm_liveness.drill._drill_faults import _FREEZER_PREFIX

pytestmark = [pytest.mark.multihost, pytest.mark.real_process, pytest.mark.mpi, needs("testhosts", "mpi"),
              pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[3]
CLI = Path(sys.executable).parent / "trtllm-liveness"
# heartbeat_timeout_s=3: no test here is about a lost host, and a loaded machine must not make one.
LIVENESS = "heartbeat_timeout_s=3,shutdown_term_s=1,shutdown_kill_s=1,d_state_timeout_s=2,scan_interval_s=0.5"
MPIRUN_ARGS = "--map-by slot --runtime-options recoverable,error-nonzero-status=false"
DRILL_S = 180.0


def run_drill(test_hosts: TestHosts, tree: str, fault: str, *extra: str, liveness: str = LIVENESS,
              midway: Callable[[subprocess.Popen[bytes]], None] | None = None) -> tuple[int, str, str]:
    """The drill in the head, to its end; (status, stdout, stderr). ``midway`` runs while it does."""
    with runs.short_tmpdir("tdrillh-") as tmpdir:  # the head's /tmp is this one; each host makes it in its own
        return _run(test_hosts, str(tmpdir), tree, fault, liveness, *extra, midway=midway)


def _run(test_hosts: TestHosts, tmpdir: str, tree: str, fault: str, liveness: str, *extra: str,
         midway: Callable[[subprocess.Popen[bytes]], None] | None = None) -> tuple[int, str, str]:
    env = test_hosts.mpi_env(fault_tolerant=True, extra={
        "TRTLLM_WORKER_LIVENESS": liveness, "TMPDIR": tmpdir, "OMPI_MCA_mpi_yield_when_idle": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "fakes" / tree), str(REPO)])})
    argv = [str(CLI), "drill", "/models/drill-test", "--engine", "tests.support.drill_engine:fake_tp_engine",
            "--session", "tests.support.drill_engine:comm_session", "--hosts", "hostA:2,hostB:2",
            "--mpirun", os.path.join(sys.prefix, "bin", "mpirun"), "--mpirun-args", MPIRUN_ARGS,
            "--launcher", f"{sys.executable} -m tests.programs.fake_llmapi_launch", "--fault", fault,
            "--timeout", "90", *extra]
    assert test_hosts.head is not None
    popen = subprocess.Popen(test_hosts.head.nsenter_argv(argv, wd=REPO_ROOT), stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True)
    test_hosts.adopt(popen)
    if midway is not None:
        midway(popen)
    try:
        out, err = popen.communicate(timeout=DRILL_S * WAIT_SCALE)
    except subprocess.TimeoutExpired:
        popen.kill()
        out, err = popen.communicate(timeout=30)
    return popen.returncode, out.decode(errors="replace"), err.decode(errors="replace")


@pytest.fixture(autouse=True)
def no_group_left(test_hosts: TestHosts) -> Iterator[None]:
    """A drill's freezer group left after a test (a failure) is thawed and removed before the test
    hosts end their processes (a frozen one could not die)."""
    del test_hosts
    yield
    remove_leftover_groups(_FREEZER_PREFIX)  # the agents' groups: never another test's local drill


def assert_nothing_left(test_hosts: TestHosts) -> None:
    for name in ("hostA", "hostB"):
        host = test_hosts.host(name)
        own = {host.pid1, host.holder.pid}  # the host's PID 1 and the unshare that holds its namespaces
        assert wait_until(lambda: set(netns_pids(host.netns)) <= own, 20 * WAIT_SCALE), \
            (name, netns_pids(host.netns), own)  # noqa: B023
    groups = os.listdir(FREEZER_ROOT) if os.path.isdir(FREEZER_ROOT) else []
    assert [name for name in groups if name.startswith(_FREEZER_PREFIX)] == []


def outcome(stdout: str, stderr: str) -> dict[str, Any]:
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, (stdout, stderr)
    document: dict[str, Any] = json.loads(lines[0])
    return document


@pytest.mark.parametrize("tree", ["trtllm_main", "trtllm_v12"])
def test_kill_of_a_rank_of_another_host_is_made_by_its_agent_and_caught(test_hosts: TestHosts,
                                                                       procs: ProcessTracker, tree: str) -> None:
    status, out, err = run_drill(test_hosts, tree, "kill", "--json")
    result = outcome(out, err)
    assert (result["rank"], result["host"], result["fault"]) == (3, "hostB", "kill"), result
    assert isinstance(result["pid"], int) and result["pid"] > 0
    assert result["verdict"]["kind"] == "detected", (result, err)
    assert "rank 3" in result["verdict"]["text"] and result["fatal"] and "hostB" in result["fatal"]
    assert result["would_exit_status"] is None and "exit_on_fatal=0" in result["would_exit"]
    assert status == 0 and result["ok"], (result, err)
    assert_nothing_left(test_hosts)


@pytest.mark.parametrize("tree", ["trtllm_main", "trtllm_v12"])
def test_stop_of_a_rank_of_another_host_is_caught_by_the_stall_bound(test_hosts: TestHosts, procs: ProcessTracker,
                                                                     tree: str) -> None:
    """A SIGSTOPped rank of hostB stops the tensor-parallel step: the stall bound catches it; the
    agents' stop (SIGKILL reaches a stopped process) leaves nothing."""
    status, out, err = run_drill(test_hosts, tree, "stop", "--json",
                                 liveness=f"{LIVENESS},stall_timeout_s=2,stall_action=fatal")
    result = outcome(out, err)
    assert (result["rank"], result["host"], result["fault"]) == (3, "hostB", "stop"), result
    assert result["verdict"]["kind"] == "detected" and "stalled" in result["verdict"]["text"], (result, err)
    assert status == 0 and result["ok"], (result, err)
    assert_nothing_left(test_hosts)


def test_a_stop_without_a_stall_bound_is_said_not_to_be_caught(test_hosts: TestHosts, procs: ProcessTracker) -> None:
    # shutdown_grace_s=1: the stopped rank never lets the engine stop by itself, so the shutdown
    # waits out its whole grace (10 s by default) before it stops the ranks either way.
    status, out, err = run_drill(test_hosts, "trtllm_main", "stop", "--json", liveness=f"{LIVENESS},shutdown_grace_s=1")
    result = outcome(out, err)
    assert result["verdict"]["kind"] == "not_detected" and "stall_timeout_s" in result["verdict"]["text"], result
    assert status == 1
    assert_nothing_left(test_hosts)


@needs("freezer")
def test_wedge_of_a_rank_of_another_host_is_real_d_and_thawed_after(test_hosts: TestHosts,
                                                                    procs: ProcessTracker) -> None:
    status, out, err = run_drill(test_hosts, "trtllm_main", "wedge")
    assert "fault 'wedge' on rank 3 (pid " in out and ", host hostB)" in out, (out, err)
    assert "verdict: detected: wedged of rank 3" in out, (out, err)
    assert status == 0, (out, err)
    assert_nothing_left(test_hosts)


@needs("freezer")
def test_sigterm_after_a_remote_wedge_thaws_and_ends_every_rank_on_every_host(test_hosts: TestHosts,
                                                                              procs: ProcessTracker) -> None:
    """The drill ended while hostB's rank 3 is frozen in ``D`` and the watch runs: status 143; the
    engine's end makes hostB's agent stop its ranks, thaw the frozen one and remove its group."""
    host_b = test_hosts.host("hostB")

    def frozen_then_term(popen: subprocess.Popen[bytes]) -> None:
        in_d = wait_until(lambda: popen.poll() is not None
                          or any(state_of(pid) == "D" for pid in netns_pids(host_b.netns)), 120 * WAIT_SCALE)
        assert in_d and popen.poll() is None, "no rank of hostB was ever frozen while the drill ran"
        popen.send_signal(signal.SIGTERM)

    slow_verdict = "heartbeat_timeout_s=3,shutdown_term_s=1,shutdown_kill_s=1,d_state_timeout_s=60"
    status, out, err = run_drill(test_hosts, "trtllm_main", "wedge", liveness=slow_verdict, midway=frozen_then_term)
    assert status == 143 and "terminated (SIGTERM)" in err, (status, out, err)
    assert_nothing_left(test_hosts)


def test_the_agents_own_rank_is_refused_with_what_can_be_hit(test_hosts: TestHosts, procs: ProcessTracker) -> None:
    status, out, err = run_drill(test_hosts, "trtllm_main", "kill", "--rank", "2")
    assert status == 4 and out == "", (out, err)  # the drill could not run: nothing was tested
    assert "rank 2 is not a rank of another host outside its agent's own (hittable: [3]" in err, err
    assert_nothing_left(test_hosts)
