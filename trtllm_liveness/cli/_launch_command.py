"""``trtllm-liveness launch -- COMMAND``: the one wrapper that switches worker liveness on for a
launcher (``mpirun``, ``srun``, ``trtllm-serve`` itself, Dynamo's worker), and never exits 0 after an
engine death, which Kubernetes, Slurm or a supervisor would otherwise take for success (or see MPI's
status). :data:`DESCRIPTION`, its ``--help`` text, says how it switches liveness on, what it does
after a failure and which status it exits with.

The parts: the environment the command gets and the check of the setting
(:func:`~trtllm_liveness.integrations.trtllm_autoload.launch_setting`); what carries them to the
ranks of other hosts (:mod:`._launcher_env`; an ``@file`` setting's file must be at the same path on
every host too); the outcome pipe into which the engine writes its failure first thing on its fatal
path (:mod:`~trtllm_liveness.exit._outcome_pipe`) and the outcome files
(:data:`~trtllm_liveness.exit._outcome.OUTCOME_ENV`), both local, hence rank 0 on the launching
host; ending what is left of the job (:mod:`._launched_job`).

The launcher runs in the wrapper's process group, so a terminal's Ctrl-C reaches it directly, once,
as without the wrapper (a second copy would make mpirun abort at once).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from .._config import LivenessConfig, changed_settings, format_setting
from .._switch import ENV_VAR, EXIT_INVALID_SETTING
from ..exit._outcome import OUTCOME_ENV, Outcome, read_outcomes
from ..exit._outcome_pipe import OutcomePipe, PipedFailure
from ._arg_types import add_command
from ._exit_status import EXIT_USAGE
from ._launched_job import LAUNCHER_GRACE_S, TERM_GRACE_S, LaunchedJob
from ._launcher_env import Forwarding, forwarding_for
from ._output import stderr_line

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
_SIGNALLED = (129, 128 + 64)  # 128 + N: the launcher was ended by signal N
MPI_ABORT_STATUS = 14
"""What Open MPI's default error handler (``MPI_ERRORS_ARE_FATAL``) exits with (MPI_ERR_UNKNOWN): the
engine's process after a worker died or was stopped, under ``OMPI_MCA_mpi_ft_enable`` off."""

# The --help text, the command's full description, in plain words (no reST roles on a terminal).
DESCRIPTION = f"""\
Run a launcher (mpirun, srun, or trtllm-serve itself) with worker liveness on in every Python it
starts, on every host, and never exit 0 after an engine failure.

Switching on: {ENV_VAR} is set to 1 unless it is set (a settings value is kept), checked
first (an invalid one: exit status {EXIT_INVALID_SETTING}, nothing started), the package's sitecustomize goes
first on PYTHONPATH (every Python the command starts installs the hook; no .pth needed), and the
launcher is made to pass PYTHONPATH, {ENV_VAR} and {OUTCOME_ENV} to the ranks of
other hosts: mpirun/mpiexec of Open MPI get -x for each (a host started over ssh gets only OMPI_*
variables and those named with -x), srun exports the environment (a --export list gets the names
added), MPICH/Hydra passes it. One line on stderr gives the effective settings. Every host needs
the package at the same path (one image).

mpirun exits 0 when a host of its job crashed (PRRTE ends the job on the lost daemon and reports
success), and Open MPI's default error handling ends the engine with 14 before it can choose its
status. The wrapper sets {OUTCOME_ENV} for the launcher (mpirun and srun pass
the environment to the ranks of the launching host; the server process, rank 0, must run there,
or --outcome-dir must be shared), reads the failure the engine writes into its outcome pipe first
thing on its fatal path, forwards SIGTERM and SIGHUP to the launcher, and SIGINT and SIGQUIT unless
they came from the terminal. After a failure it ends what is left of the job: {LAUNCHER_GRACE_S:g} s after
the failed engine process (on this host) exited (mpirun waits minutes for a cut-off host's daemon), and with
exit_on_fatal at the latest exit_delay_s + exit_timeout_s + shutdown_term_s + shutdown_kill_s +
{LAUNCHER_GRACE_S:g} s after the failure (the engine's own bound, then the grace): SIGTERM, then SIGKILL
{TERM_GRACE_S:g} s later (to the failed engine process too, where it runs on this host). It exits with:
  - after a recorded fatal error, its status (exit_code, or exit_code_unrestartable where a
    failure was a wedged or unkillable worker), whatever the launcher exited with, with one line;
  - else exit_code when an engine started and never ended cleanly and no signal ended the
    launcher (mpirun's 0 or 255 after its teardown of a host crash, Open MPI's abort 14 before
    the engine's verdict), with one line;
  - else the launcher's status (128 + N when a signal N ended it).
"""


def add_launch_parser(sub: Any) -> None:
    """Add the ``launch`` subcommand to ``sub`` (argparse subparsers)."""
    launch = add_command(sub, "launch", run_launch, description=DESCRIPTION,
                         help="run mpirun/srun/trtllm-serve with liveness on in every Python on every host; exit "
                              "non-zero whenever the engine recorded a fatal error (mpirun exits 0 after a host crash)")
    launch.add_argument("--outcome-dir", default=None, metavar="DIR",
                        help="where the engines' outcome files are made (default: $TMPDIR); the proxy (rank 0) must "
                             "see it: a local directory where rank 0 runs on the launching host, else a shared one")
    launch.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- COMMAND [ARGS...]",
                        help="the launcher and its arguments")


def run_launch(args: argparse.Namespace) -> int:
    """Run ``launch``; returns the exit status (see :data:`DESCRIPTION`)."""
    argv = list(args.argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        stderr_line("trtllm-liveness launch: no command given")
        return EXIT_USAGE
    # Imported here: importing it installs the hook in this process where the switch is on.
    from ..integrations.trtllm_autoload import EXIT_NOT_FOUND, find_command, launch_setting

    prepared = launch_setting("trtllm-liveness launch")
    if isinstance(prepared, int):
        return prepared
    env, config = prepared
    if find_command("trtllm-liveness launch", argv[0]) is None:
        return EXIT_NOT_FOUND
    # 0700: only this user writes there
    directory = tempfile.mkdtemp(prefix="trtllm-liveness-launch-", dir=args.outcome_dir)
    try:
        try:
            pipe: OutcomePipe | None = OutcomePipe(directory)
        except OSError as exc:  # a file system without FIFOs: the outcome files alone
            stderr_line(f"trtllm-liveness launch: no outcome pipe in {directory} ({exc}); the engine's failure "
                        "reaches this wrapper through its outcome file only")
            pipe = None
        try:
            forwarding = forwarding_for(argv, {**env, OUTCOME_ENV: directory})
            stderr_line(on_line(config, env[ENV_VAR], argv, forwarding))
            job = _run(list(forwarding.argv), dict(forwarding.env), pipe, config)
        finally:
            if pipe is not None:
                pipe.close()
        try:
            outcomes = read_outcomes(directory)
        except (OSError, ValueError) as exc:
            stderr_line(f"trtllm-liveness launch: ignoring the outcome files: {exc}")
            outcomes = []
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return decide_status(argv[0], job.status, job.failures, outcomes)


def decide_status(launcher: str, status: int, piped: Sequence[PipedFailure], outcomes: Sequence[Outcome]) -> int:
    """The wrapper's status from the launcher's ``status``, the failures the pipe brought and the
    outcome files; one line on stderr where it is not the launcher's."""
    failed: list[PipedFailure | Outcome] = [*piped, *(o for o in outcomes if o.state == "failed")]
    if failed:
        # The first failure's status, unless one says "do not restart here" (a wedge, a rank left
        # unkillable after a death): that one outranks it.
        chosen = next((f for f in failed if not f.restartable), failed[0])
        message, code = chosen.message, chosen.exit_code
        if status == code:
            return code
        how = {0: "exited 0, but the engine failed",
               MPI_ABORT_STATUS: f"exited {status} (Open MPI's abort) after the engine failed"}.get(
            status, f"exited {status} after the engine failed")
        stderr_line(f"trtllm-liveness launch: {launcher} {how}: {message}; exiting {code}")
        return code
    unclean = [outcome for outcome in outcomes if outcome.state == "running"]
    if unclean and not _SIGNALLED[0] <= status <= _SIGNALLED[1]:
        # 0 or 255: PRRTE's teardown after a host crash killed the engine before it could say why;
        # 14: Open MPI's default error handler ended it at a dead peer before its fatal path began.
        # (A launcher killed by a signal, 128 + N, says what happened to the job: the OOM killer.)
        why = "Open MPI's abort at a dead or stopped peer came before the engine's own verdict" \
            if status == MPI_ABORT_STATUS else "killed with its job before it could say why: a lost host?"
        stderr_line(f"trtllm-liveness launch: {launcher} exited {status}, but the engine (pid {unclean[0].pid}) "
                    f"never ended cleanly ({why}); exiting {unclean[0].exit_code}")
        return unclean[0].exit_code
    return status


# Shown in the "on" line whatever their value; every other setting only where it is not the default.
SHOWN_SETTINGS = ("d_state_timeout_s", "stall_timeout_s", "exit_on_fatal", "hosts", "heartbeat_timeout_s")
_COMMAND_CHARS = 160


def effective_settings(config: LivenessConfig) -> str:
    """``key=value, ...``: :data:`SHOWN_SETTINGS` and every setting that differs from the default,
    written as in ``TRTLLM_WORKER_LIVENESS``."""
    shown = set(SHOWN_SETTINGS) | set(changed_settings(config))
    return ", ".join(f"{spec.name}={format_setting(getattr(config, spec.name))}"
                     for spec in dataclasses.fields(config) if spec.name != "enabled" and spec.name in shown)


def on_line(config: LivenessConfig, raw: str, argv: Sequence[str], forwarding: Forwarding) -> str:
    """The one line ``launch`` prints before it starts ``argv`` (as given; what was added to it for the
    other hosts is ``forwarding.how``)."""
    command = " ".join(argv)
    if len(command) > _COMMAND_CHARS:
        command = command[:_COMMAND_CHARS - 3] + "..."
    if not config.enabled:
        return f"trtllm-liveness: worker liveness off ({ENV_VAR}={raw}) for: {command}"
    travel = f"; {forwarding.how}" if forwarding.how else ""
    note = f"; NOTE: {forwarding.problem}" if forwarding.problem else ""
    return (f"trtllm-liveness: worker liveness on ({effective_settings(config)}) in every Python of: "
            f"{command}{travel}{note}")


def _foreground_of_terminal() -> bool:
    """Whether this process's group is its terminal's foreground group (keyboard signals go to both)."""
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError, AttributeError):
        return False


def _run(argv: list[str], env: dict[str, str], pipe: OutcomePipe | None, config: LivenessConfig) -> LaunchedJob:
    """Start the launcher and wait for its end (see :mod:`._launched_job`), forwarding signals."""
    previous = {}
    from_terminal = _foreground_of_terminal()
    started: list[LaunchedJob] = []
    held: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        # A terminal's Ctrl-C / Ctrl-\ reaches the whole foreground group, the launcher too: a second
        # copy would be mpirun's "abort now" (and srun's two SIGINTs within a second).
        if from_terminal and signum in (signal.SIGINT, signal.SIGQUIT):
            return
        if not started:  # arrived before the launcher started: sent to it once it has
            held.append(signum)
        else:
            started[0].send_signal(signum)

    # The handlers before the launcher: a SIGTERM in between (a pod deleted at start) must reach
    # it, not end this wrapper and leave the launcher running unsignalled.
    for signum in FORWARDED:
        previous[signum] = signal.signal(signum, forward)
    try:
        job = LaunchedJob(argv, env, pipe, config)
        started.append(job)
        for pending in held:
            job.send_signal(pending)
        while True:  # the job itself: as long as the launcher runs, in bounded waits
            try:
                job.wait()
                return job
            except KeyboardInterrupt:  # SIGINT raised here despite the handler (re-entrancy): go on
                continue
            except BaseException:  # the wrapper is failing: its launcher must not run on unwatched
                job.end_now()
                raise
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if started:
            started[0].close()
