"""attach_to_dynamo / liveness_monitor_of with a recording runtime and a real monitored child."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from tests.support.process_tracker import ProcessTracker
from tests.support.stuck_processes import StuckChild
from tests.support.waits import wait_until
from trtllm_liveness.integrations.dynamo import DynamoLivenessBridge, attach_to_dynamo, liveness_monitor_of
from trtllm_liveness.monitor import WorkerProcessMonitor
from trtllm_liveness.process import capture_identity

pytestmark = [pytest.mark.real_process, pytest.mark.timeout(60)]


class RecordingRuntime:
    def __init__(self) -> None:
        self.health: list[bool] = []
        self.routes: dict[str, Any] = {}
        self.shutdowns = 0

    def set_health_status(self, ready: bool) -> None:
        self.health.append(ready)

    def register_engine_route(self, route_name: str, callback: Any) -> None:
        self.routes[route_name] = callback

    def shutdown(self) -> None:
        self.shutdowns += 1


def test_monitor_is_found_on_executor_llm_or_itself() -> None:
    with WorkerProcessMonitor() as monitor:
        executor = SimpleNamespace(liveness_monitor=monitor)
        assert liveness_monitor_of(monitor) is monitor
        assert liveness_monitor_of(executor) is monitor
        assert liveness_monitor_of(SimpleNamespace(_executor=executor)) is monitor


@pytest.mark.parametrize("engine", [None, object(), SimpleNamespace(liveness_monitor=None),
                                    SimpleNamespace(_executor=SimpleNamespace(liveness_monitor="x"))])
def test_engine_without_liveness_is_a_clear_error(engine: Any) -> None:
    with pytest.raises(ValueError, match="liveness extension enabled"):
        liveness_monitor_of(engine)


def test_self_referencing_engine_does_not_loop() -> None:
    engine = SimpleNamespace()
    engine._executor = engine
    with pytest.raises(ValueError):
        liveness_monitor_of(engine)


def test_shutdown_delay_is_bounded_by_the_timeout() -> None:
    with WorkerProcessMonitor() as monitor, pytest.raises(ValueError, match="shutdown_delay_s"):
        DynamoLivenessBridge(RecordingRuntime(), monitor, shutdown_timeout_s=1.0, shutdown_delay_s=2.0)


def test_death_turns_unhealthy_serves_status_and_shuts_down_once(procs: ProcessTracker) -> None:
    child = procs.sleeper()
    runtime = RecordingRuntime()
    ended: list[int] = []
    with WorkerProcessMonitor() as monitor:
        monitor.register([capture_identity(0, child.pid)])
        monitor.start()
        llm = SimpleNamespace(_executor=SimpleNamespace(liveness_monitor=monitor))
        # A huge timeout: the watchdog must not fire during the test; exit_fn records instead.
        bridge = attach_to_dynamo(llm, runtime, shutdown_timeout_s=3600, shutdown_delay_s=0.05,
                                  exit_fn=ended.append)
        try:
            healthy = asyncio.run(runtime.routes["liveness"]({}))
            assert healthy["healthy"] is True and healthy["ranks"][0]["pid"] == child.pid
            child.kill()
            assert wait_until(lambda: runtime.shutdowns == 1, 10)
            assert runtime.health == [False]
            assert bridge.guard.triggered
            document = asyncio.run(runtime.routes["liveness"]({}))
            assert document["healthy"] is False
            assert (document["failure"]["rank"], document["failure"]["pid"]) == (0, child.pid)
            bridge.attach()  # idempotent: no second route
            assert list(runtime.routes) == ["liveness"]
        finally:
            bridge.guard.disarm()
    assert runtime.shutdowns == 1
    assert ended == []


def test_a_wedge_ends_the_worker_with_the_unrestartable_status(stuck_child: StuckChild) -> None:
    runtime = RecordingRuntime()
    ended: list[int] = []
    with WorkerProcessMonitor(d_state_timeout_s=0.3, scan_interval_s=0.05) as monitor:
        monitor.register([capture_identity(0, stuck_child.popen.pid)])
        monitor.start()
        llm = SimpleNamespace(_executor=SimpleNamespace(liveness_monitor=monitor))
        # The watchdog fires at once after the wedge; exit_fn records the status instead of exiting.
        bridge = attach_to_dynamo(llm, runtime, shutdown_timeout_s=0.0, exit_code=3, exit_fn=ended.append)
        try:
            assert wait_until(lambda: ended, 10)
            assert bridge.guard.reason is not None and bridge.guard.reason.restartable is False
        finally:
            bridge.guard.disarm()
    assert ended == [69]  # exit_code_unrestartable's default, not exit_code
