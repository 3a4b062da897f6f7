"""The agent hub's ZMQ ROUTER: bound with the options the hub relies on, with its monitor socket.

- ``ROUTER_MANDATORY``: a message to a routing id whose connection is gone fails at once (how the
  hub probes a connection it cannot match to a session);
- ``SNDTIMEO`` 0, ``LINGER`` 500 ms: no send waits on a dead peer; a last ``expect`` may leave at close;
- ``MAXMSGSIZE``: an oversized message ends its connection (:data:`~._wire.MAX_MESSAGE_BYTES`);
- ``HANDSHAKE_IVL`` 5 s: a peer that never completes ZMTP holds its descriptors 5 s, not 30.

The agents PING (every ``PING_INTERVAL_TIMEOUTS`` timeouts) and this ZMQ answers: what the hub's
silence check reads. The hub sends no PINGs and ZMQ never drops a connection on its own account:
whether a silent host is lost is the hub's decision (:mod:`._host_silence`).
"""

from __future__ import annotations

from typing import Any

from . import _wire

__all__ = ["open_router"]


def open_router(bind: str, port: int) -> tuple[Any, Any, Any, int]:
    """``(context, ROUTER, its monitor socket, port)`` bound on ``bind`` (``*``/``0.0.0.0``: every
    interface) and ``port`` (0: a free one). Raises (everything closed) where it cannot bind."""
    import zmq

    ctx = zmq.Context(io_threads=1)
    sock = ctx.socket(zmq.ROUTER)
    monitor_sock = None
    try:
        sock.setsockopt(zmq.LINGER, 500)
        sock.setsockopt(zmq.SNDTIMEO, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, _wire.MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.HANDSHAKE_IVL, 5000)
        monitor_sock = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        host = "*" if bind in ("*", "0.0.0.0") else bind
        if port:
            sock.bind(f"tcp://{host}:{port}")
        else:
            port = sock.bind_to_random_port(f"tcp://{host}")
    except Exception:
        if monitor_sock is not None:
            monitor_sock.close(0)
        sock.close(0)
        ctx.term()
        raise
    return ctx, sock, monitor_sock, port
