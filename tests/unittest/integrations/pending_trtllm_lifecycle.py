"""Start-up, submit and shutdown of the liveness proxy against upstream-shaped proxies, in process.

The "ranks" are plain child processes of the ``procs`` fixture, registered through
``_worker_process_monitor`` as upstream main does (``tests/helpers/upstream_shaped.py``); D state
is real (cgroup v1 freezer).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from tests.helpers.upstream_shaped import UpstreamMainShaped
from trtllm_liveness import LivenessConfig
from trtllm_liveness.integrations import trtllm as integ
from trtllm_liveness.integrations.trtllm import _fatal
from trtllm_liveness.integrations.trtllm._state import EngineLiveness

from ...conftest import Freezer, ProcessTracker, needs, wait_until

pytestmark = [pytest.mark.timeout(60), needs("mpi")]

FAST = {"enabled": True, "scan_interval_s": 0.05, "shutdown_grace_s": 0.5, "shutdown_term_s": 0.5,
        "shutdown_kill_s": 1.0}


@pytest.fixture(autouse=True)
def _counters() -> Iterator[None]:
    UpstreamMainShaped.pre_shutdown_entries = 0
    UpstreamMainShaped.overlapping_sends = 0
    yield


def build(procs: ProcessTracker, *, workers: int = 2, during_startup: Any = None, **options: Any) -> Any:
    cls = integ.liveness_proxy_class(UpstreamMainShaped, config=LivenessConfig(**{**FAST, **options}))
    kwargs = {"workers": [procs.sleeper() for _ in range(workers)], "atexit": False,
              "during_startup": during_startup, "llm_args": None}
    return cls(kwargs, model_world_size=workers)


# ----------------------------------------------------------------------------- wedge timer at READY


@pytest.mark.freezer
def test_d_state_during_startup_is_no_wedge_and_the_timer_starts_at_ready(procs: ProcessTracker,
                                                                          freezer: Freezer) -> None:
    """Issue 10 point 11: a slow cold-mount weight load (D state during the model build) must not
    be called a wedge; after READY the same D state is one."""
    def slow_load(proxy: Any) -> None:
        assert freezer.freeze([proxy.workers[1].pid])
        # In D for well over d_state_timeout_s (several scan ticks) before READY.
        threading.Event().wait(8 * 0.2)
        freezer.thaw()

    proxy = build(procs, during_startup=slow_load, d_state_timeout_s=0.2)
    try:
        assert proxy.liveness_fatal_error is None
        assert proxy.liveness_monitor.wedge_armed
        assert freezer.freeze([proxy.workers[0].pid])
        assert wait_until(lambda: proxy.liveness_fatal_error is not None, 15)
        assert "uninterruptible" in str(proxy.liveness_fatal_error) and "rank 0" in str(proxy.liveness_fatal_error)
    finally:
        freezer.thaw()
        proxy.shutdown()


@pytest.mark.freezer
def test_startup_keeps_its_own_bound(procs: ProcessTracker, freezer: Freezer) -> None:
    seen: list[Any] = []

    def stuck_load(proxy: Any) -> None:
        assert freezer.freeze([proxy.workers[1].pid])
        seen.append(wait_until(lambda: proxy.liveness_fatal_error is not None, 15))
        freezer.thaw()

    proxy = build(procs, during_startup=stuck_load, d_state_timeout_s=30, startup_d_state_timeout_s=0.2)
    try:
        assert seen == [True]
        assert "uninterruptible" in str(proxy.liveness_fatal_error)
    finally:
        proxy.shutdown()


# ----------------------------------------------------------------------------- pre_shutdown, as upstream sees it


def test_fatal_path_enters_upstreams_pre_shutdown_once_and_shutdown_adds_none(procs: ProcessTracker) -> None:
    """Counted at upstream's own entry (before its once-flag), not at the extension's."""
    proxy = build(procs)
    proxy.workers[1].kill()
    assert wait_until(lambda: proxy.liveness_fatal_error is not None, 10)
    assert wait_until(lambda: proxy.liveness_state.fatal_done.is_set(), 10)
    assert UpstreamMainShaped.pre_shutdown_entries == 1
    assert proxy.doing_shutdown and "rank 1" in str(proxy._fatal_error)
    proxy.shutdown()
    proxy.shutdown()
    assert UpstreamMainShaped.pre_shutdown_entries == 1  # upstream's shutdown saw doing_pre_shutdown


def test_clean_shutdown_enters_pre_shutdown_once_and_reports_no_death(procs: ProcessTracker) -> None:
    proxy = build(procs)
    proxy.pre_shutdown()  # upstream's atexit order: pre_shutdown() stops the ranks first
    assert all(w.poll() is not None for w in proxy.workers)
    proxy.shutdown()
    assert UpstreamMainShaped.pre_shutdown_entries == 1
    assert proxy.liveness_fatal_error is None and proxy._fatal_error is None


# ----------------------------------------------------------------------------- submit


def test_fatal_pre_shutdown_never_overlaps_a_send_in_flight(procs: ProcessTracker) -> None:
    """Issue 10 point 5: upstream's request socket has no lock; the extension's pre_shutdown()
    from its helper thread must not send while a caller's submit() is inside a send."""
    proxy = build(procs)
    release = threading.Event()
    in_send = threading.Event()

    def slow_send(upstream: Any) -> None:
        in_send.set()
        release.wait(10)

    caller = threading.Thread(target=proxy.submit, args=(SimpleNamespace(id=None, during_send=slow_send),))
    caller.start()
    try:
        assert in_send.wait(10)
        proxy.workers[0].kill()
        assert wait_until(lambda: proxy.liveness_fatal_error is not None, 10)
        assert wait_until(lambda: proxy.liveness_state.fatal_done.is_set(), 10)
    finally:
        release.set()
        caller.join(10)
    assert UpstreamMainShaped.overlapping_sends == 0
    proxy.shutdown()


def test_request_registered_after_the_fatal_sweep_is_failed(procs: ProcessTracker) -> None:
    """Issue 10 point 9 (1.2.x): a request that passed the fatal check, registered, and then saw
    the sweep of pending results must not stay pending forever."""
    proxy = build(procs)

    def death_during_send(upstream: Any) -> None:
        upstream.workers[1].kill()
        assert wait_until(lambda: not proxy.check_health(), 10)  # the sweep runs now

    result = proxy.submit(SimpleNamespace(id=None, during_send=death_during_send))
    assert wait_until(lambda: not result.queue.empty(), 10)
    assert "rank 1" in str(result.queue.get_nowait())
    proxy.shutdown()


# ----------------------------------------------------------------------------- sessions


class _Session:
    def __init__(self) -> None:
        self.abandoned = 0
        self.mpi_pool = SimpleNamespace(_pool=SimpleNamespace(thread=threading.Thread(target=lambda: None)))

    def abandon(self) -> None:
        self.abandoned += 1


def _release_target(owns: bool) -> tuple[Any, EngineLiveness, Any]:
    session = _Session()
    proxy = SimpleNamespace(mpi_session=session)
    state = EngineLiveness(config=LivenessConfig(enabled=True), owns_session=owns)
    return proxy, state, session


@pytest.mark.parametrize("owns", [True, False])
def test_mpi4py_exit_join_is_released_only_for_an_owned_session(owns: bool) -> None:
    """Issue 10 point 6 (1.2.x): nothing released mpi4py's exit join after a death."""
    core = pytest.importorskip("mpi4py.futures._core")
    proxy, state, session = _release_target(owns)
    thread = session.mpi_pool._pool.thread
    core.THREADS_QUEUES[thread] = object()
    try:
        _fatal.release_exit_joins(proxy, state)
        assert (thread not in core.THREADS_QUEUES) is owns
    finally:
        core.THREADS_QUEUES.pop(thread, None)


class _BlockingShutdown(UpstreamMainShaped):
    release = threading.Event()  # replaced per test

    def shutdown(self) -> None:
        _BlockingShutdown.release.wait(30)  # upstream's unbounded waits on a dead world


@pytest.mark.parametrize("passed_in", [True, False])
def test_a_session_the_proxy_does_not_own_is_never_abandoned(procs: ProcessTracker, passed_in: bool) -> None:
    """Issue 10 point 6 (main): abandon() only for the session the proxy created."""
    _BlockingShutdown.release = threading.Event()
    session = _Session()
    cls = integ.liveness_proxy_class(_BlockingShutdown, config=LivenessConfig(**FAST))
    kwargs = {"workers": [procs.sleeper()], "atexit": False, "llm_args": None}
    proxy = cls(kwargs, 1, session) if passed_in else cls(kwargs, model_world_size=1)
    if not passed_in:
        proxy.mpi_session = session  # created by upstream itself
    try:
        proxy.shutdown()
        assert session.abandoned == (0 if passed_in else 1)
    finally:
        _BlockingShutdown.release.set()


def test_state_is_one_attribute_on_the_upstream_object(procs: ProcessTracker) -> None:
    proxy = build(procs)
    try:
        assert not [name for name in vars(proxy) if name.startswith("_liveness_") or (name.startswith("_liveness")
                    and name != "_liveness")]
        assert isinstance(vars(proxy)["_liveness"], EngineLiveness)
        assert weakref.ref(proxy)() is proxy
    finally:
        proxy.shutdown()
