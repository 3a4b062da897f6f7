"""Shared test helpers: real processes, tracked by pid, always cleaned up.

Rules (see CONTRIBUTING.md): every process a test starts goes through :class:`ProcessTracker`
(the ``procs`` fixture), which ends it by pid (verified by start time) at teardown; cgroups made
for freezing are thawed and removed in the ``freezer`` fixture's teardown, also on failure. A
session-level check fails the run if any tracked process outlived its test.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from trtllm_liveness import _procfs

FREEZER_ROOT = "/sys/fs/cgroup/freezer"

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


class Freezer:
    """A cgroup v1 freezer group: processes moved into it and frozen show state D and survive SIGKILL."""

    def __init__(self) -> None:
        self.path = os.path.join(FREEZER_ROOT, f"trtllm-liveness-test-{uuid.uuid4().hex[:12]}")
        os.mkdir(self.path)

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w") as handle:
            handle.write(value)

    def add(self, pid: int) -> None:
        self._write("tasks", str(pid))
        # Every thread of the process must be in the group; tasks takes one tid at a time.
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                self._write("tasks", tid)

    def freeze(self) -> None:
        self._write("freezer.state", "FROZEN")
        wait_until(lambda: self.state() == "FROZEN", 10)

    def thaw(self) -> None:
        self._write("freezer.state", "THAWED")

    def state(self) -> str:
        with open(os.path.join(self.path, "freezer.state")) as handle:
            return handle.read().strip()

    def tasks(self) -> list[int]:
        with open(os.path.join(self.path, "tasks")) as handle:
            return [int(line) for line in handle if line.strip()]

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            self.thaw()
        # Thawed tasks with SIGKILL pending die at once; give them a moment. Tasks still alive
        # (thawed without a kill; the procs fixture ends them later) go back to the root group,
        # or the rmdir below fails with EBUSY.
        if not wait_until(lambda: not self.tasks(), 1):
            for tid in self.tasks():
                with contextlib.suppress(OSError), open(os.path.join(FREEZER_ROOT, "tasks"), "w") as handle:
                    handle.write(str(tid))
        wait_until(lambda: not self.tasks(), 10)
        for _ in range(50):
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.05)
        _LEAKED.append(f"cgroup {self.path} could not be removed")


def freezer_available() -> str | None:
    """None if the cgroup v1 freezer is usable here, else the reason it is not."""
    if not os.path.isdir(FREEZER_ROOT):
        return f"cgroup v1 freezer not mounted at {FREEZER_ROOT}"
    if not os.access(FREEZER_ROOT, os.W_OK):
        return f"{FREEZER_ROOT} is not writable (needs root)"
    return None


@pytest.fixture
def freezer() -> Iterator[Freezer]:
    reason = freezer_available()
    if reason is not None:
        pytest.skip(reason)
    group = Freezer()
    try:
        yield group
    finally:
        group.remove()


MEMORY_ROOT = "/sys/fs/cgroup/memory"


class MemoryCgroup:
    """A cgroup v1 memory group with a small limit: a process in it that allocates is OOM-killed."""

    def __init__(self, limit_bytes: int) -> None:
        self.path = os.path.join(MEMORY_ROOT, f"trtllm-liveness-test-{uuid.uuid4().hex[:12]}")
        os.mkdir(self.path)
        with open(os.path.join(self.path, "memory.limit_in_bytes"), "w") as handle:
            handle.write(str(limit_bytes))

    def add(self, pid: int) -> None:
        with open(os.path.join(self.path, "cgroup.procs"), "w") as handle:
            handle.write(str(pid))

    def remove(self) -> None:
        # Move survivors back to the root group; rmdir then always succeeds.
        with contextlib.suppress(OSError), open(os.path.join(self.path, "cgroup.procs")) as handle:
            for line in handle.read().split():
                with contextlib.suppress(OSError), open(os.path.join(MEMORY_ROOT, "cgroup.procs"), "w") as root:
                    root.write(line)
        for _ in range(50):
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.05)
        _LEAKED.append(f"cgroup {self.path} could not be removed")


@pytest.fixture
def memory_cgroup() -> Iterator[MemoryCgroup]:
    if not os.path.isdir(MEMORY_ROOT) or not os.access(MEMORY_ROOT, os.W_OK):
        pytest.skip(f"cgroup v1 memory controller not writable at {MEMORY_ROOT}")
    group = MemoryCgroup(64 * 1024 * 1024)
    try:
        yield group
    finally:
        group.remove()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _LEAKED:
        sys.stderr.write("\nLEAKED by tests:\n" + "\n".join(_LEAKED) + "\n")
        session.exitstatus = 1
