"""Why a hub connection ended: closed by the peer (FIN/RST) or timed out in silence.

ZMQ tells a ROUTER only *that* a connection ended (socket monitor ``EVENT_DISCONNECTED`` with the
descriptor), the same event whether the peer's process died (its kernel closes the connection:
milliseconds) or the heartbeat timed out (a partition, a lost host, a stopped agent). The kernel
knows the difference: this table keeps a duplicate of each accepted connection's descriptor (taken
at ``EVENT_ACCEPTED``) and reads its TCP state when ZMQ drops it. ``ESTABLISHED`` means nothing
came from the peer: ZMQ timed it out. ``CLOSE_WAIT``/``CLOSE``/``LAST_ACK`` mean the peer closed or
reset it. The duplicate is closed right after, so the connection then ends as ZMQ meant it to.

A descriptor's number can be reused between ZMQ's accept and our duplicate (the connection died
within microseconds and another was accepted): that connection then gets the other's key, and its
cause may read "unknown". Standard library only; owned by the hub's thread.
"""

from __future__ import annotations

import contextlib
import enum
import os
import socket

_TCP_ESTABLISHED = 1
_TCP_CLOSED_BY_PEER = frozenset({7, 8, 9})  # CLOSE (after RST), CLOSE_WAIT (FIN received), LAST_ACK

Key = tuple[str, int]  # the peer's (address, port)
MAX_CONNECTIONS = 8192  # duplicates kept at most (each holds one descriptor)


class Ending(str, enum.Enum):
    """How a connection ended, as far as the kernel tells."""

    CLOSED = "closed"  # the peer closed or reset it: its process is gone (or its host rebooted)
    SILENT = "silent"  # nothing came for the heartbeat timeout: partition, lost host, stuck peer
    UNKNOWN = "unknown"


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


class ConnectionTable:
    """fd -> (peer key, duplicate socket) for the hub's accepted TCP connections."""

    def __init__(self) -> None:
        self._by_fd: dict[int, tuple[Key, socket.socket]] = {}

    def accepted(self, fd: int) -> Key | None:
        """Note connection ``fd`` (ZMQ's); returns its peer key, or None if it is gone already."""
        self._drop(fd)
        if len(self._by_fd) >= MAX_CONNECTIONS:
            return None  # not classified (its end reads "unknown"): never more descriptors than this
        dup = duplicate(fd)
        if dup is None:
            return None
        try:
            peer = dup.getpeername()
        except OSError:
            dup.close()
            return None
        key = (str(peer[0]), int(peer[1]))
        self._by_fd[fd] = (key, dup)
        return key

    def disconnected(self, fd: int) -> tuple[Key | None, Ending]:
        """Connection ``fd`` was dropped by ZMQ: its key and how it ended; the duplicate is closed."""
        entry = self._by_fd.pop(fd, None)
        if entry is None:
            return None, Ending.UNKNOWN
        key, dup = entry
        ending = Ending.UNKNOWN
        try:
            state = dup.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]
            if state == _TCP_ESTABLISHED:
                ending = Ending.SILENT
            elif state in _TCP_CLOSED_BY_PEER:
                ending = Ending.CLOSED
        except OSError:
            pass
        finally:
            dup.close()
        return key, ending

    def _drop(self, fd: int) -> None:
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
