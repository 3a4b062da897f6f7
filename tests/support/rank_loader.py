"""A rank's loader thread, driven from outside the rank: the soak's slow I/O, page-cache and allocation faults.

A serving rank often has a helper thread that reads (weights from a network file system, a
FUSE-backed store, a checkpoint on disk) while its main thread steps the engine. The test hosts'
ranks live in mount namespaces of their own (a private ``/tmp``), so a FUSE mount made by the
caller is not visible there; an open file is, when handed over. So:

- in the rank (``tests/programs/proxy_death_child.py`` with the option ``loader: {"rank": R,
  "socket": PATH}``), :func:`serve_loader` listens on a unix socket at ``PATH`` (a directory every
  host sees: the test hosts' shared one) and runs each request in a thread of its own, named
  ``loader``:

  * ``{"op": "read", "seconds": S, "size": N, "pause_s": P, "check": bool}`` with one open file
    (``SCM_RIGHTS``): ``pread`` ``N`` bytes at a time from offset 0 (wrapping at the end of the
    file), ``P`` seconds apart, for ``S`` seconds; with ``check`` each byte must be the slow-read
    file's pattern (``offset % SLOW_READ_PERIOD``, :mod:`tests.support.fuse_stall`);
  * ``{"op": "allocate", "bytes": N}``: ``N`` bytes of anonymous memory, every page touched (in a
    memory group limited below that, the kernel's OOM killer ends the rank);

  each answers ``started <tid>`` at once, then one result line: a read the
  :class:`~tests.support.slow_reads.SlowReadResult` line ``<reads> <bytes>
  <mismatches> <longest read s>``, an allocation ``allocated <bytes>``; ``error <text>`` when it
  failed;
- outside, :func:`hand_over` starts a short-lived child that opens the file, connects, sends the
  request with the descriptor, and prints what comes back. A child, not the caller: the FUSE test
  server (:class:`~trtllm_liveness.demo._fuse_stall.FuseStall`) answers its own process's requests
  with ``EIO``, so its owner cannot open the slow file itself.

A read of the FUSE test server's held-read file (``FuseStall.read_path``) never returns: the
loader thread is then in ``D`` without a context switch until the server is released, a wedged
thread of a rank whose main thread serves on. Every wait is bounded but that one, which the
FUSE server's release ends (the read fails with ``ENOTCONN``).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from tests.support.fuse_stall import SLOW_READ_PERIOD

ACCEPT_POLL_S = 1.0  # the listener's accept timeout (the thread is a daemon: it ends with the rank)
REQUEST_TIMEOUT_S = 10.0  # a connection's request must come within this
PAGE = 4096


def serve_loader(path: str) -> threading.Thread:
    """In the rank: listen on the unix socket ``path`` and serve every request in a ``loader``
    thread (see the module docstring). Returns the accepting thread (a daemon)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)
    listener.settimeout(ACCEPT_POLL_S)
    thread = threading.Thread(target=_accept, args=(listener,), name="loader-accept", daemon=True)
    thread.start()
    return thread


def _accept(listener: socket.socket) -> None:
    while True:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        except OSError:
            return
        threading.Thread(target=_serve, args=(conn,), name="loader", daemon=True).start()


def _serve(conn: socket.socket) -> None:
    fds: list[int] = []
    try:
        conn.settimeout(REQUEST_TIMEOUT_S)
        message, fds, _flags, _addr = socket.recv_fds(conn, 4096, 1)
        request = json.loads(message)
        conn.sendall(f"started {threading.get_native_id()}\n".encode())
        if request.get("op") == "read" and fds:
            line = _read(fds[0], float(request["seconds"]), int(request["size"]), float(request.get("pause_s", 0)),
                         bool(request.get("check")))
        elif request.get("op") == "allocate":
            line = _allocate(int(request["bytes"]))
        else:
            line = f"error bad request {request!r} ({len(fds)} descriptors)"
        conn.sendall(f"{line}\n".encode())
    except (OSError, ValueError, KeyError, TypeError) as exc:
        with contextlib.suppress(OSError):
            conn.sendall(f"error {type(exc).__name__}: {exc}\n".encode())
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        conn.close()


def _read(fd: int, seconds: float, size: int, pause_s: float, check: bool) -> str:
    pattern = bytes(range(SLOW_READ_PERIOD)) * (size // SLOW_READ_PERIOD + 2)
    reads = nbytes = mismatches = 0
    longest = 0.0
    offset = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        before = time.monotonic()
        data = os.pread(fd, size, offset)
        longest = max(longest, time.monotonic() - before)
        if not data:
            if offset == 0:
                return f"error the file is empty after {reads} reads"
            offset = 0
            continue
        if check:
            start = offset % SLOW_READ_PERIOD
            mismatches += data != pattern[start:start + len(data)]
        reads += 1
        nbytes += len(data)
        offset += len(data)
        if pause_s > 0:
            time.sleep(pause_s)
    return f"{reads} {nbytes} {mismatches} {longest:.3f}"


def _allocate(nbytes: int) -> str:
    buffer = bytearray(nbytes)  # calloc'd: its pages are charged only when touched
    for offset in range(0, nbytes, PAGE):
        buffer[offset] = 1
    return f"allocated {len(buffer)}"


# --------------------------------------------------------------------------- outside the rank

# argv: the socket, the file to hand over ("" for none), the request (JSON), the timeout in s.
# Waits (bounded) for the socket, opens the file, sends both, then copies the answer's lines to
# stdout until the rank closes the connection (each line flushed as it comes).
HAND_OVER_CODE = """\
import json, os, socket, sys, time
path, file, request, timeout = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
deadline = time.monotonic() + timeout
while not os.path.exists(path):
    if time.monotonic() >= deadline:
        sys.exit(f"no loader socket at {path} within {timeout} s")
    time.sleep(0.02)
fds = [os.open(file, os.O_RDONLY)] if file else []
conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
conn.settimeout(timeout)
conn.connect(path)
socket.send_fds(conn, [request.encode()], fds)
for fd in fds:
    os.close(fd)
conn.settimeout(None)
with conn.makefile("rb") as answers:
    for line in answers:
        sys.stdout.buffer.write(line); sys.stdout.flush()
"""


class HandOver:
    """One request handed to a rank's loader (:func:`hand_over`): the child that carries it, and
    its answer's lines as they come. :meth:`close` ends the child (a read that never returns
    keeps it waiting)."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen
        self._buffer = b""

    def line(self, timeout: float) -> str | None:
        """The next line of the answer, waited for at most ``timeout`` s; None if none came (or
        the child ended without one)."""
        assert self.popen.stdout is not None
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self.popen.stdout], [], [], left)
            if not ready:
                return None
            chunk = os.read(self.popen.stdout.fileno(), 4096)
            if not chunk:
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode(errors="replace")

    def error(self) -> str:
        """The child's stderr once it ended (empty while it runs)."""
        if self.popen.poll() is None or self.popen.stderr is None:
            return ""
        return self.popen.stderr.read().decode(errors="replace").strip()[-500:]

    def close(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)
        for stream in (self.popen.stdout, self.popen.stderr):
            if stream is not None:
                stream.close()


def hand_over(path: str, request: dict[str, Any], file: str = "", timeout: float = 30.0) -> HandOver:
    """Send ``request`` (with ``file`` opened, if given) to the loader listening at ``path``; the
    child that carries it waits at most ``timeout`` s for the socket and the connection."""
    popen = subprocess.Popen([sys.executable, "-I", "-c", HAND_OVER_CODE, path, file, json.dumps(request),
                              repr(float(timeout))], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, start_new_session=True)
    return HandOver(popen)
