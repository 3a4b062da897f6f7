"""A wedged host is never restarted on: the trtllm-serve stand-in over the reference executor.

A rank of a serving process is frozen (cgroup v1 freezer: real ``D``, SIGKILL stays pending). The
server exits with ``exit_code_unrestartable`` and leaves the host's marker; the next start on the
host refuses with the message while the wedged rank exists; once it is released (thawed: its
pending SIGKILL ends it) the next start clears the marker and serves.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.children import HelperProcess, identities_of
from tests.support.facilities import needs
from tests.support.process_tracker import state_of
from tests.support.stuck_processes import Freezer
from tests.support.waits import WAIT_SCALE, wait_until

pytestmark = [pytest.mark.timeout(180), pytest.mark.mpi, pytest.mark.real_process, needs("mpi", "freezer")]

READY_S = 60 * WAIT_SCALE


def test_a_wedged_rank_quarantines_the_host_until_it_is_gone(freezer: Freezer, tmp_path: Path) -> None:
    quarantine = tmp_path / "quarantine"
    env = {"TRTLLM_WORKER_LIVENESS": (
        "scan_interval_s=0.1,d_state_timeout_s=0.5,shutdown_grace_s=2,shutdown_term_s=0.5,shutdown_kill_s=1,"
        f"exit_on_fatal=1,exit_delay_s=0.2,exit_timeout_s={20 * WAIT_SCALE},quarantine_dir={quarantine},"
        "quarantine_devices=")}
    first = HelperProcess("serve_worker", {"mode": "main"}, env)
    try:
        ready = first.read_record(READY_S, "ready")
        victim = identities_of(ready)[1]
        freezer.add(victim.pid)
        assert freezer.freeze()

        status = first.wait_exit(60 * WAIT_SCALE)
        log = first.stderr_tail(20000)
        assert status == 69, log  # exit_code_unrestartable: not the 1 of a death
        document = json.loads((quarantine / "quarantine.json").read_text())
        assert [(item["pid"], item["start_time"], item["state"]) for item in document["processes"]] == \
            [(victim.pid, victim.start_time, "D")]
        assert f"rank 1 (pid {victim.pid})" in document["reason"] and "wedged" in document["reason"]
        assert "host quarantined: marker" in log

        # The next start on this host, while the wedged rank exists: refused at once, no worker spawned.
        with HelperProcess("serve_worker", {"mode": "main"}, env) as second:
            refused_status = second.wait_exit(READY_S)
            refused = second.stderr_tail(20000)
        assert refused_status not in (None, 0), refused
        assert "HostQuarantinedError" in refused and "refusing to start" in refused, refused
        assert f"pid {victim.pid} is still unkillable" in refused and "recycle the host" in refused
        assert state_of(victim.pid) == "D"  # the check only looked: the rank is still stuck

        first.close()  # the wedged rank stays (unkillable) until it is thawed
        freezer.thaw()
        assert wait_until(lambda: state_of(victim.pid) in (None, "Z"), 20), state_of(victim.pid)
        assert first.remove_tmpdir()

        with HelperProcess("serve_worker", {"mode": "main"}, env) as third:
            third.read_record(READY_S, "ready")  # serves again
            started = third.stderr_tail(20000)
            assert third.close() == []
        assert "every recorded process is gone: cleared" in started
        assert not (quarantine / "quarantine.json").exists()
    finally:
        freezer.thaw()
        first.close()
        first.remove_tmpdir()
