"""``trtllm-liveness demo``: a real fault in a real MPI worker, and the timeline of what follows.

Runs the reference executor (Open MPI with ``OMPI_MCA_mpi_ft_enable=1``, i.e. ULFM, where
upstream hangs: a rank's death does not abort the parent) with liveness on, streams requests,
injects the fault into one rank and prints, in time order: fault at t0, detection, health
false, requests failed, shutdown done (milliseconds after t0).

``--compare`` first runs the same fault with the extension off, cut after ``--compare-bound``
seconds, and reports what was measured then: still hanging (how many requests had not
completed when the bound hit, ``check_health()`` still True), noticed by upstream's own check,
or the whole process aborted by MPI (Open MPI's default error handler, ``mpi_ft_enable`` off);
then the run with the extension on, side by side. Its default fault is one that nothing but the
extension catches (:func:`compare_default`): ``wedge`` where the cgroup v1 freezer can make one
(a rank in ``D``: with any Open MPI setting and any TensorRT-LLM version the requests hang and
health stays green), else ``kill`` in ``1.2`` mode (the released TensorRT-LLM has no worker
monitor of its own; under ULFM, the demo's MPI setting, the parent lives on and its requests hang).
A plain ``kill`` in ``main`` mode is caught by upstream main's own monitor, and without ULFM it
aborts the server loudly: neither shows what the extension adds.

Faults: ``kill`` (SIGKILL: a death), ``wedge`` (cgroup v1 freezer: real ``D`` state, survives
SIGKILL; a non-restartable fatal error, and shutdown reports the rank unkillable; the demo then
thaws the freezer so its processes can end, which a truly wedged rank would not), ``fuse`` (one
helper thread of the rank stuck in a FUSE lookup nobody answers, wchan ``request_wait_answer``, as a
driver call that never returns; detected per thread while the main thread keeps serving), ``stop``
(SIGSTOP). A stopped process is alive and killable, not dead or in ``D``, so the monitor does
not call it a failure (a debugger or job control may stop a worker on purpose); the demo surfaces
it as a *stall* (no token progress for ``--stall-timeout`` seconds) and shows that ``shutdown()``
still ends it within its bound (SIGTERM is held while stopped; SIGKILL ends it).

The demo's bounds are short so that it ends in seconds (see :data:`DEMO_SETTINGS`); a server
keeps the package defaults unless configured otherwise.

Everything the demo starts runs in a session of its own and with a private temporary directory
(``TMPDIR``) that the demo removes on every way out (success, failure, ``--timeout``, Ctrl-C,
SIGTERM), after killing whatever is left of that session.

Exit status: 0 when the fault was detected (a stall for ``stop``) and shutdown was bounded with
no process left; 1 otherwise; 2 for bad arguments or when the fault cannot be made here; 130
when interrupted (SIGINT), 143 on SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .._record_fields import JsonRecord
from ..diagnose._diagnosis_text import snapshot_lines
from ._cgroup_faults import FREEZER_ROOT
from ._mpi_env import FT_ENABLE_VAR
from ._scenario_launcher import run_scenario
from ._scenario_records import ScenarioOptions, ScenarioResult, ScenarioRun

__all__ = ["DEMO_SETTINGS", "TMP_PREFIX", "Verdict", "add_arguments", "off_verdict", "run"]

# (setting, the demo's value, the package default, why the demo's is short). The demo's values are
# passed to the scenario's options; the defaults are those of LivenessConfig.
DEMO_SETTINGS: tuple[tuple[str, float, float, str], ...] = (
    ("d_state_timeout_s", 1.0, 30.0, "seconds in D before a rank is called wedged"),
    ("scan_interval_s", 0.1, 1.0, "how often D state is sampled"),
    ("shutdown_grace_s", 1.0, 10.0, "upstream's own shutdown, before SIGTERM"),
    ("shutdown_term_s", 0.5, 2.0, "SIGTERM, before SIGKILL"),
    ("shutdown_kill_s", 1.0, 3.0, "SIGKILL, before a rank is reported unkillable"),
)
# The demo's private TMPDIR, removed on every exit path. Short: ZMQ ipc paths below it (the
# reference proxy's sockets) must fit in a unix socket address (108 bytes).
TMP_PREFIX = "trtllm-demo-"

_SETTINGS_HELP = (
    "The demo uses short bounds so it ends in seconds: "
    + ", ".join(f"{name}={value:g} (default {default:g})" for name, value, default, _ in DEMO_SETTINGS)
    + ". The defaults are longer on purpose: a driver call may sit in D for seconds without being wedged, "
    "and upstream's own shutdown deserves time to finish cleanly."
)
_BOUNDS_LINE = ("  demo bounds: " + ", ".join(f"{name}={value:g}" for name, value, _, _ in DEMO_SETTINGS)
                + " (short for the demo; see --help)")
_MAX_WORKERS = 64
_MAX_REQUESTS = 256


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the demo's options to ``parser`` (and explain its short bounds in the help)."""
    parser.add_argument("--fault", choices=["kill", "stop", "wedge", "fuse", "remote-kill", "host-crash",
                                            "partition", "remote-wedge"], default=None,
                        help="fault to inject: SIGKILL, SIGSTOP, the whole rank frozen in D (cgroup v1 "
                             "freezer), or one of its threads stuck in D in a FUSE lookup (default kill); with "
                             "--hosts: a rank on hostB SIGKILLed or SIGSTOPped (stop), hostB crashed or cut off, or a "
                             "rank of hostB frozen in D (default remote-kill)")
    parser.add_argument("--hosts", type=int, default=0, metavar="N",
                        help="run the engine under mpirun across N test hosts made of namespaces (2 to 6; root; "
                             "from a checkout): the multi-host agents")
    parser.add_argument("--workers", type=int, default=2, help=f"MPI worker ranks (2 to {_MAX_WORKERS})")
    parser.add_argument("--rank", type=int, default=None, help="rank to hit (default: the last)")
    parser.add_argument("--mode", choices=["main", "1.2"], default=None,
                        help="TensorRT-LLM behaviour to mimic: main has a monitor of its own that notices a "
                             "rank's death (not a stop or a wedge); 1.2 (the 1.2.x releases) has none (default "
                             "main; with --compare and no --fault, see there)")
    parser.add_argument("--requests", type=int, default=4, help=f"requests in flight (1 to {_MAX_REQUESTS})")
    parser.add_argument("--stall-timeout", type=float, default=1.0, help="seconds without tokens = stall (stop)")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="outer bound on each run (s); the off run of --compare gets --compare-bound more")
    parser.add_argument("--compare", action="store_true",
                        help="first run the same fault with the extension off (cut after --compare-bound), "
                             "then with it on, and print both side by side; without --fault, a fault only the "
                             "extension catches: wedge where the cgroup v1 freezer is writable (root), else kill "
                             "in 1.2 mode")
    parser.add_argument("--compare-bound", type=float, default=10.0, metavar="S",
                        help="how long the run without the extension is watched before it is cut (default 10 s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the timeline")
    if parser.epilog is None:
        parser.epilog = _SETTINGS_HELP


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:9.1f} ms"


def _problem(args: argparse.Namespace) -> str | None:
    """Why the arguments cannot run, or the fault cannot be made here; None when they can."""
    if args.fault in ("remote-kill", "host-crash", "partition", "remote-wedge"):
        return f"--fault {args.fault} needs --hosts N"
    if not 2 <= args.workers <= _MAX_WORKERS:
        return f"--workers must be >= 2 and <= {_MAX_WORKERS}"
    if args.rank is not None and not 0 <= args.rank < args.workers:
        return f"--rank must be in [0, {args.workers - 1}]"
    if not 1 <= args.requests <= _MAX_REQUESTS:
        return f"--requests must be between 1 and {_MAX_REQUESTS} (the fault is injected while requests stream)"
    for name, value in (("--stall-timeout", args.stall_timeout), ("--timeout", args.timeout),
                        ("--compare-bound", getattr(args, "compare_bound", 10.0))):
        if not (math.isfinite(value) and value > 0):
            return f"{name} must be a positive number of seconds, not {value}"
    if args.fault == "wedge" and not os.access(FREEZER_ROOT, os.W_OK):
        return f"--fault wedge needs a writable cgroup v1 freezer at {FREEZER_ROOT}"
    if args.fault == "fuse":
        from ._fuse_stall import fuse_available

        reason = fuse_available()
        if reason is not None:
            return f"--fault fuse cannot run here: {reason}"
    return None


def compare_default(mode: str | None) -> tuple[str, str, str]:
    """``(fault, mode, why)`` for ``--compare`` without ``--fault``: a fault the extension catches and
    nothing else does (see the module docstring). ``mode`` is the one given, if any."""
    if os.access(FREEZER_ROOT, os.W_OK):
        return "wedge", mode or "main", ("a rank wedged in D (cgroup v1 freezer): nothing but the extension "
                                         "notices it, with any MPI setting and any TensorRT-LLM version")
    if (mode or "1.2") == "1.2":
        return "kill", "1.2", (f"a rank killed under TensorRT-LLM 1.2.x, which has no worker monitor of its own "
                               f"(--fault wedge needs a writable cgroup v1 freezer at {FREEZER_ROOT})")
    return "kill", mode or "main", (f"--fault wedge needs a writable cgroup v1 freezer at {FREEZER_ROOT}; in main "
                                    "mode upstream's own monitor notices a kill: try --mode 1.2")


class _Terminated(BaseException):
    """SIGTERM while the demo runs: unwinds like Ctrl-C, so the clean-up below still happens."""


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """Turn SIGTERM into :class:`_Terminated` in the main thread for the duration (no-op elsewhere)."""
    def handler(signum: int, frame: object) -> None:
        raise _Terminated

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave the signal alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _mounts_under(path: str) -> list[str]:
    """FUSE stall mounts at or below ``path`` (left there if their owner died mid-run)."""
    from ._fuse_mounts import fuse_mounts

    return [point for point in fuse_mounts() if point == path or point.startswith(path.rstrip("/") + "/")]


@contextlib.contextmanager
def _private_tmpdir(timeout: float = 5.0) -> Iterator[str]:
    """A fresh directory for everything the scenario child and its MPI processes write (their
    ``TMPDIR``), removed on the way out, whichever way that is.

    The removal is bounded: retried for up to ``timeout`` s, since the daemons of a killed MPI
    launcher may still write session files while they exit. Mounts left below it are detached
    first (their owners are dead by now, see ``_fuse_mounts.remove_leftover_mounts``); a tree with
    a mount still in it is never walked."""
    path = tempfile.mkdtemp(prefix=TMP_PREFIX)
    try:
        yield path
    finally:
        if _mounts_under(path):
            from ._fuse_mounts import remove_leftover_mounts

            remove_leftover_mounts()
        deadline = time.monotonic() + timeout
        while True:
            if not _mounts_under(path):
                shutil.rmtree(path, ignore_errors=True)
            if not os.path.lexists(path) or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if os.path.lexists(path):
            sys.stderr.write(f"trtllm-liveness: demo: could not remove its temporary directory {path}\n")


def _mpi_setting() -> str:
    value = os.environ.get(FT_ENABLE_VAR)
    if value is None or value.strip().lower() in ("1", "true", "yes", "on"):
        return f"Open MPI with ULFM ({FT_ENABLE_VAR}={value or '1'}, the demo's default)"
    return f"Open MPI with {FT_ENABLE_VAR}={value} (its default error handler)"


def _scenario(args: argparse.Namespace, rank: int, tmpdir: str, *, liveness: bool) -> ScenarioRun:
    """Run the fault once, with the extension or without it (then watched for ``--compare-bound``)."""
    bound = float(args.compare_bound)
    bounds: dict[str, Any] = {name: value for name, value, _, _ in DEMO_SETTINGS}
    options = ScenarioOptions(
        mode=args.mode, workers=args.workers, fault=args.fault, fault_rank=rank, requests=args.requests,
        liveness=liveness,
        # Without the extension the run is watched for the bound and then cut; a stop is watched
        # the same way (the scenario would end its watch at the first stall otherwise).
        stall_timeout_s=bound if not liveness and args.fault == "stop" else args.stall_timeout,
        observe_s=bound if not liveness else max(5.0, args.timeout / 3), **bounds)
    return run_scenario(options, args.timeout + (0.0 if liveness else bound), env={"TMPDIR": tmpdir})


@dataclass(frozen=True)
class Verdict(JsonRecord):
    """What one run showed, measured: ``kind`` is ``hanging`` (the bound hit with requests still
    pending and ``check_health()`` True), ``noticed`` (health turned False or every request
    failed), ``served`` (every request completed), ``aborted`` (the process ended without a
    record: MPI aborted it), ``timed_out``
    (``--timeout`` hit) or ``no_record``; ``text`` says it in one line."""

    kind: str
    text: str
    pending: int | None = None
    after_s: float | None = None


def _ended_without_record(run: ScenarioRun, timeout: float, bound_s: float | None = None) -> Verdict:
    if run.timed_out:
        return Verdict("timed_out", f"did not finish within --timeout ({timeout:g} s); the demo killed it")
    if run.exit_ms is not None and run.returncode not in (None, 0):
        observed = _observed(run)
        if bound_s is not None and run.exit_ms >= bound_s * 1e3:
            # It outlived the whole watch; the demo's own kill of the workers at the bound is what
            # made MPI abort it (its default error handler), before the record was printed.
            pending = None if observed is None else observed.get("pending_not_done")
            count = f"{pending} requests pending" if isinstance(pending, int) else "requests pending (not recorded)"
            return Verdict("hanging", f"still hanging after {bound_s:g} s, {count}; when the demo then killed the "
                                      f"workers, MPI aborted the process (exit status {run.returncode})",
                           pending=pending if isinstance(pending, int) else None, after_s=bound_s)
        before = ""
        if observed is not None:
            health = observed.get("health_false_ms")
            before = (f" (before that: check_health() False at {health:.0f} ms, "
                      if isinstance(health, (int, float)) else " (before that: check_health() still True, ")
            before += f"{observed.get('pending_not_done')} requests pending)"
        return Verdict("aborted", f"the process was aborted {run.exit_ms:.0f} ms after the fault (exit status "
                                  f"{run.returncode}): MPI's error handler ended the job{before}; nothing hangs")
    problem = (run.error or run.stderr or "no record").strip().splitlines()
    return Verdict("no_record", f"the scenario failed: {problem[-1] if problem else 'no record'}")


def _observed(run: ScenarioRun) -> dict[str, Any] | None:
    """The scenario's note of what it saw when its watch ended (if it printed one)."""
    for line in run.progress:
        value = line.get("observed")
        if isinstance(value, dict):
            return value
    return None


def off_verdict(run: ScenarioRun, timeout: float, bound_s: float) -> Verdict:
    """The verdict on a run without the extension, watched for ``bound_s`` (see :class:`Verdict`)."""
    if not run.results:
        return _ended_without_record(run, timeout, bound_s)
    out = run.results[0]
    detection = out.detection
    total = out.in_flight if out.in_flight is not None else out.options.requests
    if detection is not None and (detection.health_false_ms is not None or detection.requests_failed_ms is not None):
        when = detection.health_false_ms if detection.health_false_ms is not None else detection.requests_failed_ms
        return Verdict("noticed", f"not hanging: upstream's own check noticed it ({when:.0f} ms after the fault: "
                                  f"check_health() {'False' if detection.health_false_ms is not None else 'True'}, "
                                  f"{total - (out.pending_not_done or 0)} of {total} requests ended)",
                       pending=out.pending_not_done)
    after = detection.window_s if detection is not None else out.options.observe_s
    pending = out.pending_not_done
    if pending == 0:
        return Verdict("served", f"not hanging: every request completed within {after:g} s", pending=0, after_s=after)
    return Verdict("hanging", f"still hanging after {after:g} s, {pending} requests pending "
                              f"(of {total}; check_health() True throughout); the demo then killed the workers",
                   pending=pending, after_s=after)


def _on_ok(run: ScenarioRun, fault: str) -> bool:
    """Whether the fault was noticed (the stall for ``stop``, not a liveness failure, else the
    event) and shutdown ended within its bounds with no process left."""
    if not run.results:
        return False
    noticed = _stamp(run.results[0], "stall_detected_ms" if fault == "stop" else "detected_ms")
    return noticed is not None and _shutdown_ms(run.results[0]) is not None and not run.survivors


# The stamps of a run's detection (field, label): the timeline's rows and the comparison's cells.
_STALL_STAMP = ("stall_detected_ms", "stall noticed (no tokens)")
_STAMPS = (("detected_ms", "detected by the monitor"), ("health_false_ms", "check_health() False"),
           ("requests_failed_ms", "every request failed"))


def _stamp(out: ScenarioResult, name: str) -> float | None:
    """The run's detection stamp ``name`` (ms after the fault); None where it has none."""
    return None if out.detection is None else getattr(out.detection, name)


def _timeline(out: ScenarioResult, fault: str) -> list[tuple[str, float | None]]:
    """The run's stamps (ms after the fault), in time order; a stamp never reached comes last."""
    rows = [(label, _stamp(out, name)) for name, label in ((_STALL_STAMP,) if fault == "stop" else _STAMPS)]
    rows.sort(key=lambda row: (row[1] is None, row[1] or 0.0))
    return rows


# The cgroup v1 freezer (Linux 6.1+) marks a sleeping task frozen where it sleeps, without waking it:
# the wait channel is the one it slept in (the rank paces its tokens with a sleep, hence
# hrtimer_nanosleep); only a task frozen while running shows __refrigerator.
_FREEZER_WCHAN_NOTE = ("  (wchan: the freezer stands in for a driver wedge and freezes a sleeping thread where it "
                       "sleeps, so the wait channel is the rank's own sleep between tokens; a rank wedged in a GPU "
                       "driver or a FUSE/NFS read shows that function, e.g. --fault fuse: request_wait_answer)")

_STAMPS_NOTE = ("  (detected: when the monitor's check saw it; check_health() False: when the first "
                "probe that answered False was called, which may itself have found the fault first)")


def _single_lines(args: argparse.Namespace, rank: int, out: ScenarioResult, run: ScenarioRun, ok: bool) -> list[str]:
    victim = out.victim
    lines = [
        f"trtllm-liveness demo: {args.workers} MPI workers ({args.mode} mode), {out.in_flight} requests in "
        f"flight, fault '{args.fault}' on rank {rank} (pid {victim.pid if victim else '?'}), {_mpi_setting()}",
        f"  t0  fault injected              {_fmt(0.0)}",
    ]
    lines += [f"      {label:<27}{_fmt(value)}" for label, value in _timeline(out, args.fault)]
    lines.append(f"      shutdown() took            {_fmt(_shutdown_ms(out))}")
    if args.fault == "stop":
        lines.append("  (SIGSTOP: alive and killable, not a liveness failure; health stays as it is)")
        lines += snapshot_lines(out.snapshot)
    else:
        lines.append(_STAMPS_NOTE)
    if out.fatal_error:
        lines.append(f"  fatal error: {out.fatal_error}")
        if args.fault == "wedge":
            lines.append(_FREEZER_WCHAN_NOTE)
    lines += _release_lines(out)
    lines.append(f"  processes left: {list(run.survivors) or 'none'}")
    lines.append(_BOUNDS_LINE)
    lines.append("  result: " + ("OK: detected and shut down within bounds" if ok else "FAILED"))
    return lines


def _release_lines(out: ScenarioResult) -> list[str]:
    lines = []
    if out.shutdown is not None and out.shutdown.unkillable:
        lines.append(f"  unkillable after SIGKILL: pids {list(out.shutdown.unkillable)} (host must be recycled)")
    if out.survivors_while_frozen:
        how = "thawed its freezer cgroup" if out.options.fault == "wedge" else "released its FUSE stall"
        lines.append(f"  the demo then {how} so pids {list(out.survivors_while_frozen)} could die "
                     "(a really wedged rank would stay until the host is recycled)")
    return lines


def _run_single(args: argparse.Namespace, rank: int, tmpdir: str) -> int:
    run = _scenario(args, rank, tmpdir, liveness=True)
    if not run.results:
        verdict = _ended_without_record(run, args.timeout)
        sys.stderr.write(f"trtllm-liveness: demo: {verdict.text}\n")
        if verdict.kind == "no_record" and run.stderr:
            sys.stderr.write(run.stderr[-2000:] + "\n")
        return 1
    out = run.results[0]
    ok = _on_ok(run, args.fault)
    if args.json:
        sys.stdout.write(json.dumps(_record(run, ok=ok)) + "\n")
    else:
        sys.stdout.write("\n".join(_single_lines(args, rank, out, run, ok)) + "\n")
    return 0 if ok else 1


def _column(run: ScenarioRun) -> dict[str, str]:
    """One run's cells of the comparison table."""
    if not run.results:
        return {}
    out = run.results[0]
    total = out.in_flight if out.in_flight is not None else out.options.requests
    # A stamp never reached: "-" for the monitor's, "never" for what a caller sees.
    cells = {label: "never" if _stamp(out, name) is None and name != "detected_ms" else _fmt(_stamp(out, name))
             for name, label in _STAMPS}
    if not out.options.liveness:
        cells["detected by the monitor"] = "- (no extension)"
    cells["requests pending at end"] = f"{out.pending_not_done} of {total}"
    if out.options.fault == "stop":
        cells[_STALL_STAMP[1]] = _fmt(_stamp(out, _STALL_STAMP[0]))
    shutdown = out.shutdown
    if shutdown is not None and shutdown.by_harness:
        cells["shutdown()"] = "not called: the demo killed the workers"
    else:
        cells["shutdown()"] = _fmt(_shutdown_ms(out))
    cells["processes left"] = str(list(run.survivors) or "none")
    return {key: value.strip() for key, value in cells.items()}


def _run_compare(args: argparse.Namespace, rank: int, tmpdir: str) -> int:
    if not args.json:
        choice = getattr(args, "compare_choice", "")
        sys.stdout.write(f"trtllm-liveness demo --compare: fault '{args.fault}' on rank {rank} of {args.workers} "
                         f"MPI workers ({args.mode} mode), {args.requests} requests, {_mpi_setting()}\n"
                         + (f"  (default fault: {choice}; --fault chooses another)\n" if choice else "")
                         + f"  1/2 extension off (watched for {args.compare_bound:g} s) ...\n")
        sys.stdout.flush()
    off = _scenario(args, rank, tmpdir, liveness=False)
    verdict = off_verdict(off, args.timeout + args.compare_bound, args.compare_bound)
    if not args.json:
        sys.stdout.write("  2/2 extension on ...\n")
        sys.stdout.flush()
    on = _scenario(args, rank, tmpdir, liveness=True)
    ok = _on_ok(on, args.fault)
    on_text = ("detected and shut down within bounds" if ok else
               _ended_without_record(on, args.timeout).text if not on.results else "FAILED")
    if args.json:
        sys.stdout.write(json.dumps({
            "fault": args.fault, "mode": args.mode, "rank": rank, "mpi": _mpi_setting(),
            "off": {"verdict": verdict.to_dict(),
                    "result": _record(off, returncode=off.returncode, exit_ms=off.exit_ms)},
            "on": {"ok": ok, "verdict": on_text, "result": _record(on, returncode=on.returncode, exit_ms=on.exit_ms)},
            "ok": ok,
        }) + "\n")
        return 0 if ok else 1
    left, right = _column(off), _column(on)
    rows = [key for key in (*left, *(k for k in right if k not in left))]
    lines = [f"  {'':<28}{'extension off':<42}extension on"]
    lines += [f"  {key:<28}{left.get(key, '-'):<42}{right.get(key, '-')}" for key in rows]
    lines.append(f"  off: {verdict.text}")
    lines.append(f"  on:  {on_text}")
    if on.results:
        lines += _release_lines(on.results[0])
    if verdict.kind == "noticed" and args.fault == "kill" and args.mode == "main":
        lines.append("  (upstream main's own worker monitor catches a plain death; --mode 1.2, --fault stop or "
                     "--fault wedge show what it does not catch)")
    if verdict.kind == "aborted":
        lines.append(f"  (with {FT_ENABLE_VAR} off a death aborts the parent, loudly: see docs/affected.md)")
    lines.append(_BOUNDS_LINE)
    lines.append("  result: " + ("OK: detected and shut down within bounds with the extension" if ok else "FAILED"))
    sys.stdout.write("\n".join(lines) + "\n")
    return 0 if ok else 1


def _record(run: ScenarioRun, **extra: Any) -> dict[str, Any] | None:
    """A run's JSON form: its result without the options, the processes left and ``extra``."""
    if not run.results:
        return None
    record = run.results[0].to_dict()
    record.pop("options", None)
    record.update(survivors=list(run.survivors), **extra)
    return record


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns the exit status (see the module docstring). Blocks up to ``--timeout``
    (twice, plus ``--compare-bound``, with ``--compare``) and ~20 s of clean-up per run.
    ``KeyboardInterrupt`` propagates after the clean-up (the caller reports it)."""
    if getattr(args, "hosts", 0):
        sys.stderr.write("trtllm-liveness: demo: the multi-host demo runs on test hosts made of namespaces and on "
                         "the upstream-shaped fakes, which are test code: from a checkout, run "
                         f"`.venv/bin/python scripts/demo_hosts.py --hosts {args.hosts} --fault "
                         f"{args.fault or 'remote-kill'}` (or `bash scripts/demo.sh --hosts ...`)\n")
        return 2
    choice = ""
    if getattr(args, "compare", False) and args.fault is None:
        args.fault, mode, choice = compare_default(args.mode)
        args.mode = args.mode or mode
    args.fault = args.fault or "kill"
    args.mode = args.mode or "main"
    args.compare_choice = choice
    problem = _problem(args)
    if problem is not None:
        sys.stderr.write(f"trtllm-liveness: demo: {problem}\n")
        return 2
    rank = args.workers - 1 if args.rank is None else args.rank
    try:
        with _sigterm_unwinds(), _private_tmpdir() as tmpdir:
            if getattr(args, "compare", False):
                return _run_compare(args, rank, tmpdir)
            return _run_single(args, rank, tmpdir)
    except _Terminated:
        sys.stderr.write("trtllm-liveness: demo: terminated (SIGTERM); its processes and files are removed\n")
        return 143


def _shutdown_ms(out: ScenarioResult) -> float | None:
    return None if out.shutdown is None else out.shutdown.shutdown_ms
