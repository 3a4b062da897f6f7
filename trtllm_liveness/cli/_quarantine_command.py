"""``trtllm-liveness quarantine status|clear``: the operator's view of the host's quarantine.

:data:`_DESCRIPTION`, the ``--help`` text, says what each action does, and
:data:`QUARANTINE_STATUS_HELP` what they exit with (for ``status``, node-problem-detector's custom
plugin contract). ``status`` is a node health check, read-only and bounded: a few procfs reads, plus
1 s only when a device holder is seen in ``D``. As Slurm's ``HealthCheckProgram`` it drains a
quarantined node itself (Slurm reads no exit status of that program); as the Kubernetes node helper
(docs/kubernetes.md) it cordons and taints its own quarantined node, so that no serving pod needs
rights on nodes. A marker directory that does not exist, cannot be read or is not trusted is
"unknown" because the check would look where no server writes: an unmounted hostPath, a typo.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from .._config import LivenessConfig
from ..quarantine._host_policy import QuarantineCheck, check_host
from ..quarantine._marker import (
    DEFAULT_QUARANTINE_DIR,
    MarkerError,
    MarkerVerdict,
    clear_marker,
    inspect_marker,
    resolve_directory,
)
from ._arg_types import JSON_HELP, add_command
from ._output import out, print_result

__all__ = ["QUARANTINE_STATUS_HELP", "add_quarantine_parser", "run_quarantine"]

STATUS_OK = 0
STATUS_QUARANTINED = 1
STATUS_UNKNOWN = 2

QUARANTINE_STATUS_HELP = """\
exit status of 'quarantine status' (node-problem-detector's plugin contract):
  0    OK: no quarantine marker that applies, no accelerator device holder stuck in D
  1    quarantined: an engine start on this host would refuse (the first line says why)
  2    unknown: bad arguments, an invalid TRTLLM_WORKER_LIVENESS, a marker directory that does not
       exist, cannot be read or is not trusted, or the check itself failed (the first line says why)
exit status of 'quarantine clear': 0 removed or nothing to remove, 1 refused (still quarantined;
--force removes it anyway) or failed
"""

_DESCRIPTION = """\
A worker wedged in D (GPU driver, NCCL, RDMA) leaves a marker on its host; every engine start on
the host refuses while a recorded process still exists (or cannot be verified from its PID
namespace), or while a process holding an accelerator device is stuck in D.

  status  show it; usable as Slurm's HealthCheckProgram (--slurm-drain drains the node), as a
          node-problem-detector custom plugin, and as the Kubernetes node helper (--k8s-cordon,
          --k8s-taint: this node, $NODE_NAME) (docs/slurm.md, docs/kubernetes.md). Never
          changes the marker, never undoes a drain, cordon or taint.
  clear   remove the marker once its processes are gone (--force: also while they are not)
"""


def _defaults(args: argparse.Namespace) -> LivenessConfig:
    """The server's own settings where this environment has them (the same TRTLLM_WORKER_LIVENESS):
    status must look where the server writes. Raises ``ValueError`` for an invalid value unless
    ``--dir`` and ``--devices`` both replace what it would say."""
    try:
        return LivenessConfig.from_env()
    except ValueError:
        if args.dir is None or args.devices is None:
            raise
        return LivenessConfig()


def add_quarantine_parser(sub: Any) -> None:
    """Add the ``quarantine`` subcommand to ``sub`` (argparse subparsers)."""
    quarantine = add_command(sub, "quarantine", run_quarantine, description=_DESCRIPTION, epilog=QUARANTINE_STATUS_HELP,
                             help="show or clear this host's quarantine after a wedged worker")
    quarantine.add_argument("action", choices=["status", "clear"])
    quarantine.add_argument("--dir", metavar="DIR", default=None,
                            help=f"marker directory (default: quarantine_dir, {DEFAULT_QUARANTINE_DIR})")
    quarantine.add_argument("--devices", metavar="GLOBS", default=None,
                            help="':'-separated device patterns to check for holders stuck in D (default: "
                            "quarantine_devices, /dev/nvidia*; '' for none)")
    quarantine.add_argument("--slurm-drain", action="store_true",
                            help="status: when quarantined, drain this Slurm node (scontrol update ... State=DRAIN)")
    quarantine.add_argument("--k8s-cordon", action="store_true",
                            help="status: when quarantined, cordon this Kubernetes node (spec.unschedulable)")
    quarantine.add_argument("--k8s-taint", action="store_true",
                            help="status: when quarantined, taint this Kubernetes node "
                                 "trtllm-liveness/wedged=true:NoSchedule")
    quarantine.add_argument("--node", metavar="NAME", default=None,
                            help="Slurm node for --slurm-drain (default $SLURMD_NODENAME, else the short hostname); "
                                 "Kubernetes node for --k8s-cordon/--k8s-taint (default $NODE_NAME)")
    quarantine.add_argument("--force", action="store_true", help="clear: remove the marker even while it applies")
    quarantine.add_argument("--json", action="store_true", help=JSON_HELP)


def run_quarantine(args: argparse.Namespace) -> int:
    """Run ``quarantine status`` or ``quarantine clear``; returns the exit status."""
    try:
        base = _defaults(args)
        config = LivenessConfig(
            enabled=True,
            quarantine_dir=base.quarantine_dir if args.dir is None else args.dir,
            quarantine_devices=base.quarantine_devices if args.devices is None else args.devices,
        )
    except ValueError as exc:  # TRTLLM_WORKER_LIVENESS, or a relative --dir or --devices
        return _unknown(str(exc), as_json=args.json)
    if args.action == "clear":
        return _clear(config, force=args.force, as_json=args.json)
    try:
        check = check_host(config, clear=False)
    except Exception as exc:  # the health check's own failure is "unknown", never "quarantined"
        return _unknown(f"the quarantine check failed: {exc}", as_json=args.json)
    problem = None if check.quarantined else _directory_problem(check)
    if problem is not None:
        return _unknown(problem, as_json=args.json)
    print_result(args.json, _check_dict(check), _check_lines(check))
    if check.quarantined and args.slurm_drain:
        from ..quarantine._orchestrator_actions import slurm_drain

        result = slurm_drain(f"trtllm-liveness quarantine: {check.describe()}", node=args.node,
                             timeout_s=base.quarantine_action_timeout_s)
        if not args.json:
            out(f"slurm drain: {'done' if result.ok else 'FAILED'}: {result.detail}")
    if check.quarantined and (args.k8s_cordon or args.k8s_taint):
        from ..quarantine._orchestrator_actions import k8s_mark_node

        marked = k8s_mark_node(f"trtllm-liveness quarantine: {check.describe()}", cordon=args.k8s_cordon,
                               taint=args.k8s_taint, node=args.node, timeout_s=base.quarantine_action_timeout_s)
        if not args.json:
            out(f"kubernetes {marked.action.removeprefix('k8s-')}: {'done' if marked.ok else 'FAILED'}: "
                f"{marked.detail}")
    return STATUS_QUARANTINED if check.quarantined else STATUS_OK


def _unknown(message: str, *, as_json: bool) -> int:
    print_result(as_json, {"quarantined": None, "message": f"UNKNOWN: {message}"}, [f"UNKNOWN: {message}"])
    return STATUS_UNKNOWN


def _directory_problem(check: QuarantineCheck) -> str | None:
    """Why the marker directory cannot answer, or None: it does not exist or cannot be read (the
    check would say OK about a place no server writes to), or it is not trusted (start-up ignores
    it, and a server cannot write its marker there)."""
    status = check.marker
    if status is None:
        return None  # quarantine_dir empty: no marker by configuration
    if status.verdict is MarkerVerdict.UNTRUSTED:
        return f"{status.describe()}; start-up ignores it, so no marker can hold this host"
    if not os.path.isdir(status.directory):
        return (f"the marker directory {status.directory} does not exist: a server here would create it on "
                "its first wedge, so this check cannot tell; create it (or mount the node's directory: "
                "hostPath, DirectoryOrCreate), or pass --dir")
    if not os.access(status.directory, os.R_OK | os.X_OK):
        return f"the marker directory {status.directory} cannot be read by uid {os.geteuid()}"
    return None


def _check_lines(check: QuarantineCheck) -> list[str]:
    if check.quarantined:
        return [f"QUARANTINED: {check.describe()}"]
    status = check.marker
    if status is None:
        return ["OK: no quarantine marker directory configured; no accelerator device holder stuck in D"]
    return [f"OK: {status.describe()}; no accelerator device holder stuck in D"]


def _check_dict(check: QuarantineCheck) -> dict[str, Any]:
    status = check.marker
    return {
        "quarantined": check.quarantined,
        "message": check.describe() or _check_lines(check)[0],
        "verdict": None if status is None else status.verdict.value,
        "path": None if status is None else status.path,
        "error": None if status is None else status.error or None,
        "marker": None if status is None or status.marker is None else status.marker.to_dict(),
        "processes": [] if status is None else [
            {"pid": item.process.pid, "verdict": item.verdict.value, "state": item.state, "wchan": item.wchan,
             "kernel_stack": list(item.kernel_stack)}
            for item in status.checks],
        "device_holders": [vars(holder) for holder in check.device_holders],
    }


def _clear(config: LivenessConfig, *, force: bool, as_json: bool) -> int:
    directory = resolve_directory(config.quarantine_dir)
    if not directory:
        out("nothing to clear: quarantine_dir is empty (off)")
        return 0
    status = inspect_marker(directory)
    removed = False
    if status.verdict is MarkerVerdict.NONE:
        message = f"nothing to clear: no marker in {directory}"
    elif status.quarantined and not force:
        message = f"refused: {status.describe()}; use --force to remove it anyway"
    else:
        try:
            removed = clear_marker(directory, expected=None if force else status.marker)
        except (MarkerError, OSError) as exc:
            message = f"could not clear {status.path}: {exc}"
        else:
            message = f"removed {status.path} ({status.describe()})" if removed else f"{status.path} changed; kept"
    print_result(as_json, {"removed": removed, "message": message}, [message])
    return 0 if removed or status.verdict is MarkerVerdict.NONE else 1
