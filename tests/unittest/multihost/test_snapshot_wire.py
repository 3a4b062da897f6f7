"""The snapshot and iteration messages on the hub's wire: strict parsing (a bad or huge field is a
:class:`~trtllm_liveness.multihost._wire.WireError`, never a crash) of the ranks' diagnosis records
in their own JSON form, and replies kept under the wire's cap by cutting stacks, which the records
say. No hosts needed: the records are made from a real snapshot of real local processes."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.process_tracker import ProcessTracker
from tests.support.waits import wait_until
from trtllm_liveness.diagnose._diagnosis import Activity, RankDiagnosis, ThreadDiagnosis, diagnose, merge_hosts
from trtllm_liveness.diagnose._diagnosis_record import HostSnapshot
from trtllm_liveness.diagnose._scan import Verdict
from trtllm_liveness.diagnose._stack_records import RankStacks, StackFrame, StackSource, StackStatus, ThreadStack
from trtllm_liveness.multihost import _wire
from trtllm_liveness.multihost._hub_records import Session
from trtllm_liveness.multihost._hub_snapshots import (
    encode_ranks,
    parse_iterations,
    parse_snapshot,
    parse_snapshot_request,
)
from trtllm_liveness.process._identity import ProcessIdentity, capture_identity

pytestmark = [pytest.mark.timeout(60)]

SECRET = b"s" * 32
SID = "ab" * 16


def _message(kind: str, **fields: Any) -> _wire.Message:
    """Through the real encoder and decoder, as the hub reads it."""
    return _wire.decode(SECRET, _wire.TO_HUB, _wire.encode(SECRET, _wire.TO_HUB, kind, SID, 1, **fields))


@pytest.fixture
def ranks(procs: ProcessTracker) -> Iterator[tuple[Session, list[ProcessIdentity]]]:
    """Two real sleepers with their stack dumps registered, as another host's ranks 2 and 3."""
    code = ("from trtllm_liveness.diagnose._faulthandler_stacks import register_stack_dump; register_stack_dump(); "
            "import time; time.sleep(600)")
    children = [subprocess.Popen([sys.executable, "-c", code], start_new_session=True) for _ in range(2)]
    for child in children:
        procs.adopt(child)  # type: ignore[arg-type]
    identities = [capture_identity(2 + index, child.pid) for index, child in enumerate(children)]
    session = Session(SID, "hostB", identities[0], tuple(identities), None, seq_in=0)
    yield session, identities


def _snap(session: Session, identities: list[ProcessIdentity]) -> dict[str, Any]:
    """A reply's fields from a real snapshot, once both sleepers have registered their dumps."""
    taken: list[Any] = []

    def snapshot() -> bool:
        diagnosis = diagnose(identities, stacks=True, window_s=0.0, cpu_window_s=0.05, stacks_timeout_s=2.0,
                             stacks_source="faulthandler")
        taken[:] = [diagnosis]
        return all(r.stacks is not None and r.stacks.status is StackStatus.TAKEN for r in diagnosis.ranks)

    assert wait_until(snapshot, 10), taken
    return {"req": 7, "el": 12.5, "ranks": encode_ranks(taken[0].ranks, {2: 10, 3: 9})}


def test_a_reply_round_trips_into_typed_records(ranks: tuple[Session, list[ProcessIdentity]]) -> None:
    session, identities = ranks
    fields = _snap(session, identities)
    req, host = parse_snapshot(session, _message("snap", **fields))
    assert req == 7 and host.host == "hostB" and host.outcome == "answered" and host.agent_rank == 2
    assert [(r.rank, r.pid, r.host) for r in host.ranks] == [(i.rank, i.pid, "hostB") for i in identities]
    assert host.iterations == ((2, 10), (3, 9)) and host.truncated == ()
    for rank in host.ranks:
        assert rank.verdict is not None and rank.threads and rank.activity is not Activity.UNKNOWN
        assert rank.stacks is not None and rank.stacks.status is StackStatus.TAKEN, rank.stacks
        assert rank.stacks.source is StackSource.FAULTHANDLER and rank.stuck_in is not None


@pytest.mark.parametrize("mutate, why", [
    (lambda f: f.update(req=-1), "req"),
    (lambda f: f.update(req=True), "req"),
    (lambda f: f.update(ranks="x"), "ranks"),
    (lambda f: f["ranks"].append(copy.deepcopy(f["ranks"][0])), "ranks"),  # more ranks than the host has
    (lambda f: f["ranks"][0].update(rank=99), "not one of"),
    (lambda f: f["ranks"][0].update(pid=f["ranks"][0]["pid"] + 1), "pid"),
    (lambda f: f["ranks"][0].update(verdict="zombie-ish"), "verdict"),
    (lambda f: f["ranks"][0].update(activity=7), "activity"),
    (lambda f: f["ranks"][0].update(detail="x" * 5000), "detail"),
    (lambda f: f["ranks"][0].update(cut="yes"), "cut"),
    (lambda f: f["ranks"][0].update(it=-3), "it"),
    (lambda f: f["ranks"][0].update(it="3"), "iterations"),
    (lambda f: f["ranks"][0].update(colour="red"), "colour"),  # a field the record does not have
    (lambda f: f["ranks"][0]["threads"].append({**f["ranks"][0]["threads"][0], "tid": None}), "tid"),
    (lambda f: f["ranks"][0]["threads"][0].pop("wchan"), "wchan"),
    (lambda f: f["ranks"][0]["threads"].extend([f["ranks"][0]["threads"][0]] * 300), "threads"),
    (lambda f: f["ranks"][0]["threads"][0].update(tid=-1), "tid"),
    (lambda f: f["ranks"][0]["threads"][0].update(cpu_fraction=float("nan")), "cpu_fraction"),
    (lambda f: f["ranks"][0]["stacks"].update(status="fine"), "status"),
    (lambda f: f["ranks"][0]["stacks"].update(source="gdb"), "source"),
    (lambda f: f["ranks"][0]["stacks"]["threads"][0]["frames"].append({"function": "f", "file": "x.py",
                                                                      "line": "one"}), "line"),
    (lambda f: f["ranks"][0]["stacks"]["threads"][0].update(frames=[{"function": "f", "file": "x.py", "line": 1}]
                                                             * 257), "frames"),
    (lambda f: f["ranks"][0].update(stacks=[1, 2]), "RankStacks"),
])
def test_a_malformed_reply_is_a_wire_error(ranks: tuple[Session, list[ProcessIdentity]], mutate: Any,
                                           why: str) -> None:
    session, identities = ranks
    fields = _snap(session, identities)
    mutate(fields)
    with pytest.raises(_wire.WireError, match=why):
        parse_snapshot(session, _message("snap", **fields))


def test_an_oversized_reply_never_reaches_the_parser() -> None:
    frame = _wire.MAGIC + b"\0" * 32 + json.dumps({"ranks": ["x" * _wire.MAX_MESSAGE_BYTES]}).encode()
    with pytest.raises(_wire.WireError, match="oversized"):
        _wire.decode(SECRET, _wire.TO_HUB, frame)
    with pytest.raises(ValueError, match="exceeds"):
        _wire.encode(SECRET, _wire.TO_HUB, "snap", SID, 1, ranks=["x" * _wire.MAX_MESSAGE_BYTES])


def test_huge_stacks_are_cut_to_fit_the_wire_and_the_record_says_so() -> None:
    frames = tuple(StackFrame(f"function_{n}" + "x" * 60, f"/deep/path/{n}/" + "m" * 100 + ".py", n)
                   for n in range(200))
    threads = tuple(ThreadStack(1000 + n, f"thread-{n}", False, False, frames) for n in range(40))
    states = tuple(ThreadDiagnosis(1000 + n, f"thread-{n}", "S", Activity.SLEEPING, 0.0, "futex_wait", 0.0, False)
                   for n in range(200))
    identities = [ProcessIdentity(rank, 1000 + rank * 1000, 1, "hostB", None) for rank in range(4)]
    stacks = RankStacks(StackStatus.TAKEN, "", 5.0, StackSource.PY_SPY, threads=threads)
    big = [RankDiagnosis(i.rank, i.pid, Verdict.OK, "", Activity.SLEEPING, states, stacks) for i in identities]
    records = encode_ranks(big, {})
    frame = _wire.encode(SECRET, _wire.TO_HUB, "snap", SID, 1, req=1, el=1.0, ranks=records)
    assert len(frame) <= _wire.MAX_MESSAGE_BYTES
    session = Session(SID, "hostB", identities[0], tuple(identities), None, seq_in=0)
    _req, host = parse_snapshot(session, _wire.decode(SECRET, _wire.TO_HUB, frame))
    assert host.truncated == (0, 1, 2, 3)
    for rank in host.ranks:
        assert rank.stacks is not None and "cut to fit" in rank.stacks.detail
        assert rank.stacks.threads and rank.stacks.source is StackSource.PY_SPY


def test_a_frame_with_a_long_path_keeps_its_file_name_on_the_wire() -> None:
    """Strings are cut to the wire's bound; a frame's file keeps its end, the base name its stack
    line shows."""
    path = "/very/deep/" + "d" * 400 + "/nccl_wait.py"
    stacks = RankStacks(StackStatus.TAKEN, "", 5.0, StackSource.PY_SPY,
                        threads=(ThreadStack(1000, "main", True, False, (StackFrame("all_reduce_wait", path, 42),)),))
    identity = ProcessIdentity(2, 1000, 1, "hostB", None)
    rank = RankDiagnosis(2, 1000, Verdict.OK, "", Activity.SLEEPING, (), stacks)
    frame = _wire.encode(SECRET, _wire.TO_HUB, "snap", SID, 1, req=1, el=1.0, ranks=encode_ranks([rank], {}))
    session = Session(SID, "hostB", identity, (identity,), None, seq_in=0)
    _req, host = parse_snapshot(session, _wire.decode(SECRET, _wire.TO_HUB, frame))
    got = host.ranks[0].stacks
    assert got is not None and got.threads[0].frames[0].describe() == "all_reduce_wait (nccl_wait.py:42)", got


def test_a_snapshot_request_is_checked() -> None:
    good = {"req": 3, "cpu": 0.1, "stacks": True, "st": 0.3}
    request = parse_snapshot_request(_message("snapreq", **good))
    assert (request.req, request.cpu_window_s, request.stacks, request.stacks_timeout_s) == (3, 0.1, True, 0.3)
    for bad in ({"cpu": 60}, {"st": -1}, {"stacks": 1}, {"req": 0}, {"req": "3"}):
        with pytest.raises(_wire.WireError):
            parse_snapshot_request(_message("snapreq", **{**good, **bad}))


def test_an_iteration_batch_is_checked() -> None:
    identities = [ProcessIdentity(rank, 1000 + rank, 1, "hostB", None) for rank in (2, 3)]
    session = Session(SID, "hostB", identities[0], tuple(identities), None, seq_in=0)
    assert parse_iterations(session, _message("iters", it=[[2, 10, 0.5], [3, 9, 0]])) == [(2, 10, 0.5), (3, 9, 0.0)]
    for bad in ([[4, 1, 0]], [[2, 1, 0], [2, 2, 0]], [[2, -1, 0]], [[2, 1, -0.1]], [[2, 1, float("nan")]],
                [[2, True, 0]], [[2, 1]], [[2, 1, 0, 9]], "x", [[2, 1, 0]] * 3, [[2, 1 << 63, 0]]):
        with pytest.raises(_wire.WireError):
            parse_iterations(session, _message("iters", it=bad))


def test_merging_names_a_remote_rank_behind_in_iterations_with_its_host() -> None:
    local = diagnose([], stacks=False, window_s=0.0, cpu_window_s=0.0)
    remote = [RankDiagnosis(rank, 5000 + rank, Verdict.OK, "", Activity.SLEEPING, (), None, None, "hostB")
              for rank in (2, 3)]
    merged = merge_hosts(local, [HostSnapshot("hostB", 2, "answered", tuple(remote), ((2, 10), (3, 9)))],
                         {2: 10, 3: 10})
    assert [(r.rank, r.host) for r in merged.ranks] == [(2, "hostB"), (3, "hostB")]
    assert merged.named is not None and merged.named.rank == 3 and merged.named.pid == 5003
    assert merged.hosts and "hostB" in merged.hosts[0] and "on host hostB" in merged.summary()


@pytest.mark.parametrize(("stall_timeout_s", "expected_s"), [(0.0, 15.0), (120.0, 15.0), (16.0, 2.0), (4.0, 1.0)])
def test_agents_forward_iterations_once_per_an_eighth_of_the_stall_timeout_and_carry_it_in_the_spec(
        stall_timeout_s: float, expected_s: float) -> None:
    from trtllm_liveness import LivenessConfig
    from trtllm_liveness.integrations.trtllm._hosts import iterations_interval_s
    from trtllm_liveness.monitor._monitor import WorkerProcessMonitor
    from trtllm_liveness.multihost import AgentHub
    every = iterations_interval_s(LivenessConfig(enabled=True, stall_timeout_s=stall_timeout_s))
    assert every == expected_s
    hub = AgentHub(WorkerProcessMonitor(), bind="127.0.0.1", iterations_interval_s=every)
    hub.endpoint = "tcp://127.0.0.1:1"  # as start() sets it; nothing is bound
    try:
        assert hub.agent_settings().iterations_interval_s == expected_s
    finally:
        hub.close()
    # A value out of range: the one-second floor.
    hub = AgentHub(WorkerProcessMonitor(), bind="127.0.0.1", iterations_interval_s=0.001)
    try:
        assert hub.agent_settings().iterations_interval_s == 1.0
    finally:
        hub.close()
