"""Process identity: who a worker is, in a form that survives PID reuse and crosses IPC.

An identity is ``(rank, pid, start_time, hostname, pid_namespace)``, field for field the tuple
upstream TensorRT-LLM's ``WorkerProcessIdentity`` carries, so ``ProcessIdentity(*upstream)``
converts one. ``start_time`` (clock ticks since boot) tells a recycled PID apart; hostname and
the PID-namespace inode tell whether the PID means anything in the observer's ``/proc``.
Upstream sends ``None`` for ``start_time`` or ``pid_namespace`` when a worker's /proc read failed;
such identities are accepted, watched (a pidfd pins the process found), and never signalled.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
from collections.abc import Iterable
from typing import Any, NamedTuple

from .._errors import AccessDenied, InvalidIdentityError, ProcessGone
from . import _procfs

logger = logging.getLogger(__name__)

# Bounds for untrusted payloads. A job has at most a few thousand ranks per proxy; anything
# larger is a bug or an attack, and parsing it would be the first step of a resource blow-up.
MAX_IDENTITIES = 65536
MAX_HOSTNAME_LEN = 253
_MAX_PID = (1 << 22) - 1  # PID_MAX_LIMIT on 64-bit Linux is 2**22; pids stay below it
_MAX_RANK = 1 << 24


class ProcessIdentity(NamedTuple):
    """Who one worker rank is: rank, pid, start time (clock ticks), hostname, PID namespace inode."""

    rank: int
    pid: int
    start_time: int | None
    hostname: str
    pid_namespace: int | None

    def describe(self) -> str:
        """Human-readable ``rank R (pid P) on host H`` for log lines and errors."""
        return f"rank {self.rank} (pid {self.pid}) on host {self.hostname}"


@functools.cache
def local_hostname() -> str:
    """This machine's hostname, as workers report it."""
    return socket.gethostname()


@functools.cache
def local_pid_namespace() -> int:
    """Inode of this process's PID namespace (cached: a process cannot change its own)."""
    return _procfs.pid_namespace_inode("self")


def capture_identity(rank: int, pid: int | None = None) -> ProcessIdentity:
    """Capture the identity of ``pid`` (default: the calling process) as worker ``rank``.

    Reads ``/proc/<pid>/stat`` and ``/proc/<pid>/ns/pid``: blocks only for those two procfs reads
    (microseconds). Raises :class:`~trtllm_liveness.process.ProcessGone` if the process does not exist,
    :class:`~trtllm_liveness.process.AccessDenied` if its ``/proc`` entry cannot be read. Thread-safe.
    """
    target = os.getpid() if pid is None else pid
    try:
        start_time = _procfs.read_start_time(target)
        namespace = _procfs.pid_namespace_inode("self" if pid is None else target)
    except (FileNotFoundError, ProcessLookupError) as exc:
        raise ProcessGone(target) from exc
    except PermissionError as exc:
        raise AccessDenied(target) from exc
    return ProcessIdentity(rank, target, start_time, local_hostname(), namespace)


def is_local(identity: ProcessIdentity) -> bool:
    """Whether ``identity``'s PID can be looked up in this process's ``/proc``.

    An unknown PID namespace (``None``) on this host counts as this one: upstream sends ``None``
    only when its own read failed, and the start time (where known) still guards against a
    different process behind the same number.
    """
    return identity.hostname == local_hostname() and identity.pid_namespace in (None, local_pid_namespace())


def _require_int(value: Any, what: str, index: int, low: int, high: int) -> int:
    # bool is an int subclass; True as a pid would silently mean pid 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidIdentityError(
            f"identity #{index}: {what} must be an int, got {type(value).__name__}"
        )
    if not low <= value <= high:
        raise InvalidIdentityError(f"identity #{index}: {what}={value} is outside [{low}, {high}]")
    # Strip int subclasses (IntEnum, numpy-like wrappers) so the identity holds plain values.
    return int(value)


def _parse_one(item: Any, index: int, own_pid: int, *, strict: bool = True) -> ProcessIdentity:
    if isinstance(item, dict):
        try:
            item = tuple(item[name] for name in ProcessIdentity._fields)
        except KeyError as exc:
            raise InvalidIdentityError(f"identity #{index}: missing field {exc.args[0]!r}") from None
    if not isinstance(item, (tuple, list)):
        raise InvalidIdentityError(
            f"identity #{index}: expected a 5-field tuple, got {type(item).__name__}"
        )
    if len(item) != len(ProcessIdentity._fields):
        raise InvalidIdentityError(
            f"identity #{index}: expected {len(ProcessIdentity._fields)} fields, got {len(item)}"
        )
    rank_v, pid_v, start_v, host_v, ns_v = item
    rank = _require_int(rank_v, "rank", index, 0, _MAX_RANK)
    pid = _require_int(pid_v, "pid", index, 1, _MAX_PID)
    if strict and pid == 1:
        raise InvalidIdentityError(f"identity #{index}: pid 1 (init) is never a worker")
    if strict and pid == own_pid:
        raise InvalidIdentityError(
            f"identity #{index}: pid {pid} is the monitoring process itself"
        )
    start_time = None if start_v is None else _require_int(start_v, "start_time", index, 0, 1 << 62)
    if not isinstance(host_v, str) or not host_v or len(host_v) > MAX_HOSTNAME_LEN:
        raise InvalidIdentityError(
            f"identity #{index}: hostname must be a non-empty str of at most "
            f"{MAX_HOSTNAME_LEN} characters"
        )
    if not host_v.isprintable():
        raise InvalidIdentityError(f"identity #{index}: hostname has unprintable characters")
    namespace = None if ns_v is None else _require_int(ns_v, "pid_namespace", index, 1, (1 << 64) - 1)
    return ProcessIdentity(rank, pid, start_time, str(host_v), namespace)


def coerce_identity(item: Any, index: int = 0) -> ProcessIdentity:
    """Validate one identity's structure, types and ranges (not the pid policy of the parser).

    Used by the monitor's ``register``: pid 1 is legal there (a worker may be init of its own PID
    namespace, and is then unmonitored anyway) and the monitor never signals. Raises
    :class:`~trtllm_liveness.process.InvalidIdentityError`.
    """
    return _parse_one(item, index, own_pid=0, strict=False)


def parse_identities(
    payload: Any,
    *,
    max_count: int = MAX_IDENTITIES,
    own_pid: int | None = None,
    per_element: bool = False,
    exclude_pids: Iterable[int] = (),
) -> list[ProcessIdentity]:
    """Validate an untrusted identity payload, e.g. what the leader rank sent over IPC.

    Accepts a list or tuple of 5-field tuples/lists, dicts with the field names, or
    ``ProcessIdentity`` values; ``start_time`` and ``pid_namespace`` may be ``None``. Returns them
    sorted by rank. Raises :class:`~trtllm_liveness.process.InvalidIdentityError` (a ``ValueError``)
    naming the first bad element: wrong container or field types, ``bool`` used as an int,
    pid <= 1 or the calling process itself, duplicate ranks, or more than ``max_count`` entries.

    ``per_element=True`` rejects bad elements one by one instead (each logged at WARNING with
    its reason; a later duplicate of a rank is dropped) and keeps the rest; only a payload that
    is not a list at all, or too long, still raises. Local elements (this host and PID namespace)
    whose pid is in ``exclude_pids`` are dropped quietly (e.g. the proxy's own pid: under
    ``MpiCommSession`` rank 0 runs inside the proxy, which must not watch itself; a rank of
    another host may have the same number). Never raises anything else, never blocks (no I/O),
    thread-safe: it only reads ``payload``.
    """
    if isinstance(payload, (str, bytes, bytearray)) or not isinstance(payload, (list, tuple)):
        raise InvalidIdentityError(
            f"identities must be a list or tuple, got {type(payload).__name__}"
        )
    if len(payload) > max_count:
        raise InvalidIdentityError(
            f"identities payload has {len(payload)} entries, more than the limit {max_count}"
        )
    own = os.getpid() if own_pid is None else own_pid
    excluded = frozenset(exclude_pids)
    identities: list[ProcessIdentity] = []
    seen: dict[int, int] = {}
    for index, item in enumerate(payload):
        try:
            # This process's own pid, where excluded, is dropped below (if local), not rejected.
            identity = _parse_one(item, index, 0 if own in excluded else own)
            if identity.pid in excluded and is_local(identity):
                continue  # the same number on another host (or PID namespace) is another process
            if identity.rank in seen:
                raise InvalidIdentityError(
                    f"identity #{index}: duplicate rank {identity.rank} (also #{seen[identity.rank]})"
                )
        except InvalidIdentityError as exc:
            if not per_element:
                raise
            logger.warning("liveness: rejected one worker identity: %s", exc)
            continue
        seen[identity.rank] = index
        identities.append(identity)
    return sorted(identities, key=lambda identity: identity.rank)
