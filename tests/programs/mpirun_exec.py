"""Become ``mpirun`` (exec, same pid and session) running this project's Python on a helper module.

Usage: ``python -m tests.programs.mpirun_exec '{"mpirun_args": [...], "n": 3, "module":
"proxy_death_child", "options": {...}}'``: execs the venv's ``mpirun <mpirun_args> -n <n>
<python> -m tests.programs.<module> '<options json>'``. Lets ``tests.support.children.HelperProcess``
(new session, own TMPDIR, stderr file, kill of the whole session at close) run an mpirun job.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from trtllm_liveness.demo._mpi_env import configure_mpi_env


def main(options: dict[str, Any]) -> None:
    configure_mpi_env(fault_tolerant=bool(options.get("fault_tolerant", False)))
    mpirun = os.path.join(sys.prefix, "bin", "mpirun")
    argv = [mpirun, *[str(arg) for arg in options.get("mpirun_args", [])], "-n", str(int(options["n"])),
            sys.executable, "-m", f"tests.programs.{options['module']}", json.dumps(options.get("options", {}))]
    os.execv(mpirun, argv)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
