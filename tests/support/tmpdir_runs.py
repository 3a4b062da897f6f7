"""Runs of a ``trtllm-liveness`` command that must leave nothing behind, told apart by their ``TMPDIR``.

The command (``demo``, ``drill``) runs as a child in a session of its own with a short ``TMPDIR`` of
the test's (:func:`short_tmpdir`); everything it starts inherits that ``TMPDIR``, at any depth (its
engine process, ``prte``, the MPI ranks), so after it exits :func:`finish` finds what survived it
by that variable in ``/proc/<pid>/environ``, and asserts that nothing did and that the directory
holds no more than ``allowed``. :func:`kill_leftovers` ends such survivors after a failure, each
through a pidfd re-checked after opening it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

from tests.support.process_tracker import ProcessTracker
from tests.support.waits import WAIT_SCALE, wait_until

RUN_TIMEOUT = 240 * WAIT_SCALE


def processes_with_tmpdir(tmpdir: Path) -> list[int]:
    """Live processes (this one aside) whose ``TMPDIR`` is ``tmpdir`` or below it."""
    prefix = f"TMPDIR={tmpdir}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        with contextlib.suppress(OSError), open(f"/proc/{name}/environ", "rb") as handle:
            if any(entry == prefix or entry.startswith(prefix + b"/") for entry in handle.read().split(b"\0")):
                found.append(int(name))
    return found


def cmdline(pid: int) -> bytes:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as handle:
        return handle.read()
    return b""


def ranks_up(tmpdir: Path) -> bool:
    """Whether an MPI pool rank (``mpi4py.futures.server``) of the run is up."""
    return any(b"mpi4py.futures.server" in cmdline(pid) for pid in processes_with_tmpdir(tmpdir))


def kill_leftovers(tmpdir: Path) -> None:
    """SIGKILL every process that carries ``tmpdir`` as its TMPDIR (all started by the test's run)."""
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
def short_tmpdir(prefix: str) -> Iterator[Path]:
    """A TMPDIR with a short path (ZMQ ipc sockets live below it, and a unix socket address holds
    108 bytes: pytest's tmp_path is too deep); its survivors killed and it removed on the way out."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        yield path
    finally:
        kill_leftovers(path)  # only after a failure
        shutil.rmtree(path, ignore_errors=True)


def start(procs: ProcessTracker, argv: Sequence[str], env: Mapping[str, str]) -> subprocess.Popen[bytes]:
    """``argv`` in a session of its own, output captured, tracked by ``procs``."""
    proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            env=dict(env))
    procs.popens.append(proc)
    procs.track(proc.pid)
    return proc


def finish(proc: subprocess.Popen[bytes], tmpdir: Path, allowed: Iterable[str] = ()) -> tuple[int, str, str]:
    """Wait for the run (bounded); assert that no process and no file but ``allowed`` outlived it;
    return its status, stdout and stderr."""
    out, err = proc.communicate(timeout=RUN_TIMEOUT)
    # The command waits for its session's processes before it returns: nothing may be left even
    # now, but a dying process may take a moment to leave /proc.
    wait_until(lambda: not processes_with_tmpdir(tmpdir), 10)
    left = processes_with_tmpdir(tmpdir)
    assert left == [], f"processes of the run survive: {[(pid, cmdline(pid)) for pid in left]}"
    assert sorted(path.name for path in tmpdir.iterdir()) == sorted(allowed), "the run left files in its TMPDIR"
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")
