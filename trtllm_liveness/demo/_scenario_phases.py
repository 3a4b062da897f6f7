"""A scenario's faults outside serving: during the model build, at the spawn, during shutdown.

Each runs the whole iteration for its phase (``fault_phase`` ``init`` and ``shutdown``, fault
``spawn``; see :mod:`._scenario_child`) and fills the iteration's record: whether construction
failed, and how fast (:class:`~._scenario_records.InitOutcome`), or whether ``shutdown()`` stayed
bounded with a rank killed under it (:class:`~._scenario_records.ShutdownOutcome`). Every wait is
bounded by the options; a build or shutdown that hangs is left to its daemon thread and its ranks
are ended by the harness.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any

from ..process._identity import ProcessIdentity
from ._cgroup_faults import FreezerGroup
from ._scenario_executor import Build, fatal_fields, settled_fatal_error, shutdown_outcome
from ._scenario_faults import announce_ranks, inject, settle_ranks, victims_of
from ._scenario_observe import ThreadExceptions
from ._scenario_records import ResultInProgress, ScenarioOptions

__all__ = ["run_init_fault", "run_shutdown_fault", "run_spawn_failure"]


def run_init_fault(opts: ScenarioOptions, worker_kwargs: dict[str, Any], announce: str, freezer: FreezerGroup | None,
                   draft: ResultInProgress, identities: list[ProcessIdentity]) -> None:
    """Inject the fault while the executor is being built (its ranks announced, READY not yet sent)."""
    build = Build(opts, worker_kwargs)
    announce_ranks(opts, announce, draft, identities)
    time.sleep(min(0.2, opts.init_delay_s / 4))
    t0, _ = inject(opts, victims_of(opts, identities, draft), freezer, announce, timed=False)
    draft.update(fault_at=t0)
    build.thread.join(opts.observe_s)
    hung = build.thread.is_alive()
    error = build.error
    draft.update(init=build.outcome(hung, error, error_ms=None if hung else round((time.monotonic() - t0) * 1e3, 3),
                                    restartable=getattr(error, "restartable", None)))
    settle_ranks(identities, draft, hung or build.proxy is not None)


def run_spawn_failure(opts: ScenarioOptions, worker_kwargs: dict[str, Any], draft: ResultInProgress,
                      thread_exceptions: ThreadExceptions) -> None:
    """Build while MPI_Comm_spawn fails (the child's ``main`` made PRRTE's session base unusable).
    The latency is from the death of mpi4py's manager thread to the constructor's error."""
    build = Build(opts, worker_kwargs)
    build.thread.join(opts.observe_s)
    spawn_died = next((t for t, m in zip(thread_exceptions.times, thread_exceptions.messages, strict=True)
                       if "MPI_ERR" in m), None)
    draft.update(phase="init", survivors=(), init=build.outcome(  # no rank was ever started
        build.thread.is_alive(), build.error,
        error_ms=None if build.at is None or spawn_died is None else round((build.at - spawn_died) * 1e3, 3),
        spawn_failed=spawn_died is not None))


def run_shutdown_fault(opts: ScenarioOptions, proxy: Any, identities: list[ProcessIdentity], announce: str,
                       draft: ResultInProgress) -> None:
    """Kill ``fault_rank`` while ``shutdown()`` runs: shutdown must stay bounded and account for it."""
    victims = victims_of(opts, identities, draft)
    done = threading.Event()

    def shut() -> None:
        try:
            proxy.shutdown()
        finally:
            done.set()

    t_start = time.monotonic()
    threading.Thread(target=shut, name="scenario-shutdown", daemon=True).start()
    with contextlib.suppress(Exception):  # the rank may already be gone: that is the race
        fault_at, _ = inject(opts, victims, None, announce, timed=False)
        draft.update(fault_at=fault_at)
    finished = done.wait(opts.observe_s)
    draft.update(shutdown=shutdown_outcome(
        proxy, shutdown_ms=round((time.monotonic() - t_start) * 1e3, 3) if finished else None, hung=not finished))
    draft.update(**fatal_fields(proxy, settled_fatal_error(proxy, wait=bool(getattr(proxy, "liveness_events", [])))))
    settle_ranks(identities, draft, not finished or os.path.isdir(getattr(proxy, "_ipc_dir", "")),
                 lambda: proxy._close_queues())
