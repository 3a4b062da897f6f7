"""Real child processes for tests, tracked by pid and start time and always ended.

Every process a test starts goes through a :class:`ProcessTracker` (the ``procs`` fixture of
``tests/conftest.py``), which ends exactly those processes at teardown, by pid verified against the
start time, and reports one that outlives it (``leak_checks.LEAKED``: the session then fails).
:data:`SLEEPER` and :data:`GRANDPARENT` are the programs of its plain children; :func:`state_of`
and :func:`start_time_or_none` read a process's state and start time, None once it is gone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field

from tests.support.fuse_stall import FuseStall
from tests.support.leak_checks import LEAKED
from tests.support.slow_reads import slow_reader_cmd
from tests.support.waits import WAIT_SCALE, wait_until
from trtllm_liveness.process import _procfs

SLEEPER = "import sys, time; sys.stdout.write('ready\\n'); sys.stdout.flush(); time.sleep(3600)"

# Forks a grandchild that sleeps; the middle process prints the grandchild's pid and then reaps it
# (so a killed grandchild does not linger as a zombie), unless ``--no-reap`` is given.
GRANDPARENT = """
import os, sys, time
pid = os.fork()
if pid == 0:
    time.sleep(3600)
    os._exit(0)
sys.stdout.write(f"{pid}\\n"); sys.stdout.flush()
if "--no-reap" in sys.argv:
    time.sleep(3600)
else:
    os.waitpid(pid, 0)
    time.sleep(3600)
"""


def start_time_or_none(pid: int) -> int | None:
    """``pid``'s start time (clock ticks since boot), None if it is gone."""
    try:
        return _procfs.read_start_time(pid)
    except OSError:
        return None


def state_of(pid: int) -> str | None:
    """``pid``'s state letter (``R``, ``S``, ``D``, ``Z``, ...), None if it is gone."""
    try:
        return _procfs.read_stat(pid).state
    except OSError:
        return None


@dataclass
class ProcessTracker:
    """Starts real processes and ends exactly those at teardown (by pid and start time)."""

    popens: list[subprocess.Popen[bytes]] = field(default_factory=list)
    pids: dict[int, int | None] = field(default_factory=dict)

    def track(self, pid: int) -> int:
        self.pids[pid] = start_time_or_none(pid)
        return pid

    def adopt(self, popen: subprocess.Popen[bytes]) -> None:
        """Track a process started elsewhere (e.g. an ``on_start`` callback): ended at teardown."""
        self.popens.append(popen)
        self.track(popen.pid)

    def sleeper(self, *, ignore_term: bool = False, new_session: bool = True) -> subprocess.Popen[bytes]:
        code = SLEEPER
        if ignore_term:
            code = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); " + code
        proc = subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=new_session
        )
        self.popens.append(proc)
        self.track(proc.pid)
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"ready\n"
        return proc

    def grandchild(self, *, reap: bool = True) -> tuple[subprocess.Popen[bytes], int]:
        """Start a middle process that forks a sleeping grandchild; return (middle, grandchild pid)."""
        argv = [sys.executable, "-c", GRANDPARENT] + ([] if reap else ["--no-reap"])
        middle = subprocess.Popen(argv, stdout=subprocess.PIPE, start_new_session=True)
        self.popens.append(middle)
        self.track(middle.pid)
        assert middle.stdout is not None
        pid = int(middle.stdout.readline())
        self.track(pid)
        return middle, pid

    def stuck_in_fuse(self, stall: FuseStall, timeout: float = 10.0) -> subprocess.Popen[bytes]:
        """A child held in ``stall``: in D now, unkillable once killed, until ``stall.release()``."""
        child = subprocess.Popen(stall.stuck_child_cmd(), start_new_session=True)
        self.popens.append(child)
        self.track(child.pid)
        assert stall.wait_held(child.pid, timeout * WAIT_SCALE), "the FUSE server never read the child's request"
        return child

    def slow_reader(self, stall: FuseStall, seconds: float) -> tuple[subprocess.Popen[bytes], int]:
        """A child whose helper thread reads ``stall``'s slow-read file for ``seconds``: in ``D`` most
        of the time, every read answered (the healthy look-alike of a wedge). Returns it and the
        reading thread's id; its next line is its ``SlowReadResult``, and it exits once its stdin is
        closed (or at teardown)."""
        child = subprocess.Popen(slow_reader_cmd(stall, seconds), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 start_new_session=True)
        self.popens.append(child)
        self.track(child.pid)
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line.strip().isdigit(), f"the slow reader did not start: {line!r}"
        return child, int(line)

    def cleanup(self) -> None:
        for pid, start in self.pids.items():
            if start is not None and start_time_or_none(pid) == start:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        for proc in self.popens:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
            if proc.stdout is not None:
                proc.stdout.close()
            if proc.stdin is not None:
                proc.stdin.close()
        for pid, start in self.pids.items():
            if start is not None and not wait_until(lambda p=pid: state_of(p) in (None, "Z"), 5):
                LEAKED.append(f"pid {pid} still alive after teardown")
