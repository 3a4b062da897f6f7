"""Children that stand in for ranks in the diagnosis tests: one blocked in a wait, one spinning,
one stopped. Each prints ``ready`` from inside its distinctively named function, so a stack taken
after the line names that function even before the wait or the loop is entered."""

from __future__ import annotations

import signal
import subprocess
import sys

from tests.support.process_tracker import ProcessTracker
from tests.support.waits import wait_until
from trtllm_liveness.process import _procfs

BLOCKED = """\
import sys, threading
def wait_for_peer_that_never_comes():
    never = threading.Event()
    sys.stdout.write("ready\\n"); sys.stdout.flush()
    never.wait()
wait_for_peer_that_never_comes()
"""
SPINNING = """\
import sys
def spin_on_a_flag_nobody_sets():
    sys.stdout.write("ready\\n"); sys.stdout.flush()
    flag = False
    while not flag:
        pass
spin_on_a_flag_nobody_sets()
"""


def start(procs: ProcessTracker, code: str) -> subprocess.Popen[bytes]:
    """Run ``code`` in a child of its own session, tracked by ``procs``; returns once it said ready."""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True)
    procs.popens.append(proc)
    procs.track(proc.pid)
    assert proc.stdout is not None
    assert proc.stdout.readline() == b"ready\n"
    return proc


def blocked(procs: ProcessTracker) -> subprocess.Popen[bytes]:
    """A child asleep in ``wait_for_peer_that_never_comes`` (state S)."""
    proc = start(procs, BLOCKED)
    # After "ready" the main thread's only sleep is the Event wait.
    assert wait_until(lambda: _procfs.read_stat(proc.pid).state == "S", 10)
    return proc


def spinning(procs: ProcessTracker) -> subprocess.Popen[bytes]:
    """A child on CPU in ``spin_on_a_flag_nobody_sets``."""
    return start(procs, SPINNING)


def stop(proc: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
    """SIGSTOP ``proc`` (the caller's own unreaped child) and wait until it shows ``T``."""
    proc.send_signal(signal.SIGSTOP)
    assert wait_until(lambda: _procfs.read_stat(proc.pid).state == "T", 10)
    return proc


def stopped(procs: ProcessTracker) -> subprocess.Popen[bytes]:
    """A blocked child, then SIGSTOPped."""
    return stop(blocked(procs))
