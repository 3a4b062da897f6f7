"""The typed scenario records: JSON round trip, validation, and what the parent side derives."""

from __future__ import annotations

import dataclasses
import json
import json.decoder
import re

import pytest

from tests.support.upstream_fakes import FAKE_ENGINE
from tests.support.victims import named_in, names_a_victim
from trtllm_liveness._events import EventKind, WorkerEvent
from trtllm_liveness.demo._scenario_child import liveness_env
from trtllm_liveness.demo._scenario_executor import engine_factory
from trtllm_liveness.demo._scenario_records import (
    Detection,
    EndingOutcome,
    ScenarioOptions,
    ScenarioResult,
    ScenarioRun,
    ShutdownOutcome,
    Victim,
)
from trtllm_liveness.process._identity import ProcessIdentity
from trtllm_liveness.stop._stop_report import StopOutcome, StoppedWorker, StopReport

pytestmark = pytest.mark.timeout(30)


def _result() -> ScenarioResult:
    report = StopReport(workers=(StoppedWorker(0, 41, "h", StopOutcome.EXITED_AFTER_TERM, signals_sent=("SIGTERM",)),
                                 StoppedWorker(1, 42, "h", StopOutcome.ALREADY_GONE)),
                        unkillable=(), grace_s=0.5, kill_s=1.0, term_signal="SIGTERM", elapsed_s=0.01, started_wall=1.0)
    # As the parent reads an event back (WorkerEvent.from_dict): no start time, no monotonic stamps.
    died = WorkerEvent.from_dict(WorkerEvent(EventKind.DIED, ProcessIdentity(1, 42, None, "h", None), "process exited",
                                             wall_time=1.0e9).to_dict())
    return ScenarioResult(
        iteration=0, options=ScenarioOptions(fault_ranks=(1,)), phase="serving", pids=(41, 42),
        victims=(Victim(1, 42),), in_flight=4, fault_at=12.5, events=(died,),
        fatal_error="MPI worker rank 1 (pid 42) on host h exited unexpectedly", fatal_error_type="WorkerFailedError",
        pending_not_done=0,
        detection=Detection(2.5, 2.9, 2.8, 2.9, None, 2.4, ("EngineDeadError",), "EngineDeadError", 10.0),
        shutdown=ShutdownOutcome(90.0, pre_shutdown_calls=1, pre_shutdown_runs=1, report=report, restartable=True),
        ending=EndingOutcome("shutdown"), thread_exceptions=("x: MPI_ERR_PROC_FAILED",), pidfds_open=0, fds_open=19)


# The JSON form of _result(), key for key: what the demo's --json, the tests and the benchmarks read.
RESULT_FORM = {
    "iteration": 0, "phase": "serving", "proxy_class": None, "ready_ms": None, "pids": [41, 42],
    "victims": [{"rank": 1, "pid": 42}], "in_flight": 4, "tokens_ok": None, "fault_at": 12.5,
    "events": [{"kind": "died", "rank": 1, "pid": 42, "hostname": "h", "cause": "process exited",
                "restartable": True, "tid": None, "wchan": "", "wall_time": 1.0e9,
                "message": "MPI worker rank 1 (pid 42) on host h exited unexpectedly: process exited"}],
    "fatal_error": "MPI worker rank 1 (pid 42) on host h exited unexpectedly", "fatal_error_type": "WorkerFailedError",
    "pending_not_done": 0,
    "detection": {"detected_ms": 2.5, "health_false_ms": 2.9, "requests_failed_ms": 2.8, "e2e_ms": 2.9,
                  "stall_detected_ms": None, "floor_ms": 2.4, "pending_errors": ["EngineDeadError"],
                  "new_request_error": "EngineDeadError", "window_s": 10.0},
    "shutdown": {"shutdown_ms": 90.0, "hung": False, "by_harness": False, "pre_shutdown_calls": 1,
                 "pre_shutdown_runs": 1,
                 "report": {"restartable": True, "all_stopped": True, "grace_s": 0.5, "kill_s": 1.0,
                            "term_signal": "SIGTERM", "elapsed_s": 0.01, "started_wall": 1.0,
                            "workers": [{"rank": 0, "pid": 41, "hostname": "h", "outcome": "exited-after-term",
                                         "detail": "", "returncode": None, "exited_after_s": None,
                                         "signals_sent": ["SIGTERM"]},
                                        {"rank": 1, "pid": 42, "hostname": "h", "outcome": "already-gone",
                                         "detail": "", "returncode": None, "exited_after_s": None,
                                         "signals_sent": []}],
                            "unkillable": []},
                 "unkillable": [], "restartable": True, "fatal_restartable": None},
    "init": None, "control": None, "health_probe": None, "watcher": None,
    "ending": {"ending": "shutdown", "sigints": 0, "sigint_ms": None, "graceful_ms": None, "at_exit": False},
    "survivors": [], "survivors_while_frozen": [], "snapshot": None, "oom_kills": None, "freezer_path": None,
    "memory_cgroup_path": None, "critical_logs": [], "thread_exceptions": ["x: MPI_ERR_PROC_FAILED"],
    "pidfds_open": 0, "fds_open": 19,
}


def test_a_result_is_written_in_its_json_form_key_for_key() -> None:
    data = _result().to_dict()
    assert list(data.pop("options")) == [f.name for f in dataclasses.fields(ScenarioOptions)]
    assert list(data) == list(RESULT_FORM)
    assert data == RESULT_FORM
    assert list(data["events"][0]) == list(RESULT_FORM["events"][0])  # type: ignore[index]
    assert list(data["shutdown"]["report"]) == list(RESULT_FORM["shutdown"]["report"])  # type: ignore[index]


def test_a_result_survives_the_json_process_boundary_unchanged() -> None:
    result = _result()
    line = json.dumps(result.to_dict())
    assert ScenarioResult.from_dict(json.loads(line)) == result


def test_derived_views_name_the_victim_and_its_stop_outcome() -> None:
    result = _result()
    assert result.victim == Victim(1, 42)
    assert names_a_victim(result, result.fatal_error)
    assert not named_in(Victim(1, 4), result.fatal_error)  # pid 4 is not pid 42
    assert result.shutdown is not None and result.shutdown.report is not None
    assert result.shutdown.report.outcome_of(42) is StopOutcome.ALREADY_GONE
    assert result.shutdown.report.outcome_of(7) is None


def test_options_reject_unknown_keys_and_bad_values_by_name() -> None:
    with pytest.raises(ValueError, match=r"unknown scenario option.*fualt"):
        ScenarioOptions.from_dict({"fualt": "kill"})
    with pytest.raises(ValueError, match="fault='boom'"):
        ScenarioOptions(fault="boom")
    with pytest.raises(ValueError, match="iterations must be 1"):
        ScenarioOptions(ending="serve_until_sigint", iterations=2)
    with pytest.raises(ValueError, match="takes fault 'none'"):
        ScenarioOptions(ending="interpreter_exit", fault="kill")
    assert ScenarioOptions.from_dict({"fault_ranks": [1, 2]}).fault_ranks == (1, 2)


def test_liveness_env_carries_the_knobs_and_the_exit_guard_only_when_asked() -> None:
    plain = liveness_env(ScenarioOptions(d_state_timeout_s=0.5))
    assert "d_state_timeout_s=0.5" in plain and "exit_on_fatal" not in plain
    guarded = liveness_env(ScenarioOptions(exit_on_fatal=True, exit_code=3, exit_timeout_s=5.0))
    assert "exit_on_fatal=1" in guarded and "exit_code=3" in guarded and "exit_timeout_s=5.0" in guarded


def test_a_run_parses_records_and_times_the_exit_from_the_fault() -> None:
    lines = [{"pids": [41, 42], "iteration": 0}, {"fault_at": 12.5, "iteration": 0}, _result().to_dict(),
             {"done": True}]
    results, other = ScenarioRun.parse(lines)
    run = ScenarioRun(results=results, survivors=(), done=True, returncode=3, exited_at=14.0,
                      progress=tuple(line for line in other if "done" not in line))
    assert run.results == (_result(),)
    assert run.fault_at == 12.5 and run.exit_ms == 1500.0
    assert run.problems() == []
    hung = ScenarioRun(results=(), survivors=(9,), done=False, stderr="boom", timed_out=True)
    assert hung.exit_ms is None and hung.problems() == ["boom", "processes left behind: [9]"]


def test_upstream_api_takes_one_iteration_per_process() -> None:
    """A second iteration on the fakes would share the process with the first one's upstream
    shutdown, which aborts it (libzmq) when it closes its queues under its dispatch thread."""
    with pytest.raises(ValueError, match="one iteration per process"):
        ScenarioOptions(via="executor_cls", engine=FAKE_ENGINE, iterations=2)
    assert ScenarioOptions(via="autoload", engine=FAKE_ENGINE).iterations == 1
    assert ScenarioOptions(iterations=3).via == "class"


@pytest.mark.parametrize("engine", ["", "module", "module:", ":Factory", "a b:C", "mod:1x", 3])
def test_upstream_api_needs_an_engine_factory_named_module_colon_attribute(engine: object) -> None:
    with pytest.raises(ValueError, match=r"engine=.*expected 'module:attribute'"):
        ScenarioOptions.from_dict({"via": "plain", "engine": engine})


def test_the_reference_executor_takes_no_engine_factory() -> None:
    with pytest.raises(ValueError, match=r"engine=.*is for upstream's API"):
        ScenarioOptions(via="class", engine=FAKE_ENGINE)
    assert ScenarioOptions(via="plain", engine="pkg.mod:Outer.factory").engine == "pkg.mod:Outer.factory"


@pytest.mark.parametrize(("engine", "why"), [
    ("trtllm_liveness_no_such_module:Factory", "cannot import 'trtllm_liveness_no_such_module'"),
    ("json:no_such_factory", "'json' has no attribute 'no_such_factory'"),
    ("string:ascii_letters", "'ascii_letters' is not callable"),
])
def test_an_engine_factory_that_cannot_be_had_is_named_with_the_reason(engine: str, why: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"engine='{engine}': {why}")):
        engine_factory(engine)
    assert engine_factory("json.decoder:JSONDecoder.decode") is json.decoder.JSONDecoder.decode
