"""The worker side: every rank's entry when liveness is on.

The proxy wraps ``mpi_session.submit`` while it starts the workers, so each rank runs
:func:`liveness_worker_entry` (it travels by reference to this module: workers need no import
hook), which

1. starts the **proxy-death watch** (all versions): a daemon thread holding a pidfd on the proxy
   process, verified against its start time. When the proxy dies (SIGKILL, OOM kill), the rank
   logs one line and ends with ``os._exit(PROXY_DIED_EXIT_STATUS)``, so ranks launched by
   ``mpirun`` (``MpiCommSession``) do not keep their GPUs after their server is gone. Skipped in
   the proxy process itself (rank 0 of ``MpiCommSession`` runs there) and on another host or PID
   namespace (no pidfd can reach the proxy there);
2. on 1.2.x (no identities in upstream's protocol), **announces identities**: the ranks gather
   them over the session's own communicator (upstream's ``tensorrt_llm._utils.mpi_comm()``, which
   is the sub-communicator of a sub-communicator session; ``COMM_WORLD`` only without it) and the
   leader sends them over the side channel (:mod:`._side_channel`). That happens before the model
   is built, so a death during initialization is caught;
3. calls the real ``worker_main`` with exactly the arguments upstream gave.

Nothing here raises into upstream: a failure is logged and the rank runs unmonitored.
"""

from __future__ import annotations

import json
import logging
import os
import select
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from ..._identity import capture_identity, local_hostname, local_pid_namespace

logger = logging.getLogger(__name__.rpartition(".")[0])

FN_KWARG = "_trtllm_liveness_fn"
CHANNEL_KWARG = "_trtllm_liveness_channel"
PROXY_KWARG = "_trtllm_liveness_proxy"
PROXY_DIED_EXIT_STATUS = 75
"""Exit status of a rank ended by the proxy-death watch (EX_TEMPFAIL: the job may be restarted)."""

_SEND_TIMEOUT_MS = 5000
_WATCH_TICK_MS = 1000  # how often the watch re-checks that it should still run; not a poll interval


def liveness_worker_entry(*args: Any, **kwargs: Any) -> Any:
    """Every rank's entry when liveness is on; see the module docstring.

    Pops its own keyword arguments and calls the wrapped ``worker_main`` with the rest.
    """
    target = kwargs.pop(FN_KWARG)
    channel = kwargs.pop(CHANNEL_KWARG, None)
    proxy = kwargs.pop(PROXY_KWARG, None)
    if proxy is not None:
        try:
            start_proxy_death_watch(proxy)
        except Exception:
            logger.warning("liveness: could not start the proxy-death watch", exc_info=True)
    if channel is not None:
        try:
            announce_identities(channel)
        except Exception:
            logger.warning("liveness: could not announce worker identities", exc_info=True)
    return target(*args, **kwargs)


def proxy_identity() -> list[Any]:
    """What the proxy passes to its workers: ``[pid, start_time, hostname, pid_namespace]``."""
    identity = capture_identity(0)
    return [identity.pid, identity.start_time, identity.hostname, identity.pid_namespace]


def start_proxy_death_watch(proxy: Sequence[Any]) -> threading.Thread | None:
    """Start the daemon thread that ends this rank when the proxy process ``proxy`` ends.

    Returns None (and starts nothing) in the proxy process itself, on another host or PID
    namespace, or when the proxy is already gone or its start time does not match (then the rank
    ends at once: its proxy is gone). Raises ``ValueError`` for a malformed ``proxy``.
    """
    from ... import _pidfd
    from ..._errors import LivenessError

    pid, start_time, hostname, namespace = proxy
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 1:
        raise ValueError(f"bad proxy pid {pid!r}")
    if pid == os.getpid():
        return None  # rank 0 of MpiCommSession runs in the proxy process
    if hostname != local_hostname() or namespace != local_pid_namespace():
        logger.info("liveness: the proxy (pid %d on %s) is on another host or PID namespace; no proxy-death watch",
                    pid, hostname)
        return None
    if not _pidfd.pidfd_supported():
        logger.warning("liveness: no pidfd on this kernel: a rank does not exit when its proxy dies")
        return None
    try:
        fd = _pidfd.open_verified_pidfd(pid, start_time)
    except (LivenessError, OSError):
        _proxy_gone(pid)
        return None
    thread = threading.Thread(target=_watch_proxy, args=(fd, pid), name="trtllm-liveness-proxy-watch", daemon=True)
    thread.start()
    return thread


def _watch_proxy(fd: int, pid: int) -> None:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while not poller.poll(_WATCH_TICK_MS):
        pass
    _proxy_gone(pid)


def _proxy_gone(pid: int) -> None:
    logger.critical("liveness: the proxy process (pid %d) is gone; ending this rank (pid %d) with status %d",
                    pid, os.getpid(), PROXY_DIED_EXIT_STATUS)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed stream must not keep the rank alive
            pass
    os._exit(PROXY_DIED_EXIT_STATUS)


def session_comm() -> Any:
    """The communicator of this rank's session: upstream's ``mpi_comm()`` where it is loaded
    (it is once ``worker_main`` was unpickled), else ``COMM_WORLD``."""
    from ._features import find_symbol

    mpi_comm = find_symbol(["mpi_comm"], ["tensorrt_llm._utils"], import_missing=False)
    if callable(mpi_comm):
        try:
            comm = mpi_comm()
            if comm is not None:
                return comm
        except Exception:
            logger.debug("liveness: tensorrt_llm._utils.mpi_comm() failed; using COMM_WORLD", exc_info=True)
    from mpi4py import MPI

    return MPI.COMM_WORLD


def announce_identities(channel: Mapping[str, str], comm: Any = None) -> None:
    """Gather every rank's identity over ``comm`` (default :func:`session_comm`); the leader sends them."""
    comm = session_comm() if comm is None else comm
    rank = comm.Get_rank()
    try:
        mine: list[Any] | None = list(capture_identity(rank))
    except Exception:
        logger.warning("liveness: rank %d could not capture its identity", rank, exc_info=True)
        mine = None
    # Every rank of the session's communicator takes part, even one whose capture failed.
    gathered = comm.allgather(mine)
    if rank != 0:
        return
    import zmq

    payload = json.dumps({"token": channel["token"], "identities": [g for g in gathered if g is not None]})
    context: Any = zmq.Context.instance()
    sock = context.socket(zmq.PUSH)
    try:
        sock.setsockopt(zmq.LINGER, _SEND_TIMEOUT_MS)
        sock.setsockopt(zmq.SNDTIMEO, _SEND_TIMEOUT_MS)
        sock.connect(channel["address"])
        sock.send(payload.encode())
    finally:
        sock.close()
