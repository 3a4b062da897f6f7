"""Executor iterations as progress: each rank counts its iterations and tells the proxy.

Why: the proxy sees output only when a response arrives, and a non-streaming request returns its
output only when it finishes, so output alone would call a long non-streaming generation a stall.
Every rank of TensorRT-LLM's PyTorch executor calls ``HangDetector.checkpoint()`` at the top of
each iteration of its executor loop (``tensorrt_llm._torch.pyexecutor.hang_detector``, main; see
docs/upstream-contract.md); the rank entry wraps that method, so each call counts one iteration.
Where the module does not exist (1.2.x as read, other backends) nothing is counted and only
output is progress (``doctor`` and one WARNING say so).

Rank side (:class:`IterationReporter`): ``tick()`` (in the executor loop) is a counter, a clock read
and an ``Event.set()``; a daemon thread sends at most one beat per ``interval_s`` (the first at
once after a quiet spell), JSON over a ZMQ PUSH socket, non-blocking: a full queue drops the beat
(the next one carries the newer count). Each beat carries the time of the rank's last iteration
(``time.monotonic()``, one clock for every process of a host), so the proxy's stall clock is
exact whatever the beat's delay.

Proxy side (:class:`ProgressChannel`): a PULL socket in a 0700 directory (only this user's
processes can connect), a random token per engine checked in constant time, messages of at most
512 bytes; anything else is rejected with a (rate-limited) log line and never raised. One thread,
woken by the socket or by its own pipe at ``close()``.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...multihost._channel import Tally
from .. import patch_when_imported
from ._side_channel import close_listener, open_listener
from ._worker_spec import ProgressSpec, is_int

logger = logging.getLogger(__name__.rpartition(".")[0])

HANG_DETECTOR_MODULE = "tensorrt_llm._torch.pyexecutor.hang_detector"
MAX_MESSAGE_BYTES = 512
_SEND_RETRIES = 10  # a beat not taken is tried again this many times, one interval apart
_RECHECK_MS = 60_000  # bound on the waits that only a beat or close() ends


@dataclass(frozen=True)
class IterationBeat:
    """One rank's report: ``count`` iterations so far, the last at ``at`` (monotonic, this host)."""

    rank: int
    count: int
    at: float


def parse_beat(raw: bytes, token: str) -> IterationBeat:
    """Parse and check one beat; raises ``ValueError`` saying what is wrong."""
    if len(raw) > MAX_MESSAGE_BYTES:
        raise ValueError(f"{len(raw)} bytes (at most {MAX_MESSAGE_BYTES})")
    try:
        message: Any = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(message, dict):
        raise ValueError("not a JSON object")
    got = message.get("token")
    if not isinstance(got, str) or not hmac.compare_digest(got.encode(), token.encode()):
        raise ValueError("bad or missing token")
    rank: Any = message.get("rank")
    count: Any = message.get("count")
    at: Any = message.get("at")
    if not is_int(rank) or not 0 <= rank < 1 << 20:
        raise ValueError(f"bad rank {rank!r}")
    if not is_int(count) or count < 0:
        raise ValueError(f"bad count {count!r}")
    if not isinstance(at, (int, float)) or isinstance(at, bool) or not 0 <= at < 1e12:
        raise ValueError(f"bad time {at!r}")
    return IterationBeat(rank, count, float(at))


class ProgressChannel:
    """The proxy's end: calls ``on_beat(beat)`` in its thread for every valid beat.

    ``spec`` (a :class:`~._worker_spec.ProgressSpec`: address, token, interval) travels to the
    ranks with the worker task. Thread-safe;
    ``close()`` is idempotent and joins the thread for at most its timeout.
    """

    def __init__(self, on_beat: Callable[[IterationBeat], None], interval_s: float) -> None:
        self._dir, self.token, self.address, self._context, self._sock = open_listener("progress",
                                                                                       MAX_MESSAGE_BYTES)
        self.interval_s = interval_s
        self.rejected = Tally(logger, "liveness: rejected a progress message (%d so far): %s", 0)
        self._on_beat = on_beat
        self._closed = threading.Event()
        self._wake_lock = threading.Lock()  # the write end: close() writes it, then closes it
        self._wake_w: int | None = None
        try:
            self._wake_r, self._wake_w = os.pipe()
            self._thread = threading.Thread(target=self._run, name="trtllm-liveness-progress", daemon=True)
            self._thread.start()
        except BaseException:
            for fd in (getattr(self, "_wake_r", None), self._wake_w):
                if fd is not None:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            close_listener(self._context, self._dir)
            raise

    @property
    def spec(self) -> ProgressSpec:
        return ProgressSpec(self.address, self.token, self.interval_s)

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            while not self._closed.is_set():
                ready = dict(poller.poll(_RECHECK_MS))  # woken by the socket or close()'s pipe
                if self._closed.is_set():
                    return
                if self._sock in ready:
                    self._drain()
        except Exception:
            logger.exception("liveness: the progress listener failed; only output counts as progress now")
        finally:
            self._release()

    def _drain(self) -> None:
        import zmq

        while True:
            try:
                raw = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                beat = parse_beat(raw, self.token)
            except ValueError as exc:
                self.rejected.note(exc)
                continue
            try:
                self._on_beat(beat)
            except Exception:
                logger.exception("liveness: progress callback raised")

    def _release(self) -> None:
        # The thread owns the socket, the context, the pipe's read end and the directory; the
        # write end is close()'s (a write after a close here could hit a reused fd number).
        close_listener(self._context, self._dir)
        with contextlib.suppress(OSError):
            os.close(self._wake_r)
        with self._wake_lock:
            if not self._closed.is_set():  # ended on its own (an error): nobody will close it
                self._close_wake_w()

    def _close_wake_w(self) -> None:
        fd, self._wake_w = self._wake_w, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def close(self, timeout: float = 1.0) -> None:
        """Stop listening and release the socket, the pipe and the directory. Idempotent."""
        with self._wake_lock:
            if self._closed.is_set():
                return
            self._closed.set()
            if self._wake_w is not None:
                with contextlib.suppress(OSError):
                    os.write(self._wake_w, b"x")
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        with self._wake_lock:
            self._close_wake_w()


class IterationReporter:
    """One rank's iteration counter and its sending thread (see the module docstring)."""

    def __init__(self, spec: ProgressSpec, rank: int) -> None:
        import zmq

        self.count = 0
        self.at = 0.0
        self._lock = threading.Lock()
        # The current engine's: ``spec`` was checked where the rank got it (WorkerSpec.from_wire).
        self._target = (spec, rank)
        self._connected: str | None = None
        self._pending = threading.Event()
        self._context = zmq.Context()
        self._sock = self._context.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 8)
        self._sock.setsockopt(zmq.IMMEDIATE, 1)  # no queueing for a proxy that is not there
        threading.Thread(target=self._run, name="trtllm-liveness-iterations", daemon=True).start()

    def retarget(self, spec: ProgressSpec, rank: int) -> None:
        """Report to another engine's proxy from now on (a rank process that serves a new engine,
        as ranks launched by mpirun do); the sending thread reconnects before its next beat."""
        with self._lock:
            self._target = (spec, rank)
        self._pending.set()

    def tick(self) -> None:
        """One executor iteration (called in the executor loop: well under a microsecond)."""
        self.count += 1
        self.at = time.monotonic()
        # Under load the flag is nearly always still set (the sender clears it once per interval),
        # and set() takes the event's lock even then: test it first. No tick is lost: the count is
        # written before the test, and the sender reads the count only after it cleared the flag.
        if not self._pending.is_set():
            self._pending.set()

    def _run(self) -> None:
        import zmq

        retries = 0
        with self._lock:
            first = self._target[0].address
        # Connect now, long before the first iteration: a beat sent while the connection is still
        # being made is not taken (IMMEDIATE) and would come an interval late.
        self._sock.connect(first)
        self._connected = first
        while True:
            # A beat that could not be sent (no connection yet, the proxy slow or gone) is tried
            # again after an interval, a few times: else one quiet iteration would go unreported.
            fresh = self._pending.wait(_RECHECK_MS / 1000 if retries == 0 else 0)
            self._pending.clear()
            if not fresh:
                if retries == 0:
                    continue  # no iteration for a while, nothing to retry: wait again
                retries -= 1
            with self._lock:
                spec, rank = self._target
            if spec.address != self._connected:  # only this thread touches the socket
                if self._connected is not None:
                    with contextlib.suppress(Exception):
                        self._sock.disconnect(self._connected)
                self._sock.connect(spec.address)
                self._connected = spec.address
            payload = json.dumps({"token": spec.token, "rank": rank, "count": self.count, "at": self.at})
            try:
                self._sock.send(payload.encode(), zmq.NOBLOCK)
                retries = 0
            except zmq.Again:
                if fresh:
                    retries = _SEND_RETRIES
            except Exception:
                logger.debug("liveness: could not send an iteration beat", exc_info=True)
            time.sleep(spec.interval_s)  # coalesce: at most one beat per interval


_REPORTER: IterationReporter | None = None
_REPORTER_LOCK = threading.Lock()


def start_iteration_reporter(spec: ProgressSpec, rank: int) -> IterationReporter:
    """Count this rank's executor iterations and report them to the proxy ``spec`` names. One
    reporter per process: a rank process that serves a later engine (ranks launched by mpirun)
    reports to that engine's proxy from then on. Returns the reporter."""
    global _REPORTER
    with _REPORTER_LOCK:
        if _REPORTER is not None:
            _REPORTER.retarget(spec, rank)
            return _REPORTER
        reporter = IterationReporter(spec, rank)
        _REPORTER = reporter

    def count_iterations(module: Any) -> None:
        try:
            _wrap_checkpoint(module, reporter)
        except Exception:  # must not fail upstream's import
            logger.warning("liveness: could not count executor iterations", exc_info=True)

    patch_when_imported(HANG_DETECTOR_MODULE, count_iterations)
    return reporter


def _wrap_checkpoint(module: Any, reporter: IterationReporter) -> None:
    cls = getattr(module, "HangDetector", None)
    original = getattr(cls, "checkpoint", None)
    if cls is None or not callable(original) or getattr(original, "_trtllm_liveness", False):
        if cls is None or not callable(original):
            logger.warning("liveness: %s has no HangDetector.checkpoint: iterations are not counted", module.__name__)
        return

    def checkpoint(self: Any, *args: Any, **kwargs: Any) -> Any:
        reporter.tick()
        return original(self, *args, **kwargs)

    checkpoint._trtllm_liveness = True  # type: ignore[attr-defined]
    checkpoint.__wrapped__ = original  # type: ignore[attr-defined]
    cls.checkpoint = checkpoint

