"""The host's quarantine marker and the start-up check, on real processes in real ``D`` state.

A wedged (or unkillable) process recorded in the marker keeps every start-up on the host refused
until it is gone; a marker of another boot, or of processes verifiably gone, is cleared; hostile
or malformed markers are errors (fail closed) or, in an untrusted directory, ignored; nothing here
ever signals a process. Device holders: a stand-in device file held by a process in ``D``.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.fuse_stall import FuseStall
from tests.support.process_tracker import ProcessTracker, state_of
from tests.support.quarantine import config_for, fresh_quarantine_state  # noqa: F401 - an autouse fixture
from tests.support.stuck_processes import D_STATE_SOURCES, Freezer, StuckChild
from tests.support.waits import WAIT_SCALE, wait_until
from trtllm_liveness import LivenessConfig
from trtllm_liveness._events import EventKind, WorkerEvent
from trtllm_liveness.process import _procfs
from trtllm_liveness.process._identity import capture_identity
from trtllm_liveness.quarantine._device_holders import find_stuck_device_holders, parse_patterns
from trtllm_liveness.quarantine._host_policy import (
    HostQuarantinedError,
    check_host,
    check_host_at_start,
    quarantine_host,
)
from trtllm_liveness.quarantine._marker import (
    DEFAULT_QUARANTINE_DIR,
    MARKER_NAME,
    QUARANTINE_DIR_VAR,
    MarkerError,
    MarkerVerdict,
    ProcessVerdict,
    QuarantinedProcess,
    inspect_marker,
    read_marker,
    resolve_directory,
    write_marker,
)

pytestmark = [pytest.mark.timeout(60)]


def wedge_event(pid: int, kind: EventKind = EventKind.WEDGED) -> WorkerEvent:
    return WorkerEvent(kind, capture_identity(1, pid), "thread in D for 0.5s", wchan="request_wait_answer")


def record(directory: Path, pid: int, kind: EventKind = EventKind.WEDGED) -> Path:
    worker = quarantine_host(config_for(directory), [wedge_event(pid, kind)])
    assert worker is not None
    worker.join(10 * WAIT_SCALE)
    assert not worker.is_alive()
    return directory / MARKER_NAME


def refusal(config: LivenessConfig) -> str:
    try:
        check_host_at_start(config)
    except HostQuarantinedError as exc:
        return str(exc)
    return ""


def test_a_wedged_process_is_recorded_and_refuses_start_until_it_is_gone(
        stuck_child: StuckChild, tmp_path: Path) -> None:
    pid = stuck_child.popen.pid
    start = _procfs.read_start_time(pid)
    marker_path = record(tmp_path / "q", pid)

    document = json.loads(marker_path.read_text())
    assert document["boot_id"] == _procfs.boot_id() != ""
    assert document["pid_namespace"] == _procfs.pid_namespace_inode("self")
    assert [(item["pid"], item["start_time"], item["state"]) for item in document["processes"]] == [(pid, start, "D")]
    assert document["processes"][0]["wchan"] == "request_wait_answer"
    assert "wedged" in document["reason"] and document["time"].endswith("Z")
    assert stat.S_IMODE(marker_path.stat().st_mode) == 0o644  # every user of the host reads it
    assert stat.S_IMODE(marker_path.parent.stat().st_mode) == 0o755
    assert sorted(os.listdir(marker_path.parent)) == [MARKER_NAME]  # no temporary file left

    with pytest.raises(HostQuarantinedError) as refused:
        check_host_at_start(config_for(tmp_path / "q"))
    message = str(refused.value)
    assert f"pid {pid} is still wedged" in message and "recycle the host" in message
    assert marker_path.exists()

    # Killed while stuck: SIGKILL pending, still there. The verdict says unkillable.
    # (A FUSE waiter passes through R on its way back into D: wait for the settled state.)
    stuck_child.popen.kill()
    assert wait_until(lambda: f"pid {pid} is still unkillable" in refusal(config_for(tmp_path / "q")), 5)

    stuck_child.release()
    stuck_child.popen.wait(10 * WAIT_SCALE)
    check_host_at_start(config_for(tmp_path / "q"))  # gone: the start goes on ...
    assert not marker_path.exists()  # ... and the marker is cleared


def test_a_live_recorded_process_not_in_d_still_blocks(procs: ProcessTracker, tmp_path: Path) -> None:
    child = procs.sleeper()
    record(tmp_path, child.pid)
    status = inspect_marker(str(tmp_path))
    assert status.verdict is MarkerVerdict.QUARANTINED
    assert [check.verdict for check in status.checks] == [ProcessVerdict.ALIVE]
    child.kill()
    child.wait(10)
    status = inspect_marker(str(tmp_path))
    assert (status.verdict, status.checks[0].verdict) == (MarkerVerdict.GONE, ProcessVerdict.GONE)


def test_a_reused_pid_is_no_longer_the_recorded_process(procs: ProcessTracker, tmp_path: Path) -> None:
    child = procs.sleeper()
    namespace = _procfs.pid_namespace_inode("self")
    real_start = _procfs.read_start_time(child.pid)
    write_marker(str(tmp_path), [QuarantinedProcess(child.pid, real_start + 1, namespace, 1, "D", "", "wedged", "x")],
                 "test")
    status = inspect_marker(str(tmp_path))
    assert [check.verdict for check in status.checks] == [ProcessVerdict.PID_REUSED]
    assert status.clearable
    assert state_of(child.pid) == "S"  # looked at, never signalled


def test_a_marker_of_another_boot_is_stale_and_cleared(procs: ProcessTracker, tmp_path: Path) -> None:
    child = procs.sleeper()
    path = record(tmp_path, child.pid)
    document = json.loads(path.read_text())
    document["boot_id"] = "00000000-0000-0000-0000-000000000000"
    path.write_text(json.dumps(document))
    check = check_host(config_for(tmp_path), clear=True)
    assert check.marker is not None and check.marker.verdict is MarkerVerdict.STALE_BOOT
    assert not check.quarantined and not path.exists()


def test_processes_of_another_pid_namespace_cannot_be_verified(procs: ProcessTracker, tmp_path: Path) -> None:
    child = procs.sleeper()
    path = record(tmp_path, child.pid)
    document = json.loads(path.read_text())
    document["processes"][0]["pid_namespace"] = 4026531836 + 7  # the next container's namespace
    path.write_text(json.dumps(document))
    with pytest.raises(HostQuarantinedError, match="cannot be verified from here"):
        check_host_at_start(config_for(tmp_path))
    assert path.exists()


def test_override_starts_on_a_quarantined_host_with_an_error(procs: ProcessTracker, tmp_path: Path,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    child = procs.sleeper()
    record(tmp_path, child.pid)
    with caplog.at_level(logging.ERROR, logger="trtllm_liveness"):
        check_host_at_start(config_for(tmp_path, quarantine_override=True))
    assert any("quarantine_override=1" in item.message for item in caplog.records)
    assert (tmp_path / MARKER_NAME).exists()


def test_restartable_events_and_remote_ranks_write_no_marker(procs: ProcessTracker, tmp_path: Path) -> None:
    child = procs.sleeper()
    assert quarantine_host(config_for(tmp_path), [wedge_event(child.pid, EventKind.DIED)]) is None
    remote = WorkerEvent(EventKind.WEDGED, capture_identity(1, child.pid)._replace(hostname="elsewhere"), "x")
    worker = quarantine_host(config_for(tmp_path), [remote])
    if worker is not None:
        worker.join(10)
    assert not (tmp_path / MARKER_NAME).exists()
    assert worker is None  # nothing to do here: the rank's own host's agent quarantines that host


def test_a_second_failure_is_merged_into_the_marker(procs: ProcessTracker, tmp_path: Path) -> None:
    first, second = procs.sleeper(), procs.sleeper()
    record(tmp_path, first.pid)
    record(tmp_path, second.pid, EventKind.UNKILLABLE)
    marker = read_marker(str(tmp_path))
    assert marker is not None
    assert sorted(process.pid for process in marker.processes) == sorted([first.pid, second.pid])


# ----------------------------------------------------------------------------- hostile input


def _valid_document(pid: int) -> dict[str, object]:
    return {"version": 1, "boot_id": _procfs.boot_id(), "hostname": "h", "pid_namespace": 1, "writer_pid": 5,
            "wall_time": time.time(), "reason": "r",
            "processes": [{"pid": pid, "start_time": 1, "pid_namespace": _procfs.pid_namespace_inode("self"),
                           "rank": 0, "state": "D", "wchan": "", "kind": "wedged", "cause": ""}]}


def _with(pid: object = 4242, **changes: object) -> bytes:
    document = _valid_document(4242)
    process = document["processes"][0]  # type: ignore[index]
    process["pid"] = pid
    document.update(changes)
    return json.dumps(document).encode()


HOSTILE = {
    "not-json": b"{not json",
    "a-list": b"[1, 2]",
    "wrong-version": _with(version=2),
    "pid-0": _with(0),
    "pid-1": _with(1),
    "pid-bool": _with(True),
    "pid-string": _with("4242"),
    "pid-huge": _with(1 << 40),
    "no-processes": _with(processes=[]),
    "reason-not-text": _with(reason=["x"]),
    "too-large": b" " * (70 << 10) + b"{}",
    "not-utf8": b"\xff\xfe",
}


@pytest.mark.parametrize("content", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_malformed_marker_refuses_start_with_a_clear_error(content: bytes, tmp_path: Path) -> None:
    (tmp_path / MARKER_NAME).write_bytes(content)
    status = inspect_marker(str(tmp_path))
    assert status.verdict is MarkerVerdict.MALFORMED and status.quarantined
    with pytest.raises(MarkerError, match=MARKER_NAME):
        read_marker(str(tmp_path))
    with pytest.raises(HostQuarantinedError, match=f"{MARKER_NAME} malformed"):
        check_host_at_start(config_for(tmp_path))
    assert (tmp_path / MARKER_NAME).exists()  # never removed without an operator


def test_a_marker_naming_this_process_is_not_this_process(tmp_path: Path) -> None:
    (tmp_path / MARKER_NAME).write_bytes(_with(os.getpid()))
    status = inspect_marker(str(tmp_path))
    assert [check.verdict for check in status.checks] == [ProcessVerdict.PID_REUSED]


def test_a_symlinked_marker_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.json"
    target.write_bytes(_with())
    (tmp_path / "q").mkdir()
    (tmp_path / "q" / MARKER_NAME).symlink_to(target)
    status = inspect_marker(str(tmp_path / "q"))
    assert status.verdict is MarkerVerdict.MALFORMED and "symlink" in status.error


def test_a_fifo_marker_never_blocks(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / MARKER_NAME)
    status = inspect_marker(str(tmp_path))
    assert status.verdict is MarkerVerdict.MALFORMED and "not a regular file" in status.error


@pytest.mark.parametrize("kind", ["symlink", "world-writable", "foreign-owner"])
def test_an_untrusted_directory_is_ignored_and_never_written(kind: str, tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    real = tmp_path / "real"
    real.mkdir()
    content = _with()
    (real / MARKER_NAME).write_bytes(content)
    directory = real
    if kind == "symlink":
        directory = tmp_path / "link"
        directory.symlink_to(real)
    elif kind == "world-writable":
        real.chmod(0o777)
    else:
        os.chown(real, 12345, 12345)
    with caplog.at_level(logging.WARNING, logger="trtllm_liveness"):
        check = check_host(config_for(directory), clear=True)
    assert check.marker is not None and check.marker.verdict is MarkerVerdict.UNTRUSTED
    assert not check.quarantined
    assert any("not trusted" in item.message for item in caplog.records)
    with pytest.raises(MarkerError, match="not trusted"):
        write_marker(str(directory), [], "x")
    assert (real / MARKER_NAME).read_bytes() == content  # neither cleared nor rewritten


def test_an_empty_directory_setting_turns_the_marker_off(procs: ProcessTracker, tmp_path: Path) -> None:
    child = procs.sleeper()
    config = LivenessConfig(enabled=True, quarantine_dir="", quarantine_devices="")
    assert not check_host(config, clear=True).quarantined
    worker = quarantine_host(config, [wedge_event(child.pid)])
    assert worker is not None
    worker.join(10)
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------- device holders


@dataclass
class DeviceHolderChild:
    popen: subprocess.Popen[bytes]
    device: Path
    stick: Callable[[], None]
    release: Callable[[], None]


HOLD_CODE = """
import os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
sys.stdout.write("ready\\n"); sys.stdout.flush()
sys.stdin.readline()
if len(sys.argv) > 2:
    os.stat(sys.argv[2])  # a FUSE lookup nobody answers: D
time.sleep(3600)
"""


@pytest.fixture(params=D_STATE_SOURCES)
def device_holder(request: pytest.FixtureRequest, procs: ProcessTracker, tmp_path: Path) -> DeviceHolderChild:
    """A child holding a stand-in device file open, put into ``D`` by :attr:`stick`."""
    device = tmp_path / "nvidia-standin0"
    device.write_bytes(b"")
    stall: FuseStall | None = None
    argv = [sys.executable, "-c", HOLD_CODE, str(device)]
    if request.param == "fuse":
        stall = request.getfixturevalue("fuse_stall")
        argv.append(stall.new_path())
    child = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
    procs.popens.append(child)
    procs.track(child.pid)
    assert child.stdout is not None and child.stdout.readline() == b"ready\n"
    if stall is not None:
        fuse = stall

        def stick() -> None:
            assert child.stdin is not None
            child.stdin.write(b"go\n")
            child.stdin.flush()
            assert fuse.wait_held(child.pid, 10 * WAIT_SCALE)

        return DeviceHolderChild(child, device, stick, fuse.release)
    freezer: Freezer = request.getfixturevalue("freezer")
    freezer.add(child.pid)

    def freeze() -> None:
        assert freezer.freeze()

    return DeviceHolderChild(child, device, freeze, freezer.thaw)


def test_a_device_holder_in_d_refuses_start_and_a_healthy_one_does_not(device_holder: DeviceHolderChild,
                                                                        tmp_path: Path) -> None:
    config = config_for(tmp_path / "q", quarantine_devices=f"/nonexistent/x*:{tmp_path}/nvidia-standin*")
    assert parse_patterns(config.quarantine_devices) == ("/nonexistent/x*", f"{tmp_path}/nvidia-standin*")
    check_host_at_start(config)  # holding the device but not in D: a healthy process

    device_holder.stick()
    holders = find_stuck_device_holders(parse_patterns(config.quarantine_devices), resample_s=0.1)
    assert [(holder.pid, holder.devices) for holder in holders] == [(device_holder.popen.pid,
                                                                     (str(device_holder.device),))]
    with pytest.raises(HostQuarantinedError, match=f"pid {device_holder.popen.pid} .*nvidia-standin0"):
        check_host_at_start(config)
    assert not check_host(config_for(tmp_path / "q", quarantine_devices="/dev/nonexistent*"), clear=False).quarantined

    device_holder.release()
    assert wait_until(lambda: not find_stuck_device_holders(parse_patterns(config.quarantine_devices),
                                                            resample_s=0.05), 10)
    check_host_at_start(config)


def test_the_default_directory_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(QUARANTINE_DIR_VAR, str(tmp_path / "env-q"))
    assert resolve_directory(DEFAULT_QUARANTINE_DIR) == str(tmp_path / "env-q")
    assert resolve_directory("/srv/q") == "/srv/q"  # an explicit setting wins
    assert resolve_directory("") == ""  # off stays off
    monkeypatch.setenv(QUARANTINE_DIR_VAR, "relative")  # not an absolute path: ignored
    assert resolve_directory(DEFAULT_QUARANTINE_DIR) != "relative"


def test_concurrent_writers_lose_no_record(procs: ProcessTracker, tmp_path: Path) -> None:
    """Eight processes record one stuck process each at the same moment (two engines of one host
    hit by one driver wedge): the marker must name all eight. Without the directory lock the
    read-merge-rename of one writer drops what another renamed meanwhile."""
    go = tmp_path / "go"
    code = textwrap.dedent(f"""
        import os, sys, time
        from trtllm_liveness.quarantine._marker import QuarantinedProcess, write_marker
        while not os.path.exists({str(go)!r}):
            time.sleep(0.001)
        for attempt in range(5):  # each writer several times: more chances to interleave
            write_marker({str(tmp_path)!r}, [QuarantinedProcess(100000 + int(sys.argv[1]), 1, 1, None, "D",
                         "w", "wedged", "test")], f"writer {{sys.argv[1]}}")
    """)
    writers = [subprocess.Popen([sys.executable, "-c", code, str(index)], start_new_session=True)
               for index in range(8)]
    for writer in writers:
        procs.popens.append(writer)
        procs.track(writer.pid)
    go.touch()
    for writer in writers:
        assert writer.wait(60) == 0
    marker = read_marker(str(tmp_path))
    assert marker is not None
    assert sorted(process.pid for process in marker.processes) == [100000 + index for index in range(8)]


@pytest.mark.freezer
def test_a_device_holder_that_wakes_between_the_samples_is_not_stuck(procs: ProcessTracker, freezer: Freezer,
                                                                      tmp_path: Path) -> None:
    """In D at both samples but awake in between (a healthy neighbour streaming weights from a slow
    mount sleeps in D again and again): not a wedge. Made with the freezer: frozen, thawed and
    frozen again between the check's two samples."""
    device = tmp_path / "nvidia-standin0"
    device.write_bytes(b"")
    child = subprocess.Popen([sys.executable, "-c", HOLD_CODE, str(device)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, start_new_session=True)
    procs.popens.append(child)
    procs.track(child.pid)
    assert child.stdout is not None and child.stdout.readline() == b"ready\n"
    freezer.add(child.pid)
    assert freezer.freeze()
    patterns = parse_patterns(f"{tmp_path}/nvidia-standin*")
    assert [holder.pid for holder in find_stuck_device_holders(patterns, resample_s=0.2)] == [child.pid]

    woken = []

    def wake_and_sleep_again() -> None:  # between the samples: the first one found it in D
        freezer.thaw()
        assert wait_until(lambda: state_of(child.pid) != "D", 10)  # it runs: a context switch
        assert freezer.freeze()
        woken.append(True)

    holders = find_stuck_device_holders(patterns, resample_s=0.2, between=wake_and_sleep_again)
    assert woken == [True]  # the first sample found the process in D, so the second decided
    assert state_of(child.pid) == "D"  # in D at the second sample too
    assert holders == ()
    freezer.thaw()


def test_root_reads_another_users_fallback_marker_only_as_that_user(procs: ProcessTracker) -> None:
    """A server running as a user (a Slurm job) records its wedge in its own fallback directory;
    root's health check finds it there, trusting the directory and the marker only when they
    belong to that very uid."""
    if os.geteuid() != 0:
        pytest.skip("needs root (chown to another uid)")
    from trtllm_liveness.quarantine._host_policy import _user_marker
    from trtllm_liveness.quarantine._marker import user_marker_directories

    child = procs.sleeper()
    uid = 4_000_000 + os.getpid() % 100_000  # a uid no account has
    directory = Path(f"/tmp/trtllm-liveness-{uid}")
    directory.mkdir(mode=0o755)
    try:
        document = _valid_document(child.pid)
        document["processes"][0]["start_time"] = _procfs.read_start_time(child.pid)  # type: ignore[index]
        (directory / MARKER_NAME).write_text(json.dumps(document))
        os.chown(directory / MARKER_NAME, uid, uid)
        os.chown(directory, uid, uid)
        assert (str(directory), uid) in user_marker_directories()
        assert inspect_marker(str(directory)).verdict is MarkerVerdict.UNTRUSTED  # neither root's nor ours
        assert inspect_marker(str(directory), owner=uid).verdict is MarkerVerdict.QUARANTINED
        assert inspect_marker(str(directory), owner=uid + 1).verdict is MarkerVerdict.UNTRUSTED
        # Any user writes their own directory: a marker there counts only for that user's own
        # processes (the sleeper is root's), and a malformed one is ignored, not a quarantine.
        assert _user_marker(str(directory), uid) is None
        theirs = subprocess.Popen(["sleep", "3600"], user=uid,
                                  start_new_session=True)
        procs.popens.append(theirs)
        procs.track(theirs.pid)
        document["processes"][0].update(pid=theirs.pid,  # type: ignore[index]
                                         start_time=_procfs.read_start_time(theirs.pid))
        (directory / MARKER_NAME).write_text(json.dumps(document))
        found = _user_marker(str(directory), uid)
        assert found is not None and [check.process.pid for check in found.blocking] == [theirs.pid]
        (directory / MARKER_NAME).write_text("{not json")
        assert inspect_marker(str(directory), owner=uid).verdict is MarkerVerdict.MALFORMED
        assert _user_marker(str(directory), uid) is None
    finally:
        for entry in directory.iterdir():
            entry.unlink()
        directory.rmdir()
