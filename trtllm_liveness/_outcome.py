"""The engine's outcome, for a launcher whose own exit status cannot be trusted.

``mpirun`` (PRRTE) ends a job whose host crashed with exit status 0 (measured on the test hosts:
it notices the lost daemon and ends every rank, the proxy included, before any of them can exit
with an error), so an orchestrator sees success after an engine death. ``trtllm-liveness launch``
(:mod:`trtllm_liveness._cli_launch`) runs the launcher with :data:`OUTCOME_ENV` naming a file in a
private directory; the engine's fatal path writes its error there at once (a few hundred bytes of
JSON, from a daemon thread, before anything else can end the process), and the wrapper turns a
zero status with a recorded fatal error into the error's status. Standard library only.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass

logger = logging.getLogger(__name__)

OUTCOME_ENV = "TRTLLM_LIVENESS_OUTCOME"
"""Path of the outcome file, set by ``trtllm-liveness launch`` for the launcher it runs."""
_LIMIT = 8192


@dataclass(frozen=True)
class Outcome:
    """A recorded fatal error: its message, whether it is restartable, the status it calls for."""

    message: str
    restartable: bool
    exit_code: int


def record_outcome(message: str, restartable: bool, exit_code: int,
                   environ: dict[str, str] | None = None) -> threading.Thread | None:
    """Write the outcome where :data:`OUTCOME_ENV` says, in a daemon thread; the first record wins
    (``O_EXCL``: the file is made once). Returns the thread, or None when no wrapper asked."""
    path = (os.environ if environ is None else environ).get(OUTCOME_ENV, "")
    if not path:
        return None
    body = json.dumps({"message": message[:4000], "restartable": restartable, "exit_code": exit_code}).encode()

    def write() -> None:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
        except FileExistsError:
            return
        except OSError as exc:
            logger.warning("liveness: could not record the outcome in %s: %s", path, exc)
            return
        try:
            os.write(fd, body)
            os.fsync(fd)
        except OSError as exc:
            logger.warning("liveness: could not record the outcome in %s: %s", path, exc)
        finally:
            os.close(fd)

    thread = threading.Thread(target=write, name="trtllm-liveness-outcome", daemon=True)
    thread.start()
    return thread


def read_outcome(path: str) -> Outcome | None:
    """The recorded outcome, or None (no file). A malformed file is a ``ValueError``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    try:
        raw = os.read(fd, _LIMIT + 1)
    finally:
        os.close(fd)
    if len(raw) > _LIMIT:
        raise ValueError(f"outcome file {path} is larger than {_LIMIT} bytes")
    data = json.loads(raw)
    if not isinstance(data, dict) or not isinstance(data.get("message"), str) \
            or not isinstance(data.get("restartable"), bool) or not isinstance(data.get("exit_code"), int) \
            or isinstance(data.get("exit_code"), bool) or not 1 <= data["exit_code"] <= 255:
        raise ValueError(f"outcome file {path} is malformed")
    return Outcome(data["message"], data["restartable"], data["exit_code"])
