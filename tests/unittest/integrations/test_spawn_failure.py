"""A real MPI_Comm_spawn failure during start-up: the extension fails construction, upstream hangs.

The failure is made by exporting ``PRTE_MCA_prte_tmpdir_base`` as a regular file: PRRTE cannot make
its session directory, ``MPI_Comm_spawn`` raises in mpi4py's manager thread, and the worker futures
stay pending. (Also what the stale-session collision of ``test_mpi_env`` did to CI.)
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.support.children import HelperProcess
from tests.support.facilities import MPI_MARKS
from tests.support.waits import WAIT_SCALE
from trtllm_liveness.demo._mpi_env import PRTE_TMPDIR_VAR

pytestmark = [
    pytest.mark.timeout(120),
    *MPI_MARKS,
]

SPAWN_FAILED = "MPI_ERR_UNKNOWN"  # mpi4py's manager thread traceback on stderr
HANG_OBSERVE_S = 5.0  # how long the control is watched not returning (upstream polls every 1 s)


def _unusable_tmpdir_base(tmp_path: Path) -> str:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("PRRTE cannot make prte.<pid>/ under a regular file\n")
    return str(blocker)


@pytest.mark.parametrize("mode", ["1.2", "main"])
def test_failed_spawn_fails_construction_with_the_extension(mode: str, tmp_path: Path) -> None:
    env = {PRTE_TMPDIR_VAR: _unusable_tmpdir_base(tmp_path)}
    with HelperProcess("spawn_failure", {"mode": mode, "liveness": True}, env=env) as helper:
        helper.read_record(30 * WAIT_SCALE, "building")
        record = helper.read_record(60 * WAIT_SCALE, "init_error")
        stderr = helper.stderr_tail(20000)
    assert SPAWN_FAILED in stderr, stderr
    assert record["init_error_type"] == "PoolManagerDiedError", record
    assert "MPI_Comm_spawn failed" in record["init_error"]
    assert "failing 2 pending worker futures" in record["init_error"]
    assert record["cause_type"] == "RuntimeError"  # upstream's "died during initialization", chained


def test_failed_spawn_hangs_upstream_construction(tmp_path: Path) -> None:
    env = {PRTE_TMPDIR_VAR: _unusable_tmpdir_base(tmp_path)}
    with HelperProcess("spawn_failure", {"mode": "main", "liveness": False}, env=env) as helper:
        helper.read_record(30 * WAIT_SCALE, "building")
        deadline = time.monotonic() + 60 * WAIT_SCALE
        while SPAWN_FAILED not in helper.stderr_tail() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert SPAWN_FAILED in helper.stderr_tail(), helper.stderr_tail()
        # The spawn has failed; upstream's loop keeps waiting on futures nobody will complete.
        with pytest.raises(TimeoutError):
            helper.read_record(HANG_OBSERVE_S, "init_error")
        assert helper.alive()
