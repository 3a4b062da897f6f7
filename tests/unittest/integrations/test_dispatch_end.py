"""ForgottenResults and end_dispatch (``integrations/trtllm/_upstream_teardown.py``) against their
adversaries, in this process.

Upstream's pieces are the fakes' (built from upstream's files, tests/fakes/README.md): the result
queue is a ``ZeroMqQueue`` (PAIR, HMAC-signed pickles), the dispatch thread a ``ManagedThread``
running 1.2's ``dispatch_result_task``, which indexes ``_results[client_id]`` and pops a finished
request. A leader thread streams responses for every pending request the whole time; several
threads fail and forget every pending request at once at a random moment (the fatal path's sweep);
the leader then dies (its socket closes) while it still streams, and several threads end the
dispatch thread at once. Promises under test: no response meets a ``KeyError`` (nothing logged or
queued by ``ManagedThread``), the thread ends, every ``end_dispatch`` says so, and a table that has
not failed is upstream's dict (a missing id raises; a present id is the dict's own lookup).
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import types
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.upstream_fakes import FAKES_ROOT
from trtllm_liveness.integrations.trtllm import _upstream_teardown
from trtllm_liveness.integrations.trtllm._upstream_teardown import (
    FailedResults,
    ForgottenResults,
    end_dispatch,
    forget_late_responses,
    forget_results,
)

pytest.importorskip("zmq")

pytestmark = [pytest.mark.timeout(120)]

REQUESTS = 400
TOKENS = 2  # a final response every other message: finals meet the sweep
MAX_ROUNDS = 40  # a bound on the rounds run to see the race happen at least once


@pytest.fixture()
def fakes(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The fakes' shared module (``_trtllm_fake_common``): upstream's queue, thread and 1.2 proxy."""
    monkeypatch.syspath_prepend(str(FAKES_ROOT))
    import _trtllm_fake_common

    return _trtllm_fake_common


class Proxy:
    """What the two functions read of upstream's proxy, with 1.2's dispatch loop bound to it."""

    def __init__(self, fakes: Any, results: dict[int, Any]) -> None:
        self._results = results
        self.result_queue = fakes.ZeroMqQueueBase(is_server=True, name="proxy_result_queue")
        self.errors: queue.Queue[BaseException] = queue.Queue()
        self.dispatch_result_thread = fakes.ManagedThread(
            lambda: fakes.ProxyCore.dispatch_result_task(self), error_queue=self.errors,
            name="proxy_dispatch_result_thread")


def _result() -> Any:
    return types.SimpleNamespace(queue=queue.SimpleQueue())


@pytest.fixture()
def upstream_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    caplog.set_level(logging.INFO, logger="tensorrt_llm")
    yield caplog


class CountingDrop:
    """Stands for the dropping result: counts the responses that found a forgotten request."""

    def __init__(self) -> None:
        self.dropped = 0
        self.queue = self

    def put(self, _item: object) -> None:
        self.dropped += 1

    def abort(self) -> None:
        pass


def _race_once(fakes: Any, log: pytest.LogCaptureFixture, sweepers: int, enders: int) -> None:
    proxy = Proxy(fakes, {client_id: _result() for client_id in range(REQUESTS)})
    forget_results(proxy)
    table = proxy._results
    assert isinstance(table, ForgottenResults)
    leader = fakes.ZeroMqQueueBase(proxy.result_queue.address, is_server=False, name="worker_result_queue")
    die = threading.Event()
    swept = threading.Event()

    def stream() -> None:  # the leader: each request's tokens, its final last, until it dies
        for client_id in range(REQUESTS):
            for token in range(1, TOKENS + 1):
                if die.is_set():
                    break
                leader.put(fakes.Response(client_id, token, token == TOKENS))
        die.wait(30)
        leader.socket.close(linger=0)  # its death: the connection goes with the process
        leader.context.term()

    barrier = threading.Barrier(sweepers + 1, timeout=30)

    def sweep() -> None:  # the fatal path's: late responses dropped first, then every pending request forgotten
        barrier.wait()
        threading.Event().wait(random.uniform(0, 0.005))
        forget_late_responses(table)
        for client_id in list(table):
            table.pop(client_id, None)
        swept.set()

    ended: list[bool] = []
    start_ending = threading.Barrier(enders + 1, timeout=30)

    def end() -> None:
        start_ending.wait()
        ended.append(end_dispatch(proxy))

    threads = [threading.Thread(target=sweep, name=f"sweeper-{i}") for i in range(sweepers)]
    threads += [threading.Thread(target=end, name=f"ender-{i}") for i in range(enders)]
    leader_thread = threading.Thread(target=stream, name="leader")
    proxy.dispatch_result_thread.start()
    leader_thread.start()
    for thread in threads:
        thread.start()
    threading.Event().wait(random.uniform(0.002, 0.02))  # responses flow, sometimes pile up
    barrier.wait()
    assert swept.wait(30)
    threading.Event().wait(random.uniform(0, 0.01))  # late responses for forgotten requests arrive
    die.set()
    leader_thread.join(30)
    start_ending.wait()
    for thread in threads:
        thread.join(30)
    try:
        assert not leader_thread.is_alive() and not any(thread.is_alive() for thread in threads)
        assert not proxy.dispatch_result_thread.is_alive()
        assert ended == [True] * enders
        assert isinstance(table, FailedResults) and len(table) == 0  # nothing forgotten counts as pending
        assert proxy.errors.empty(), proxy.errors.get_nowait()
        assert [r.getMessage() for r in log.records if r.levelno >= logging.WARNING] == []
    finally:
        proxy.result_queue.close()


@pytest.mark.parametrize(("sweepers", "enders"), [(1, 1), (3, 4)])
def test_late_responses_for_forgotten_requests_meet_no_key_error_and_the_thread_ends(
        fakes: Any, upstream_log: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, sweepers: int,
        enders: int) -> None:
    drop = CountingDrop()
    monkeypatch.setattr(_upstream_teardown, "_DROPPED", drop)
    rounds = 0
    # At least 5 rounds, and on until responses did meet forgotten requests (a loaded machine can
    # sweep before any arrive): the race was run, not missed.
    while rounds < 5 or (drop.dropped == 0 and rounds < MAX_ROUNDS):
        upstream_log.clear()
        _race_once(fakes, upstream_log, sweepers, enders)
        rounds += 1
    assert drop.dropped > 0, f"no late response met a forgotten request in {rounds} rounds"


def test_before_a_failure_the_table_is_upstreams_dict(fakes: Any) -> None:
    proxy = Proxy(fakes, {1: "one"})
    try:
        forget_results(proxy)
        table = proxy._results
        assert isinstance(table, ForgottenResults) and dict(table) == {1: "one"}
        assert type(table).__getitem__ is dict.__getitem__  # a present id: no code of the extension
        with pytest.raises(KeyError):
            table[2]  # 1.2's lookup of an unknown id raises as upstream's does until the engine fails
        assert 2 not in table
        forget_results(proxy)
        assert proxy._results is table  # a table already in place is kept
        forget_late_responses(table)
        assert isinstance(table, FailedResults) and table[2] is not None and 2 not in table  # dropped, not stored
        assert table.pop(1) == "one" and table.pop(1) is None  # a pop of a request gone meanwhile
    finally:
        proxy.result_queue.close()


def test_a_pull_result_queue_takes_the_marker_while_its_peers_live(fakes: Any) -> None:
    """With postprocess workers upstream's result queue is a PULL socket: any number of peers, so the
    marker (from a PUSH client) ends the thread while the senders are still connected."""
    import zmq

    proxy = Proxy(fakes, {})
    proxy.result_queue.close()
    proxy.result_queue = fakes.ZeroMqQueueBase(is_server=True, socket_type=zmq.PULL, name="proxy_result_queue")
    sender = fakes.ZeroMqQueueBase(proxy.result_queue.address, is_server=False, socket_type=zmq.PUSH,
                                   name="postprocess_worker")
    try:
        proxy.dispatch_result_thread.start()
        assert end_dispatch(proxy) is True
        assert not proxy.dispatch_result_thread.is_alive()
    finally:
        sender.socket.close(linger=0)
        sender.context.term()
        proxy.result_queue.close()


def test_a_leader_that_keeps_its_connection_leaves_the_thread_and_its_socket_open(fakes: Any) -> None:
    """A rank that cannot be ended keeps the PAIR socket's one connection: the marker is not taken,
    ``end_dispatch`` gives up after its bound, and upstream's close of the socket (under the thread's
    receive) does nothing. Once that connection goes, the marker ends the thread."""
    proxy = Proxy(fakes, {})
    leader = fakes.ZeroMqQueueBase(proxy.result_queue.address, is_server=False, name="worker_result_queue")
    socket = proxy.result_queue.socket
    try:
        forget_results(proxy)
        proxy._results[7] = _result()
        proxy.dispatch_result_thread.start()
        leader.put(fakes.Response(7, 1, False))
        while proxy._results[7].queue.empty():  # dispatched: the leader holds the socket's one pipe
            threading.Event().wait(0.001)
        forget_late_responses(proxy._results)
        assert end_dispatch(proxy) is False
        assert proxy.dispatch_result_thread.is_alive()
        proxy.result_queue.close()  # upstream's, after its join gave up
        assert proxy.result_queue.socket is socket and not socket.closed
    finally:
        leader.socket.close(linger=0)
        leader.context.term()
    assert end_dispatch(proxy) is True
    assert not proxy.dispatch_result_thread.is_alive()
    type(proxy.result_queue).close(proxy.result_queue)
