"""MpiPoolSession: upstream's wrapper over ``mpi4py.futures.MPIPoolExecutor``.

Workers are spawned with ``MPI_Comm_spawn`` under ``prte``: they are grandchildren of the proxy,
so it cannot ``waitpid`` them and MPI does not tell it their PIDs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ._mpi_env import configure_mpi_env

logger = logging.getLogger(__name__)


class MpiPoolSession:
    """``submit(fn, **kwargs)`` runs ``fn`` once on each of ``n_workers`` spawned ranks.

    Not thread-safe (like upstream). Nothing here blocks for long: ``shutdown`` does not wait
    (a dead rank would make ``wait=True`` hang forever: measured with Open MPI 4.1 and with a SIGSTOPped rank).
    """

    def __init__(self, n_workers: int) -> None:
        if n_workers < 1:
            raise ValueError(f"n_workers must be >= 1, got {n_workers}")
        configure_mpi_env()
        from mpi4py.futures import MPIPoolExecutor

        self.n_workers = n_workers
        self.mpi_pool: Any = MPIPoolExecutor(max_workers=n_workers)
        self._closed = False

    def submit(self, task: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Future[Any]]:
        """One future per rank (MPIPoolExecutor hands each idle worker one long-running task)."""
        return [self.mpi_pool.submit(task, *args, **kwargs) for _ in range(self.n_workers)]

    def shutdown(self, wait: bool = False) -> None:
        """Stop the pool. Departure from upstream: never ``wait=True`` (it hangs on a dead rank)."""
        del wait
        if self._closed:
            return
        self._closed = True
        try:
            self.mpi_pool.shutdown(wait=False, cancel_futures=True)
        except Exception:
            logger.debug("MPIPoolExecutor.shutdown raised", exc_info=True)
