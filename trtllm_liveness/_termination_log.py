"""The fatal reason, written where Kubernetes looks for a container's termination message.

Kubernetes shows the contents of a container's ``terminationMessagePath`` (default
``/dev/termination-log``, a file the kubelet mounts into the container) in ``kubectl describe pod``
and the pod's status after the container ended, keeping at most 4096 bytes of it. Writing the
engine's fatal error there puts "rank 1 (pid 4242 on host a) killed by SIGKILL (OOM killer)" next
to the restart, instead of a bare exit status.

The write never blocks the caller nor the exit: it runs in a daemon thread of its own and opens
the file with ``O_NONBLOCK`` (a FIFO without a reader fails at once instead of waiting). Outside a
container (no such file) the default path is left alone: only a path the user set is created.
"""

from __future__ import annotations

import logging
import os
import stat
import threading

logger = logging.getLogger(__name__)

__all__ = ["MESSAGE_LIMIT_BYTES", "TERMINATION_LOG_DEFAULT", "write_termination_message"]

TERMINATION_LOG_DEFAULT = "/dev/termination-log"
MESSAGE_LIMIT_BYTES = 4096
"""Kubernetes keeps at most this much of a container's termination message."""


def write_termination_message(path: str, message: str, *, create: bool | None = None) -> threading.Thread | None:
    """Write ``message`` (cut to :data:`MESSAGE_LIMIT_BYTES` of UTF-8) to ``path`` in a daemon thread.

    ``path`` empty: nothing (switched off). ``create``: make the file if it is missing; default:
    only for a path other than :data:`TERMINATION_LOG_DEFAULT`. Returns the started thread (callers
    may wait on it with a timeout), or ``None`` when off. Failures are logged, never raised.
    """
    if not path:
        return None
    if create is None:
        create = path != TERMINATION_LOG_DEFAULT
    writer = threading.Thread(target=_write, args=(path, message, create),
                              name="trtllm-liveness-termination-log", daemon=True)
    try:
        writer.start()
    except RuntimeError as exc:  # no thread left (interpreter shutting down, thread limit)
        logger.warning("termination message not written to %s: %s", path, exc)
        return None
    return writer


def bounded_message(message: str, limit: int = MESSAGE_LIMIT_BYTES) -> bytes:
    """``message`` as UTF-8, cut at a character boundary to at most ``limit`` bytes."""
    data = message.encode("utf-8", errors="replace")
    if len(data) <= limit:
        return data
    return data[:limit].decode("utf-8", errors="ignore").encode("utf-8")


def _write(path: str, message: str, create: bool) -> None:
    flags = os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    try:
        fd = os.open(path, flags, 0o644)
    except FileNotFoundError:
        if create:
            logger.warning("termination message not written: the directory of %s does not exist", path)
        else:  # not in a container that asked for one
            logger.debug("no %s: termination message not written", path)
        return
    except OSError as exc:
        logger.warning("termination message not written to %s: %s", path, exc.strerror or exc)
        return
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            logger.warning("termination message not written: %s is not a regular file", path)
            return
        os.ftruncate(fd, 0)
        data = bounded_message(message)
        written = 0
        while written < len(data):
            written += os.write(fd, data[written:])
        logger.info("fatal reason written to %s", path)
    except OSError as exc:
        logger.warning("termination message not fully written to %s: %s", path, exc.strerror or exc)
    finally:
        os.close(fd)
