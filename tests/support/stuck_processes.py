"""Sources of real ``D`` state for tests: the cgroup v1 freezer and a FUSE mount nobody answers.

:class:`Freezer` (a freezer group: a frozen process shows ``D`` and survives SIGKILL until thawed)
and :class:`MemoryCgroup` (a small memory limit: an allocating process is OOM-killed) carry the
tests' cgroup prefix; :func:`remove_or_report` removes one and reports it as a leak when it stays.
:class:`StuckChild` is what the ``stuck_child`` fixture of ``tests/conftest.py`` gives: a child in
``D`` from either source (:data:`D_STATE_SOURCES`), so every real-``D`` test also runs where only
one of them exists.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import pytest

from tests.support.leak_checks import LEAKED
from tests.support.waits import WAIT_SCALE
from trtllm_liveness.demo._cgroup_faults import FreezerGroup, MemoryGroup


class Freezer(FreezerGroup):
    """A cgroup v1 freezer group: processes moved into it and frozen show state D and survive SIGKILL."""

    def __init__(self) -> None:
        super().__init__("trtllm-liveness-test")

    def freeze(self, pids: Iterable[int] = (), timeout: float = 10.0) -> bool:
        return super().freeze(pids, timeout * WAIT_SCALE)


class MemoryCgroup(MemoryGroup):
    """A cgroup v1 memory group with a small limit: a process in it that allocates is OOM-killed."""

    def __init__(self, limit_bytes: int) -> None:
        super().__init__(limit_bytes, "trtllm-liveness-test")


def remove_or_report(group: FreezerGroup | MemoryGroup) -> None:
    """Remove ``group``; one that stays is reported as a leak."""
    # Thawed tasks with SIGKILL pending die at once; tasks still alive (the procs fixture ends them
    # later) go back to the root group, so the rmdir succeeds. A group that stays is a leak.
    if not group.remove():
        LEAKED.append(f"cgroup {group.path} could not be removed")


@dataclass
class StuckChild:
    """A real child process in ``D`` that SIGKILL cannot end until :attr:`release` is called."""

    popen: subprocess.Popen[bytes]
    release: Callable[[], None]
    source: str  # "freezer" or "fuse"


# Both sources of real D state, so that every real-D test runs where either one exists: the cgroup
# v1 freezer, and FUSE (cgroup-v2-only hosts, most current distributions and Kubernetes nodes).
D_STATE_SOURCES = [pytest.param("freezer", marks=pytest.mark.freezer, id="freezer"),
                   pytest.param("fuse", marks=pytest.mark.fuse, id="fuse")]
