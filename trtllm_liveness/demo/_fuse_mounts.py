"""FUSE mounts of :class:`~._fuse_stall.FuseStall`: mount and unmount, whether one can be made
here, and the clean-up of mounts that a dead owner left behind.

Each mount is a ``fuse.trtllm-liveness`` file system (:data:`FUSE_FSTYPE`) at
``<tmp>/<MOUNT_PREFIX>-<owner pid>-<random>``, so ``/proc/self/mounts`` tells ours apart and a
leftover's owner is known by name. Unmounting forces the connection's abort (which releases every
stuck caller) and detaches the mount even while busy. Nothing here ever calls ``stat`` on a path inside
a mount: that could hang the caller.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import logging
import os
import re
import sys
import tempfile

__all__ = ["DEV_FUSE", "FUSE_FSTYPE", "FUSE_SOURCE", "MOUNT_PREFIX", "fuse_available", "fuse_mounts", "mount_fuse",
           "remove_leftover_mounts", "umount_fuse"]

logger = logging.getLogger(__name__)

DEV_FUSE = "/dev/fuse"
FUSE_SOURCE = "trtllm-liveness"
# "fuse.<subtype>": the kernel's fuse file system with a subtype, so /proc/mounts tells ours apart.
FUSE_FSTYPE = "fuse.trtllm-liveness"
# Mountpoints are <tmp>/<MOUNT_PREFIX>-<owner pid>-<random>: leftovers of a dead owner are found by name.
MOUNT_PREFIX = "trtllm-liveness-fuse"

_MS_NOSUID = 2
_MS_NODEV = 4
_MNT_FORCE = 1  # runs fuse_umount_begin(), which aborts the connection
_MNT_DETACH = 2  # lazy: detach now even while busy


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    libc.mount.restype = ctypes.c_int
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    libc.umount2.restype = ctypes.c_int
    return libc


def mount_fuse(fd: int, mountpoint: str) -> int:
    """Mount a fuse file system served on ``fd`` at ``mountpoint``; 0 or the errno.

    ``rootmode=40000`` makes the root a directory; ``user_id``/``group_id`` name the only user the
    kernel lets in without ``allow_other`` (the owner, root here).
    """
    options = f"fd={fd},rootmode=40000,user_id={os.geteuid()},group_id={os.getegid()}"
    libc = _libc()
    if libc.mount(FUSE_SOURCE.encode(), os.fsencode(mountpoint), FUSE_FSTYPE.encode(),
                  _MS_NOSUID | _MS_NODEV, options.encode()) == 0:
        return 0
    return ctypes.get_errno() or errno.EIO


def umount_fuse(mountpoint: str) -> None:
    """Abort the connection (``MNT_FORCE``) and detach the mount (``MNT_DETACH``). Never raises.

    Forcing matters: it releases every stuck caller even when a forked copy of the ``/dev/fuse``
    descriptor keeps the connection open; detaching succeeds while the mount is still busy.
    """
    libc = _libc()
    path = os.fsencode(mountpoint)
    for flags in (_MNT_FORCE | _MNT_DETACH, _MNT_DETACH):
        if libc.umount2(path, flags) == 0:
            return
        code = ctypes.get_errno()
        if code == errno.EINVAL:  # not a mount point (any more)
            return
        logger.debug("umount2(%s, %#x) failed: %s", mountpoint, flags, os.strerror(code))


def _unescape_mount_field(field: str) -> str:
    """Undo the octal escapes (``\\040`` for a space) that /proc/self/mounts uses in paths."""
    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), field)


def fuse_mounts() -> list[str]:
    """Mountpoints of every file system of type :data:`FUSE_FSTYPE` in this mount namespace."""
    found = []
    try:
        with open("/proc/self/mounts") as handle:
            for line in handle:
                fields = line.split()
                if len(fields) >= 3 and fields[2] == FUSE_FSTYPE:
                    found.append(_unescape_mount_field(fields[1]))
    except OSError as exc:
        logger.debug("cannot read /proc/self/mounts: %s", exc)
    return found


def fuse_available() -> str | None:
    """None if a :class:`FuseStall` can be made here, else the reason it cannot.

    Cheap: checks ``/dev/fuse`` and the kernel's file system list, then mounts and unmounts a trial
    file system (never left behind; no process is started).
    """
    if not sys.platform.startswith("linux"):
        return "FUSE stalls need Linux"
    if not sys.executable:
        return "sys.executable is unknown (needed to start the priming child)"
    if not os.path.exists(DEV_FUSE):
        return f"{DEV_FUSE} does not exist (no fuse module, or not exposed to this container)"
    try:
        with open("/proc/filesystems") as handle:
            if "fuse" not in handle.read().split():
                return "the kernel has no fuse file system (/proc/filesystems)"
    except OSError as exc:
        return f"cannot read /proc/filesystems: {exc.strerror}"
    try:
        fd = os.open(DEV_FUSE, os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        return f"cannot open {DEV_FUSE}: {exc.strerror} (needs root)"
    mountpoint = ""
    code = -1
    try:
        mountpoint = tempfile.mkdtemp(prefix=f"{MOUNT_PREFIX}-{os.getpid()}-")
        code = mount_fuse(fd, mountpoint)
    except OSError as exc:
        return f"cannot make a mountpoint: {exc.strerror}"
    finally:
        os.close(fd)  # nobody answers INIT: closing aborts the connection
        if code == 0:
            umount_fuse(mountpoint)
        if mountpoint:
            with contextlib.suppress(OSError):
                os.rmdir(mountpoint)
    if code == errno.EPERM:
        return "mount(2) of a fuse file system failed: EPERM (needs root / CAP_SYS_ADMIN)"
    if code:
        return f"mount(2) of a fuse file system failed: {errno.errorcode.get(code, code)} ({os.strerror(code)})"
    return None


def _owner_alive(name: str) -> bool:
    owner = name[len(MOUNT_PREFIX) + 1:].split("-", 1)[0]
    if not owner.isdigit():
        return True  # not one of ours: leave it
    return os.path.exists(f"/proc/{owner}")


def remove_leftover_mounts() -> list[str]:
    """Unmount and remove the mountpoints that dead owners left behind; returns their paths.

    An owner that died (even by SIGKILL) closed its ``/dev/fuse`` descriptor, which released its
    stuck callers; its mount stays, answering ``ENOTCONN``. Only mounts and empty directories named
    after a pid that no longer runs are touched, so a live owner's stall is safe. A reused pid
    merely leaves a leftover in place. Never raises.
    """
    removed = []
    tmp = tempfile.gettempdir()
    for mountpoint in fuse_mounts():
        name = os.path.basename(mountpoint)
        if name.startswith(MOUNT_PREFIX + "-") and not _owner_alive(name):
            umount_fuse(mountpoint)
            removed.append(mountpoint)
    try:
        names = os.listdir(tmp)
    except OSError:
        names = []
    mounted = set(fuse_mounts())
    for name in names:
        path = os.path.join(tmp, name)
        # rmdir only: never stat a path that may be a live mount (that could hang the caller).
        if name.startswith(MOUNT_PREFIX + "-") and path not in mounted and not _owner_alive(name):
            try:
                os.rmdir(path)
            except OSError:
                continue
            if path not in removed:
                removed.append(path)
    return removed
