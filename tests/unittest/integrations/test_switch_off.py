"""The off switch is free everywhere: with ``TRTLLM_WORKER_LIVENESS`` off, every entry point a user
calls does nothing, raises nothing and logs nothing above INFO.

In a real child on each upstream-shaped fake (real MPI ranks, ``tests/programs/switch_off_child.py``):
the autoload, the README's in-code ``executor_cls=liveness_executor_class(config=...)``,
``attach_to_dynamo`` and ``expose_metrics_on_dynamo``. In process, for each off value: the inert
bridge, and the error that stays when the switch is on and the engine has no monitor. The
launchers' off path (``launch``, the autoload launcher: exec only, one "off" line) is tested in
tests/unittest/cli/test_launch_command.py and test_autoload_launcher.py.
"""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from tests.support.children import HelperProcess
from tests.support.facilities import needs
from tests.support.waits import WAIT_SCALE
from trtllm_liveness._switch import ENV_VAR, switch_word
from trtllm_liveness.integrations.dynamo import attach_to_dynamo, expose_metrics_on_dynamo

pytestmark = [pytest.mark.timeout(120)]

OFF = [None, "0", "off", " False ", "enabled=0,exit_on_fatal=1,stall_timeout_s=120"]


class RecordingRuntime:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def set_health_status(self, ready: bool) -> None:
        self.calls.append(f"set_health_status({ready})")

    def register_engine_route(self, route_name: str, callback: Any) -> None:
        self.calls.append(f"register_engine_route({route_name})")

    def shutdown(self) -> None:
        self.calls.append("shutdown()")


class RecordingEndpoint:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.metrics = self

    def register_prometheus_expfmt_callback(self, callback: Any) -> None:
        self.calls.append("register")


def _llm_without_liveness() -> Any:
    """What ``LLM`` is with the switch off: an executor whose liveness monitor is None."""
    return SimpleNamespace(_executor=SimpleNamespace(liveness_monitor=None))


def _set_switch(monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    if value is None:
        monkeypatch.delenv(ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(ENV_VAR, value)


@pytest.mark.parametrize("value", OFF, ids=repr)
def test_switched_off_the_dynamo_entry_points_do_nothing(value: str | None, monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    _set_switch(monkeypatch, value)
    runtime, endpoint = RecordingRuntime(), RecordingEndpoint()
    threads = set(threading.enumerate())
    with caplog.at_level(logging.DEBUG, logger="trtllm_liveness"):
        bridge = attach_to_dynamo(_llm_without_liveness(), runtime)
        bridge.attach()  # a second attach is as inert
        metrics = expose_metrics_on_dynamo(endpoint, _llm_without_liveness())
    assert bridge.active is False and bridge.guard is None
    assert bridge.status() == {"healthy": True, "failure": None, "restartable": True, "ranks": []}
    assert runtime.calls == [] and endpoint.calls == [] and metrics is None
    assert set(threading.enumerate()) == threads  # no thread started
    records = [(record.levelno, record.getMessage()) for record in caplog.records]
    said = "unset" if value is None else repr(value)
    assert records == [(logging.INFO, f"liveness: off ({ENV_VAR} {said}): attach_to_dynamo does nothing"),
                       (logging.INFO, f"liveness: off ({ENV_VAR} {said}): expose_metrics_on_dynamo does nothing")]


@pytest.mark.parametrize("value", ["1", "exit_on_fatal=1"])
def test_switched_on_an_engine_without_a_monitor_is_still_an_error(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _set_switch(monkeypatch, value)
    runtime, endpoint = RecordingRuntime(), RecordingEndpoint()
    with pytest.raises(ValueError, match="liveness extension enabled"):
        attach_to_dynamo(_llm_without_liveness(), runtime)
    with pytest.raises(ValueError, match="liveness extension enabled"):
        expose_metrics_on_dynamo(endpoint, _llm_without_liveness())
    assert runtime.calls == [] and endpoint.calls == []


@pytest.mark.real_process
@pytest.mark.mpi
@needs("mpi")
@pytest.mark.parametrize("tree", ["v12", "main"])
@pytest.mark.parametrize("value", ["0", "enabled=0,exit_on_fatal=1,stall_timeout_s=120"])
def test_switched_off_a_worker_written_from_the_docs_runs_as_without_the_package(tree: str, value: str) -> None:
    with HelperProcess("switch_off_child", {"tree": tree}, {ENV_VAR: value}) as child:
        record = child.read_record(90 * WAIT_SCALE, "executor")
        child.read_record(60 * WAIT_SCALE, "done")
        status = child.wait_exit(30 * WAIT_SCALE)
        log = child.stderr_tail(200_000)
        survivors = child.close()
    assert status == 0 and survivors == [], log
    # The autoload installs nothing for an off word; a settings value installs the import hook so that
    # an engine start validates it (documented), and then the engine attaches nothing.
    assert record["hooked"] is (switch_word({ENV_VAR: value}) is not False), record
    assert record["monitor"] is False and record["liveness_threads"] == [], record  # the executor attaches nothing
    assert record["tokens"] == 4, record  # and serves as upstream's
    assert record["bridge_active"] is False and record["bridge_guard"] is False, record
    assert record["runtime_calls"] == [] and record["metrics"] is False and record["endpoint_calls"] == [], record
    package = [line for line in log.splitlines() if line.startswith("LOG ") and " trtllm_liveness" in line]
    assert [line for line in package if not line.startswith("LOG INFO ") and not line.startswith("LOG DEBUG ")] \
        == [], package
    assert not any("worker liveness on" in line for line in log.splitlines()), log
