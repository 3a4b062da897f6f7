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
