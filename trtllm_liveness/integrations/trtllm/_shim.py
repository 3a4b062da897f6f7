"""The monitor shim: what upstream main sees as ``_worker_process_monitor``.

Upstream main registers the identities of its early message with its own monitor and calls
``find_dead_worker()`` from ``check_health()`` and its 5 s loop; its ``pre_shutdown()`` closes the
monitor to mark that expected exits begin. With liveness on, the proxy hands upstream this shim
instead, so one registration lands in the liveness monitor (validated per element, the proxy's own
pid dropped) and ``close()`` marks expected exits; the monitor itself belongs to the proxy.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from ..._events import WorkerState
from ...monitor._monitor import WorkerProcessMonitor
from ...process._identity import ProcessIdentity, is_local
from ._identities import validate_identities

logger = logging.getLogger(__name__.rpartition(".")[0])


class MonitorShim:
    """Upstream's monitor interface over the liveness monitor (see the module docstring).

    ``on_close`` is called for each upstream ``close()``: the proxy marks expected exits there.
    ``own_view`` (observe mode): ``find_dead_worker()`` answers as upstream's own monitor would, for
    the ranks upstream itself registered only (a rank of another host, or one registered through
    the extension's side channel, is nothing upstream would have watched).
    """

    def __init__(self, monitor: WorkerProcessMonitor, on_close: Callable[[], None] | None = None, *,
                 own_view: bool = False) -> None:
        self._monitor = monitor
        self._on_close = on_close
        self._own_view = own_view
        self._registered: frozenset[tuple[int, int]] = frozenset()  # (rank, pid) upstream registered

    def register(self, identities: Any) -> None:
        validated = validate_identities(identities, exclude_pids=(os.getpid(),))
        if not validated:
            return
        self._registered |= {(identity.rank, identity.pid) for identity in validated if is_local(identity)}
        try:
            self._monitor.register(validated)
        except RuntimeError:  # closed meanwhile (shutdown or an aborted start): nothing to watch
            logger.warning("liveness: worker identities arrived after the monitor was closed; ignored")
        except ValueError as exc:  # the core rejected what the per-element check let through
            logger.error("liveness: rejected worker identities from upstream: %s", exc)

    def find_dead_worker(self) -> ProcessIdentity | None:
        if not self._own_view:
            return self._monitor.find_dead_worker()
        self._monitor.check()
        for status in self._monitor.statuses():
            who = status.identity
            if status.state.is_dead and status.state is not WorkerState.EXITED_EXPECTED \
                    and (who.rank, who.pid) in self._registered:
                return who
        return None

    def close(self, *args: Any, **kwargs: Any) -> None:
        """Upstream's close: expected exits begin (the proxy keeps and later closes the monitor)."""
        del args, kwargs
        if self._on_close is not None:
            self._on_close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._monitor, name)
