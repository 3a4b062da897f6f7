"""Process identity capture and the untrusted-payload parser (real processes + hypothesis)."""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.process_tracker import ProcessTracker
from trtllm_liveness.process import (
    InvalidIdentityError,
    ProcessGone,
    ProcessIdentity,
    capture_identity,
    parse_identities,
)
from trtllm_liveness.process._identity import MAX_HOSTNAME_LEN, coerce_identity, local_hostname, local_pid_namespace

pytestmark = [pytest.mark.timeout(120)]

HOST = local_hostname()
NS = local_pid_namespace()
OWN = os.getpid()


def _valid(rank: int, pid: int = 4242) -> tuple[int, int, int, str, int]:
    return (rank, pid, 123456, HOST, NS)


def test_capture_identity_of_self_and_child(procs: ProcessTracker) -> None:
    me = capture_identity(3)
    assert me.rank == 3 and me.pid == OWN and me.hostname == HOST and me.pid_namespace == NS
    assert me.start_time > 0
    child = procs.sleeper()
    ident = capture_identity(0, child.pid)
    assert ident.pid == child.pid
    assert ident.start_time >= me.start_time
    assert ident.pid_namespace == os.stat(f"/proc/{child.pid}/ns/pid").st_ino
    assert ProcessIdentity(*tuple(ident)) == ident  # upstream WorkerProcessIdentity converts field for field
    assert "rank 0" in ident.describe()


def test_capture_identity_of_gone_process_raises(procs: ProcessTracker) -> None:
    child = procs.sleeper()
    child.kill()
    child.wait(10)
    with pytest.raises(ProcessGone) as info:
        capture_identity(0, child.pid)
    assert info.value.pid == child.pid


def test_parse_accepts_tuples_dicts_and_identities_sorted_by_rank() -> None:
    payload: list[Any] = [
        _valid(2, 5002),
        dict(zip(ProcessIdentity._fields, _valid(0, 5000), strict=True)),
        ProcessIdentity(*_valid(1, 5001)),
        list(_valid(3, 5003)),
    ]
    parsed = parse_identities(payload)
    assert [p.rank for p in parsed] == [0, 1, 2, 3]
    assert [p.pid for p in parsed] == [5000, 5001, 5002, 5003]
    assert all(type(p) is ProcessIdentity for p in parsed)
    assert parse_identities(tuple(payload)) == parsed


@pytest.mark.parametrize(
    ("payload", "fragment"),
    [
        ("not a list", "list or tuple"),
        (b"bytes", "list or tuple"),
        ({"0": 1}, "list or tuple"),
        ([(True, 4242, 1, HOST, NS)], "rank must be an int"),
        ([(0, True, 1, HOST, NS)], "pid must be an int"),
        ([(0, 4242, False, HOST, NS)], "start_time must be an int"),
        ([(0, 4242, 1, HOST, True)], "pid_namespace must be an int"),
        ([(0, 0, 1, HOST, NS)], "pid=0"),
        ([(0, -5, 1, HOST, NS)], "pid=-5"),
        ([(0, 1, 1, HOST, NS)], "pid 1"),
        ([(0, OWN, 1, HOST, NS)], "monitoring process itself"),
        ([(-1, 4242, 1, HOST, NS)], "rank=-1"),
        ([(0, 4242, -1, HOST, NS)], "start_time=-1"),
        ([(0, 4242, 1, HOST, 0)], "pid_namespace=0"),
        ([(0, 4242, 1, "", NS)], "hostname"),
        ([(0, 4242, 1, "h" * (MAX_HOSTNAME_LEN + 1), NS)], "hostname"),
        ([(0, 4242, 1, "bad\nhost", NS)], "unprintable"),
        ([(0, 4242, 1, 7, NS)], "hostname"),
        ([(0, 4242, 1, HOST)], "expected 5 fields"),
        ([(0, 4242, 1, HOST, NS, 9)], "expected 5 fields"),
        ([None], "expected a 5-field tuple"),
        ([{"rank": 0}], "missing field"),
        ([(0, "4242", 1, HOST, NS)], "pid must be an int"),
        ([(0, 4242.0, 1, HOST, NS)], "pid must be an int"),
        ([(0, 1 << 40, 1, HOST, NS)], "pid="),
        ([_valid(0, 4242), _valid(0, 4243)], "duplicate rank 0"),
    ],
)
def test_parse_rejects_bad_payloads_naming_the_element(payload: Any, fragment: str) -> None:
    with pytest.raises(InvalidIdentityError, match="identit") as info:
        parse_identities(payload)
    assert fragment in str(info.value)
    assert isinstance(info.value, ValueError)


def test_parse_names_the_index_of_the_bad_element() -> None:
    with pytest.raises(InvalidIdentityError, match="identity #2"):
        parse_identities([_valid(0, 5000), _valid(1, 5001), (2, 1, 1, HOST, NS)])


def test_parse_rejects_huge_payloads_before_parsing_them() -> None:
    with pytest.raises(InvalidIdentityError, match="more than the limit"):
        parse_identities([_valid(0)] * 100_000)
    with pytest.raises(InvalidIdentityError, match="more than the limit"):
        parse_identities([_valid(i, 5000 + i) for i in range(9)], max_count=8)


def test_parse_own_pid_override_and_int_subclasses_are_normalised() -> None:
    import enum

    class Rank(enum.IntEnum):
        LEADER = 0

    parsed = parse_identities([(Rank.LEADER, OWN, 1, HOST, NS)], own_pid=99)
    assert parsed[0].rank == 0 and type(parsed[0].rank) is int


def test_coerce_identity_allows_pid_1_for_other_namespaces() -> None:
    ident = coerce_identity((0, 1, 5, "container-host", 4026532000))
    assert ident.pid == 1
    with pytest.raises(InvalidIdentityError):
        coerce_identity((0, True, 5, HOST, NS))


# ------------------------------------------------------------------ hypothesis

_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=8),
    st.binary(max_size=8),
)
_junk = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6), st.tuples(inner, inner), st.tuples(inner, inner, inner, inner, inner),
        st.dictionaries(st.sampled_from([*ProcessIdentity._fields, "x"]), inner, max_size=6),
    ),
    max_leaves=30,
)
_near_valid_field = st.one_of(
    st.integers(min_value=-3, max_value=(1 << 64) + 3), st.booleans(), st.text(max_size=300), st.none(),
    st.just(HOST), st.just(OWN), st.just(1), st.just(0),
)
_near_valid = st.lists(
    st.one_of(st.tuples(*[_near_valid_field] * 5), st.lists(_near_valid_field, min_size=4, max_size=6)),
    max_size=6,
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(_junk, _near_valid))
def test_fuzz_parser_raises_only_invalid_identity_error(payload: Any) -> None:
    try:
        result = parse_identities(payload)
    except InvalidIdentityError:
        return
    # Whatever got through is well-formed.
    assert all(type(i) is ProcessIdentity for i in result)
    assert len({i.rank for i in result}) == len(result)
    for ident in result:
        assert not isinstance(ident.pid, bool) and 2 <= ident.pid and ident.pid != OWN
        assert type(ident.rank) is int and type(ident.start_time) is int and type(ident.pid_namespace) is int
        assert isinstance(ident.hostname, str) and ident.hostname


_valid_identity = st.builds(
    ProcessIdentity,
    rank=st.integers(min_value=0, max_value=1 << 24),
    pid=st.integers(min_value=2, max_value=(1 << 22) - 1).filter(lambda p: p != OWN),
    start_time=st.integers(min_value=0, max_value=1 << 62),
    hostname=st.text(st.characters(min_codepoint=33, max_codepoint=0x2FFF), min_size=1, max_size=MAX_HOSTNAME_LEN)
    .filter(str.isprintable),
    pid_namespace=st.integers(min_value=1, max_value=(1 << 64) - 1),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_valid_identity, max_size=20, unique_by=lambda i: i.rank), st.sampled_from(["tuple", "list", "dict"]))
def test_fuzz_parser_accepts_every_valid_identity(identities: list[ProcessIdentity], form: str) -> None:
    if form == "tuple":
        payload: list[Any] = [tuple(i) for i in identities]
    elif form == "list":
        payload = [list(i) for i in identities]
    else:
        payload = [i._asdict() for i in identities]
    assert parse_identities(payload) == sorted(identities, key=lambda i: i.rank)
