"""DispatchGate (``integrations/trtllm/_upstream_teardown.py``) against its adversaries, in this process.

Real ZMQ PAIR sockets over ``inproc``: a sender thread streams messages the whole time (as a leader
that keeps streaming), one thread is upstream's dispatch thread (``dispatch()`` in a loop, each call
receiving one message as upstream's receive does), and several threads close the gate at once at
a random moment. Promises under test: the dispatch thread leaves (its call returns False), nothing
is dispatched once any ``close()`` has returned (the fatal path fails and forgets the pending
requests right after it), ``close()`` is idempotent from any thread, and the gate's wakeup pipe is
released once.
"""

from __future__ import annotations

import os
import random
import threading
from typing import Any

import pytest

from trtllm_liveness.integrations.trtllm._upstream_teardown import DispatchGate, result_socket

zmq = pytest.importorskip("zmq")

pytestmark = [pytest.mark.timeout(120)]


class ResultQueue:
    """What the gate reads of upstream's result queue: the ZMQ socket it holds (``ZeroMqQueue.socket``)."""

    def __init__(self, socket: Any) -> None:
        self.socket = socket


class Wrapping:
    """1.2's ``FusedIpcQueue``: the ``ZeroMqQueue`` it wraps is ``.queue``."""

    def __init__(self, inner: ResultQueue) -> None:
        self.queue = inner


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _race_once(round_no: int, closers: int) -> None:
    context = zmq.Context()
    server = context.socket(zmq.PAIR)
    client = context.socket(zmq.PAIR)
    for socket in (server, client):
        socket.setsockopt(zmq.LINGER, 0)
    server.bind(f"inproc://dispatch-gate-{round_no}")
    client.connect(f"inproc://dispatch-gate-{round_no}")
    queue = ResultQueue(server) if round_no % 2 else Wrapping(ResultQueue(server))
    before = _open_fds()
    gate = DispatchGate()
    lock = threading.Lock()
    dispatched: list[int] = []
    after_first_close: list[int] = []  # len(dispatched) when the first close() returned
    stop_sending = threading.Event()
    returns: list[Any] = []

    def upstream() -> bool:
        item = server.recv_pyobj(zmq.NOBLOCK)  # the gate calls upstream only once a message is there
        threading.Event().wait(0.0005)  # upstream's handling of the batch (results, notifications)
        with lock:
            dispatched.append(item)
        return True

    def dispatcher() -> None:
        while (more := gate.dispatch(queue, upstream)):
            pass
        returns.append(more)

    def sender() -> None:
        sent = 0
        while not stop_sending.is_set():
            client.send_pyobj(sent)
            sent += 1
            if sent % 16 == 0:
                threading.Event().wait(0.0005)

    barrier = threading.Barrier(closers + 1, timeout=30)

    def closer() -> None:
        barrier.wait()
        threading.Event().wait(random.uniform(0, 0.02))
        gate.close()
        with lock:
            if not after_first_close:
                after_first_close.append(len(dispatched))

    threads = [threading.Thread(target=dispatcher, name="proxy_dispatch_result_thread"),
               threading.Thread(target=sender, name="leader")]
    threads += [threading.Thread(target=closer, name=f"closer-{i}") for i in range(closers)]
    for thread in threads:
        thread.start()
    threading.Event().wait(random.uniform(0.005, 0.03))  # let responses flow, sometimes pile up
    barrier.wait()
    for thread in threads[2:]:
        thread.join(30)
    stop_sending.set()
    for thread in threads:
        thread.join(30)
    try:
        assert not any(thread.is_alive() for thread in threads), [t.name for t in threads if t.is_alive()]
        assert returns == [False]  # upstream's thread leaves: its task returned False
        assert after_first_close and dispatched, (after_first_close, len(dispatched))
        assert len(dispatched) == after_first_close[0], "a message was dispatched after close() returned"
        assert dispatched == list(range(len(dispatched)))  # in order, none lost before the close
        assert gate.dispatch(queue, upstream) is False  # closed for good
        assert _open_fds() == before  # the wakeup pipe was released (once: a double close would raise here)
    finally:
        server.close(0)
        client.close(0)
        context.term()


@pytest.mark.parametrize("closers", [1, 4])
def test_close_races_the_dispatch_thread_and_nothing_is_dispatched_after_it(closers: int) -> None:
    for round_no in range(30):
        _race_once(round_no, closers)


def test_a_gate_closed_before_the_first_dispatch_makes_no_pipe() -> None:
    before = _open_fds()
    gate = DispatchGate()
    gate.close()
    gate.close()
    called: list[int] = []
    context = zmq.Context()
    server = context.socket(zmq.PAIR)
    try:
        assert gate.dispatch(ResultQueue(server), lambda: called.append(1)) is False
    finally:
        server.close(0)
        context.term()
    assert called == [] and gate.closed and _open_fds() == before


def test_a_queue_without_a_zmq_socket_gets_upstreams_own_receive_until_closed() -> None:
    gate = DispatchGate()
    calls: list[str] = []
    assert result_socket(object()) is None
    assert gate.dispatch(object(), lambda: calls.append("upstream") or True) is True
    gate.close()
    assert gate.dispatch(object(), lambda: calls.append("upstream") or True) is False
    assert calls == ["upstream"]


def test_an_idle_gate_wakes_for_each_message_without_its_tick(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wait is on the socket's edge-triggered ZMQ_FD: each message sent to an idle gate (one
    already waiting) must wake it by itself. The tick is made longer than the test's bound, so a
    missed wakeup leaves the dispatcher waiting and fails the join below."""
    from trtllm_liveness.integrations.trtllm import _upstream_teardown

    monkeypatch.setattr(_upstream_teardown, "_WAIT_TICK_MS", 3_600_000)
    context = zmq.Context()
    server = context.socket(zmq.PAIR)
    client = context.socket(zmq.PAIR)
    for socket in (server, client):
        socket.setsockopt(zmq.LINGER, 0)
    server.bind("inproc://dispatch-gate-idle")
    client.connect("inproc://dispatch-gate-idle")
    gate = DispatchGate()
    received: list[int] = []
    dispatched = threading.Semaphore(0)

    def upstream() -> bool:
        received.append(server.recv_pyobj(zmq.NOBLOCK))
        dispatched.release()
        return True

    def dispatcher() -> None:
        while gate.dispatch(ResultQueue(server), upstream):
            pass

    thread = threading.Thread(target=dispatcher, name="proxy_dispatch_result_thread")
    thread.start()
    try:
        for sent in range(20):
            threading.Event().wait(0.01)  # the dispatcher is back in its wait: idle
            client.send_pyobj(sent)
            assert dispatched.acquire(timeout=30), f"message {sent} did not wake the idle gate"
        assert received == list(range(20))
    finally:
        gate.close()
        thread.join(30)
        server.close(0)
        client.close(0)
        context.term()
    assert not thread.is_alive()
