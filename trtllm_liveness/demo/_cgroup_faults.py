"""Real stuck and out-of-memory processes for the demo, the drill, tests and benchmarks (cgroup v1, root).

- :class:`FreezerGroup`: a cgroup v1 freezer group. A process moved in and frozen shows state
  ``D`` and survives SIGKILL (it stays pending) until thawed, then dies at once: the closest safe
  stand-in for a worker wedged in a GPU driver.
- :class:`MemoryGroup`: a cgroup v1 memory group with a limit. A process in it that allocates past
  the limit is killed by the kernel OOM killer, which counts it in the group's ``oom_kill``.

Each always cleans up in :meth:`remove` (idempotent): thaw, move survivors back to the root group
(``rmdir`` fails with EBUSY while a task is left), then ``rmdir`` with retries. Use them as context
managers so that happens also on an exception or Ctrl-C. Not thread-safe; one owner each. The cpu
groups, and the clean-up of groups a crashed owner left, are the tests' (``tests/support/cgroups.py``).

Run as ``python -I _cgroup_faults.py GROUP`` (standard library only), it is the guard of the freezer
group at path ``GROUP`` that a drill's agent starts before it makes the group (drill/_drill_faults.py):
once stdin ends it thaws and removes that group.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import uuid
from collections.abc import Iterable
from types import TracebackType

__all__ = ["FREEZER_ROOT", "MEMORY_ROOT", "FreezerGroup", "MemoryGroup", "freezer_available"]

FREEZER_ROOT = "/sys/fs/cgroup/freezer"
MEMORY_ROOT = "/sys/fs/cgroup/memory"


def _unavailable(root: str, what: str) -> str | None:
    if not os.path.isdir(root):
        return f"cgroup v1 {what} not mounted at {root}"
    if not os.access(root, os.W_OK):
        return f"{root} is not writable (needs root)"
    return None


def freezer_available() -> str | None:
    """None if the cgroup v1 freezer is usable here, else the reason it is not."""
    return _unavailable(FREEZER_ROOT, "freezer")


class _Group:
    root = ""

    def __init__(self, prefix: str = "trtllm-liveness", settings: tuple[tuple[str, str], ...] = (), *,
                 name: str | None = None) -> None:
        """Make the group ``name`` (by default ``prefix`` and a random suffix) and write ``settings``
        (file, value) into it; on an ``OSError`` the group is removed again and the error raised."""
        self.path = os.path.join(self.root, name or f"{prefix}-{uuid.uuid4().hex[:12]}")
        os.mkdir(self.path)
        self.removed = False
        try:
            for name, value in settings:
                self._write(name, value)
        except OSError:
            self.remove()
            raise

    def add(self, pid: int) -> None:
        """Move process ``pid`` (all its threads) into the group; raises ``OSError`` if gone."""
        self._write("cgroup.procs", str(pid))

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w") as handle:
            handle.write(value)

    def _read(self, name: str) -> str:
        with open(os.path.join(self.path, name)) as handle:
            return handle.read()

    def _counters(self, name: str) -> dict[str, int]:
        """The ``name value`` lines of the group's file ``name`` (as far as readable)."""
        counters: dict[str, int] = {}
        with contextlib.suppress(OSError, ValueError):
            for line in self._read(name).splitlines():
                key, _, value = line.partition(" ")
                counters[key] = int(value)
        return counters

    def tasks(self) -> list[int]:
        """Thread ids in the group (empty once it is removed)."""
        try:
            return [int(line) for line in self._read("tasks").split()]
        except OSError:
            return []

    def _before_rmdir(self) -> None:
        """Hook: make the group's tasks able to leave (the freezer thaws)."""

    def remove(self, timeout: float = 10.0) -> bool:
        """Release every task and delete the group; True when it is gone. Idempotent.

        Blocks up to ``timeout`` seconds (retrying ``rmdir`` while tasks are leaving). Tasks still
        in the group after a second are moved back to the root group, never killed.
        """
        if self.removed:
            return True
        with contextlib.suppress(OSError):
            self._before_rmdir()
        deadline = time.monotonic() + timeout
        moved = False
        while True:
            try:
                os.rmdir(self.path)
            except FileNotFoundError:
                pass
            except OSError:
                now = time.monotonic()
                if now >= deadline:
                    return False
                # Killed tasks (SIGKILL pending while frozen) leave by themselves once thawed;
                # any task still here after a second is alive and goes back to the root.
                if not moved and now >= deadline - timeout + 1.0:
                    moved = True
                    for tid in self.tasks():
                        with contextlib.suppress(OSError), open(os.path.join(self.root, "tasks"), "w") as handle:
                            handle.write(str(tid))
                time.sleep(0.02)
                continue
            self.removed = True
            return True

    def __enter__(self) -> _Group:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.remove()


class FreezerGroup(_Group):
    """A cgroup v1 freezer group under :data:`FREEZER_ROOT`, named ``name`` (by default ``prefix``
    and a random suffix). Raises ``OSError`` if it cannot be made."""

    root = FREEZER_ROOT

    def add(self, pid: int) -> None:
        """Move every thread of ``pid`` into the group (``tasks`` takes one tid at a time).

        Raises ``OSError`` if the process itself cannot be moved (it is gone)."""
        self._write("tasks", str(pid))
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError):
                    self._write("tasks", tid)

    def freeze(self, pids: Iterable[int] = (), timeout: float = 10.0) -> bool:
        """Add ``pids``, freeze the group and wait up to ``timeout`` s for FROZEN; True if reached."""
        for pid in pids:
            self.add(pid)
        self._write("freezer.state", "FROZEN")
        deadline = time.monotonic() + timeout
        while self.state() != "FROZEN":
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.002)
        return True

    def thaw(self) -> None:
        """Let the group's tasks run again (a pending SIGKILL then takes effect). Never raises."""
        with contextlib.suppress(OSError):
            self._write("freezer.state", "THAWED")

    def state(self) -> str:
        """``THAWED``, ``FREEZING`` or ``FROZEN`` (``""`` once removed)."""
        try:
            return self._read("freezer.state").strip()
        except OSError:
            return ""

    def _before_rmdir(self) -> None:
        self.thaw()


class MemoryGroup(_Group):
    """A cgroup v1 memory group under :data:`MEMORY_ROOT` limited to ``limit_bytes``.

    Only memory charged after a process joins counts against the limit (charges do not move).
    Raises ``OSError`` if it cannot be made.
    """

    root = MEMORY_ROOT

    def __init__(self, limit_bytes: int, prefix: str = "trtllm-liveness") -> None:
        super().__init__(prefix, (("memory.limit_in_bytes", str(limit_bytes)),))

    def oom_kills(self) -> int | None:
        """The group's ``oom_kill`` counter (None if unreadable)."""
        return self._counters("memory.oom_control").get("oom_kill")


def _guard(path: str) -> None:
    """Wait for EOF on stdin (the owner released the group, or its process ended), then thaw and
    remove the freezer group at ``path`` (:meth:`FreezerGroup.remove`, bounded; none there: done)."""
    sys.stdin.buffer.read()
    group = FreezerGroup.__new__(FreezerGroup)
    group.path, group.removed = path, False
    group.remove()


if __name__ == "__main__":
    _guard(sys.argv[1])
