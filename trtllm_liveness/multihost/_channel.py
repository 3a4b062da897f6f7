"""Each end's socket, the socket's monitor and a wakeup pipe (:class:`Channel`), and the count of
bad input each end logs (:class:`Tally`): what the hub and its agents share.

The hub's is a bound ROUTER (:func:`open_router`), each agent's a DEALER connected to it
(:func:`open_dealer`). Both have ``MAXMSGSIZE`` (an oversized message ends its connection:
:data:`~._wire.MAX_MESSAGE_BYTES`), ``LINGER`` 500 ms (a last ``expect`` or stop report may leave at
close) and a bounded send (the hub's ``SNDTIMEO`` 0: never waits on a dead peer). The ROUTER also has
``ROUTER_MANDATORY`` (a message to a routing id whose connection is gone fails at once: how the hub
probes a connection it cannot match to a session) and ``HANDSHAKE_IVL`` 5 s (a peer that never
completes ZMTP holds its descriptors 5 s, not 30). The agents PING (every ``PING_INTERVAL_TIMEOUTS``
timeouts) and the hub's ZMQ answers: what both ends' silence checks read. The hub sends no PINGs and
ZMQ never drops a connection on its own account: whether a silent host is lost is the hub's decision
(:mod:`._host_silence`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

from . import _wire

__all__ = ["AGENT_SEND_TIMEOUT_MS", "Channel", "Tally", "open_dealer", "open_router"]

AGENT_SEND_TIMEOUT_MS = 1000  # a send to a hub whose host is gone must not hold the agent
_LOGGED_FIRST = 5
_LOG_EVERY = 1000


class Tally:
    """How often one kind of bad input came (:attr:`count`); its WARNING ``text`` (the count its
    ``count_at``-th argument) is logged the first five times, then every thousandth."""

    def __init__(self, log: logging.Logger, text: str, count_at: int) -> None:
        self.count = 0
        self._log = log
        self._text = text
        self._count_at = count_at

    def note(self, *args: object) -> None:
        """Count one more, and log it where due (``args``: the text's other arguments)."""
        self.count += 1
        if self.count <= _LOGGED_FIRST or self.count % _LOG_EVERY == 0:
            self._log.warning(self._text, *args[:self._count_at], self.count, *args[self._count_at:])


class Channel:
    """A ZMQ socket (:attr:`sock`), its monitor socket and a wakeup pipe, owned by one thread:
    :meth:`poll`, :meth:`events`, :meth:`close`; any thread may :meth:`wake` it."""

    def __init__(self, kind: int, events: int, options: dict[int, int | bytes]) -> None:
        import zmq

        self._lock = threading.Lock()
        self._wake_r = self._wake_w = -1
        self.monitor_sock: Any = None
        self.ctx = zmq.Context(io_threads=1)
        try:
            self.sock = self.ctx.socket(kind)
        except BaseException:
            self.ctx.term()  # no socket: its I/O thread ends at once
            raise
        try:
            for option, value in {zmq.LINGER: 500, zmq.MAXMSGSIZE: _wire.MAX_MESSAGE_BYTES, **options}.items():
                self.sock.setsockopt(option, value)
            self.monitor_sock = self.sock.get_monitor_socket(events)
            self._wake_r, self._wake_w = os.pipe()
            os.set_blocking(self._wake_r, False)
            os.set_blocking(self._wake_w, False)
            self._poller = zmq.Poller()
            for polled in (self.sock, self.monitor_sock, self._wake_r):
                self._poller.register(polled, zmq.POLLIN)
        except BaseException:
            self.close(linger_ms=0)
            raise

    def wake(self) -> None:
        """End the owner's current :meth:`poll` at once (any thread; never blocks)."""
        with self._lock:
            if self._wake_w >= 0:
                with contextlib.suppress(BlockingIOError, OSError):
                    os.write(self._wake_w, b"x")

    def poll(self, timeout_ms: int) -> tuple[bool, bool]:
        """Wait at most ``timeout_ms`` (a wake ends it): whether the socket, and its monitor, have
        something to read."""
        ready = dict(self._poller.poll(timeout_ms))
        if self._wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(self._wake_r, 4096)
        return self.sock in ready, self.monitor_sock in ready

    def events(self) -> Iterator[tuple[int, int]]:
        """The socket monitor's queued ``(event, value)`` pairs (the value: a descriptor, here)."""
        import zmq
        from zmq.utils.monitor import parse_monitor_message

        while True:
            try:
                event = parse_monitor_message(self.monitor_sock.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            yield int(event["event"]), int(event["value"])

    def close(self, linger_ms: int | None = None) -> None:
        """Close everything (the socket with its LINGER unless ``linger_ms``; the pipe last)."""
        if self.monitor_sock is not None:
            with contextlib.suppress(Exception):
                self.sock.disable_monitor()
            self.monitor_sock.close(0)
        self.sock.close(linger_ms)
        self.ctx.term()
        with self._lock:
            for fd in (self._wake_r, self._wake_w):
                if fd >= 0:
                    os.close(fd)
            self._wake_r = self._wake_w = -1


def open_router(bind: str, port: int) -> tuple[Channel, int]:
    """The hub's channel and its port: a ROUTER bound on ``bind`` (``*``/``0.0.0.0``: every
    interface) and ``port`` (0: a free one). Raises (everything closed) where it cannot bind."""
    import zmq

    channel = Channel(zmq.ROUTER, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED,
                      {zmq.SNDTIMEO: 0, zmq.ROUTER_MANDATORY: 1, zmq.HANDSHAKE_IVL: 5000})
    host = "*" if bind in ("*", "0.0.0.0") else bind
    try:
        if port:
            channel.sock.bind(f"tcp://{host}:{port}")
        else:
            port = channel.sock.bind_to_random_port(f"tcp://{host}")
    except BaseException:
        channel.close(linger_ms=0)
        raise
    return channel, port


def open_dealer(sid: str, heartbeat_timeout_s: float) -> Channel:
    """An agent's channel: a DEALER with routing id ``sid`` (connected by its owner), whose PINGs go
    every :data:`~._wire.PING_INTERVAL_TIMEOUTS` of ``heartbeat_timeout_s``."""
    import zmq

    # This agent's PINGs are what the hub's silence check reads, and the hub's answers what this
    # one's reads. ZMQ never drops the connection on its own (timeout 0): a silence ends it only by
    # the agent's decision (_check_hub_silence), which asks its ranks' progress.
    timeout_ms = max(20, int(heartbeat_timeout_s * 1000))
    return Channel(zmq.DEALER, zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED, {
        zmq.ROUTING_ID: sid.encode(), zmq.SNDTIMEO: AGENT_SEND_TIMEOUT_MS, zmq.RECONNECT_IVL: 100,
        zmq.HEARTBEAT_IVL: max(5, int(timeout_ms * _wire.PING_INTERVAL_TIMEOUTS)), zmq.HEARTBEAT_TIMEOUT: 0})
