"""The process-wide signal ledger: a given signal reaches a given process once across concurrent stops.

Two concurrent calls of :func:`~._bounded_stop.stop_processes` (a health path and an atexit path,
say) may stop the same process. Each call waits on its own pidfds and keeps its own deadlines, but
a given signal is sent to a given process (pid, start time) once across all calls in flight: a
second SIGTERM could cut short the cleanup handler the first one started. A call holds a reference
on each process's entry while it runs (:func:`acquire`/:func:`release`); an entry without
references is dropped. A re-entrant lock keeps a call made from a signal handler that interrupted
this very thread from deadlocking (though that use is discouraged: see ``stop_processes``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["Key", "acquire", "claim", "release", "unclaim", "was_sent"]

Key = tuple[int, int]


@dataclass
class _Ledger:
    refs: int = 0
    sent: set[int] = field(default_factory=set)


_ledger_lock = threading.RLock()
_ledgers: dict[Key, _Ledger] = {}


def _reset_ledger_after_fork() -> None:
    # A forked child must not inherit a lock held by a thread that does not exist there.
    global _ledger_lock
    _ledger_lock = threading.RLock()
    _ledgers.clear()


os.register_at_fork(after_in_child=_reset_ledger_after_fork)


def acquire(key: Key) -> None:
    """Hold ``key``'s entry for the calling stop (released by :func:`release`)."""
    with _ledger_lock:
        _ledgers.setdefault(key, _Ledger()).refs += 1


def release(key: Key) -> None:
    """Drop one hold on ``key``'s entry; the last one forgets what was sent to it."""
    with _ledger_lock:
        entry = _ledgers.get(key)
        if entry is not None:
            entry.refs -= 1
            if entry.refs <= 0:
                del _ledgers[key]


def claim(key: Key, sig: int) -> bool:
    """Reserve sending ``sig`` to ``key``; False when some call already sent it."""
    with _ledger_lock:
        entry = _ledgers.setdefault(key, _Ledger())
        if sig in entry.sent:
            return False
        entry.sent.add(sig)
        return True


def was_sent(key: Key, sig: int) -> bool:
    """Whether some call in flight sent ``sig`` to ``key``."""
    with _ledger_lock:
        entry = _ledgers.get(key)
        return entry is not None and sig in entry.sent


def unclaim(keys: Iterable[Key], sig: int) -> None:
    """Forget that ``sig`` was sent to ``keys`` (a group signal reserved but then not sent)."""
    with _ledger_lock:
        for key in keys:
            entry = _ledgers.get(key)
            if entry is not None:
                entry.sent.discard(sig)
