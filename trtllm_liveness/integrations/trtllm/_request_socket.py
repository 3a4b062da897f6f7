"""Upstream's request socket: who owns it, and how the extension keeps from sending on it.

Upstream's queues are ZMQ sockets without a lock; ZMQ sockets are not thread-safe, and upstream's
debug mode (``TLLM_LLMAPI_ZMQ_DEBUG``) raises on a send from a thread that does not own the
socket (docs/upstream-contract.md, "Request queue and blocking sends").
"""

from __future__ import annotations

import os
import threading

from ..._events import WorkerFailedError
from .._futures import fail_pending
from ._state import EngineLiveness


def zmq_debug() -> bool:
    # Upstream's ipc reads it per queue at construction; the same word here (docs/upstream-contract.md).
    return os.environ.get("TLLM_LLMAPI_ZMQ_DEBUG", "0") != "0"


def owns_request_socket(state: EngineLiveness) -> bool:
    # No submit yet: nobody owns the socket, and the thread that sends now becomes its owner.
    owner = state.request_socket_owner
    return owner is None or owner == threading.get_ident()


def quiet_after_fatal(state: EngineLiveness, error: WorkerFailedError) -> None:
    # Upstream's pre_shutdown() sends its stop sentinel (put_noblock(None)) only while worker
    # futures are pending (main: any; 1.2.x: all). After a fatal error it runs in the fatal path's
    # helper thread (or the upstream-shutdown thread); once a caller's thread owns upstream's
    # request socket, a send from another thread breaks ZMQ's rule (sockets are not thread-safe)
    # and raises with TLLM_LLMAPI_ZMQ_DEBUG=1. Failing the futures (upstream's mirrors) first keeps
    # upstream from sending at all; a leader still alive is then ended by the bounded stop of
    # shutdown() / the exit guard instead of returning by itself.
    fail_pending(state.mpi_futures if isinstance(state.mpi_futures, list) else [], error)
