"""A fake ``/proc`` tree for states no test can make for real: a task running in the kernel in
``R`` with SIGKILL pending (a driver's spin loop), an exiting task. ``_procfs`` reads everything
through ``PROCFS_PATH``, which a test points at the tree (``monkeypatch.setattr``)."""

from __future__ import annotations

import os
from pathlib import Path

SIGKILL_PENDING = f"{1 << 8:016x}"  # bit of signal 9
SPIN_STACK = (
    "[<0>] uvm_spin_loop+0x6b/0x140 [nvidia_uvm]\n"
    "[<0>] uvm_tracker_wait+0x9e/0x1d0 [nvidia_uvm]\n"
    "[<0>] uvm_va_block_make_resident+0x2a1/0x9c0 [nvidia_uvm]\n"
)


def stat_line(pid: int, comm: str, state: str, flags: int = 0x400040) -> str:
    # pid (comm) state ppid pgrp session tty tpgid flags ... starttime (field 22) ...
    rest = ["1", str(pid), str(pid), "0", "-1", str(flags)] + ["0"] * 12 + ["4"] + ["0"] + ["12345"] + ["0"] * 30
    return f"{pid} ({comm}) {state} {' '.join(rest)}\n"


def status_text(pending: str = "0" * 16, shared: str = "0" * 16) -> str:
    return (f"Name:\tpython\nState:\tR (running)\nUid:\t0\t0\t0\t0\nGid:\t0\t0\t0\t0\n"
            f"SigPnd:\t{pending}\nShdPnd:\t{shared}\nSigBlk:\t{'0' * 16}\nSigIgn:\t{'0' * 16}\nSigCgt:\t{'0' * 16}\n")


def fake_process(root: Path, pid: int, threads: dict[int, tuple[str, str, str, str, str]], *,
                 shared: str = "0" * 16, flags: int = 0x400040, devices: tuple[str, ...] = ()) -> None:
    """Process ``pid`` under ``root``; ``threads``: tid -> (state, wchan, SigPnd, kernel stack, comm);
    ``devices``: files its descriptors 3, 4, ... point to (symlinks, as in ``/proc/PID/fd``)."""
    proc = root / str(pid)
    (proc / "task").mkdir(parents=True)
    main_state, main_wchan, main_pending, _stack, comm = threads[pid]
    (proc / "stat").write_text(stat_line(pid, comm, main_state, flags))
    (proc / "status").write_text(status_text(main_pending, shared))
    (proc / "wchan").write_text(main_wchan)
    for tid, (state, wchan, pending, stack, name) in threads.items():
        task = proc / "task" / str(tid)
        task.mkdir()
        (task / "stat").write_text(stat_line(tid, name, state, flags))
        (task / "status").write_text(status_text(pending, shared))
        (task / "wchan").write_text(wchan)
        (task / "stack").write_text(stack)
    (proc / "fd").mkdir()
    for number, device in enumerate(devices, start=3):
        os.symlink(device, proc / "fd" / str(number))
