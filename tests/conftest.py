"""The test session's fixtures and hooks: real processes, tracked by pid, always cleaned up.

Rules (see CONTRIBUTING.md): every process a test starts goes through the ``procs`` fixture
(:class:`~tests.support.process_tracker.ProcessTracker`), which ends it by pid (verified by start
time) at teardown; cgroups made for freezing are thawed and removed in the ``freezer`` fixture's
teardown, and FUSE stalls released and unmounted in the ``fuse_stall`` fixture's, also on failure.
The session hooks fail the run if any tracked process outlived its test, or if the run left
``trtllm-*`` entries in the temp directory, or changed the machine's quarantine marker directory
(``/run/trtllm-liveness``; ``tests/support/leak_checks.py``), and apply the
facility markers (``tests/support/facilities.py``): a test that needs a facility this machine
lacks skips with the reason, or fails where ``TRTLLM_LIVENESS_REQUIRE`` names it.

The reusable support lives in ``tests/support/``: ``facilities`` (``needs``, ``require_or_skip``,
``require_facility``, ``MPI_MARKS``), ``waits`` (``wait_until``, ``WAIT_SCALE``),
``process_tracker`` (``ProcessTracker``, ``state_of``, ``SLEEPER``), ``stuck_processes``
(``Freezer``, ``MemoryCgroup``, ``StuckChild``, ``D_STATE_SOURCES``) and ``leak_checks``.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import tempfile
from collections.abc import Generator, Iterator

import pytest

from tests.support import facilities
from tests.support.facilities import REQUIRE_VAR, item_facilities, require_facility
from tests.support.fuse_stall import FuseStall
from tests.support.leak_checks import LEAKED, MachineDirectoryCheck, TempLeakCheck, directory_state, tempdir_as
from tests.support.leftovers import remove_orphaned_prte_tmpdirs
from tests.support.process_ending import fresh_process_ending  # noqa: F401 - autouse: each test its own ending
from tests.support.process_tracker import ProcessTracker
from tests.support.stuck_processes import (
    D_STATE_SOURCES,
    Freezer,
    MemoryCgroup,
    StuckChild,
    remove_or_report,
)
from trtllm_liveness.demo._fuse_stall import fuse_mounts, remove_leftover_mounts
from trtllm_liveness.quarantine._marker import DEFAULT_QUARANTINE_DIR, MARKER_NAME, QUARANTINE_DIR_VAR

_TEMP_CHECK: list[TempLeakCheck] = []
_MACHINE_QUARANTINE: list[MachineDirectoryCheck] = []


# --------------------------------------------------------------------- fixtures


@pytest.fixture
def procs() -> Iterator[ProcessTracker]:
    """Starts real processes for the test and ends exactly those at teardown."""
    tracker = ProcessTracker()
    try:
        yield tracker
    finally:
        tracker.cleanup()


@pytest.fixture
def freezer() -> Iterator[Freezer]:
    """A cgroup v1 freezer group, thawed and removed at teardown; skips where there is no freezer."""
    require_facility("freezer")
    group = Freezer()
    try:
        yield group
    finally:
        remove_or_report(group)


@pytest.fixture
def memory_cgroup() -> Iterator[MemoryCgroup]:
    """A cgroup v1 memory group limited to 64 MiB, removed at teardown; skips without memory cgroups."""
    require_facility("memcg")
    group = MemoryCgroup(64 * 1024 * 1024)
    try:
        yield group
    finally:
        remove_or_report(group)


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
                LEAKED.append(f"FUSE mount {stall.mountpoint} not removed")


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
        LEAKED.append(f"{request.node.nodeid} left {sorted(left)}")


@pytest.fixture(autouse=True)
def _machine_quarantine_untouched(request: pytest.FixtureRequest) -> Iterator[None]:
    """Name the test after which the machine's quarantine marker directory changed (the session
    check fails the run; see :class:`~tests.support.leak_checks.MachineDirectoryCheck`)."""
    if not _MACHINE_QUARANTINE:
        yield
        return
    check = _MACHINE_QUARANTINE[0]
    before = directory_state(check.path)
    yield
    changed = check.changed(since=before)
    if changed:
        sys.stderr.write(f"\n{request.node.nodeid} touched the machine's quarantine directory: {changed}\n")
        LEAKED.append(f"{request.node.nodeid}: the machine's quarantine directory: {changed}")


# --------------------------------------------------------------------- session hooks


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "facility(*names): needs these facilities "
                                       "(see needs() in tests/support/facilities.py)")
    try:
        facilities.load_required()
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None


def pytest_report_header(config: pytest.Config) -> str:
    return f"{REQUIRE_VAR}: {', '.join(sorted(facilities.REQUIRED)) or '(none: a missing facility skips its tests)'}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    """A test that wedges an engine leaves this machine's quarantine marker in the session's
    directory, as an engine would in ``/run``; a later test's engine would read it at its start (a
    line more in a log a test may count). Each test's marker is removed after every fixture of the
    test was torn down (the ending's joins the quarantine thread that writes it); the session's
    directory only, never the machine's."""
    del item, nextitem
    try:
        return (yield)
    finally:
        if _TEMP_CHECK:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(_TEMP_CHECK[-1].path, "quarantine", MARKER_NAME))


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
        required = [name for name in item_facilities(item) if name in facilities.REQUIRED]
        if required:
            longrepr = report.longrepr
            reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
            report.outcome = "failed"
            report.longrepr = (f"skipped although {REQUIRE_VAR} requires {', '.join(required)}: "
                               f"{reason.removeprefix('Skipped: ')}")
    return report


def pytest_sessionstart(session: pytest.Session) -> None:
    # pytest's own tmp_path root stays where it was: under the session directory the paths of the
    # IPC sockets that tests make in tmp_path would pass the 107-byte limit of a socket address.
    factory = getattr(session.config, "_tmp_path_factory", None)
    if factory is not None:
        factory.getbasetemp()
    check = TempLeakCheck()
    _TEMP_CHECK.append(check)
    # The quarantine marker of engines that tests wedge goes to the session's directory, never to
    # the machine's /run/trtllm-liveness (inherited by every child, removed with the directory; the
    # test hosts give it to their logins too, and have their own /run). A change to the machine's
    # directory fails the run: a test, or something it started, did not get the session's.
    os.environ[QUARANTINE_DIR_VAR] = os.path.join(check.path, "quarantine")
    _MACHINE_QUARANTINE.append(MachineDirectoryCheck(DEFAULT_QUARANTINE_DIR))
    # A run started as a shell's background job has SIGINT ignored, and every child would inherit
    # that (a Python started so never raises KeyboardInterrupt): the tests of Ctrl-C paths would
    # hang. The children get the default disposition, as from a terminal.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # Registered before any configure_mpi_env() of a test, so it runs after that one's removal.
    atexit.register(check.remove)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for directory in {tempfile.gettempdir(), *(check.shared for check in _TEMP_CHECK)}:
        with tempdir_as(directory):  # both look in gettempdir(): the session's and the shared one
            remove_orphaned_prte_tmpdirs()  # bases of launchers this run SIGKILLed
            remove_leftover_mounts()  # FUSE stalls of helper processes that were killed
    if _TEMP_CHECK:
        leaked, shared_new = _TEMP_CHECK[-1].finish()
        LEAKED.extend(f"temporary entry {path} left behind (removed)" for path in leaked)
        if shared_new:
            sys.stderr.write("\nNew trtllm-* entries in the shared temp directory (not TMPDIR; maybe another "
                             "run's):\n" + "\n".join(shared_new) + "\n")
    for machine in _MACHINE_QUARANTINE:
        changed = machine.changed()
        if changed and not any(changed in line for line in LEAKED):
            LEAKED.append(f"the machine's quarantine directory: {changed} during the session")
    if LEAKED:
        sys.stderr.write("\nLEAKED by tests:\n" + "\n".join(LEAKED) + "\n")
        session.exitstatus = 1
