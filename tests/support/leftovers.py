"""The clean-up of what killed processes left behind, for the test session and the benchmarks:
PRRTE session bases of MPI launchers (each launcher's own base is
:func:`trtllm_liveness.demo._mpi_env.configure_mpi_env`'s) and stack-dump files of ranks
(:func:`trtllm_liveness.diagnose.register_stack_dump`'s)."""

from __future__ import annotations

import glob
import os
import shutil
import tempfile

from trtllm_liveness.demo._mpi_env import PRTE_TMPDIR_PREFIX
from trtllm_liveness.diagnose._faulthandler_stacks import _open_private_dir, _sweep, dump_directory, logger
from trtllm_liveness.process import _procfs

__all__ = ["remove_gone_dump_files", "remove_orphaned_prte_tmpdirs"]


def remove_orphaned_prte_tmpdirs() -> list[str]:
    """Remove the session bases (in this process's temp dir) whose owner no longer runs.

    A launcher that was SIGKILLed, or ended with ``os._exit`` before removing its own, leaves its
    base behind; it is harmless (the name is unique) but clutter. A live owner's base, or one whose
    owner pid was reused, is left alone. Returns the paths removed.
    """
    removed = []
    for path in glob.glob(os.path.join(tempfile.gettempdir(), f"{PRTE_TMPDIR_PREFIX}*")):
        owner = os.path.basename(path)[len(PRTE_TMPDIR_PREFIX):].split("-", 1)[0]
        if owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def remove_gone_dump_files(*, uid: int | None = None, base: str | None = None) -> None:
    """Remove the dump files of ``uid``'s processes of this PID namespace that are gone (ranks
    ended by SIGKILL or ``os._exit`` leave theirs). A directory that is missing or not private is
    left alone. Never raises; local file operations."""
    owner = os.geteuid() if uid is None else uid
    directory = dump_directory(owner, base)
    try:
        dir_fd = _open_private_dir(directory, owner)
    except OSError:
        return
    try:
        _sweep(dir_fd, _procfs.pid_namespace_inode())
    except (OSError, ValueError) as exc:
        logger.debug("liveness: dump files in %s not swept: %s", directory, exc)
    finally:
        os.close(dir_fd)
