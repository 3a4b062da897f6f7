"""The worker side: every rank's entry when liveness is on.

The proxy wraps ``mpi_session.submit`` while it starts the workers, so each rank runs
:func:`liveness_worker_entry` (it travels by reference to this module: workers need no import
hook) with one keyword of its own, a :class:`~._worker_spec.WorkerSpec` (checked here before any
part of it is used), which

1. starts the **proxy-death watch** (all versions; :class:`ProxyDeathWatch`): a daemon thread
   holding a pidfd on the proxy process, opened at the rank's start and verified against the
   start time the proxy sent (:func:`proxy_identity`, passed with the task, so every rank learns
   the pid of the process that submitted it: the spawning parent under ``MpiPoolSession``,
   rank 0's process under ``MpiCommSession``, with or without a sub-communicator; no collective).
   When the proxy dies (SIGKILL, OOM kill), the rank logs one line naming it and ends with
   ``os._exit(PROXY_DIED_EXIT_STATUS)``, so ranks launched by ``mpirun`` (``MpiCommSession``) do
   not keep their GPUs after their server is gone. Skipped in the proxy process itself (rank 0 of
   ``MpiCommSession`` runs there) and on another host or PID namespace (no pidfd can reach the
   proxy there); without pidfd, ``/proc`` is polled (one WARNING). A rank whose own interpreter
   exit has begun is not ended for ``_EXIT_GRACE_S`` (a clean job end, where rank 0 may exit
   first, keeps its statuses). ``TRTLLM_LIVENESS_PROXY_WATCH=0`` turns the watch off;
2. on 1.2.x (no identities in upstream's protocol), **announces identities**: the ranks gather
   them over the session's own communicator (upstream's ``tensorrt_llm._utils.mpi_comm()``, which
   is the sub-communicator of a sub-communicator session; ``COMM_WORLD`` only without it) and the
   leader sends them over the side channel (:mod:`._side_channel`). That happens before the model
   is built, so a death during initialization is caught;
3. where the proxy runs an agent hub (``hosts``, :mod:`trtllm_liveness.multihost`), **joins the
   hosts' agents**: one ``allgather`` over the session's communicator, then the lowest rank of each
   host other than the proxy's runs that host's agent (:mod:`trtllm_liveness.multihost._placement`);
4. with stall detection on (``stall_timeout_s``), **counts executor iterations** and reports them
   to the proxy (:mod:`._progress`), so a long non-streaming generation is progress; a rank of
   another host reports them to its host's agent (:func:`agent_beats`), which forwards them;
5. first of all, registers the rank's **stack dump** (``diagnose/_faulthandler_stacks.py``): a
   snapshot then gets its Python stacks without ptrace rights;
6. calls the real ``worker_main`` with exactly the arguments upstream gave.

Nothing here raises into upstream: a failure is logged and the rank runs unmonitored (a spec
without a callable task is the one exception: nothing could run, so its error is the task's).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..._errors import ProcessGone
from ..._events import MonitorMethod
from ...process import _pidfd
from ...process._identity import capture_identity, local_hostname, local_pid_namespace
from ...process._procfs import boot_id
from ._worker_spec import SPEC_KWARG, IdentityChannelSpec, ProgressSpec, ProxyIdentity, WorkerSpec, WorkerSpecError

if TYPE_CHECKING:
    from ...multihost._agent import HostAgent

logger = logging.getLogger(__name__.rpartition(".")[0])

PROXY_DIED_EXIT_STATUS = 75
"""Exit status of a rank ended by the proxy-death watch (EX_TEMPFAIL: the job may be restarted)."""

WATCH_ENV_VAR = "TRTLLM_LIVENESS_PROXY_WATCH"
"""``0`` in a rank's environment turns the proxy-death watch off there (diagnosis; tests)."""

_SEND_TIMEOUT_MS = 5000
_WATCH_TICK_MS = 1000  # poll() wakes this often; a bound on each wait, not how fast a death is seen
_FALLBACK_POLL_S = 0.5  # without pidfd: how often /proc/<pid>/stat is re-read
_EXIT_GRACE_S = 5.0  # a rank already exiting on its own is ended only if still here after this
_LAST_WORDS_S = 1.0  # the most the rank waits for its last log line and flushes


def liveness_worker_entry(*args: Any, **kwargs: Any) -> Any:
    """Every rank's entry when liveness is on; see the module docstring.

    Pops its own keyword (:data:`~._worker_spec.SPEC_KWARG`, a :class:`~._worker_spec.WorkerSpec`)
    and calls upstream's task with the rest. A spec this rank cannot use is logged (one ERROR naming
    this process, its host and what is wrong) and the task runs without liveness on this rank;
    only a spec without a callable task raises its :class:`~._worker_spec.WorkerSpecError` (nothing
    could run: the task's future carries the error back to the proxy).
    """
    raw = kwargs.pop(SPEC_KWARG, None)
    try:
        spec = WorkerSpec.from_wire(raw)
    except WorkerSpecError as exc:
        task = WorkerSpec.task_of(raw)
        logger.error("liveness: the worker process (pid %d) on host %s rejected the proxy's worker spec: %s; %s",
                     os.getpid(), local_hostname(), exc,
                     "the task cannot run" if task is None else "its task runs without liveness on this rank")
        if task is None:
            raise
        return task(*args, **kwargs)
    start_liveness(spec)
    return spec.fn(*args, **kwargs)


def start_liveness(spec: WorkerSpec) -> None:
    """This rank's part of liveness, as ``spec`` asks (steps 1 to 4 of the module docstring); each
    step that fails is logged and skipped: the rank then runs that part unmonitored."""
    from ...diagnose._faulthandler_stacks import register_stack_dump_or_warn

    register_stack_dump_or_warn()
    if spec.proxy is not None and os.environ.get(WATCH_ENV_VAR, "1") != "0":
        try:
            start_proxy_death_watch(spec.proxy)
        except Exception:
            logger.warning("liveness: could not start the proxy-death watch", exc_info=True)
    if spec.channel is not None:
        try:
            announce_identities(spec.channel)
        except Exception:
            logger.warning("liveness: could not announce worker identities", exc_info=True)
    progress = spec.progress
    if spec.hub is not None:
        try:
            from ...multihost._placement import start_for_rank

            proxy = spec.proxy
            _agent, beats = start_for_rank(spec.hub, session_comm(), None if proxy is None else
                                           (proxy.hostname, proxy.boot_id or "", proxy.pid_namespace),
                                           open_beats=None if progress is None else agent_beats(progress.interval_s))
            if beats is not None and progress is not None:  # a remote host's rank: to its host's agent
                progress = ProgressSpec(beats[0], beats[1], progress.interval_s)
        except Exception:
            logger.warning("liveness: could not start this host's agent; its ranks are not watched", exc_info=True)
    if progress is not None:
        try:
            from ._progress import start_iteration_reporter

            start_iteration_reporter(progress, session_comm().Get_rank())
        except Exception:
            logger.warning("liveness: could not report executor iterations; only output counts as progress",
                           exc_info=True)


def agent_beats(interval_s: float) -> Callable[[HostAgent], tuple[str, str]]:
    """Opens a remote host's agent's own progress channel (the proxy's is local IPC, out of that
    host's reach): the host's ranks report there, the agent forwards batched to the hub. The agent
    owns the channel (closed when it ends)."""
    def open_beats(agent: HostAgent) -> tuple[str, str]:
        from ._progress import ProgressChannel

        channel = ProgressChannel(lambda beat: agent.note_iteration(beat.rank, beat.count, beat.at), interval_s)
        agent.adopt(channel.close)
        return channel.address, channel.token

    return open_beats


def proxy_identity() -> list[Any]:
    """What the proxy passes to its workers: ``[pid, start_time, hostname, pid_namespace, boot_id]``.

    ``boot_id`` (the kernel's, ``""`` if unreadable) tells two hosts apart even where hostnames
    and the initial PID namespace's inode coincide; a 4-element form without it is still accepted.
    """
    identity = capture_identity(0)
    return [identity.pid, identity.start_time, identity.hostname, identity.pid_namespace, boot_id()]


class ProxyDeathWatch:
    """One rank's watch on its proxy process; see :func:`start_proxy_death_watch`.

    The thread owns its descriptor (a pidfd, or none in the procfs fallback) and closes it when
    the proxy is gone, just before it ends the rank. ``on_gone(pid)`` ends the rank (default:
    one CRITICAL line naming the dead proxy, then ``os._exit(PROXY_DIED_EXIT_STATUS)``); tests
    pass their own.
    """

    def __init__(self, pid: int, start_time: int | None, fd: int | None,
                 on_gone: Callable[[int], None]) -> None:
        self.pid = pid
        self.start_time = start_time
        self.fd = fd  # closed by the thread once the proxy is gone
        self.method = MonitorMethod.PIDFD if fd is not None else MonitorMethod.PROCFS
        self._on_gone = on_gone
        self.thread = threading.Thread(target=self._run, name="trtllm-liveness-proxy-watch", daemon=True)

    def _run(self) -> None:
        if self.fd is not None:
            try:
                poller = select.poll()
                poller.register(self.fd, select.POLLIN)
                while not poller.poll(_WATCH_TICK_MS):  # readable once the proxy exited (zombie or reaped)
                    pass
            finally:
                os.close(self.fd)
        else:
            while not gone_now(self.pid, self.start_time):
                time.sleep(_FALLBACK_POLL_S)
        if _EXITING.is_set():
            # This rank is leaving on its own (its interpreter exit began before the proxy was
            # seen gone, as at the clean end of an mpirun job, where rank 0 may exit first): that
            # is no reason for status 75. Only a rank still here after the grace is ended.
            time.sleep(_EXIT_GRACE_S)
        self._on_gone(self.pid)


# Set when this process's interpreter exit begins (a threading exit hook: it runs before the atexit
# handlers, and before mpi4py's MPI_Finalize, which is a Py_AtExit callback at the very end).
_EXITING = threading.Event()
_WATCHES: dict[tuple[int, int | None], ProxyDeathWatch] = {}
_WATCHES_LOCK = threading.Lock()


def _note_exit_hook() -> None:
    """Register the hook that marks this process's own exit, once (called under the lock)."""
    if _WATCHES:
        return
    try:
        threading._register_atexit(_EXITING.set)  # type: ignore[attr-defined]  # CPython 3.9+
    except RuntimeError:  # the interpreter is already shutting down
        _EXITING.set()


def start_proxy_death_watch(proxy: ProxyIdentity | Sequence[Any], *,
                            on_gone: Callable[[int], None] | None = None) -> ProxyDeathWatch | None:
    """Start the daemon thread that ends this rank when the proxy process ``proxy`` ends.

    ``proxy`` is the proxy's :class:`~._worker_spec.ProxyIdentity` (or :func:`proxy_identity`'s
    list), made in the proxy process. The proxy is watched
    through a pidfd opened here and verified against its start time after opening (so the watch
    can never follow a later process that reuses the pid; an identity without a start time, which
    upstream may send, is watched through the pidfd opened now, unverified); where this kernel or Python has no
    pidfd, through ``/proc/<pid>/stat`` (pid and start time) every 0.5 s, with one WARNING.

    Returns the watch, or None when nothing is watched: in the proxy process itself (rank 0 of
    ``MpiCommSession`` runs there), on another host or PID namespace (no pidfd can reach the proxy;
    INFO), when a watch on the same proxy already runs in this process (a rank that serves several
    tasks of one session), when the proxy's ``/proc`` entry cannot be read or no pidfd can be
    opened (WARNING), or when the proxy is already gone or its pid now belongs to another process:
    then ``on_gone`` runs at once (by default the rank ends: its proxy is gone). Raises
    ``ValueError`` for a malformed ``proxy``. Never blocks (two procfs reads and a ``pidfd_open``).
    """
    ref = proxy if isinstance(proxy, ProxyIdentity) else ProxyIdentity.from_sequence(proxy)
    pid, start_time, hostname, namespace, boot = ref.pid, ref.start_time, ref.hostname, ref.pid_namespace, ref.boot_id
    if pid == 1 and hostname == local_hostname() and namespace == local_pid_namespace():
        # A server that is PID 1 of this (container's) PID namespace: when it exits, the kernel
        # ends every process of the namespace, these ranks included. Nothing to watch.
        logger.info("liveness: the proxy is PID 1 of this PID namespace; its exit ends the ranks (no watch needed)")
        return None
    if pid <= 1:
        raise ValueError(f"bad proxy pid {pid!r}: PID 1 of another PID namespace or host")
    end = _end_rank if on_gone is None else on_gone
    if pid == os.getpid():
        return None  # rank 0 of MpiCommSession runs in the proxy process
    if (hostname != local_hostname() or namespace is None or namespace != local_pid_namespace()
            or (boot and boot_id() and boot != boot_id())):
        logger.info("liveness: the proxy (pid %d on %s) is on another host or PID namespace; no proxy-death watch",
                    pid, hostname)
        return None
    key = (pid, start_time)
    with _WATCHES_LOCK:
        if key in _WATCHES:
            return None
        fd: int | None = None
        if _pidfd.pidfd_supported():
            try:
                fd = _pidfd.open_verified_pidfd(pid, start_time)
            except ProcessGone:  # gone, a zombie, or its pid reused: this rank's proxy is gone
                gone = True
            except Exception as exc:  # AccessDenied, EMFILE...: cannot tell, so the rank keeps running
                logger.warning("liveness: cannot watch the proxy (pid %d): %s; this rank will not exit "
                               "when its proxy dies", pid, exc)
                return None
            else:
                gone = False
        else:
            gone = gone_now(pid, start_time)
            if not gone:
                logger.warning("liveness: no pidfd here: the proxy (pid %d) is watched by polling /proc every "
                               "%.1f s (pid and start time)", pid, _FALLBACK_POLL_S)
        if not gone:
            watch = ProxyDeathWatch(pid, start_time, fd, end)
            try:
                _note_exit_hook()
                watch.thread.start()
            except BaseException:
                if fd is not None:
                    os.close(fd)
                raise
            _WATCHES[key] = watch
            logger.debug("liveness: watching the proxy (pid %d) by %s", pid, watch.method)
            return watch
    end(pid)
    return None


def gone_now(pid: int, start_time: int | None) -> bool:
    """The procfs check: True if ``pid`` is gone, a zombie, or another process now (False while it
    cannot tell)."""
    try:
        _pidfd.verify_start_time(pid, start_time)
    except ProcessGone:
        return True
    except Exception:  # cannot tell this time (AccessDenied, EMFILE...): a watch keeps watching
        return False
    return False


def _end_rank(pid: int) -> None:
    """One line naming the dead proxy, then ``os._exit(PROXY_DIED_EXIT_STATUS)``.

    The line and the flushes run in a helper thread the rank waits for at most
    ``_LAST_WORDS_S``: a stream whose reader is gone or stopped must not keep the rank alive.
    """
    def last_words() -> None:
        try:
            logger.critical("liveness: the proxy process (pid %d) is gone; ending this rank (pid %d) with status %d",
                            pid, os.getpid(), PROXY_DIED_EXIT_STATUS)
            for stream in (sys.stderr, sys.stdout):
                with contextlib.suppress(Exception):  # a closed stream must not keep the rank alive
                    stream.flush()
        finally:
            said.set()

    said = threading.Event()
    with contextlib.suppress(Exception):
        threading.Thread(target=last_words, name="trtllm-liveness-last-words", daemon=True).start()
        said.wait(_LAST_WORDS_S)
    os._exit(PROXY_DIED_EXIT_STATUS)


def session_comm() -> Any:
    """The communicator of this rank's session: upstream's ``tensorrt_llm._utils.mpi_comm()``,
    else ``COMM_WORLD`` (only where ``tensorrt_llm`` is not loaded at all).

    ``_utils`` is imported here when ``tensorrt_llm`` is loaded (it is on a rank once
    ``worker_main`` was unpickled; upstream's package ``__init__`` imports ``_utils`` itself, but
    nothing here may rely on that): without it, a rank of a sub-communicator session would gather
    over ``COMM_WORLD``, a collective that the ranks outside the session never reach (seen as a
    start-up hang with the fakes, whose ``__init__`` does not import it)."""
    from ._features import find_symbol

    mpi_comm = find_symbol(["mpi_comm"], ["tensorrt_llm._utils"], import_missing="tensorrt_llm" in sys.modules)
    if callable(mpi_comm):
        try:
            comm = mpi_comm()
            if comm is not None:
                return comm
        except Exception:
            logger.debug("liveness: tensorrt_llm._utils.mpi_comm() failed; using COMM_WORLD", exc_info=True)
    from mpi4py import MPI

    return MPI.COMM_WORLD


def announce_identities(channel: IdentityChannelSpec) -> None:
    """Gather every rank's identity over the session's communicator (:func:`session_comm`); the leader sends them."""
    comm = session_comm()
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

    payload = json.dumps({"token": channel.token, "identities": [g for g in gathered if g is not None]})
    context: Any = zmq.Context.instance()
    sock = context.socket(zmq.PUSH)
    try:
        sock.setsockopt(zmq.LINGER, _SEND_TIMEOUT_MS)
        sock.setsockopt(zmq.SNDTIMEO, _SEND_TIMEOUT_MS)
        sock.connect(channel.address)
        sock.send(payload.encode())
    finally:
        sock.close()
