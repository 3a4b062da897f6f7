"""WorkerSpec: everything the proxy hands its ranks with their task, as one typed record.

The proxy wraps ``mpi_session.submit`` (:mod:`._mixin`) so that every rank runs
:func:`~._worker_entry.liveness_worker_entry`; the one keyword :data:`SPEC_KWARG` carries a
:class:`WorkerSpec`: upstream's original task (``worker_main``), the proxy's identity (for the
proxy-death watch), the identity side channel (1.2.x), the progress channel (stall detection)
and the agent hub's settings (several hosts). Every other argument is upstream's, untouched.

The record crosses MPI pickled. Unpickling fills a record without running its checks, so the rank
re-checks it with :meth:`WorkerSpec.from_wire` before it uses any part: what it cannot use (a
record of another version of this package, a part of the wrong type or range) raises
:class:`WorkerSpecError` naming the part and what is wrong. Every check looks at the values
alone, never at the host it runs on: every rank of a session gets the same record and so makes the
same decision, and no collective (the identities' gather, the agents' placement) is entered by
some ranks and skipped by others.

Standard library only; the hub's settings type is imported only where a record carries one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ...multihost._agent import AgentSettings

__all__ = ["SPEC_KWARG", "IdentityChannelSpec", "ProgressSpec", "ProxyIdentity", "WorkerSpec", "WorkerSpecError"]

SPEC_KWARG = "_trtllm_liveness_spec"
"""The keyword that carries the :class:`WorkerSpec` to :func:`~._worker_entry.liveness_worker_entry`."""

_MAX_PID = (1 << 22) - 1  # PID_MAX_LIMIT on 64-bit Linux
_MAX_HOSTNAME = 253
_MAX_ADDRESS = 4096
_MAX_TOKEN = 256
_SECRET_BYTES = 32  # multihost._wire.SECRET_BYTES (not imported: this module stays free of multihost)


class WorkerSpecError(ValueError):
    """A worker spec a rank cannot use; the text names the part and what is wrong."""


def is_int(value: Any) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any, low: float, high: float) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and low <= value <= high)


def _check_text(value: Any, what: str, max_len: int) -> None:
    if not isinstance(value, str) or not 0 < len(value) <= max_len:
        raise ValueError(f"bad {what} {value!r:.80}: want a non-empty string of at most {max_len} characters")


def _check_endpoint(value: Any, what: str) -> None:
    _check_text(value, what, _MAX_ADDRESS)
    if "://" not in value:
        raise ValueError(f"bad {what} {value!r:.80}: want a ZMQ endpoint (transport://address)")


@dataclass(frozen=True)
class ProxyIdentity:
    """The proxy process as its ranks learn it (:func:`~._worker_entry.proxy_identity`): pid, start
    time (clock ticks; None when unknown), hostname, PID namespace inode (None when unknown) and the
    kernel's boot id (``""`` when unreadable, None in the 4-element list form).

    PID 1 is accepted: a server that is PID 1 of its container ends every rank of its namespace when
    it exits (the watch decides that on the rank's own host, :func:`~._worker_entry.start_proxy_death_watch`).
    """

    pid: int
    start_time: int | None
    hostname: str
    pid_namespace: int | None
    boot_id: str | None = None

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise ``ValueError`` naming the first field of the wrong type or range."""
        if not is_int(self.pid) or not 1 <= self.pid <= _MAX_PID:
            raise ValueError(f"bad proxy pid {self.pid!r}")
        if self.start_time is not None and (not is_int(self.start_time) or self.start_time < 0):
            raise ValueError(f"bad proxy start time {self.start_time!r}")
        if not isinstance(self.hostname, str) or len(self.hostname) > _MAX_HOSTNAME:
            raise ValueError(f"bad proxy hostname {self.hostname!r:.80}")
        if self.pid_namespace is not None and not is_int(self.pid_namespace):
            raise ValueError(f"bad proxy PID namespace {self.pid_namespace!r}")
        if self.boot_id is not None and (not isinstance(self.boot_id, str) or len(self.boot_id) > 64):
            raise ValueError(f"bad proxy boot id {self.boot_id!r:.80}")

    @classmethod
    def from_sequence(cls, value: object) -> ProxyIdentity:
        """Parse the list form ``[pid, start_time, hostname, pid_namespace(, boot_id)]``.
        Raises ``ValueError`` saying what is wrong."""
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) not in (4, 5):
            raise ValueError(f"bad proxy identity {value!r:.200}: want [pid, start_time, hostname, "
                             "pid_namespace(, boot_id)]")
        return cls(*value)


@dataclass(frozen=True)
class IdentityChannelSpec:
    """Where the session's leader rank sends the ranks' identities (:mod:`._side_channel`) and the
    token that proves the payload is this engine's."""

    address: str
    token: str

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise ``ValueError`` naming the first field of the wrong type or range."""
        _check_endpoint(self.address, "identity channel address")
        _check_text(self.token, "identity channel token", _MAX_TOKEN)


@dataclass(frozen=True)
class ProgressSpec:
    """Where each rank reports its executor iterations (:mod:`._progress`), with the engine's token
    and at most how often (seconds)."""

    address: str
    token: str
    interval_s: float

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise ``ValueError`` naming the first field of the wrong type or range."""
        _check_endpoint(self.address, "progress channel address")
        _check_text(self.token, "progress channel token", _MAX_TOKEN)
        if not _is_number(self.interval_s, 1e-6, 3600.0):
            raise ValueError(f"bad progress interval {self.interval_s!r}: want seconds in (0, 3600]")


def check_agent_settings(settings: Any) -> None:
    """Raise ``ValueError`` unless ``settings`` is an :class:`~trtllm_liveness.multihost._agent.AgentSettings`
    whose fields an agent can use (the hub's values in range, and a fault handler)."""
    from ...multihost._agent import AgentSettings
    from ...multihost._agent_faults import FaultHandler

    if not isinstance(settings, AgentSettings):
        raise ValueError(f"not agent settings but {type(settings).__name__}")
    endpoint = settings.endpoint
    if not isinstance(endpoint, str) or not endpoint.startswith("tcp://") or len(endpoint) > 300:
        raise ValueError(f"bad hub endpoint {endpoint!r:.80}")
    if not isinstance(settings.secret, bytes) or len(settings.secret) != _SECRET_BYTES:
        raise ValueError(f"bad hub secret: want {_SECRET_BYTES} bytes")
    if not _is_number(settings.heartbeat_timeout_s, 0.01, 3600.0):
        raise ValueError(f"bad heartbeat timeout {settings.heartbeat_timeout_s!r}")
    if not _is_number(settings.heartbeat_ceiling_s, settings.heartbeat_timeout_s, 86400.0):
        raise ValueError(f"bad heartbeat ceiling {settings.heartbeat_ceiling_s!r}")
    d = settings.d_state_timeout_s
    if d is not None and not _is_number(d, 1e-6, math.inf):
        raise ValueError(f"bad D-state timeout {d!r}")
    if not _is_number(settings.scan_interval_s, 0.01, 60.0):
        raise ValueError(f"bad scan interval {settings.scan_interval_s!r}")
    for name in ("grace_s", "kill_s"):
        if not _is_number(getattr(settings, name), 0.0, math.inf):
            raise ValueError(f"bad {name} {getattr(settings, name)!r}")
    if not isinstance(settings.faults, type) or not issubclass(settings.faults, FaultHandler):
        raise ValueError(f"bad fault handler {settings.faults!r:.80}")
    if settings.quarantine is not None:
        from ...quarantine._quarantine_settings import QuarantineSettings

        if not isinstance(settings.quarantine, QuarantineSettings):
            raise ValueError(f"quarantine settings: a {type(settings.quarantine).__name__}, not QuarantineSettings")
        settings.quarantine.check()


@dataclass(frozen=True)
class WorkerSpec:
    """What one rank's task carries besides upstream's arguments (see the module docstring).

    ``fn`` is upstream's task, called with exactly upstream's arguments; each other part is None
    where the engine does not use it (``channel``: upstream registers the ranks itself;
    ``progress``: no stall detection; ``hub``: one host). Building a record checks it (raises
    :class:`WorkerSpecError`); so does :meth:`from_wire` on the rank.
    """

    fn: Callable[..., Any]
    proxy: ProxyIdentity | None = None
    channel: IdentityChannelSpec | None = None
    progress: ProgressSpec | None = None
    hub: AgentSettings | None = None

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise :class:`WorkerSpecError` naming the first part a rank could not use."""
        if not callable(self.fn):
            raise WorkerSpecError(f"the task is not callable ({type(self.fn).__name__})")
        parts: tuple[tuple[str, Any, type[ProxyIdentity | IdentityChannelSpec | ProgressSpec] | None], ...] = (
            ("proxy identity", self.proxy, ProxyIdentity), ("identity channel", self.channel, IdentityChannelSpec),
            ("progress channel", self.progress, ProgressSpec), ("hub settings", self.hub, None))
        for name, part, kind in parts:
            if part is None:
                continue
            try:
                if kind is None:  # the hub's settings type is multihost's, checked there
                    check_agent_settings(part)
                elif not isinstance(part, kind):
                    raise ValueError(f"a {type(part).__name__}, not a {kind.__name__}")
                else:
                    part.check()
            except (ValueError, TypeError, AttributeError) as exc:
                raise WorkerSpecError(f"{name}: {exc}") from None

    @classmethod
    def from_wire(cls, raw: object) -> WorkerSpec:
        """The record a rank received (unpickled, so never checked yet), checked; raises
        :class:`WorkerSpecError` for anything else: no spec, another type, a record of another
        version of this package (a missing field), a part of the wrong type or range."""
        if raw is None:
            raise WorkerSpecError(f"no worker spec (the {SPEC_KWARG} keyword is missing)")
        if not isinstance(raw, WorkerSpec):
            raise WorkerSpecError(f"the worker spec is a {type(raw).__name__}, not a {cls.__name__}")
        missing = [f.name for f in dataclasses.fields(WorkerSpec) if f.name not in vars(raw)]
        if missing:
            raise WorkerSpecError(f"the worker spec lacks {', '.join(missing)} (another version of trtllm-liveness "
                                  "on the proxy's side?)")
        raw.check()
        return raw

    @staticmethod
    def task_of(raw: object) -> Callable[..., Any] | None:
        """Upstream's task in a record :meth:`from_wire` rejected, if it holds a callable one."""
        fn = vars(raw).get("fn") if isinstance(raw, WorkerSpec) else None
        return fn if callable(fn) else None
