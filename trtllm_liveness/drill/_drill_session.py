"""The drill's engine process, its fault and its clean-up: one owner for all of them.

:class:`DrillSession` makes a private working directory (the engine's ``TMPDIR``, the quarantine
directory inside it), starts :mod:`trtllm_liveness.drill._drill_engine` in a session of
its own, reads its lines in a thread, injects the fault into one rank of this host through a pidfd
verified against the rank's start time (SIGKILL, SIGSTOP, or the cgroup v1 freezer: real ``D``
state), or asks the engine to have a remote rank's own host agent make it (``--hosts``: the agents
undo it and stop their hosts' ranks when the engine stops or goes), and on :meth:`close` thaws the
freezer, waits for the engine process (bounded), reads the marker it left, kills what is left of its
session, stops every rank of this host it was told of by verified identity, and removes the
directory. Every wait has a deadline; :meth:`close` is idempotent and
never raises for a clean-up step.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, TYPE_CHECKING, Any

from ..multihost._agent_faults import FAULT_SIGNALS
from ..process import _pidfd
from ._drill_records import DrillOptions, DrillRank, EngineReady, EngineReport, local_ranks

if TYPE_CHECKING:
    from ..quarantine._marker import QuarantineMarker

__all__ = ["DrillSession", "EngineEnded", "FaultNotMade"]

_EXIT_WAIT_S = 10.0
_STOP_KILL_S = 2.0
_LOG_TAIL_CHARS = 3000
_ENGINE = "trtllm_liveness.drill._drill_engine"


class EngineEnded(Exception):
    """The engine process sent an error line, ended, or said nothing in time (``str`` says which)."""


class FaultNotMade(Exception):
    """The remote host's agent did not make the fault: its answer (refused, failed, no answer)."""


class DrillSession:
    """One drill's engine process and everything it needs; see the module docstring."""

    def __init__(self) -> None:
        self.workdir = tempfile.mkdtemp(prefix="trtllm-drill-")  # 0700; short: ZMQ ipc paths live below
        self.quarantine_dir = os.path.join(self.workdir, "quarantine")
        os.mkdir(self.quarantine_dir, 0o700)
        self.child: subprocess.Popen[bytes] | None = None
        self.ranks: tuple[DrillRank, ...] = ()
        self.survivors: list[int] = []
        self.returncode: int | None = None
        self.exited_at: float | None = None
        self.marker: QuarantineMarker | str | None = None
        self._lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._log_path = os.path.join(self.workdir, "engine.log")
        self._freezer: Any = None
        self._closed = False
        self.last_log = ""  # the end of the engine's stderr, kept by close() before the directory goes

    def start(self, options: DrillOptions, env: Mapping[str, str], launch: Sequence[str] = ()) -> None:
        """Start the engine process with ``env`` (its ``TMPDIR`` is the working directory); ``launch``
        goes in front of it (``--hosts``: ``trtllm-liveness launch -- mpirun ... trtllm-llmapi-launch``)."""
        with open(self._log_path, "wb") as log:
            self.child = subprocess.Popen([*launch, sys.executable, "-m", _ENGINE, json.dumps(options.to_dict())],
                                          stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=log, start_new_session=True,
                                          env={**env, "TMPDIR": self.workdir})
        assert self.child.stdout is not None
        threading.Thread(target=self._read, args=(self.child.stdout,), name="drill-engine-lines",
                         daemon=True).start()

    def _engine(self) -> subprocess.Popen[bytes]:
        if self.child is None:
            raise EngineEnded("the engine process was not started")
        return self.child

    def _read(self, stream: IO[bytes]) -> None:
        for raw in stream:
            with contextlib.suppress(ValueError):
                line = json.loads(raw)
                if isinstance(line, dict):
                    self._lines.put(line)
        self._lines.put(None)

    def _next(self, key: str, deadline: float) -> Any:
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise EngineEnded(f"no {key} from the engine within the drill's bound") from None
            if line is None:
                child = self._engine()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.wait(_EXIT_WAIT_S)
                self.returncode, self.exited_at = child.returncode, time.monotonic()
                raise EngineEnded(f"the engine process ended (exit status {child.returncode}) before its {key}")
            if "error" in line:
                raise EngineEnded(str(line["error"]))
            if key in line:
                return line[key]

    def wait_ready(self, deadline: float) -> EngineReady:
        """The engine's ready line (raises :class:`EngineEnded`, or ``ValueError`` for a malformed one)."""
        ready = EngineReady.from_dict(self._next("ready", deadline))
        self.ranks = ready.ranks
        return ready

    def wait_report(self, deadline: float) -> EngineReport:
        """The engine's report after the fault (raises as :meth:`wait_ready`)."""
        return EngineReport.from_dict(self._next("report", deadline))

    def inject(self, fault: str, victim: DrillRank) -> float:
        """Inject ``fault`` into ``victim`` (a rank of this host, its identity verified through the
        pidfd used) and tell the engine when; returns that monotonic time. Raises the identity's
        errors (the rank is gone, or its pid was reused) or ``OSError`` (the freezer)."""
        fd = _pidfd.open_verified_pidfd(victim.pid, victim.start_time)
        try:
            if fault == "wedge":
                from ..demo._cgroup_faults import FreezerGroup

                self._freezer = FreezerGroup(prefix="trtllm-liveness-drill")
                t0 = time.monotonic()
                self._freezer.freeze([victim.pid])
                if _pidfd.is_exited(fd):  # the pid may name another process by the time it was added
                    self.release_fault()
                    raise ProcessLookupError(f"rank {victim.rank} (pid {victim.pid}) exited before it was frozen")
            else:
                t0 = time.monotonic()
                _pidfd.send_signal(fd, FAULT_SIGNALS[fault])
        finally:
            os.close(fd)
        self._tell({"fault_at": t0})
        return t0

    def inject_remote(self, fault: str, victim: DrillRank, deadline: float) -> float:
        """Ask the engine to have ``victim``'s host's agent make ``fault`` (the drill never signals a
        pid of another host); returns when it was made, on the engine's monotonic clock. Raises
        :class:`FaultNotMade` with the agent's answer (e.g. "wedge not available on host H"), or
        :class:`EngineEnded`."""
        from ._drill_faults import FaultReply

        self._tell({"inject": {"rank": victim.rank, "fault": fault}})
        reply = FaultReply.from_dict(self._next("injected", deadline))
        if not reply.injected or reply.at is None:
            raise FaultNotMade(f"{reply.outcome}: {reply.detail}")
        return reply.at

    def _tell(self, line: dict[str, Any]) -> None:
        stdin = self._engine().stdin
        assert stdin is not None
        with contextlib.suppress(OSError):
            stdin.write(json.dumps(line).encode() + b"\n")
            stdin.flush()

    def release_fault(self) -> None:
        """Thaw and remove the freezer group (a frozen rank then takes its pending SIGKILL)."""
        if self._freezer is not None:
            with contextlib.suppress(Exception):
                self._freezer.remove()
            self._freezer = None

    def close(self) -> None:
        """Release everything (see the module docstring); records the marker the engine left in
        :attr:`marker` and the processes left in :attr:`survivors` (empty normally). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.release_fault()
        if self.child is not None:
            self._end_engine(self.child)
        with contextlib.suppress(OSError):  # the end of TensorRT-LLM's and the extension's log
            with open(self._log_path, errors="replace") as handle:
                self.last_log = handle.read()[-_LOG_TAIL_CHARS:]
        shutil.rmtree(self.workdir, ignore_errors=True)

    def _end_engine(self, child: subprocess.Popen[bytes]) -> None:
        from ..demo._scenario_launcher import kill_session
        from ..stop._bounded_stop import stop_processes

        with contextlib.suppress(OSError):
            if child.stdin is not None:
                child.stdin.close()  # EOF: an engine still waiting for the fault gives up
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(_EXIT_WAIT_S)
        if self.returncode is None:
            self.returncode = child.returncode
        kill_session(child.pid)
        if child.poll() is None:
            child.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(_EXIT_WAIT_S)
        self.marker = self._read_marker()  # the engine process is gone: whatever it wrote is there
        identities = [rank.identity() for rank in local_ranks(self.ranks, child.pid)]
        if identities:
            report = stop_processes(identities, grace_s=0.0, kill_s=_STOP_KILL_S)
            self.survivors = sorted(worker.pid for worker in report.unkillable)
        self.survivors += [pid for pid in kill_session(child.pid) if pid not in self.survivors]
        if child.stdout is not None:
            with contextlib.suppress(OSError):
                child.stdout.close()

    def _read_marker(self) -> QuarantineMarker | str | None:
        """The marker the engine wrote in the drill's quarantine directory (None: none; a string:
        why it could not be read)."""
        from ..quarantine._marker import MarkerError, read_marker

        try:
            return read_marker(self.quarantine_dir)
        except (MarkerError, OSError) as exc:
            return f"unreadable: {exc}"
