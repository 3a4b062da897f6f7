"""The engine's outcome, for a launcher whose own exit status cannot be trusted.

docs/multihost.md (the paragraph on ``trtllm-liveness launch``) says why (``mpirun`` exits 0 after a
host crash), what each record below means to the wrapper, and which status it exits with.
``trtllm-liveness launch`` (:mod:`trtllm_liveness.cli._launch_command`) runs the launcher with
:data:`OUTCOME_ENV` naming a private directory; every engine process writes its own
``outcome.<pid>.json`` there:

- ``running`` when its engine starts (with the status a failure calls for);
- ``failed`` at its first fatal error (first thing on the fatal path, synchronously into the
  wrapper's outcome pipe, :mod:`._outcome_pipe`, where the wrapper runs on this host; the file
  from a thread the process's ending awaits; sticky: nothing overwrites it but the same failure
  with its snapshot, the typed :class:`~._snapshot_record.FatalSnapshot` of every rank taken
  before the bounded stop, once, or turned unrestartable, once);
- ``clean`` when its engine shut down healthy, or its interpreter exits normally with no failure.

Writes are atomic (temporary file, rename).
"""

from __future__ import annotations

import functools
import glob
import json
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

from .._record_fields import JsonFields
from ..process._procfs import own_pid_namespace, start_time_or_none
from ._outcome_pipe import PipedFailure, compact_json, open_writer, send_failure
from ._process_ending import WRITE_BOUND_S, OutcomeLedger, Stage, process_ending
from ._snapshot_record import FatalSnapshot

logger = logging.getLogger(__name__)

OUTCOME_ENV = "TRTLLM_LIVENESS_OUTCOME"
"""The directory of the outcome files, set by ``trtllm-liveness launch`` for the launcher it runs."""
_LIMIT = 65536
_SNAPSHOT_LIMIT = _LIMIT - 8192
"""Room for the snapshot in a record (8 ranks with their main threads' frames take about 6 KiB)."""
_STATES = ("running", "failed", "clean")


@dataclass(frozen=True)
class Outcome:
    """One engine process's record: ``running``, ``failed`` or ``clean``; for a failure its message
    and whether it is restartable; the status a failure (or an unclean end) calls for."""

    state: str
    message: str
    restartable: bool
    exit_code: int
    pid: int
    snapshot: FatalSnapshot | None = None


def _directory() -> str:
    return os.environ.get(OUTCOME_ENV, "")


def _encode(record: dict[str, object], snapshot: FatalSnapshot | None) -> bytes:
    """``record`` (with this pid) as compact JSON of at most :data:`_LIMIT` bytes, measured as
    written: the message is shortened until the record fits, then ``snapshot`` gets the room left
    (its frames and ranks go first; left out when not even its verdict fits). Always whole JSON."""
    data = compact_json({**record, "pid": os.getpid()}, _LIMIT)
    if snapshot is None:
        return data
    key = b',"snapshot":'
    room = _LIMIT - len(data) - len(key)
    text = snapshot.to_json(min(room, _SNAPSHOT_LIMIT)).encode()
    return data if len(text) > room else data[:-1] + key + text + b"}"


def _write(directory: str, record: dict[str, object], snapshot: FatalSnapshot | None = None) -> None:
    path = os.path.join(directory, f"outcome.{os.getpid()}.json")
    temporary = f"{path}.{threading.get_ident()}.tmp"
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
        try:
            os.write(fd, _encode(record, snapshot))
        finally:
            os.close(fd)
        os.rename(temporary, path)
    except OSError as exc:
        logger.warning("liveness: could not record the engine's outcome in %s: %s", directory, exc)


def mark_running(exit_code: int) -> None:
    """An engine of this process starts (synchronous: one small file). Also arranges that a normal
    interpreter exit without a failure records ``clean`` (a cleanup of the process's ending)."""
    directory = _directory()
    if not directory:
        return
    ending = process_ending()
    ledger = ending.outcome
    if ledger.pipe_fd is None:
        writer, identity = open_writer(directory), _identity()  # outside the locks: opening may wait
        with ledger.record_lock:
            if ledger.pipe_fd is None:  # once per process; owned by it until it ends (close-on-exec)
                ledger.pipe_fd, ledger.pipe_identity = writer, identity
                writer = -1
        if writer >= 0:  # another engine of this process opened it first
            os.close(writer)
    with ledger.lock:
        ledger.running += 1
        with ledger.record_lock:
            failed = ledger.failed
        if failed:
            return
        _write(directory, {"state": "running", "exit_code": exit_code, "restartable": True, "message": ""})
        first = not ledger.clean_at_exit
        ledger.clean_at_exit = True
    if first:
        ending.add_cleanup(_clean_at_exit, Stage.NORMAL_EXIT)


def _clean_at_exit() -> None:
    ledger = process_ending().outcome
    with ledger.lock:
        ledger.running = 0  # a normal interpreter exit: whatever was not shut down ended with it
    mark_clean(ended=0)


def mark_clean(*, ended: int = 1) -> None:
    """``ended`` engines of this process shut down healthy; once none runs, the record says
    ``clean`` (a no-op after a failure)."""
    directory = _directory()
    if not directory:
        return
    ledger = process_ending().outcome
    with ledger.lock:
        ledger.running = max(0, ledger.running - ended)
        with ledger.record_lock:
            failed = ledger.failed
        if not failed and ledger.running == 0:
            _write(directory, {"state": "clean", "exit_code": 1, "restartable": True, "message": ""})


def _identity() -> tuple[int | None, int | None]:
    """This process's start time and PID namespace, read at engine start: the fatal path reads no file."""
    return start_time_or_none(os.getpid()), own_pid_namespace() or None


def _send(ledger: OutcomeLedger, message: str, restartable: bool, exit_code: int) -> None:
    if ledger.pipe_fd is not None and ledger.pipe_fd >= 0:
        start, namespace = ledger.pipe_identity
        send_failure(ledger.pipe_fd, PipedFailure(message, restartable, exit_code, os.getpid(), start, namespace))


def record_outcome(message: str, restartable: bool, exit_code: int) -> threading.Thread | None:
    """Record this process's first failure: at once into the wrapper's outcome pipe (one
    non-blocking write of a pipe's atomic size), then in a file from a thread of the process's
    ending (never blocks the fatal path; the ending waits for it, bounded); returns the thread, or
    None when no wrapper asked or a failure was recorded already."""
    def first(ledger: OutcomeLedger) -> bool:
        if ledger.failed:
            return False
        ledger.failed = True
        ledger.failure = {"state": "failed", "message": message[:4000], "restartable": restartable,
                          "exit_code": exit_code}
        _send(ledger, message[:4000], restartable, exit_code)
        ledger.unrestartable_sent = not restartable
        return True

    return _record(first, "trtllm-liveness-outcome")


def record_unrestartable(message: str, exit_code: int) -> threading.Thread | None:
    """This process's recorded failure turned unrestartable (a rank left unkillable, wedged after a
    death): once, one more line into the wrapper's pipe at once, and the failure record rewritten
    with ``exit_code`` from a thread of the process's ending (returned; None: a no-op, without a
    wrapper, without a recorded failure, or once more)."""
    def turn(ledger: OutcomeLedger) -> bool:
        if not ledger.failed or ledger.unrestartable_sent:
            return False
        ledger.unrestartable_sent = True
        ledger.failure = {**ledger.failure, "restartable": False, "exit_code": exit_code}
        _send(ledger, message[:4000], False, exit_code)
        return True

    return _record(turn, "trtllm-liveness-outcome-unrestartable")


def _record(change: Callable[[OutcomeLedger], bool], name: str) -> threading.Thread | None:
    """Apply ``change`` to the failure under the record's lock (the pipe's line with it); where it
    changed something, write the record from a thread of the process's ending (returned)."""
    directory = _directory()
    if not directory:
        return None
    ending = process_ending()
    ledger = ending.outcome
    with ledger.record_lock:
        if not change(ledger):
            return None
    return ending.threads.start(functools.partial(_rewrite, directory, ledger), name=name, bound_s=WRITE_BOUND_S)


def _rewrite(directory: str, ledger: OutcomeLedger) -> None:
    """Write the failure record as it stands now, with its snapshot where one was added."""
    with ledger.lock:
        with ledger.record_lock:
            failure, snapshot = dict(ledger.failure), ledger.snapshot
        _write(directory, failure, snapshot)


def record_snapshot(snapshot: FatalSnapshot) -> threading.Thread | None:
    """Add the failure's snapshot to this process's failure record, once, in a thread of the
    process's ending; None when no wrapper asked, no failure was recorded or a snapshot was added."""
    def add(ledger: OutcomeLedger) -> bool:
        if not ledger.failed or not ledger.failure or ledger.snapshot is not None:
            return False
        ledger.snapshot = snapshot
        return True

    return _record(add, "trtllm-liveness-outcome-snapshot")


def read_outcomes(directory: str) -> list[Outcome]:
    """Every process's record in ``directory`` (a malformed one is a ``ValueError``; a malformed
    ``snapshot`` field alone reads as no snapshot, logged: the record's verdict stands)."""
    outcomes = []
    for path in sorted(glob.glob(os.path.join(directory, "outcome.*.json"))):
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            raw = os.read(fd, _LIMIT + 1)
        finally:
            os.close(fd)
        try:
            data = json.loads(raw) if len(raw) <= _LIMIT else None
        except RecursionError:  # nested brackets, not a record
            data = None
        # Another host's newer package may write more fields: its verdict is read all the same.
        fields = JsonFields(f"outcome file {path} is malformed", data, optional=("snapshot",), newer_fields=True,
                            required=("state", "message", "restartable", "exit_code", "pid"))
        state, code = fields.text("state"), fields.integer("exit_code")
        if state not in _STATES or not 1 <= code <= 255:
            raise ValueError(f"outcome file {path} is malformed")
        snapshot = None
        if fields.get("snapshot") is not None:
            try:
                snapshot = FatalSnapshot.from_dict(fields.get("snapshot"))
            except ValueError as exc:
                logger.warning("liveness: outcome file %s has a malformed snapshot, read without it: %s", path, exc)
        outcomes.append(Outcome(state, fields.text("message"), fields.flag("restartable"), code, fields.integer("pid"),
                                snapshot))
    return outcomes
