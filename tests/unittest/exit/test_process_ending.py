"""ProcessEnding: one owner of the process's ending, each cleanup once and in order, whoever ends it.

In-process: each test has a ProcessEnding of its own (the autouse ``fresh_process_ending``
fixture), and the guards end "the process" through an ``exit_fn`` that records the status.
"""

from __future__ import annotations

import functools
import threading

import pytest

from tests.support.waits import WAIT_SCALE, wait_until
from trtllm_liveness.exit._exit_guard import FatalExitGuard, add_exit_cleanup
from trtllm_liveness.exit._process_ending import OwnedThreads, ProcessEnding, Stage

pytestmark = pytest.mark.timeout(60)

ENDERS = 6


def watchdogs_running() -> bool:
    return any(thread.name == "trtllm-liveness-exit-watchdog" and thread.is_alive()
               for thread in threading.enumerate())


def test_several_threads_ending_the_process_at_once_run_each_cleanup_once_in_order() -> None:
    # Six engines' guards fail at the same moment, each with a watchdog that expires at once: six
    # threads end the process concurrently. The cleanups run once each, in registration order,
    # and the process is ended once.
    lock = threading.Lock()
    ran: list[str] = []

    def cleanup(name: str) -> None:
        with lock:
            ran.append(name)

    for n in range(3):
        add_exit_cleanup(functools.partial(cleanup, f"cleanup {n}"))
    ended: list[int] = []
    guards = [FatalExitGuard(graceful=lambda: None, timeout_s=0, exit_code=3, exit_fn=ended.append)
              for _ in range(ENDERS)]
    start = threading.Barrier(ENDERS, timeout=10 * WAIT_SCALE)

    def fail(guard: FatalExitGuard, n: int) -> None:
        start.wait()
        guard.trigger(f"rank {n} died")

    threads = [threading.Thread(target=fail, args=(guard, n), name=f"failing-engine-{n}")
               for n, guard in enumerate(guards)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10 * WAIT_SCALE)
    assert wait_until(lambda: ended and not watchdogs_running(), 20), "no watchdog ended the process"
    assert ran == ["cleanup 0", "cleanup 1", "cleanup 2"]
    assert ended == [3]


def test_the_stages_run_in_order_and_the_status_is_decided_after_the_stop(
        fresh_process_ending: ProcessEnding) -> None:
    ending = fresh_process_ending
    order: list[str] = []
    released = threading.Event()
    awaited: list[bool] = []
    guard = FatalExitGuard(graceful=lambda: None, timeout_s=None, exit_code=3, exit_code_unrestartable=69,
                           exit_fn=lambda status: awaited.append(released.is_set()) or order.append(f"exit {status}"))

    def stop() -> None:
        # What an engine's stop does when it leaves a rank unkillable: the status becomes the
        # unrestartable one, and the quarantine starts a thread the ending must wait for.
        order.append("stop")
        guard.mark_unrestartable()
        ending.threads.start(lambda: released.wait(0.3) or released.set(), name="slow-quarantine",
                             bound_s=10 * WAIT_SCALE)

    add_exit_cleanup(functools.partial(order.append, "cleanup"))
    ending.add_cleanup(stop, Stage.STOP)
    ending.add_cleanup(stop, Stage.STOP)  # the same cleanup twice: once
    ending.add_cleanup(functools.partial(order.append, "normal exit"), Stage.NORMAL_EXIT)
    guard.trigger("rank 1 died")
    start = threading.Barrier(ENDERS, timeout=10 * WAIT_SCALE)

    def end(n: int) -> None:
        start.wait()
        if n % 2:
            ending.at_exit()  # the interpreter's exit, racing the watchdogs
        else:
            ending.end(guard)

    threads = [threading.Thread(target=end, args=(n,), name=f"ender-{n}") for n in range(ENDERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20 * WAIT_SCALE)
    assert not any(thread.is_alive() for thread in threads)
    assert order == ["stop", "cleanup", "exit 69"]  # no "normal exit": a guard decided
    assert awaited == [True], "the process ended before the thread its stop started"


def test_a_clean_interpreter_exit_runs_the_normal_exit_cleanups_and_awaits_the_threads(
        fresh_process_ending: ProcessEnding) -> None:
    ending = fresh_process_ending
    order: list[str] = []
    ending.add_cleanup(functools.partial(order.append, "stop"), Stage.STOP)
    ending.add_cleanup(functools.partial(order.append, "normal exit"), Stage.NORMAL_EXIT)
    finished = threading.Event()
    ending.threads.start(lambda: finished.wait(0.2) or finished.set(), name="marker-write", bound_s=10 * WAIT_SCALE)
    ending.at_exit()
    assert order == ["normal exit"]
    assert finished.is_set()


def test_owned_threads_are_joined_until_their_deadline_and_a_late_one_is_named() -> None:
    threads = OwnedThreads()
    release = threading.Event()
    quick = threads.start(lambda: None, name="quick", bound_s=10 * WAIT_SCALE)
    stuck = threads.start(release.wait, name="stuck", bound_s=0.05, args=(30,))
    assert quick is not None and stuck is not None
    try:
        assert threads.join() == ["stuck"]  # past its deadline: left, named, not waited for further
        assert not quick.is_alive()
    finally:
        release.set()
        stuck.join(10)
    assert threads.join() == []


@pytest.mark.parametrize("raised", [KeyboardInterrupt, SystemExit])
def test_a_cleanup_interrupted_still_ends_the_process_with_the_fatal_status(
        fresh_process_ending: ProcessEnding, raised: type[BaseException]) -> None:
    # A second Ctrl-C (or a SystemExit) inside a cleanup of the ending must not cost the exit
    # status: the process still ends through exit_fn with the guard's status, the later cleanups
    # still run, and a second ender does not take the ending for finished without an exit.
    ending = fresh_process_ending
    ran: list[str] = []

    def interrupted() -> None:
        ran.append("interrupted")
        raise raised

    ended: list[int] = []
    guard = FatalExitGuard(graceful=lambda: None, timeout_s=None, exit_code=3, exit_fn=ended.append)
    ending.add_cleanup(interrupted, Stage.STOP)
    ending.add_cleanup(functools.partial(ran.append, "later"), Stage.CLEANUP)
    guard.trigger("rank 1 died")
    ending.end(guard)
    ending.end(guard)
    assert ran == ["interrupted", "later"]
    assert ended == [3]
