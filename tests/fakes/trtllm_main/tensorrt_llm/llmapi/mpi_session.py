"""Fake ``tensorrt_llm.llmapi.mpi_session`` (main): ``release_exit_joins``, ``abandon``, ``check_worker_error``."""

from __future__ import annotations

import sys
import threading
from typing import Any, NamedTuple

from _trtllm_fake_common import (
    MpiCommSessionBase,
    MpiPoolSessionBase,
    MpiSessionBase,
    RemoteMpiCommSessionClientBase,
    RemoteTask,
    serve_comm_workers,
)

from ..executor.ipc import ZeroMqQueue


class MpiSession(MpiSessionBase):
    def release_exit_joins(self) -> None:
        """Non-destructive: nothing may wait forever on a dead worker world. Default: no-op."""

    def abandon(self) -> None:
        """Tear down without waiting on a dead worker world."""
        self.release_exit_joins()
        self.shutdown(wait=False)


def _abandon_mpi_pool_threads(mpi_pool: Any) -> None:
    """Deregister the pool's manager thread from mpi4py's and CPython's exit joins (best effort)."""
    thread = getattr(getattr(mpi_pool, "_pool", None), "thread", None)
    if thread is None:
        return
    for name in ("mpi4py.futures._lib", "mpi4py.futures._core"):
        registry = getattr(sys.modules.get(name), "THREADS_QUEUES", None)
        if registry is not None:
            registry.pop(thread, None)
    lock = getattr(thread, "_tstate_lock", None)
    locks = getattr(threading, "_shutdown_locks", None)
    if lock is not None and locks is not None:
        locks.discard(lock)


class MpiPoolSession(MpiPoolSessionBase, MpiSession):
    def release_exit_joins(self) -> None:
        if self.mpi_pool is not None:
            _abandon_mpi_pool_threads(self.mpi_pool)
        self._pool_dead = True

    def shutdown(self, wait: bool = True) -> None:
        if getattr(self, "_pool_dead", False):
            wait = False  # a dead pool can never be joined
        super().shutdown(wait=wait)


class MpiCommSession(MpiCommSessionBase, MpiSession):
    pass


class RemoteWorkerDeath(NamedTuple):
    exc_type: str
    message: str

    @classmethod
    def from_exception(cls, e: BaseException) -> RemoteWorkerDeath:
        return cls(exc_type=type(e).__name__, message=str(e))

    def to_exception(self) -> RuntimeError:
        return RuntimeError(f"Remote MPI worker died: {self.exc_type}: {self.message}")


class RemoteMpiCommSessionClient(RemoteMpiCommSessionClientBase, MpiSession):
    queue_cls = ZeroMqQueue

    def check_worker_error(self) -> RuntimeError | None:
        """Non-blocking: a ``RemoteWorkerDeath`` (sent by the server only for FAILED tasks) or None."""
        while self.queue.poll(0):
            message = self.queue.get()
            if isinstance(message, RemoteWorkerDeath):
                return message.to_exception()
            self._pending_responses.append(message)
        return None


__all__ = ["MpiCommSession", "MpiPoolSession", "MpiSession", "RemoteMpiCommSessionClient", "RemoteTask",
           "RemoteWorkerDeath", "serve_comm_workers"]
