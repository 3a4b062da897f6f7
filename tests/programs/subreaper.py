"""Run a program under a child subreaper and report how every process it reaps ended.

Usage: ``python -m tests.programs.subreaper '{"argv": [...], "linger_s": 120}'``. This process sets
``PR_SET_CHILD_SUBREAPER`` and starts ``argv`` as its child in a process group of its own
(stdout and stderr inherited, so the child's JSON lines come through the same pipe). Orphans of
that child's tree are reparented here when their parent dies, so their exit statuses, which the
test process could never see (they are not its children), are reported: one JSON line
``{"reaped": pid, "status": s}`` per process reaped (``s`` the exit status, or minus the signal
number). First line: ``{"reaper": pid, "child": pid}``. Ends after ``linger_s`` (bounded); the
parent kills its session anyway.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import time
from typing import Any

PR_SET_CHILD_SUBREAPER = 36


def emit(record: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def become_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def main(options: dict[str, Any]) -> int:
    become_subreaper()
    # A process group of its own, as a server's under a supervisor (preexec_fn: Python 3.10 has no process_group).
    child = subprocess.Popen([str(arg) for arg in options["argv"]], preexec_fn=os.setpgrp)
    emit({"reaper": os.getpid(), "child": child.pid})
    deadline = time.monotonic() + float(options.get("linger_s", 120))
    while time.monotonic() < deadline:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG)
        except ChildProcessError:
            info = None
        if info is None:
            time.sleep(0.005)
            continue
        status = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        emit({"reaped": info.si_pid, "status": status})
        if info.si_pid == child.pid:
            child.returncode = status  # reaped here, not by Popen
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
