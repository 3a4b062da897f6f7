"""Exception types of trtllm_liveness.

Modelled on psutil's hierarchy: every process error carries the pid, the start time (clock ticks
since boot, ``None`` when unknown) and a name, and pickles through ``__reduce__`` so it can cross
an IPC queue. A zombie is a kind of gone process, and so is a recycled PID.
"""

from __future__ import annotations

import errno
import functools
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

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


_P = ParamSpec("_P")
_R = TypeVar("_R")


def translate_oserror(func: Callable[_P, _R]) -> Callable[_P, _R]:
    """Map ``OSError`` raised while handling a pid to this package's errors.

    The wrapped function must take the pid as its first positional argument.
    """

    @functools.wraps(func)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return func(*args, **kwargs)
        except (FileNotFoundError, ProcessLookupError) as exc:
            raise ProcessGone(_pid_of(args)) from exc
        except PermissionError as exc:
            raise AccessDenied(_pid_of(args)) from exc
        except OSError as exc:
            if exc.errno == errno.ESRCH:
                raise ProcessGone(_pid_of(args)) from exc
            raise

    return wrapper


def _pid_of(args: tuple[Any, ...]) -> int:
    pid = args[0] if args else -1
    return pid if isinstance(pid, int) else -1
