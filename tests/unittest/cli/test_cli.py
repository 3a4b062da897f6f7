"""The installed ``trtllm-liveness`` console script, run as a subprocess on real processes.

Live, zombie and stuck (real ``D`` via the cgroup v1 freezer or FUSE) processes; every wait is bounded and
nothing asserts on timing.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.facilities import needs, require_facility
from tests.support.other_user import OTHER_USER, interpreter_for_others, package_readable_by_others
from tests.support.process_tracker import SLEEPER, ProcessTracker, state_of
from tests.support.stuck_processes import Freezer, StuckChild
from tests.support.waits import WAIT_SCALE, wait_until
from trtllm_liveness.process import _procfs

pytestmark = [pytest.mark.real_process, pytest.mark.timeout(120)]

CLI = Path(sys.executable).parent / "trtllm-liveness"
require_facility("console-script", allow_module_level=True)  # trtllm-liveness next to sys.executable

RUN_TIMEOUT = 60 * WAIT_SCALE


def run_cli(*args: str | int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(CLI), *map(str, args)], capture_output=True, text=True, timeout=RUN_TIMEOUT, check=False
    )


def start_cli(procs: ProcessTracker, *args: str | int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [str(CLI), *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    procs.popens.append(proc)
    procs.track(proc.pid)
    return proc


def wait_for_stderr(proc: subprocess.Popen[bytes], needle: bytes, timeout: float = 30) -> bytes:
    """Read the process's stderr until it contains ``needle`` (or EOF); return what was read."""
    assert proc.stderr is not None
    fd = proc.stderr.fileno()
    seen = bytearray()

    def found() -> bool:
        ready, _, _ = select.select([fd], [], [], 0)
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:
                return True  # EOF: stop waiting; the assertion below reports what was seen
            seen.extend(chunk)
        return needle in seen

    wait_until(found, timeout, 0.01)
    assert needle in seen, f"{needle!r} not seen on stderr; got {bytes(seen)!r}"
    return bytes(seen)


def finish(proc: subprocess.Popen[bytes]) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=RUN_TIMEOUT)
    return proc.returncode, out.decode(), err.decode()


def nonexistent_pid() -> int:
    with open("/proc/sys/kernel/pid_max") as handle:
        return int(handle.read()) + 1  # above pid_max: the kernel cannot have given it out


def distinctive_sleeper(procs: ProcessTracker, token: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", SLEEPER, token], stdout=subprocess.PIPE, start_new_session=True)
    procs.popens.append(proc)
    procs.track(proc.pid)
    assert proc.stdout is not None
    assert proc.stdout.readline() == b"ready\n"
    return proc


@contextlib.contextmanager
def killed_at_exit(pid: int) -> Iterator[None]:
    """SIGKILL ``pid`` (a process this test started) when the block ends, also on failure.

    A process in a freezer group must be gone before the group can be removed: SIGKILL stays
    pending while it is frozen and takes effect when the ``freezer`` fixture thaws the group.
    """
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def scan_json(*args: str | int) -> tuple[int, dict[str, Any]]:
    result = run_cli("scan", "--json", *args)
    return result.returncode, json.loads(result.stdout)


# ----------------------------------------------------------------------------- scan


def test_scan_of_a_live_process_is_ok(procs: ProcessTracker) -> None:
    child = procs.sleeper()
    result = run_cli("scan", "--window", "0.2", child.pid)
    assert result.returncode == 0, result.stderr
    assert f"pid {child.pid} " in result.stdout
    assert ": ok" in result.stdout
    assert "summary: 1 process(es)" in result.stdout


def test_scan_over_a_second_prints_progress_on_stderr_and_threads_on_request(procs: ProcessTracker) -> None:
    child = procs.sleeper()
    result = run_cli("scan", "--threads", child.pid)  # default window: 1 s
    assert result.returncode == 0, result.stderr
    assert "trtllm-liveness: sampling 1 process(es)" in result.stderr
    assert "TID" in result.stdout
    assert f"    {child.pid} " in result.stdout


def test_scan_of_a_stopped_process_flags_it(procs: ProcessTracker) -> None:
    child = procs.sleeper()
    os.kill(child.pid, signal.SIGSTOP)
    assert wait_until(lambda: state_of(child.pid) == "T", 10)
    result = run_cli("scan", "--window", "0.2", child.pid)
    os.kill(child.pid, signal.SIGCONT)
    assert result.returncode == 4, result.stdout + result.stderr
    assert "STOPPED" in result.stdout
    assert "SIGCONT" in result.stdout


def test_scan_json_parses_and_lists_threads(procs: ProcessTracker) -> None:
    child = procs.sleeper()
    status, data = scan_json("--window", "0.2", "--samples", "3", child.pid)
    assert status == 0
    assert data["samples"] == 1  # no thread in D at the first sample: nothing to confirm
    assert data["window_s"] == 0.0
    assert data["unkillable"] == 0
    (report,) = data["processes"]
    assert report["pid"] == child.pid
    assert report["verdict"] == "ok"
    assert report["zombie"] is False
    assert report["sigkill_pending"] is False
    assert child.pid in [thread["tid"] for thread in report["threads"]]
    assert all(thread["state"] in "RSI" for thread in report["threads"])


def test_scan_of_a_zombie_says_so_with_its_exit(procs: ProcessTracker) -> None:
    _middle, pid = procs.grandchild(reap=False)
    os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: state_of(pid) == "Z", 10)
    result = run_cli("scan", "--window", "0", pid)
    assert result.returncode == 3, result.stdout + result.stderr
    assert "ZOMBIE" in result.stdout
    assert "killed by SIGKILL" in result.stdout
    status, data = scan_json("--window", "0", pid)
    assert status == 3
    assert data["processes"][0]["zombie"] is True
    assert data["processes"][0]["exit_status"] == "killed by SIGKILL"


def test_scan_of_a_stuck_process_shows_d_then_unkillable_with_recycle_advice(
    procs: ProcessTracker, stuck_child: StuckChild
) -> None:
    """Over both sources of real D (freezer, FUSE): a cgroup-v2-only host is covered too."""
    pid = stuck_child.popen.pid
    with killed_at_exit(pid):
        _check_stuck_scan(pid)


def _check_stuck_scan(pid: int) -> None:
    assert wait_until(lambda: state_of(pid) == "D", 10)

    result = run_cli("scan", "--window", "0.3", pid)
    assert result.returncode == 4, result.stdout + result.stderr
    assert "D-STATE" in result.stdout
    assert "UNKILLABLE" not in result.stdout

    os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: _procfs.sigkill_pending(pid), 10)
    result = run_cli("scan", "--window", "0.3", pid)
    assert result.returncode == 4, result.stdout + result.stderr
    assert "UNKILLABLE" in result.stdout
    assert "recycle the host" in result.stdout
    assert "pending" in result.stdout

    status, data = scan_json("--window", "0.3", pid)
    assert status == 4
    assert data["unkillable"] == 1
    assert "recycle the host" in data["advice"]
    (report,) = data["processes"]
    assert report["verdict"] == "unkillable"
    assert report["sigkill_pending"] is True
    assert report["d_seconds"] > 0
    assert any(thread["state"] == "D" for thread in report["threads"])
    assert state_of(pid) == "D"  # the scan only looked; releasing it in teardown lets it die


def test_scan_by_name_finds_the_process_with_a_distinctive_argv(procs: ProcessTracker) -> None:
    token = f"trtllm-liveness-test-{uuid.uuid4().hex}"
    child = distinctive_sleeper(procs, token)
    procs.sleeper()  # a bystander that must not match
    status, data = scan_json("--window", "0", "--name", token)
    assert status == 0
    # The scan's own command line holds the token too; it must exclude itself.
    assert [report["pid"] for report in data["processes"]] == [child.pid]


def test_scan_by_parent_finds_a_grandchild(procs: ProcessTracker) -> None:
    middle, grandchild = procs.grandchild()
    status, data = scan_json("--window", "0", "--parent", middle.pid)
    assert status == 0
    assert grandchild in [report["pid"] for report in data["processes"]]
    assert middle.pid not in [report["pid"] for report in data["processes"]]


@pytest.mark.freezer
def test_scan_by_cgroup_directory(procs: ProcessTracker, freezer: Freezer) -> None:
    inside, outside = procs.sleeper(), procs.sleeper()
    freezer.add(inside.pid)
    with killed_at_exit(inside.pid):
        status, data = scan_json("--window", "0", "--cgroup", freezer.path)
        # The same group named as /proc/<pid>/cgroup writes it (relative to the hierarchy's root).
        by_path_status, by_path = scan_json("--window", "0", "--cgroup", "/" + os.path.basename(freezer.path))
    assert status == 0
    pids = [report["pid"] for report in data["processes"]]
    assert pids == [inside.pid]
    assert outside.pid not in pids
    assert by_path_status == 0
    assert [report["pid"] for report in by_path["processes"]] == [inside.pid]


def test_scan_filter_matching_nothing_fails_with_one_line() -> None:
    result = run_cli("scan", "--window", "0", "--name", f"no-such-process-{uuid.uuid4().hex}")
    assert result.returncode == 1
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 1
    assert "no process matches" in result.stderr


# ----------------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["scan"], "give PIDs"),
        (["scan", "abc"], "not a pid"),
        (["scan", "1"], "pid 1"),
        (["scan", "-5"], "not a pid"),
        (["scan", "12.5"], "not a pid"),
        (["scan", "--window", "-1", "100"], "seconds"),
        (["scan", "--samples", "0", "100"], "between 1 and"),
        (["demo-processes", "--workers", "0"], "between 1 and"),
        (["demo", "--workers", "1"], ">= 2"),
        (["demo", "--workers", "2", "--rank", "5"], "--rank must be in"),
        (["scan", "100", "--name", "x"], "not both"),
        (["watch"], "required"),
        (["watch", "abc"], "not a pid"),
        (["watch", "1"], "pid 1"),
        (["watch", "0"], "not a pid"),
        (["watch", "--d-state-timeout", "0", "100"], "seconds"),
        (["watch", "--d-state-timeout", "nan", "100"], "seconds"),
        (["no-such-command"], "invalid choice"),
        ([], "required"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(args: list[str], needle: str) -> None:
    result = run_cli(*args)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("trtllm-liveness")
    assert needle in lines[0]


def test_watch_of_a_nonexistent_pid_exits_2_with_one_line() -> None:
    pid = nonexistent_pid()
    result = run_cli("watch", pid)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.splitlines() == [f"trtllm-liveness: no such process: pid {pid}"]


def test_scan_reports_a_gone_pid_as_gone_beside_the_live_ones(procs: ProcessTracker) -> None:
    # The help says 3 is "a scanned process is gone": a gone pid is no usage error (2), and the
    # live pid next to it is still reported.
    pid = nonexistent_pid()
    live = procs.sleeper()
    result = run_cli("scan", pid, live.pid, "--window", "0", "--json")
    assert result.returncode == 3, result.stderr
    verdicts = {process["pid"]: process["verdict"] for process in json.loads(result.stdout)["processes"]}
    assert verdicts == {pid: "gone", live.pid: "ok"}


def test_scan_as_another_user_reads_what_proc_shows_it(procs: ProcessTracker) -> None:
    # A process's stat and status are readable by every user, its ns/pid only by its owner (and
    # root): the scan of another user's process goes ahead on what /proc shows that user. The
    # command runs from a copy of the package that the other user can read, so the test does not
    # depend on where the checkout lives.
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run the scan as another user")
    python, tried = interpreter_for_others()
    if python is None:
        pytest.skip(f"no Python 3.10+ that uid 65534 can run with its standard library (tried {', '.join(tried)})")
    live = procs.sleeper()
    with package_readable_by_others() as root:
        result = subprocess.run([*OTHER_USER, python, "-E", "-s", "-m", "trtllm_liveness.cli", "scan", str(live.pid),
                                 "--window", "0", "--json"], capture_output=True, text=True, timeout=RUN_TIMEOUT,
                                cwd=root)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["processes"][0]["verdict"] == "ok"


def test_watch_refuses_a_duplicate_pid(procs: ProcessTracker) -> None:
    child = procs.sleeper()
    result = run_cli("watch", child.pid, child.pid)
    assert result.returncode == 2
    assert len(result.stderr.splitlines()) == 1
    assert "more than once" in result.stderr


@pytest.mark.parametrize("args", [["--help"], ["scan", "--help"], ["watch", "--help"], ["demo", "--help"]])
def test_help_exits_0_and_explains(args: list[str]) -> None:
    result = run_cli(*args)
    assert result.returncode == 0
    assert "usage: trtllm-liveness" in result.stdout
    if args[0] != "demo":
        assert "exit status" in result.stdout


# ----------------------------------------------------------------------------- watch


def test_watch_exits_3_when_the_process_is_sigkilled(procs: ProcessTracker) -> None:
    child, other = procs.sleeper(), procs.sleeper()
    watch = start_cli(procs, "watch", other.pid, child.pid)
    wait_for_stderr(watch, b"watching 2 process(es)")
    os.kill(child.pid, signal.SIGKILL)
    status, out, err = finish(watch)
    assert status == 3, err
    # Any process, not an MPI rank: the line names the process, not "MPI worker rank 1".
    assert out.strip().startswith(f"process {child.pid} (python"), out
    assert "exited unexpectedly" in out and "MPI worker" not in out
    assert state_of(other.pid) in ("S", "R")


def test_watch_json_event_parses(procs: ProcessTracker) -> None:
    child = procs.sleeper()
    watch = start_cli(procs, "watch", "--json", child.pid)
    wait_for_stderr(watch, b"watching 1 process(es)")
    os.kill(child.pid, signal.SIGKILL)
    status, out, _err = finish(watch)
    assert status == 3
    event = json.loads(out)
    assert event["kind"] == "died"
    assert event["pid"] == child.pid
    assert event["restartable"] is True


def test_watch_of_a_zombie_exits_3_at_once(procs: ProcessTracker) -> None:
    _middle, pid = procs.grandchild(reap=False)
    os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: state_of(pid) == "Z", 10)
    result = run_cli("watch", pid)
    assert result.returncode == 3, result.stderr
    assert "zombie" in result.stdout


def test_watch_exits_4_on_a_stuck_process(procs: ProcessTracker, stuck_child: StuckChild) -> None:
    child = stuck_child.popen
    with killed_at_exit(child.pid):
        assert wait_until(lambda: state_of(child.pid) == "D", 10)
        watch = start_cli(procs, "watch", "--json", "--d-state-timeout", "0.3", child.pid)
        status, out, err = finish(watch)
    assert status == 4, err
    event = json.loads(out)
    assert event["kind"] == "wedged"
    assert event["restartable"] is False
    assert event["pid"] == child.pid


def test_watch_exits_130_on_sigint(procs: ProcessTracker) -> None:
    child = procs.sleeper()
    watch = start_cli(procs, "watch", child.pid)
    wait_for_stderr(watch, b"Ctrl-C to stop")
    os.kill(watch.pid, signal.SIGINT)
    status, out, err = finish(watch)
    assert status == 130
    assert out == ""
    assert "interrupted" in err
    assert state_of(child.pid) in ("S", "R")  # watching never touches the process


# ----------------------------------------------------------------------------- imports

# Runs the command in-process and prints the reference/ modules it imported.
IMPORTS_OF = (
    "import json, sys\n"
    "from trtllm_liveness import cli\n"
    "status = cli.main(sys.argv[1:])\n"
    "print(json.dumps([status, sorted(m for m in sys.modules if m.startswith('trtllm_liveness.demo'))]))\n"
)


def _reference_modules_of(*args: str | int) -> tuple[int, list[str]]:
    result = subprocess.run([sys.executable, "-c", IMPORTS_OF, *map(str, args)], capture_output=True, text=True,
                            timeout=RUN_TIMEOUT, check=False)
    status, modules = json.loads(result.stdout.splitlines()[-1])
    return status, modules


def test_scan_and_watch_never_import_reference(procs: ProcessTracker) -> None:
    child = procs.sleeper()
    assert _reference_modules_of("scan", "--window", "0", child.pid) == (0, [])
    assert _reference_modules_of("scan", "--window", "0", "--name", f"no-such-{uuid.uuid4().hex}") == (1, [])
    _middle, zombie = procs.grandchild(reap=False)
    os.kill(zombie, signal.SIGKILL)
    assert wait_until(lambda: state_of(zombie) == "Z", 10)
    assert _reference_modules_of("watch", zombie) == (3, [])
    # The demo still gets its arguments (and so imports reference/) when it is the command.
    status, modules = _reference_modules_of("demo", "--workers", "1")
    assert status == 2
    assert "trtllm_liveness.demo._demo_run" in modules


def test_scan_of_a_healthy_process_skips_nothing(procs: ProcessTracker) -> None:
    child = procs.sleeper()
    status, data = scan_json("--window", "0", child.pid)
    assert status == 0
    assert data["skipped_reads"] == 0
    (report,) = data["processes"]
    assert report["skipped"] == []
    assert report["cmdline"][-1].endswith("time.sleep(3600)")
    assert data["selection_skipped"] == []


# ----------------------------------------------------------------------------- doctor


def test_doctor_is_listed_and_its_help_gives_one_exit_status_per_verdict() -> None:
    top = run_cli("--help")
    assert top.returncode == 0 and "doctor" in top.stdout
    result = run_cli("doctor", "--help")
    assert result.returncode == 0, result.stderr
    assert "usage: trtllm-liveness doctor" in result.stdout
    lines = result.stdout.splitlines()
    for status, verdict in (("0", "covered"), ("1", "degraded"), ("3", "inert"), ("4", "not installed")):
        assert any(line.split()[:1] == [status] and verdict in line for line in lines), (status, verdict)


def test_doctor_bad_argument_is_a_usage_error() -> None:
    result = run_cli("doctor", "--no-such-option")
    assert result.returncode == 2
    assert len(result.stderr.splitlines()) == 1 and "unrecognized arguments" in result.stderr


# ----------------------------------------------------------------------------- PID 1 in a container


def _in_pid_namespace(tmp_path: Path, pid1_name: str, *cli_args: str) -> subprocess.CompletedProcess[str]:
    """Run ``trtllm-liveness CLI_ARGS`` inside a new PID namespace whose PID 1 is a shell script
    named ``pid1_name`` (its comm), as in a container whose entrypoint is that program."""
    script = tmp_path / pid1_name
    args = " ".join(cli_args)
    # PID 1 waits for the CLI (its child) and passes its status on; the CLI inspects PID 1.
    script.write_text(f"#!/bin/sh\n{CLI} {args}\nexit $?\n")
    script.chmod(0o755)
    return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", str(script)], capture_output=True,
                          text=True, timeout=RUN_TIMEOUT, start_new_session=True)


@needs("unshare")
def test_pid_1_is_accepted_where_it_is_the_server_of_its_own_namespace(tmp_path: Path) -> None:
    # A container without an init: PID 1 is the inference server, which is what the probe means.
    scanned = _in_pid_namespace(tmp_path, "trtllm-serve", "scan", "1", "--window", "0", "--json")
    assert scanned.returncode == 0, scanned.stderr
    assert json.loads(scanned.stdout)["processes"][0]["pid"] == 1
    assert _procfs.pid1_role() == "host-init"  # and here, in the host's namespace, it is refused (above)


@needs("unshare")
def test_pid_1_running_an_init_program_is_refused_with_the_way_out(tmp_path: Path) -> None:
    refused = _in_pid_namespace(tmp_path, "tini", "scan", "1")
    assert refused.returncode == 2
    assert "container's init program" in refused.stderr and "--parent 1" in refused.stderr
    below = _in_pid_namespace(tmp_path, "tini", "scan", "--parent", "1", "--window", "0", "--json")
    assert below.returncode in (0, 1), below.stderr  # accepted: its descendants are the container's
    assert "refusing" not in below.stderr


def test_version_names_the_package_version() -> None:
    from trtllm_liveness import __version__

    result = run_cli("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"trtllm-liveness {__version__}"


def test_autoload_install_status_remove_round_trip(tmp_path: Path) -> None:
    site = str(tmp_path)
    assert run_cli("autoload", "status", "--site", site).returncode == 1  # documented: not installed
    installed = run_cli("autoload", "install", "--site", site)
    assert installed.returncode == 0 and (tmp_path / "trtllm_liveness_autoload.pth").is_file(), installed
    assert run_cli("autoload", "status", "--site", site).returncode == 0
    (tmp_path / "trtllm_liveness_autoload.pth").write_text("import trtllm_liveness.integrations.trtllm_autoload\n")
    outdated = run_cli("autoload", "status", "--site", site)
    assert outdated.returncode == 3 and "outdated" in outdated.stdout  # an older line: rewrite it
    assert run_cli("autoload", "remove", "--site", site).returncode == 0
    assert not (tmp_path / "trtllm_liveness_autoload.pth").exists()
    again = run_cli("autoload", "remove", "--site", site)
    assert again.returncode == 0 and "nothing to remove" in again.stdout
