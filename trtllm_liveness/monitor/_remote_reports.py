"""Merging remote ranks' reports: what another host's agent (or the hub, for a lost host) says.

A report is hearsay about a rank this host cannot observe, so it is taken only when it is about a
remote rank that is not observed here and matches the registered identity; a death, or any fatal
verdict, stands against a later non-fatal report (a late message). Nothing here signals anything,
and a remote rank is never a signal target. The monitor calls :func:`merge_remote_reports` under
its lock and then claims each taken rank's event through its one exactly-once path.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from .._events import MonitorMethod, WorkerState
from ..process._identity import ProcessIdentity, is_local
from ._watched_rank import WatchedRank

__all__ = ["merge_remote_reports"]

logger = logging.getLogger(__name__)


def merge_remote_reports(records: dict[int, WatchedRank],
                         updates: Sequence[tuple[ProcessIdentity, WorkerState, str]], *,
                         via: MonitorMethod) -> list[WatchedRank]:
    """Apply ``updates`` to ``records`` (by rank; a rank never registered gets a record here) and
    return the records taken, in order; each rejected report is logged. Every state is set before
    the caller claims any event, so a subscriber sees a whole host's view. Not thread-safe: the
    monitor's lock guards ``records``."""
    taken: list[tuple[WatchedRank, WorkerState, str]] = []
    for identity, state, detail in updates:
        if is_local(identity):
            logger.warning("liveness: ignored a remote report about local %s", identity.describe())
            continue
        record = records.get(identity.rank)
        if record is None:
            record = WatchedRank(identity, WorkerState.UNMONITORED_REMOTE, MonitorMethod.NONE)
            records[identity.rank] = record
        elif not _same_process(record.identity, identity) or record.method.signals:
            logger.warning("liveness: ignored a remote report about %s: rank %d is registered as %s",
                           identity.describe(), identity.rank, record.identity.describe())
            continue
        taken.append((record, state, detail))
    for record, state, detail in taken:
        if record.state.is_dead or (record.state.is_fatal and not state.is_fatal):
            continue  # a death or a fatal verdict stands; what comes later is a late message
        record.method = via
        record.set_state(state, detail)
    return [record for record, _state, _detail in taken]


def _same_process(registered: ProcessIdentity, reported: ProcessIdentity) -> bool:
    """Whether an agent's identity is the registered one (a start time unknown on one side is not
    held against it: upstream may send None)."""
    if registered[:2] != reported[:2] or registered.hostname != reported.hostname:
        return False
    return None in (registered.start_time, reported.start_time) or registered.start_time == reported.start_time
