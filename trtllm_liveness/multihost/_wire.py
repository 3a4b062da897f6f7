"""The wire between a proxy's agent hub and the per-host agents: authenticated, bounded messages.

The channel crosses hosts, so every message is authenticated with the engine's secret
(docs/multihost.md, "Turning it on for a cluster", says where it comes from). One ZMQ frame per
message::

    b"TLH1" | HMAC-SHA256(secret, b"TLH1" + direction + body) (32 bytes) | body (UTF-8 JSON object)

``direction`` is ``b"A"`` for agent -> hub and ``b"H"`` for hub -> agent, so a message cannot be
reflected back to its sender. The body always holds ``k`` (the kind), ``sid`` (the agent's session
id: 32 hex digits, also its ZMQ routing id) and ``n`` (a sequence number, strictly increasing per
session and direction). A receiver keeps the last ``n`` per session and drops anything not newer:
a replay within a session fails there, and a session id the hub has ever seen is never accepted
in a new ``hello`` (a replay of an old session). Standard library only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeAlias, TypeVar

MAGIC = b"TLH1"
TO_HUB = b"A"
TO_AGENT = b"H"
MAC_BYTES = 32
SECRET_BYTES = 32
MAX_MESSAGE_BYTES = 64 << 10  # a hello of 72 ranks is ~10 KiB; anything near this is not ours
PING_INTERVAL_TIMEOUTS = 0.75
"""Every agent PINGs (ZMTP) the hub once per this many heartbeat timeouts (0.75 s by default), and
the hub's ZMQ answers each (the hub sends none: one wakeup of its I/O thread per PING, not two).
Those PINGs are the data both sides' silence checks read (:mod:`._tcp`): a host whose agent sent
nothing for the timeout is suspect, which costs nothing but a state and, past twice the timeout, a
line; it is lost only when the engine's progress stops too (:mod:`._host_silence`). So a lost
segment or a jittery link needs no more PINGs to stay clear of a verdict, and fewer PINGs cost the
hub less CPU (scripts/bench_multihost.py, 128 hosts)."""
_SID_RE = re.compile(r"[0-9a-f]{32}")
_KIND_RE = re.compile(r"[a-z]{1,16}")
_MAX_SEQ = 1 << 62


class WireError(ValueError):
    """A message that is not one of ours: the text says why (for a rate-limited log line)."""


@dataclass(frozen=True)
class Message:
    """One authenticated, parsed message: its kind, session, sequence number and whole body."""

    kind: str
    sid: str
    seq: int
    body: dict[str, Any]


def encode(secret: bytes, direction: bytes, kind: str, sid: str, seq: int, /, **fields: Any) -> bytes:
    """One frame: magic, MAC, JSON body of ``fields`` plus ``k``, ``sid`` and ``n``."""
    body = json.dumps({**fields, "k": kind, "sid": sid, "n": seq}, separators=(",", ":")).encode()
    if len(body) + len(MAGIC) + MAC_BYTES > MAX_MESSAGE_BYTES:
        raise ValueError(f"message {kind!r} of {len(body)} bytes exceeds {MAX_MESSAGE_BYTES}")
    return MAGIC + _mac(secret, direction, body) + body


def decode(secret: bytes, direction: bytes, frame: bytes) -> Message:
    """Check and parse one frame received in ``direction``. Raises :class:`WireError`.

    The MAC is checked (in constant time) before the body is parsed: no unauthenticated byte
    reaches the JSON parser."""
    if len(frame) > MAX_MESSAGE_BYTES:
        raise WireError(f"oversized message ({len(frame)} bytes, limit {MAX_MESSAGE_BYTES})")
    head = len(MAGIC) + MAC_BYTES
    if len(frame) <= head or not frame.startswith(MAGIC):
        raise WireError(f"not a hub message ({len(frame)} bytes without the {MAGIC!r} header)")
    mac, body = frame[len(MAGIC):head], frame[head:]
    if not hmac.compare_digest(mac, _mac(secret, direction, body)):
        raise WireError("authentication failed (wrong or missing secret, or a tampered message)")
    try:
        parsed = json.loads(body)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # authenticated garbage: a bug, not an attack
        raise WireError(f"authenticated body is no JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise WireError(f"body is a {type(parsed).__name__}, not an object")
    kind, sid, seq = parsed.get("k"), parsed.get("sid"), parsed.get("n")
    if not isinstance(kind, str) or not _KIND_RE.fullmatch(kind):
        raise WireError(f"bad kind {kind!r}")
    if not isinstance(sid, str) or not _SID_RE.fullmatch(sid):
        raise WireError("bad session id")
    if not isinstance(seq, int) or isinstance(seq, bool) or not 0 < seq < _MAX_SEQ:
        raise WireError(f"bad sequence number {seq!r}")
    return Message(kind, sid, seq, parsed)


def _mac(secret: bytes, direction: bytes, body: bytes) -> bytes:
    return hmac.new(secret, MAGIC + direction + body, hashlib.sha256).digest()


def field(message: Message, name: str, kind: type, *, low: float | None = None, high: float | None = None,
          max_len: int = 4096, null: bool = False) -> Any:
    """``message.body[name]`` checked against ``kind`` (and bounds; ``null``: it may be null, read
    as None). Raises :class:`WireError`."""
    value = message.body.get(name)
    if null and value is None:
        return None
    if kind in (int, float):  # an int is a number too; a bool is neither, NaN no number
        if not isinstance(value, int if kind is int else (int, float)) or isinstance(value, bool) or value != value \
                or (low is not None and value < low) or (high is not None and value > high):
            raise WireError(f"{message.kind}: field {name!r} must be {'an int' if kind is int else 'a number'} in "
                            f"[{low}, {high}], got {value!r}")
        return value if kind is int else float(value)
    if kind is str:
        if not isinstance(value, str) or len(value) > max_len:
            raise WireError(f"{message.kind}: field {name!r} must be a string of at most {max_len}")
    elif not isinstance(value, kind):
        raise WireError(f"{message.kind}: field {name!r} must be a {kind.__name__}")
    return value


MAX_COMMAND_S = 1e7
"""The longest bound a command carries (115 days); the hub sends a longer setting as this one."""


_SECONDS: dict[str, Any] = {"kind": float, "low": 0, "high": MAX_COMMAND_S}
_C = TypeVar("_C", bound="_Command")


@dataclass(frozen=True)
class _Command:
    """A hub -> agent command: a typed record whose fields travel under the names in ``wire``, each
    read back with its check there (:func:`field`'s arguments)."""

    kind: ClassVar[str]
    wire: ClassVar[dict[str, dict[str, Any]]] = {}  # each field's name on the wire, in the record's order

    def fields(self) -> dict[str, Any]:
        """The message's fields on the wire."""
        return dict(zip(self.wire, (getattr(self, spec.name) for spec in dataclasses.fields(self)), strict=True))

    @classmethod
    def parse(cls: type[_C], message: Message) -> _C:
        """The command in an authenticated message of its kind. Raises :class:`WireError`."""
        return cls(*(field(message, name, **check) for name, check in cls.wire.items()))


@dataclass(frozen=True)
class ArmCommand(_Command):
    """Make wedge verdicts from now on, with this ``D``-state bound (None: none)."""

    d_state_timeout_s: float | None
    kind: ClassVar[str] = "arm"
    wire: ClassVar[dict[str, dict[str, Any]]] = {"d": {**_SECONDS, "null": True}}


@dataclass(frozen=True)
class ExpectCommand(_Command):
    """A clean stop began: exits are expected, and the agent no longer ends its host's ranks when
    the hub goes away. It has no field."""

    kind: ClassVar[str] = "expect"


@dataclass(frozen=True)
class StopCommand(_Command):
    """Stop the host's other ranks (SIGTERM, ``grace_s``, SIGKILL, ``kill_s``), report, then end the
    agent's own rank. ``req`` numbers the request; the hub's thread sets it when it sends the
    stop."""

    grace_s: float
    kill_s: float
    req: int | None = None
    kind: ClassVar[str] = "stop"
    wire: ClassVar[dict[str, dict[str, Any]]] = {"grace": _SECONDS, "kill": _SECONDS,
                                                 "req": {"kind": int, "low": 1, "high": _MAX_SEQ}}


@dataclass(frozen=True)
class Rejection(_Command):
    """The hub does not count this agent's host (``why``): the agent ends."""

    why: str
    kind: ClassVar[str] = "reject"
    wire: ClassVar[dict[str, dict[str, Any]]] = {"why": {"kind": str, "max_len": 500}}


Command: TypeAlias = "ArmCommand | ExpectCommand | StopCommand | Rejection"
"""A hub -> agent command with a record of its own (``snapreq``'s: :mod:`._hub_snapshots`; ``fault``:
the agent's fault handler reads it)."""

COMMANDS: dict[str, Callable[[Message], Command]] = {
    "arm": ArmCommand.parse, "expect": ExpectCommand.parse, "stop": StopCommand.parse, "reject": Rejection.parse}
"""Each command's parser by its kind: the one parse of what a hub sends an agent."""
