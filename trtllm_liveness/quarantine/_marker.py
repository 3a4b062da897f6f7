"""The host's quarantine marker: a wedged worker's record, left where the next start-up reads it.

A worker stuck in ``D`` still holds its GPU and NIC; a new worker group on that host would collide
with it (torchelastic's ``_remaining_restarts = 0``). Kubernetes and Slurm restart a server on the
same host whatever its exit status, so the host itself keeps the verdict in one JSON file,
``quarantine.json``, which the next start-up reads (:func:`inspect_marker`). What it records, and
when it keeps the host quarantined or is cleared: docs/slurm.md and docs/kubernetes.md ("Quarantine
of a wedged node"). A recorded process that still exists keeps the host quarantined in any state,
not only in ``D``: it still holds its devices.

The file is untrusted input: read with ``O_NOFOLLOW`` from a directory that must not be a symlink,
must belong to root or this user and must not be writable by others; at most 64 KiB; every field
type-checked; pids 0, 1 and this process's own are malformed. Nothing here sends a signal: the
verdict only decides whether this process may start. Writes are atomic (a temporary file in the
same directory, fsynced, renamed) and readable by every user of the host (0644, directory 0755).
"""

from __future__ import annotations

import contextlib
import enum
import errno
import fcntl
import json
import logging
import os
import socket
import stat
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from .._record_fields import JsonRecord
from ..process import _procfs

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_QUARANTINE_DIR",
    "MARKER_NAME",
    "QUARANTINE_DIR_VAR",
    "MarkerError",
    "MarkerStatus",
    "MarkerVerdict",
    "ProcessVerdict",
    "QuarantineMarker",
    "QuarantinedProcess",
    "RecordedProcessCheck",
    "clear_marker",
    "inspect_marker",
    "read_marker",
    "resolve_directory",
    "write_marker",
]

DEFAULT_QUARANTINE_DIR = "/run/trtllm-liveness"
"""Default marker directory: ``/run`` is a tmpfs on current distributions, emptied at every boot."""

QUARANTINE_DIR_VAR = "TRTLLM_LIVENESS_QUARANTINE_DIR"
"""Environment variable that replaces the default directory (not a ``quarantine_dir`` set explicitly)."""

MARKER_NAME = "quarantine.json"
MARKER_VERSION = 1
MAX_MARKER_BYTES = 64 << 10
MAX_PROCESSES = 4096
_MAX_PID = (1 << 22) - 1
_MAX_TEXT = 4096


class MarkerError(ValueError):
    """The marker file or its directory cannot be trusted or parsed; the message names the path."""


@dataclass(frozen=True)
class QuarantinedProcess(JsonRecord):
    """One stuck process as the marker records it."""

    pid: int
    start_time: int
    pid_namespace: int
    rank: int | None
    state: str
    wchan: str
    kind: str
    cause: str

    def describe(self) -> str:
        """``pid P (rank R, state D, wchan W)`` for messages."""
        rank = "" if self.rank is None else f"rank {self.rank}, "
        return f"pid {self.pid} ({rank}state {self.state or '?'}, wchan {self.wchan or '?'})"


@dataclass(frozen=True)
class QuarantineMarker:
    """What a non-restartable failure left on the host. ``wall_time`` is ``time.time()``."""

    boot_id: str
    hostname: str
    pid_namespace: int
    writer_pid: int
    wall_time: float
    reason: str
    processes: tuple[QuarantinedProcess, ...]

    def to_dict(self) -> dict[str, Any]:
        """The JSON document (also what ``quarantine status --json`` prints)."""
        return {
            "version": MARKER_VERSION,
            "boot_id": self.boot_id,
            "hostname": self.hostname,
            "pid_namespace": self.pid_namespace,
            "writer_pid": self.writer_pid,
            "wall_time": self.wall_time,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.wall_time)),
            "reason": self.reason,
            "processes": [process.to_dict() for process in self.processes],
        }


class ProcessVerdict(str, enum.Enum):
    """What became of one recorded process, seen from this process."""

    GONE = "gone"  # no such pid, or a zombie with no thread left in D
    PID_REUSED = "pid-reused"  # the pid belongs to a process of another start time
    WEDGED = "wedged"  # still exists, a thread in D
    UNKILLABLE = "unkillable"  # SIGKILL pending, whatever its state (D, R in the kernel, other)
    ALIVE = "alive"  # still exists, not in D: still holds its devices
    UNVERIFIABLE = "unverifiable"  # another PID namespace, or /proc denied

    @property
    def blocks(self) -> bool:
        """Whether the host stays quarantined because of this process."""
        return self not in (ProcessVerdict.GONE, ProcessVerdict.PID_REUSED)


@dataclass(frozen=True)
class RecordedProcessCheck:
    """One recorded process and its verdict now; ``state``/``wchan`` as read now (if it exists)."""

    process: QuarantinedProcess
    verdict: ProcessVerdict
    state: str
    wchan: str
    kernel_stack: tuple[str, ...] = ()  # where readable (root), for a process SIGKILL does not end

    def describe(self) -> str:
        """One phrase for messages."""
        if self.verdict is ProcessVerdict.UNVERIFIABLE:
            return f"{self.process.describe()}: cannot be verified from here (recorded in PID namespace " \
                   f"{self.process.pid_namespace}, this is {_procfs.own_pid_namespace()})"
        if self.verdict.blocks:
            stack = f", kernel stack {' < '.join(self.kernel_stack[:6])}" if self.kernel_stack else ""
            return f"pid {self.process.pid} is still {self.verdict.value} (state {self.state or '?'}, " \
                   f"wchan {self.wchan or '?'}{stack})"
        return f"pid {self.process.pid}: {self.verdict.value}"


class MarkerVerdict(str, enum.Enum):
    """The marker's meaning for a start-up on this host now."""

    NONE = "none"  # no marker
    STALE_BOOT = "stale-boot"  # written before the last boot: the host was recycled
    GONE = "gone"  # every recorded process verifiably gone
    QUARANTINED = "quarantined"  # a recorded process still exists or cannot be verified
    MALFORMED = "malformed"  # unreadable or invalid in a trusted directory: quarantined (fail closed)
    UNTRUSTED = "untrusted"  # the directory is not safe (symlink, owner, writable by others): ignored


@dataclass(frozen=True)
class MarkerStatus:
    """The result of :func:`inspect_marker`."""

    directory: str
    path: str
    verdict: MarkerVerdict
    marker: QuarantineMarker | None
    checks: tuple[RecordedProcessCheck, ...]
    error: str = ""

    @property
    def quarantined(self) -> bool:
        """Whether a start-up on this host must refuse (the marker still applies)."""
        return self.verdict in (MarkerVerdict.QUARANTINED, MarkerVerdict.MALFORMED)

    @property
    def clearable(self) -> bool:
        """Whether the marker may be removed: it exists and no longer applies."""
        return self.verdict in (MarkerVerdict.STALE_BOOT, MarkerVerdict.GONE)

    @property
    def blocking(self) -> tuple[RecordedProcessCheck, ...]:
        """The recorded processes that keep the host quarantined."""
        return tuple(check for check in self.checks if check.verdict.blocks)

    def describe(self) -> str:
        """One line for logs, errors and the CLI."""
        if self.verdict is MarkerVerdict.NONE:
            return f"no quarantine marker in {self.directory}"
        if self.verdict in (MarkerVerdict.MALFORMED, MarkerVerdict.UNTRUSTED):
            return f"quarantine marker {self.path} {self.verdict.value}: {self.error}"
        assert self.marker is not None
        when = time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(self.marker.wall_time))
        if self.verdict is MarkerVerdict.STALE_BOOT:
            return f"quarantine marker {self.path} of {when} is from another boot (the host was recycled)"
        if self.verdict is MarkerVerdict.GONE:
            return f"quarantine marker {self.path} of {when}: every recorded process is gone"
        return (f"host quarantined by {self.path} since {when} ({self.marker.reason}): "
                + "; ".join(check.describe() for check in self.blocking))


# ----------------------------------------------------------------------------- directory


def resolve_directory(configured: str) -> str:
    """The marker directory for the setting ``configured`` ("" = off, returned as is).

    The default, :data:`DEFAULT_QUARANTINE_DIR`, is replaced by ``$TRTLLM_LIVENESS_QUARANTINE_DIR``
    where that names an absolute path (one setting for the servers and the node's health check;
    the test suite points it at its own directory). It needs root to create; other users get
    ``$XDG_RUNTIME_DIR/trtllm-liveness`` (also under ``/run``, also emptied at boot), else
    ``/tmp/trtllm-liveness-<uid>``. Any other value is used as given. Never blocks beyond a stat.
    """
    if configured != DEFAULT_QUARANTINE_DIR:
        return configured
    override = os.environ.get(QUARANTINE_DIR_VAR, "")
    if override.startswith("/"):
        return override
    if os.geteuid() == 0:
        return configured
    parent = os.path.dirname(DEFAULT_QUARANTINE_DIR)
    if os.path.isdir(configured) and os.access(configured, os.W_OK | os.X_OK):
        return configured
    if not os.path.isdir(configured) and os.access(parent, os.W_OK | os.X_OK):
        return configured
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if runtime.startswith("/") and os.path.isdir(runtime):
        return os.path.join(runtime, "trtllm-liveness")
    return f"/tmp/trtllm-liveness-{os.geteuid()}"


def user_marker_directories() -> list[tuple[str, int]]:
    """Every user's fallback marker directory on this host with the uid that must own it
    (``/run/user/<uid>/trtllm-liveness``, ``/tmp/trtllm-liveness-<uid>``): where a server that runs
    as a non-root user (a Slurm job) records a wedge. Root's ``quarantine status`` (the node's
    health check) reads them too. A few stats; never raises."""
    found: list[tuple[str, int]] = []
    with contextlib.suppress(OSError):
        for name in os.listdir("/run/user"):
            if name.isdigit():
                found.append((f"/run/user/{name}/trtllm-liveness", int(name)))
    prefix = "trtllm-liveness-"
    with contextlib.suppress(OSError):
        for name in os.listdir("/tmp"):
            if name.startswith(prefix) and name[len(prefix):].isdigit():
                found.append((f"/tmp/{name}", int(name[len(prefix):])))
    return [(directory, uid) for directory, uid in found if os.path.isdir(directory)]


def _open_directory(directory: str, *, create: bool, owner: int | None = None) -> int:
    """An ``O_DIRECTORY`` fd of ``directory``, checked: not a symlink, owned by root or this user
    (or by ``owner``: another user's fallback directory, read by root), not writable by group or
    others (unless sticky: /tmp-like). Raises :class:`MarkerError`, or ``FileNotFoundError`` when
    it does not exist and ``create`` is False."""
    if create:
        with contextlib.suppress(FileExistsError):
            os.makedirs(directory, mode=0o755)
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise MarkerError(f"{directory} is a symlink or not a directory: not trusted") from None
        raise MarkerError(f"cannot open {directory}: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if info.st_uid not in (0, os.geteuid(), owner):
            raise MarkerError(f"{directory} belongs to uid {info.st_uid}, neither root nor this user: not trusted")
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
            raise MarkerError(f"{directory} is writable by other users (mode {stat.S_IMODE(info.st_mode):o}): "
                              "not trusted")
    except BaseException:
        os.close(fd)
        raise
    return fd


# ----------------------------------------------------------------------------- write


_LOCK_WAIT_S = 2.0


@contextlib.contextmanager
def _locked_directory(directory: str, *, create: bool) -> Iterator[int]:
    """An fd of ``directory`` (checked and, with ``create``, made: :func:`_open_directory`), with an
    ``flock`` on it while the block runs: read-merge-rename and judge-then-unlink of concurrent
    writers (two engines of one host, a start-up clearing while another writes) do not lose
    records. A bounded wait: past it the operation goes on unlocked, with a WARNING (a holder is a
    few file operations long; only a stuck one makes it wait)."""
    fd = _open_directory(directory, create=create)
    deadline = time.monotonic() + _LOCK_WAIT_S
    locked = False
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    logger.warning("liveness: the quarantine directory %s stayed locked for %.0f s; going on "
                                   "unlocked", directory, _LOCK_WAIT_S)
                    break
                time.sleep(0.01)
            except OSError:  # a file system without flock
                break
        yield fd
    finally:
        if locked:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def write_marker(directory: str, processes: Iterable[QuarantinedProcess], reason: str) -> str:
    """Record ``processes`` in ``directory``'s marker (created 0755 if missing), merged with a
    marker of this boot already there; returns the marker's path.

    Atomic: a temporary file in the directory, fsynced, then renamed over the marker (a reader
    sees the old marker or the new one, never half of one). Blocks for those few local file
    operations (the directory should be a tmpfs: ``/run``). Raises :class:`MarkerError` for an
    untrusted directory, ``OSError`` for a failed write. Concurrent writers (other processes)
    are serialized by a lock on the directory (:func:`_locked_directory`), so none loses another's
    records.
    """
    with _locked_directory(directory, create=True) as fd:
        return _write_marker_locked(fd, directory, processes, reason)


def _write_marker_locked(fd: int, directory: str, processes: Iterable[QuarantinedProcess], reason: str) -> str:
    merged = {(process.pid, process.start_time, process.pid_namespace): process for process in processes}
    reasons = [reason]
    with contextlib.suppress(MarkerError, FileNotFoundError, OSError):
        old = _read_marker_at(fd, directory)
        if old.boot_id == _procfs.boot_id():
            for process in old.processes:
                merged.setdefault((process.pid, process.start_time, process.pid_namespace), process)
            if old.reason and old.reason != reason:
                reasons.insert(0, old.reason)
    marker = QuarantineMarker(
        boot_id=_procfs.boot_id(), hostname=socket.gethostname(), pid_namespace=_procfs.own_pid_namespace(),
        writer_pid=os.getpid(), wall_time=time.time(), reason=" | ".join(reasons)[:_MAX_TEXT],
        processes=tuple(merged.values())[:MAX_PROCESSES])
    data = json.dumps(marker.to_dict(), indent=1).encode()
    name = f".{MARKER_NAME}.{os.getpid()}.{os.urandom(4).hex()}"
    tmp = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=fd)
    try:
        os.fchmod(tmp, 0o644)  # readable by every user of the host, whatever the umask
        view = memoryview(data)
        while view:
            view = view[os.write(tmp, view):]
        os.fsync(tmp)
    except BaseException:
        os.close(tmp)
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=fd)
        raise
    os.close(tmp)
    os.rename(name, MARKER_NAME, src_dir_fd=fd, dst_dir_fd=fd)
    with contextlib.suppress(OSError):
        os.fsync(fd)
    return os.path.join(directory, MARKER_NAME)


# ----------------------------------------------------------------------------- read


def read_marker(directory: str) -> QuarantineMarker | None:
    """The marker of ``directory``, or None when there is none (or no such directory).

    Raises :class:`MarkerError` (naming the path and the problem) for an untrusted directory, a
    marker that is not a regular file (a symlink, a FIFO), larger than 64 KiB, not JSON, or with a
    field of the wrong type or range. Never blocks on a FIFO (``O_NONBLOCK``).
    """
    try:  # FileNotFoundError: no such directory, or no marker in it
        fd = _open_directory(directory, create=False)
        try:
            return _read_marker_at(fd, directory)
        finally:
            os.close(fd)
    except FileNotFoundError:
        return None


def _read_marker_at(dir_fd: int, directory: str, owner: int | None = None) -> QuarantineMarker:
    path = os.path.join(directory, MARKER_NAME)
    try:
        fd = os.open(MARKER_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise MarkerError(f"{path} is a symlink: not trusted") from None
        raise MarkerError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise MarkerError(f"{path} is not a regular file")
        if info.st_uid not in (0, os.geteuid(), owner):
            raise MarkerError(f"{path} belongs to uid {info.st_uid}, neither root nor this user: not trusted")
        data = os.read(fd, MAX_MARKER_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_MARKER_BYTES:
        raise MarkerError(f"{path} is larger than {MAX_MARKER_BYTES} bytes")
    try:
        document = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise MarkerError(f"{path} is not JSON: {exc}") from None
    try:
        return parse_marker(document)
    except MarkerError as exc:
        raise MarkerError(f"{path}: {exc}") from None


def parse_marker(document: Any) -> QuarantineMarker:
    """Validate an untrusted marker document. Raises :class:`MarkerError` naming the field."""
    if not isinstance(document, dict):
        raise MarkerError(f"expected a JSON object, got {type(document).__name__}")
    if document.get("version") != MARKER_VERSION:
        raise MarkerError(f"unknown version {document.get('version')!r} (expected {MARKER_VERSION})")
    processes = document.get("processes")
    if not isinstance(processes, list) or not processes or len(processes) > MAX_PROCESSES:
        raise MarkerError(f"processes must be a list of 1 to {MAX_PROCESSES} entries")
    return QuarantineMarker(
        boot_id=_text(document, "boot_id"), hostname=_text(document, "hostname"),
        pid_namespace=_int(document, "pid_namespace", 0, (1 << 64) - 1),
        writer_pid=_int(document, "writer_pid", 0, _MAX_PID),
        wall_time=_number(document, "wall_time"), reason=_text(document, "reason"),
        processes=tuple(_parse_process(item, index) for index, item in enumerate(processes)))


def _parse_process(item: Any, index: int) -> QuarantinedProcess:
    if not isinstance(item, dict):
        raise MarkerError(f"processes[{index}] must be an object")
    where = f"processes[{index}]."
    pid = _int(item, "pid", 2, _MAX_PID, where)
    rank = item.get("rank")
    if rank is not None:
        rank = _int(item, "rank", 0, 1 << 24, where)
    return QuarantinedProcess(
        pid=pid, start_time=_int(item, "start_time", 0, 1 << 62, where),
        pid_namespace=_int(item, "pid_namespace", 1, (1 << 64) - 1, where), rank=rank,
        state=_text(item, "state", where)[:8], wchan=_text(item, "wchan", where), kind=_text(item, "kind", where),
        cause=_text(item, "cause", where))


def _int(document: dict[str, Any], key: str, low: int, high: int, where: str = "") -> int:
    value = document.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise MarkerError(f"{where}{key} must be an integer in [{low}, {high}], got {value!r}"[:300])
    return value


def _number(document: dict[str, Any], key: str) -> float:
    value = document.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1e12:
        raise MarkerError(f"{key} must be a time in seconds, got {value!r}"[:300])
    return float(value)


def _text(document: dict[str, Any], key: str, where: str = "") -> str:
    value = document.get(key, "")
    if not isinstance(value, str) or len(value) > _MAX_TEXT:
        raise MarkerError(f"{where}{key} must be a string of at most {_MAX_TEXT} characters")
    return "".join(char if char.isprintable() else "?" for char in value)


# ----------------------------------------------------------------------------- verify


def check_process(process: QuarantinedProcess) -> RecordedProcessCheck:
    """Whether ``process`` still exists here, verified by its start time in this PID namespace.

    Reads ``/proc/<pid>/stat``, its threads' ``stat``, ``status`` and ``wchan`` (none of which
    waits for a lock a process in ``D`` may hold). Never signals. Never raises for procfs errors:
    a denied read is UNVERIFIABLE.
    """
    if process.pid_namespace != _procfs.own_pid_namespace():
        return RecordedProcessCheck(process, ProcessVerdict.UNVERIFIABLE, "", "")
    if process.pid == os.getpid():
        # The same pid as this very process: the recorded one is gone (or this is a forgery).
        return RecordedProcessCheck(process, ProcessVerdict.PID_REUSED, "", "")
    try:
        info = _procfs.read_stat(process.pid)
        if info.start_time != process.start_time:
            return RecordedProcessCheck(process, ProcessVerdict.PID_REUSED, info.state, "")
        states = _procfs.read_thread_states(process.pid)
        d_tids = _procfs.uninterruptible_tids(states)
        if info.exited and not d_tids:
            return RecordedProcessCheck(process, ProcessVerdict.GONE, info.state, "")
        # Unkillable in any state: a recorded process (it outlived the stop's kill grace) that still
        # has SIGKILL pending, asleep in D or running in the kernel in R (a driver spin loop), unless
        # it is exiting (PF_EXITING): then the pending SIGKILL is its normal exit's.
        if _procfs.sigkill_stuck(process.pid, info, d_tids):
            from ..stop._survivor import sample_survivor  # the state, wait channel and kernel stack

            sample = sample_survivor(process.pid)
            state = "D" if d_tids else sample.state or info.state
            return RecordedProcessCheck(process, ProcessVerdict.UNKILLABLE, state, sample.d_wchan or sample.wchan,
                                        sample.kernel_stack)
        if not d_tids:
            return RecordedProcessCheck(process, ProcessVerdict.ALIVE, info.state, _procfs.read_wchan(process.pid))
        return RecordedProcessCheck(process, ProcessVerdict.WEDGED, "D", _procfs.read_wchan(process.pid, d_tids[0]))
    except (FileNotFoundError, ProcessLookupError):
        return RecordedProcessCheck(process, ProcessVerdict.GONE, "", "")
    except (OSError, ValueError):  # EACCES (hidepid), a malformed stat: cannot tell
        return RecordedProcessCheck(process, ProcessVerdict.UNVERIFIABLE, "", "")


def inspect_marker(directory: str, *, owner: int | None = None) -> MarkerStatus:
    """Read and judge ``directory``'s marker for a start-up now (see the module docstring).
    ``owner``: also trust a directory and marker of that uid (another user's fallback directory).

    Never raises for a bad marker (the verdict says MALFORMED or UNTRUSTED, with the error) and
    never modifies anything; :func:`clear_marker` removes a marker that no longer applies.
    """
    path = os.path.join(directory, MARKER_NAME)
    try:
        fd = _open_directory(directory, create=False, owner=owner)
    except FileNotFoundError:
        return MarkerStatus(directory, path, MarkerVerdict.NONE, None, ())
    except MarkerError as exc:
        return MarkerStatus(directory, path, MarkerVerdict.UNTRUSTED, None, (), str(exc))
    try:
        marker = _read_marker_at(fd, directory, owner)
    except FileNotFoundError:
        return MarkerStatus(directory, path, MarkerVerdict.NONE, None, ())
    except MarkerError as exc:
        return MarkerStatus(directory, path, MarkerVerdict.MALFORMED, None, (), str(exc))
    finally:
        os.close(fd)
    boot = _procfs.boot_id()
    if marker.boot_id and boot and marker.boot_id != boot:
        return MarkerStatus(directory, path, MarkerVerdict.STALE_BOOT, marker, ())
    checks = tuple(check_process(process) for process in marker.processes)
    verdict = MarkerVerdict.QUARANTINED if any(check.verdict.blocks for check in checks) else MarkerVerdict.GONE
    return MarkerStatus(directory, path, verdict, marker, checks)


def clear_marker(directory: str, *, expected: QuarantineMarker | None = None) -> bool:
    """Remove ``directory``'s marker; True if one was removed.

    With ``expected``, only while the file still holds that marker (a marker rewritten since it
    was judged is kept). Raises :class:`MarkerError` for an untrusted directory.
    """
    try:
        with _locked_directory(directory, create=False) as fd:
            if expected is not None:
                try:
                    if _read_marker_at(fd, directory) != expected:
                        return False
                except (FileNotFoundError, MarkerError):
                    return False
            os.unlink(MARKER_NAME, dir_fd=fd)
            return True
    except FileNotFoundError:  # no such directory, or no marker in it
        return False
