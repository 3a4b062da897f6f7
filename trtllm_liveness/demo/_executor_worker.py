"""worker_main: what every MPI rank of the reference executor runs (upstream's ``worker_main``).

Every rank: barrier; the leader (rank 0) opens the DEALER status queue; on ``main`` all ranks
allgather their identities and the leader sends them early; the "model build" (a sleep); a
barrier; the leader sends the ready status, then serves requests until a ``None`` arrives, while
the other ranks wait as subordinates and acknowledge each generation step (standing in for the
tensor-parallel collective a real step is), so a dead subordinate stalls the leader as it would
stall NCCL.

Departures from upstream: the fake generation echoes the prompt one token per step with a fixed
delay; MPI waits are non-blocking requests polled with short sleeps (Open MPI's blocking
collectives spin, which a 2-core test machine cannot afford); ``announce_dir`` (tests and the
demo only) makes every rank write its identity to a file, so a harness can inject faults even in
1.2 mode, whose protocol carries no identities.

Fault injection (the fault matrix and tests only): ``fault={"kind", "rank", "trigger", "record",
"cgroup"}`` makes rank ``rank`` watch for the file ``trigger`` from a helper thread; once it
exists the rank writes ``time.monotonic()`` (system-wide, so the harness can time detection from
it) to ``record`` and then ``exit0`` calls ``os._exit(0)`` mid-request (a clean but unexpected
exit) or ``oom`` allocates until the kernel OOM killer ends it (after the rank moved itself into
the memory cgroup ``cgroup`` at start, before its identity is taken). Without ``fault`` nothing
of this runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from typing import Any

from ..process._identity import ProcessIdentity, capture_identity
from ._executor_protocol import ACK, READY_SIGNAL, WORKER_PROCESS_IDENTITIES_SIGNAL, TokenResponse

_TAG_CMD = 11
_TAG_ACK = 12
_POLL_S = 0.001


def _wait_request(request: Any) -> Any:
    """Poll an MPI request to completion; returns its message (or None for a barrier)."""
    while True:
        done, message = request.test()
        if done:
            return message
        time.sleep(_POLL_S)


def worker_main(
    *,
    worker_queues: dict[str, str],
    mode: str = "1.2",
    token_delay_s: float = 0.02,
    init_delay_s: float = 0.0,
    announce_dir: str | None = None,
    fault: dict[str, Any] | None = None,
    **_unused: Any,
) -> None:
    """Run one rank until the proxy sends ``None``. Blocks for the life of the engine."""
    import zmq
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    if fault is not None and fault.get("rank") == rank:
        _arm_fault(fault)
    comm.barrier()
    context: Any = zmq.Context.instance()
    status: Any = None
    if rank == 0:
        status = context.socket(zmq.DEALER)
        status.setsockopt(zmq.LINGER, 1000)
        status.connect(worker_queues["status"])
    identity = capture_identity(rank)
    if announce_dir is not None:
        path = _announce_path(announce_dir, rank)
        with open(path + ".tmp", "w") as handle:
            json.dump(list(identity), handle)
        os.replace(path + ".tmp", path)  # atomic: a reader never sees half a file
    identities = None
    if mode == "main":
        identities = [tuple(item) for item in comm.allgather(tuple(identity))]
        if status is not None:
            # Early, before the model is built, so a death during initialization is caught.
            status.send_pyobj((WORKER_PROCESS_IDENTITIES_SIGNAL, None, identities))
    if init_delay_s > 0:
        time.sleep(init_delay_s)  # stands in for building the model
    _wait_request(comm.Ibarrier())
    if status is None:
        _subordinate_loop(comm)
        return
    status.send_pyobj((READY_SIGNAL, None) if mode != "main" else (READY_SIGNAL, None, identities))
    if status.poll(30_000):
        reply = status.recv_pyobj()
        if reply != ACK:
            raise RuntimeError(f"expected ACK from the proxy, got {reply!r}")
    status.close()
    try:
        _leader_loop(comm, context, worker_queues, token_delay_s)
    finally:
        for peer in range(1, comm.Get_size()):
            with contextlib.suppress(Exception):
                comm.isend(("stop",), dest=peer, tag=_TAG_CMD)


def _arm_fault(fault: dict[str, Any]) -> None:
    kind = fault.get("kind")
    if kind not in ("exit0", "oom", "fuse"):
        raise ValueError(f"unknown fault kind {kind!r}")
    cgroup = fault.get("cgroup")
    if cgroup:
        # Before the identity is captured and registered, so the monitor's OOM probe reads
        # this group's counter.
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as handle:
            handle.write(str(os.getpid()))
    threading.Thread(target=_fault_thread, args=(kind, fault["trigger"], fault["record"], fault.get("path")),
                     name="reference-fault-injection", daemon=True).start()


def _fault_thread(kind: str, trigger: str, record: str, path: str | None) -> None:
    while not os.path.exists(trigger):
        time.sleep(0.002)
    with open(record + ".tmp", "w") as handle:
        json.dump({"pid": os.getpid(), "tid": threading.get_native_id(), "at": time.monotonic()}, handle)
    os.replace(record + ".tmp", record)
    if kind == "exit0":
        os._exit(0)
    if kind == "fuse":
        # This thread alone enters the kernel and never comes back (a FUSE lookup nobody answers,
        # like a driver call that hangs); the main thread keeps serving.
        with contextlib.suppress(OSError):  # ENOTCONN once the stall is released
            os.stat(path or "")
        return
    hog = []
    while True:  # ends when the OOM killer SIGKILLs this process
        block = bytearray(8 << 20)
        block[::4096] = b"x" * len(block[::4096])  # touch every page so it is charged
        hog.append(block)


def _subordinate_loop(comm: Any) -> None:
    while True:
        command = _wait_request(comm.irecv(source=0, tag=_TAG_CMD))
        if command[0] == "stop":
            return
        comm.send(command[1], dest=0, tag=_TAG_ACK)


def _leader_loop(comm: Any, context: Any, worker_queues: dict[str, str], token_delay_s: float) -> None:
    import zmq

    requests = context.socket(zmq.PULL)
    results = context.socket(zmq.PUSH)
    for sock in (requests, results):
        sock.setsockopt(zmq.LINGER, 1000)
    requests.connect(worker_queues["request"])
    results.connect(worker_queues["result"])
    active: dict[int, list[int]] = {}
    step = 0
    try:
        while True:
            timeout_ms = 0 if active else 50
            stop = False
            while requests.poll(timeout_ms):
                request = requests.recv_pyobj()
                if request is None:
                    stop = True
                    break
                active[request.id] = list(request.prompt_token_ids)
                timeout_ms = 0
            if stop:
                return
            if not active:
                continue
            step += 1
            # Every rank takes part in a step, as in tensor parallelism.
            for peer in range(1, comm.Get_size()):
                comm.send(("step", step), dest=peer, tag=_TAG_CMD)
            for peer in range(1, comm.Get_size()):
                _wait_request(comm.irecv(source=peer, tag=_TAG_ACK))
            time.sleep(token_delay_s)
            for client_id in list(active):
                remaining = active[client_id]
                token = remaining.pop(0)
                final = not remaining
                results.send_pyobj(TokenResponse(client_id, token, final))
                if final:
                    del active[client_id]
    finally:
        with contextlib.suppress(Exception):
            results.send_pyobj(None)
        requests.close()
        results.close()


def _announce_path(directory: str, rank: int) -> str:
    return os.path.join(directory, f"rank{rank}.json")


def read_announced_identities(directory: str, count: int, timeout: float) -> list[ProcessIdentity]:
    """The identities ranks ``0..count-1`` wrote to ``announce_dir`` (test and demo harness only).

    Polls every 5 ms up to ``timeout`` seconds; raises ``TimeoutError`` if some rank has not
    announced itself by then.
    """
    deadline = time.monotonic() + timeout
    while True:
        found = []
        for rank in range(count):
            try:
                with open(_announce_path(directory, rank)) as handle:
                    found.append(ProcessIdentity(*json.load(handle)))
            except (OSError, ValueError):
                break
        if len(found) == count:
            return found
        if time.monotonic() >= deadline:
            raise TimeoutError(f"workers did not announce themselves within {timeout}s")
        time.sleep(0.005)
