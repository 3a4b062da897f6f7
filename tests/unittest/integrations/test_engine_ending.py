"""An engine's part in the process's ending, in a real child process with ``exit_on_fatal`` on.

- After ``shutdown()`` no thread of the fatal path is left (enumerated by name): the exit guard's
  trigger, the ``pre_shutdown()`` helper and its send, the diagnosis; the guard is triggered then
  (not ``exit_delay_s`` later, when the process may be gone), so the exit status is the failure's.
- The quarantine's wait is real: when the guard's watchdog ends the process, the ending stops the
  ranks first; a rank left unkillable (real ``D``: freezer or FUSE) quarantines the host, and the
  process does not end before the quarantine's slow hook has finished (within its bound).
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import pytest

from tests.support.children import HelperProcess
from tests.support.process_tracker import ProcessTracker
from tests.support.stuck_processes import StuckChild
from tests.support.waits import WAIT_SCALE, wait_until
from trtllm_liveness.exit._process_ending import ProcessEnding, Stage

pytestmark = [pytest.mark.timeout(120), pytest.mark.real_process]

FATAL_PATH_THREADS = {"trtllm-liveness-exit", "trtllm-liveness-fatal", "trtllm-liveness-pre-shutdown",
                      "trtllm-liveness-diagnosis"}
HOOK_SLEEP_S = 1.0


def test_no_fatal_path_thread_is_left_after_shutdown_and_the_status_is_the_failures(
        procs: ProcessTracker, tmp_path: Path) -> None:
    sleeper = procs.sleeper()
    outcome_dir = tmp_path / "outcome"
    outcome_dir.mkdir()
    termination = tmp_path / "termination-log"
    config = {"exit_delay_s": 30.0, "exit_timeout_s": 60.0, "quarantine_dir": "", "quarantine_devices": "",
              "termination_log": str(termination), "shutdown_grace_s": 0.1, "shutdown_term_s": 0.2,
              "shutdown_kill_s": 0.5}
    with HelperProcess("process_ending_child", {"config": config, "ranks": [[1, sleeper.pid]],
                                                "scenario": "shutdown"},
                       {"TRTLLM_LIVENESS_OUTCOME": str(outcome_dir)}) as child:
        child.read_record(30 * WAIT_SCALE, "ready")
        os.kill(sleeper.pid, signal.SIGKILL)
        fatal = child.read_record(30 * WAIT_SCALE, "fatal")["fatal"]
        assert f"pid {sleeper.pid}" in fatal
        after = child.read_record(30 * WAIT_SCALE, "after_shutdown")
        status = child.wait_exit(30 * WAIT_SCALE)
        log = child.stderr_tail()
    assert not FATAL_PATH_THREADS & set(after["after_shutdown"]), after
    assert after["sigints"] == 0, "the guard sent a SIGINT although the executor was already shutting down"
    assert status == 1, log  # exit_code: the guard was triggered before the interpreter's exit
    assert "still running past their bound" not in log and "still running after their bound" not in log, log
    assert f"pid {sleeper.pid}" in termination.read_text()
    (record,) = [json.loads(path.read_text()) for path in outcome_dir.glob("outcome.*.json")]
    assert record["state"] == "failed" and f"pid {sleeper.pid}" in record["message"], record


def test_the_ending_awaits_a_slow_quarantine_started_by_its_own_stop(
        procs: ProcessTracker, stuck_child: StuckChild, tmp_path: Path) -> None:
    sleeper = procs.sleeper()
    done = tmp_path / "hook-done"
    hook = tmp_path / "hook.sh"
    hook.write_text(f"#!/bin/sh\nsleep {HOOK_SLEEP_S}\necho \"$1\" > {done}\n")
    hook.chmod(0o755)
    quarantine = tmp_path / "quarantine"
    # No wedge verdicts: the stuck rank is found only by the ending's stop (SIGKILL stays pending).
    config = {"d_state_timeout_s": 0.0, "exit_delay_s": 0.1, "exit_timeout_s": 0.5, "exit_code": 3,
              "quarantine_dir": str(quarantine), "quarantine_devices": "", "quarantine_hook": str(hook),
              "quarantine_action_timeout_s": 20.0, "termination_log": "", "shutdown_term_s": 0.2,
              "shutdown_kill_s": 0.3}
    ranks = [[0, stuck_child.popen.pid], [1, sleeper.pid]]
    try:
        with HelperProcess("process_ending_child", {"config": config, "ranks": ranks, "scenario": "watchdog"}
                           ) as child:
            child.read_record(30 * WAIT_SCALE, "ready")
            os.kill(sleeper.pid, signal.SIGKILL)
            child.read_record(30 * WAIT_SCALE, "fatal")
            status = child.wait_exit(60 * WAIT_SCALE)
            hook_done_at_exit = done.exists()
            log = child.stderr_tail(20000)
        assert status == 69, log  # exit_code_unrestartable: the ending's stop left rank 0 unkillable
        assert hook_done_at_exit, f"the process ended before its quarantine's hook finished:\n{log}"
        marker = json.loads((quarantine / "quarantine.json").read_text())
        assert [item["pid"] for item in marker["processes"]] == [stuck_child.popen.pid]
        assert done.read_text().strip() == str(quarantine / "quarantine.json")
    finally:
        # Where the ending did not wait, the hook (its own session) still runs: let it finish.
        wait_until(done.exists, 10 * HOOK_SLEEP_S)


class _FailingUpstreamProxy:
    """Upstream's proxy whose constructor raises after the extension started its liveness (a
    model that does not load, a session that cannot be made)."""

    def __init__(self, worker_kwargs: object, *args: object, **kwargs: object) -> None:
        raise RuntimeError("the model did not load")

    def shutdown(self) -> None:
        pass

    def is_shutdown(self) -> bool:
        return False


@pytest.mark.parametrize("exit_on_fatal", [False, True])
def test_a_failed_constructor_leaves_no_liveness_thread_nor_exit_cleanup(
        fresh_process_ending: ProcessEnding, tmp_path: Path, exit_on_fatal: bool) -> None:
    # Nobody calls shutdown() on an engine whose constructor raised: whatever its liveness started
    # (the watcher thread with its pidfds, the STOP cleanup of the process's ending) is released.
    from trtllm_liveness import LivenessConfig
    from trtllm_liveness.integrations.trtllm import liveness_proxy_class

    config = LivenessConfig(enabled=True, termination_log="", quarantine_dir=str(tmp_path / "q"),
                            quarantine_devices="", exit_on_fatal=exit_on_fatal)
    before = {thread.ident for thread in threading.enumerate()}
    with pytest.raises(RuntimeError, match="the model did not load"):
        liveness_proxy_class(_FailingUpstreamProxy, config=config)({"llm_args": None})
    left = [thread.name for thread in threading.enumerate()
            if thread.ident not in before and thread.is_alive() and "liveness" in thread.name]
    assert left == []
    assert fresh_process_ending._cleanups[Stage.STOP] == []
