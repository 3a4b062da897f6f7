"""The parent side of a scenario: start its child in a session of its own, bound it, clean up.

Used by the demo, the benchmarks, the fault matrix and the tests: :func:`run_scenario` runs
``python -m trtllm_liveness.demo._scenario_child '<json options>'`` (or another program that prints
the same records) with ``start_new_session=True`` (an MPI launcher may kill its whole process
group) and an outer timeout, sees when the child exits through a pidfd (:class:`_ExitWatch`), and
then kills whatever is left of that session (prte, the ranks) by verified pid
(:func:`kill_session`). A wedge scenario's quarantine marker goes to a directory of the child's
own, never the machine's.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ..process import _pidfd, _procfs
from ..quarantine._marker import QUARANTINE_DIR_VAR
from ._scenario_records import ScenarioOptions, ScenarioRun

__all__ = ["CHILD_MODULE", "kill_session", "run_scenario", "session_members"]

# The scenario program run by default: one iteration's record per JSON line (_scenario_child.py).
CHILD_MODULE = "trtllm_liveness.demo._scenario_child"


def session_members(sid: int) -> list[_procfs.StatInfo]:
    """The stat of each live process whose session id is ``sid`` (the scenario child's session: it,
    prte and the workers)."""
    members = []
    for pid in _procfs.list_pids():
        info = _procfs.stat_or_none(pid)  # None: gone since the listing
        if info is not None and info.session == sid and not info.exited:
            members.append(info)
    return members


def kill_session(sid: int, timeout: float = 5.0) -> list[int]:
    """SIGKILL every live member of session ``sid`` (verified through a pidfd); return survivors' pids.

    Only for a session this process created (``start_new_session=True``): its members are ours.
    """
    deadline = time.monotonic() + timeout
    while True:
        members = session_members(sid)
        if not members or time.monotonic() > deadline:
            return [info.pid for info in members]
        for info in members:
            # Verified against the listing's start time after opening: the pid may have been
            # recycled since, and only the process listed in this session is ours to kill.
            with contextlib.suppress(Exception):
                _pidfd.signal_verified(info.pid, info.start_time, signal.SIGKILL)
        time.sleep(0.05)


class _ExitWatch:
    """When a process exits, seen through a pidfd in a thread of its own (without reaping it:
    ``Popen`` still does). ``communicate()`` alone would wait for the ranks too, which share its
    stdout."""

    def __init__(self, pid: int) -> None:
        self.exited_at: float | None = None
        self._stop = threading.Event()
        try:
            self._fd: int | None = _pidfd.open_pidfd(pid)
        except Exception:
            self._fd = None
        self._thread = threading.Thread(target=self._wait, name="scenario-exit-watch", daemon=True)
        self._thread.start()

    def _wait(self) -> None:
        if self._fd is None:
            return
        try:
            poller = select.poll()
            poller.register(self._fd, select.POLLIN)
            while not self._stop.is_set():
                if poller.poll(100):
                    self.exited_at = time.monotonic()
                    return
        finally:
            os.close(self._fd)

    def close(self) -> float | None:
        self._thread.join(1.0)  # the child has been waited for: the pidfd is readable by now
        self._stop.set()
        self._thread.join(1.0)
        return self.exited_at


def run_scenario(options: ScenarioOptions | Mapping[str, Any], timeout: float,
                 env: Mapping[str, str] | None = None, program: Sequence[str] | None = None) -> ScenarioRun:
    """Run a scenario in a child process in a new session, with an outer ``timeout`` (seconds);
    always kill what it left in that session. Blocks up to ``timeout`` + ~15 s.

    ``options``: a :class:`ScenarioOptions` or its mapping form (``ValueError`` here, before
    anything starts, for an unknown key or bad value). ``env`` is added to this process's
    environment for the child. Returns what the child reported, its exit status and exit time
    and the pids of its session still alive after cleanup (should be none); a malformed record
    line is reported in ``error``, never raised. ``program``: another scenario program (argv
    before the options' JSON) that prints the same records, e.g. one driving an upstream-shaped
    ``tensorrt_llm`` through its own API; default :data:`CHILD_MODULE`.
    """
    opts = options if isinstance(options, ScenarioOptions) else ScenarioOptions.from_dict(options)
    command = list(program) if program else [sys.executable, "-m", CHILD_MODULE]
    child_env = {**os.environ, **(env or {})}
    with contextlib.ExitStack() as cleanup:
        # A wedge scenario quarantines "the host" (a marker, see quarantine/_marker.py): the demo, the
        # matrix and the benchmarks keep that marker in a directory of the child's own, never the
        # machine's /run, unless the caller chose one. Only the scenario process itself writes a
        # marker: the directory goes once it has exited.
        if QUARANTINE_DIR_VAR not in child_env:
            child_env[QUARANTINE_DIR_VAR] = cleanup.enter_context(tempfile.TemporaryDirectory(
                prefix="trtllm-liveness-quarantine-", ignore_cleanup_errors=True))
        child = subprocess.Popen([*command, json.dumps(opts.to_dict())], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, start_new_session=True, env=child_env)
        watch = _ExitWatch(child.pid)
        timed_out = False
        try:
            stdout, stderr = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            kill_session(child.pid)
            stdout, stderr = child.communicate(timeout=10)
            stderr += b"\n[scenario timed out]"
        except BaseException:  # Ctrl-C: the session is ours and must not outlive us
            kill_session(child.pid)
            raise
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(10)
            exited_at = watch.close()
    # prte and the workers outlive a parent that exits: give them a moment, then kill them.
    deadline = time.monotonic() + 3
    while session_members(child.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    survivors = kill_session(child.pid)
    lines = []
    for line in stdout.decode(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            value = json.loads(line)
            if isinstance(value, dict):
                lines.append(value)
    try:
        results, other = ScenarioRun.parse(lines)
        error = next((str(line["error"]) for line in other if "error" in line), None)
    except (KeyError, TypeError, ValueError) as exc:  # a child of another version, or a bug: say so
        results, other, error = (), tuple(lines), f"malformed scenario record: {exc!r}"
    return ScenarioRun(
        results=results, survivors=tuple(survivors), done=any(line.get("done") for line in other), error=error,
        stderr=stderr.decode(errors="replace")[-4000:], returncode=child.returncode, exited_at=exited_at,
        timed_out=timed_out, progress=tuple(line for line in other if "done" not in line and "error" not in line))
