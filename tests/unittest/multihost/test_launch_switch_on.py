"""``trtllm-liveness launch -- mpirun ...``: the one wrapper puts the hook into every Python on every
host, with nothing installed in the image (no ``.pth``).

The hosts are the ``login_hosts`` fixture: each host's command starts with a fresh environment, as
over ssh, so a rank gets only what ``mpirun`` forwards (Open MPI: ``OMPI_*`` variables and those
named with ``-x``) and what the host's login configuration sets (the test run's quarantine marker
directory). The engine is the trtllm-serve shape: upstream's own executor class
(``tests/programs/proxy_death_child.py`` without ``executor_cls``), which only the import hook makes
the liveness one. No timing is asserted.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from tests.support.facilities import needs
from tests.support.multihost_engine import Engine
from tests.support.testhosts import TestHosts
from tests.support.waits import WAIT_SCALE
from trtllm_liveness.integrations.trtllm_autoload import SITE_DIR
from trtllm_liveness.process._procfs import pid_namespace_inode
from trtllm_liveness.quarantine._marker import MARKER_NAME, QUARANTINE_DIR_VAR, QuarantinedProcess, write_marker

pytestmark = [pytest.mark.multihost, pytest.mark.real_process, pytest.mark.mpi, needs("testhosts", "mpi")]

LAUNCH = [sys.executable, "-m", "trtllm_liveness.cli", "launch"]
# Prints, from every rank, its host and whether the hook's finder is first on sys.meta_path.
HOOKED = ("import socket, sys; print('HOOK', socket.gethostname(), "
          "getattr(sys.meta_path[0], '_target', None) == 'tensorrt_llm.executor.proxy', flush=True)")
PLACEMENT = (("hostA", 1), ("hostB", 1), ("hostC", 1))


def _hooks(output: str) -> dict[str, bool]:
    return {words[1]: words[2] == "True" for words in (line.split() for line in output.splitlines())
            if len(words) == 3 and words[0] == "HOOK"}


@pytest.mark.timeout(120)
def test_every_python_on_every_host_gets_the_hook(login_hosts: TestHosts) -> None:
    """Under the wrapper every rank is hooked. The README's former line (``mpirun -x
    TRTLLM_WORKER_LIVENESS``, the site directory on the launching shell's ``PYTHONPATH``) leaves
    every rank of another host without it: what the wrapper is for."""
    bare = login_hosts.mpirun(PLACEMENT, [sys.executable, "-c", HOOKED], mpirun_args=["-x", "TRTLLM_WORKER_LIVENESS"],
                              env={"TRTLLM_WORKER_LIVENESS": "1", "PYTHONPATH": SITE_DIR})
    assert bare.wait_exit(60 * WAIT_SCALE) == 0, bare.output()
    assert _hooks(bare.output()) == {"hostA": False, "hostB": False, "hostC": False}, bare.output()

    wrapped = login_hosts.mpirun(PLACEMENT, [sys.executable, "-c", HOOKED],
                                 wrapper=[*LAUNCH, "--outcome-dir", login_hosts.shared, "--"])
    assert wrapped.wait_exit(60 * WAIT_SCALE) == 0, wrapped.output()
    output = wrapped.output()
    assert _hooks(output) == {"hostA": True, "hostB": True, "hostC": True}, output
    on = [line for line in output.splitlines() if "worker liveness" in line]
    assert len(on) == 1 and "worker liveness on (" in on[0], output
    assert "mpirun -x PYTHONPATH -x TRTLLM_WORKER_LIVENESS -x TRTLLM_LIVENESS_OUTCOME" in on[0], on


@pytest.mark.timeout(150)
def test_the_readme_line_watches_every_rank_and_reports_a_remote_kill(login_hosts: TestHosts) -> None:
    """``trtllm-liveness launch -- mpirun ... <trtllm-serve-shaped engine>``: every rank watched (the
    proxy's own by pidfd, the others by their host's agent); SIGKILL of rank 3 on hostC is the
    engine's fatal error naming it, the pending request failed, health False, a bounded shutdown."""
    engine = Engine(login_hosts, executor_cls=False, wrapper=[*LAUNCH, "--outcome-dir", login_hosts.shared, "--"])
    for rank, (state, host, _pid, method) in engine.ready["hosts"].items():
        assert state == "alive", engine.ready
        assert method == ("pidfd" if host == "hostA" else "agent"), (rank, engine.ready)
    assert engine.host_of(3) == "hostC"
    login_hosts.kill("hostC", engine.pid_of(3), signal.SIGKILL)
    fatal = engine.wait_fatal()
    engine.assert_fatal(fatal, ["died"], 3)
    engine.assert_shutdown()


@pytest.mark.timeout(150)
def test_a_marker_in_the_hosts_own_default_directory_does_not_stop_the_test_run(login_hosts: TestHosts) -> None:
    """Each host's default marker directory (``/run/trtllm-liveness`` as the host sees it: its own
    ``/run``, a directory of the test hosts) holds a real marker that quarantines the host, as one
    left on a machine by another program would. The README line still starts its engine: every
    rank, started through a login environment, uses the test run's marker directory, never the
    host's default, which is left as it was."""
    markers = {}
    for host in ("hostA", "hostB", "hostC"):
        directory = os.path.join(login_hosts.run_directory(host), "trtllm-liveness")
        # A stuck process of another PID namespace (a previous container's): unverifiable from a
        # rank, so it quarantines the host.
        stuck = QuarantinedProcess(pid=4242, start_time=1, pid_namespace=pid_namespace_inode(), rank=1, state="D",
                                   wchan="nv_wait", kind="wedged", cause="left by another program")
        markers[host] = Path(write_marker(directory, [stuck], "a wedged rank of another program")).read_bytes()
        # What the host's default directory says to a start that reads it: quarantined.
        status = login_hosts.run(host, ["env", "-u", QUARANTINE_DIR_VAR, sys.executable, "-m", "trtllm_liveness.cli",
                                        "quarantine", "status", "--devices", ""], timeout=60 * WAIT_SCALE)
        assert status.returncode == 1 and status.stdout.startswith("QUARANTINED: host quarantined by "
                                                                   "/run/trtllm-liveness/quarantine.json"), status

    engine = Engine(login_hosts, executor_cls=False, wrapper=[*LAUNCH, "--outcome-dir", login_hosts.shared, "--"],
                    request=False)
    assert "HostQuarantinedError" not in engine.stderr(), engine.diagnostics()
    for rank, (state, host, _pid, method) in engine.ready["hosts"].items():
        assert state == "alive", engine.ready
        assert method == ("pidfd" if host == "hostA" else "agent"), (rank, engine.ready)
    engine.job.kill()
    for host, content in markers.items():
        marker = Path(login_hosts.run_directory(host), "trtllm-liveness", MARKER_NAME)
        assert marker.read_bytes() == content, f"{host}'s default marker changed"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fault_tolerant", [False, True], ids=["ompi-default", "ulfm"])
def test_a_lost_host_ends_the_whole_job_with_the_recorded_status(login_hosts: TestHosts, fault_tolerant: bool) -> None:
    """hostB cut off (both networks) under ``launch -- mpirun``: the proxy's verdict (lost host) goes
    into the wrapper's outcome pipe; rank 0 ends (Open MPI's abort, or the exit guard's shutdown
    under ULFM) while mpirun waits for hostB's cut-off daemon (PRRTE: minutes of TCP keepalive). The
    wrapper ends mpirun and exits with the recorded status, whatever MPI's setting."""
    liveness = ("heartbeat_timeout_s=1,shutdown_term_s=1,shutdown_kill_s=1,exit_on_fatal=1,exit_code=3,"
                "exit_delay_s=0.2,exit_timeout_s=2")
    engine = Engine(login_hosts, liveness=liveness, executor_cls=False, fault_tolerant=fault_tolerant,
                    wrapper=[*LAUNCH, "--outcome-dir", login_hosts.shared, "--"])
    assert engine.host_of(2) == "hostB"
    login_hosts.partition("hostB")
    status = engine.job.wait_exit(90 * WAIT_SCALE)
    output = engine.job.output()
    assert status == 3, f"mpirun (wrapped) still runs or exited {status}:\n{engine.diagnostics()}"
    said = [line for line in output.splitlines() if line.startswith("trtllm-liveness launch:")]
    assert said[0].startswith("trtllm-liveness launch: ending mpirun"), said
    assert "after the engine failed" in said[-1] and "hostB" in said[-1] and said[-1].endswith("exiting 3"), \
        said
