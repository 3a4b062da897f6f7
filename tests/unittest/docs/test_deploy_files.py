"""The deployment files under docs/: the Kubernetes manifest against the Kubernetes API schema (the
schemas bundled with kubernetes-validate: offline), the Slurm batch script's syntax and control
flow (stand-ins for trtllm-liveness and scontrol on PATH), and the copies shown in the docs."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.support.process_tracker import ProcessTracker
from tests.support.waits import WAIT_SCALE, wait_until
from trtllm_liveness._config import parse_value

pytestmark = [pytest.mark.timeout(60)]

ROOT = Path(__file__).resolve().parents[3]
MANIFEST = ROOT / "docs" / "kubernetes-trtllm-serve.yaml"
K8S_DOC = ROOT / "docs" / "kubernetes.md"
SBATCH = ROOT / "docs" / "slurm-trtllm-serve.sbatch"
SLURM_DOC = ROOT / "docs" / "slurm.md"
K8S_VERSION = "1.30.0"


def _kubernetes_validate() -> Any:
    return pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (the test extra) is not installed")


def manifest_objects() -> list[dict[str, Any]]:
    import yaml

    return [item for item in yaml.safe_load_all(MANIFEST.read_text()) if item]


def fenced_blocks(path: Path, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", path.read_text(), re.MULTILINE | re.DOTALL)


# ----------------------------------------------------------------------------- Kubernetes


def test_the_manifest_is_valid_against_the_kubernetes_api_schema() -> None:
    validate = _kubernetes_validate().validate
    objects = manifest_objects()
    assert [item["kind"] for item in objects] == ["ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment",
                                                  "Service"]
    for item in objects:
        validate(item, K8S_VERSION, strict=True)  # raises ValidationError, naming the field


def test_the_validation_can_fail() -> None:
    kubernetes_validate = _kubernetes_validate()
    deployment = manifest_objects()[3]
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["periodSecond"] = 10  # a typo
    with pytest.raises(kubernetes_validate.ValidationError, match="periodSecond"):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def test_the_manifest_carries_what_the_docs_promise() -> None:
    objects = {item["kind"]: item for item in manifest_objects()}
    pod = objects["Deployment"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {item["name"]: item for item in container["env"]}
    config = parse_value(env["TRTLLM_WORKER_LIVENESS"]["value"])  # valid, and the recommended settings
    assert config.exit_on_fatal and config.stall_timeout_s == 120 and config.quarantine_k8s_cordon
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert container["command"][:4] == ["python", "-m", "trtllm_liveness.integrations.trtllm_autoload", "--"]
    assert {"startupProbe", "livenessProbe", "readinessProbe"} <= set(container)
    # SIGTERM path: shutdown_grace_s + shutdown_term_s + shutdown_kill_s + 2 must fit in the grace period.
    assert pod["terminationGracePeriodSeconds"] > config.shutdown_grace_s + config.shutdown_term_s + \
        config.shutdown_kill_s + 2
    mounts = {item["name"]: item["mountPath"] for item in container["volumeMounts"]}
    volumes = {item["name"]: item for item in pod["volumes"]}
    assert mounts["liveness-quarantine"] == config.quarantine_dir
    assert volumes["liveness-quarantine"]["hostPath"]["type"] == "DirectoryOrCreate"
    binding = objects["ClusterRoleBinding"]
    assert binding["subjects"][0]["name"] == pod["serviceAccountName"] == objects["ServiceAccount"]["metadata"]["name"]
    assert objects["ClusterRole"]["rules"][0]["resources"] == ["nodes"]
    assert set(objects["ClusterRole"]["rules"][0]["verbs"]) == {"get", "patch"}


def test_kubernetes_doc_shows_the_manifest_and_its_snippets_are_valid() -> None:
    blocks = fenced_blocks(K8S_DOC, "yaml")
    assert MANIFEST.read_text() in blocks, f"{K8S_DOC.name} must show {MANIFEST.name} as it is"
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


@pytest.mark.real_process
@pytest.mark.parametrize(("status", "requeued"), [(3, True), (69, False), (0, False), (1, False)])
def test_the_batch_script_requeues_an_engine_failure_only(tmp_path: Path, status: int, requeued: bool) -> None:
    env = {**_stubs(tmp_path), "STUB_STATUS": str(status)}
    result = subprocess.run(["bash", str(SBATCH)], capture_output=True, text=True, env=env,
                            timeout=30 * WAIT_SCALE, start_new_session=True)
    assert result.returncode == status, result
    log = tmp_path / "scontrol.log"
    assert (log.read_text() if log.exists() else "") == ("requeue 4242\n" if requeued else ""), result
    assert ("wedged (exit 69)" in result.stderr) == (status == 69)


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
