"""Validation of worker identities from upstream or the side channel: per element, never a crash.

One bad element (a wrong type, a duplicate rank) drops that element with a logged reason; the
proxy's own pid (rank 0 runs inside the proxy under ``MpiCommSession``) is dropped quietly; the
rest are kept and watched. ``None`` start time or PID namespace (upstream's Optional fields, when
a /proc read failed) is accepted: the monitor watches such a rank by pidfd and never signals it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from ...process._identity import ProcessIdentity, parse_identities

logger = logging.getLogger(__name__.rpartition(".")[0])


def as_fields(item: Any) -> Any:
    """Upstream's identity may be a NamedTuple, a dataclass or a dict; the parser judges it."""
    fields = ProcessIdentity._fields
    if isinstance(item, (tuple, list, dict)) or not all(hasattr(item, name) for name in fields):
        return item
    return tuple(getattr(item, name) for name in fields)


def validate_identities(payload: Any, *, exclude_pids: Iterable[int] = (),
                        source: str = "upstream") -> list[ProcessIdentity]:
    """The valid identities of ``payload``, sorted by rank; each bad element logged and dropped.

    A payload that is not a list at all (or too long) is logged and gives ``[]``. Never raises.
    Thread-safe; no I/O.
    """
    items = [as_fields(item) for item in payload] if isinstance(payload, (list, tuple)) else payload
    try:
        return parse_identities(items, per_element=True, exclude_pids=exclude_pids, own_pid=0)
    except (ValueError, TypeError) as exc:
        logger.error("liveness: rejected worker identities from %s: %s", source, exc)
        return []
