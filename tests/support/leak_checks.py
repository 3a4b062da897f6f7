"""What a test session leaves behind, found and reported: the session then fails.

:data:`LEAKED` collects every leak the fixtures and trackers find (a process that outlived its test,
a cgroup or FUSE mount that could not be removed, a helper's temporary directory); the session
hooks of ``tests/conftest.py`` print it and fail the run. :class:`TempLeakCheck` gives the session a
temporary directory of its own (``TMPDIR``) and finds the ``trtllm-*`` entries left in it.
:class:`MachineDirectoryCheck` finds a change to the machine's quarantine marker directory
(``/run/trtllm-liveness``), which no test may read or write.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator

from trtllm_liveness.demo._fuse_stall import MOUNT_PREFIX, fuse_mounts
from trtllm_liveness.demo._mpi_env import PRTE_TMPDIR_PREFIX

# One line per leak found; the session fails when it is not empty.
LEAKED: list[str] = []

# Temporary entries this project's code and tests make: tempfile.mkdtemp(prefix="trtllm-...").
TEMP_PREFIX = "trtllm-"
SESSION_TMP_PREFIX = "trtllm-tests-"


class TempLeakCheck:
    """Gives the session a temp directory of its own and finds the ``trtllm-*`` entries left in it.

    Other test sessions, benchmarks and demos on the same machine make and remove such entries in
    the shared temp directory too, so a before/after comparison there cannot tell whose an entry
    is, and removing one could break a live run. So the session exports ``TMPDIR`` (and sets
    ``tempfile.tempdir``) to ``<tmp>/trtllm-tests-<pid>-*``, which every process it starts inherits:
    what is left there at the end is this session's leak, reported and removed with the directory.
    New ``trtllm-*`` entries in the shared directory (a creator that ignores ``TMPDIR``) are listed
    as a warning. Session directories of sessions that died are removed at the next start.
    """

    def __init__(self) -> None:
        self.shared = tempfile.gettempdir()
        self.shared_before = self._entries(self.shared)
        self._remove_dead_sessions()
        self.path = tempfile.mkdtemp(prefix=f"{SESSION_TMP_PREFIX}{os.getpid()}-", dir=self.shared)
        os.environ["TMPDIR"] = self.path
        tempfile.tempdir = self.path

    @staticmethod
    def _entries(directory: str) -> set[str]:
        try:
            return {name for name in os.listdir(directory) if name.startswith(TEMP_PREFIX)}
        except OSError:
            return set()

    def _remove_dead_sessions(self) -> None:
        mounts = fuse_mounts()
        for name in self._entries(self.shared):
            owner = name[len(SESSION_TMP_PREFIX):].split("-", 1)[0] if name.startswith(SESSION_TMP_PREFIX) else ""
            path = os.path.join(self.shared, name)
            if not owner.isdigit() or os.path.exists(f"/proc/{owner}"):
                continue
            if any(mount.startswith(path + os.sep) for mount in mounts):
                continue  # a FUSE stall may still be served inside: never walk into it
            shutil.rmtree(path, ignore_errors=True)

    def finish(self) -> tuple[list[str], list[str]]:
        """(leaked entries of this session, now removed; new entries in the shared temp dir)."""
        leaked = []
        for name in sorted(self._entries(self.path)):
            if name.startswith(f"{PRTE_TMPDIR_PREFIX}{os.getpid()}-"):
                continue  # this process's own PRRTE base: removed by its atexit handler
            path = os.path.join(self.path, name)
            leaked.append(path)
            if name.startswith(MOUNT_PREFIX):
                continue  # never stat or walk a FUSE mountpoint: remove_leftover_mounts() owns those
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        shared_new = sorted(os.path.join(self.shared, name) for name in self._entries(self.shared) - self.shared_before
                            if not name.startswith(SESSION_TMP_PREFIX))
        return leaked, shared_new

    def remove(self) -> None:
        """Remove the session directory (at exit: after this process's own PRRTE base is gone)."""
        if any(mount.startswith(self.path + os.sep) for mount in fuse_mounts()):
            return
        shutil.rmtree(self.path, ignore_errors=True)


@contextlib.contextmanager
def tempdir_as(directory: str) -> Iterator[None]:
    """``tempfile.gettempdir()`` is ``directory`` inside the block."""
    previous = tempfile.tempdir
    tempfile.tempdir = directory
    try:
        yield
    finally:
        tempfile.tempdir = previous


# One directory entry as lstat sees it: (name, inode, mode, size, mtime ns, ctime ns).
_Entry = tuple[str, int, int, int, int, int]
# A directory's state: None when it does not exist, else (its own entry, its entries sorted).
DirectoryState = tuple[_Entry, tuple[_Entry, ...]] | None


def directory_state(path: str) -> DirectoryState:
    """``path``'s state from ``lstat`` alone (never a file opened, never a symlink followed): None
    when it does not exist, else its own inode, mode, times and those of each entry. A change to
    the directory or to any entry (created, removed, rewritten, renamed over) changes it."""
    def entry(name: str, info: os.stat_result) -> _Entry:
        return (name, info.st_ino, info.st_mode, info.st_size, info.st_mtime_ns, info.st_ctime_ns)

    try:
        own = os.lstat(path)
    except FileNotFoundError:
        return None
    entries: list[_Entry] = []
    if stat.S_ISDIR(own.st_mode):
        with contextlib.suppress(OSError):
            for name in sorted(os.listdir(path)):
                with contextlib.suppress(OSError):
                    entries.append(entry(name, os.lstat(os.path.join(path, name))))
    return entry(path, own), tuple(entries)


class MachineDirectoryCheck:
    """The machine's own quarantine marker directory, ``path``, must be as it was: the session points
    every default at a directory of its own (``TRTLLM_LIVENESS_QUARANTINE_DIR``; each test host has
    its own ``/run``), so a change there means a test (or what it started) used the machine's
    directory, where a real marker of another program would have refused its engines, and where
    its own marker would refuse the machine's. :meth:`changed` says what changed since the
    snapshot (nothing is removed or repaired: the directory is not the session's to touch).
    Another program on the machine writing there at the same time would also be reported."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.before = directory_state(path)

    def changed(self, since: DirectoryState | None = None) -> str:
        """"" if ``path`` is as it was at the snapshot (or as ``since``), else what changed."""
        before = self.before if since is None else since
        after = directory_state(self.path)
        if after == before:
            return ""
        if before is None:
            assert after is not None
            return f"{self.path} was created (now holding {[item[0] for item in after[1]]})"
        if after is None:
            return f"{self.path} was removed"
        old = {item[0]: item for item in before[1]}
        new = {item[0]: item for item in after[1]}
        parts = [f"{label} {names}" for label, names in (
            ("new", sorted(set(new) - set(old))), ("gone", sorted(set(old) - set(new))),
            ("rewritten", sorted(name for name in set(old) & set(new) if old[name] != new[name]))) if names]
        detail = "; ".join(parts) or "the directory itself (mode, owner or times)"
        return f"{self.path} changed: {detail}"
