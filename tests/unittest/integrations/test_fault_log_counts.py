"""What a wedge and an unkillable rank write to the log, counted: one ERROR (the fatal line, with
its evidence) and one WARNING (the snapshot), up to the shutdown.

A liveness proxy over the smallest upstream shape (``tests/support/bare_proxy.py``) watches two
real processes: rank 0 a sleeper, rank 1 really stuck in ``D`` (freezer or FUSE:
``stuck_child``). For ``unkillable`` rank 1 is SIGKILLed first (the signal stays pending), so the
monitor's first verdict is that it cannot be ended. (A death and a stall on real MPI ranks:
``test_trtllm_fault_logs.py``.)
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.support.bare_proxy import BareUpstreamProxy
from tests.support.process_tracker import ProcessTracker
from tests.support.quarantine import config_for, fresh_quarantine_state  # noqa: F401 - an autouse fixture
from tests.support.stuck_processes import StuckChild
from tests.support.waits import WAIT_SCALE, wait_until
from trtllm_liveness.integrations.trtllm import liveness_proxy_class
from trtllm_liveness.process import _procfs
from trtllm_liveness.process._identity import capture_identity

pytestmark = [pytest.mark.timeout(90), pytest.mark.real_process]


@pytest.mark.parametrize("kind", ["wedged", "unkillable"])
def test_a_stuck_rank_is_one_error_with_its_evidence_and_one_snapshot(
        kind: str, stuck_child: StuckChild, procs: ProcessTracker, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    config = config_for(tmp_path / "quarantine", d_state_timeout_s=0.5, scan_interval_s=0.05, termination_log="",
                        shutdown_grace_s=0.1, shutdown_term_s=0.2, shutdown_kill_s=0.3)
    proxy: Any = liveness_proxy_class(BareUpstreamProxy, config=config)({"llm_args": None})
    stuck = stuck_child.popen.pid
    if kind == "unkillable":
        os.kill(stuck, signal.SIGKILL)  # pending: the task is in D
        assert wait_until(lambda: _procfs.sigkill_pending(stuck), 10)
    sleeper = procs.sleeper()
    state = proxy.liveness_state
    with caplog.at_level(logging.INFO, logger="trtllm_liveness"):
        caplog.clear()  # the bare shape's start-up warnings (hooks it lacks) are no part of the failure
        proxy.liveness_monitor.register([capture_identity(0, sleeper.pid), capture_identity(1, stuck)])
        assert wait_until(lambda: not proxy.check_health(), 20 * WAIT_SCALE)
        assert state.diagnoser.snapshot_taken.wait(10 * WAIT_SCALE)
        assert wait_until(lambda: any(record.getMessage().startswith("liveness: diagnosis")
                                      for record in caplog.records), 5 * WAIT_SCALE)
        records = [record for record in caplog.records if record.name.startswith("trtllm_liveness")]
    try:
        assert proxy.liveness_fatal_error.event.kind.value == kind
        errors = [record.getMessage() for record in records if record.levelno == logging.ERROR]
        warnings = [record.getMessage() for record in records if record.levelno == logging.WARNING]
        assert len(errors) == 1, errors
        assert errors[0].startswith(f"liveness: fatal: MPI worker rank 1 (pid {stuck}) on host "), errors[0]
        assert "; evidence: rank 1 has " in errors[0] and " in D" in errors[0], errors[0]
        assert len(warnings) == 1 and warnings[0].startswith(f"liveness: diagnosis ({kind} of rank 1): "), warnings
        assert f"rank 1 (pid {stuck}) on host " in warnings[0] and ": D, wchan " in warnings[0], warnings[0]
        assert f"rank 0 (pid {sleeper.pid}) on host " in warnings[0], warnings[0]
    finally:
        proxy.shutdown()
