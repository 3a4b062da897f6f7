"""The job ``trtllm-liveness launch`` runs: the launcher, the engine failures its outcome pipe brings,
and the end of what is left of the job after a failure.

:class:`LaunchedJob` owns the launcher's process, its pidfd, the outcome pipe's read end and the
pidfd of the engine process that failed, and releases them once. It waits for whichever comes
first: the launcher's exit, a failure line, the failed process's exit, or the deadline of the job's
end. After the engine's first failure:

- once the failed process has exited (seen through a pidfd verified against its start time; the
  engine on the launching host, as the outcome directory requires), the launcher gets
  :data:`LAUNCHER_GRACE_S` to end (``mpirun`` ends at once, unless a host of its job is cut off:
  PRRTE then waits for that host's daemon, minutes of TCP keepalive);
- with ``exit_on_fatal``, whatever happens, the launcher gets ``exit_delay_s + exit_timeout_s``
  (the exit guard's own bound on the engine's graceful shutdown) plus that grace;
- then it is sent SIGTERM, and SIGKILL :data:`TERM_GRACE_S` later, each with one line on stderr.

So the job has ended within :func:`job_end_bound_s` of the verdict. Without ``exit_on_fatal`` a
server whose failed process stays up (answering its health check with the failure) keeps its job.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable

from .._config import LivenessConfig
from .._errors import AccessDenied, PidReused, ProcessGone, ProcessZombie
from ..exit._outcome_pipe import OutcomePipe, PipedFailure
from ..process._pidfd import open_pidfd, open_verified_pidfd, pidfd_supported

LAUNCHER_GRACE_S = 2.0
"""How long the launcher may outlive the engine process that failed (``mpirun`` collects its other
ranks' ends in milliseconds)."""
TERM_GRACE_S = 3.0
"""Between the SIGTERM that ends the launcher and the SIGKILL."""
_POLL_S = 1.0  # without a pidfd for the launcher: how often its end is checked


def job_end_bound_s(config: LivenessConfig) -> float | None:
    """The most a job under the wrapper lasts after its engine's first failure, when the failed
    process stays up (None: without ``exit_on_fatal``, only a failed process that has exited ends
    the job)."""
    if not config.exit_on_fatal:
        return None
    return config.exit_delay_s + config.exit_timeout_s + LAUNCHER_GRACE_S + TERM_GRACE_S


class LaunchedJob:
    """The launcher started with ``argv`` and ``env``, watched until it ends (:meth:`wait`)."""

    def __init__(self, argv: list[str], env: dict[str, str], pipe: OutcomePipe, config: LivenessConfig,
                 say: Callable[[str], None]) -> None:
        self._pipe = pipe
        self._config = config
        self._say = say
        self.failures: list[PipedFailure] = []
        self.status = 0  # the launcher's exit status, once :meth:`wait` returned
        self._failed_fd = -1  # the pidfd of the first failure's process
        self._deadline: float | None = None
        self._why = ""  # what set the deadline, for the line that ends the launcher
        self._why_at = 0.0
        self._killed_at: float | None = None
        self._termed = False
        self.child = subprocess.Popen(argv, env=env)
        self._child_fd = -1
        if pidfd_supported():
            try:
                self._child_fd = open_pidfd(self.child.pid)
            except OSError:
                self._child_fd = -1

    def send_signal(self, signum: int) -> None:
        """Forward ``signum`` to the launcher while it runs."""
        if self.child.poll() is None:
            self.child.send_signal(signum)

    def wait(self) -> int:
        """Wait, in bounded steps, until the launcher ends; its status (128 + N for a signal N),
        also kept in :attr:`status`."""
        while True:
            code = self.child.poll()
            if code is not None:
                self._take_failures()  # a line written just before the end
                self.status = 128 - code if code < 0 else code
                return self.status
            self._step()

    def _step(self) -> None:
        poller = select.poll()
        poller.register(self._pipe.fileno(), select.POLLIN)
        for fd in (self._child_fd, self._failed_fd):
            if fd >= 0:
                poller.register(fd, select.POLLIN)
        timeout = _POLL_S if self._child_fd < 0 else None
        if self._deadline is not None:
            left = max(0.0, self._deadline - time.monotonic())
            timeout = left if timeout is None else min(timeout, left)
        try:
            ready = {fd for fd, _ in poller.poll(None if timeout is None else int(timeout * 1000) + 1)}
        except InterruptedError:  # a forwarded signal's handler ran
            return
        if self._pipe.fileno() in ready:
            self._take_failures()
        if self._failed_fd >= 0 and self._failed_fd in ready:
            os.close(self._failed_fd)
            self._failed_fd = -1
            self._end_by(time.monotonic() + LAUNCHER_GRACE_S, "the failed engine process exited")
        if self._deadline is not None and time.monotonic() >= self._deadline:
            self._end_launcher()

    def _take_failures(self) -> None:
        for failure in self._pipe.read_failures():
            first = not self.failures
            self.failures.append(failure)
            if first:
                self._watch_failed_process(failure)
                bound = job_end_bound_s(self._config)
                if bound is not None:
                    self._end_by(time.monotonic() + bound - TERM_GRACE_S, "the engine failed (exit_on_fatal)")

    def _watch_failed_process(self, failure: PipedFailure) -> None:
        if not pidfd_supported() or failure.start_time is None or failure.pid == os.getpid():
            return
        try:
            self._failed_fd = open_verified_pidfd(failure.pid, failure.start_time)
        except (ProcessGone, ProcessZombie):  # it has ended already
            self._end_by(time.monotonic() + LAUNCHER_GRACE_S, "the failed engine process exited")
        except (PidReused, AccessDenied, OSError):  # not a process of this PID namespace: the deadline
            self._failed_fd = -1

    def _end_by(self, when: float, why: str) -> None:
        if self._killed_at is None and not self._termed and (self._deadline is None or when < self._deadline):
            self._deadline = when
            self._why_at = time.monotonic()
            self._why = f"{why} (pid {self.failures[0].pid})" if self.failures else why

    def _end_launcher(self) -> None:
        name = os.path.basename(self.child.args[0]) if isinstance(self.child.args, list) else "the launcher"
        if not self._termed:
            self._termed = True
            since = time.monotonic() - self._why_at
            self._say(f"trtllm-liveness launch: ending {name} (pid {self.child.pid}), still running {since:.1f} s "
                      f"after {self._why}: SIGTERM")
            self.send_signal(signal.SIGTERM)
            self._deadline = time.monotonic() + TERM_GRACE_S
        elif self._killed_at is None:
            self._killed_at = time.monotonic()
            self._say(f"trtllm-liveness launch: {name} (pid {self.child.pid}) outlived SIGTERM by "
                      f"{TERM_GRACE_S:g} s: SIGKILL")
            self.send_signal(signal.SIGKILL)
            self._deadline = None

    def close(self) -> None:
        """Release the pidfds (idempotent; the pipe is its owner's)."""
        for name in ("_child_fd", "_failed_fd"):
            fd = getattr(self, name)
            if fd >= 0:
                setattr(self, name, -1)
                os.close(fd)


def stderr_line(text: str) -> None:
    """One line on the wrapper's stderr, flushed."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()
