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
from trtllm_liveness.integrations.trtllm._upstream_teardown import (
    ForgottenResults,
    end_dispatch,
    forget_results,
)

pytest.importorskip("zmq")

pytestmark = [pytest.mark.timeout(120)]

REQUESTS = 64
TOKENS = 40


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


def _race_once(fakes: Any, log: pytest.LogCaptureFixture, sweepers: int, enders: int) -> None:
    proxy = Proxy(fakes, {client_id: _result() for client_id in range(REQUESTS)})
    forget_results(proxy)
    table = proxy._results
    assert isinstance(table, ForgottenResults)
    leader = fakes.ZeroMqQueueBase(proxy.result_queue.address, is_server=False, name="worker_result_queue")
    leader_alive = threading.Event()
    leader_alive.set()
    swept = threading.Event()

    def stream() -> None:  # the leader: every request's tokens, round robin, until it dies
        token = 0
        while leader_alive.is_set() and token < TOKENS:
            token += 1
            for client_id in range(REQUESTS):
                if not leader_alive.is_set():
                    break
                leader.put(fakes.Response(client_id, token, token == TOKENS))
        leader.socket.close(linger=0)  # its death: the connection goes with the process
        leader.context.term()

    barrier = threading.Barrier(sweepers + 1, timeout=30)

    def sweep() -> None:  # the fatal path's: failed first, then every pending request forgotten
        barrier.wait()
        threading.Event().wait(random.uniform(0, 0.005))
        table.failed = True
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
    leader_alive.clear()
    leader_thread.join(30)
    start_ending.wait()
    for thread in threads:
        thread.join(30)
    try:
        assert not leader_thread.is_alive() and not any(thread.is_alive() for thread in threads)
        assert not proxy.dispatch_result_thread.is_alive()
        assert ended == [True] * enders
        assert proxy.errors.empty(), proxy.errors.get_nowait()
        assert [r.getMessage() for r in log.records if r.levelno >= logging.WARNING] == []
    finally:
        proxy.result_queue.close()


@pytest.mark.parametrize(("sweepers", "enders"), [(1, 1), (3, 4)])
def test_late_responses_for_forgotten_requests_meet_no_key_error_and_the_thread_ends(
        fakes: Any, upstream_log: pytest.LogCaptureFixture, sweepers: int, enders: int) -> None:
    for _ in range(5):
        upstream_log.clear()
        _race_once(fakes, upstream_log, sweepers, enders)


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
    finally:
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
        proxy._results.failed = True  # type: ignore[attr-defined]
        proxy.dispatch_result_thread.start()
        leader.put(fakes.Response(7, 1, False))
        while 7 not in proxy._results:  # dispatched (a forgotten id): the leader holds the one pipe
            threading.Event().wait(0.001)
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
