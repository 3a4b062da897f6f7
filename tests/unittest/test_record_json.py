"""The core records' JSON forms: ``from_dict`` reads back exactly what ``to_dict`` writes, and
rejects anything else with a ``ValueError`` that names the record and the field.

The records come from real runs: a monitor's event for a real SIGKILL, a stop report of a real
stop with a real unkillable process (``D`` from the freezer or FUSE). The kit that derives most
records' forms from their declarations (``JsonRecord``) is checked on a record with a field of each
type it supports.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import json
import math
import signal
import types
from pathlib import Path
from typing import Any

import pytest

import trtllm_liveness
from tests.support.process_tracker import ProcessTracker, state_of
from tests.support.stuck_processes import StuckChild
from tests.support.waits import wait_until
from trtllm_liveness._events import EventKind, WorkerEvent
from trtllm_liveness._record_fields import JsonRecord, _form_of
from trtllm_liveness.monitor import WorkerProcessMonitor
from trtllm_liveness.process import capture_identity
from trtllm_liveness.stop._bounded_stop import stop_processes
from trtllm_liveness.stop._stop_report import StopOutcome, StoppedWorker, StopReport, UnkillableWorker

pytestmark = [pytest.mark.real_process, pytest.mark.timeout(60)]


def _through_json(data: dict[str, Any]) -> Any:
    return json.loads(json.dumps(data))


@pytest.fixture
def died(procs: ProcessTracker) -> WorkerEvent:
    """The monitor's event for a real SIGKILL of a watched child."""
    child = procs.sleeper()
    events: list[WorkerEvent] = []
    with WorkerProcessMonitor() as monitor:
        monitor.subscribe(events.append)
        monitor.register([capture_identity(3, child.pid)])
        monitor.start()
        child.send_signal(signal.SIGKILL)
        assert wait_until(lambda: events, 10), "the death was never reported"
    return events[0]


def test_a_worker_event_reads_back_what_it_wrote(died: WorkerEvent) -> None:
    data = died.to_dict()
    back = WorkerEvent.from_dict(_through_json(data))
    assert back.to_dict() == data
    assert (back.kind, back.cause, back.wall_time, back.tid, back.wchan) == (
        EventKind.DIED, died.cause, died.wall_time, died.tid, died.wchan)
    assert back.identity[:2] == died.identity[:2] and back.identity.hostname == died.identity.hostname
    # What the form does not carry is unknown, never made up: no start time (never signalled), no
    # monotonic stamps.
    assert back.identity.start_time is None and back.identity.pid_namespace is None
    assert math.isnan(back.detected_at) and back.fault_at is None
    assert WorkerEvent.from_dict({k: v for k, v in data.items() if k not in ("restartable", "message")}) == back


@pytest.mark.parametrize(("change", "complaint"), [
    ({"kind": "exploded"}, "field 'kind' must be one of 'died', 'wedged'"),
    ({"pid": "42"}, "field 'pid' must be an int, got '42'"),
    ({"pid": True}, "field 'pid' must be an int, got True"),
    ({"pid": 0}, "pid=0 is outside"),
    ({"rank": -1}, "rank=-1 is outside"),
    ({"hostname": ""}, "hostname must be a non-empty str"),
    ({"tid": 1.5}, "field 'tid' must be an int"),
    ({"wall_time": float("inf")}, "field 'wall_time' must be a finite number"),
    ({"restartable": False}, "field 'restartable' is False, but the record's other fields give True"),
    ({"restartable": 1}, "field 'restartable' is 1, but the record's other fields give True"),
    ({"message": "all is well"}, "field 'message' is 'all is well', but the record's other fields give 'MPI worker"),
    ({"colour": "red"}, "unknown field(s) colour"),
    ({"cause": None}, "field 'cause' must be a string, got None"),
])
def test_a_bad_worker_event_is_refused_naming_the_field(died: WorkerEvent, change: dict[str, Any],
                                                         complaint: str) -> None:
    with pytest.raises(ValueError, match=r"^WorkerEvent: .*") as raised:
        WorkerEvent.from_dict({**died.to_dict(), **change})
    assert complaint in str(raised.value)


def test_a_worker_event_needs_a_json_object_with_every_field(died: WorkerEvent) -> None:
    with pytest.raises(ValueError, match="WorkerEvent: expected a JSON object, got list"):
        WorkerEvent.from_dict([died.to_dict()])
    data = died.to_dict()
    del data["wall_time"], data["kind"]
    with pytest.raises(ValueError, match="WorkerEvent: missing field"):
        WorkerEvent.from_dict(data)


def test_a_stop_report_with_an_unkillable_worker_reads_back_what_it_wrote(
        procs: ProcessTracker, stuck_child: StuckChild) -> None:
    healthy = procs.sleeper()
    identities = [capture_identity(0, healthy.pid), capture_identity(1, stuck_child.popen.pid)]
    assert wait_until(lambda: state_of(stuck_child.popen.pid) == "D", 10)
    report = stop_processes(identities, grace_s=0.2, kill_s=0.5)
    stuck_child.release()
    assert [w.outcome for w in report.workers] == [StopOutcome.EXITED_AFTER_TERM, StopOutcome.UNKILLABLE]
    data = report.to_dict()
    back = StopReport.from_dict(_through_json(data))
    assert back.to_dict() == data
    assert back.workers == report.workers  # every field of a stopped worker is in its form
    # An unkillable worker's form has no identity: the rest is all there.
    assert back.unkillable == tuple(dataclasses.replace(item, identity=None) for item in report.unkillable)
    assert back.outcome_of(stuck_child.popen.pid) is StopOutcome.UNKILLABLE and back.outcome_of(1) is None
    assert not back.restartable and [event.kind for event in back.events()] == [EventKind.UNKILLABLE]


@pytest.fixture
def report_form() -> dict[str, Any]:
    report = StopReport(
        workers=(StoppedWorker(0, 41, "h", StopOutcome.EXITED_AFTER_TERM, signals_sent=("SIGTERM",),
                               exited_after_s=0.01),
                 StoppedWorker(1, 42, "h", StopOutcome.UNKILLABLE, signals_sent=("SIGTERM", "SIGKILL"))),
        unkillable=(UnkillableWorker(1, 42, "h", "D", "", (42, 43), "request_wait_answer", True, "SIGKILL", 0.5),),
        grace_s=0.2, kill_s=0.5, term_signal="SIGTERM", elapsed_s=0.71, started_wall=1.0e9)
    return report.to_dict()


@pytest.mark.parametrize(("path", "value", "complaint"), [
    ((), {"restartable": True}, "StopReport: field 'restartable' is True, but the record's other fields give False"),
    ((), {"all_stopped": True}, "StopReport: field 'all_stopped' is True"),
    ((), {"workers": {}}, "StopReport: field 'workers' must be an array"),
    ((), {"grace_s": "0.2"}, "StopReport: field 'grace_s' must be a finite number"),
    (("workers", 0), {"outcome": "vanished"}, "StoppedWorker: field 'outcome' must be one of 'already-gone'"),
    (("workers", 0), {"signals_sent": ["SIGTERM", 15]}, "StoppedWorker: field 'signals_sent' must be an array of str"),
    (("workers", 1), {"pid": None, "why": "x"}, "StoppedWorker: unknown field(s) why"),
    (("unkillable", 0), {"d_tids": [42, "43"]}, "UnkillableWorker: field 'd_tids' must be an array of ints"),
    (("unkillable", 0), {"kill_pending": 1}, "UnkillableWorker: field 'kill_pending' must be a bool"),
    (("unkillable", 0), {"message": "fine"}, "UnkillableWorker: field 'message' is 'fine'"),
])
def test_a_bad_stop_report_is_refused_naming_the_record_and_field(report_form: dict[str, Any], path: tuple[Any, ...],
                                                                  value: dict[str, Any], complaint: str) -> None:
    target: Any = report_form
    for key in path:
        target = target[key]
    target.update(value)
    with pytest.raises(ValueError) as raised:
        StopReport.from_dict(report_form)
    assert complaint in str(raised.value)


def test_a_stopped_worker_without_a_pid_reads_back(report_form: dict[str, Any]) -> None:
    report_form["workers"][1]["pid"] = None  # a target that had none (bad input, a Process never started)
    assert StopReport.from_dict(report_form).workers[1].pid is None


class _Colour(str, enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclasses.dataclass(frozen=True)
class _Leaf(JsonRecord):
    name: str
    weight: float


@dataclasses.dataclass(frozen=True)
class _EveryKind(JsonRecord):
    """One field of each type the kit reads, a derived property and a field the form may lack."""

    json_form = ("count", "ratio", "label", "flag", "maybe", "colour", "ids", "names", "leaf", "leaves", "total",
                 "late")
    json_optional = ("late",)

    count: int
    ratio: float
    label: str
    flag: bool
    maybe: int | None
    colour: _Colour
    ids: tuple[int, ...]
    names: tuple[str, ...]
    leaf: _Leaf | None
    leaves: tuple[_Leaf, ...]
    late: str = "unset"
    hidden: int = 7  # not in the form: read back as its default

    @property
    def total(self) -> float:
        return self.count + sum(leaf.weight for leaf in self.leaves)


_EVERY = _EveryKind(3, 0.5, "x", False, None, _Colour.BLUE, (1, 2), ("a",), _Leaf("l", 1.0),
                    (_Leaf("m", 2.0), _Leaf("n", 0.25)), late="set")


def test_the_kit_writes_every_field_in_order_and_reads_it_back() -> None:
    data = _EVERY.to_dict()
    assert list(data) == list(_EveryKind.json_form)
    assert data["colour"] == "blue" and data["ids"] == [1, 2] and data["leaves"][1] == {"name": "n", "weight": 0.25}
    assert data["total"] == 5.25 and "hidden" not in data
    assert _EveryKind.from_dict(_through_json(data)) == _EVERY
    lacking = {k: v for k, v in data.items() if k not in ("late", "total")}
    assert _EveryKind.from_dict({**lacking, "ratio": 1, "maybe": 4}) == dataclasses.replace(
        _EVERY, late="unset", ratio=1.0, maybe=4)
    assert _EveryKind.from_dict({**data, "leaf": None, "maybe": 0}).leaf is None


@pytest.mark.parametrize(("change", "complaint"), [
    ({"count": True}, "_EveryKind: field 'count' must be an int, got True"),
    ({"count": 1.0}, "_EveryKind: field 'count' must be an int"),
    ({"ratio": False}, "_EveryKind: field 'ratio' must be a finite number"),
    ({"ratio": float("nan")}, "_EveryKind: field 'ratio' must be a finite number"),
    ({"label": 3}, "_EveryKind: field 'label' must be a string"),
    ({"flag": 0}, "_EveryKind: field 'flag' must be a bool"),
    ({"maybe": "1"}, "_EveryKind: field 'maybe' must be an int"),
    ({"colour": "green"}, "_EveryKind: field 'colour' must be one of 'red', 'blue'"),
    ({"ids": [1, True]}, "_EveryKind: field 'ids' must be an array of ints"),
    ({"names": "a"}, "_EveryKind: field 'names' must be an array of strings"),
    ({"leaf": {"name": "l"}}, "_Leaf: missing field(s) weight"),
    ({"leaf": []}, "_Leaf: expected a JSON object, got list"),
    ({"leaves": [{"name": "m", "weight": "2"}]}, "_Leaf: field 'weight' must be a finite number"),
    ({"leaves": {}}, "_EveryKind: field 'leaves' must be an array"),
    ({"total": 5}, "_EveryKind: field 'total' is 5, but the record's other fields give 5.25"),
    ({"hidden": 7}, "_EveryKind: unknown field(s) hidden"),
    ({"count": None}, "_EveryKind: field 'count' must be an int, got None"),
])
def test_the_kit_refuses_a_bad_field_by_name(change: dict[str, Any], complaint: str) -> None:
    with pytest.raises(ValueError) as raised:
        _EveryKind.from_dict({**_EVERY.to_dict(), **change})
    assert complaint in str(raised.value)


def test_the_kit_needs_every_field_the_form_does_not_mark_optional() -> None:
    data = _EVERY.to_dict()
    del data["ids"]
    with pytest.raises(ValueError, match=r"^_EveryKind: missing field\(s\) ids$"):
        _EveryKind.from_dict(data)


@dataclasses.dataclass(frozen=True)
class _Renamed(JsonRecord):
    """Keys other than the names, floats rounded (a derived one too), a derived field never compared."""

    json_form = ("seconds", "fraction", "pending", "half", "where")
    json_keys = types.MappingProxyType({"pending": "sigkill_pending", "where": "stuck_in"})
    json_round = types.MappingProxyType({"seconds": 3, "fraction": 2, "half": 1})
    json_unchecked = ("where",)

    seconds: float
    fraction: float | None
    pending: bool

    @property
    def half(self) -> float:
        return self.seconds / 2

    @property
    def where(self) -> str:
        return f"{self.seconds} on this host"


def test_the_kit_writes_keys_and_rounding_the_record_asks_for() -> None:
    record = _Renamed(1.23456, None, True)
    data = record.to_dict()
    assert json.dumps(data) == ('{"seconds": 1.235, "fraction": null, "sigkill_pending": true, "half": 0.6, '
                                '"stuck_in": "1.23456 on this host"}')
    assert _Renamed.from_dict(data) == _Renamed(1.235, None, True)  # the form's precision, read back
    assert _Renamed(0.5, 0.456, False).to_dict()["fraction"] == 0.46
    # Read by key; the unchecked property may be anything or absent; the rounded derived one is compared rounded.
    assert _Renamed.from_dict({**data, "stuck_in": 7}) == _Renamed.from_dict(
        {k: v for k, v in data.items() if k != "stuck_in"})
    with pytest.raises(ValueError, match=r"^_Renamed: field 'half' is 0\.62, but the record's other fields give 0\.6$"):
        _Renamed.from_dict({**data, "half": 0.62})
    with pytest.raises(ValueError, match=r"^_Renamed: field 'sigkill_pending' must be a bool, got 1$"):
        _Renamed.from_dict({**data, "sigkill_pending": 1})
    with pytest.raises(ValueError, match=r"^_Renamed: missing field\(s\) sigkill_pending$"):
        _Renamed.from_dict({**{k: v for k, v in data.items() if k != "sigkill_pending"}, "pending": True})


def test_every_record_of_the_package_has_a_json_form() -> None:
    """A field type the kit cannot write or read fails here, not at a record's first ``to_dict``."""
    root = Path(trtllm_liveness.__file__).parent
    for path in sorted(root.rglob("*.py")):
        if "(JsonRecord):" in path.read_text():
            importlib.import_module(".".join(("trtllm_liveness", *path.relative_to(root).with_suffix("").parts)))
    pending, records = [JsonRecord], []
    while pending:
        for record in pending.pop().__subclasses__():
            pending.append(record)
            if record.__module__.startswith("trtllm_liveness."):
                records.append(record)
                assert _form_of(record).writers, record
    assert {"StopReport", "ScenarioResult", "DoctorReport"} <= {record.__name__ for record in records}


def test_the_kit_refuses_a_form_it_cannot_derive() -> None:
    @dataclasses.dataclass(frozen=True)
    class Misnamed(JsonRecord):
        count: int
        json_form = ("count", "total")

    @dataclasses.dataclass(frozen=True)
    class Unwritable(JsonRecord):
        spans: tuple[float, ...]

    @dataclasses.dataclass(frozen=True)
    class MisKeyed(JsonRecord):
        count: int
        json_keys = types.MappingProxyType({"total": "sum"})

    for record in (Misnamed(1), MisKeyed(1)):
        with pytest.raises(TypeError, match=f"{type(record).__name__}: a json_\\* option names what is neither"):
            record.to_dict()
    with pytest.raises(TypeError, match=r"Unwritable\.spans: no JSON form for type"):
        Unwritable.from_dict({"spans": []})
