"""Messages exchanged between the reference proxy and its workers, and the result objects.

Departure from upstream: upstream signs pickled IPC messages with an HMAC key; the reference
binds its sockets in a private (0700) directory instead and trusts its own workers.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

READY_SIGNAL = b"READY"
WORKER_PROCESS_IDENTITIES_SIGNAL = b"WORKER_PROCESS_IDENTITIES"
ACK = "ACK"


@dataclass
class GenerationRequest:
    """A fake generation: the worker echoes ``prompt_token_ids`` back, one token per step."""

    prompt_token_ids: list[int]
    id: int = -1

    def set_id(self, request_id: int) -> None:
        self.id = request_id


class TokenResponse(NamedTuple):
    client_id: int
    token: int
    is_final: bool


class ErrorResponse(NamedTuple):
    """Same fields as upstream's ``tensorrt_llm.executor.utils.ErrorResponse``."""

    client_id: int
    error_msg: str
    request_id: int


class RequestError(RuntimeError):
    """A per-request error: the engine itself is fine."""


class EngineDeadError(RuntimeError):
    """The engine died; every pending and new request fails with this (upstream main's name)."""

    def __init__(self, root_cause: BaseException | str) -> None:
        super().__init__(f"engine is dead: {root_cause}")
        self.root_cause = root_cause


@dataclass(eq=False)
class GenerationResult:
    """A future for one request. Thread-safe; ``result(timeout)`` blocks at most ``timeout`` s.

    It is its own ``result.queue``: what upstream's dispatch thread (and the extension) ``put``
    responses into. Departure from upstream: responses are applied at once instead of waiting for
    a consumer, so the time a request failed is the time the failure arrived.
    """

    client_id: int
    tokens: list[int] = field(default_factory=list)
    error: BaseException | None = None
    finished_at: float | None = None
    _event: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.queue = self
        self.started = threading.Event()  # set at the first token: the request is in flight

    @property
    def done(self) -> bool:
        return self._event.is_set()

    def put(self, item: Any) -> None:
        """Apply one response: a token, the request's error, or the engine's."""
        with self._lock:
            if self._event.is_set():
                return
            if isinstance(item, TokenResponse):
                self.tokens.append(item.token)
                self.started.set()
                if not item.is_final:
                    return
            elif isinstance(item, BaseException):
                self.error = item
            elif isinstance(item, tuple) and hasattr(item, "error_msg"):
                self.error = RequestError(str(item.error_msg))
            else:
                self.error = RequestError(f"unexpected response {item!r}")
            self.finished_at = time.monotonic()
            self._event.set()

    put_nowait = put

    def abort(self) -> None:
        self.put(RequestError("request aborted"))

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the request to finish or fail; True when it did."""
        return self._event.wait(timeout)

    def result(self, timeout: float) -> list[int]:
        """The generated tokens. Raises ``TimeoutError`` after ``timeout`` s, or the request's error."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"request {self.client_id} not finished after {timeout}s")
        if self.error is not None:
            raise self.error
        return list(self.tokens)
