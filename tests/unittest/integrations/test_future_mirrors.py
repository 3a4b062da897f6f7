"""The extension fails mirrors of mpi4py's worker futures, never mpi4py's own.

mpi4py's manager thread calls ``set_result`` on a worker's future when its task returns; if
anybody else finished that future first, the call raises ``InvalidStateError`` and kills the
manager thread. The mixin therefore stores mirrors in ``mpi_futures`` (what upstream reads) and
fails those. Unit tests on plain futures, then the real sequence on MPI: a frozen rank makes the
extension fail the futures while the healthy leader still returns its task.
"""

from __future__ import annotations

from concurrent.futures import CancelledError, Future
from typing import Any

import pytest

from tests.support.cgroups import remove_leftover_groups
from tests.support.children import HelperProcess
from tests.support.facilities import needs
from tests.support.waits import WAIT_SCALE
from trtllm_liveness import LivenessConfig
from trtllm_liveness.integrations._futures import fail_pending, mirror_future
from trtllm_liveness.integrations.trtllm import liveness_proxy_class
from trtllm_liveness.integrations.trtllm._engine_shutdown import release


def test_mirror_follows_the_real_future() -> None:
    real: Future[Any] = Future()
    mirror = mirror_future(real)
    assert not mirror.done()
    real.set_result("token")
    assert mirror.result(timeout=0) == "token"

    real_failed: Future[Any] = Future()
    mirror_failed = mirror_future(real_failed)
    real_failed.set_exception(ValueError("boom"))
    assert isinstance(mirror_failed.exception(timeout=0), ValueError)


def test_failing_the_mirror_leaves_the_real_future_to_its_owner() -> None:
    real: Future[Any] = Future()
    mirror = mirror_future(real)
    mirror.set_exception(RuntimeError("world is dead"))
    real.set_result("late result")  # what mpi4py's manager thread does; must not raise
    assert real.result(timeout=0) == "late result"
    assert isinstance(mirror.exception(timeout=0), RuntimeError)


def test_cancelling_the_mirror_cancels_the_real_future() -> None:
    real: Future[Any] = Future()
    mirror = mirror_future(real)
    assert mirror.cancel()
    assert real.cancelled()
    with pytest.raises(CancelledError):
        mirror.result(timeout=0)


def test_fail_pending_skips_done_futures_and_other_values() -> None:
    done: Future[Any] = Future()
    done.set_result(1)
    pending: Future[Any] = Future()
    fail_pending([done, pending, "not a future"], RuntimeError("dead"))
    assert done.result(timeout=0) == 1
    assert isinstance(pending.exception(timeout=0), RuntimeError)


def test_proxy_stores_mirrors_only_with_liveness_on() -> None:
    class Upstream:
        def __init__(self, worker_kwargs: Any, *args: Any, **kwargs: Any) -> None:
            self.mpi_futures: list[Future[Any]] = []

    real: Future[Any] = Future()
    off = liveness_proxy_class(Upstream)({"llm_args": None})
    off.mpi_futures = [real]
    assert off.mpi_futures[0] is real

    on = liveness_proxy_class(Upstream, config=LivenessConfig(enabled=True))({"llm_args": None})
    try:
        on.mpi_futures = [real]
        assert on.mpi_futures[0] is not real
        real.set_result(7)
        assert on.mpi_futures[0].result(timeout=0) == 7
    finally:
        release(on.liveness_state)


GROUP_PREFIX = "trtllm-liveness-test-frozen-rank"


@pytest.mark.timeout(180)
@pytest.mark.mpi
@pytest.mark.real_process
@pytest.mark.freezer
@needs("mpi", "freezer")
@pytest.mark.parametrize("mode", ["1.2", "main"])
def test_leader_returning_after_the_fatal_error_does_not_kill_mpi4pys_manager(mode: str) -> None:
    helper = HelperProcess("frozen_rank_fatal", {"mode": mode})
    try:
        with helper:
            record = helper.read_record(90 * WAIT_SCALE, "thread_exceptions")
            stderr = helper.stderr_tail(20000)
    finally:
        remove_leftover_groups(GROUP_PREFIX)  # the helper removes its group; this is for a crash
        # A rank still frozen when the helper was ended kept its TMPDIR: thawed now, so it can go.
        helper.remove_tmpdir()
    assert record["fatal"] is not None and "uninterruptible" in record["fatal"]
    assert record["leader_returned"] is True, stderr
    assert record["thread_exceptions"] == [], stderr
