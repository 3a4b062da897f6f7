"""The job ``trtllm-liveness launch`` runs: the launcher, the engine failures its outcome pipe brings,
and the end of what is left of the job after a failure.

:class:`LaunchedJob` owns the launcher's process, its pidfd and the pidfd of the engine process that
failed, and releases them once; the outcome pipe is its caller's. It waits, in steps of at most
:data:`POLL_S`, for whichever comes first: the launcher's exit, a failure line, the failed
process's exit, or the deadline of the job's end. After the engine's first failure:

- once the failed process has exited (watched through a pidfd verified against its start time, or
  by its ``stat`` where pidfds are missing; only a process of the wrapper's own PID namespace, as
  the line says, which is where an engine started by this launcher on this host runs), the
  launcher gets :data:`LAUNCHER_GRACE_S` to end (``mpirun`` ends at once, unless a host of its job
  is cut off: PRRTE then waits for that host's daemon, minutes of TCP keepalive);
- with ``exit_on_fatal``, whatever happens, the launcher gets the engine's own bound on its end
  after a failure (``exit_delay_s + exit_timeout_s + shutdown_term_s + shutdown_kill_s``, the exit
  guard's) plus that grace;
- then the launcher is sent SIGTERM, and :data:`TERM_GRACE_S` later SIGKILL, it and the failed
  process (through its verified pidfd) alike, each step one line on stderr.

So the job has ended within :func:`job_end_bound_s` of the verdict. Without ``exit_on_fatal`` a
server whose failed process stays up (answering its health check with the failure) keeps its job.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import time

from .._config import LivenessConfig
from .._errors import AccessDenied, PidReused, ProcessGone, ProcessZombie
from ..exit._outcome_pipe import OutcomePipe, PipedFailure
from ..process._pidfd import open_pidfd, open_verified_pidfd, pidfd_supported, send_signal, verify_start_time
from ..process._procfs import own_pid_namespace
from ._output import stderr_line

LAUNCHER_GRACE_S = 2.0
"""How long the launcher may outlive the engine process that failed (``mpirun`` collects its other
ranks' ends in milliseconds)."""
TERM_GRACE_S = 3.0
"""Between the SIGTERM that ends the launcher and the SIGKILL."""
POLL_S = 1.0
"""The longest single wait: the launcher's end and the failed process's are also checked this often."""
_ENDED = (ProcessGone, ProcessZombie, PidReused)  # what a verification says of a process that has exited


def job_end_bound_s(config: LivenessConfig) -> float | None:
    """The most a job under the wrapper lasts after its engine's first failure (None: without
    ``exit_on_fatal``, only a failed process that has exited ends the job): the exit guard's bound
    on the engine's own end, the launcher's grace, and SIGTERM's."""
    if not config.exit_on_fatal:
        return None
    engine_s = config.exit_delay_s + config.exit_timeout_s + config.shutdown_term_s + config.shutdown_kill_s
    return engine_s + LAUNCHER_GRACE_S + TERM_GRACE_S


class LaunchedJob:
    """The launcher started with ``argv`` and ``env``, watched until it ends (:meth:`wait`);
    ``pipe`` None: no outcome pipe could be made (the outcome files still say what failed)."""

    def __init__(self, argv: list[str], env: dict[str, str], pipe: OutcomePipe | None, config: LivenessConfig) -> None:
        self._pipe = pipe
        self._config = config
        self.failures: list[PipedFailure] = []
        self.status = 0  # the launcher's exit status, once :meth:`wait` returned
        self._failed: PipedFailure | None = None  # the first failure's process, while it is watched
        self._failed_fd = -1  # its pidfd, where pidfds work
        self._deadline: float | None = None
        self._why = ""  # what set the deadline, for the line that ends the launcher
        self._why_at = 0.0
        self._termed = False
        self._killed = False
        self._own_namespace = own_pid_namespace() or None
        self.child = subprocess.Popen(argv, env=env)
        self._child_fd = -1  # without a pidfd, signals go by pid before the reap (send_signal)
        if pidfd_supported():
            with contextlib.suppress(OSError):
                self._child_fd = open_pidfd(self.child.pid)

    def send_signal(self, signum: int) -> None:
        """Forward ``signum`` to the launcher while it runs: through its pidfd where there is one
        (never to a pid reaped and reused in between), else by pid before it is reaped."""
        if self._child_fd >= 0:
            try:
                send_signal(self._child_fd, signum)
            except OSError as exc:
                stderr_line(f"trtllm-liveness launch: could not send signal {signum} to the launcher: {exc}")
        elif self.child.returncode is None:
            self.child.send_signal(signum)

    def wait(self) -> int:
        """Wait, in steps of at most :data:`POLL_S`, until the launcher ends; its status (128 + N
        for a signal N), also kept in :attr:`status`."""
        while True:
            code = self.child.poll()
            if code is not None:
                self._take_failures()  # a line written just before the end
                self.status = 128 - code if code < 0 else code
                return self.status
            self._step()

    def end_now(self) -> None:
        """SIGKILL the launcher (the wrapper itself is failing: never leave it running unwatched)."""
        if self.child.poll() is None:
            self.child.kill()

    def _step(self) -> None:
        poller = select.poll()
        for fd in (self._pipe.fileno() if self._pipe else -1, self._child_fd, self._failed_fd):
            if fd >= 0:
                poller.register(fd, select.POLLIN)
        timeout = POLL_S
        if self._deadline is not None:
            timeout = min(timeout, max(0.0, self._deadline - time.monotonic()))
        ready = {fd for fd, _ in poller.poll(int(timeout * 1000) + 1)}
        if self._pipe is not None and self._pipe.fileno() in ready:
            self._take_failures()
        if self._failed is not None and self._failed_exited(ready):
            self._stop_watching()
            self._end_by(time.monotonic() + LAUNCHER_GRACE_S, "the failed engine process exited")
        if self._deadline is not None and time.monotonic() >= self._deadline:
            self._end_launcher()

    def _take_failures(self) -> None:
        if self._pipe is None:
            return
        for failure in self._pipe.read_failures():
            first = not self.failures
            self.failures.append(failure)
            if first:
                self._watch_failed_process(failure)
                bound = job_end_bound_s(self._config)
                if bound is not None:
                    self._end_by(time.monotonic() + bound - TERM_GRACE_S, "the engine failed (exit_on_fatal)")

    def _watch_failed_process(self, failure: PipedFailure) -> None:
        """Watch the failed process where its pid means a process of this PID namespace, verified
        by its start time; one that has already exited sets the launcher's grace at once."""
        if failure.start_time is None or failure.pid_namespace is None or failure.pid_namespace != self._own_namespace \
                or failure.pid == os.getpid():
            return  # another host's or container's pid: only the exit_on_fatal deadline applies
        self._failed = failure
        if not pidfd_supported():
            return  # checked by its stat at each step
        try:
            self._failed_fd = open_verified_pidfd(failure.pid, failure.start_time)
        except _ENDED:
            pass  # the next step sees it gone
        except (AccessDenied, OSError, ValueError):
            self._failed = None

    def _failed_exited(self, ready: set[int]) -> bool:
        if self._failed_fd >= 0:
            return self._failed_fd in ready
        assert self._failed is not None
        try:
            verify_start_time(self._failed.pid, self._failed.start_time)
        except _ENDED:
            return True
        except (AccessDenied, OSError, ValueError):
            self._failed = None
        return False

    def _stop_watching(self) -> None:
        self._failed = None
        if self._failed_fd >= 0:
            fd, self._failed_fd = self._failed_fd, -1
            os.close(fd)

    def _end_by(self, when: float, why: str) -> None:
        if not self._termed and (self._deadline is None or when < self._deadline):
            self._deadline = when
            self._why_at = time.monotonic()
            self._why = f"{why} (pid {self.failures[0].pid})" if self.failures else why

    def _end_launcher(self) -> None:
        name = os.path.basename(self.child.args[0]) if isinstance(self.child.args, list) else "the launcher"
        if not self._termed:
            self._termed = True
            since = time.monotonic() - self._why_at
            stderr_line(f"trtllm-liveness launch: ending {name} (pid {self.child.pid}), still running {since:.1f} s "
                      f"after {self._why}: SIGTERM")
            self.send_signal(signal.SIGTERM)
            self._deadline = time.monotonic() + TERM_GRACE_S
        elif not self._killed:
            self._killed = True
            failed = ""
            try:
                if self._failed_fd >= 0 and send_signal(self._failed_fd, signal.SIGKILL):
                    failed = f" and the failed engine process (pid {self.failures[0].pid})"
            except OSError as exc:  # EPERM: another user's process (a setuid launcher's rank)
                failed = f" (not to the failed engine process, pid {self.failures[0].pid}: {exc})"
            stderr_line(f"trtllm-liveness launch: {name} (pid {self.child.pid}) outlived SIGTERM by "
                      f"{TERM_GRACE_S:g} s: SIGKILL to it{failed}")
            self.send_signal(signal.SIGKILL)
            self._deadline = None

    def close(self) -> None:
        """Release the pidfds (idempotent; the pipe is its owner's)."""
        self._stop_watching()
        if self._child_fd >= 0:
            fd, self._child_fd = self._child_fd, -1
            os.close(fd)
