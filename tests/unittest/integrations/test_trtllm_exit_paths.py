"""The fatal path and the interpreter exit, on the upstream-shaped fake ``tensorrt_llm`` (main).

``tests/programs/fatal_path_child.py`` builds the engine with upstream's own ``create()`` on real MPI
ranks: a PAIR request queue whose ``put`` blocks forever without a peer (``pre_shutdown()`` ->
``abort_request()`` per pending request), ``_mark_engine_dead`` keeping ``_results``,
``pre_shutdown()`` closing the monitor, and ``threading._register_atexit(pre_shutdown)`` +
``atexit.register(shutdown)``; the extension is installed as the import hook installs it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.children import HelperProcess
from tests.support.facilities import MPI_MARKS
from tests.support.waits import WAIT_SCALE

pytestmark = [pytest.mark.timeout(90), *MPI_MARKS]

COMMON = "enabled=1,scan_interval_s=0.1,shutdown_grace_s=1,shutdown_term_s=0.5,shutdown_kill_s=1"


def _atexit_record(log: str) -> dict[str, object]:
    lines = [line for line in log.splitlines() if line.startswith('{"atexit_fatal"')]
    assert lines, log[-4000:]
    record: dict[str, object] = json.loads(lines[-1])
    return record


@pytest.mark.parametrize("wait", ["wakeup", "event"])
@pytest.mark.parametrize("rank", [0, 1])
def test_leader_death_with_requests_pending_exits_nonzero_with_one_sigint(rank: int, wait: str, tmp_path: Path) -> None:
    """Upstream's pre_shutdown() blocks (PAIR send per pending request to a dead
    peer); the error is published, the requests failed and the guard fires anyway, once, and its
    SIGINT reaches the main thread's handler: ``wait="wakeup"`` waits as an asyncio server
    (uvicorn) does, on a wakeup fd; ``wait="event"`` in a lock wait, which only a signal taken by
    the main thread itself interrupts (the guard directs it there; a process-directed one taken by
    another thread left the handler unrun until the watchdog ended the process)."""
    termination_log = tmp_path / "termination-log"
    env = {"TRTLLM_WORKER_LIVENESS": f"{COMMON},exit_on_fatal=1,exit_code=3,exit_delay_s=0.1,"
                                     f"exit_timeout_s={10 * WAIT_SCALE},termination_log={termination_log}"}
    with HelperProcess("fatal_path_child", {"scenario": "kill", "rank": rank, "wait": wait}, env) as child:
        record = child.read_record(30 * WAIT_SCALE, "published")
        try:
            sigints = child.read_record(30 * WAIT_SCALE, "sigints")["sigints"]
        except TimeoutError:
            sigints = None  # the main thread never left its wait: asserted below, with the log
        status = child.wait_exit(40 * WAIT_SCALE)
        log = child.stderr_tail(10**7)  # all of it: a tail of a chatty run may miss a line
        survivors = child.close()
    assert record["published"] and f"rank {rank}" in str(record["published"]), log
    assert record["failed"] == 2, (record, log)
    assert status == 3, log
    assert survivors == []
    assert sigints == 1, log  # the guard's, and never a second one from /health
    assert log.count("SIGINT #") == 1, log
    assert "graceful shutdown did not finish" not in log, log  # the exit came from the graceful path
    assert f"rank {rank}" in termination_log.read_text(), log


@pytest.mark.parametrize("guard", [False, True])
def test_script_ending_without_shutdown_is_not_a_death(guard: bool) -> None:
    """Upstream's atexit pre_shutdown() stops the ranks; that is no fatal error,
    and the exit status stays 0 even with exit_on_fatal."""
    env = {"TRTLLM_WORKER_LIVENESS": f"{COMMON},exit_on_fatal={int(guard)},exit_code=3,exit_delay_s=0.1"}
    with HelperProcess("fatal_path_child", {"scenario": "clean_exit"}, env) as child:
        ready = child.read_record(30 * WAIT_SCALE, "ready")
        status = child.wait_exit(30 * WAIT_SCALE)
        log = child.stderr_tail(20000)
        survivors = child.close()
    record = _atexit_record(log)
    assert ready["tokens"] == 4, log
    assert record["atexit_fatal"] is None, log
    assert status == 0, log
    assert "liveness: fatal" not in log
    assert survivors == []
