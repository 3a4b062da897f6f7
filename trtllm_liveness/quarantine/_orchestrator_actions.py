"""Orchestrator actions on a quarantined host: Slurm drain, Kubernetes cordon/taint, a command hook.

Each is optional and off by default (``LivenessConfig.quarantine_*``), bounded by a timeout, and
reports an :class:`ActionResult` instead of raising: a failed action is logged, never in the way
of the exit. They need rights a server rarely has (``scontrol update`` as SlurmUser or root; a
ClusterRole allowing ``get``/``patch`` on ``nodes``); the node-side alternative that needs none is
``trtllm-liveness quarantine status`` as Slurm's ``HealthCheckProgram`` or a node-problem-detector
plugin (docs/slurm.md, docs/kubernetes.md).

The Kubernetes client (the ``k8s`` extra) is imported only inside :func:`k8s_mark_node`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "K8S_NODE_ENV",
    "K8S_REASON_ANNOTATION",
    "K8S_TAINT_KEY",
    "ActionResult",
    "k8s_mark_node",
    "run_hook",
    "slurm_drain",
]

K8S_NODE_ENV = "NODE_NAME"
"""Environment variable with the node's name (downward API: ``fieldRef: spec.nodeName``)."""
K8S_TAINT_KEY = "trtllm-liveness/wedged"
K8S_REASON_ANNOTATION = "trtllm-liveness/quarantine-reason"
_MAX_REASON = 200
_MAX_OUTPUT = 2000


@dataclass(frozen=True)
class ActionResult:
    """What one action did: ``ok``, a one-line ``detail`` (the error where it failed), its duration."""

    action: str
    ok: bool
    detail: str
    elapsed_s: float


def one_line(text: str, limit: int = _MAX_REASON) -> str:
    """``text`` as one printable line of at most ``limit`` characters (for a Slurm reason, a taint)."""
    flat = " ".join("".join(char if char.isprintable() else " " for char in text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def slurm_drain(reason: str, *, node: str | None = None, timeout_s: float = 10.0) -> ActionResult:
    """``scontrol update NodeName=<node> State=DRAIN Reason=<reason>``, killed after ``timeout_s``;
    ``node`` defaults to ``$SLURMD_NODENAME`` (set in jobs), else the short hostname."""
    name = node or os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    argv = ["scontrol", "update", f"NodeName={name}", "State=DRAIN", f"Reason={one_line(reason)}"]
    return _run("slurm-drain", argv, timeout_s, {})


def run_hook(path: str, *, marker_path: str, reason: str, timeout_s: float = 10.0) -> ActionResult:
    """Run the executable ``path`` with the marker's path as its argument and the reason in
    ``TRTLLM_LIVENESS_QUARANTINE_REASON`` (also ``..._MARKER``); its session is killed after
    ``timeout_s``."""
    env = {"TRTLLM_LIVENESS_QUARANTINE_REASON": one_line(reason, 4000),
           "TRTLLM_LIVENESS_QUARANTINE_MARKER": marker_path}
    return _run("hook", [path, marker_path], timeout_s, env)


def _run(action: str, argv: list[str], timeout_s: float, env: dict[str, str]) -> ActionResult:
    start = time.monotonic()
    try:
        # Own session: on timeout the whole group goes (a hook's children included); our child
        # is not reaped before the kill, so its pid (the group id) cannot have been reused.
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env={**os.environ, **env}, start_new_session=True)
    except OSError as exc:
        return _result(action, False, f"cannot run {argv[0]}: {exc.strerror or exc}", start)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=1.0)
        return _result(action, False, f"{argv[0]} did not finish within {timeout_s:g}s: killed", start)
    text = one_line(output.decode(errors="replace"), _MAX_OUTPUT)
    if proc.returncode != 0:
        return _result(action, False, f"{argv[0]} exited with status {proc.returncode}: {text}", start)
    return _result(action, True, text or f"{argv[0]} succeeded", start)


def _result(action: str, ok: bool, detail: str, start: float) -> ActionResult:
    result = ActionResult(action, ok, detail, time.monotonic() - start)
    if ok:
        logger.warning("quarantine action %s done: %s", action, detail)
    else:
        logger.error("quarantine action %s failed: %s", action, detail)
    return result


def k8s_mark_node(reason: str, *, cordon: bool, taint: bool, node: str | None = None, timeout_s: float = 10.0,
                  api_client: Any = None) -> ActionResult:
    """Cordon (``spec.unschedulable``) and/or taint (``trtllm-liveness/wedged=true:NoSchedule``,
    added to the node's taints) this node, with the reason in the annotation
    ``trtllm-liveness/quarantine-reason``, through the official ``kubernetes`` client, each
    request bounded by ``timeout_s``. ``node`` defaults to ``$NODE_NAME``; ``api_client`` to one
    from the in-cluster configuration (else ``~/.kube/config``)."""
    action = "k8s-" + "+".join(word for word, on in (("cordon", cordon), ("taint", taint)) if on)
    start = time.monotonic()
    name = node or os.environ.get(K8S_NODE_ENV, "")
    if not name:
        return _result(action, False, f"no node name: set {K8S_NODE_ENV} from the downward API (spec.nodeName)",
                       start)
    try:
        from kubernetes import client  # the optional 'k8s' extra
    except ImportError as exc:
        return _result(action, False, f"the kubernetes client is not installed (extra 'k8s'): {exc}", start)
    try:
        if api_client is None:
            api_client = _default_api_client()
        api = client.CoreV1Api(api_client)
        spec: dict[str, Any] = {}
        if cordon:
            spec["unschedulable"] = True
        if taint:
            current = api.read_node(name, _request_timeout=timeout_s)
            taints = [api_client.sanitize_for_serialization(item) for item in (current.spec.taints or [])]
            if not any(item.get("key") == K8S_TAINT_KEY for item in taints):
                taints.append({"key": K8S_TAINT_KEY, "value": "true", "effect": "NoSchedule"})
            spec["taints"] = taints
        # A JSON merge patch would replace the list too; the client picks strategic merge for a
        # dict body, which for taints merges by key: either way the list sent is the whole list.
        body = {"metadata": {"annotations": {K8S_REASON_ANNOTATION: one_line(reason)}}, "spec": spec}
        api.patch_node(name, body, _request_timeout=timeout_s)
    except Exception as exc:  # ApiException, urllib3 errors, config errors: all reported, none raised
        return _result(action, False, f"node {name}: {type(exc).__name__}: {one_line(str(exc))}", start)
    return _result(action, True, f"node {name}: {', '.join(spec)} set ({one_line(reason, 80)})", start)


def _default_api_client() -> Any:
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()
