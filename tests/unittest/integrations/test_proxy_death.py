"""When the proxy process dies, every rank of its engine exits within a bound.

The ranks' proxy-death watch (``integrations/trtllm/_worker_entry.py``) holds a pidfd on the
proxy, verified by start time. Tested with real processes on both session kinds of the
upstream-shaped fakes (tests/fakes/trtllm_main, tests/fakes/trtllm_v12), driven through
upstream's LLM API (``LLM(..., executor_cls=liveness_executor_class())``) by
``tests/programs/proxy_death_child.py``; each kind also has a baseline with liveness off, so the
tests with liveness on can fail: under ``mpirun`` the ranks a real user is left with; with spawned
ranks, which Open MPI often (not always) ends by itself, the exit statuses that tell its end from
the watch's. Open MPI runs with its own default, no ULFM (``OMPI_MCA_mpi_ft_enable=0``; the
project's ``configure_mpi_env`` would turn it on): with ULFM the subordinates' MPI calls fail on
the dead peer and end those ranks by themselves, which is not what a user without it sees.
``TRTLLM_LIVENESS_PROXY_WATCH=0`` in the environment turns the watch off in every rank: the
liveness tests then fail (that is how they were checked).

Every wait has a deadline; ``EXIT_BOUND_S`` is the bound the ranks are held to (with liveness
they take milliseconds: the figures are measured by ``scripts/proxy_death_figures.py``, not here).
Survivors of a baseline are killed by the test through pidfds verified by start time, and each
child's whole session is killed at the end (``HelperProcess.close``).

The in-process tests at the end check the watch itself on real processes: verified at start,
one watch per proxy, an unverifiable proxy never ends a rank, the procfs fallback without pidfd.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.children import HelperProcess
from tests.support.facilities import MPI_MARKS, needs
from tests.support.process_tracker import ProcessTracker
from tests.support.waits import WAIT_SCALE, wait_until
from trtllm_liveness._errors import AccessDenied
from trtllm_liveness.integrations.trtllm import _worker_entry
from trtllm_liveness.integrations.trtllm._worker_entry import PROXY_DIED_EXIT_STATUS, start_proxy_death_watch
from trtllm_liveness.process import _pidfd
from trtllm_liveness.process._identity import local_hostname, local_pid_namespace
from trtllm_liveness.process._procfs import boot_id

EXIT_BOUND_S = 5.0  # every rank must be gone this long (scaled) after the proxy's SIGKILL
START_S = 60.0  # the engine's start-up on 2 shared cores
OPEN_MPI_DEFAULT = {"OMPI_MCA_mpi_ft_enable": "0"}

TREES = pytest.mark.parametrize("tree", ["trtllm_main", "trtllm_v12"])


def mpi_test(test: Any) -> Any:
    """Marks of a test that starts real MPI jobs."""
    for mark in MPI_MARKS:
        test = mark(test)
    return test


class Watched:
    """Pidfds on real processes, opened and then verified against the start times reported."""

    def __init__(self, entries: list[list[int]]) -> None:
        self.fds: dict[int, int] = {}
        try:
            for pid, start_time in entries:
                self.fds[pid] = _pidfd.open_verified_pidfd(pid, start_time)
        except BaseException:
            self.close()
            raise

    def alive(self) -> list[int]:
        return [pid for pid, fd in self.fds.items() if not _pidfd.is_exited(fd)]

    def wait_gone(self, timeout: float) -> list[int]:
        """Wait up to ``timeout`` (scaled) for every process to exit; those still alive."""
        deadline = time.monotonic() + timeout * WAIT_SCALE
        while (alive := self.alive()) and time.monotonic() < deadline:
            poller = select.poll()
            for pid in alive:
                poller.register(self.fds[pid], select.POLLIN)
            poller.poll(max(1, int((deadline - time.monotonic()) * 1000)))
        return alive

    def kill(self, pids: list[int] | None = None) -> None:
        """SIGKILL through the verified pidfds (never a recycled pid)."""
        for pid in self.fds if pids is None else pids:
            _pidfd.send_signal(self.fds[pid], signal.SIGKILL)

    def close(self) -> None:
        for fd in self.fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds.clear()


@contextlib.contextmanager
def watched(entries: list[list[int]]) -> Iterator[Watched]:
    processes = Watched(entries)
    try:
        yield processes
    finally:
        processes.kill(processes.alive())  # a baseline's survivors, or anything left on failure
        processes.close()


def _track(procs: ProcessTracker, entries: list[list[int]]) -> None:
    # The tracker ends them too (by pid and start time) and reports any that outlives the test.
    for pid, start_time in entries:
        procs.pids[pid] = start_time


def _rank_log(job: HelperProcess, rank: int) -> str:
    """What world rank ``rank`` of an mpirun job wrote to its stderr (proxy_death_child.py puts
    it in a file: mpirun's forwarding may drop what a rank wrote just before it ended)."""
    try:
        with open(os.path.join(job.tmpdir, f"rank-{rank}.log"), errors="replace") as handle:
            return handle.read()
    except FileNotFoundError:
        return ""


def _watch_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "is gone; ending this rank" in line]


# --------------------------------------------------------------------------- MpiCommSession (mpirun)

# mpirun's default ends the whole job when one rank dies (rank 0's SIGKILL included), and so
# would a rank 0 death under ULFM here (the subordinates' broadcast fails and ends them): both
# would pass without the extension and prove nothing. A user whose ranks survive their server
# runs a launcher that does not end the job on one rank's death: PRRTE's "recoverable" runtime
# option (the application takes responsibility for failures; Slurm's srun without
# --kill-on-bad-exit behaves alike), with the subordinates waiting on something that never notices a
# dead peer (here the shared-memory broadcast of the engine's step loop; in a real engine a NCCL
# collective). The baseline test shows they then stay, spinning, for as long as one looks.
RECOVERABLE = ["--runtime-options", "recoverable"]


def _comm_job(tree: str, liveness: bool, *, n: int = 3, outsider: bool = False,
              env: dict[str, str] | None = None) -> HelperProcess:
    options = {"session": "comm", "tree": tree, "liveness": liveness, "outsider": outsider}
    return HelperProcess("mpirun_exec", {"mpirun_args": RECOVERABLE, "n": n, "module": "proxy_death_child",
                                         "options": options}, {**OPEN_MPI_DEFAULT, **(env or {})})


@pytest.mark.timeout(120)
@mpi_test
@pytest.mark.parametrize(("tree", "outsider"), [("trtllm_main", False), ("trtllm_v12", False), ("trtllm_v12", True)],
                         ids=["main", "v12", "v12-subcomm"])
def test_mpirun_ranks_exit_when_the_proxy_is_killed(procs: ProcessTracker, tree: str, outsider: bool) -> None:
    """``mpirun -n 3`` (``-n 4`` with an outsider rank): rank 0 is the proxy (``MpiCommSession``;
    its own rank runs in its thread pool), ranks 1-2 serve. SIGKILL of rank 0: ranks 1 and 2 end
    by the watch (one line each naming the dead proxy's pid: the pid they learned is rank 0's),
    and mpirun, which reaps them, ends with their status 75.

    ``v12-subcomm``: the session runs on a sub-communicator of ranks 0-2 and world rank 3 never
    takes part: the engine starts (on 1.2.x the workers gather identities over
    the session's communicator, never ``COMM_WORLD``), the watch works, and the outsider, no rank
    of the session, is left alone (the test kills it)."""
    with _comm_job(tree, True, n=4 if outsider else 3, outsider=outsider) as job:
        record = job.read_record(START_S * WAIT_SCALE, "ready")
        proxy_pid = record["proxy"][0]
        by_rank = {rank: [pid, start] for rank, pid, start in record["ranks"]}
        session_ranks = [by_rank[1], by_rank[2]]
        others = [by_rank[3]] if outsider else []
        _track(procs, [record["proxy"], *session_ranks, *others])
        with watched([record["proxy"]]) as proxy, watched(session_ranks) as ranks, watched(others) as outside:
            proxy.kill()
            left = ranks.wait_gone(EXIT_BOUND_S)
            status = None if outsider else job.wait_exit(EXIT_BOUND_S * WAIT_SCALE)
            assert left == [], f"ranks {left} outlived their proxy {proxy_pid}:\n{job.stderr_tail()}"
            for rank in (1, 2):
                log = _rank_log(job, rank)
                expected = (f"proxy process (pid {proxy_pid}) is gone; ending this rank (pid {by_rank[rank][0]}) "
                            f"with status {PROXY_DIED_EXIT_STATUS}")
                assert sum(expected in line for line in _watch_lines(log)) == 1, log[-4000:]
            if outsider:
                assert outside.alive() == [by_rank[3][0]], "the outsider rank is no rank of the session"
            else:
                assert status == PROXY_DIED_EXIT_STATUS, job.stderr_tail()  # mpirun: its ranks' status
        assert job.close() == []


@pytest.mark.timeout(120)
@mpi_test
def test_mpirun_ranks_outlive_a_killed_proxy_without_liveness(procs: ProcessTracker) -> None:
    """Baseline (liveness off, same launch): after rank 0's SIGKILL, ranks 1 and 2 are still there
    once the bound the test above holds them to has passed, and mpirun with them. The test kills
    them (verified pidfds)."""
    with _comm_job("trtllm_main", False) as job:
        record = job.read_record(START_S * WAIT_SCALE, "ready")
        session_ranks = [[pid, start] for _rank, pid, start in record["ranks"]]
        _track(procs, [record["proxy"], *session_ranks])
        with watched([record["proxy"]]) as proxy, watched(session_ranks) as ranks:
            proxy.kill()
            assert proxy.wait_gone(EXIT_BOUND_S) == []
            left = ranks.wait_gone(EXIT_BOUND_S)
            assert sorted(left) == sorted(pid for pid, _ in session_ranks), job.stderr_tail()
            assert job.alive()
            assert _watch_lines(_rank_log(job, 1) + _rank_log(job, 2)) == []
        assert job.close() == []


@pytest.mark.timeout(120)
@mpi_test
@pytest.mark.parametrize("tree", ["trtllm_main", "trtllm_v12"])
def test_a_clean_mpirun_job_end_keeps_every_status_zero(procs: ProcessTracker, tree: str) -> None:
    """With the watch in every rank, a job that ends well (rank 0, the proxy, shuts down and
    exits, and may do so before the other ranks have finished their own exit) ends with status 0
    everywhere: no rank is ended by its proxy's normal exit. On 1.2.x the extension watches the
    comm session's ranks itself (side channel); its healthy shutdown must still never signal them:
    they belong to mpirun's job, not to the proxy (before: SIGTERM after the grace, status 143)."""
    options = {"session": "comm", "tree": tree, "liveness": True, "clean_end": True}
    with HelperProcess("mpirun_exec", {"mpirun_args": [], "n": 3, "module": "proxy_death_child",
                                       "options": options}, OPEN_MPI_DEFAULT) as job:
        record = job.read_record(START_S * WAIT_SCALE, "done")
        _track(procs, [record["proxy"], *[[pid, start] for _rank, pid, start in record["ranks"]]])
        assert record["tokens"] == 4
        # The mpirun-launched ranks are watched on both lines (main registers none of a comm
        # session's ranks itself: the side channel does; rank 0 is the proxy's own pid, dropped).
        assert record["watched"] == [1, 2], record
        status = job.wait_exit(START_S * WAIT_SCALE)
        log = job.stderr_tail(40000)
        assert status == 0, log[-4000:]
        assert _watch_lines(log + _rank_log(job, 1) + _rank_log(job, 2)) == [], log[-4000:]
        assert job.close() == []


# --------------------------------------------------------------------------- MpiPoolSession (spawn)

# The proxy spawns its ranks through MPIPoolExecutor: proxy -> prte -> ranks, each rank in a process
# group of its own. Open MPI often ends such ranks by itself here: after a SIGKILL of the proxy
# alone prte ends the spawned job (its keepalive pipe from the proxy closes; ~0.26 s), so that case
# cannot show the watch at all. After the proxy and its prte die together (a supervisor's SIGKILL of
# the server's process group, which the ranks' own groups escape) each rank's MPI usually aborts once
# it loses its PMIx server (~2.2 s, status 14 or 195), but not always: in about one run of five the
# leader rank (waiting on its request queue) was still there 10 s later (scripts/proxy_death_figures.py).
# So the tests tell the watch's end (milliseconds, status 75) from Open MPI's by the exit status.
# The statuses are read by tests/programs/subreaper.py, which the child runs under, so that the
# orphaned ranks are reparented to it: the test process is not their parent. (After a SIGKILL of
# the proxy alone, prte reaps the ranks: no status can be read there.)
OPEN_MPI_ABORT = 14  # a rank whose MPI aborts on a lost peer (MPI_ERRORS_ARE_FATAL)


def _pool_job(tree: str, liveness: bool, env: dict[str, str] | None = None) -> HelperProcess:
    options = {"session": "pool", "tree": tree, "liveness": liveness, "workers": 2}
    argv = [sys.executable, "-m", "tests.programs.proxy_death_child", json.dumps(options)]
    return HelperProcess("subreaper", {"argv": argv, "linger_s": 110}, {**OPEN_MPI_DEFAULT, **(env or {})})


def _reaped(job: HelperProcess, pids: list[int], timeout: float) -> dict[int, int]:
    """Exit statuses the subreaper reports for ``pids`` (waits up to ``timeout`` for them all)."""
    found: dict[int, int] = {}
    deadline = time.monotonic() + timeout * WAIT_SCALE
    while set(pids) - set(found):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            record = job.read_record(remaining, "reaped")
        except TimeoutError:
            break
        found[int(record["reaped"])] = int(record["status"])
    return {pid: status for pid, status in found.items() if pid in pids}


def _kill_proxy_and_prte(record: dict[str, Any]) -> None:
    # prte first: once the proxy is gone alone, prte ends the ranks itself (see above).
    with watched(record["prte"]) as prte, watched([record["proxy"]]) as proxy:
        prte.kill()
        proxy.kill()
        assert prte.wait_gone(EXIT_BOUND_S) == [] and proxy.wait_gone(EXIT_BOUND_S) == []


@pytest.mark.timeout(120)
@mpi_test
@TREES
def test_spawned_ranks_exit_when_the_proxy_and_its_prte_are_killed(procs: ProcessTracker, tree: str) -> None:
    """``MpiPoolSession`` (2 spawned ranks): the proxy and its prte are SIGKILLed; both ranks are
    gone within the bound, ended by the watch (status 75). A rank whose MPI noticed its peer's end
    first may end with Open MPI's abort (14) instead: at least one must be the watch's."""
    with _pool_job(tree, True) as job:
        job.read_record(START_S * WAIT_SCALE, "reaper")
        record = job.read_record(START_S * WAIT_SCALE, "ready")
        entries = [[pid, start] for _rank, pid, start in record["ranks"]]
        assert len(entries) == 2 and len(record["prte"]) == 1, record
        _track(procs, [record["proxy"], *record["prte"], *entries])
        with watched(entries) as ranks:
            _kill_proxy_and_prte(record)
            left = ranks.wait_gone(EXIT_BOUND_S)
            assert left == [], f"ranks {left} outlived their proxy:\n{job.stderr_tail()}"
        statuses = _reaped(job, [pid for pid, _ in entries], EXIT_BOUND_S)
        assert sorted(statuses) == sorted(pid for pid, _ in entries), (statuses, job.stderr_tail())
        assert PROXY_DIED_EXIT_STATUS in statuses.values(), statuses
        assert set(statuses.values()) <= {PROXY_DIED_EXIT_STATUS, OPEN_MPI_ABORT}, statuses
        assert job.close() == []


@pytest.mark.timeout(120)
@mpi_test
def test_spawned_ranks_without_liveness_never_end_with_status_75(procs: ProcessTracker) -> None:
    """Baseline (liveness off, same kill): whatever ends the ranks (Open MPI's abort, or the test's
    SIGKILL of a rank still there after the bound: the one a user is left with), it is never
    status 75, so the status the test above requires is the watch's."""
    with _pool_job("trtllm_main", False) as job:
        job.read_record(START_S * WAIT_SCALE, "reaper")
        record = job.read_record(START_S * WAIT_SCALE, "ready")
        entries = [[pid, start] for _rank, pid, start in record["ranks"]]
        _track(procs, [record["proxy"], *record["prte"], *entries])
        with watched(entries) as ranks:
            _kill_proxy_and_prte(record)
            left = ranks.wait_gone(EXIT_BOUND_S)
            ranks.kill(left)  # survivors (verified pidfds); reaped below with status -9
        statuses = _reaped(job, [pid for pid, _ in entries], EXIT_BOUND_S)
        assert sorted(statuses) == sorted(pid for pid, _ in entries), statuses
        assert PROXY_DIED_EXIT_STATUS not in statuses.values(), statuses
        assert job.close() == []


# --------------------------------------------------------------------------- the watch, in process


@pytest.fixture
def fresh_watches(monkeypatch: pytest.MonkeyPatch) -> None:
    # The registry is per process (one watch per proxy); each test starts with an empty one and
    # its own exit flag, so the pytest process's state is never touched.
    monkeypatch.setattr(_worker_entry, "_WATCHES", {})
    monkeypatch.setattr(_worker_entry, "_EXITING", threading.Event())


def _identity_of(pid: int) -> list[Any]:
    from trtllm_liveness.process._procfs import read_start_time

    return [pid, read_start_time(pid), local_hostname(), local_pid_namespace(), boot_id()]


class Ended:
    def __init__(self) -> None:
        self.pids: list[int] = []
        self.event = threading.Event()

    def __call__(self, pid: int) -> None:
        self.pids.append(pid)
        self.event.set()


@pytest.mark.timeout(30)
@pytest.mark.usefixtures("fresh_watches")
@pytest.mark.parametrize("method", ["pidfd", "procfs"])
def test_watch_ends_the_rank_when_a_real_proxy_dies(procs: ProcessTracker, monkeypatch: pytest.MonkeyPatch,
                                                      method: str) -> None:
    """A sleeper stands in for the proxy; its SIGKILL ends the "rank" (``on_gone``) exactly once.
    ``procfs``: a host without pidfd, where ``/proc`` is polled (with one WARNING)."""
    if method == "procfs":
        monkeypatch.setattr(_pidfd, "pidfd_supported", lambda: False)
    proxy = procs.sleeper()
    ended = Ended()
    watch = start_proxy_death_watch(_identity_of(proxy.pid), on_gone=ended)
    assert watch is not None and watch.method == method
    assert start_proxy_death_watch(_identity_of(proxy.pid), on_gone=ended) is None  # one watch per proxy
    assert not ended.event.is_set() and proxy.poll() is None
    proxy.kill()
    assert ended.event.wait(10 * WAIT_SCALE)
    watch.thread.join(5 * WAIT_SCALE)
    assert not watch.thread.is_alive()
    assert ended.pids == [proxy.pid]


@pytest.mark.timeout(30)
@pytest.mark.usefixtures("fresh_watches")
def test_watch_thread_closes_its_pidfd(procs: ProcessTracker) -> None:
    proxy = procs.sleeper()
    before = set(os.listdir("/proc/self/fd"))
    ended = Ended()
    watch = start_proxy_death_watch(_identity_of(proxy.pid), on_gone=ended)
    assert watch is not None and watch.fd is not None
    assert os.readlink(f"/proc/self/fd/{watch.fd}") == "anon_inode:[pidfd]"
    proxy.kill()
    assert ended.event.wait(10 * WAIT_SCALE)
    watch.thread.join(5 * WAIT_SCALE)
    assert not watch.thread.is_alive()
    assert set(os.listdir("/proc/self/fd")) <= before


@pytest.mark.timeout(30)
@pytest.mark.usefixtures("fresh_watches")
def test_a_proxy_whose_pid_is_another_process_ends_the_rank_at_once_and_is_never_signalled(
        procs: ProcessTracker) -> None:
    """The pid the proxy sent is now a process with another start time (the proxy died and its
    pid was reused): the rank's proxy is gone. Nothing is sent to that other process."""
    other = procs.sleeper()
    identity = _identity_of(other.pid)
    identity[1] -= 1
    ended = Ended()
    assert start_proxy_death_watch(identity, on_gone=ended) is None
    assert ended.pids == [other.pid]
    assert other.poll() is None


@pytest.mark.timeout(30)
@pytest.mark.usefixtures("fresh_watches")
def test_an_unverifiable_proxy_never_ends_the_rank(procs: ProcessTracker, monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """When the proxy cannot be checked (its /proc entry unreadable, no descriptor left), the rank
    keeps running unwatched, with a WARNING: "cannot tell" is never "gone"."""
    proxy = procs.sleeper()
    ended = Ended()
    for error in (AccessDenied(proxy.pid, None), OSError(24, "Too many open files")):
        def fail(pid: int, start_time: int | None, error: BaseException = error) -> int:
            raise error

        monkeypatch.setattr(_pidfd, "open_verified_pidfd", fail)
        with caplog.at_level("WARNING"):
            assert start_proxy_death_watch(_identity_of(proxy.pid), on_gone=ended) is None
    assert ended.pids == []
    assert sum("cannot watch the proxy" in r.getMessage() for r in caplog.records) == 2


@pytest.mark.timeout(30)
@pytest.mark.usefixtures("fresh_watches")
def test_no_watch_in_the_proxy_itself_nor_for_a_proxy_elsewhere(procs: ProcessTracker) -> None:
    """Rank 0 of ``MpiCommSession`` runs in the proxy process; a proxy on another host (hostname or
    boot id) or in another PID namespace cannot be reached by a pidfd. None of them ends the rank."""
    proxy = procs.sleeper()
    ended = Ended()
    me = _identity_of(os.getpid())
    assert start_proxy_death_watch(me, on_gone=ended) is None
    base = _identity_of(proxy.pid)
    elsewhere = [[*base[:2], base[2] + "-other", *base[3:]], [*base[:3], base[3] + 1, base[4]],
                 [*base[:4], "00000000-0000-0000-0000-000000000000"], [*base[:3], None, base[4]]]
    for identity in elsewhere:
        assert start_proxy_death_watch(identity, on_gone=ended) is None
    assert ended.pids == [] and _worker_entry._WATCHES == {}


@pytest.mark.parametrize("identity", [None, "1234", [True, 1, "h", 1], [1, 1, "h", 1], [99, "x", "h", 1],
                                      [99, 1, 5, 1], [99, 1, "h", 1, 7], [99, 1, "h"], [99, 1, "h", 1.5]])
def test_a_malformed_proxy_identity_is_rejected(identity: Any) -> None:
    with pytest.raises(ValueError):
        start_proxy_death_watch(identity, on_gone=lambda pid: pytest.fail("must not end the rank"))


@pytest.mark.timeout(30)
@pytest.mark.usefixtures("fresh_watches")
def test_a_rank_already_exiting_is_not_ended_by_its_proxys_exit(procs: ProcessTracker,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """At the clean end of an mpirun job rank 0 (the proxy) may exit before the other ranks have
    finished their own exit: once a rank's interpreter exit began, its proxy's exit does not end
    it with status 75 within the grace (here 3 s): only a rank still there after it is ended."""
    monkeypatch.setattr(_worker_entry, "_EXIT_GRACE_S", 3.0)
    proxy = procs.sleeper()
    ended = Ended()
    watch = start_proxy_death_watch(_identity_of(proxy.pid), on_gone=ended)
    assert watch is not None
    _worker_entry._EXITING.set()  # what the rank's threading exit hook does
    proxy.kill()
    assert wait_until(lambda: proxy.poll() is not None, 10)
    assert not ended.event.wait(1.0)
    assert ended.event.wait(3.0 + 10 * WAIT_SCALE)  # and after the grace it is (a rank hung in its exit)


@needs("unshare")
def test_a_proxy_that_is_pid_1_of_the_namespace_is_not_watched_and_not_warned_about(tmp_path: Any) -> None:
    """A server exec'ed as PID 1 of a container: its exit ends the whole PID namespace, so there is
    nothing to watch, and nothing to warn about (before: a WARNING with a traceback on every rank)."""
    rank = tmp_path / "rank.py"
    rank.write_text(
        "import json, logging, sys\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "from trtllm_liveness.integrations.trtllm._worker_entry import start_proxy_death_watch\n"
        "print(json.dumps(start_proxy_death_watch(json.loads(sys.argv[1])) is None))\n")
    server = tmp_path / "server.py"  # PID 1 of the new namespace: the "server" that spawns a rank
    server.write_text(
        "import json, subprocess, sys\n"
        "from trtllm_liveness.integrations.trtllm._worker_entry import proxy_identity\n"
        "me = proxy_identity()\n"
        f"out = subprocess.run([sys.executable, {str(rank)!r}, json.dumps(me)], capture_output=True, text=True,"
        " timeout=30)\n"
        "print(me[0], out.stdout.strip())\n"
        "sys.stderr.write(out.stderr)\n")
    result = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, str(server)],
                            capture_output=True, text=True, timeout=60 * WAIT_SCALE, start_new_session=True)
    assert result.stdout.split() == ["1", "true"], (result.stdout, result.stderr)
    assert "WARNING" not in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert "PID 1 of this PID namespace" in result.stderr
