"""The rank a stall is named after (trtllm_liveness.diagnose._stalled_rank), on real processes: a
SIGSTOPped rank, a rank in D (freezer and FUSE), a gone rank, a spinning rank among sleepers, and
executor iteration counts. Precedence: gone, stopped or in D; then behind in iterations; then
spinning while the others sleep; never the leader by default, and never the leader for spinning."""

from __future__ import annotations

import subprocess

import pytest

from tests.support.process_tracker import ProcessTracker
from tests.support.rank_children import blocked, spinning, stop
from tests.support.stuck_processes import StuckChild
from trtllm_liveness.diagnose._diagnosis import diagnose, stalled_rank_of
from trtllm_liveness.diagnose._stalled_rank import NamingBasis, StalledRank, name_stalled_rank, stalled_rank_now
from trtllm_liveness.process._identity import ProcessIdentity, capture_identity

pytestmark = [pytest.mark.timeout(120), pytest.mark.real_process]

def _identities(procs: list[subprocess.Popen[bytes]]) -> list[ProcessIdentity]:
    return [capture_identity(rank, proc.pid) for rank, proc in enumerate(procs)]


def _named(procs: list[subprocess.Popen[bytes]], iterations: dict[int, int] | None = None) -> StalledRank | None:
    return stalled_rank_of(_identities(procs), iterations=iterations)


def test_a_stopped_rank_is_named_even_beside_a_spinning_leader(procs: ProcessTracker) -> None:
    ranks = [spinning(procs), blocked(procs), blocked(procs), blocked(procs)]
    stop(ranks[1])
    diagnosis = diagnose(_identities(ranks), stacks=False, window_s=0.0)
    named = diagnosis.named
    assert named is not None and (named.rank, named.basis) == (1, NamingBasis.STOPPED), diagnosis.summary()
    assert named.pid == ranks[1].pid and "rank 1 is stopped (T)" in named.evidence
    assert diagnosis.to_dict()["named"] == named.to_dict()
    # The odd-rank finder does not single out the busy-polling leader either.
    assert all(odd.rank != 0 for odd in diagnosis.odd_ranks), diagnosis.odd_ranks


def test_stopped_outranks_behind_in_iterations(procs: ProcessTracker) -> None:
    ranks = [blocked(procs) for _ in range(3)]
    stop(ranks[2])
    named = _named(ranks, iterations={0: 40, 1: 39, 2: 40})
    assert named is not None and (named.rank, named.basis) == (2, NamingBasis.STOPPED), named


def test_the_rank_behind_in_iterations_is_named_over_a_spinning_one(procs: ProcessTracker) -> None:
    ranks = [blocked(procs), blocked(procs), blocked(procs), spinning(procs)]
    named = _named(ranks, iterations={0: 12, 1: 12, 2: 11, 3: 12})
    assert named is not None and (named.rank, named.basis) == (2, NamingBasis.BEHIND), named
    assert named.evidence == "rank 2 at 11 executor iteration(s), ranks 0, 1, 3 at 12"


def test_without_iterations_the_rank_spinning_among_sleepers_is_named(procs: ProcessTracker) -> None:
    ranks = [blocked(procs), blocked(procs), spinning(procs), blocked(procs)]
    named = _named(ranks)
    assert named is not None and (named.rank, named.basis) == (2, NamingBasis.SPINNING), named
    assert named.evidence == "rank 2 spins while ranks 1, 3 sleep"


def test_a_spinning_leader_among_sleepers_is_never_named(procs: ProcessTracker) -> None:
    ranks = [spinning(procs), blocked(procs), blocked(procs)]
    diagnosis = diagnose(_identities(ranks), stacks=False, window_s=0.0)
    assert [rank.activity.value for rank in diagnosis.ranks] == ["spinning", "sleeping", "sleeping"]
    assert diagnosis.named is None
    assert [odd for odd in diagnosis.odd_ranks if odd.aspect == "activity"] == [], diagnosis.odd_ranks


def test_equal_iterations_and_all_asleep_name_nobody(procs: ProcessTracker) -> None:
    ranks = [blocked(procs) for _ in range(3)]
    assert _named(ranks, iterations={0: 7, 1: 7, 2: 7}) is None
    assert _named(ranks) is None


def test_the_leader_behind_in_iterations_is_named_on_that_evidence(procs: ProcessTracker) -> None:
    ranks = [blocked(procs) for _ in range(3)]
    named = _named(ranks, iterations={0: 5, 1: 6, 2: 6})
    assert named is not None and (named.rank, named.basis) == (0, NamingBasis.BEHIND), named


def test_a_gone_rank_is_named(procs: ProcessTracker) -> None:
    ranks = [blocked(procs) for _ in range(3)]
    identities = _identities(ranks)
    ranks[1].kill()
    ranks[1].wait(10)
    named = stalled_rank_of(identities)
    assert named is not None and (named.rank, named.basis) == (1, NamingBasis.GONE), named


def test_a_rank_in_d_is_named_over_one_behind(procs: ProcessTracker, stuck_child: StuckChild) -> None:
    sleepers = [blocked(procs) for _ in range(2)]
    identities = [*_identities(sleepers), capture_identity(2, stuck_child.popen.pid)]
    named = stalled_rank_of(identities, iterations={0: 9, 1: 8, 2: 9})
    assert named is not None and (named.rank, named.basis) == (2, NamingBasis.IN_D), named
    assert "thread(s) in D" in named.evidence


def test_the_naming_is_a_pure_function_of_the_diagnosis(procs: ProcessTracker) -> None:
    ranks = [blocked(procs) for _ in range(3)]
    stop(ranks[1])
    diagnosis = diagnose(_identities(ranks), stacks=False, window_s=0.0)
    assert name_stalled_rank(diagnosis.ranks) == diagnosis.named
    assert name_stalled_rank(diagnosis.ranks, leader=None) == diagnosis.named  # the leader matters only for spinning
    assert name_stalled_rank(()) is None


def test_the_instant_naming_reads_states_and_iterations_but_never_spinning(procs: ProcessTracker) -> None:
    ranks = [blocked(procs), spinning(procs), blocked(procs)]
    identities = _identities(ranks)
    assert stalled_rank_now(identities) is None  # no CPU window: a spinner is not evidence here
    behind = stalled_rank_now(identities, iterations={0: 3, 1: 3, 2: 2})
    assert behind is not None and (behind.rank, behind.basis) == (2, NamingBasis.BEHIND)
    stop(ranks[1])
    stopped = stalled_rank_now(identities, iterations={0: 3, 1: 3, 2: 2})
    assert stopped is not None and (stopped.rank, stopped.basis) == (1, NamingBasis.STOPPED), stopped
    ranks[0].kill()
    ranks[0].wait(10)
    gone = stalled_rank_now(identities)
    assert gone is not None and (gone.rank, gone.basis) == (0, NamingBasis.GONE), gone


def test_the_instant_naming_sees_a_rank_in_d(procs: ProcessTracker, stuck_child: StuckChild) -> None:
    sleeper = blocked(procs)
    named = stalled_rank_now([capture_identity(0, sleeper.pid), capture_identity(1, stuck_child.popen.pid)])
    assert named is not None and (named.rank, named.basis) == (1, NamingBasis.IN_D), named
