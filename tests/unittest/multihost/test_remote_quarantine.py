"""A rank of another host that cannot be ended quarantines that host, and only it, by its own agent.

- On the test hosts (real ``mpirun``, the upstream-shaped engine, a rank of hostB frozen in ``D``
  by the cgroup v1 freezer): hostB's marker names the wedged rank, and hostB's node alone is
  drained, cordoned, tainted and hooked; the proxy's host (hostA) gets no marker and no request.
  Every host has its own recorders: an ``scontrol`` and a hook stand-in (one executable on the
  shared disk, each writing into the ``/run`` of the host that runs it) and a Kubernetes API
  stand-in on each host's own loopback (only that host's processes reach it); each rank's
  ``SLURMD_NODENAME`` and ``NODE_NAME`` are its host's, as slurmd and the downward API set them.
- An agent in a UTS namespace of its own (another host to the hub, :mod:`test_agent_hub`'s agent
  child) over a rank in real ``D`` (freezer or FUSE): the marker is on disk when the hub delivers
  the wedge's event, the drain names the agent's own node; in observe mode it only says so.

Every wait is bounded; no timing is asserted.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.support.facilities import needs
from tests.support.kube_api import recorded_requests, write_kubeconfig
from tests.support.multihost_engine import FATAL_S, LIVENESS, TWO_ON_B, Engine
from tests.support.process_tracker import ProcessTracker
from tests.support.quarantine import command_recorder, recorded_calls
from tests.support.stuck_processes import Freezer, StuckChild
from tests.support.testhosts import TestHosts
from tests.support.waits import WAIT_SCALE, wait_until
from tests.unittest.multihost.test_agent_hub import Engine as HubEngine
from tests.unittest.multihost.test_agent_hub import start_agent
from trtllm_liveness import LivenessConfig
from trtllm_liveness._events import EventKind, WorkerEvent
from trtllm_liveness.quarantine._marker import MARKER_NAME, read_marker
from trtllm_liveness.quarantine._orchestrator_actions import K8S_TAINT_KEY

pytestmark = [pytest.mark.real_process]

REPO = str(Path(__file__).resolve().parents[3])
BOUND_S = 20.0 * WAIT_SCALE
KUBE_PORT = 18080  # on each test host's own loopback
DRAINS, HOOKS, KUBE = "/run/scontrol.calls", "/run/hook.calls", "/run/kube.requests"  # each host's own /run


def _marked_pids(directory: str) -> list[int]:
    marker = read_marker(directory)
    return [] if marker is None else [process.pid for process in marker.processes]


# --------------------------------------------------------------------------- across test hosts


@pytest.mark.timeout(180)
@pytest.mark.freezer
@needs("testhosts", "mpi", "freezer", "k8s-client")
def test_a_remote_wedge_quarantines_that_host_and_never_the_proxys(test_hosts: TestHosts, freezer: Freezer) -> None:
    """hostB runs ranks 2 (its agent) and 3; rank 3 frozen in D: the engine fails with the wedge,
    and hostB's agent writes hostB's marker naming rank 3 and drains, cordons, taints and hooks
    hostB, each once, before its rank ends; hostA, the proxy's host, is neither marked nor
    drained, cordoned, tainted or hooked."""
    shared = Path(test_hosts.shared)
    (shared / "bin").mkdir()
    command_recorder(shared / "bin" / "scontrol", DRAINS)
    hook = command_recorder(shared / "hook", HOOKS)
    kubeconfig = write_kubeconfig(shared / "kubeconfig", f"http://127.0.0.1:{KUBE_PORT}")
    for name in ("hostA", "hostB"):
        test_hosts.start_in(name, [sys.executable, "-m", "tests.programs.kube_node_api", str(KUBE_PORT), KUBE], wd=REPO)
    liveness = (f"{LIVENESS},d_state_timeout_s=2,quarantine_slurm_drain=1,quarantine_k8s_cordon=1,"
                f"quarantine_k8s_taint=1,quarantine_hook={hook}")
    engine = Engine(test_hosts, TWO_ON_B, liveness, node_names=True,
                    env={"PATH": f"{shared / 'bin'}:{os.environ['PATH']}", "KUBECONFIG": str(kubeconfig),
                         "KUBERNETES_SERVICE_HOST": ""})  # the kubeconfig's server, never an in-cluster one
    victim = test_hosts.root_pid("hostB", engine.pid_of(3))
    assert victim is not None
    on_a, on_b = (lambda path: test_hosts.path_in("hostA", path)), (lambda path: test_hosts.path_in("hostB", path))
    try:
        assert freezer.freeze([victim]), "the freezer group did not reach FROZEN"
        engine.assert_fatal(engine.wait_fatal(FATAL_S + 2), ["wedged"], 3)
        engine.assert_shutdown()
        # hostB's agent ends its rank once its quarantine's actions are done.
        left = engine.wait_gone([("hostB", engine.pid_of(2))])
        log_b = engine.rank_log("hostB", 2)[-4000:]
        assert left == [], log_b

        marker = read_marker(test_hosts.quarantine_directory("hostB"))
        assert marker is not None, log_b
        assert marker.hostname == "hostB"
        assert [(item.pid, item.rank, item.kind) for item in marker.processes] == [(engine.pid_of(3), 3, "wedged")]
        wedge = f"MPI worker rank 3 (pid {engine.pid_of(3)}) on host hostB is wedged"
        (drain,) = recorded_calls(on_b(DRAINS))
        assert drain.startswith(f"update NodeName=hostB State=DRAIN Reason=trtllm-liveness: {wedge}"), drain
        (get, patch) = recorded_requests(on_b(KUBE))
        assert get[:2] == ("GET", "/api/v1/nodes/hostB") and patch[:2] == ("PATCH", "/api/v1/nodes/hostB"), (get, patch)
        assert patch[3]["spec"]["unschedulable"] is True
        assert K8S_TAINT_KEY in [taint["key"] for taint in patch[3]["spec"]["taints"]]
        (hooked,) = recorded_calls(on_b(HOOKS))
        assert hooked.startswith(f"{test_hosts.hosts_quarantine_dir}/{MARKER_NAME}|") and wedge in hooked, hooked

        # The proxy's host: no marker (in its quarantine directory, nor in its own /run), no request.
        assert _marked_pids(test_hosts.quarantine_directory("hostA")) == []
        assert not os.path.exists(on_a(f"/run/trtllm-liveness/{MARKER_NAME}"))
        assert recorded_calls(on_a(DRAINS)) == [] and recorded_calls(on_a(HOOKS)) == []
        assert recorded_requests(on_a(KUBE)) == []
    finally:
        freezer.thaw()
        freezer.remove()


# --------------------------------------------------------------------------- one agent, another UTS namespace


def _agent_over(procs: ProcessTracker, stuck: StuckChild, tmp_path: Path, *, observe: bool
                ) -> tuple[HubEngine, list[tuple[WorkerEvent, list[int]]], Path]:
    """A hub whose agents quarantine their host (marker in ``tmp_path/q``, Slurm drain, the hook),
    and fakehostB's agent over the stuck child as its rank 3, with an ``scontrol`` stand-in on its
    PATH and its log in ``tmp_path/agent.log``. Returns the hub's engine, the events it delivered,
    each with the pids the marker named at that moment, and the marker's directory."""
    from trtllm_liveness.quarantine._quarantine_settings import QuarantineSettings

    (tmp_path / "bin").mkdir()
    command_recorder(tmp_path / "bin" / "scontrol", tmp_path / "scontrol.calls")
    hook = command_recorder(tmp_path / "hook", tmp_path / "hook.calls")
    directory = tmp_path / "q"
    policy = QuarantineSettings.from_config(LivenessConfig(quarantine_dir=str(directory), quarantine_slurm_drain=True,
                                                           quarantine_hook=str(hook)))
    engine = HubEngine(quarantine=policy, observe=observe)
    delivered: list[tuple[WorkerEvent, list[int]]] = []
    engine.monitor.subscribe(lambda event: delivered.append((event, _marked_pids(str(directory)))))
    env = {key: value for key, value in os.environ.items() if key not in ("SLURMD_NODENAME", "NODE_NAME")}
    env["PATH"] = f"{tmp_path / 'bin'}:{env['PATH']}"
    with open(tmp_path / "agent.log", "wb") as log:
        start_agent(procs, engine, ranks=0, watch=[[3, stuck.popen.pid]], env=env, stderr=log, observe=observe,
                    quarantine=policy.to_spec())
    engine.hub.arm(0.5)
    return engine, delivered, directory


def _wedge_of(delivered: list[tuple[WorkerEvent, list[int]]]) -> tuple[WorkerEvent, list[int]] | None:
    return next((item for item in delivered if item[0].kind is EventKind.WEDGED), None)


@pytest.mark.timeout(90)
@needs("mpi", "unshare")
def test_the_agent_writes_its_hosts_marker_before_the_wedge_leaves_and_drains_its_own_node(
        procs: ProcessTracker, stuck_child: StuckChild, tmp_path: Path) -> None:
    engine, delivered, directory = _agent_over(procs, stuck_child, tmp_path, observe=False)
    try:
        pid = stuck_child.popen.pid
        assert wait_until(lambda: _wedge_of(delivered) is not None, BOUND_S), (tmp_path / "agent.log").read_text()
        wedge, marked = _wedge_of(delivered)  # type: ignore[misc]
        assert (wedge.identity.rank, wedge.identity.pid, wedge.identity.hostname) == (3, pid, "fakehostB")
        assert marked == [pid], "the marker was not on disk when the hub delivered the wedge"
        log = tmp_path / "agent.log"
        assert wait_until(lambda: recorded_calls(tmp_path / "hook.calls"), BOUND_S), log.read_text()
        (drain,) = recorded_calls(tmp_path / "scontrol.calls")
        assert drain.startswith("update NodeName=fakehostB State=DRAIN Reason=trtllm-liveness: MPI worker rank 3 "
                                f"(pid {pid}) on host fakehostB is wedged"), drain
        (hooked,) = recorded_calls(tmp_path / "hook.calls")
        assert hooked.startswith(f"{directory / MARKER_NAME}|"), hooked
        marker = read_marker(str(directory))
        assert marker is not None and marker.hostname == "fakehostB"
    finally:
        engine.close()


@pytest.mark.timeout(90)
@needs("mpi", "unshare")
def test_in_observe_mode_the_agent_only_says_how_it_would_quarantine_its_host(
        procs: ProcessTracker, stuck_child: StuckChild, tmp_path: Path) -> None:
    engine, delivered, directory = _agent_over(procs, stuck_child, tmp_path, observe=True)
    try:
        pid = stuck_child.popen.pid
        would = (f"would quarantine host fakehostB for rank 3 (pid {pid}) wedged: its marker in {directory}, then "
                 "Slurm drain, the hook of this node (observe=1: nothing written, nothing run)")
        assert wait_until(lambda: would in (tmp_path / "agent.log").read_text(), BOUND_S), \
            (tmp_path / "agent.log").read_text()
        assert wait_until(lambda: _wedge_of(delivered) is not None, BOUND_S)
        assert not directory.exists()
        assert recorded_calls(tmp_path / "scontrol.calls") == [] and recorded_calls(tmp_path / "hook.calls") == []
    finally:
        engine.close()
