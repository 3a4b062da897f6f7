"""Exception types of trtllm_liveness.

Modelled on psutil's hierarchy: every process error carries the pid, the start time (clock ticks
since boot, ``None`` when unknown) and a name, and pickles through ``__reduce__`` so it can cross
an IPC queue. A zombie is a kind of gone process, and so is a recycled PID.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AccessDenied",
    "InvalidIdentityError",
    "LivenessError",
    "PidReused",
    "ProcessGone",
    "ProcessZombie",
]


class LivenessError(Exception):
    """Base of every process error raised by this package."""

    _default_message = "process error"  # each kind's own, where no ``msg`` is given

    def __init__(
        self, pid: int, start_time: int | None = None, name: str = "", msg: str = ""
    ) -> None:
        self.pid = pid
        self.start_time = start_time
        self.name = name
        self.msg = msg or self._default_message
        super().__init__(self.msg)

    def __str__(self) -> str:
        detail = f"pid={self.pid}"
        if self.name:
            detail += f", name={self.name!r}"
        if self.start_time is not None:
            detail += f", start_time={self.start_time}"
        return f"{self.msg} ({detail})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.pid, self.start_time, self.name, self.msg))


class ProcessGone(LivenessError):
    """The process no longer exists (exited and reaped, or never existed)."""

    _default_message = "process no longer exists"


class ProcessZombie(ProcessGone):
    """The process has exited but its parent has not reaped it yet."""

    _default_message = "process is a zombie"


class PidReused(ProcessGone):
    """The PID now belongs to another process (its start time differs)."""

    _default_message = "PID was reused by another process"


class AccessDenied(LivenessError):
    """The kernel refused to let us inspect or signal the process."""

    _default_message = "access denied"


class InvalidIdentityError(ValueError):
    """An identity payload (for example one received over IPC) is malformed or unsafe."""
