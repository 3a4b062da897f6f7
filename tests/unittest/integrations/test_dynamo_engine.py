"""Dynamo over the reference MPI executor, with real SIGKILLs of a rank.

1. Stock Dynamo: the REAL ``TrtllmEngineMonitor`` from the installed ai-dynamo wheel, driven
   through an engine wrapper shaped like Dynamo's (``tests/support/ref_engine.py``), ends the
   worker with status 1 when the extension is on (1.2.x and main), because the extension records
   the death in ``_fatal_error``, which Dynamo's watchdog reads. Without the extension, on 1.2.x,
   nothing ever notices (the baseline).
2. Our bridge (``attach_to_dynamo``) on the real runtime on loopback: ``/health`` turns 503,
   ``/engine/liveness`` names the dead rank, and the worker exits non-zero within its bound.

Each worker runs in a child process in its own session (``HelperProcess``), which is killed as a
whole afterwards; no process may survive that. The exit time is measured in the benchmark only.
"""

from __future__ import annotations

import json
import signal
from typing import Any

import pytest

from tests.support.children import HelperProcess, free_port, http_get, identities_of
from tests.support.facilities import needs
from tests.support.ref_engine import kill_rank, signal_rank
from tests.support.waits import WAIT_SCALE, wait_until

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.mpi,
    pytest.mark.real_process,
    needs("mpi", "dynamo"),
]

READY_S = 60 * WAIT_SCALE
EXIT_S = 30 * WAIT_SCALE


@needs("dynamo-monitor")
@pytest.mark.parametrize(("mode", "rank"), [("1.2", 1), ("main", 0), ("main", 1)])
def test_stock_dynamo_monitor_exits_1_after_sigkill_with_extension(mode: str, rank: int) -> None:
    with HelperProcess("dynamo_stock_worker", {"mode": mode, "max_life_s": 60 * WAIT_SCALE}) as worker:
        ready = worker.read_record(READY_S, "ready")
        assert ready["supports_health_check"] is True  # otherwise Dynamo disables its monitor
        victim = identities_of(ready)[rank]
        kill_rank(victim)
        status = worker.wait_exit(EXIT_S)
        log = worker.stderr_tail(20000)
        survivors = worker.close()
    assert status == 1, log
    # The exit is Dynamo's own, and its log names the dead rank.
    assert "dynamo.trtllm.engine_monitor" in log and "Forcing process exit" in log
    assert f"rank {victim.rank} (pid {victim.pid})" in log
    assert survivors == []


@needs("dynamo-monitor")
def test_stock_dynamo_monitor_without_extension_never_notices_on_12() -> None:
    options = {"mode": "1.2", "liveness": False, "max_life_s": 4.0}
    with HelperProcess("dynamo_stock_worker", options) as worker:
        ready = worker.read_record(READY_S, "ready")
        kill_rank(identities_of(ready)[1])
        ended = worker.read_record(READY_S, "ended")  # the worker gave up waiting by itself
        status = worker.wait_exit(EXIT_S)
        survivors = worker.close()
    assert ended["ended"] == "max_life_s" and ended["pending"] > 0  # requests hang, nobody exits
    assert status == 3
    assert survivors == []


def _dynamo_env(port: int) -> dict[str, str]:
    return {"DYN_SYSTEM_PORT": str(port), "DYN_SYSTEM_HOST": "127.0.0.1", "DYN_TCP_RPC_HOST": "127.0.0.1",
            "DYN_LOG": "warn"}


@pytest.mark.parametrize(("mode", "rank"), [("main", 1), ("1.2", 0)])
def test_bridge_on_real_runtime_503_names_rank_and_exits_nonzero(mode: str, rank: int) -> None:
    port = free_port()
    # The delay keeps the status server up after the 503 so that the route can be read; the
    # exit bound is the delay plus the graceful shutdown, within shutdown_timeout_s.
    options = {"mode": mode, "shutdown_delay_s": 2.0 * WAIT_SCALE, "shutdown_timeout_s": 15.0 * WAIT_SCALE}
    with HelperProcess("dynamo_engine_worker", options, _dynamo_env(port)) as worker:
        ready = worker.read_record(READY_S, "ready")
        assert ready["streamed"] == [7, 8, 9]  # a request went through the endpoint to the executor
        assert wait_until(lambda: http_get(port, "/health")[0] == 200, 20)
        status, body = http_get(port, "/engine/liveness")
        assert status == 200 and json.loads(body)["healthy"] is True
        victim = identities_of(ready)[rank]

        kill_rank(victim)

        assert wait_until(lambda: http_get(port, "/health")[0] == 503, 20), worker.stderr_tail()
        status, body = http_get(port, "/engine/liveness")
        assert status == 200, body
        document = json.loads(body)
        assert document["healthy"] is False
        assert document["failure"]["kind"] == "died"
        assert (document["failure"]["rank"], document["failure"]["pid"]) == (victim.rank, victim.pid)
        ranks = {item["rank"]: item["state"] for item in document["ranks"]}
        assert ranks[victim.rank] in ("exited", "zombie")
        exit_status = worker.wait_exit(EXIT_S)
        log = worker.stderr_tail(20000)
        survivors = worker.close()
    assert exit_status == 1, log
    assert f"rank {victim.rank} (pid {victim.pid})" in log
    assert "shutting the Dynamo runtime down" in log  # graceful first, not the watchdog
    assert survivors == []


def test_engine_route_shows_a_stall_with_its_diagnosis_and_its_end() -> None:
    """A SIGSTOPped subordinate stops the reference leader (it waits for every rank's step ack):
    with stall_action=report, /health stays 200 while /engine/liveness shows every rank stalled,
    the stall, and the diagnosis naming the stopped rank; SIGCONT ends the stall."""
    port = free_port()
    options = {"mode": "main", "liveness": {"stall_timeout_s": 1.0}}
    with HelperProcess("dynamo_engine_worker", options, _dynamo_env(port)) as worker:
        ready = worker.read_record(READY_S, "ready")
        assert wait_until(lambda: http_get(port, "/health")[0] == 200, 20)
        victim = identities_of(ready)[1]
        signal_rank(victim, signal.SIGSTOP)
        try:
            def document() -> dict[str, Any]:
                status, body = http_get(port, "/engine/liveness")
                assert status == 200, body
                return dict(json.loads(body))

            assert wait_until(lambda: document()["diagnosis"] is not None, 30), worker.stderr_tail()
            seen = document()
            assert seen["healthy"] is True and seen["stall"] is not None and seen["stall"]["pending"] >= 1
            assert {item["state"] for item in seen["ranks"]} == {"stalled"}
            activity = {rank["rank"]: rank["activity"] for rank in seen["diagnosis"]["ranks"]}
            assert activity[victim.rank] == "stopped"
            assert http_get(port, "/health")[0] == 200  # report mode: the engine keeps serving
        finally:
            signal_rank(victim, signal.SIGCONT)
        assert wait_until(lambda: document()["stall"] is None, 30), worker.stderr_tail()
        assert {item["state"] for item in document()["ranks"]} == {"alive"}
        survivors = worker.close()
    assert survivors == []
