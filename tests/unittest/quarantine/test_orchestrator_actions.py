"""The quarantine's exit status and orchestrator actions: real Slurm, a real hook, the Kubernetes
client's own requests.

- exit status: a non-restartable event makes the exit guard's status ``exit_code_unrestartable``
  (also after a restartable first event);
- Slurm, for real: a one-node cluster (slurmctld, slurmd, munged started here, stopped by pid):
  after a real wedge seen by the monitor, the node reads DRAIN with the reason; and
  ``quarantine status --slurm-drain`` as the node's ``HealthCheckProgram`` drains it too;
- the command hook: run with the marker and the reason; one that hangs is killed at its timeout;
- a rank of another host: nothing recorded or done here (stand-ins for ``scontrol`` and the hook
  record every call), a local rank in the same call is;
- Kubernetes: no API server can run here, so the official client talks to a loopback HTTP server
  that records its requests (``tests/support/kube_api.py``): the shape of the calls (paths, verbs,
  content type, bodies) is the client's own, not a mock's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.facilities import needs, require_facility
from tests.support.kube_api import NodeApiRecorder, serve_nodes
from tests.support.process_tracker import ProcessTracker
from tests.support.quarantine import (  # noqa: F401 - fresh_quarantine_state: an autouse fixture
    command_recorder,
    config_for,
    fresh_quarantine_state,
    recorded_calls,
)
from tests.support.slurm_cluster import SlurmCluster
from tests.support.stuck_processes import StuckChild
from tests.support.waits import wait_until
from trtllm_liveness import LivenessConfig
from trtllm_liveness._events import EventKind, WorkerEvent
from trtllm_liveness.exit._exit_guard import DEFAULT_EXIT_CODE_UNRESTARTABLE
from trtllm_liveness.monitor._monitor import WorkerProcessMonitor
from trtllm_liveness.process._identity import capture_identity
from trtllm_liveness.quarantine._host_policy import quarantine_host
from trtllm_liveness.quarantine._marker import MARKER_NAME, read_marker
from trtllm_liveness.quarantine._orchestrator_actions import (
    K8S_REASON_ANNOTATION,
    K8S_TAINT_KEY,
    k8s_mark_node,
    run_hook,
)

pytestmark = [pytest.mark.timeout(90)]


def event(pid: int, kind: EventKind) -> WorkerEvent:
    return WorkerEvent(kind, capture_identity(1, pid), "cause")


# ----------------------------------------------------------------------------- exit status


def test_the_default_unrestartable_status_differs_from_the_default_status() -> None:
    config = LivenessConfig()
    assert config.exit_code_unrestartable == DEFAULT_EXIT_CODE_UNRESTARTABLE == 69 != config.exit_code
    assert LivenessConfig.from_env({"TRTLLM_WORKER_LIVENESS": "exit_code_unrestartable=75"}).exit_code_unrestartable \
        == 75
    for bad in ("0", "256", "x"):
        with pytest.raises(ValueError, match="exit_code_unrestartable"):
            LivenessConfig.from_env({"TRTLLM_WORKER_LIVENESS": f"exit_code_unrestartable={bad}"})
    with pytest.raises(ValueError, match="quarantine_dir must be an absolute path"):
        LivenessConfig.from_env({"TRTLLM_WORKER_LIVENESS": "quarantine_dir=relative/dir"})


GUARD_SCRIPT = """
import sys
from trtllm_liveness import LivenessConfig
from trtllm_liveness.process import ProcessIdentity
from trtllm_liveness._events import EventKind, WorkerEvent, WorkerFailedError
from trtllm_liveness.exit._exit_guard import FatalExitGuard
from trtllm_liveness.integrations.trtllm._fatal import note_unrestartable
from trtllm_liveness.integrations.trtllm._state import EngineLiveness

first, *later = [EventKind(word) for word in sys.argv[1].split(",")]
identity = ProcessIdentity(1, 4242, 1, "h", 1)
state = EngineLiveness(config=LivenessConfig(enabled=True, quarantine_dir="", quarantine_devices=""))
state.exit_guard = FatalExitGuard(graceful=lambda: None, timeout_s=20, exit_code=3, exit_code_unrestartable=69)
state.exit_guard.trigger(WorkerFailedError(WorkerEvent(first, identity, "c")))  # what the fatal path does
note_unrestartable(state, [WorkerEvent(kind, identity, "c") for kind in later])  # later events, the stop's
sys.exit(0)  # the server's clean return: the guard's atexit hook sets the status
"""


@pytest.mark.parametrize(("kinds", "expected"), [
    ("died", 3),
    ("wedged", 69),
    ("unkillable", 69),
    ("died,died", 3),
    ("died,unkillable", 69),  # a death, then the bounded stop left a rank unkillable
])
def test_the_exit_status_says_unrestartable_after_a_wedge(kinds: str, expected: int) -> None:
    done = subprocess.run([sys.executable, "-c", GUARD_SCRIPT, kinds], capture_output=True, text=True, timeout=30,
                          start_new_session=True)
    assert done.returncode == expected, done.stderr
    assert f"exit status {3 if kinds.startswith('died') else 69}" in done.stderr  # the trigger's own line


# ----------------------------------------------------------------------------- hook


def test_the_hook_runs_with_the_marker_and_the_reason(procs: ProcessTracker, tmp_path: Path) -> None:
    child = procs.sleeper()
    out = tmp_path / "hook.out"
    hook = tmp_path / "hook.sh"
    hook.write_text(f'#!/bin/sh\necho "$1|$TRTLLM_LIVENESS_QUARANTINE_REASON" > {out}\n')
    hook.chmod(0o755)
    config = LivenessConfig(enabled=True, quarantine_dir=str(tmp_path / "q"), quarantine_devices="",
                            quarantine_hook=str(hook), quarantine_action_timeout_s=10)
    worker = quarantine_host(config, [event(child.pid, EventKind.WEDGED)])
    assert worker is not None
    worker.join(15)
    marker, reason = out.read_text().strip().split("|", 1)
    assert marker == str(tmp_path / "q" / MARKER_NAME)
    assert f"(pid {child.pid})" in reason and "wedged" in reason


def test_a_hanging_hook_is_killed_at_its_timeout(tmp_path: Path) -> None:
    hook = tmp_path / "hang.sh"
    pidfile = tmp_path / "pid"
    hook.write_text(f"#!/bin/sh\nsleep 3600 &\necho $! > {pidfile}\nwait\n")
    hook.chmod(0o755)
    result = run_hook(str(hook), marker_path="/nonexistent", reason="r", timeout_s=0.5)
    assert not result.ok and "did not finish within 0.5s: killed" in result.detail
    grandchild = int(pidfile.read_text())
    assert wait_until(lambda: not Path(f"/proc/{grandchild}").exists() or
                      Path(f"/proc/{grandchild}/stat").read_text().split(") ")[1][0] == "Z", 5)


def test_a_failing_or_missing_hook_is_reported_not_raised(tmp_path: Path) -> None:
    assert not run_hook(str(tmp_path / "missing"), marker_path="", reason="r").ok
    hook = tmp_path / "fail.sh"
    hook.write_text("#!/bin/sh\necho no rights >&2\nexit 7\n")
    hook.chmod(0o755)
    result = run_hook(str(hook), marker_path="", reason="r")
    assert not result.ok and "status 7" in result.detail and "no rights" in result.detail


# ----------------------------------------------------------------------------- another host's rank


def test_a_rank_of_another_host_drains_and_hooks_nothing_here(procs: ProcessTracker, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A wedge of a rank on hostB, given to this host's policy (the proxy's): no marker here, no
    drain of this node, no hook (hostB's own agent quarantines hostB). In the same call with a wedge
    of this host's, only the local rank is recorded, and this node is drained once, for it."""
    (tmp_path / "bin").mkdir()
    drains = tmp_path / "scontrol.calls"
    command_recorder(tmp_path / "bin" / "scontrol", drains)
    hooks = tmp_path / "hook.calls"
    hook = command_recorder(tmp_path / "hook", hooks)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURMD_NODENAME", "proxy-node")
    config = config_for(tmp_path / "q", quarantine_slurm_drain=True, quarantine_hook=str(hook),
                        quarantine_action_timeout_s=10)
    local, elsewhere = procs.sleeper(), procs.sleeper()
    remote = WorkerEvent(EventKind.WEDGED, capture_identity(3, elsewhere.pid)._replace(hostname="hostB"),
                         "thread in D for 2.0s")
    worker = quarantine_host(config, [remote])
    if worker is not None:  # what a policy acting for it starts: let it finish, to see what it did
        worker.join(15)
    assert recorded_calls(drains) == [], "this node was drained for another host's rank"
    assert recorded_calls(hooks) == [], "the hook ran here for another host's rank"
    assert not (tmp_path / "q" / MARKER_NAME).exists()
    assert worker is None

    worker = quarantine_host(config, [remote, event(local.pid, EventKind.WEDGED)])
    assert worker is not None
    worker.join(15)
    marker = read_marker(str(tmp_path / "q"))
    assert marker is not None and [process.pid for process in marker.processes] == [local.pid]
    (drain,) = recorded_calls(drains)
    assert drain.startswith("update NodeName=proxy-node State=DRAIN Reason=trtllm-liveness: MPI worker rank 1 "
                            f"(pid {local.pid})"), drain
    (hooked,) = recorded_calls(hooks)
    assert hooked.startswith(f"{tmp_path / 'q' / MARKER_NAME}|") and f"(pid {local.pid})" in hooked, hooked


# ----------------------------------------------------------------------------- Kubernetes


@pytest.fixture
def api_server() -> Iterator[tuple[str, type[NodeApiRecorder]]]:
    require_facility("k8s-client")
    with serve_nodes() as served:
        yield served


def _client(host: str) -> Any:
    from kubernetes import client

    configuration = client.Configuration()
    configuration.host = host
    return client.ApiClient(configuration)


def test_cordon_and_taint_use_the_clients_own_node_requests(api_server: tuple[str, type[NodeApiRecorder]],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    host, recorder = api_server
    monkeypatch.setenv("NODE_NAME", "gpu-7")
    result = k8s_mark_node("rank 1 wedged", cordon=True, taint=True, timeout_s=5, api_client=_client(host))
    assert result.ok, result.detail
    (get_verb, get_path, _, _), (verb, path, content_type, body) = recorder.requests
    assert (get_verb, get_path) == ("GET", "/api/v1/nodes/gpu-7")
    assert (verb, path) == ("PATCH", "/api/v1/nodes/gpu-7")
    assert content_type == "application/strategic-merge-patch+json"
    assert body["spec"]["unschedulable"] is True
    assert body["spec"]["taints"] == [{"key": "other", "value": "x", "effect": "NoExecute"},
                                      {"key": K8S_TAINT_KEY, "value": "true", "effect": "NoSchedule"}]
    assert body["metadata"]["annotations"][K8S_REASON_ANNOTATION] == "rank 1 wedged"


def test_cordon_alone_reads_nothing_and_a_missing_node_name_is_an_error(
        api_server: tuple[str, type[NodeApiRecorder]], monkeypatch: pytest.MonkeyPatch) -> None:
    host, recorder = api_server
    monkeypatch.delenv("NODE_NAME", raising=False)
    failed = k8s_mark_node("r", cordon=True, taint=False, timeout_s=5, api_client=_client(host))
    assert not failed.ok and "NODE_NAME" in failed.detail and recorder.requests == []
    done = k8s_mark_node("r", cordon=True, taint=False, node="gpu-7", timeout_s=5, api_client=_client(host))
    assert done.ok and [request[:2] for request in recorder.requests] == [("PATCH", "/api/v1/nodes/gpu-7")]
    assert "taints" not in recorder.requests[0][3]["spec"]


def test_an_unreachable_api_server_fails_within_the_timeout() -> None:
    require_facility("k8s-client")
    result = k8s_mark_node("r", cordon=True, taint=False, node="n", timeout_s=1,
                           api_client=_client("http://127.0.0.1:9"))  # discard port: nothing listens
    assert not result.ok and result.action == "k8s-cordon"


# ----------------------------------------------------------------------------- Slurm, for real


@pytest.fixture
def slurm(procs: ProcessTracker, tmp_path: Path) -> Iterator[SlurmCluster]:
    require_facility("slurm")
    health_dir = tmp_path / "health-q"
    cluster = SlurmCluster(tmp_path / "slurm", health_check=(
        f"{sys.executable} -m trtllm_liveness.cli quarantine status --dir {health_dir} --devices '' "
        f"--slurm-drain --node {SlurmCluster.node_name()}"))
    try:
        cluster.start(procs)
        yield cluster
    finally:
        cluster.stop()


@needs("slurm")
def test_a_real_wedge_drains_the_node_and_the_health_check_does_too(
        slurm: SlurmCluster, stuck_child: StuckChild, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    monkeypatch.setenv("SLURMD_NODENAME", slurm.node)
    config = LivenessConfig(enabled=True, quarantine_dir=str(tmp_path / "server-q"), quarantine_devices="",
                            quarantine_slurm_drain=True, quarantine_action_timeout_s=10)
    workers: list[threading.Thread | None] = []
    with WorkerProcessMonitor(d_state_timeout_s=0.3, scan_interval_s=0.05) as monitor:
        monitor.subscribe(lambda item: workers.append(quarantine_host(config, [item])))
        monitor.register([capture_identity(1, stuck_child.popen.pid)])
        monitor.start()
        assert wait_until(lambda: any(workers), 10)
    worker = next(item for item in workers if item is not None)
    worker.join(15)
    fields = slurm.node_fields()
    assert "DRAIN" in fields.get("State", ""), (fields, slurm.logs())
    assert f"(pid {stuck_child.popen.pid})" in fields.get("Reason", "") and "wedged" in fields["Reason"]
    marker = read_marker(str(tmp_path / "server-q"))
    assert marker is not None and [process.pid for process in marker.processes] == [stuck_child.popen.pid]

    # The node-side path: the same marker where the HealthCheckProgram looks drains a resumed node.
    slurm.resume()
    assert wait_until(lambda: "DRAIN" not in slurm.node_state(), 10), slurm.node_fields()
    (tmp_path / "health-q").mkdir()
    (tmp_path / "health-q" / MARKER_NAME).write_bytes((tmp_path / "server-q" / MARKER_NAME).read_bytes())
    assert wait_until(lambda: "DRAIN" in slurm.node_state(), 20), (slurm.node_fields(), slurm.logs())
    reason = slurm.node_fields().get("Reason", "")
    assert reason.startswith("trtllm-liveness quarantine: host quarantined by") and str(stuck_child.popen.pid) in reason
