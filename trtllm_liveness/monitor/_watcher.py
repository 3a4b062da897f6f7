"""The watcher thread and everything it sleeps on: one owner for the thread, its wakeup and the pidfds.

Shape of CPython's ``concurrent.futures.process`` (``_ExecutorManagerThread`` + ``_ThreadWakeup``):

- :class:`Wakeup` is a self-pipe. Anybody may :meth:`~Wakeup.wake` it; only the watcher thread
  clears it (docs/development.md, "The watcher owns its wakeup", says what a drained one breaks).
- :class:`PidfdWatcher` holds two epoll sets over the same pidfds. The *watch* set also holds the
  wakeup and is waited on by the watcher thread alone; the *check* set holds only pidfds and is
  what synchronous checks poll with a zero timeout. So checks never see, let alone drain, the
  wakeup.
- The pidfds, both epolls and the pipe are released exactly once, when the owner has closed the
  watcher *and* no watcher thread is running, whichever happens last (a watcher stuck in a slow
  subscriber releases them itself when it ends; the closer never closes them under it).

The thread holds its target only by weak reference between waits, so a dropped monitor ends it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
import weakref
from typing import Protocol

logger = logging.getLogger(__name__)

_EPOLL_FLAGS = select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR
THREAD_NAME = "trtllm-liveness-watcher"


class WatcherClosed(RuntimeError):
    """:meth:`PidfdWatcher.start` after :meth:`PidfdWatcher.close`: the owner is closed."""


class WatchTarget(Protocol):
    """What the watcher thread calls back into (the monitor). Both run in the watcher thread."""

    def _watch_timeout(self) -> float | None:
        """Seconds until the next periodic tick is due, or None to sleep until an event."""

    def _watch_handle(self, ready: list[int]) -> None:
        """Handle readable pidfds (possibly none: a tick or a wakeup) and run due periodic work."""


class Wakeup:
    """A non-blocking self-pipe. :meth:`wake` from any thread; :meth:`clear` by the watcher alone."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def wake(self) -> None:
        try:
            os.write(self.write_fd, b"x")
        except OSError:
            pass  # full (a wakeup is already pending) or closed (released: nobody to wake)

    def clear(self) -> None:
        try:
            while os.read(self.read_fd, 4096):
                pass
        except OSError:
            pass  # EAGAIN: empty

    def close(self) -> None:
        _close_quietly(self.write_fd)
        _close_quietly(self.read_fd)


class PidfdWatcher:
    """Owns the watcher thread, its :class:`Wakeup`, the two epoll sets and every pidfd added.

    Lifecycle: :meth:`add`/:meth:`discard` pidfds at any time; :meth:`start` and :meth:`stop` the
    thread any number of times (each idempotent); :meth:`close` once (idempotent) when the owner is
    done. All methods are thread-safe. Descriptors are released exactly once: at :meth:`close` when
    no thread runs, otherwise by the last thread on its way out.

    ``pidfd_capable=False`` (no pidfd support here): no epoll is made; the thread sleeps on the
    wakeup alone with ``poll`` and the owner's procfs ticks do the rest.
    """

    def __init__(self, *, pidfd_capable: bool = True) -> None:
        self._lock = threading.Lock()
        self._wakeup = Wakeup()
        self._watch_set: select.epoll | None = None
        self._check_set: select.epoll | None = None
        if pidfd_capable:
            self._watch_set = select.epoll()
            self._check_set = select.epoll()
            self._watch_set.register(self._wakeup.read_fd, _EPOLL_FLAGS)
        self._pidfds: set[int] = set()
        self._thread: threading.Thread | None = None
        self._stop_requested = False
        self._running = 0  # threads running (an old one may still be leaving after a restart)
        self._closed = False
        self._released = False
        self.error: BaseException | None = None

    @property
    def pidfd_capable(self) -> bool:
        return self._check_set is not None

    # ----------------------------------------------------------------- descriptors

    def add(self, pidfd: int) -> None:
        """Take ownership of ``pidfd`` and watch it. Raises ``RuntimeError`` after release."""
        with self._lock:
            if self._released or self._watch_set is None or self._check_set is None:
                raise RuntimeError("watcher descriptors are released")
            self._pidfds.add(pidfd)
            self._watch_set.register(pidfd, _EPOLL_FLAGS)
            self._check_set.register(pidfd, _EPOLL_FLAGS)

    def discard(self, pidfd: int) -> None:
        """Stop watching ``pidfd`` and close it; a no-op for an fd not owned (or already released)."""
        with self._lock:
            if pidfd not in self._pidfds:
                return
            self._pidfds.discard(pidfd)
            for epoll in (self._watch_set, self._check_set):
                if epoll is not None:
                    with contextlib.suppress(OSError, ValueError):
                        epoll.unregister(pidfd)
            _close_quietly(pidfd)

    def ready_now(self) -> list[int]:
        """Pidfds readable right now (their process exited). Never blocks, never touches the wakeup.

        The caller re-tests each fd under its own lock: a number reported here may have been
        discarded and reused by a newer pidfd since.
        """
        check_set = self._check_set
        if check_set is None:
            return []
        with self._lock:
            if self._released or not self._pidfds:
                return []
        try:
            return [fd for fd, _mask in check_set.poll(0)]
        except (OSError, ValueError):
            return []  # released between the test and the poll

    def wake(self) -> None:
        """Make the watcher re-evaluate its timeout (new registrations, stop, close)."""
        with self._lock:
            if not self._released:
                self._wakeup.wake()

    # ----------------------------------------------------------------- the thread

    def start(self, target: WatchTarget) -> None:
        """Start the thread for ``target`` (held by weak reference); a no-op while one runs.

        Raises :class:`WatcherClosed` (a ``RuntimeError``) after :meth:`close`; any other
        ``RuntimeError`` is the thread's own failure to start.
        """
        with self._lock:
            if self._closed:
                raise WatcherClosed("watcher is closed")
            self._stop_requested = False
            if self._thread is not None:
                return  # running, and it has not decided to leave (it decides under this lock)
            self._running += 1
            self._thread = threading.Thread(
                target=self._run, args=(weakref.ref(target),), name=THREAD_NAME, daemon=True,
            )
            # Started under the lock, so stop() never joins a thread not yet started (the new
            # thread's first step takes this lock, so it waits for us).
            try:
                self._thread.start()
            except BaseException:
                # Out of threads: leave no phantom thread behind (it would block every later
                # start and the release of the descriptors).
                self._thread = None
                self._running -= 1
                raise

    def stop(self, timeout: float) -> bool:
        """Ask the thread to stop and join it for at most ``timeout`` s; True when none runs then.

        Called from the watcher thread itself (a subscriber), asks and returns False at once.
        """
        with self._lock:
            thread = self._thread
            self._stop_requested = True
            if not self._released:
                self._wakeup.wake()
        if thread is None:
            return True
        if thread is threading.current_thread():
            return False
        thread.join(max(0.0, timeout))
        return not thread.is_alive()

    def close(self, timeout: float) -> bool:
        """Stop the thread (bounded) and release every descriptor, now or when the thread ends.

        Idempotent. Returns True when the descriptors are released on return.
        """
        self.stop(timeout)
        with self._lock:
            self._closed = True
            if not self._released:
                self._wakeup.wake()  # a start() racing stop() may have cleared the stop request
            self._release_if_unused_locked()
            return self._released

    @property
    def alive(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    def _run(self, ref: weakref.ReferenceType[WatchTarget]) -> None:
        poller: select.poll | None = None
        if self._watch_set is None:
            poller = select.poll()
            poller.register(self._wakeup.read_fd, select.POLLIN)
        wake_fd = self._wakeup.read_fd
        try:
            while True:
                with self._lock:
                    # Decided under the lock, so a concurrent start() either sees this thread gone
                    # (and starts another) or has cleared the request (and this one goes on).
                    if self._stop_requested or self._closed:
                        self._thread = None if self._thread is threading.current_thread() else self._thread
                        return
                target = ref()
                if target is None:
                    return
                timeout = target._watch_timeout()
                del target
                if self._watch_set is not None:
                    events = self._watch_set.poll(-1.0 if timeout is None else max(0.0, timeout))
                    ready = [fd for fd, _mask in events if fd != wake_fd]
                    if len(ready) != len(events):
                        self._wakeup.clear()
                else:
                    assert poller is not None
                    if poller.poll(None if timeout is None else max(0.0, timeout) * 1000.0):
                        self._wakeup.clear()
                    ready = []
                target = ref()
                if target is None:
                    return
                target._watch_handle(ready)
                del target
        except BaseException as exc:  # fail loudly: the engine must not become silently unmonitored
            self.error = exc
            logger.critical(
                "liveness watcher thread died (%r); worker deaths are now seen only by synchronous "
                "checks (check_health / find_dead_worker)", exc, exc_info=True,
            )
        finally:
            with self._lock:
                self._running -= 1
                if self._thread is threading.current_thread():
                    self._thread = None
                self._release_if_unused_locked()

    def _release_if_unused_locked(self) -> None:
        if self._released or not self._closed or self._running:
            return
        self._released = True
        self._close_descriptors()

    def release_in_forked_child(self) -> None:
        """Drop this (forked) process's copies of the descriptors without taking the lock.

        A lock copied while another thread of the parent held it would never be released here, and
        no watcher thread exists in the child. The parent's epoll registrations are unaffected.
        """
        if self._released:
            return
        self._released = True
        self._closed = True
        self._close_descriptors()

    def _close_descriptors(self) -> None:
        """Close every descriptor the watcher owns: the pidfds, the epoll sets and the wakeup."""
        for fd in self._pidfds:
            _close_quietly(fd)
        self._pidfds.clear()
        for epoll in (self._watch_set, self._check_set):
            if epoll is not None:
                epoll.close()
        self._wakeup.close()


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
