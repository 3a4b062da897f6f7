"""Build a reference executor whose MPI_Comm_spawn fails for real, and report how construction ended.

Usage: ``python -m tests.programs.spawn_failure '{"mode": "main", "liveness": true}'`` in a new
session with ``PRTE_MCA_prte_tmpdir_base`` exported as a regular file, so PRRTE cannot make its
session directory and the spawn raises in mpi4py's manager thread. Prints ``{"building": true}``,
then ``{"init_error": ..., "init_error_type": ...}`` if the constructor raised, or ``{"built":
true}``. Without the liveness extension the constructor never returns (upstream's start-up loop
waits on futures nobody completes); the parent observes that and kills the session.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile

from tests.support.ref_engine import build_executor, emit


def main(options: dict[str, object]) -> None:
    emit({"building": True})
    announce = tempfile.mkdtemp(prefix="trtllm-spawn-failure-")
    try:
        build_executor(str(options.get("mode", "main")), announce, liveness=bool(options.get("liveness", True)))
    except Exception as exc:
        emit({"init_error": str(exc), "init_error_type": type(exc).__name__,
              "cause_type": type(exc.__cause__).__name__ if exc.__cause__ else None})
    else:
        emit({"built": True})
    finally:
        shutil.rmtree(announce, ignore_errors=True)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    main(json.loads(sys.argv[1]) if len(sys.argv) > 1 else {})
    logging.shutdown()
    sys.stdout.flush()
    os._exit(0)  # mpi4py's atexit join and MPI_Finalize have nothing sane to do after a failed spawn
