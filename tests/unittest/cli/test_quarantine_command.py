"""``trtllm-liveness quarantine status|clear``, the installed console script, on a real stuck process.

``status`` is a node health check: 0 OK, 1 quarantined, 2 unknown (node-problem-detector's
plugin contract; also what Slurm's HealthCheckProgram runs, see test_quarantine_actions.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.facilities import needs
from tests.support.kube_api import serve_nodes, write_kubeconfig
from tests.support.other_user import OTHER_USER, interpreter_for_others, package_readable_by_others
from tests.support.process_tracker import ProcessTracker
from tests.support.quarantine import config_for, fresh_quarantine_state  # noqa: F401 - an autouse fixture
from tests.support.stuck_processes import StuckChild
from trtllm_liveness._events import EventKind, WorkerEvent
from trtllm_liveness.cli import EXIT_STATUS_HELP
from trtllm_liveness.process._identity import capture_identity
from trtllm_liveness.quarantine._host_policy import quarantine_host
from trtllm_liveness.quarantine._marker import MARKER_NAME
from trtllm_liveness.quarantine._orchestrator_actions import K8S_REASON_ANNOTATION, K8S_TAINT_KEY

pytestmark = [pytest.mark.real_process, pytest.mark.timeout(60), needs("console-script")]

CLI = Path(sys.executable).parent / "trtllm-liveness"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(CLI), "quarantine", *args], capture_output=True, text=True, timeout=30,
                          start_new_session=True, env={"PATH": "/usr/bin:/bin"})


def quarantine(directory: Path, pid: int) -> None:
    worker = quarantine_host(config_for(directory), [WorkerEvent(EventKind.WEDGED, capture_identity(1, pid), "x")])
    assert worker is not None
    worker.join(10)


def test_status_and_clear_follow_the_stuck_process(stuck_child: StuckChild, tmp_path: Path) -> None:
    directory = tmp_path / "q"
    directory.mkdir()
    assert cli("status", "--dir", str(directory), "--devices", "").returncode == 0
    quarantine(directory, stuck_child.popen.pid)

    status = cli("status", "--dir", str(directory), "--devices", "")
    assert status.returncode == 1, status.stdout + status.stderr
    first_line = status.stdout.splitlines()[0]
    assert first_line.startswith("QUARANTINED: host quarantined by") and str(stuck_child.popen.pid) in first_line
    document = json.loads(cli("status", "--dir", str(directory), "--devices", "", "--json").stdout)
    assert document["quarantined"] is True and document["verdict"] == "quarantined"
    assert [(item["pid"], item["verdict"]) for item in document["processes"]] == [(stuck_child.popen.pid, "wedged")]

    refused = cli("clear", "--dir", str(directory))
    assert refused.returncode == 1 and "refused" in refused.stdout and (directory / MARKER_NAME).exists()

    stuck_child.release()
    stuck_child.popen.kill()
    stuck_child.popen.wait(10)
    status = cli("status", "--dir", str(directory), "--devices", "")
    assert status.returncode == 0 and "every recorded process is gone" in status.stdout
    assert (directory / MARKER_NAME).exists()  # status is read-only
    cleared = cli("clear", "--dir", str(directory))
    assert cleared.returncode == 0 and "removed" in cleared.stdout and not (directory / MARKER_NAME).exists()
    assert cli("clear", "--dir", str(directory)).returncode == 0  # nothing to clear


@needs("k8s-client")
def test_the_kubernetes_node_helper_cordons_and_taints_its_own_node_only_when_quarantined(
        procs: ProcessTracker, tmp_path: Path) -> None:
    """docs/kubernetes.md's node helper: ``quarantine status --k8s-cordon --k8s-taint`` with the
    node's name from ``$NODE_NAME`` and its own client configuration (a kubeconfig here, pointing at
    a loopback API stand-in that records the client's own requests)."""
    directory = tmp_path / "q"
    directory.mkdir()
    with serve_nodes() as (server, recorder):
        env = {"PATH": "/usr/bin:/bin", "NODE_NAME": "gpu-7",
               "KUBECONFIG": str(write_kubeconfig(tmp_path / "kubeconfig", server))}

        def helper() -> subprocess.CompletedProcess[str]:
            return subprocess.run([str(CLI), "quarantine", "status", "--dir", str(directory), "--devices", "",
                                   "--k8s-cordon", "--k8s-taint"], capture_output=True, text=True,
                                  timeout=60, start_new_session=True, env=env)

        clean = helper()
        assert clean.returncode == 0 and recorder.requests == [], (clean, recorder.requests)
        stuck = procs.sleeper()
        quarantine(directory, stuck.pid)
        marked = helper()
        assert marked.returncode == 1, marked
        first, second = marked.stdout.splitlines()
        assert first.startswith("QUARANTINED: host quarantined by") and f"pid {stuck.pid}" in first, first
        assert second.startswith("kubernetes cordon+taint: done: node gpu-7: unschedulable, taints set"), second
        (get_verb, get_path, _, _), (verb, path, _, body) = recorder.requests
    assert (get_verb, get_path, verb, path) == ("GET", "/api/v1/nodes/gpu-7", "PATCH", "/api/v1/nodes/gpu-7")
    assert body["spec"]["unschedulable"] is True
    assert body["spec"]["taints"] == [{"key": "other", "value": "x", "effect": "NoExecute"},
                                      {"key": K8S_TAINT_KEY, "value": "true", "effect": "NoSchedule"}]
    assert body["metadata"]["annotations"][K8S_REASON_ANNOTATION].startswith(
        "trtllm-liveness quarantine: host quarantined by"), body
    assert (directory / MARKER_NAME).exists()  # read only


def test_clear_force_removes_a_marker_that_still_applies(procs: ProcessTracker, tmp_path: Path) -> None:
    child = procs.sleeper()
    quarantine(tmp_path, child.pid)
    assert cli("status", "--dir", str(tmp_path), "--devices", "").returncode == 1
    forced = cli("clear", "--dir", str(tmp_path), "--force")
    assert forced.returncode == 0 and not (tmp_path / MARKER_NAME).exists()


def test_a_malformed_marker_is_quarantined_and_bad_arguments_are_unknown(tmp_path: Path) -> None:
    (tmp_path / MARKER_NAME).write_text("{")
    malformed = cli("status", "--dir", str(tmp_path), "--devices", "")
    assert malformed.returncode == 1 and "malformed" in malformed.stdout
    unknown = cli("status", "--dir", "relative/dir")
    assert unknown.returncode == 2 and unknown.stdout.startswith("UNKNOWN:")
    assert cli("frobnicate").returncode == 2
    assert "quarantine status: 0 OK, 1 quarantined, 2 unknown" in EXIT_STATUS_HELP


def test_a_directory_that_cannot_answer_is_unknown_not_ok(tmp_path: Path) -> None:
    # A missing directory (an unmounted hostPath, a typo) would say OK about a place no server writes.
    missing = cli("status", "--dir", str(tmp_path / "absent"), "--devices", "")
    assert missing.returncode == 2 and missing.stdout.startswith("UNKNOWN: ") and "does not exist" in missing.stdout
    as_json = json.loads(cli("status", "--dir", str(tmp_path / "absent"), "--devices", "", "--json").stdout)
    assert as_json["quarantined"] is None and "does not exist" in as_json["message"]
    # Writable by others: start-up ignores it, so no marker there could hold the host.
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    untrusted = cli("status", "--dir", str(shared), "--devices", "")
    assert untrusted.returncode == 2 and "not trusted" in untrusted.stdout, untrusted
    # An invalid TRTLLM_WORKER_LIVENESS: the check cannot know where the server writes.
    bad = subprocess.run([str(CLI), "quarantine", "status"], capture_output=True, text=True, timeout=30,
                         start_new_session=True, env={"PATH": "/usr/bin:/bin", "TRTLLM_WORKER_LIVENESS": "bogus=1"})
    assert bad.returncode == 2 and bad.stdout.startswith("UNKNOWN: TRTLLM_WORKER_LIVENESS: unknown key 'bogus'")


def test_a_directory_this_user_cannot_read_is_unknown(tmp_path: Path) -> None:
    # The command runs from a copy of the package that the other user can read, so the test does
    # not depend on where the checkout lives.
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run the check as another user")
    python, tried = interpreter_for_others()
    if python is None:
        pytest.skip(f"no Python 3.10+ that uid 65534 can run with its standard library (tried {', '.join(tried)})")
    with package_readable_by_others() as root:
        private = root / "private"
        private.mkdir(mode=0o700)  # the path to it is searchable; the directory itself is not
        result = subprocess.run([*OTHER_USER, python, "-E", "-s", "-m", "trtllm_liveness.cli", "quarantine",
                                 "status", "--dir", str(private), "--devices", ""],
                                capture_output=True, text=True, timeout=30, start_new_session=True, cwd=root,
                                env={"PATH": "/usr/bin:/bin"})
    assert result.returncode == 2 and result.stdout.startswith("UNKNOWN: "), result
    assert "Permission denied" in result.stdout or "cannot be read" in result.stdout, result
