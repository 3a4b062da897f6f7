"""FatalExitGuard in real interpreters: one graceful shutdown, then a bounded non-zero exit."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from trtllm_liveness.exit._exit_guard import FatalExitGuard

pytestmark = [pytest.mark.real_process, pytest.mark.timeout(60)]


def run_script(body: str) -> subprocess.CompletedProcess[str]:
    code = "import os, signal, sys, threading, time\nfrom trtllm_liveness.exit._exit_guard import FatalExitGuard\n"
    return subprocess.run(
        [sys.executable, "-c", code + textwrap.dedent(body)],
        capture_output=True, text=True, timeout=30, start_new_session=True,
    )


def test_clean_main_exit_after_fatal_event_becomes_status_1() -> None:
    result = run_script(
        """
        calls = []
        guard = FatalExitGuard(graceful=lambda: calls.append(1), timeout_s=20)
        assert guard.trigger("rank 1 died") is True
        assert guard.trigger("again") is False
        time.sleep(0.2)
        print("graceful calls", len(calls), flush=True)
        sys.exit(0)
        """
    )
    assert result.returncode == 1, result.stderr
    assert "graceful calls 1" in result.stdout


def test_hung_graceful_shutdown_is_ended_by_the_watchdog() -> None:
    result = run_script(
        """
        guard = FatalExitGuard(graceful=lambda: time.sleep(3600), timeout_s=0.3, exit_code=7)
        guard.trigger("rank 0 wedged")
        time.sleep(3600)  # the main program hangs too; only the watchdog can end it
        """
    )
    assert result.returncode == 7
    assert "did not finish" in result.stderr


def test_default_graceful_action_is_sigint_once() -> None:
    result = run_script(
        """
        hits = []
        signal.signal(signal.SIGINT, lambda *a: hits.append(1))
        guard = FatalExitGuard(timeout_s=None)
        for _ in range(5):
            guard.trigger("dead")
        deadline = time.monotonic() + 10
        while not hits and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        print("sigints", len(hits), flush=True)
        """
    )
    assert result.returncode == 1
    assert "sigints 1" in result.stdout


def test_exit_code_zero_is_refused() -> None:
    with pytest.raises(ValueError, match="non-zero"):
        FatalExitGuard(exit_code=0)


def test_disarmed_guard_never_acts() -> None:
    ended: list[int] = []
    guard = FatalExitGuard(graceful=lambda: None, timeout_s=0, exit_fn=ended.append)
    guard.disarm()
    assert guard.trigger("dead") is False
    assert guard.triggered is False
    assert ended == []


def test_two_guards_of_one_process_send_one_sigint() -> None:
    """Two engines (each with its guard) in one server start ONE graceful shutdown: a second
    SIGINT would make uvicorn skip its graceful shutdown."""
    result = run_script(
        """
        got = []
        signal.signal(signal.SIGINT, lambda *a: got.append(1))
        first = FatalExitGuard(timeout_s=None)
        second = FatalExitGuard(timeout_s=None)
        assert first.trigger("rank 0 of engine A died") and second.trigger("rank 0 of engine B died")
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # a second SIGINT would be delivered by now
        print("sigints", len(got), flush=True)
        os._exit(0)
        """
    )
    assert "sigints 1" in result.stdout, result.stderr


def test_hooks_registered_after_the_guard_run_once_each_before_the_forced_status() -> None:
    # The forced status must not cost the hooks registered since the guard was built (the
    # executor's shutdown(), registered at the end of its constructor): os._exit alone would skip
    # them. A cleanup that predates the guard is handed to it with add_exit_cleanup.
    result = run_script(
        """
        import atexit
        from trtllm_liveness.exit._exit_guard import add_exit_cleanup
        add_exit_cleanup(lambda: print("cleanup ran", flush=True))
        guard = FatalExitGuard(graceful=lambda: None, timeout_s=20, exit_code=5)
        atexit.register(print, "registered before the trigger", flush=True)
        atexit.register(lambda: 1 / 0)  # a failing hook must not stop the rest nor the status
        guard.trigger("rank 1 died")
        atexit.register(print, "registered after the trigger", flush=True)
        """
    )
    assert result.returncode == 5, result.stderr
    assert result.stdout.splitlines() == ["registered after the trigger", "registered before the trigger",
                                          "cleanup ran"], result.stdout
    assert "ZeroDivisionError" in result.stderr


def test_a_hook_registered_after_threading_shutdown_runs_once() -> None:
    # A non-daemon thread registers a hook after the main program returned (threading's own
    # exit phase joins it): it must run once, not once more from inside the guard's hook.
    result = run_script(
        """
        import atexit
        guard = FatalExitGuard(graceful=lambda: None, timeout_s=20, exit_code=5)
        guard.trigger("rank 1 died")
        def late() -> None:
            time.sleep(0.3)
            atexit.register(print, "late hook", flush=True)
        threading.Thread(target=late).start()
        """
    )
    assert result.returncode == 5, result.stderr
    assert result.stdout.splitlines() == ["late hook"], result.stdout


def test_a_fatal_event_while_atexit_hooks_run_still_sets_the_status() -> None:
    # An engine death while the executor's own atexit shutdown runs: the status must not be 0.
    result = run_script(
        """
        import atexit
        guard = FatalExitGuard(graceful=lambda: None, timeout_s=20, exit_code=6)
        def slow_shutdown() -> None:
            threading.Thread(target=lambda: guard.trigger("rank 0 died during shutdown")).start()
            time.sleep(0.5)
        atexit.register(slow_shutdown)
        """
    )
    assert result.returncode == 6, result.stderr


def test_the_first_guard_triggered_decides_the_status() -> None:
    result = run_script(
        """
        import atexit
        atexit.register(print, "first", flush=True)
        engine = FatalExitGuard(graceful=lambda: None, timeout_s=20, exit_code=3)
        bridge = FatalExitGuard(graceful=lambda: None, timeout_s=20, exit_code=1)
        atexit.register(print, "second", flush=True)
        engine.trigger("a")
        bridge.trigger("b")
        atexit.register(print, "third", flush=True)
        """
    )
    assert result.returncode == 3, result.stderr  # exit_code=3 marks an engine death: it must survive
    assert result.stdout.splitlines() == ["third", "second"], result.stdout  # "first" predates the guards


def test_sigint_reaches_a_sigwait_thread_when_the_main_thread_blocks_it() -> None:
    # Programs that leave signals to one thread (main blocks SIGINT, a thread sigwait()s) must get
    # the guard's SIGINT too: directed at the main thread, it would stay pending there for good.
    result = run_script(
        """
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        got = []
        waiter = threading.Thread(target=lambda: got.append(signal.sigwait({signal.SIGINT})))
        waiter.start()
        guard = FatalExitGuard(timeout_s=None)
        guard.trigger("rank 1 died")
        waiter.join(10)
        print("sigwait got", got, flush=True)
        guard.disarm()
        """
    )
    assert "sigwait got [<Signals.SIGINT: 2>]" in result.stdout, (result.stdout, result.stderr)


def test_a_later_unrestartable_event_changes_the_status_of_a_triggered_guard() -> None:
    # A death first (restartable), then a wedge of another rank through the same guard (a Dynamo
    # bridge gets every event): the status must say "do not restart here".
    result = run_script(
        """
        class Event:
            def __init__(self, restartable):
                self.restartable = restartable
        bridge = FatalExitGuard(graceful=lambda: None, timeout_s=20, exit_code=1, exit_code_unrestartable=69)
        assert bridge.trigger(Event(True)) is True
        assert bridge.trigger(Event(False)) is False
        """
    )
    assert result.returncode == 69, result.stderr


def test_an_unrestartable_failure_of_any_guard_sets_the_deciding_guards_unrestartable_status() -> None:
    # The bridge's guard decides (triggered first, died); the engine's guard then learns that the
    # bounded stop left a rank unkillable. The process status is the deciding guard's 69-class code.
    result = run_script(
        """
        bridge = FatalExitGuard(graceful=lambda: None, timeout_s=20, exit_code=1, exit_code_unrestartable=70)
        engine = FatalExitGuard(graceful=lambda: None, timeout_s=20, exit_code=3, exit_code_unrestartable=69)
        bridge.trigger("rank 1 died")
        engine.trigger("rank 1 died")
        engine.mark_unrestartable()
        """
    )
    assert result.returncode == 70, result.stderr
