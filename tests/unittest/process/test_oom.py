"""A real kernel OOM kill in a memory-limited cgroup is reported as such, not as a plain SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from tests.support.facilities import require_or_skip
from tests.support.process_tracker import ProcessTracker
from tests.support.stuck_processes import MemoryCgroup
from trtllm_liveness import EventKind, WorkerEvent
from trtllm_liveness.monitor import WorkerProcessMonitor
from trtllm_liveness.process import _oom, capture_identity
from trtllm_liveness.process._oom import OomCounters, OomProbe

pytestmark = [pytest.mark.real_process, pytest.mark.timeout(60)]

HOG = (
    "import sys\n"
    "sys.stdout.write('ready\\n'); sys.stdout.flush()\n"
    "sys.stdin.readline()\n"
    "hoard = []\n"
    "while True:\n"
    "    hoard.append(bytearray(8 << 20))\n"
)


def start_hog(procs: ProcessTracker) -> subprocess.Popen[bytes]:
    hog = subprocess.Popen(
        [sys.executable, "-c", HOG], stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True
    )
    procs.popens.append(hog)
    procs.track(hog.pid)
    assert hog.stdout is not None and hog.stdout.readline() == b"ready\n"
    return hog


def test_oom_kill_is_reported_as_oom(procs: ProcessTracker, memory_cgroup: MemoryCgroup) -> None:
    hog = start_hog(procs)
    memory_cgroup.add(hog.pid)
    got = threading.Event()
    events: list[WorkerEvent] = []
    with WorkerProcessMonitor() as monitor:
        monitor.subscribe(lambda event: (events.append(event), got.set()))
        monitor.register([capture_identity(0, hog.pid)])
        monitor.start()
        assert hog.stdin is not None
        hog.stdin.write(b"go\n")
        hog.stdin.flush()
        assert got.wait(30)
    assert events[0].kind is EventKind.DIED
    assert "OOM killer" in events[0].cause
    assert memory_cgroup.path in events[0].cause
    hog.wait(10)
    assert hog.returncode == -signal.SIGKILL


def test_plain_sigkill_in_a_memory_cgroup_is_not_called_oom(
    procs: ProcessTracker, memory_cgroup: MemoryCgroup
) -> None:
    child = procs.sleeper()
    memory_cgroup.add(child.pid)
    got = threading.Event()
    events: list[WorkerEvent] = []
    with WorkerProcessMonitor() as monitor:
        monitor.subscribe(lambda event: (events.append(event), got.set()))
        monitor.register([capture_identity(0, child.pid)])
        monitor.start()
        os.kill(child.pid, signal.SIGKILL)
        assert got.wait(30)
    assert "OOM" not in events[0].cause
    assert "SIGKILL" in events[0].cause


def test_probe_of_a_missing_process_never_raises_and_falls_back_to_the_machine_count() -> None:
    probe = OomProbe.capture(2**22 - 1)  # no such process: no cgroup to read, and no error
    assert probe.counter_file is None
    if probe.machine_kills is None:
        require_or_skip("oom-counter", "/proc/vmstat has no oom_kill counter on this kernel")
    probe.machine_kills -= 1  # as if one OOM kill happened on the machine since registration
    verdict = probe.verdict()
    assert verdict is not None and verdict.startswith("likely killed by the kernel OOM killer")


def test_workers_registered_together_keep_each_its_own_memory_cgroup(
    procs: ProcessTracker, memory_cgroup: MemoryCgroup
) -> None:
    """One registration shares its cgroup reads among its workers; a worker outside the memory
    cgroup of the others must still be judged by its own counter: registered in one call with an
    OOM-killed worker, its plain SIGKILL after that OOM kill is not called OOM."""
    hog = start_hog(procs)
    memory_cgroup.add(hog.pid)
    outside = procs.sleeper()
    got = threading.Event()
    events: list[WorkerEvent] = []
    with WorkerProcessMonitor() as monitor:
        monitor.subscribe(lambda event: (events.append(event), got.set()))
        monitor.register([capture_identity(0, hog.pid), capture_identity(1, outside.pid)])
        monitor.start()
        assert hog.stdin is not None
        hog.stdin.write(b"go\n")
        hog.stdin.flush()
        assert got.wait(30)
        got.clear()
        os.kill(outside.pid, signal.SIGKILL)
        assert got.wait(30)
    by_rank = {event.identity.rank: event for event in events}
    assert "OOM killer" in by_rank[0].cause and memory_cgroup.path in by_rank[0].cause
    assert "OOM" not in by_rank[1].cause


def test_shared_counters_give_each_worker_the_file_of_its_own_cgroup(
    procs: ProcessTracker, memory_cgroup: MemoryCgroup
) -> None:
    """One registration lists the members of the memory cgroups it meets (this process's, and one
    where a second worker was found) instead of reading each worker's cgroup file: the answers must
    be those of reading each one's file, inside the test cgroup (met by reading, then listed) and
    outside it (listed from the start)."""
    inside = [procs.sleeper(), procs.sleeper(), procs.sleeper()]
    outside = [procs.sleeper(), procs.sleeper()]
    for child in inside:
        memory_cgroup.add(child.pid)
    counters = OomCounters()
    order = [inside[0], outside[0], inside[1], outside[1], inside[2]]
    probes = {child.pid: OomProbe.capture(child.pid, counters) for child in order}
    for child in order:
        content = _oom._read_cgroup_file(child.pid)  # the worker's own file, read directly
        assert content is not None
        assert probes[child.pid].counter_file == _oom._counter_file_of(content), child.pid
    assert memory_cgroup.path in str(probes[inside[0].pid].counter_file)
    assert probes[outside[0].pid].counter_file != probes[inside[0].pid].counter_file
