"""pidfd syscalls: open a process handle, verify it, signal it (or its process group), test whether it exited.

A pidfd pins one process: once opened, it never refers to a later process that reuses the PID.
So the safe order is *open, then verify the start time*: if the start time read after opening
matches the identity, every later signal through that fd reaches the verified process.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import select
import signal
import threading

from .._errors import AccessDenied, PidReused, ProcessGone, ProcessZombie
from . import _procfs

logger = logging.getLogger(__name__)


@functools.cache
def pidfd_supported() -> bool:
    """Whether ``pidfd_open`` and ``pidfd_send_signal`` work here (probed once, cached)."""
    if not hasattr(os, "pidfd_open") or not hasattr(signal, "pidfd_send_signal"):
        logger.debug("pidfd unsupported by this Python; using procfs checks")
        return False
    try:
        fd = os.pidfd_open(os.getpid())
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            # Out of descriptors right now says nothing about kernel support, and this answer is
            # cached for the life of the process; per-worker opens fall back on their own.
            logger.debug("pidfd probe hit %s; assuming pidfd support", errno.errorcode[exc.errno])
            return True
        logger.debug("pidfd_open unavailable (%s); using procfs checks", exc)
        return False
    try:
        signal.pidfd_send_signal(fd, 0)
    except OSError as exc:
        logger.debug("pidfd_send_signal unavailable (%s); using procfs checks", exc)
        return False
    finally:
        os.close(fd)
    return True


def open_pidfd(pid: int) -> int:
    """Open a pidfd for ``pid``. Raises ``OSError`` as the kernel reports it."""
    return os.pidfd_open(pid, 0)


def is_exited(pidfd: int) -> bool:
    """Whether the process behind ``pidfd`` has exited (it becomes readable then). Never blocks."""
    # poll, not select: select() cannot take descriptors >= FD_SETSIZE (1024), which a monitor of
    # a thousand workers reaches.
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


def verify_start_time(pid: int, start_time: int | None) -> _procfs.StatInfo:
    """Read ``pid``'s stat and check it is alive and, if given, started at ``start_time``.

    Raises :class:`ProcessGone`, :class:`ProcessZombie`, :class:`PidReused` or
    :class:`AccessDenied`; any other ``OSError`` (``EMFILE``...) means "could not tell" and
    propagates unchanged. A malformed ``stat`` (only seen with fake procfs trees) raises ``ValueError``.
    """
    return _procfs.parse_stat(_verified_stat(pid, start_time))


def _verified_stat(pid: int, start_time: int | None) -> bytes:
    """:func:`verify_start_time`'s checks on the raw ``stat``, parsing only the state and the start
    time (the full parse, for the name in an error, only on the way out)."""
    try:
        data = _procfs.read_stat_bytes(pid)
    except (FileNotFoundError, ProcessLookupError):
        raise ProcessGone(pid, start_time) from None
    except PermissionError:
        raise AccessDenied(pid, start_time) from None
    state, observed = _procfs.parse_state_and(data, _procfs.STARTTIME_INDEX)
    if start_time is not None and observed != start_time:
        raise PidReused(pid, start_time, _procfs.parse_stat(data).comm)
    if state in _procfs.EXITED_STATES:
        raise ProcessZombie(pid, start_time, _procfs.parse_stat(data).comm)
    return data


def open_verified_pidfd(pid: int, start_time: int | None) -> int:
    """Open a pidfd for ``pid`` and verify, after opening, that it is the expected process.

    Returns the fd, which the caller owns. Raises :class:`ProcessGone`,
    :class:`ProcessZombie` (the fd is closed: a zombie needs no signal), :class:`PidReused`,
    :class:`AccessDenied`, or ``OSError`` for pidfd failures such as ``EMFILE`` or ``ENOSYS``.
    """
    try:
        fd = open_pidfd(pid)
    except ProcessLookupError:  # ESRCH
        raise ProcessGone(pid, start_time) from None
    try:
        _verified_stat(pid, start_time)
    except BaseException:
        os.close(fd)
        raise
    return fd


def send_signal(pidfd: int, sig: int) -> bool:
    """Send ``sig`` through ``pidfd``. Returns False if the process already exited."""
    try:
        signal.pidfd_send_signal(pidfd, sig)
    except ProcessLookupError:
        return False
    return True


def signal_verified(pid: int, start_time: int | None, sig: int) -> bool:
    """Send ``sig`` to ``pid`` only if it is still the process that started at ``start_time``
    (through a pidfd verified after opening: never a recycled pid). False if it already exited;
    raises as :func:`open_verified_pidfd`."""
    fd = open_verified_pidfd(pid, start_time)
    try:
        return send_signal(fd, sig)
    finally:
        os.close(fd)


# pidfd_send_signal()'s scope flags (linux/pidfd.h, Linux 6.9+): PIDFD_SIGNAL_THREAD = 1,
# PIDFD_SIGNAL_THREAD_GROUP = 2, PIDFD_SIGNAL_PROCESS_GROUP = 4. Python passes ``flags`` through.
PIDFD_SIGNAL_PROCESS_GROUP = 4

_group_signal_lock = threading.Lock()
_group_signal_probe: bool | None = None  # None: not probed yet (or the probe could not tell)


def group_signal_supported() -> bool:
    """Whether ``pidfd_send_signal`` takes ``PIDFD_SIGNAL_PROCESS_GROUP`` here (Linux 6.9+).

    Probed once with signal 0 through a pidfd of this process and cached; never blocks. A kernel
    without the flag rejects it with ``EINVAL`` before looking at the target; one that has it
    answers ``ESRCH`` when this process leads no group (or succeeds when it does: signal 0 is only
    a permission check). Running out of descriptors says nothing about the kernel, so that answer
    (False) is not cached. Thread-safe.
    """
    global _group_signal_probe
    with _group_signal_lock:
        if _group_signal_probe is not None:
            return _group_signal_probe
        if not pidfd_supported():
            _group_signal_probe = False
            return False
        try:
            fd = os.pidfd_open(os.getpid())
        except OSError as exc:
            logger.debug("group-signal probe could not open a pidfd (%s); using killpg this time", exc)
            return False
        try:
            signal.pidfd_send_signal(fd, 0, None, PIDFD_SIGNAL_PROCESS_GROUP)
        except OSError as exc:
            # ESRCH: the flag was accepted, this process just leads no group. EPERM: accepted too.
            supported = exc.errno in (errno.ESRCH, errno.EPERM)
            if not supported:
                logger.debug("pidfd_send_signal has no PIDFD_SIGNAL_PROCESS_GROUP here (%s); "
                             "process groups are signalled with killpg", exc)
            _group_signal_probe = supported
        else:
            _group_signal_probe = True
        finally:
            os.close(fd)
        return _group_signal_probe


def send_group_signal(pidfd: int, sig: int) -> bool:
    """Send ``sig`` to the process group led by the process behind ``pidfd`` (Linux 6.9+).

    The kernel resolves the group from the ``struct pid`` the fd pins, not from a number, so the
    signal reaches exactly the members of that group, also after its leader exited or was reaped
    and even if the leader's pid number was reused since. Returns False when the group has no
    member left (``ESRCH``: also when the process never led a group). Raises ``OSError`` otherwise:
    ``EINVAL`` where the kernel lacks the flag (check :func:`group_signal_supported` first), or
    for a bad signal; ``EBADF`` for an fd that is not a pidfd. Never blocks.
    """
    try:
        signal.pidfd_send_signal(pidfd, sig, None, PIDFD_SIGNAL_PROCESS_GROUP)
    except ProcessLookupError:
        return False
    return True
