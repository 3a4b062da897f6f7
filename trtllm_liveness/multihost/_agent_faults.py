"""A host agent's answer to its hub's ``fault`` requests: :class:`FaultHandler` refuses every one.
Only a drill's hub hands its agents one that makes them (:attr:`~._agent.AgentSettings.faults`)."""

from __future__ import annotations

import logging
import signal
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ._channel import Tally

if TYPE_CHECKING:
    from ..process._identity import ProcessIdentity
    from ..stop._stop_report import StopReport
    from ._wire import Message

logger = logging.getLogger(__name__)

FAULTS = ("kill", "stop", "wedge")
FAULT_SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}  # the faults a signal makes (a drill's, any host)


class FaultHandler:
    """Refuses every ``fault`` message (:meth:`handle`). Its agent's thread alone calls it: passes its
    stop's report of the host's ranks through :meth:`after_stop`, calls :meth:`release` at its end."""

    def __init__(self, own: ProcessIdentity, identities: Sequence[ProcessIdentity]) -> None:
        self.own = own
        self.identities = {identity.rank: identity for identity in identities}
        self.rejected = Tally(logger, "liveness: the host agent on %s rejected a fault request (%d so far): %s", 1)

    def handle(self, message: Message) -> dict[str, Any]:
        """The ``faulted`` answer's fields for one ``fault`` message (never raises)."""
        req, rank, fault = (message.body.get(key) for key in ("req", "rank", "fault"))
        self.rejected.note(self.own.hostname, f"rank {rank!r}, fault {fault!r}: this engine was not started as a drill")
        return self._answer(req, rank, fault, "refused", f"the agent on host {self.own.hostname} refuses faults: "
                            "its engine was not started as a drill")

    def after_stop(self, report: StopReport) -> StopReport:
        return report

    def release(self) -> None:
        """Undo what the handler made (bounded; never raises)."""

    def _answer(self, req: Any, rank: Any, fault: Any, outcome: str, detail: str, *, pid: int = 0,
                age: float | None = None) -> dict[str, Any]:
        """The ``faulted`` message's fields (a bad request number, rank, fault as 1, 0, ``?``; ``age`` in s)."""
        def number(value: Any, high: int) -> int:
            return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= high else 0

        return {"req": number(req, 1 << 62) or 1, "rank": number(rank, 1 << 24),
                "fault": fault if isinstance(fault, str) and fault in FAULTS else "?", "outcome": outcome,
                "pid": pid, "detail": detail[:2000], "age": age}
