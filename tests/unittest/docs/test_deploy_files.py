"""The deployment files under docs/: the Kubernetes manifest against the Kubernetes API schema (the
schemas bundled with kubernetes-validate: offline), the Slurm batch script's syntax and control
flow (stand-ins for trtllm-liveness and scontrol on PATH), and the copies shown in the docs."""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.support.facilities import needs
from tests.support.process_tracker import ProcessTracker
from tests.support.waits import WAIT_SCALE, wait_until
from trtllm_liveness._config import parse_value

pytestmark = [pytest.mark.timeout(60)]

ROOT = Path(__file__).resolve().parents[3]
MANIFEST = ROOT / "docs" / "kubernetes-trtllm-serve.yaml"
BASELINE = ROOT / "docs" / "kubernetes-trtllm-serve-baseline.yaml"
K8S_DOC = ROOT / "docs" / "kubernetes.md"
SBATCH = ROOT / "docs" / "slurm-trtllm-serve.sbatch"
SLURM_DOC = ROOT / "docs" / "slurm.md"
K8S_VERSION = "1.30.0"


def _kubernetes_validate() -> Any:
    return pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (the test extra) is not installed")


def manifest_objects(path: Path = MANIFEST) -> list[dict[str, Any]]:
    import yaml

    return [item for item in yaml.safe_load_all(path.read_text()) if item]


def by_name(objects: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(item["kind"], item["metadata"]["name"]): item for item in objects}


def fenced_blocks(path: Path, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", path.read_text(), re.MULTILINE | re.DOTALL)


# ----------------------------------------------------------------------------- Kubernetes


@pytest.mark.parametrize("path", [MANIFEST, BASELINE], ids=lambda path: path.name)
def test_the_manifests_are_valid_against_the_kubernetes_api_schema(path: Path) -> None:
    validate = _kubernetes_validate().validate
    objects = manifest_objects(path)
    expected = ["Namespace", "ServiceAccount", "Deployment", "Service"]
    if path == MANIFEST:
        expected[2:2] = ["ServiceAccount", "ClusterRole", "ClusterRoleBinding", "DaemonSet"]
    assert [item["kind"] for item in objects] == expected
    for item in objects:
        validate(item, K8S_VERSION, strict=True)  # raises ValidationError, naming the field


def test_the_validation_can_fail() -> None:
    kubernetes_validate = _kubernetes_validate()
    deployment = by_name(manifest_objects())[("Deployment", "trtllm-serve")]
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["periodSecond"] = 10  # a typo
    with pytest.raises(kubernetes_validate.ValidationError, match="periodSecond"):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def _pod(objects: dict[tuple[str, str], dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    spec: dict[str, Any] = objects[(kind, name)]["spec"]["template"]["spec"]
    return spec


def test_every_object_is_in_a_namespace_the_manifest_creates() -> None:
    for path in (MANIFEST, BASELINE):
        objects = manifest_objects(path)
        namespaces = [item["metadata"]["name"] for item in objects if item["kind"] == "Namespace"]
        assert namespaces == ["llm"], path
        for item in objects:
            if item["kind"] not in ("Namespace", "ClusterRole", "ClusterRoleBinding"):
                assert item["metadata"]["namespace"] == "llm", (path, item["kind"])


def _baseline_violations(pod: dict[str, Any]) -> list[str]:
    """What of Pod Security's baseline level (host namespaces, hostPath volumes, privileged or added
    capabilities, host ports) a pod spec uses."""
    found = [field for field in ("hostPID", "hostIPC", "hostNetwork") if pod.get(field)]
    found += [f"hostPath volume {volume['name']}" for volume in pod.get("volumes", []) if "hostPath" in volume]
    for container in pod["containers"]:
        context = container.get("securityContext", {})
        if context.get("privileged") or context.get("capabilities", {}).get("add"):
            found.append(f"container {container['name']}: privileged or added capabilities")
        found += [f"host port {port['hostPort']}" for port in container.get("ports", []) if port.get("hostPort")]
    return found


def test_the_pod_security_level_each_namespace_declares_is_the_one_its_pods_need() -> None:
    main, baseline = by_name(manifest_objects()), by_name(manifest_objects(BASELINE))
    labels = main[("Namespace", "llm")]["metadata"]["labels"]
    assert labels == {"pod-security.kubernetes.io/enforce": "privileged"}
    assert _baseline_violations(_pod(main, "Deployment", "trtllm-serve")) == ["hostPath volume liveness-quarantine"]
    assert _baseline_violations(_pod(main, "DaemonSet", "trtllm-liveness-node")) == [
        "hostPath volume liveness-quarantine"]
    labels = baseline[("Namespace", "llm")]["metadata"]["labels"]
    assert labels == {"pod-security.kubernetes.io/enforce": "baseline"}
    assert _baseline_violations(_pod(baseline, "Deployment", "trtllm-serve")) == []


def test_only_the_node_helper_may_patch_nodes() -> None:
    objects = by_name(manifest_objects())
    serving = _pod(objects, "Deployment", "trtllm-serve")
    assert serving["serviceAccountName"] == "trtllm-serve" and serving["automountServiceAccountToken"] is False
    assert objects[("ServiceAccount", "trtllm-serve")]["automountServiceAccountToken"] is False
    bindings = [item for item in objects.values() if item["kind"] in ("ClusterRoleBinding", "RoleBinding")]
    assert [[subject["name"] for subject in item["subjects"]] for item in bindings] == [["trtllm-liveness-node"]]
    rules = objects[("ClusterRole", "trtllm-liveness-node")]["rules"]
    assert rules == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}]
    helper = _pod(objects, "DaemonSet", "trtllm-liveness-node")
    assert helper["serviceAccountName"] == "trtllm-liveness-node"
    # It keeps running on the node it taints.
    assert {"key": "trtllm-liveness/wedged", "operator": "Exists", "effect": "NoSchedule"} in helper["tolerations"]


def test_the_manifest_carries_what_the_docs_promise() -> None:
    objects = by_name(manifest_objects())
    pod = _pod(objects, "Deployment", "trtllm-serve")
    container = pod["containers"][0]
    env = {item["name"]: item for item in container["env"]}
    config = parse_value(env["TRTLLM_WORKER_LIVENESS"]["value"])  # valid, and the recommended settings
    assert config.exit_on_fatal and config.stall_timeout_s == 120
    assert not config.quarantine_k8s_cordon and not config.quarantine_k8s_taint  # the node helper's job
    # the way of starting that keeps the documented status under either MPI setting (README, exit table)
    assert container["command"][:3] == ["trtllm-liveness", "launch", "--"]
    assert {"startupProbe", "livenessProbe", "readinessProbe"} <= set(container)
    # SIGTERM path: shutdown_grace_s + shutdown_term_s + shutdown_kill_s + 2 must fit in the grace period.
    assert pod["terminationGracePeriodSeconds"] > config.shutdown_grace_s + config.shutdown_term_s + \
        config.shutdown_kill_s + 2
    mounts = {item["name"]: item["mountPath"] for item in container["volumeMounts"]}
    volumes = {item["name"]: item for item in pod["volumes"]}
    assert mounts["liveness-quarantine"] == config.quarantine_dir
    assert volumes["liveness-quarantine"]["hostPath"] == {"path": config.quarantine_dir, "type": "DirectoryOrCreate"}
    # The node helper reads the same directory of the node, read-only, and knows its node's name.
    helper = _pod(objects, "DaemonSet", "trtllm-liveness-node")
    [watcher] = helper["containers"]
    assert watcher["image"] == container["image"]
    assert [item["hostPath"] for item in helper["volumes"]] == [volumes["liveness-quarantine"]["hostPath"]]
    assert watcher["volumeMounts"] == [{"name": "liveness-quarantine", "mountPath": config.quarantine_dir,
                                        "readOnly": True}]
    [node_name] = watcher["env"]
    assert node_name == {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}
    assert "trtllm-liveness quarantine status --devices '' --k8s-cordon --k8s-taint" in watcher["command"][2]


@pytest.mark.real_process
@needs("console-script")
def test_the_node_helpers_command_is_one_the_cli_accepts(tmp_path: Path) -> None:
    command = _pod(by_name(manifest_objects()), "DaemonSet", "trtllm-liveness-node")["containers"][0]["command"][2]
    found = re.search(r"trtllm-liveness (quarantine status [^>]*)>", command)
    assert found is not None, command
    argv = [str(Path(sys.executable).parent / "trtllm-liveness"), *shlex.split(found.group(1)), "--dir", str(tmp_path)]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0 and result.stdout.startswith("OK: "), result  # no marker: nothing to do


def test_the_baseline_variant_is_the_manifest_but_for_the_markers_volume() -> None:
    main = by_name(manifest_objects())
    baseline = by_name(manifest_objects(BASELINE))
    assert baseline[("Service", "trtllm-serve")] == main[("Service", "trtllm-serve")]
    assert baseline[("ServiceAccount", "trtllm-serve")] == main[("ServiceAccount", "trtllm-serve")]
    pod = _pod(baseline, "Deployment", "trtllm-serve")
    container = pod["containers"][0]
    env = {item["name"]: item["value"] for item in container["env"]}
    config = parse_value(env["TRTLLM_WORKER_LIVENESS"])
    mounts = {item["name"]: item["mountPath"] for item in container["volumeMounts"]}
    volumes = {item["name"]: item for item in pod["volumes"]}
    # The marker's directory is one the server makes inside the emptyDir: an emptyDir is world-writable.
    assert volumes["liveness-quarantine"] == {"name": "liveness-quarantine", "emptyDir": {}}
    assert os.path.dirname(config.quarantine_dir) == mounts["liveness-quarantine"]
    main_pod = _pod(main, "Deployment", "trtllm-serve")
    main_container = main_pod["containers"][0]
    main_config = parse_value({item["name"]: item["value"] for item in main_container["env"]}["TRTLLM_WORKER_LIVENESS"])
    assert dataclasses.replace(config, quarantine_dir=main_config.quarantine_dir) == main_config
    strip = {"env", "volumeMounts"}
    assert {key: value for key, value in container.items() if key not in strip} == \
        {key: value for key, value in main_container.items() if key not in strip}
    assert {key: value for key, value in pod.items() if key not in ("containers", "volumes")} == \
        {key: value for key, value in main_pod.items() if key not in ("containers", "volumes")}


def test_kubernetes_doc_shows_the_manifest_and_its_snippets_are_valid() -> None:
    blocks = fenced_blocks(K8S_DOC, "yaml")
    assert MANIFEST.read_text() in blocks, f"{K8S_DOC.name} must show {MANIFEST.name} as it is"
    assert BASELINE.name in K8S_DOC.read_text()
    kubernetes_validate = _kubernetes_validate()
    import yaml

    for block in blocks:
        for item in yaml.safe_load_all(block):
            if isinstance(item, dict) and "apiVersion" in item:
                kubernetes_validate.validate(item, K8S_VERSION, strict=True)


# ----------------------------------------------------------------------------- Slurm


def test_the_batch_script_parses_and_the_doc_shows_it() -> None:
    bash = shutil.which("bash")
    assert bash is not None
    result = subprocess.run([bash, "-n", str(SBATCH)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert SBATCH.read_text() in fenced_blocks(SLURM_DOC, "bash"), f"{SLURM_DOC.name} must show {SBATCH.name}"
    value = re.search(r'export TRTLLM_WORKER_LIVENESS="([^"]+)"', SBATCH.read_text())
    assert value is not None
    config = parse_value(value.group(1).replace("$(hostname)", "node1"))
    assert config.exit_on_fatal and config.exit_code == 3 and config.stall_timeout_s == 120


# Stand-ins: `trtllm-liveness launch -- ...` exits with $STUB_STATUS after $STUB_SLEEP seconds (and
# writes its pid to $STUB_DIR/launch.pid), `config check` runs the real command; scontrol records
# its arguments.
_STUB_CLI = """\
#!/bin/sh
if [ "$1" = config ]; then exec "$REAL_CLI" "$@"; fi
echo $$ > "$STUB_DIR/launch.pid"
sleep "$STUB_SLEEP"
exit "$STUB_STATUS"
"""
_STUB_SCONTROL = """\
#!/bin/sh
echo "$@" >> "$STUB_DIR/scontrol.log"
"""


def _stubs(tmp_path: Path) -> dict[str, str]:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, text in (("trtllm-liveness", _STUB_CLI), ("scontrol", _STUB_SCONTROL)):
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    return {"PATH": f"{bindir}{os.pathsep}/usr/bin{os.pathsep}/bin", "STUB_DIR": str(tmp_path),
            "REAL_CLI": str(Path(sys.executable).parent / "trtllm-liveness"), "SLURM_JOB_ID": "4242",
            "STUB_SLEEP": "0"}


# What the batch script does with each status the extension documents (README, "What it does to
# pods and jobs": exit_code, here 3; 14; 69; 75; 78), and with 1 (not this script's exit_code) and 0:
# requeued or not, and the one line it prints.
BATCH_STATUSES = [(3, True, ""), (14, True, ""), (75, True, ""),
                  (69, False, "trtllm-serve: a worker is wedged (exit 69): the node must be recycled\n"),
                  (78, False, "trtllm-serve: TRTLLM_WORKER_LIVENESS is invalid (exit 78, the key is in the log): "
                              "nothing started\n"),
                  (1, False, "trtllm-serve: exit 1, not an engine failure (exit_code is 3): see the log\n"),
                  (0, False, ""), (137, False, "")]


@pytest.mark.real_process
@pytest.mark.parametrize(("status", "requeued", "says"), BATCH_STATUSES)
def test_the_batch_script_requeues_an_engine_failure_only(tmp_path: Path, status: int, requeued: bool,
                                                          says: str) -> None:
    env = {**_stubs(tmp_path), "STUB_STATUS": str(status)}
    result = subprocess.run(["bash", str(SBATCH)], capture_output=True, text=True, env=env,
                            timeout=30 * WAIT_SCALE, start_new_session=True)
    assert result.returncode == status, result
    log = tmp_path / "scontrol.log"
    assert (log.read_text() if log.exists() else "") == ("requeue 4242\n" if requeued else ""), result
    assert result.stderr == says, result


def test_the_batch_script_and_the_alerts_cover_every_documented_exit_status() -> None:
    """Every status of the README's table has a requeue decision above and an alert in docs/alerts.yml
    that matches it (``== N`` on the container's last exit status; exit_code as the manifest and
    the script set it, 3)."""
    import yaml

    table = (ROOT / "README.md").read_text().split("## What it does to pods and jobs", 1)[1].split("\n\n")[2]
    statuses = set()
    for row in table.splitlines()[2:]:
        first = row.split("|")[1]
        found = re.search(r"\((\d+)[;)]", first) or re.search(r"(\d+)", first)
        assert found is not None, row
        statuses.add(3 if first.strip().startswith("`exit_code`") else int(found.group(1)))
    assert statuses == {3, 14, 69, 75, 78}, statuses
    assert statuses <= {status for status, _, _ in BATCH_STATUSES}
    rules = yaml.safe_load((ROOT / "docs" / "alerts.yml").read_text())
    exprs = [rule["expr"] for group in rules["groups"] for rule in group["rules"]
             if "kube_pod_container_status_last_terminated_exitcode" in rule["expr"]]
    alerted = {int(number) for expr in exprs for number in re.findall(r"== (\d+)\b", expr)}
    assert statuses <= alerted, statuses - alerted


@pytest.mark.real_process
def test_a_cancelled_job_is_not_requeued(tmp_path: Path, procs: ProcessTracker) -> None:
    # scancel: SIGTERM to the batch script while the step runs; the step then ends with exit_code.
    env = {**os.environ, **_stubs(tmp_path), "STUB_STATUS": "3", "STUB_SLEEP": "2"}
    script = subprocess.Popen(["bash", str(SBATCH)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              start_new_session=True)
    procs.popens.append(script)
    procs.track(script.pid)
    assert wait_until(lambda: (tmp_path / "launch.pid").exists(), 20)
    script.send_signal(signal.SIGTERM)
    _out, err = script.communicate(timeout=30 * WAIT_SCALE)
    assert script.returncode == 3, err
    assert not (tmp_path / "scontrol.log").exists(), (tmp_path / "scontrol.log").read_text()


def test_an_invalid_setting_in_the_script_stops_it_before_the_launch(tmp_path: Path) -> None:
    text = SBATCH.read_text().replace("stall_timeout_s=120", "stall_timeout_s=soon")
    (tmp_path / "job.sbatch").write_text(text)
    env = {**_stubs(tmp_path), "STUB_STATUS": "0"}
    result = subprocess.run(["bash", str(tmp_path / "job.sbatch")], capture_output=True, text=True, env=env,
                            timeout=30 * WAIT_SCALE, start_new_session=True)
    assert result.returncode == 78, result
    assert "stall_timeout_s" in result.stdout and not (tmp_path / "launch.pid").exists()


def test_the_single_node_snippet_is_valid_shell() -> None:
    block = next(block for block in fenced_blocks(SLURM_DOC, "bash") if "--nodes=1" in block)
    result = subprocess.run(["bash", "-n"], input=textwrap.dedent(block), capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
