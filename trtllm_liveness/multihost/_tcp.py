"""What the kernel knows of a hub connection: when the peer was last heard, and why it ended.

ZMQ tells a ROUTER only *that* a connection ended (socket monitor ``EVENT_DISCONNECTED`` with the
descriptor), the same event whether the peer's process died (its kernel closes the connection:
milliseconds) or the heartbeat timed out (a stopped agent). The kernel knows more: this table
keeps a duplicate of each accepted connection's descriptor (taken at ``EVENT_ACCEPTED``) and reads
the connection's ``TCP_INFO``:

- **silence** (:func:`last_heard`, :meth:`ConnectionTable.silences`): how long ago anything came
  from the peer, a data segment or a bare acknowledgement (``tcpi_last_data_recv``,
  ``tcpi_last_ack_recv``: the kernel's own "last heard", the one TCP keepalive uses). The agents'
  PINGs are data a few times per timeout, so on a lossy, jittery network one lost segment costs one
  PING interval of silence, not a retransmission timeout of TCP plus a round trip, as a PING
  waiting for its own PONG does; an acknowledgement without data says the peer's host is up and its
  process mute. :meth:`ConnectionTable.cut` ends a connection (``shutdown``): ZMQ then drops it and
  its end reads ``SILENT``.
- **how it ended** (:meth:`ConnectionTable.disconnected`): ``ESTABLISHED`` when ZMQ drops it means
  nothing came from the peer's process: ZMQ's own heartbeat timed out while its kernel may still
  acknowledge (``MUTE``: a stopped or frozen agent) or not (``SILENT``). ``CLOSE_WAIT``/``CLOSE``/
  ``LAST_ACK`` mean the peer closed or reset it. The duplicate is closed right after, so the
  connection then ends as ZMQ meant it to.

A descriptor's number can be reused between ZMQ's accept and our duplicate (the connection died
within microseconds and another was accepted): that connection then gets the other's key, and its
cause may read "unknown". Standard library only; owned by the hub's thread.
"""

from __future__ import annotations

import contextlib
import enum
import os
import socket
import struct
from typing import NamedTuple

_TCP_ESTABLISHED = 1
_TCP_CLOSED_BY_PEER = frozenset({7, 8, 9})  # CLOSE (after RST), CLOSE_WAIT (FIN received), LAST_ACK
# struct tcp_info (linux/tcp.h) up to tcpi_last_ack_recv: u32 tcpi_last_data_recv at byte 52, then
# tcpi_last_ack_recv, both milliseconds ago (jiffies); stable since Linux 2.6.
_TCP_INFO_BYTES = 60
_LAST_RECV = struct.Struct("=II")
_LAST_RECV_AT = 52

Key = tuple[str, int]  # the peer's (address, port)
MAX_CONNECTIONS = 8192  # duplicates kept at most (each holds one descriptor)


class Ending(str, enum.Enum):
    """How a connection ended, as far as the kernel tells."""

    CLOSED = "closed"  # the peer closed or reset it: its process is gone (or its host rebooted)
    SILENT = "silent"  # nothing at all came from the peer's host: partition, lost host
    MUTE = "mute"  # its kernel still acknowledges, its process answers no heartbeat: a stuck agent
    UNKNOWN = "unknown"

    @property
    def is_silence(self) -> bool:
        """The peer went quiet without closing anything (partition, lost host, stuck agent)."""
        return self in (Ending.SILENT, Ending.MUTE)


class Silence(NamedTuple):
    """One connection's silence: its descriptor, peer key, seconds since data came from its peer,
    and whether the peer's kernel acknowledged within the last second (the process is mute)."""

    fd: int
    key: Key
    seconds: float
    mute: bool


_MUTE_ACK_S = 1.0  # an acknowledgement this recent: the peer's host is up, its process is silent


class Closure(NamedTuple):
    """A connection ZMQ dropped: its peer key (None: unknown), how it ended, and how long nothing
    had come from the peer then (None: unreadable)."""

    key: Key | None
    ending: Ending
    silent_s: float | None = None


def duplicate(fd: int) -> socket.socket | None:
    """A socket object on a duplicate of ZMQ's descriptor ``fd`` (the caller closes it), or None
    when the number is gone or now names something that is no socket."""
    try:
        raw = os.dup(fd)
    except OSError:
        return None
    try:
        return socket.socket(fileno=raw)
    except OSError:
        os.close(raw)
        return None


def last_heard(conn: socket.socket) -> tuple[float, float] | None:
    """(seconds since the last data segment, since the last acknowledgement) came from the peer
    of TCP connection ``conn``, per the kernel; None if unreadable (closed, not TCP)."""
    try:
        raw = conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
    except OSError:
        return None
    if len(raw) < _TCP_INFO_BYTES:
        return None
    data_ms, ack_ms = _LAST_RECV.unpack_from(raw, _LAST_RECV_AT)
    return data_ms / 1000, ack_ms / 1000


def cut(conn: socket.socket) -> None:
    """End TCP connection ``conn`` (a duplicate of another owner's descriptor) for its owner too:
    ``shutdown`` both ways (its owner's next read sees the end) and no lingering on close (the
    connection is reset, not kept retrying a peer that answers nothing)."""
    with contextlib.suppress(OSError):
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)


class ConnectionTable:
    """fd -> (peer key, duplicate socket) for the hub's accepted TCP connections."""

    def __init__(self) -> None:
        self._by_fd: dict[int, tuple[Key, socket.socket]] = {}
        self._cut: dict[int, float] = {}  # fd -> the silence it was cut at

    def accepted(self, fd: int) -> None:
        """Note connection ``fd`` (ZMQ's) and its peer key, unless it is gone already."""
        self._drop(fd)
        if len(self._by_fd) >= MAX_CONNECTIONS:
            return  # not classified (its end reads "unknown"): never more descriptors than this
        dup = duplicate(fd)
        if dup is None:
            return
        try:
            peer = dup.getpeername()
        except OSError:
            dup.close()
            return
        self._by_fd[fd] = ((str(peer[0]), int(peer[1])), dup)

    def silences(self) -> list[Silence]:
        """Every open connection not cut yet, with how long no data came from its peer's process
        (its PINGs are data) and whether its kernel still acknowledged meanwhile (``mute``: the
        host is there, the process answers nothing)."""
        found: list[Silence] = []
        for fd, (key, dup) in self._by_fd.items():
            if fd in self._cut:
                continue
            heard = last_heard(dup)
            if heard is not None:
                found.append(Silence(fd, key, heard[0], heard[1] < heard[0] and heard[1] < _MUTE_ACK_S))
        return found

    def cut(self, silence: Silence) -> None:
        """End ``silence``'s connection (its peer was silent for ``silence.seconds``): ZMQ drops it
        next, and :meth:`disconnected` then says ``SILENT``."""
        entry = self._by_fd.get(silence.fd)
        if entry is not None and silence.fd not in self._cut:
            self._cut[silence.fd] = silence.seconds
            cut(entry[1])

    def disconnected(self, fd: int) -> Closure:
        """Connection ``fd`` was dropped by ZMQ: its key, how it ended and how long its peer had
        been silent; the duplicate is closed."""
        entry = self._by_fd.pop(fd, None)
        silence_cut = self._cut.pop(fd, None)
        if entry is None:
            return Closure(None, Ending.UNKNOWN)
        key, dup = entry
        if silence_cut is not None:
            dup.close()
            return Closure(key, Ending.SILENT, silence_cut)
        ending = Ending.UNKNOWN
        silent: float | None = None
        with dup, contextlib.suppress(OSError):  # the duplicate is closed on every way out
            state = dup.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]
            heard = last_heard(dup)
            if state == _TCP_ESTABLISHED:  # ZMQ's heartbeat timed out: its process answered nothing
                ending = Ending.MUTE
                if heard is not None:
                    silent = heard[0]
                    if heard[1] >= heard[0]:  # not even an acknowledgement since
                        ending = Ending.SILENT
            elif state in _TCP_CLOSED_BY_PEER:
                ending = Ending.CLOSED
        return Closure(key, ending, silent)

    def _drop(self, fd: int) -> None:
        self._cut.pop(fd, None)
        entry = self._by_fd.pop(fd, None)
        if entry is not None:
            with contextlib.suppress(OSError):
                entry[1].close()

    def __contains__(self, key: object) -> bool:
        return any(entry[0] == key for entry in self._by_fd.values())

    def close(self) -> None:
        for fd in list(self._by_fd):
            self._drop(fd)

    def __len__(self) -> int:
        return len(self._by_fd)
