"""What a process that outlived the kill grace looks like, and why it is unkillable.

After :func:`~._bounded_stop.stop_processes` sent SIGKILL and waited its kill grace, a process
still there is **unkillable whatever its state**:

- **SIGKILL still pending** (in the process's queue or a thread's): the kernel has not let it act
  on the signal, asleep in ``D`` or looping in the kernel in ``R`` (docs/diagnosis.md, "Unkillable
  in any state"; docs/upstream-contract.md). A rule that looks only for ``D`` calls the one in
  ``R`` killable.
- **exiting** (``PF_EXITING``, SIGKILL no longer pending): it took the signal, but its exit is
  stuck in the kernel (a driver's release of its device files).
- **still present** otherwise (nothing pending, not exiting): reported as it is.

:func:`sample_survivor` reads, per thread of interest (the main thread, then threads in ``D``, then
threads in ``R``; at most :data:`MAX_THREADS`), the state, wait channel, SIGKILL pending and, where
readable (root), the kernel stack (``/proc/PID/task/TID/stack``), each read bounded by an
:class:`~trtllm_liveness.process._mm_read.MmReader`. Everything comes from ``_procfs`` and so from
``PROCFS_PATH`` (a fake tree in tests).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .._record_fields import JsonRecord
from ..process import _procfs
from ..process._mm_read import MmReader

__all__ = ["MAX_THREADS", "StuckThread", "SurvivorSample", "UnkillableBasis", "sample_survivor"]

MAX_THREADS = 8
STACK_READ_TIMEOUT_S = 0.2
"""Bound on each kernel-stack read (it waits on the task's exec lock, which a stuck exec holds)."""
_STACK_FRAMES = 24


class UnkillableBasis(str, enum.Enum):
    """Why a process still there after the kill grace is called unkillable."""

    SIGKILL_PENDING = "sigkill-pending"
    EXITING = "exiting"
    STILL_PRESENT = "still-present"


@dataclass(frozen=True)
class StuckThread(JsonRecord):
    """One thread of an unkillable process: state, wait channel, SIGKILL pending, kernel stack
    (innermost first; empty with ``kernel_stack_note`` saying why where it was not read)."""

    tid: int
    state: str
    wchan: str
    kill_pending: bool
    kernel_stack: tuple[str, ...] = ()
    kernel_stack_note: str = ""


@dataclass(frozen=True)
class SurvivorSample:
    """A process sampled after the kill grace. ``state``/``wchan`` are the main thread's;
    ``d_tids``/``d_wchan`` the threads in ``D`` and the first one's wait channel."""

    state: str = ""
    wchan: str = ""
    kill_pending: bool = False
    exiting: bool = False
    d_tids: tuple[int, ...] = ()
    d_wchan: str = ""
    threads: tuple[StuckThread, ...] = ()

    @property
    def kernel_stack(self) -> tuple[str, ...]:
        """The kernel stack of the first thread in ``D``, else of the main thread (empty where unread)."""
        chosen = next((thread for thread in self.threads if thread.tid in self.d_tids), None) or next(
            iter(self.threads), None)
        return chosen.kernel_stack if chosen is not None else ()

    def describe(self) -> str:
        """``state R, wchan -, SIGKILL pending, kernel stack uvm_spin_loop < uvm_tracker_wait``: what
        a report of a process that SIGKILL does not end says of it (the kernel stack where readable:
        root; otherwise why not)."""
        chosen = next((thread for thread in self.threads if thread.tid in self.d_tids), None) or next(
            iter(self.threads), None)
        stack = self.kernel_stack
        where = (f"kernel stack {' < '.join(stack[:6])}" if stack else
                 f"kernel stack {chosen.kernel_stack_note if chosen is not None and chosen.kernel_stack_note else '-'}")
        wchan = self.d_wchan or self.wchan
        return (f"state {self.state or '?'}, wchan {wchan or '-'}, "
                f"{'SIGKILL pending' if self.kill_pending else 'no SIGKILL pending'}, {where}")

    @property
    def basis(self) -> UnkillableBasis:
        """Why it is unkillable (see the module docstring)."""
        if self.kill_pending:
            return UnkillableBasis.SIGKILL_PENDING
        if self.exiting:
            return UnkillableBasis.EXITING
        return UnkillableBasis.STILL_PRESENT


def _read_stack(pid: int, tid: int, reader: MmReader) -> tuple[tuple[str, ...], str]:
    try:
        data = reader.read(pid, f"task/{tid}/stack")
    except PermissionError:
        return (), "not readable (root only)"
    except OSError as exc:
        return (), f"not readable: {exc.strerror or exc}"
    if not isinstance(data, bytes):
        return (), data.detail
    frames = _procfs.parse_kernel_stack(data, _STACK_FRAMES)
    return frames, "" if frames else "empty (running on a CPU as it was read)"


def _thread_state(pid: int, tid: int | None) -> tuple[str, str, bool]:
    info = _procfs.stat_or_none(pid, tid)
    if info is None:
        return "", "", False
    try:
        wchan = _procfs.read_wchan(pid, tid)
        pending = _procfs.sigkill_pending(pid, tid)
    except OSError:
        wchan, pending = "", False
    return info.state, wchan, pending


def sample_survivor(pid: int, *, reader: MmReader | None = None) -> SurvivorSample:
    """Sample ``pid`` (see the module docstring). Never raises: what could not be read (the
    process exiting right now, a fake tree without a file) is left empty. Blocks for procfs
    reads plus at most :data:`STACK_READ_TIMEOUT_S` per kernel stack (a stack read that times
    out is skipped, and later ones too once ``reader`` has too many stuck helpers)."""
    info = _procfs.stat_or_none(pid)
    if info is None:
        return SurvivorSample()
    try:
        states = _procfs.read_thread_states(pid)
    except OSError:
        states = {pid: info.state}
    _state, wchan, shared_pending = _thread_state(pid, None)  # the process's own wait channel and queue
    d_tids = _procfs.uninterruptible_tids(states)
    running = sorted(tid for tid, state in states.items() if state == "R" and tid != pid)
    chosen = list(dict.fromkeys([pid, *d_tids, *running]))[:MAX_THREADS]
    own_reader = reader is None
    stacks = MmReader(STACK_READ_TIMEOUT_S) if reader is None else reader
    threads = []
    try:
        for tid in chosen:
            state, thread_wchan, pending = _thread_state(pid, tid)
            if not state:
                continue  # exited since the listing
            frames, note = _read_stack(pid, tid, stacks)
            threads.append(StuckThread(tid, state, thread_wchan, pending, frames, note))
    finally:
        if own_reader:
            stacks.close()
    kill_pending = shared_pending or any(thread.kill_pending for thread in threads) or any(
        _thread_state(pid, tid)[2] for tid in states if tid not in chosen)
    d_wchan = next((thread.wchan for thread in threads if thread.tid in d_tids), "")
    return SurvivorSample(info.state, wchan, kill_pending, info.exiting, d_tids, d_wchan, tuple(threads))
