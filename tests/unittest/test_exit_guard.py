"""FatalExitGuard in real interpreters: one graceful shutdown, then a bounded non-zero exit."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from trtllm_liveness._exit_guard import FatalExitGuard

pytestmark = [pytest.mark.real_process, pytest.mark.timeout(60)]


def run_script(body: str) -> subprocess.CompletedProcess[str]:
    code = "import os, signal, sys, threading, time\nfrom trtllm_liveness._exit_guard import FatalExitGuard\n"
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
    """Issue 10 point 10: two engines (each with its guard) in one server start ONE graceful
    shutdown; a second SIGINT makes uvicorn skip its graceful shutdown."""
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


def test_other_atexit_hooks_run_once_each_before_the_forced_status() -> None:
    # The forced status must not cost the hooks registered before the trigger (an executor's
    # shutdown(), MPI session-directory removal): os._exit alone would skip them.
    result = run_script(
        """
        import atexit
        atexit.register(print, "hook registered before", flush=True)
        atexit.register(lambda: 1 / 0)  # a failing hook must not stop the rest nor the status
        guard = FatalExitGuard(graceful=lambda: None, timeout_s=20, exit_code=5)
        guard.trigger("rank 1 died")
        atexit.register(print, "hook registered after", flush=True)
        """
    )
    assert result.returncode == 5, result.stderr
    lines = result.stdout.splitlines()
    assert lines.count("hook registered before") == 1, result.stdout
    assert lines.count("hook registered after") == 1, result.stdout
    assert lines.index("hook registered after") < lines.index("hook registered before")  # usual order
    assert "ZeroDivisionError" in result.stderr


def test_two_triggered_guards_run_each_other_hook_once() -> None:
    result = run_script(
        """
        import atexit
        atexit.register(print, "first", flush=True)
        one = FatalExitGuard(graceful=lambda: None, timeout_s=20, exit_code=4)
        two = FatalExitGuard(graceful=lambda: None, timeout_s=20, exit_code=4)
        one.trigger("a")
        atexit.register(print, "second", flush=True)
        two.trigger("b")
        atexit.register(print, "third", flush=True)
        """
    )
    assert result.returncode == 4, result.stderr
    assert result.stdout.splitlines() == ["third", "second", "first"], result.stdout


def test_a_hanging_atexit_hook_is_bounded_without_a_watchdog() -> None:
    result = run_script(
        """
        import atexit
        import trtllm_liveness._exit_guard as exit_guard
        exit_guard.ATEXIT_HOOKS_BOUND_S = 0.3
        atexit.register(time.sleep, 3600)  # e.g. upstream's shutdown() blocked on a dead peer
        guard = FatalExitGuard(graceful=lambda: None, timeout_s=None, exit_code=6)
        guard.trigger("rank 0 died")
        """
    )
    assert result.returncode == 6, result.stderr
    assert "atexit hooks did not finish" in result.stderr


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
