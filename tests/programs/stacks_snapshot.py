"""Child process: takes the stacks of one rank the way the proxy does, and prints what came back.

Usage: ``python -m tests.programs.stacks_snapshot PID START_TIME``. Prints one JSON object:
``py_spy`` (the executable :func:`find_py_spy` finds here, or null), ``py_spy_direct`` (what a
plain ``py-spy`` dump of the rank gave: its status and detail, or null without py-spy),
``ptrace_access`` (the check's answer and reason) and ``diagnosis`` (the rank's stacks from
:func:`diagnose` with the ``auto`` source). Run under ``setpriv`` or another interpreter to see
what a process without ptrace rights, or without py-spy, gets.
"""

from __future__ import annotations

import json
import sys

from trtllm_liveness.diagnose._diagnosis import diagnose
from trtllm_liveness.diagnose._py_spy import find_py_spy, ptrace_access, take_stacks
from trtllm_liveness.process import _procfs
from trtllm_liveness.process._identity import ProcessIdentity, local_hostname, local_pid_namespace


def main() -> None:
    pid, start_time = int(sys.argv[1]), int(sys.argv[2])
    # As the proxy has it: the rank's own report (reading another process's ns/pid needs ptrace rights).
    identity = ProcessIdentity(0, pid, start_time, local_hostname(), local_pid_namespace())
    if _procfs.read_start_time(pid) != start_time:
        raise SystemExit(f"pid {pid} is not the rank started at {start_time}")
    py_spy = find_py_spy()
    direct = take_stacks([pid], timeout_s=20.0, py_spy=py_spy)[pid] if py_spy is not None else None
    permitted, why = ptrace_access(pid)
    diagnosis = diagnose([identity], window_s=0.0, cpu_window_s=0.0, stacks_timeout_s=20.0)
    (rank,) = diagnosis.ranks
    print(json.dumps({
        "py_spy": py_spy,
        "py_spy_direct": None if direct is None else {"status": direct.status.value, "detail": direct.detail},
        "ptrace_access": [permitted, why],
        "diagnosis": None if rank.stacks is None else rank.stacks.to_dict(),
        "stuck_in": None if rank.stuck_in is None else rank.stuck_in.function,
    }))


if __name__ == "__main__":
    main()
