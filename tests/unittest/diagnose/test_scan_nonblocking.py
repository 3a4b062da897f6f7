"""``trtllm-liveness scan`` never blocks on a target's mmap lock: real lock, real FUSE page fault.

The target (``MEM_FAULT_TARGET_CODE``) maps the FUSE stall's ``held-read`` file, whose READ the
server never answers. One thread faults the page through ``/proc/self/mem`` and so holds
``mmap_read_lock`` for the whole wait (an ordinary fault drops the lock, or the per-VMA lock,
before it waits: on this kernel that alone blocks nobody); a second thread's ``mmap`` queues
for the write lock behind it. Every later reader of that mm (``/proc/PID/cmdline``) queues behind
the writer, in ``D``. The ``fuse_stall`` fixture releases the server at teardown, also on failure:
the READ fails, the lock is released, the target exits; ``procs`` ends what is left.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.facilities import require_facility
from tests.support.fuse_stall import FuseStall
from tests.support.process_tracker import SLEEPER, ProcessTracker, state_of
from tests.support.waits import WAIT_SCALE, wait_until
from trtllm_liveness.process import _procfs
from trtllm_liveness.process._mm_read import MmReader, SkippedRead, SkipReason

# A process stuck in a page fault on the held READ while holding its mmap lock, with a second
# thread queued on that lock for write. argv: the held-read path, then a name for the process's
# comm (prctl PR_SET_NAME; at most 15 bytes). Both threads are started first (starting a thread
# maps its stack, which would queue on the lock too), then it prints "<fault tid> <mmap tid>" and
# lets them go. The fault goes through /proc/self/mem: get_user_pages without FOLL_UNLOCKABLE
# keeps mmap_read_lock across the READ (an ordinary fault would drop it); the other thread's
# mmap(2) then waits for mmap_write_lock. After release the read fails and the process exits 3.
MEM_FAULT_TARGET_CODE = """\
import ctypes, mmap, os, sys, threading, time
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.prctl(15, sys.argv[2].encode()[:15], 0, 0, 0)
fd = os.open(sys.argv[1], os.O_RDONLY)
addr = libc.mmap(None, 4096, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
if addr in (None, ctypes.c_void_p(-1).value):
    sys.exit(f"mmap failed: {os.strerror(ctypes.get_errno())}")
mem = os.open("/proc/self/mem", os.O_RDONLY)
go = threading.Event()
def fault():
    go.wait(60)
    try:
        os.pread(mem, 1, addr)
    except OSError:
        pass
def remap():
    go.wait(60)
    time.sleep(0.2)  # let the fault take the lock first: the writer must queue behind it
    try:
        mmap.mmap(-1, 4096).close()
    except OSError:
        pass
a = threading.Thread(target=fault, daemon=True)
b = threading.Thread(target=remap, daemon=True)
a.start(); b.start()
sys.stdout.write(f"{a.native_id} {b.native_id}\\n"); sys.stdout.flush()
go.set()
a.join(3600); b.join(3600)  # stuck until the test releases the FUSE server (or kills this)
sys.exit(3)
"""

# The fuse marker names the facility (skip with the reason, or fail where it is required); the
# fuse_stall fixture probes it with fuse_available().
pytestmark = [pytest.mark.real_process, pytest.mark.fuse, pytest.mark.timeout(180)]

CLI = Path(sys.executable).parent / "trtllm-liveness"
require_facility("console-script", allow_module_level=True)  # trtllm-liveness next to sys.executable

# Generous: a scan that returns takes well under a second; one that hangs never returns.
RUN_TIMEOUT = 60 * WAIT_SCALE

# Reads a procfs file and prints what it read; run as a child because the read may hang in D.
PLAIN_READ = (
    "import sys\nwith open(sys.argv[1], 'rb') as f:\n    data = f.read()\nsys.stdout.write(repr(data) + '\\n')\n"
)


@dataclass
class Wedged:
    """The target: its pid, the faulting thread (holds the mm lock), the queued writer, its comm."""

    proc: subprocess.Popen[bytes]
    fault_tid: int
    writer_tid: int
    comm: str

    @property
    def pid(self) -> int:
        return self.proc.pid


def _thread(pid: int, tid: int) -> tuple[str, str]:
    try:
        return _procfs.read_stat(pid, tid).state, _procfs.read_wchan(pid, tid)
    except (OSError, ValueError):
        return "", ""


def _readline(proc: subprocess.Popen[bytes], timeout: float) -> bytes:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout * WAIT_SCALE)
    assert ready, "the child printed nothing within its bound"
    return proc.stdout.readline()


@pytest.fixture
def wedged(procs: ProcessTracker, fuse_stall: FuseStall) -> Wedged:
    comm = f"mmwedge{uuid.uuid4().hex[:8]}"  # 15 bytes: the most a comm holds
    proc = subprocess.Popen(
        [sys.executable, "-c", MEM_FAULT_TARGET_CODE, fuse_stall.read_path, comm],
        stdout=subprocess.PIPE, start_new_session=True,
    )
    procs.popens.append(proc)
    procs.track(proc.pid)
    fault_tid, writer_tid = map(int, _readline(proc, 30).split())
    assert fuse_stall.wait_read_held(fault_tid, 10 * WAIT_SCALE), "the fault never reached the FUSE server"
    assert wait_until(lambda: _thread(proc.pid, fault_tid)[0] == "D", 10)
    # The writer queues on the lock (mmap_write_lock_killable: D); until then it sleeps in S.
    assert wait_until(lambda: _thread(proc.pid, writer_tid)[0] == "D", 10), _thread(proc.pid, writer_tid)
    assert _procfs.read_stat(proc.pid).comm == comm
    return Wedged(proc, fault_tid, writer_tid, comm)


def _plain_reader(procs: ProcessTracker, path: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", PLAIN_READ, path], stdout=subprocess.PIPE,
                            start_new_session=True)
    procs.popens.append(proc)
    procs.track(proc.pid)
    return proc


def run_cli(*args: str | int) -> subprocess.CompletedProcess[str]:
    # The bound is the proof: a scan stuck on the lock never returns and this raises TimeoutExpired.
    return subprocess.run([str(CLI), *map(str, args)], capture_output=True, text=True, timeout=RUN_TIMEOUT,
                          check=False)


def _report(data: dict[str, Any], pid: int) -> dict[str, Any]:
    [report] = [report for report in data["processes"] if report["pid"] == pid]
    return report


def test_a_plain_cmdline_read_blocks_behind_the_queued_writer(
    procs: ProcessTracker, fuse_stall: FuseStall, wedged: Wedged
) -> None:
    # What an unprotected reader (ps, the old scan) does: it sleeps in D on the target's mm lock.
    # Its own state is the evidence (no timing): D, in the remote-VM access of the cmdline read.
    reader = _plain_reader(procs, f"/proc/{wedged.pid}/cmdline")
    assert wait_until(lambda: state_of(reader.pid) == "D", 10), state_of(reader.pid)
    wchan = _procfs.read_wchan(reader.pid)
    assert reader.poll() is None
    # A file that does not take the mm lock is read at once in the same state of the target.
    stat_reader = _plain_reader(procs, f"/proc/{wedged.pid}/task/{wedged.fault_tid}/stat")
    assert stat_reader.wait(30 * WAIT_SCALE) == 0
    assert reader.poll() is None and state_of(reader.pid) == "D", wchan
    # Releasing the READ lets the fault, then the writer, then the reader through.
    fuse_stall.release()
    assert reader.wait(30 * WAIT_SCALE) == 0
    assert reader.stdout is not None
    assert fuse_stall.read_path.encode() in reader.stdout.read()  # the target's argv names the file
    assert wedged.proc.wait(30 * WAIT_SCALE) == 3


def test_scan_of_the_pid_returns_and_reports_the_skip(wedged: Wedged) -> None:
    result = run_cli("scan", "--json", "--window", "0.3", "--samples", "3", wedged.pid)
    assert result.returncode == 4, result.stdout + result.stderr  # a thread in D on every sample
    data = json.loads(result.stdout)
    report = _report(data, wedged.pid)
    assert report["verdict"] == "d-state"
    assert data["samples"] == 3  # a thread in D: the whole window confirms it
    assert report["cmdline"] == []
    [skip] = report["skipped"]
    assert (skip["pid"], skip["file"], skip["reason"]) == (wedged.pid, "cmdline", "task-in-d")
    assert "cmdline skipped: task in D" in skip["detail"]
    assert data["skipped_reads"] == 1
    states = {thread["tid"]: thread["state"] for thread in report["threads"]}
    assert states[wedged.fault_tid] == "D" and states[wedged.writer_tid] == "D"

    text = run_cli("scan", "--window", "0", wedged.pid)
    assert text.returncode in (0, 4), text.stdout + text.stderr  # one sample confirms nothing
    assert "skipped: cmdline skipped: task in D" in text.stdout


def test_scan_by_name_returns_with_the_wedged_process_on_the_host(procs: ProcessTracker, wedged: Wedged) -> None:
    # Found by its comm: selected without reading its command line, reported with the skip.
    result = run_cli("scan", "--json", "--window", "0", "--name", wedged.comm)
    assert result.returncode in (0, 4), result.stdout + result.stderr
    data = json.loads(result.stdout)
    assert [report["pid"] for report in data["processes"]] == [wedged.pid]
    assert _report(data, wedged.pid)["skipped"][0]["reason"] == "task-in-d"

    # A token only in another process's argv: the selection reads every command line on the host,
    # the wedged one too (with its deadline, since a D worker is what --name is meant to find);
    # that read times out, is reported, and the scan of the match goes on and the command exits.
    token = f"trtllm-liveness-nonblocking-{uuid.uuid4().hex}"
    other = subprocess.Popen([sys.executable, "-c", SLEEPER, token], stdout=subprocess.PIPE, start_new_session=True)
    procs.popens.append(other)
    procs.track(other.pid)
    assert _readline(other, 30) == b"ready\n"
    result = run_cli("scan", "--json", "--window", "0", "--read-timeout", "0.2", "--name", token)
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(result.stdout)
    assert [report["pid"] for report in data["processes"]] == [other.pid]
    assert token in " ".join(_report(data, other.pid)["cmdline"])
    skipped = {skip["pid"]: skip for skip in data["selection_skipped"]}
    assert skipped[wedged.pid]["reason"] == "timed-out"
    assert "cmdline read timed out after 0.2 s" in skipped[wedged.pid]["detail"]
    assert f"pid {wedged.pid} not matched by its command line" in result.stderr


def _helpers_alive() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name.startswith("trtllm-liveness-mm-read-")]


def test_mm_reader_abandons_a_stuck_helper_and_bounds_the_leak(fuse_stall: FuseStall, wedged: Wedged) -> None:
    before = set(_helpers_alive())
    reader = MmReader(timeout_s=0.2, max_stuck=2)
    try:
        stuck = reader.read(wedged.pid, "cmdline")
        assert isinstance(stuck, SkippedRead) and stuck.reason is SkipReason.TIMED_OUT
        # The same target is not read again (its lock is held): no second thread is leaked.
        again = reader.read(wedged.pid, "environ")
        assert isinstance(again, SkippedRead) and again.reason is SkipReason.LOCK_STUCK
        # One stuck helper does not stall later reads: a fresh helper serves them.
        own = reader.read(os.getpid(), "cmdline")
        assert isinstance(own, bytes) and own
        assert reader.stuck_helpers == 1
        leaked = set(_helpers_alive()) - before
        assert len(leaked) <= reader.stuck_helpers + 1  # the stuck one and the live one
    finally:
        reader.close()
    bounded = MmReader(timeout_s=0.2, max_stuck=1)
    try:
        assert isinstance(bounded.read(wedged.pid, "cmdline"), SkippedRead)
        refused = bounded.read(os.getpid(), "cmdline")  # the bound reached: no more threads
        assert isinstance(refused, SkippedRead) and refused.reason is SkipReason.NO_HELPER
    finally:
        bounded.close()
    # Released, the stuck reads return and their abandoned helpers end.
    fuse_stall.release()
    assert wait_until(lambda: not (set(_helpers_alive()) - before), 30), _helpers_alive()
