"""``trtllm-liveness drill MODEL``: a real fault in your own model's engine, on this host, and what
the extension does with it.

:data:`DESCRIPTION`, its ``--help`` text, says what it starts, injects, prints and leaves behind.
The quarantine check it makes first is an engine start's, read only. With ``--hosts``, the launch
is :mod:`trtllm_liveness.drill._drill_hosts`'s and the fault in a rank of another host is made by
that host's agent (:mod:`trtllm_liveness.drill._drill_faults`).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
import time
from typing import Any

from .._config import LivenessConfig, parse_value
from .._errors import LivenessError
from .._switch import ENV_VAR, EXIT_INVALID_SETTING
from ..drill._drill_hosts import launch_argv, parse_hosts, remote_victim
from ..drill._drill_records import DrillOptions, DrillRank, EngineReady, EngineReport, choose_victim, local_ranks
from ..drill._drill_session import DrillSession, EngineEnded, FaultNotMade
from ..exit._outcome import OUTCOME_ENV
from ._arg_types import add_command, int_arg, seconds_arg
from ._exit_status import EXIT_FAILED, EXIT_OK
from ._launch_command import effective_settings
from ._output import error_status, print_result

__all__ = ["add_drill_parser", "run_drill"]

EXIT_QUARANTINED = 3
EXIT_NOT_STARTED = 4  # as doctor's 4 (no TensorRT-LLM): nothing was tested, the drill could not run

DRILL_STATUS_HELP = """\
exit status:
  0    the fault was detected (fatal error, check_health() False, every request failed) and shutdown
       was bounded with no process left
  1    it was not (requests still pending when the watch ended, or the engine ended before it
       reported), or a process was left
  2    bad arguments, or the fault cannot be made here (wedge: no writable cgroup v1 freezer)
  3    this host is quarantined: nothing started
  4    the drill could not run, nothing was tested: TensorRT-LLM is not installed (nothing started),
       the engine did not start or stream, no rank to hit, or the fault could not be injected
  78   TRTLLM_WORKER_LIVENESS is invalid: nothing started
  130  interrupted (Ctrl-C), 143 terminated (SIGTERM); everything is cleaned up first
"""
# The --help text, in plain words (no reST markup on a terminal).
DESCRIPTION = """\
A real fault in your own model's engine on this host, and what the extension does with it: the
first command to run on a new cluster (docs/drill.md).

Starts MODEL through the installed TensorRT-LLM's LLM API (LLM(MODEL, tensor_parallel_size=N), the
extension on through its executor class) with your TRTLLM_WORKER_LIVENESS settings, streams
requests, injects the fault into one rank of this host by its verified pid (kill: SIGKILL; stop:
SIGSTOP; wedge: the cgroup v1 freezer, real D state, root), and prints the timeline (fault,
detection, health False, requests failed, shutdown), the verdict, and what a server with these
settings would leave behind: its exit status and the host's quarantine marker. It leaves neither:
exit_on_fatal is off, the marker goes to a private directory (read, shown, removed), the
termination log and the quarantine's actions (Slurm drain, Kubernetes cordon or taint, hook) are
off; they are named instead.

Refuses to run on a quarantined host. Bounded by --timeout (model load included); on every way out
it stops every rank it started (by verified pid), kills what is left of its engine's session and
removes its files.

--hosts H1:N1,H2:N2 runs the engine across hosts as the README's multi-host line does
(trtllm-liveness launch -- mpirun --host ... trtllm-llmapi-launch ...) and has the fault made in a
rank of another host than the proxy's by that host's agent, which verifies the rank by its own
pidfd: the drill never signals a pid of another host. Each agent stops its host's ranks (and thaws
a wedge) when the engine stops or goes.
"""
_FAULT_WAIT_S = 60.0
_SLACK_S = 5.0


def add_drill_parser(sub: Any) -> None:
    """Add the ``drill`` subcommand to ``sub`` (argparse subparsers)."""
    drill = add_command(sub, "drill", run_drill, description=DESCRIPTION, epilog=DRILL_STATUS_HELP,
                        help="a real fault in your own model's engine on this host: the timeline, the verdict, the "
                             "exit status and quarantine marker a server would leave")
    drill.add_argument("model", metavar="MODEL", help="what you pass to tensorrt_llm.LLM: a model directory or name")
    drill.add_argument("--tp", type=int_arg(1, 4096), default=None, metavar="N",
                       help="tensor_parallel_size (default 1; with --hosts, the hosts' slots)")
    drill.add_argument("--fault", choices=["kill", "stop", "wedge"], default="kill",
                       help="SIGKILL (default), SIGSTOP, or a rank frozen in D (cgroup v1 freezer; root)")
    drill.add_argument("--rank", type=int_arg(0, 1 << 24), default=None,
                       help="rank to hit (default: the highest rank on this host outside the engine's own process; "
                            "with --hosts, the highest rank of another host outside its agent's)")
    drill.add_argument("--hosts", default="", metavar="H1:N1,H2:N2",
                       help="run across these hosts (mpirun --host's form; the proxy on the first) as the README's "
                            "multi-host line does, and have the fault made in a rank of another host by that "
                            "host's agent")
    drill.add_argument("--mpirun", default="mpirun", metavar="PATH", help="with --hosts: the mpirun (default mpirun)")
    drill.add_argument("--mpirun-args", default="", metavar="ARGS",
                       help="with --hosts: more arguments for mpirun, one string (e.g. '--map-by slot')")
    drill.add_argument("--launcher", default="trtllm-llmapi-launch", metavar="COMMAND",
                       help="with --hosts: what mpirun runs in front of the engine (default trtllm-llmapi-launch)")
    drill.add_argument("--session", default="", metavar="MODULE:ATTRIBUTE",
                       help="for testing: a callable whose result is passed to LLM as its MPI session (the test "
                            "suite's fakes have no trtllm-llmapi-launch)")
    drill.add_argument("--requests", type=int_arg(1, 256), default=4, help="streaming requests (default 4)")
    drill.add_argument("--max-tokens", type=int_arg(1, 1 << 20), default=1024, metavar="N",
                       help="tokens per request (ignore_eos; default 1024): they must still stream at the fault")
    drill.add_argument("--timeout", type=seconds_arg(allow_zero=False), default=1800.0, metavar="S",
                       help="bound on the whole drill, model load included (default 1800)")
    drill.add_argument("--engine", default="", metavar="MODULE:ATTRIBUTE",
                       help="for testing: a callable, called with MODEL, whose result is passed to LLM instead of "
                            "MODEL (the test suite's fake TensorRT-LLM takes an engine object)")
    drill.add_argument("--json", action="store_true", help="print one JSON object instead of the timeline")


def _observe_s(fault: str, config: LivenessConfig) -> float:
    """How long the engine watches after the fault: what the settings need to catch it, plus slack."""
    if fault == "wedge":
        return config.d_state_timeout_s + 3 * config.scan_interval_s + _SLACK_S
    if fault == "stop" and config.stall_timeout_s > 0:
        return config.stall_timeout_s + _SLACK_S
    return 2 * _SLACK_S


def _drill_config(user: LivenessConfig, quarantine_dir: str) -> LivenessConfig:
    """The user's settings, with everything that would outlast the drill off or made private."""
    return dataclasses.replace(
        user, enabled=True, exit_on_fatal=False, termination_log="",
        quarantine_dir=quarantine_dir if user.quarantine_dir else "", quarantine_slurm_drain=False,
        quarantine_k8s_cordon=False, quarantine_k8s_taint=False, quarantine_hook="")


def _victim(ready: EngineReady, wanted: int | None) -> DrillRank | str:
    """The rank to hit, or why there is none."""
    return choose_victim(local_ranks(ready.ranks, ready.proxy_pid), wanted,
                         where="a rank of this host outside the engine's process",
                         none="no rank of this engine runs on this host outside the engine's own process")


@dataclasses.dataclass(frozen=True)
class DrillOutcome:
    """The drill's result: what it ran, what it saw, its verdict, what a server would leave."""

    model: str
    fault: str
    tp: int
    settings: str
    version: str = "?"
    victim: DrillRank | None = None
    report: EngineReport | None = None
    t0: float | None = None
    verdict_kind: str = "no_report"  # detected | not_detected | aborted | no_report
    verdict: str = ""
    would_exit: str = "-"
    would_exit_status: int | None = None
    would_mark: str = ""
    would_act: tuple[str, ...] = ()
    left: tuple[int, ...] = ()

    @property
    def ok(self) -> bool:
        return self.verdict_kind == "detected" and not self.left and self.report is not None \
            and self.report.shutdown_s is not None

    def ms(self, stamp: float | None) -> float | None:
        return None if stamp is None or self.t0 is None else round((stamp - self.t0) * 1e3, 3)

    def timeline(self) -> list[tuple[str, float | None]]:
        report = self.report
        if report is None:
            return []
        rows = [("detected by the monitor", self.ms(report.detected_at)),
                ("check_health() False", self.ms(report.health_false_at)),
                ("every request failed", self.ms(report.failed_all_at))]
        if report.tokens_stopped_at is not None:  # a stop or a wedge: the last token before the silence
            rows.append(("tokens stopped", self.ms(report.tokens_stopped_at)))
        rows.sort(key=lambda row: (row[1] is None, row[1] or 0.0))
        return rows

    def to_dict(self) -> dict[str, Any]:
        report = self.report
        return {
            "model": self.model, "fault": self.fault, "tensorrt_llm": self.version, "tp": self.tp,
            "rank": None if self.victim is None else self.victim.rank,
            "pid": None if self.victim is None else self.victim.pid,
            "host": None if self.victim is None else self.victim.host,
            "detected_ms": None if report is None else self.ms(report.detected_at),
            "health_false_ms": None if report is None else self.ms(report.health_false_at),
            "requests_failed_ms": None if report is None else self.ms(report.failed_all_at),
            "tokens_stopped_ms": None if report is None else self.ms(report.tokens_stopped_at),
            "shutdown_ms": None if report is None or report.shutdown_s is None else round(report.shutdown_s * 1e3, 3),
            "fatal": None if report is None or not report.fatal else report.fatal,
            "pending": None if report is None else report.pending, "requests": None if report is None else report.total,
            "unkillable": [] if report is None else list(report.unkillable),
            "verdict": {"kind": self.verdict_kind, "text": self.verdict},
            "would_exit": self.would_exit, "would_exit_status": self.would_exit_status,
            "would_leave_marker": self.would_mark, "would_run_actions": list(self.would_act),
            "processes_left": list(self.left), "settings": self.settings, "ok": self.ok,
        }


def _verdict(fault: str, config: LivenessConfig, report: EngineReport | None, observe_s: float,
             ended: str) -> tuple[str, str]:
    if report is None:
        return ("aborted" if "ended" in ended else "no_report"), ended
    if report.fatal and report.health_false_at is not None and report.pending == 0:
        return "detected", f"detected: {report.fatal_kind} of rank {report.fatal_rank}; check_health() False, " \
                           f"every request failed ({report.total} of {report.total})"
    hint = ""
    if fault == "stop" and config.stall_timeout_s == 0:
        hint = ("; a stopped rank is alive and killable, not a liveness failure: set stall_timeout_s (and "
                "stall_action=fatal) to catch a rank that stops making progress")
    return "not_detected", (f"NOT detected within {observe_s:g} s: {report.pending} of {report.total} requests "
                            f"still pending, check_health() {'False' if report.health_false_at else 'True'}{hint}")


def _would_exit(config: LivenessConfig, report: EngineReport | None) -> tuple[str, int | None]:
    if report is None or not report.fatal:
        return "nothing (no fatal error)", None
    status = config.exit_code if report.restartable else config.exit_code_unrestartable
    why = "restartable" if report.restartable else "not restartable on this host"
    if config.exit_on_fatal:
        return f"exit with status {status} ({why}; exit_on_fatal=1), also under trtllm-liveness launch", status
    return (f"keep running with check_health() False (/health 503; exit_on_fatal=0); with exit_on_fatal=1 it "
            f"would exit with status {status} ({why})"), None


def _would_mark(config: LivenessConfig, marker: Any, remote_host: str = "") -> str:
    from ..quarantine._marker import MARKER_NAME, QuarantineMarker, resolve_directory

    if not config.quarantine_dir:
        return "none (quarantine_dir is empty: quarantine off)"
    where = os.path.join(resolve_directory(config.quarantine_dir), MARKER_NAME)
    if isinstance(marker, QuarantineMarker):
        processes = "; ".join(process.describe() for process in marker.processes)
        return f"{where}: {processes}: {marker.reason}"
    if isinstance(marker, str):
        return f"{where}: the drill's copy is {marker}"
    if remote_host:  # docs/multihost.md: a rank of another host quarantines its own host, never the proxy's
        return (f"none at {where} on the proxy's host (a rank of another host never quarantines it); for a wedged "
                f"or unkillable rank, host {remote_host}'s own agent writes {remote_host}'s marker and runs the "
                "actions for its node (a drill's agents only log that they would)")
    return f"none at {where} (the failure is restartable on this host)"


def _would_act(config: LivenessConfig, marker: Any) -> tuple[str, ...]:
    if marker is None:
        return ()
    actions = []
    if config.quarantine_slurm_drain:
        actions.append("Slurm drain of this node (quarantine_slurm_drain=1)")
    if config.quarantine_k8s_cordon or config.quarantine_k8s_taint:
        actions.append("Kubernetes cordon/taint of $NODE_NAME (quarantine_k8s_cordon/taint=1)")
    if config.quarantine_hook:
        actions.append(f"the hook {config.quarantine_hook}")
    return tuple(actions)


def _drill(args: argparse.Namespace, config: LivenessConfig, options: DrillOptions, session: DrillSession,
           deadline: float) -> DrillOutcome:
    """Wait for the engine, inject the fault, wait for its report: everything but the clean-up."""
    outcome = DrillOutcome(model=args.model, fault=args.fault, tp=args.tp, settings=effective_settings(config))
    try:
        ready = session.wait_ready(deadline)
    except (EngineEnded, ValueError) as exc:
        return dataclasses.replace(outcome, verdict=f"the engine did not start streaming: {exc}")
    outcome = dataclasses.replace(outcome, version=ready.version)
    victim = remote_victim(ready, args.rank) if args.hosts else _victim(ready, args.rank)
    if isinstance(victim, str):
        return dataclasses.replace(outcome, verdict=f"{victim}: nothing to inject the fault into")
    try:
        t0 = session.inject_remote(args.fault, victim, deadline) if args.hosts else session.inject(args.fault, victim)
    except (LivenessError, OSError, FaultNotMade, EngineEnded, ValueError) as exc:
        return dataclasses.replace(outcome, victim=victim, verdict=f"could not inject the fault: {exc}")
    bound = options.observe_s + config.shutdown_grace_s + config.shutdown_term_s + config.shutdown_kill_s + 60.0
    report, ended = None, ""
    try:
        report = session.wait_report(min(deadline, time.monotonic() + bound))
    except (EngineEnded, ValueError) as exc:
        ended = str(exc)
        if session.exited_at is not None:
            ended = (f"the engine's process ended {(session.exited_at - t0) * 1e3:.0f} ms after the fault (exit "
                     f"status {session.returncode}) before it reported: with Open MPI's default error handler "
                     f"(mpi_ft_enable off) a rank's death aborts the job; loud, nothing hangs")
    kind, text = _verdict(args.fault, config, report, options.observe_s, ended)
    would_exit, status = _would_exit(config, report)
    return dataclasses.replace(outcome, victim=victim, report=report, t0=t0, verdict_kind=kind, verdict=text,
                               would_exit=would_exit, would_exit_status=status)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:9.1f} ms"


def _lines(outcome: DrillOutcome) -> list[str]:
    victim = outcome.victim
    report = outcome.report
    where = "" if victim is None else f" on rank {victim.rank} (pid {victim.pid}, host {victim.host})"
    lines = [f"trtllm-liveness drill: {outcome.model} on TensorRT-LLM {outcome.version}, tensor_parallel_size "
             f"{outcome.tp}, {'?' if report is None else report.total} requests streaming; fault '{outcome.fault}'"
             f"{where}",
             f"  settings: {outcome.settings}"]
    if outcome.t0 is not None:
        lines.append(f"  t0  fault injected              {_fmt(0.0)}")
        lines += [f"      {label:<27}{_fmt(value)}" for label, value in outcome.timeline()]
        shutdown = None if report is None or report.shutdown_s is None else report.shutdown_s * 1e3
        lines.append(f"      shutdown() took            {_fmt(shutdown)}")
    if report is not None and report.fatal:
        lines.append(f"  fatal error: {report.fatal}")
    if report is not None and report.unkillable:
        lines.append(f"  unkillable after SIGKILL: pids {list(report.unkillable)} (host must be recycled); the drill "
                     "then thawed its freezer cgroup so they could die")
    lines.append(f"  verdict: {outcome.verdict}")
    lines.append(f"  a server with these settings would: {outcome.would_exit}")
    lines.append(f"  quarantine marker it would leave: {outcome.would_mark}")
    if outcome.would_act:
        lines.append(f"  and would run: {'; '.join(outcome.would_act)}")
    lines.append("  (the drill itself left neither: exit_on_fatal off, its marker in a private directory, removed)")
    lines.append(f"  processes left: {list(outcome.left) or 'none'}")
    lines.append("  result: " + ("OK: detected and shut down within bounds" if outcome.ok else "FAILED"))
    return lines


def _tensorrt_llm_missing() -> bool:
    """Whether this interpreter cannot import ``tensorrt_llm`` (found without importing it; a spec
    lookup that fails some other way is left to the engine to report)."""
    try:
        return importlib.util.find_spec("tensorrt_llm") is None
    except (ImportError, ValueError):
        return False


def run_drill(args: argparse.Namespace) -> int:
    """Run ``drill``; returns the exit status (see ``DRILL_STATUS_HELP``)."""
    try:
        user = parse_value(os.environ.get(ENV_VAR), base=LivenessConfig(enabled=True))
    except ValueError as exc:
        return error_status(f"drill: {exc}; nothing started", EXIT_INVALID_SETTING)
    try:
        hosts = parse_hosts(args.hosts) if args.hosts else ()
    except ValueError as exc:
        return error_status(f"drill: {exc}")
    slots = sum(count for _, count in hosts)
    if hosts and args.tp is not None and args.tp != slots:
        return error_status(f"drill: --tp {args.tp} differs from the {slots} slots of --hosts {args.hosts}")
    args.tp = slots or args.tp or 1
    if args.fault == "wedge" and not hosts:  # across hosts the rank's own agent says whether it can
        from ..demo._cgroup_faults import freezer_available

        reason = freezer_available()
        if reason is not None:
            return error_status(f"drill: --fault wedge needs the cgroup v1 freezer: {reason}")
    from ..quarantine._host_policy import RECYCLE_ADVICE, check_host

    check = check_host(user, clear=False)
    if check.quarantined:
        return error_status(f"drill: refusing to run: this host is quarantined: {check.describe()}; {RECYCLE_ADVICE}",
                            EXIT_QUARANTINED)
    if not hosts and _tensorrt_llm_missing():  # across hosts the proxy's host decides: the engine says
        return error_status(f"drill: TensorRT-LLM is not installed (tensorrt_llm is not importable by "
                            f"{sys.executable}): no engine to drill; nothing started", EXIT_NOT_STARTED)
    from ..demo._demo_run import _sigterm_unwinds, _Terminated

    options = DrillOptions(model=args.model, tp=args.tp, engine=args.engine, session=args.session,
                           hosts=bool(hosts), requests=args.requests,
                           max_tokens=args.max_tokens, stream_timeout_s=args.timeout, fault_wait_s=_FAULT_WAIT_S,
                           observe_s=_observe_s(args.fault, user))
    deadline = time.monotonic() + args.timeout
    env = {key: value for key, value in os.environ.items() if key != OUTCOME_ENV}  # a drill records no outcome
    session = DrillSession()
    try:
        with _sigterm_unwinds():
            try:
                env[ENV_VAR] = _drill_config(user, session.quarantine_dir).to_env()
                session.start(options, env, launch_argv(hosts, args.mpirun, args.mpirun_args, args.launcher)
                              if hosts else ())
                outcome = _drill(args, user, options, session, deadline)
            finally:
                session.close()
    except _Terminated:
        return error_status("drill: terminated (SIGTERM); its processes and files are removed", 143)
    outcome = dataclasses.replace(outcome, left=tuple(session.survivors),
                                  would_mark=_would_mark(user, session.marker, outcome.victim.host
                                                         if hosts and outcome.victim is not None else ""),
                                  would_act=_would_act(user, session.marker))
    if outcome.t0 is None:  # nothing was injected: say why, with the engine's last words
        return error_status(f"drill: {outcome.verdict}\n--- the engine's log (last lines):\n{session.last_log}",
                            EXIT_NOT_STARTED)
    print_result(args.json, outcome.to_dict(), _lines(outcome))
    return EXIT_OK if outcome.ok else EXIT_FAILED
