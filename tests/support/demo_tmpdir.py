"""A demo run's private ``TMPDIR``, and the processes that carry it.

A test runs ``trtllm-liveness demo`` with a ``TMPDIR`` of its own: the scenario child, ``prte`` and
the ranks all inherit it, so after the demo exits :func:`processes_with_tmpdir` finds anything it
left behind, at any depth, and :func:`kill_processes_with_tmpdir` ends those (only processes this
test's demo started carry that directory). :func:`short_tmpdir` makes the directory: short,
because the reference proxy's ZMQ ipc sockets live below it and a unix socket address holds 108
bytes (pytest's ``tmp_path`` is too deep).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tests.support.waits import wait_until


def processes_with_tmpdir(tmpdir: Path) -> list[int]:
    """Live processes (other than this one) whose ``TMPDIR`` is ``tmpdir`` or below it."""
    prefix = f"TMPDIR={tmpdir}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            with open(f"/proc/{name}/environ", "rb") as handle:
                entries = handle.read().split(b"\0")
            if any(entry == prefix or entry.startswith(prefix + b"/") for entry in entries):
                found.append(int(name))
    return found


def cmdline(pid: int) -> bytes:
    """``pid``'s command line (NUL-separated), empty once it is gone."""
    with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as handle:
        return handle.read()
    return b""


def kill_processes_with_tmpdir(tmpdir: Path) -> None:
    """SIGKILL (through a pidfd, re-checked after opening it) every process that carries
    ``tmpdir`` as its TMPDIR, for up to 10 s (scaled)."""
    def kill_all() -> bool:
        for pid in processes_with_tmpdir(tmpdir):
            with contextlib.suppress(OSError):
                fd = os.pidfd_open(pid)
                try:
                    if pid in processes_with_tmpdir(tmpdir):  # not recycled since the listing
                        signal.pidfd_send_signal(fd, signal.SIGKILL)
                finally:
                    os.close(fd)
        return not processes_with_tmpdir(tmpdir)

    wait_until(kill_all, 10, 0.05)


@contextlib.contextmanager
def short_tmpdir() -> Iterator[Path]:
    """A fresh directory ``/tmp/tdemo-*``; at the end, the processes that still carry it are
    killed (only after a failure are there any) and it is removed."""
    path = Path(tempfile.mkdtemp(prefix="tdemo-", dir="/tmp"))
    try:
        yield path
    finally:
        kill_processes_with_tmpdir(path)
        shutil.rmtree(path, ignore_errors=True)
