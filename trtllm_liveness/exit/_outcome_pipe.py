"""The outcome pipe: an engine's failure reaches ``trtllm-liveness launch`` before anything can kill
the engine's process.

Open MPI's default error handler ends the engine's process with 14 within milliseconds of a dead
peer, without running any exit hook; PRRTE kills every local rank when it loses a host. A record
written from a thread may come too late. So the wrapper makes a FIFO, :data:`PIPE_NAME`, in its
private outcome directory and holds its read end (and a write end of its own, so that it never
reads end-of-file); each engine process opens the write end when its engine starts
(:func:`open_writer`, non-blocking: a FIFO with no reader on this host, a missing one, or anything
else than a FIFO is no pipe) and, first thing on its fatal path, writes its failure as one line of
JSON with :func:`send_failure`: one ``write(2)`` of at most ``PIPE_BUF`` bytes to a pipe, atomic
(lines of several processes never interleave), non-blocking, no file system, no thread: a few
microseconds. The outcome files (:mod:`._outcome`) still carry what is slower to write (the
snapshot) and what a pipe cannot say (a process killed before it could record anything).

A line names the process by pid, start time and PID namespace, so a wrapper of the same namespace
(the engine on the launching host) can watch that process exit through a verified pidfd. A later
line of the same process says the failure turned unrestartable (a rank left unkillable after a
death): the status to exit with is then ``exit_code_unrestartable``.
Standard library only.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import select
import stat
from dataclasses import dataclass

from .._record_fields import JsonFields

logger = logging.getLogger(__name__)

PIPE_NAME = "outcome.fifo"
"""The FIFO in the outcome directory (:data:`~._outcome.OUTCOME_ENV`)."""
LINE_LIMIT = select.PIPE_BUF
"""A line's bound: a pipe write of at most ``PIPE_BUF`` bytes is atomic."""
_READ_LIMIT = 16 * LINE_LIMIT
"""How much one :meth:`OutcomePipe.read_failures` takes; the rest waits for the next call."""


@dataclass(frozen=True)
class PipedFailure:
    """One engine process's failure, as it wrote it to the pipe."""

    message: str
    restartable: bool
    exit_code: int
    pid: int
    start_time: int | None  # clock ticks after boot (``/proc/<pid>/stat`` field 22); None: unknown
    pid_namespace: int | None = None  # the inode of the writer's PID namespace (its pid means a process there)


def open_writer(directory: str) -> int:
    """The write end of ``directory``'s outcome pipe, owned by the caller; -1 where there is none
    (no wrapper on this host is reading, the FIFO is missing or is something else)."""
    try:
        fd = os.open(os.path.join(directory, PIPE_NAME), os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno not in (errno.ENXIO, errno.ENOENT, errno.ELOOP):
            logger.debug("liveness: no outcome pipe in %s: %s", directory, exc)
        return -1
    if not stat.S_ISFIFO(os.fstat(fd).st_mode):
        os.close(fd)
        return -1
    return fd


def compact_json(fields: dict[str, object], limit: int) -> bytes:
    """``fields`` as compact JSON of at most ``limit`` bytes, its ``message`` halved until it fits
    (as it is where no message is left to shorten). Shortens ``fields``' message in place."""
    while True:
        data = json.dumps(fields, separators=(",", ":")).encode()
        message = fields.get("message")
        if len(data) <= limit or not isinstance(message, str) or not message:
            return data
        fields["message"] = message[: len(message) // 2]


def encode_failure(failure: PipedFailure) -> bytes:
    """``failure`` as one JSON line of at most :data:`LINE_LIMIT` bytes (its message shortened to fit)."""
    fields = {"state": "failed", "message": failure.message, "restartable": failure.restartable,
              "exit_code": failure.exit_code, "pid": failure.pid, "start_time": failure.start_time,
              "pid_ns": failure.pid_namespace}
    return compact_json(fields, LINE_LIMIT - 1) + b"\n"


def send_failure(fd: int, failure: PipedFailure) -> bool:
    """Write ``failure`` to the pipe ``fd``: one atomic, non-blocking write. False where it could not
    be written (the pipe is full or its reader gone); the outcome file still follows."""
    try:
        return os.write(fd, encode_failure(failure)) > 0
    except OSError as exc:
        logger.debug("liveness: the outcome pipe took no failure record: %s", exc)
        return False


def _decode(line: bytes) -> PipedFailure | None:
    try:
        fields = JsonFields("outcome line", json.loads(line), optional=("start_time", "pid_ns"), newer_fields=True,
                            required=("state", "message", "restartable", "exit_code", "pid"))
        failure = PipedFailure(fields.text("message"), fields.flag("restartable"), fields.integer("exit_code"),
                               fields.integer("pid"), fields.integer_or_none("start_time"),
                               fields.integer_or_none("pid_ns"))
    except (ValueError, RecursionError):  # RecursionError: a line of nested brackets, not ours
        return None
    if fields.get("state") != "failed" or not 1 <= failure.exit_code <= 255 or failure.pid <= 0 \
            or any(value is not None and value < 0 for value in (failure.start_time, failure.pid_namespace)):
        return None
    return failure


class OutcomePipe:
    """The wrapper's end: makes the FIFO in ``directory`` (private to the wrapper), holds its read
    end and a write end (no end-of-file while engines come and go). :meth:`close` releases both,
    once."""

    def __init__(self, directory: str) -> None:
        path = os.path.join(directory, PIPE_NAME)
        os.mkfifo(path, 0o600)
        self._read_fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            self._hold_fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            os.close(self._read_fd)
            raise
        self._partial = b""

    def fileno(self) -> int:
        """The read end, for ``poll``: readable when a failure line arrived."""
        return self._read_fd

    def read_failures(self) -> list[PipedFailure]:
        """The failure lines that arrived (never blocks); a malformed line is logged and dropped."""
        try:
            data = os.read(self._read_fd, _READ_LIMIT)
        except BlockingIOError:
            return []
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        if len(self._partial) > LINE_LIMIT:  # no writer writes a line this long: not ours
            logger.warning("liveness: dropped %d bytes of an over-long line from the outcome pipe", len(self._partial))
            self._partial = b""
        failures = []
        for line in lines:
            failure = _decode(line)
            if failure is None:
                logger.warning("liveness: dropped a malformed line from the outcome pipe (%d bytes)", len(line))
            else:
                failures.append(failure)
        return failures

    def close(self) -> None:
        """Release both ends (idempotent)."""
        for name in ("_read_fd", "_hold_fd"):
            fd = getattr(self, name)
            if fd >= 0:
                setattr(self, name, -1)
                os.close(fd)
