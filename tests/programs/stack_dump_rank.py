"""Child process: a rank that registers its stack dump, then takes orders on stdin.

Usage: ``python -m tests.programs.stack_dump_rank [--no-register] [--not-dumpable]``.
``--not-dumpable`` first makes it non-dumpable (``prctl(PR_SET_DUMPABLE, 0)``: only a
``CAP_SYS_PTRACE`` holder may then read its memory). It registers
:func:`~trtllm_liveness.diagnose._faulthandler_stacks.register_stack_dump` (unless
``--no-register``), starts a helper thread waiting in ``helper_waits_for_work``, prints one line
``ready <dump path or ->`` and then waits for orders in ``wait_for_a_peer_that_never_comes``
(its main thread reads stdin):

- ``stat PATH``: the main thread stats ``PATH`` (a FUSE stall: the main thread in ``D``);
- ``thread-stat PATH``: a new thread stats ``PATH`` (a helper thread in ``D``; the main one waits on);
- ``spin``: the main thread spins in ``spin_on_a_flag_nobody_sets``;
- ``threads N``: starts N more threads, each waiting 60 frames deep (a long dump: about N * 60
  lines written by the handler), then prints ``threads N``.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading

PR_SET_DUMPABLE = 4


def helper_waits_for_work(never: threading.Event) -> None:
    never.wait(3600)  # a rank stuck here: its test ends it (by pid) long before


def spin_on_a_flag_nobody_sets() -> None:
    flag = False
    while not flag:
        pass


def wait_deep(depth: int, never: threading.Event) -> None:
    if depth:
        wait_deep(depth - 1, never)
    else:
        never.wait(3600)  # as helper_waits_for_work


def wait_for_a_peer_that_never_comes() -> None:
    for line in sys.stdin:
        order, _, argument = line.strip().partition(" ")
        if order == "stat":
            os.stat(argument)
        elif order == "thread-stat":
            threading.Thread(target=os.stat, args=(argument,), name="stat-in-fuse", daemon=True).start()
        elif order == "spin":
            spin_on_a_flag_nobody_sets()
        elif order == "threads":
            never = threading.Event()
            for number in range(int(argument)):
                threading.Thread(target=wait_deep, args=(60, never), name=f"deep-{number}", daemon=True).start()
            sys.stdout.write(f"threads {argument}\n")
            sys.stdout.flush()


def main() -> None:
    if "--not-dumpable" in sys.argv:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")
    path = "-"
    if "--no-register" not in sys.argv:
        from trtllm_liveness.diagnose._faulthandler_stacks import register_stack_dump

        registered = register_stack_dump()
        path = registered.path if registered is not None else "-"
    threading.Thread(target=helper_waits_for_work, args=(threading.Event(),), name="helper", daemon=True).start()
    sys.stdout.write(f"ready {path}\n")
    sys.stdout.flush()
    wait_for_a_peer_that_never_comes()


if __name__ == "__main__":
    main()
