"""Child program for the proxy-death tests: an upstream-shaped engine whose proxy the test SIGKILLs.

Usage: ``python -m tests.programs.proxy_death_child '<json options>'`` (``session: "pool"``), or
``mpirun -n N python -m tests.programs.proxy_death_child '<json options>'`` (``session: "comm"``).
Options: ``tree`` (``"trtllm_main"`` or ``"trtllm_v12"``: which fake ``tensorrt_llm`` under
tests/fakes is put first on ``sys.path``), ``liveness`` (bool: ``LLM(executor_cls=
liveness_executor_class())`` or upstream's own executor), ``workers`` (pool: the tensor parallel
size), ``outsider`` (comm: the last rank of ``COMM_WORLD`` stays out of the session, which then
runs on a sub-communicator of the others, as with ``MpiCommSession(comm=sub_comm)``),
``clean_end`` (comm: one short request, then ``llm.shutdown()`` and the session's, and every rank
ends normally; prints ``{"done": true, ...}`` instead of waiting to be killed), ``watch_fatal``
(comm; multi-host tests, tests/support/multihost_engine.py: the ready line also has ``hosts``,
the monitor's per-rank view; then the proxy waits for the engine's fatal error and prints it, see
:func:`report_fatal`), ``no_request`` (no request is started: idle figures), ``step_acks`` (the
fake engine's: every step waits for every rank's acknowledgement, so one stopped rank stalls the
engine), ``snapshots`` (with ``watch_fatal``: after the ready line, that many whole-engine
snapshots as the fatal verdict takes them, each printed as ``{"snapshot": {"ms": ..., "ranks":
[[rank, host, activity, stack status, stack source, why not the other], ...], "hosts": [...],
"iterations": {rank: count}}}``, the executor iterations the stall timer has of each rank),
``iterations_wait_s`` (before those snapshots, wait at most that long until every rank's
iterations reached the stall timer), ``snapshot_full`` (those snapshots with the diagnosis' full
bounds, not the fatal verdict's tight ones: a test of their content on a loaded machine),
``progress_s`` (with ``watch_fatal``: while no fatal error is set, one ``{"progress": {"t": monotonic,
"iterations": rank 0's executor iterations, "hosts": the per-rank view}}`` line every that many
seconds: the engine's progress through a fault that must not stop it), ``loader`` (comm; ``{"rank":
R, "socket": PATH}``: world rank ``R`` runs a loader thread that reads the files handed to it over
the unix socket ``PATH``, as a rank's weight loader reads while it serves:
:mod:`tests.support.rank_loader`).

- ``pool``: this process is the proxy. ``LLM`` spawns its ranks through a real
  ``MPIPoolExecutor`` (``MpiPoolSession``); they are grandchildren (this process -> prte -> ranks).
- ``comm``: the ``mpirun`` shape. Rank 0 of the session is the proxy (``LLM(...,
  _mpi_session=MpiCommSession(comm, n))``; its own rank's task runs in its thread pool); the other
  session ranks serve tasks (``serve_comm_workers``), as upstream's worker-node entry does. Every
  rank but 0 writes its stderr to ``$TMPDIR/rank-<world rank>.log``.

Once the engine is up, the proxy starts one long request (so the ranks are in the engine's step
loop, as a server's would be) and prints one JSON line ``{"ready": true, "proxy": [pid,
start_time], "ranks": [[rank, pid, start_time], ...]}`` (every rank but those inside the proxy
process), then waits (bounded) to be killed. Every wait is bounded; the parent bounds the whole
process with its own timeout and kills its session.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
LINGER_S = 300.0  # how long the proxy waits to be killed before it gives up (the test kills it long before)


def emit(record: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def start_time_of(pid: int) -> int:
    from trtllm_liveness.process import _procfs

    return _procfs.read_start_time(pid)


def descendants(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from /proc/<pid>/task/*/children, recursively)."""
    found: list[int] = []
    pending = [pid]
    while pending:
        parent = pending.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as handle:
                    children = [int(child) for child in handle.read().split()]
            except OSError:
                continue
            found.extend(children)
            pending.extend(children)
    return found


def spawned_ranks(timeout: float = 30.0) -> list[int]:
    """The pids of this process's ``MPIPoolExecutor`` workers (``-m mpi4py.futures.server``)."""
    deadline = time.monotonic() + timeout
    while True:
        ranks = []
        for pid in descendants(os.getpid()):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as handle:
                    argv = handle.read().split(b"\0")
            except OSError:
                continue
            if b"mpi4py.futures.server" in argv:
                ranks.append(pid)
        if ranks or time.monotonic() >= deadline:
            return sorted(ranks)
        time.sleep(0.05)


def build_llm(options: dict[str, Any], world: int, session: Any = None) -> Any:
    import importlib

    from tensorrt_llm import LLM  # type: ignore[import-not-found]  # the fake tree put on sys.path

    fake = importlib.import_module("_trtllm_fake_common")
    kwargs: dict[str, Any] = {"tensor_parallel_size": world}
    if session is not None:
        kwargs["_mpi_session"] = session
    if options.get("liveness"):
        from trtllm_liveness.integrations.trtllm import liveness_executor_class

        kwargs["executor_cls"] = liveness_executor_class()
    return LLM(fake.FakeEngine(token_delay_s=0.05, step_acks=bool(options.get("step_acks"))), **kwargs)


def children_named(name: str) -> list[list[int]]:
    """``[pid, start_time]`` of this process's direct children whose comm is ``name``."""
    found = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as handle:
            children = [int(child) for child in handle.read().split()]
        for pid in children:
            try:
                with open(f"/proc/{pid}/comm") as handle:
                    if handle.read().strip() == name:
                        found.append([pid, start_time_of(pid)])
            except OSError:
                continue
    return found


def serve_until_killed(llm: Any, ranks: list[list[int]], *, watch_fatal: bool = False, comm: Any = None,
                       no_request: bool = False, **extra: Any) -> int:
    pending = None if no_request else llm.generate_async([1, 2, 3], max_tokens=10**9)  # ranks in the step loop
    deadline = time.monotonic() + 20
    while watch_fatal and time.monotonic() < deadline and (
            any(state[3] == "none" for state in hosts_of(llm).values())
            or len(hosts_of(llm)) < comm.Get_size() - 1):
        time.sleep(0.01)  # every remote host's agent said hello (they do within milliseconds of the start)
    emit({"ready": True, "proxy": [os.getpid(), start_time_of(os.getpid())], "ranks": ranks, **extra,
          **({"hosts": hosts_of(llm)} if watch_fatal else {})})
    wait_s = float(extra.pop("iterations_wait_s", 0) or 0)
    stall = llm._executor.liveness_state.stall if wait_s else None
    until = time.monotonic() + wait_s
    while stall is not None and time.monotonic() < until and len(stall.iterations()) < comm.Get_size():
        time.sleep(0.05)
    full = bool(extra.pop("snapshot_full", False))
    for _ in range(int(extra.pop("snapshots", 0) or 0)):
        emit({"snapshot": whole_engine_snapshot(llm, full=full)})
    if watch_fatal:
        return report_fatal(llm, pending, extra.pop("progress_s", None))
    time.sleep(LINGER_S)
    return 1  # never killed: the parent's deadline has long passed


def snapshot_rows(diagnosis: Any) -> list[list[Any]]:
    """``[rank, host, activity, stack status, stack source, why not the other]`` of each rank."""
    return [[r.rank, r.host, r.activity.value, r.stacks.status.value if r.stacks else None,
             r.stacks.source.value if r.stacks and r.stacks.source else None, r.stacks.other_source if r.stacks else ""]
            for r in diagnosis.ranks]


def whole_engine_snapshot(llm: Any, *, full: bool = False) -> dict[str, Any]:
    """The fatal verdict's snapshot of every rank (local and remote), taken now, and its time
    (``full``: the diagnosis' full bounds instead)."""
    diagnoser = llm._executor.liveness_state.diagnoser
    t0 = time.monotonic()
    diagnosis = diagnoser.take(snapshot=not full)
    ms = (time.monotonic() - t0) * 1000
    stall = llm._executor.liveness_state.stall
    iterations = {} if stall is None else {rank: last.count for rank, last in stall.iterations().items()}
    return {"ms": ms, "ranks": snapshot_rows(diagnosis), "hosts": list(diagnosis.hosts), "iterations": iterations}


def hosts_of(llm: Any) -> dict[str, Any]:
    """Rank -> [state, hostname, pid, method] as the engine's monitor sees them now."""
    return {str(s.identity.rank): [s.state.value, s.identity.hostname, s.identity.pid, s.method]
            for s in llm._executor.liveness_statuses()}


def progress_of(llm: Any) -> dict[str, Any]:
    """Rank 0's executor iterations as the engine's stall clock has them (with ``step_acks`` each
    needed every rank), the time, and the per-rank view: the ``progress_s`` records."""
    stall = llm._executor.liveness_state.stall
    iterations = {} if stall is None else stall.iterations()
    zero = iterations.get(0)
    return {"t": time.monotonic(), "iterations": 0 if zero is None else zero.count, "hosts": hosts_of(llm)}


def report_fatal(llm: Any, pending: Any, progress_s: float | None = None) -> int:
    """Multi-host tests: wait (bounded) for the engine's fatal error and print it with the time it
    was recorded, whether the pending request failed, the per-rank view; then a bounded shutdown
    and what it reported of every host (with the fatal ERROR line's text, ``fatal_line``, and the fatal
    verdict's snapshot taken before the stop, ``fatal_snapshot``: ``FatalSnapshot.to_dict()``).
    Prints ``{"fatal": null}`` if none came."""
    executor = llm._executor
    deadline = time.monotonic() + LINGER_S
    every = float(progress_s or 0)
    next_report = time.monotonic()
    while executor.liveness_fatal_error is None and time.monotonic() < deadline:
        if every > 0 and time.monotonic() >= next_report:
            next_report = time.monotonic() + every
            emit({"progress": progress_of(llm)})
        time.sleep(0.002)
    error = executor.liveness_fatal_error
    if error is None:
        emit({"fatal": None})
        return 1
    event = error.event
    try:
        if pending is not None:
            pending.result(timeout=10)
        failed = False
    except Exception:
        failed = True
    emit({"fatal": str(error), "detected_at": event.detected_at, "kind": event.kind.value,
          "rank": event.identity.rank, "host": event.identity.hostname, "pid": event.identity.pid,
          "pending_failed": failed, "health": executor.check_health(), "statuses": hosts_of(llm)})
    t0 = time.monotonic()
    llm.shutdown()
    state = executor.liveness_state  # the public reading docs/multihost.md names (host_stops)
    latest = state.diagnoser.latest if state.diagnoser is not None else None
    # The extension's live threads (tests/support/ref_engine.py's prefixes: this program imports no tests module).
    extension = [thread.name for thread in threading.enumerate()
                 if thread.name.startswith(("trtllm-liveness", "liveness-"))]
    emit({"shutdown_s": time.monotonic() - t0, "extension_threads": extension,
          "host_stops": [stop.to_dict() for stop in state.host_stops],
          "snapshot": None if latest is None else {"ranks": snapshot_rows(latest), "hosts": list(latest.hosts),
                                                   "named": None if latest.named is None else latest.named.to_dict()},
          "fatal_line": state.fatal_path.line,
          "fatal_snapshot": None if state.fatal_path.snapshot is None else state.fatal_path.snapshot.to_dict()})
    time.sleep(LINGER_S)
    return 1


def run_pool(options: dict[str, Any]) -> int:
    workers = int(options.get("workers", 2))
    llm = build_llm(options, workers)
    pids = spawned_ranks()
    return serve_until_killed(llm, [[-1, pid, start_time_of(pid)] for pid in pids], prte=children_named("prte"))


def run_comm(options: dict[str, Any]) -> int:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if world.Get_rank() != 0:
        # Straight to a file (TMPDIR/rank-<n>.log), not through mpirun's forwarding, which may
        # drop what a process wrote just before it ended.
        log = os.open(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"rank-{world.Get_rank()}.log"),
                      os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(log, 2)
        os.close(log)
    loader = options.get("loader")
    if loader and world.Get_rank() == int(loader["rank"]):
        from tests.support.rank_loader import serve_loader

        serve_loader(str(loader["socket"]))
    me = [world.Get_rank(), os.getpid(), start_time_of(os.getpid())]
    everyone = world.allgather(me)  # a COMM_WORLD collective every rank of this program reaches
    comm = world
    if options.get("clean_end"):
        comm = world.Split(0, world.Get_rank())  # every rank; a session that owns its pool (not COMM_WORLD's)
    elif options.get("outsider"):
        # The last rank stays out: the session runs on a sub-communicator of the others.
        outsider = world.Get_rank() == world.Get_size() - 1
        comm = world.Split(1 if outsider else 0, world.Get_rank())
        if outsider:
            time.sleep(LINGER_S)  # never reaches any collective of the session
            return 1
    # The executor package first: the fake's llmapi.mpi_session imported on its own is a circular import.
    import tensorrt_llm.executor  # type: ignore[import-not-found]  # noqa: F401

    if comm.Get_rank() != 0:
        from tensorrt_llm.llmapi.mpi_session import serve_comm_workers  # type: ignore[import-not-found]

        serve_comm_workers(comm)
        return 0
    from tensorrt_llm.llmapi.mpi_session import MpiCommSession

    session = MpiCommSession(comm, n_workers=comm.Get_size())
    llm = build_llm(options, comm.Get_size(), session)
    ranks = [entry for entry in everyone if entry[0] != world.Get_rank()]  # not by pid: hosts reuse numbers
    if options.get("clean_end"):
        # A job that ends well: one request, shutdown, the session's pool closed (the servers
        # return), and every rank leaves through a normal interpreter exit.
        tokens = len(llm.generate_async([1, 2, 3], max_tokens=4).result(timeout=60).token_ids)
        state = getattr(llm._executor, "liveness_state", None)
        monitor = None if state is None else state.monitor
        watched = [] if monitor is None else sorted(status.identity.rank for status in monitor.statuses())
        llm.shutdown()
        session.shutdown()
        emit({"done": True, "tokens": tokens, "proxy": [os.getpid(), start_time_of(os.getpid())], "ranks": ranks,
              "watched": watched})
        return 0
    return serve_until_killed(llm, ranks, watch_fatal=bool(options.get("watch_fatal")), comm=comm,
                              no_request=bool(options.get("no_request")), snapshots=options.get("snapshots", 0),
                              iterations_wait_s=options.get("iterations_wait_s", 0),
                              snapshot_full=options.get("snapshot_full", False),
                              progress_s=options.get("progress_s", 0))


def main(options: dict[str, Any]) -> int:
    tree = str(options.get("tree", "trtllm_main"))
    sys.path.insert(0, str(REPO_ROOT / "tests" / "fakes" / tree))
    from trtllm_liveness.demo._mpi_env import configure_mpi_env

    configure_mpi_env()
    if options.get("session") == "comm":
        return run_comm(options)
    return run_pool(options)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s")
    sys.exit(main(json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}))
