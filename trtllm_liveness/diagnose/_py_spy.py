"""Python stacks of a rank by ``py-spy dump --nonblocking``, under one deadline for all ranks.

``py-spy`` needs ptrace rights over the rank; :func:`ptrace_access` tells beforehand where the
kernel will refuse them (the caller then uses the rank's own dump, :mod:`._faulthandler_stacks`).

``py-spy`` reads the target's memory (``/proc/<pid>/maps``, ``process_vm_readv``), which can block
on the target's mmap lock like a ``cmdline`` read, and a process stuck that way cannot be killed
either. So the caller excludes ranks with a thread in ``D``; each ``py-spy`` here runs in its own
session with its output in an unnamed file (no pipe to fill), and after the deadline it is
SIGKILLed and waited for briefly; if it is still there it is left and reported as ``py-spy did not
exit``. Both dump formats are read: ``--json`` where this ``py-spy`` has it (probed once per
executable), else the plain text. The records are :mod:`._stack_records`'.

Standard library only; never signals a process other than the ``py-spy`` children it started.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO

from ..process import _procfs
from ._stack_records import RankStacks, StackFrame, StackSource, StackStatus, ThreadStack, parse_stack_text

__all__ = ["DEFAULT_STACKS_TIMEOUT_S", "KILL_WAIT_S", "NO_PY_SPY", "RankStacks", "StackFrame", "StackStatus",
           "ThreadStack", "find_py_spy", "ptrace_access", "take_stacks"]

logger = logging.getLogger(__name__)

DEFAULT_STACKS_TIMEOUT_S = 2.0
KILL_WAIT_S = 0.2
"""How long a SIGKILLed ``py-spy`` is waited for before it is left behind."""


NO_PY_SPY = RankStacks(StackStatus.NO_PY_SPY, "py-spy is not installed (pip install 'trtllm-liveness[diagnose]')",
                      source=StackSource.PY_SPY)
"""What a rank's stacks are when they are asked of ``py-spy`` and it is not installed."""


def find_py_spy() -> str | None:
    """The ``py-spy`` executable: on ``PATH``, else next to this interpreter (a venv's ``bin``)."""
    return shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))


CAP_SYS_PTRACE = 19
_YAMA_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"


def _yama_scope() -> int:
    try:
        with open(_YAMA_SCOPE, "rb") as handle:
            return int(handle.read().strip() or b"0")
    except (OSError, ValueError):
        return 0  # no Yama: ptrace is governed by uids, dumpability and capabilities alone


def ptrace_access(pid: int) -> tuple[bool | None, str]:
    """Whether a ``py-spy`` started by this process may read ``pid``'s memory, and why.

    The kernel's rule for ``process_vm_readv`` (``PTRACE_MODE_ATTACH_REALCREDS``), read from
    ``/proc``: allowed with ``CAP_SYS_PTRACE`` (unless Yama ``ptrace_scope`` is 3); without it,
    only for the same user (real, effective and saved ids) on a dumpable target whose permitted
    capabilities are a subset of this process's, and only with Yama ``ptrace_scope`` 0
    (``py-spy``, this process's child, is never the rank's ancestor). Returns True, False, or
    None where it cannot tell (a root target's dumpability does not show: its ``/proc`` entry is
    root's either way; an unreadable ``/proc`` entry). Never blocks beyond procfs reads.
    """
    scope = _yama_scope()
    if scope >= 3:
        return False, "Yama ptrace_scope 3 forbids ptrace"
    try:
        mine = _procfs.read_status("self")
        target = _procfs.read_status(pid)
        owner = os.stat(f"{_procfs.PROCFS_PATH}/{pid}").st_uid
    except (OSError, ValueError) as exc:
        return None, f"cannot tell ({exc})"
    if mine.cap_effective & (1 << CAP_SYS_PTRACE):
        return True, "CAP_SYS_PTRACE"
    if scope >= 1:
        return False, f"no CAP_SYS_PTRACE and Yama ptrace_scope {scope}"
    if not mine.uids or set(target.uids[:3]) != {mine.uids[0]} or set(target.gids[:3]) != {mine.gids[0]}:
        return False, f"another user (uid {target.uids[1] if len(target.uids) > 1 else '?'}) and no CAP_SYS_PTRACE"
    if target.cap_permitted & ~mine.cap_permitted:
        return False, "the rank has capabilities this process lacks, and no CAP_SYS_PTRACE"
    if target.uids[1] != 0:
        if owner != target.uids[1]:
            return False, "the rank is not dumpable (its /proc entry is root's), and no CAP_SYS_PTRACE"
        return True, "same user, dumpable"
    return None, "same user (root) without CAP_SYS_PTRACE: permitted only if the rank is dumpable"


def _parse_json_dump(data: bytes) -> tuple[ThreadStack, ...]:
    threads = []
    for item in json.loads(data):
        frames = tuple(StackFrame(str(frame.get("name", "?")), str(frame.get("filename", "")),
                                  int(frame.get("line") or 0)) for frame in item.get("frames", ()))
        tid = item.get("os_thread_id")
        threads.append(ThreadStack(tid if isinstance(tid, int) else None, str(item.get("thread_name") or ""),
                                   bool(item.get("active")), bool(item.get("owns_gil")), frames))
    return tuple(threads)


_TEXT_THREAD = re.compile(r'^Thread (0x[0-9A-Fa-f]+|\d+) \(([^)]*)\)(?:: "(.*)")?')
_TEXT_FRAME = re.compile(r"^\s+(.+) \((.+):(\d+)\)\s*$")


def _parse_text_dump(text: str) -> tuple[ThreadStack, ...]:
    """The plain ``py-spy dump`` format (py-spy without ``--json``): ``Thread TID (idle): "name"``
    followed by indented ``function (file:line)`` lines, innermost first."""
    def thread(head: re.Match[str], frames: tuple[StackFrame, ...]) -> ThreadStack:
        ident, flags = head.group(1), head.group(2)
        return ThreadStack(None if ident.startswith("0x") else int(ident), head.group(3) or "", "active" in flags,
                           "gil" in flags, frames)

    return parse_stack_text(text, _TEXT_THREAD, _TEXT_FRAME, thread,
                            lambda found: StackFrame(found.group(1), found.group(2), int(found.group(3))))


@functools.cache
def _supports_json(py_spy: str) -> bool:
    """Whether this ``py-spy`` has ``dump --json`` (older ones print text). At most 5 s, plus the
    kill wait; an executable that does not answer is taken as text-only (its dumps time out then)."""
    with tempfile.TemporaryFile() as out:
        try:
            proc = subprocess.Popen([py_spy, "dump", "--help"], stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.DEVNULL, start_new_session=True)
        except OSError:
            return False
        try:
            proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            proc.kill()  # our unreaped child: the pid is still its own
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=KILL_WAIT_S)
            return False
        out.seek(0)
        return b"--json" in out.read()


@dataclass
class _Dump:
    """One running ``py-spy dump``; its output goes to an unnamed file, never a pipe that can fill."""

    pid: int
    proc: subprocess.Popen[bytes]
    out: IO[bytes]
    err: IO[bytes]
    started: float
    json_format: bool


def _start_dump(py_spy: str, pid: int, json_format: bool) -> _Dump | RankStacks:
    argv = [py_spy, "dump", "--nonblocking", "--pid", str(pid)] + (["--json"] if json_format else [])
    out = tempfile.TemporaryFile()
    err = tempfile.TemporaryFile()
    try:
        # Its own session: a terminal's SIGINT to the operator's scan never reaches it, and it is
        # no part of the caller's process group.
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True)
    except OSError as exc:
        out.close()
        err.close()
        return RankStacks(StackStatus.FAILED, f"py-spy could not start: {exc}")
    return _Dump(pid, proc, out, err, time.monotonic(), json_format)


def _finish_dump(dump: _Dump, deadline: float, timeout_s: float) -> RankStacks:
    try:
        try:
            dump.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return _kill_dump(dump, timeout_s)
        took_ms = (time.monotonic() - dump.started) * 1000
        dump.out.seek(0)
        dump.err.seek(0)
        data, errors = dump.out.read(), dump.err.read().decode("utf-8", "replace").strip()
        if dump.proc.returncode != 0:
            # py-spy prints "Error: ..." then (RUST_BACKTRACE builds) a backtrace: keep the error.
            lines = [line.strip() for line in errors.splitlines() if line.strip()]
            detail = next((line for line in lines if line.startswith("Error")), lines[0] if lines else
                          f"exit status {dump.proc.returncode}")
            return RankStacks(StackStatus.FAILED, f"py-spy failed: {detail}"[:300], took_ms=took_ms)
        try:
            threads = _parse_json_dump(data) if dump.json_format else _parse_text_dump(data.decode("utf-8", "replace"))
        except (ValueError, TypeError, AttributeError) as exc:
            return RankStacks(StackStatus.FAILED, f"py-spy output not understood: {exc}"[:300], took_ms=took_ms)
        return RankStacks(StackStatus.TAKEN, "", took_ms, threads=threads)
    finally:
        dump.out.close()
        dump.err.close()


def _kill_dump(dump: _Dump, timeout_s: float) -> RankStacks:
    took_ms = (time.monotonic() - dump.started) * 1000
    # Our own unreaped child: its pid cannot have been reused, so a plain signal is safe.
    dump.proc.send_signal(signal.SIGKILL)
    try:
        dump.proc.wait(timeout=KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        # Stuck in D on the target's mmap lock: it cannot be killed or reaped now. Left behind
        # (the subprocess module reaps it later if it ever exits); never waited for again.
        logger.warning("py-spy (pid %d) on pid %d did not exit %.1f s after SIGKILL; left behind",
                       dump.proc.pid, dump.pid, KILL_WAIT_S)
        return RankStacks(StackStatus.DID_NOT_EXIT,
                          f"py-spy did not exit: timed out after {timeout_s:g} s and still there after SIGKILL "
                          f"(pid {dump.proc.pid}, probably stuck on the target's mmap lock)", took_ms=took_ms)
    return RankStacks(StackStatus.TIMED_OUT, f"py-spy timed out after {timeout_s:g} s (killed)", took_ms=took_ms)


def take_stacks(pids: Sequence[int], *, timeout_s: float = DEFAULT_STACKS_TIMEOUT_S,
                py_spy: str | None = None) -> dict[int, RankStacks]:
    """Python stacks of ``pids``, one ``py-spy dump --nonblocking`` each, all in parallel.

    The caller has already excluded processes with a thread in ``D`` (see the module docstring).
    Blocks at most ``timeout_s`` plus :data:`KILL_WAIT_S` (one deadline for all), plus a one-time
    ``py-spy dump --help`` (bounded by 5 s) per ``py-spy`` executable. Never raises for a process
    that cannot be read: that is its :class:`RankStacks`. Thread-safe.
    """
    executable = py_spy if py_spy is not None else find_py_spy()
    if executable is None:
        return dict.fromkeys(pids, NO_PY_SPY)
    json_format = _supports_json(executable)
    deadline = time.monotonic() + timeout_s
    started: dict[int, _Dump | RankStacks] = {}
    results: dict[int, RankStacks] = {}
    try:
        for pid in pids:
            started[pid] = _start_dump(executable, pid, json_format)
        for pid, dump in started.items():
            result = dump if isinstance(dump, RankStacks) else _finish_dump(dump, deadline, timeout_s)
            results[pid] = result.with_source(StackSource.PY_SPY)
    finally:
        # Interrupted (Ctrl-C in the operator's scan): end the dumps still running, our own
        # unreaped children (each in its own session, so the terminal's SIGINT missed them).
        for pid, dump in started.items():
            if pid not in results and isinstance(dump, _Dump) and dump.proc.poll() is None:
                with contextlib.suppress(OSError):
                    dump.proc.send_signal(signal.SIGKILL)
    return results
