"""The identity side channel (1.2.x, whose protocol carries no identities): the proxy's end.

The leader rank sends the ranks' identities (JSON, never unpickled) with a random token to a ZMQ
PULL socket in a 0700 directory; see :mod:`._worker_entry` for the sending end. One listener
thread, which ends at the first payload with the right token, at ``close()`` or after the timeout.
:func:`open_listener`/:func:`close_listener` make and release such a socket, for this channel and
the ranks' progress channel (:mod:`._progress`).
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import os
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from ...process._identity import ProcessIdentity
from ._identities import validate_identities
from ._worker_spec import IdentityChannelSpec

logger = logging.getLogger(__name__.rpartition(".")[0])

_MAX_MESSAGE_BYTES = 4 << 20
_MAX_IPC_PATH = 100  # sockaddr_un's sun_path holds 108 bytes; a long TMPDIR (Slurm's) overflows it


def open_listener(name: str, max_bytes: int) -> tuple[str, str, str, Any, Any]:
    """A ZMQ PULL socket bound to ``name`` in a new 0700 directory (only this user's processes can
    connect; under TMPDIR unless that path would be too long for a socket address), taking messages
    of at most ``max_bytes``, and a random token for the senders to present: ``(directory, token,
    address, context, socket)``. Nothing is left behind when it fails."""
    import zmq

    directory = tempfile.mkdtemp(prefix="trtllm-liveness-")
    if len(os.path.join(directory, name)) > _MAX_IPC_PATH:
        os.rmdir(directory)
        directory = tempfile.mkdtemp(prefix="trtllm-liveness-", dir="/tmp")
    address = f"ipc://{os.path.join(directory, name)}"
    context: Any = None
    try:
        context = zmq.Context()
        sock = context.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        sock.bind(address)
    except BaseException:
        close_listener(context, directory)
        raise
    return directory, secrets.token_hex(16), address, context, sock


def close_listener(context: Any, directory: str) -> None:
    """Close the sockets of :func:`open_listener`'s ``context`` (at once), end it, remove ``directory``."""
    if context is not None:
        with contextlib.suppress(Exception):
            context.destroy(0)
    shutil.rmtree(directory, ignore_errors=True)


class IdentityChannel:
    """The proxy's end of the side channel (see the module docstring).

    ``on_identities`` is called once, in the listener thread, with the valid identities of the
    first token-checked payload (elements rejected one by one; ``exclude_pids`` dropped).
    """

    def __init__(self, on_identities: Callable[[list[ProcessIdentity]], None], timeout_s: float,
                 *, exclude_pids: frozenset[int] = frozenset()) -> None:
        self._dir, self.token, self.address, self._context, self._sock = open_listener("identities",
                                                                                       _MAX_MESSAGE_BYTES)
        self._exclude = exclude_pids
        self._stop = threading.Event()
        self._on_identities = on_identities
        self._deadline = time.monotonic() + timeout_s
        self._thread = threading.Thread(target=self._run, name="trtllm-liveness-identities", daemon=True)
        try:
            self._thread.start()
        except BaseException:
            close_listener(self._context, self._dir)
            raise

    @property
    def spec(self) -> IdentityChannelSpec:
        """Where the leader rank sends the identities, and the token; travels in the worker spec."""
        return IdentityChannelSpec(self.address, self.token)

    def _run(self) -> None:
        try:
            while not self._stop.is_set() and time.monotonic() < self._deadline:
                if not self._sock.poll(100):
                    continue
                identities = self._parse(self._sock.recv())
                if identities is not None:
                    self._on_identities(identities)
                    return
            if not self._stop.is_set():
                logger.error("liveness: no worker identities within the timeout; workers are unmonitored")
        except Exception:
            logger.exception("liveness: identity listener failed; workers are unmonitored")
        finally:
            close_listener(self._context, self._dir)

    def _parse(self, raw: bytes) -> list[ProcessIdentity] | None:
        try:
            message: Any = json.loads(raw)
            token = message.get("token") if isinstance(message, dict) else None
            if not isinstance(token, str) or not hmac.compare_digest(token, self.token):
                raise ValueError("bad or missing token")
        except (ValueError, TypeError, AttributeError, RecursionError) as exc:
            # JSON errors, JSON nested too deep, forged: reject it, keep listening.
            logger.error("liveness: rejected a worker identities payload: %s", exc)
            return None
        valid = validate_identities(message.get("identities"), exclude_pids=self._exclude, source="the side channel")
        if not valid:  # nothing usable: keep listening until the timeout
            logger.error("liveness: rejected a worker identities payload: no valid identity in it")
            return None
        return valid

    def close(self, timeout: float = 1.0) -> None:
        """Stop listening; joins the listener for at most ``timeout`` seconds. Idempotent."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
