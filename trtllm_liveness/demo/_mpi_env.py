"""Environment for Open MPI 5 (the PyPI wheel) as root on loopback, set before MPI starts.

Values are the ones measured on this project's machines (Open MPI 5 wheels, root, loopback).
Only ``setdefault`` is used, so whatever the user exported wins. ``PRTE_MCA_oob_tcp_if_include``
is deliberately never set: it breaks the spawn.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import MutableMapping

from ..exit._exit_guard import add_exit_cleanup

logger = logging.getLogger(__name__)

MPI_ENV_DEFAULTS: dict[str, str] = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    # Required for the singleton spawn that MPIPoolExecutor does.
    "PRTE_ALLOW_RUN_AS_ROOT": "1",
    "PRTE_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_pml": "ob1",  # MPI_Init 1.07 s -> 0.09 s
    "OMPI_MCA_btl": "self,sm,tcp",  # do not drop tcp
    "OMPI_MCA_btl_tcp_if_include": "lo",
    "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe",  # more ranks than cores
}

# With the default error handler Open MPI aborts the parent ~40 ms after a worker dies; with
# ULFM (fault tolerance) on, the parent survives and its futures stay pending forever: the field
# failure this project exists for.
FT_ENABLE_VAR = "OMPI_MCA_mpi_ft_enable"

# PRRTE keeps its session files in ``<base>/prte.<pid of prte>/`` and its PMIx server creates the
# rendezvous files there with O_EXCL. A SIGKILLed launcher leaves that directory behind, and with
# Linux's default pid_max of 32768 a later ``prte`` soon gets the same pid: its listener then fails
# ("The PMIx server's listener thread failed to start") and mpi4py's spawn thread dies, leaving every
# future pending forever. A directory of our own per launching process makes such a collision
# impossible; it is removed when that process exits.
PRTE_TMPDIR_VAR = "PRTE_MCA_prte_tmpdir_base"
PRTE_TMPDIR_PREFIX = "trtllm-liveness-prte-"

_private_dir_lock = threading.Lock()
_private_dir: tuple[int, str] | None = None  # (pid that made it, path)


def _private_prte_tmpdir() -> str:
    """This process's own PRRTE session base: made on first use, removed at exit (by its maker only)."""
    global _private_dir
    with _private_dir_lock:
        pid = os.getpid()
        if _private_dir is None or _private_dir[0] != pid:  # a forked child makes its own
            path = tempfile.mkdtemp(prefix=f"{PRTE_TMPDIR_PREFIX}{pid}-")
            _private_dir = (pid, path)
            atexit.register(_remove_private_dir, pid, path)
            # A process the exit guard ends (os._exit after a fatal error) skips this atexit hook,
            # registered before the guard's: hand the removal to the guard as well (idempotent).
            add_exit_cleanup(functools.partial(_remove_private_dir, pid, path))
        return _private_dir[1]


def _remove_private_dir(owner_pid: int, path: str) -> None:
    if os.getpid() == owner_pid:
        shutil.rmtree(path, ignore_errors=True)
        logger.debug("removed PRRTE session base %s", path)


def remove_private_prte_tmpdir() -> None:
    """Remove the session base :func:`configure_mpi_env` made for this process, now.

    For processes that end with ``os._exit`` (which skips the ``atexit`` removal), after their MPI
    pools are shut down. Idempotent; a no-op when none was made.
    """
    with _private_dir_lock:
        if _private_dir is not None:
            _remove_private_dir(*_private_dir)


def configure_mpi_env(
    environ: MutableMapping[str, str] | None = None, *, fault_tolerant: bool = True
) -> MutableMapping[str, str]:
    """Fill in the Open MPI variables (``setdefault``) and put this venv's ``bin`` first on PATH.

    ``fault_tolerant`` also defaults ``OMPI_MCA_mpi_ft_enable=1``. Unless set non-empty, PRRTE's session
    base (``PRTE_MCA_prte_tmpdir_base``) becomes a fresh directory of this process's, removed when this
    process exits (so a stale ``prte.<pid>`` left by a killed launcher can never collide with a new
    one); a mapping built for a child that outlives this process should set it explicitly. Must run
    before ``mpi4py`` initialises MPI (it reads the environment once). Not thread-safe (it edits the
    environment); returns the mapping it edited.
    """
    env = os.environ if environ is None else environ
    for key, value in MPI_ENV_DEFAULTS.items():
        env.setdefault(key, value)
    if not env.get(PRTE_TMPDIR_VAR):  # empty is PRRTE's default too
        env[PRTE_TMPDIR_VAR] = _private_prte_tmpdir()
    if fault_tolerant:
        env.setdefault(FT_ENABLE_VAR, "1")
    env.setdefault("OPAL_PREFIX", sys.prefix)  # help texts of the wheel
    # A plain-python spawn execs ``prte`` from PATH; Debian's or none makes every future hang.
    bindir = os.path.join(sys.prefix, "bin")
    path = env.get("PATH", "")
    parts = path.split(os.pathsep) if path else []
    if not parts or parts[0] != bindir:
        env["PATH"] = os.pathsep.join([bindir, *[p for p in parts if p != bindir]])
    return env
