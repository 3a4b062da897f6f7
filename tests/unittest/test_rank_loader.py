"""tests/support/rank_loader.py: a loader thread in another process reads the files handed to it.

The soak hands a rank's loader files it cannot open itself (a FUSE mount of another mount
namespace). Here the loader runs in a plain child: a slow FUSE file is read, every byte checked;
the held-read file leaves the loader thread stuck in the FUSE READ until the server is released;
a request without its file is refused with a clear line.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.facilities import needs
from tests.support.fuse_stall import FuseStall
from tests.support.process_tracker import ProcessTracker
from tests.support.rank_loader import hand_over
from tests.support.slow_reads import SlowReadResult

pytestmark = [pytest.mark.real_process, pytest.mark.timeout(60), needs("fuse")]

REPO = Path(__file__).resolve().parents[2]
LOADER = ("import sys\nfrom tests.support.rank_loader import serve_loader\nserve_loader(sys.argv[1])\n"
          "sys.stdout.write('ready\\n'); sys.stdout.flush(); sys.stdin.read()")


def start_loader(procs: ProcessTracker, path: str) -> subprocess.Popen[bytes]:
    child = subprocess.Popen([sys.executable, "-c", LOADER, path], cwd=REPO, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)},
                             start_new_session=True)
    procs.adopt(child)
    assert child.stdout is not None and child.stdout.readline() == b"ready\n"
    return child


def test_a_handed_slow_file_is_read_and_checked_and_a_held_one_holds_the_loader(procs: ProcessTracker,
                                                                                tmp_path: Path) -> None:
    path = str(tmp_path / "loader.sock")
    start_loader(procs, path)
    with FuseStall() as stall:
        reader = hand_over(path, {"op": "read", "seconds": 1.0, "size": 4096, "check": True}, stall.slow_read_path)
        try:
            assert (reader.line(10) or "").startswith("started "), reader.error()
            result = SlowReadResult.parse(reader.line(20) or "")
        finally:
            reader.close()
        assert result.reads >= 2 and result.nbytes == 4096 * result.reads and result.mismatches == 0, result
        assert stall.slow_reads_answered() >= result.reads

        held = hand_over(path, {"op": "read", "seconds": 60, "size": 4096}, stall.read_path)
        try:
            started = held.line(10) or ""
            assert started.startswith("started "), held.error()
            assert stall.wait_read_held(int(started.split()[1]), 10)  # the loader thread waits in the READ
            stall.release()
            answer = held.line(10) or ""
            assert answer.startswith("error OSError") and "not connected" in answer, answer
        finally:
            held.close()


def test_a_request_without_its_file_is_refused(procs: ProcessTracker, tmp_path: Path) -> None:
    path = str(tmp_path / "loader.sock")
    start_loader(procs, path)
    refused = hand_over(path, {"op": "read", "seconds": 1.0, "size": 4096})
    try:
        assert (refused.line(10) or "").startswith("started ")
        assert (refused.line(10) or "").startswith("error bad request")
    finally:
        refused.close()
