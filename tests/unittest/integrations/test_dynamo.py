"""The Dynamo bridge against the real ai-dynamo-runtime on loopback, with real processes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.support.children import free_port
from tests.support.facilities import require_facility
from tests.support.process_tracker import ProcessTracker
from tests.support.waits import wait_until

require_facility("dynamo", allow_module_level=True)

pytestmark = [pytest.mark.real_process, pytest.mark.timeout(90)]

WORKER = Path(__file__).resolve().parents[2] / "programs" / "dynamo_worker.py"


def get(port: int, path: str) -> tuple[int | None, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return None, repr(exc)


def test_sigkill_turns_health_503_names_rank_and_exits_nonzero(procs: ProcessTracker) -> None:
    workers = [procs.sleeper() for _ in range(2)]
    port = free_port()
    env = dict(
        os.environ,
        DYN_SYSTEM_PORT=str(port),
        DYN_SYSTEM_HOST="127.0.0.1",
        DYN_TCP_RPC_HOST="127.0.0.1",
        DYN_LOG="warn",
    )
    server = subprocess.Popen(
        [sys.executable, str(WORKER), *(str(w.pid) for w in workers)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True,
    )
    procs.popens.append(server)
    procs.track(server.pid)
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        assert line == b"serving\n", server.stderr.read().decode()[-3000:] if server.stderr else ""
        assert wait_until(lambda: get(port, "/health")[0] == 200, 20)

        os.kill(workers[1].pid, signal.SIGKILL)

        assert wait_until(lambda: get(port, "/health")[0] in (503, None), 20)
        status, body = get(port, "/engine/liveness")
        if status == 200:  # the server may already be gone; when it answers, it names the rank
            document = json.loads(body)
            assert document["healthy"] is False
            assert document["failure"]["rank"] == 1
            assert document["failure"]["pid"] == workers[1].pid
        returncode = server.wait(30)
        assert returncode == 1
        assert workers[0].poll() is None  # the healthy worker was never touched
    finally:
        if server.poll() is None:
            with contextlib.suppress(OSError):
                os.kill(server.pid, signal.SIGKILL)
            server.wait(10)
        stderr = server.stderr.read().decode() if server.stderr else ""
        if server.stderr:
            server.stderr.close()
    assert "exited unexpectedly" in stderr
