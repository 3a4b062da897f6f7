"""Parent side of the helper processes: start in a new session, read JSON lines with deadlines,
time the exit through a pidfd, and always kill the whole session (the helper, prte, the ranks).

Used by the tests and by ``scripts/bench_e2e.py``; every wait has a deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from trtllm_liveness.demo._fuse_stall import remove_leftover_mounts
from trtllm_liveness.demo._scenario_launcher import kill_session
from trtllm_liveness.process import ProcessIdentity

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A free loopback port below 32768: Dynamo 1.6.1 parses DYN_SYSTEM_PORT as a signed 16-bit int."""
    for port in random.sample(range(20000, 32000), 200):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below 32768")


def http_get(port: int, path: str, timeout: float = 2.0) -> tuple[int | None, str]:
    """``(status, body)``; ``(None, reason)`` when nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return None, repr(exc)


class HelperProcess:
    """``python -m tests.programs.<module> <json>`` in a new session (stdin/stdout pipes, stderr to
    a file so a chatty child never blocks). Use as a context manager: exit kills the session.

    The helper gets a ``TMPDIR`` of its own (unless ``env`` sets one), removed at :meth:`close`
    after its session is killed: a helper that is killed, or ends with ``os._exit``, cannot remove
    what it made there (announce directories, the reference proxy's IPC directory, PRRTE bases)."""

    def __init__(self, module: str, options: dict[str, Any], env: dict[str, str] | None = None) -> None:
        self._stderr = tempfile.TemporaryFile()
        self.tmpdir = tempfile.mkdtemp(prefix="trtllm-helper-")
        try:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", f"tests.programs.{module}", json.dumps(options)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, cwd=REPO_ROOT,
                env={**os.environ, "TMPDIR": self.tmpdir, **(env or {})}, start_new_session=True,
            )
        except BaseException:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self._stderr.close()
            raise
        self.pid = self.popen.pid
        self._pidfd = os.pidfd_open(self.pid)
        self._buffer = b""
        self.exit_time: float | None = None

    def __enter__(self) -> HelperProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read_record(self, timeout: float, key: str | None = None) -> dict[str, Any]:
        """The next JSON line (having ``key`` if given). Raises ``TimeoutError`` with the stderr tail."""
        assert self.popen.stdout is not None
        deadline = time.monotonic() + timeout
        fd = self.popen.stdout.fileno()
        while True:
            while b"\n" in self._buffer:
                line, self._buffer = self._buffer.split(b"\n", 1)
                with contextlib.suppress(ValueError):
                    record = json.loads(line)
                    if isinstance(record, dict) and (key is None or key in record):
                        return record
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no record {key!r} within {timeout}s; stderr:\n{self.stderr_tail()}")
            ready, _, _ = select.select([fd], [], [], remaining)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise TimeoutError(f"helper closed stdout (exit {self.popen.poll()}); stderr:\n"
                                       f"{self.stderr_tail()}")
                self._buffer += chunk

    def send(self, line: str) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.write(line.encode() + b"\n")
        self.popen.stdin.flush()

    def wait_exit(self, timeout: float) -> int | None:
        """Wait on the pidfd up to ``timeout`` s; record when it became readable; the exit status or None."""
        if self.exit_time is None:
            ready, _, _ = select.select([self._pidfd], [], [], timeout)
            if not ready:
                return None
            self.exit_time = time.monotonic()
        return self.popen.wait(10)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stderr_tail(self, chars: int = 6000) -> str:
        self._stderr.flush()
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")[-chars:]

    def close(self) -> list[int]:
        """Kill everything left in the helper's session (ours: it was created for it); survivors."""
        survivors = kill_session(self.pid)
        with contextlib.suppress(Exception):
            self.popen.wait(10)
        # Under load an MPI rank can take longer than kill_session's bound to finish exiting (its
        # mappings torn down in D): wait for such survivors a little longer (bounded) before
        # deciding that the directory must be kept for them (a process the helper left stuck, a
        # frozen rank, stays: then the test calls remove_tmpdir() after releasing it).
        deadline = time.monotonic() + 3.0
        while survivors and time.monotonic() < deadline:
            time.sleep(0.05)
            survivors = [pid for pid in survivors if _still_running(pid)]
        for stream in (self.popen.stdin, self.popen.stdout):
            with contextlib.suppress(Exception):
                if stream is not None:
                    stream.close()
        with contextlib.suppress(OSError):
            os.close(self._pidfd)
        self._stderr.close()
        self._survivors = survivors
        if not survivors:  # a survivor may still use it (and a FUSE stall in it may be served)
            self.remove_tmpdir()
        return survivors

    def remove_tmpdir(self, survivors_timeout: float = 10.0) -> bool:
        """Remove the helper's TMPDIR once no survivor of :meth:`close` runs (bounded); True if gone.

        For tests whose helper left a process it had stuck (a frozen rank): call it after releasing
        that process (thawing its group)."""
        deadline = time.monotonic() + survivors_timeout
        survivors = list(getattr(self, "_survivors", []))
        while survivors and time.monotonic() < deadline:
            time.sleep(0.05)
            survivors = [pid for pid in survivors if _still_running(pid)]
        if survivors:
            return False
        self._survivors = []
        remove_leftover_mounts()  # the helper's own stalls: their owner is dead now
        # A killed launcher's daemons may still be writing their session files while they
        # exit: retry within a short bound until the directory is gone.
        deadline = time.monotonic() + 5.0
        while True:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            if not os.path.lexists(self.tmpdir) or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        return not os.path.lexists(self.tmpdir)


def _still_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            data = handle.read()
    except OSError:
        return False
    fields = data[data.rfind(b")") + 2:].split()
    return bool(fields) and fields[0] not in (b"Z", b"X")


def identities_of(record: dict[str, Any]) -> list[ProcessIdentity]:
    return [ProcessIdentity(*item) for item in record["identities"]]

