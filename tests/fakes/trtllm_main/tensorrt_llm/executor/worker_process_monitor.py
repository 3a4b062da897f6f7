"""Fake ``tensorrt_llm.executor.worker_process_monitor`` (main).

Identity ``(rank, pid, start_time, hostname, pid_namespace)`` with ``start_time`` and
``pid_namespace`` None when the /proc read fails. ``register`` skips identities of another host or
PID namespace, opens a pidfd per identity and checks it (zombie, gone, start time changed) right
after opening; ``find_dead_worker`` is a ``poll(0)``; ``close`` drops everything.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
from typing import NamedTuple

logger = logging.getLogger(__name__)

PROC_ROOT = "/proc"  # a test may point this elsewhere to make the reads fail


class WorkerProcessIdentity(NamedTuple):
    rank: int
    pid: int
    start_time: int | None
    hostname: str
    pid_namespace: int | None


def _read_process_state(pid: int) -> tuple[str, int] | None:
    try:
        with open(f"{PROC_ROOT}/{pid}/stat", encoding="utf-8") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    end = stat.rfind(")")
    if end < 0:
        return None
    fields = stat[end + 2:].split()
    if len(fields) <= 19:
        return None
    return fields[0], int(fields[19])


def _read_pid_namespace(pid: int) -> int | None:
    try:
        return os.stat(f"{PROC_ROOT}/{pid}/ns/pid").st_ino
    except OSError:
        return None


def capture_worker_process_identity(rank: int, pid: int | None = None) -> WorkerProcessIdentity:
    pid = os.getpid() if pid is None else pid
    try:
        state = _read_process_state(pid)
    except (OSError, ValueError):
        state = None
    return WorkerProcessIdentity(rank=rank, pid=pid, start_time=state[1] if state is not None else None,
                                 hostname=socket.gethostname(), pid_namespace=_read_pid_namespace(pid))


class WorkerProcessMonitor:
    def __init__(self) -> None:
        self._pidfds: dict[int, WorkerProcessIdentity] = {}
        self._procfs: list[WorkerProcessIdentity] = []
        self._dead: WorkerProcessIdentity | None = None
        self._poller = select.poll()
        self._lock = threading.Lock()
        self._hostname = socket.gethostname()
        self._pid_namespace = _read_pid_namespace(os.getpid())

    def register(self, identities: list[WorkerProcessIdentity]) -> None:
        with self._lock:
            self._close_unlocked()
            for identity in identities:
                if identity.hostname != self._hostname or identity.pid_namespace != self._pid_namespace:
                    continue
                try:
                    pidfd = os.pidfd_open(identity.pid)
                except ProcessLookupError:
                    self._dead = identity
                    continue
                except OSError as error:
                    logger.debug("pidfd_open(%d) failed: %s", identity.pid, error)
                    if identity.start_time is not None:
                        self._procfs.append(identity)
                    continue
                if identity.start_time is not None:
                    state = _read_process_state(identity.pid)
                    if state is None or state[0] == "Z" or state[1] != identity.start_time:
                        os.close(pidfd)
                        self._dead = identity
                        continue
                self._pidfds[pidfd] = identity
                self._poller.register(pidfd, select.POLLIN | select.POLLERR | select.POLLHUP)

    def find_dead_worker(self) -> WorkerProcessIdentity | None:
        with self._lock:
            if self._dead is not None:
                return self._dead
            for pidfd, _ in self._poller.poll(0):
                identity = self._pidfds.get(pidfd)
                if identity is not None:
                    self._dead = identity
                    return identity
            for identity in self._procfs:
                state = _read_process_state(identity.pid)
                if state is None or state[0] == "Z" or state[1] != identity.start_time:
                    self._dead = identity
                    return identity
            return None

    def close(self) -> None:
        with self._lock:
            self._close_unlocked()

    def _close_unlocked(self) -> None:
        for pidfd in self._pidfds:
            try:
                self._poller.unregister(pidfd)
            except (KeyError, OSError):
                pass
            try:
                os.close(pidfd)
            except OSError:
                pass
        self._pidfds.clear()
        self._procfs.clear()
        self._dead = None
