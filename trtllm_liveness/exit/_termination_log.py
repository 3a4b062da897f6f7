"""The fatal reason, written where Kubernetes looks for a container's termination message.

docs/kubernetes.md "The fatal reason in the pod status" says what Kubernetes shows of it (at most
4096 bytes, in ``kubectl describe pod``) and gives an example line.

The write never blocks the caller: it runs in a thread of its own, which the process's ending
(:mod:`._process_ending`) awaits for at most :data:`WRITE_BOUND_S`, and opens the file with
``O_NONBLOCK`` (a FIFO without a reader fails at once instead of waiting) and ``O_NOFOLLOW``. A
write to a regular file on a stalled mount could still leave that thread in ``D``, which the
kernel would then wait for at the process's exit: the path Kubernetes mounts is a local file.
Outside a container (no such file) the default path is left alone: only a path the user set is
created. One message per process: the first fatal error's; once the fatal verdict's snapshot is
taken, :func:`amend_termination_message` rewrites it with the snapshot after the same first line
(writes are serialized and numbered: an older one never overwrites a newer).
"""

from __future__ import annotations

import logging
import os
import stat
import threading

from ._process_ending import WRITE_BOUND_S, process_ending

logger = logging.getLogger(__name__)

__all__ = ["MESSAGE_LIMIT_BYTES", "TERMINATION_LOG_DEFAULT", "WRITE_BOUND_S", "amend_termination_message",
           "write_termination_message"]

TERMINATION_LOG_DEFAULT = "/dev/termination-log"
MESSAGE_LIMIT_BYTES = 4096
"""Kubernetes keeps at most this much of a container's termination message."""


def write_termination_message(path: str, message: str, *, create: bool | None = None) -> threading.Thread | None:
    """Write ``message`` (cut to :data:`MESSAGE_LIMIT_BYTES` of UTF-8) to ``path`` in a thread of the
    process's ending.

    ``path`` empty: nothing (switched off). ``create``: make the file if it is missing; default:
    only for a path other than :data:`TERMINATION_LOG_DEFAULT`. Returns the started thread (callers
    may wait on it with a timeout), or ``None`` when off. Failures are logged, never raised.
    """
    return _claim_and_write(path, message, path != TERMINATION_LOG_DEFAULT if create is None else create, amend=False)


def amend_termination_message(path: str, message: str) -> threading.Thread | None:
    """Rewrite the termination message with ``message``, which must begin with the message this
    process wrote (the same fatal error, with its snapshot after it); otherwise nothing. As
    :func:`write_termination_message`: in a thread of the process's ending, never raises."""
    return _claim_and_write(path, message, path != TERMINATION_LOG_DEFAULT, amend=True)


def _wanted(path: str, create: bool) -> bool:
    """Whether a message goes to ``path``: one is set, and is to be created or exists already."""
    if path and not create and not os.path.lexists(path):
        # Not in a container that asked for one: no thread at all (one stat; the fatal path runs
        # this at the moment everything else wants the CPU).
        logger.debug("no %s: termination message not written", path)
        return False
    return bool(path)


def _claim_and_write(path: str, message: str, create: bool, *, amend: bool) -> threading.Thread | None:
    """Where a message goes to ``path``, claim its write (or its amendment's) from the process's ending
    and make it in a thread of the ending (returned); None where nothing is written."""
    if not _wanted(path, create):
        return None
    ending = process_ending()
    sequence = ending.claim_termination(message, amend=amend)
    if not sequence:  # an amendment of no message of this process, or not its first fatal error (the reason)
        logger.debug("termination message not amended: %r extends no message of this process" if amend else
                     "termination message already written by this process; %r not written", message[:80])
        return None
    writer = ending.threads.start(_write_once, name="trtllm-liveness-termination-log",
                                  bound_s=WRITE_BOUND_S, args=(path, message, create, sequence))
    if writer is None:  # no thread left (interpreter shutting down, thread limit)
        logger.warning("termination message not written to %s", path)
    return writer


def _write_once(path: str, message: str, create: bool, sequence: int) -> None:
    ending = process_ending()
    with ending.termination_lock:
        if ending.termination_written > sequence:
            return  # a newer message (the amendment) is already there
        _write(path, message, create)
        ending.termination_written = sequence


def bounded_message(message: str) -> bytes:
    """``message`` as UTF-8, cut at a character boundary to at most :data:`MESSAGE_LIMIT_BYTES` bytes."""
    data = message.encode("utf-8", errors="replace")
    if len(data) <= MESSAGE_LIMIT_BYTES:
        return data
    return data[:MESSAGE_LIMIT_BYTES].decode("utf-8", errors="ignore").encode("utf-8")


def _write(path: str, message: str, create: bool) -> None:
    # O_NOFOLLOW: a symlink planted at a path the user named (say under /tmp, with the server as
    # root) must not make this truncate another file.
    flags = (os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC | os.O_NOFOLLOW
             | (os.O_CREAT if create else 0))
    try:
        fd = os.open(path, flags, 0o644)
    except FileNotFoundError:
        if create:
            logger.warning("termination message not written: the directory of %s does not exist", path)
        else:  # not in a container that asked for one
            logger.debug("no %s: termination message not written", path)
        return
    except OSError as exc:  # ELOOP for a symlink, ENXIO for a FIFO without a reader, EACCES, ...
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
