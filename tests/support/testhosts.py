"""Test hosts: several "hosts" on one machine, made of namespaces, for multi-host MPI runs.

Layout::

    hub netns (bridge br0: management) --veth-- head  (own net/UTS/mount ns, root PID ns: mpirun runs here)
              (bridge br1: data)       --veth-- hostA (own net/UTS/mount/PID ns; PID 1 = a tiny reaper)
                                       --veth-- hostB ...

* Two networks, as a cluster has: the **management** network (``eth0``, :data:`SUBNET`, what the
  host names resolve to: the launcher's daemons and the liveness hub and agents) and the **data**
  network (``eth1``, :data:`DATA_SUBNET`: MPI's traffic between ranks, what an engine's collectives
  cross). Each can be cut on its own (:meth:`TestHosts.partition` ``network=``).

* Every namespace is named ``tlh<owner pid>-<n>-<role>``; the veths live only in the hub and in
  the hosts (made inside the hub with ``ip -n``), the /24 (:data:`SUBNET`) exists only inside
  these namespaces: nothing touches the root namespace's links or routes, and no traffic leaves
  them.
* A host is ``nsenter --net=/run/netns/<ns> unshare --pid --uts --mount --fork --mount-proc
  --propagation private <init>``, started in a session of its own (``start_new_session``, the
  ``setsid`` of the recipe); the init sets the hostname, binds the shared hosts file over
  ``/etc/hosts``, binds a directory of the work directory over ``/run`` (:meth:`TestHosts.run_directory`:
  the host's own ``/run``, so nothing run in a host reads or writes the machine's, its quarantine
  marker directory ``/run/trtllm-liveness`` included), mounts private tmpfs on ``/tmp`` and
  ``/dev/shm`` and execs a reaper as PID 1. The head is the same without ``--pid``/``--fork`` and
  without the tmpfs mounts (it shares ``/tmp`` with the caller, where PRRTE's session base of each
  job lives).
* ``mpirun`` runs in the head with PRRTE's ssh launcher pointed at an agent script that enters the
  target host (``PRTE_MCA_plm_ssh_agent``); no tree spawn (the agent needs the root PID namespace).
* Faults: :meth:`TestHosts.kill` (a process of a host, by its in-host pid, through a pidfd
  verified against the host's PID namespace), :meth:`~TestHosts.crash` (SIGKILL of the host's
  PID 1: the kernel kills everything in it), :meth:`~TestHosts.partition` /
  :meth:`~TestHosts.heal` (the hub-side veth down / up), :meth:`~TestHosts.silent_loss` (cut,
  then crash).
* :meth:`TestHosts.close` cleans up by namespace, never by name: SIGKILL of every host's PID 1,
  then of every pid ``ip netns pids`` lists for each of our namespaces, then ``ip netns del``
  (the veths and the bridge go with their namespaces). It is idempotent and runs on failure too
  (context manager); :meth:`TestHosts.leftovers` lists what is left (nothing, normally). At start,
  namespaces of owners that no longer run (a killed test session) are removed the same way.

Every blocking call has a timeout. Not thread-safe: one thread drives a :class:`TestHosts`.
No pytest (``scripts/bench_multihost.py`` uses it too); procfs and pidfds through the package's
core (``_procfs``, ``_pidfd``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from trtllm_liveness._errors import LivenessError
from trtllm_liveness.demo._mpi_env import PRTE_TMPDIR_VAR, configure_mpi_env
from trtllm_liveness.process import _pidfd, _procfs
from trtllm_liveness.quarantine._marker import DEFAULT_QUARANTINE_DIR, QUARANTINE_DIR_VAR

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RANK_PROGRAM = os.path.join(REPO_ROOT, "tests", "programs", "multihost_rank.py")

NS_PREFIX = "tlh"  # netns names: tlh<owner pid>-<n>-<role>
SUBNET = "10.213.77"  # <SUBNET>.0/24, only inside our namespaces; .1 is the head: the management network
DATA_SUBNET = "10.213.78"  # the data network (MPI's traffic), the same host numbers
NETWORKS = ("both", "mgmt", "data")  # what partition() cuts
HEAD = "head"
DEFAULT_HOSTS = ("hostA", "hostB", "hostC")
INHERITED_MCA_PREFIXES = ("OMPI_MCA_", "PRTE_MCA_", "PMIX_MCA_")  # never passed on to the rig's jobs

_NS_RE = re.compile(rf"^{NS_PREFIX}(\d+)-\d+-[A-Za-z0-9]+$")
_counter = 0

# PID 1 of a host (and the head's holder): prints "ready", then reaps every child, race-free
# (SIGCHLD blocked, collected with sigwait). Signals without a handler are ignored by a PID 1,
# but SIGKILL from the parent namespace always ends it, and the kernel then kills the whole host.
REAPER = r"""
import os, signal, sys
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
sys.stdout.write("ready\n"); sys.stdout.flush()
fd = os.open(os.devnull, os.O_RDWR)
os.dup2(fd, 1)
while True:
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass
    signal.sigwait({signal.SIGCHLD})
"""

# $1 hostname, $2 hosts file, $3 "tmpfs" for private /tmp and /dev/shm, $4 the directory bound
# over /run (before the tmpfs hides it), $5 python, then the directories under /tmp or /dev/shm the
# host must still see (the checkout, the venv: a CI clone may live in /tmp). Each is opened before
# the private tmpfs hides it and bound back through that descriptor after (mount --no-canonicalize
# --bind /proc/self/fd/N: mount(8) would otherwise resolve the path, which the tmpfs now hides).
INIT_SCRIPT = """#!/bin/sh
set -e
hostname "$1"
mount --bind "$2" /etc/hosts
mount --bind "$4" /run
mode=$3
python=$5
shift 5
if [ "$mode" = tmpfs ]; then
    n=3
    for keep in "$@"; do eval "exec $n<\\"\\$keep\\""; n=$((n + 1)); done
    mount -t tmpfs -o mode=1777 tmpfs /tmp
    mount -t tmpfs -o mode=1777 tmpfs /dev/shm
    n=3
    for keep in "$@"; do
        mkdir -p "$keep"
        mount --no-canonicalize --bind "/proc/self/fd/$n" "$keep"
        eval "exec $n<&-"
        n=$((n + 1))
    done
fi
exec "$python" -I -c "$REAPER"
"""


def kept_directories() -> list[str]:
    """The directories under ``/tmp`` or ``/dev/shm`` a host must still see after its private
    tmpfs mounts: the checkout and the interpreter (venv and base), outermost only, at most 6."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    candidates = {os.path.realpath(path) for path in (repo, sys.prefix, sys.base_prefix,
                                                      os.path.dirname(os.path.realpath(sys.executable)))}
    hidden = sorted(path for path in candidates if path.startswith(("/tmp/", "/dev/shm/")))
    outermost = [path for path in hidden if not any(path.startswith(other + "/") for other in hidden)]
    if len(outermost) > 6:
        raise TestHostsError(f"too many directories to keep visible in the hosts: {outermost}")
    return outermost

# PRRTE's ssh launcher calls ``agent [ssh options] HOST CMD...``. The agent enters HOST (by the
# root-ns pid of its PID 1; with a login environment, that one alone, as sshd gives a login the
# host's configured environment), makes the caller's TMPDIR and PRRTE session base in the host's private
# /tmp, runs CMD there, and exits 255 when CMD died of a signal (as ssh does). Like ssh, it cannot
# tell that its command ended while the host is cut off (the marker file ``<down>/HOST`` exists,
# made by partition(), or by crash(launcher_notices=False)): it then waits until the marker is
# gone, as an ssh session to a host that vanished silently hangs until TCP gives up. Without this,
# PRRTE would learn of a silent host loss from the agent's exit (measured: "A daemon failed to
# report back", status 255, in 16 ms), which no real launcher could tell it.
AGENT_SCRIPT = """#!/bin/sh
while [ $# -gt 0 ]; do
    case "$1" in
        -o|-p|-l|-i|-F|-E|-J) shift 2 ;;
        -*) shift ;;
        *) break ;;
    esac
done
host=$1
shift
case "$host" in
{cases}
    *) echo "test-host agent: unknown host $host" >&2; exit 255 ;;
esac
{login}nsenter -t "$pid" -n -u -p -m --wd=/ -- /bin/sh -c \
    "mkdir -p \\"\\$TMPDIR\\" \\"\\$PRTE_MCA_prte_tmpdir_base\\" 2>/dev/null; $*"
status=$?
while [ -e "{down}/$host" ]; do sleep 0.2; done
if [ $status -gt 128 ]; then exit 255; fi
exit $status
"""


class TestHostsError(RuntimeError):
    """A test-host step failed (the command and its output are in the message)."""


def unavailable() -> str | None:
    """Why test hosts cannot be made here, or None (tools and privileges only; cheap)."""
    if not sys.platform.startswith("linux"):
        return "test hosts need Linux namespaces"
    if os.geteuid() != 0:
        return "test hosts need root (network, PID and mount namespaces, veths)"
    missing = [tool for tool in ("ip", "nsenter", "unshare", "hostname", "mount") if shutil.which(tool) is None]
    if missing:
        return f"not installed: {', '.join(missing)}"
    return None


def _ip(*args: str, timeout: float = 10.0, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise TestHostsError(f"ip {' '.join(args)}: no answer in {timeout} s") from exc
    if check and out.returncode != 0:
        raise TestHostsError(f"ip {' '.join(args)} failed (status {out.returncode}): {out.stderr.strip()}")
    return out


def netns_names() -> list[str]:
    """The names ``ip netns list`` shows (ours or not)."""
    out = _ip("netns", "list", check=False)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def netns_pids(name: str) -> list[int]:
    out = _ip("netns", "pids", name, check=False)
    return [int(word) for word in out.stdout.split() if word.isdigit()]


def start_time_of(pid: int) -> int | None:
    """``pid``'s start time, or None when it is gone or unreadable."""
    try:
        return _procfs.read_start_time(pid)
    except (OSError, ValueError):
        return None


def _gone(pid: int, start: int | None) -> bool:
    """Whether the process that started at ``start`` has exited (a zombie counts as gone)."""
    try:
        info = _procfs.read_stat(pid)
    except (OSError, ValueError):
        return True
    return info.start_time != start or info.state in "ZX"


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.01) -> bool:
    """Poll ``predicate`` until it holds (True) or ``timeout`` s passed (False)."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def _pidns_inode(pid: int) -> int | None:
    try:
        return _procfs.pid_namespace_inode(pid)
    except OSError:
        return None


def _nspid(pid: int) -> list[int]:
    """The ``NSpid`` line of ``/proc/<pid>/status``: the pid in each PID namespace, outermost first."""
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("NSpid:"):
                    return [int(word) for word in line.split()[1:]]
    except OSError:
        pass
    return []


def _sigkill_verified(pid: int, start: int | None) -> None:
    """SIGKILL ``pid`` if it is still the process that started at ``start`` (None: unreadable,
    so gone or not ours to judge: nothing is sent)."""
    if start is None:
        return
    with contextlib.suppress(LivenessError, OSError):
        _pidfd.signal_verified(pid, start, signal.SIGKILL)


def _sigkill_in_netns(pid: int, name: str) -> None:
    """SIGKILL ``pid`` through a pidfd opened first and then verified to pin a process of network
    namespace ``name`` (a pid listed a moment ago may have been reused by another process since)."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return  # gone
    try:
        if os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat(f"/run/netns/{name}").st_ino:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
    except OSError:
        pass  # gone meanwhile, or the namespace is: nothing to kill
    finally:
        os.close(fd)


def kill_netns_processes(name: str, timeout: float = 10.0) -> list[int]:
    """SIGKILL every process in network namespace ``name`` until none is left; return the pids
    still there at ``timeout`` (in ``D``, say: a pending SIGKILL)."""
    def empty() -> bool:
        pids = netns_pids(name)
        for pid in pids:
            _sigkill_in_netns(pid, name)
        return not pids

    if wait_for(empty, timeout, 0.02):
        return []
    return netns_pids(name)


def remove_orphaned_namespaces() -> list[str]:
    """Remove our namespaces whose owner process no longer runs (a killed session): kill their
    processes, then ``ip netns del``. Returns the names removed."""
    removed = []
    for name in netns_names():
        match = _NS_RE.match(name)
        if match is None or os.path.exists(f"/proc/{match.group(1)}"):
            continue
        kill_netns_processes(name)
        if _ip("netns", "del", name, check=False).returncode == 0:
            removed.append(name)
    return removed


@dataclass
class TestHost:
    """One host (or the head): its namespaces and the process that holds them."""

    __test__ = False  # not a pytest test class

    name: str
    netns: str
    address: str
    hub_veth: str  # its management veth's end on the hub's bridge (down = cut off from management)
    data_veth: str  # its data veth's end on the hub's data bridge (down = cut off from its peers' MPI traffic)
    holder: subprocess.Popen[bytes]  # unshare (host: parent of PID 1) or the head process itself
    pid1: int  # root-ns pid of the host's PID 1 (the head: its holder process)
    pid1_start: int | None
    pidns_inode: int | None  # the host's PID namespace (the head: the root one)
    own_pid_namespace: bool

    def nsenter_argv(self, argv: Sequence[str], wd: str = "/") -> list[str]:
        flags = ["-n", "-u", "-p", "-m"] if self.own_pid_namespace else ["-n", "-u", "-m"]
        return ["nsenter", "-t", str(self.pid1), *flags, f"--wd={wd}", "--", *argv]


@dataclass
class MpiJob:
    """An ``mpirun`` started in the head: its output is read by a daemon thread (merged stderr),
    each line kept with the ``time.monotonic()`` it was read at."""

    popen: subprocess.Popen[bytes]
    lines: list[tuple[float, str]] = field(default_factory=list)
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _reader: threading.Thread | None = None

    def start_reader(self) -> None:
        self._reader = threading.Thread(target=self._read, name=f"mpirun-{self.popen.pid}-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for raw in self.popen.stdout:
            with self._cond:
                self.lines.append((time.monotonic(), raw.decode(errors="replace").rstrip("\n")))
                self._cond.notify_all()

    def output(self) -> str:
        with self._cond:
            return "\n".join(line for _, line in self.lines)

    def wait_for(self, predicate: Callable[[list[str]], bool], timeout: float) -> bool:
        """Wait (at most ``timeout`` s) until ``predicate(lines)`` holds; return whether it did."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate([line for _, line in self.lines]):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.1))
            return True

    def wait_exit(self, timeout: float) -> int | None:
        """mpirun's exit status (negative: killed by that signal), or None if it runs at ``timeout``."""
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """SIGKILL mpirun's whole session (it leads one), if it still runs. What it started in the
        hosts goes with the hosts (:meth:`TestHosts.close`)."""
        if self.popen.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(10)

    def close(self) -> None:
        self.kill()
        if self._reader is not None:
            self._reader.join(5)
        if self.popen.stdout is not None and (self._reader is None or not self._reader.is_alive()):
            self.popen.stdout.close()


RankInfo = dict[str, str]
_RANK_RE = re.compile(r"RANK (.*)$")


def rank_lines(lines: Iterable[str]) -> dict[int, RankInfo]:
    """The ``RANK key=value ...`` lines of :mod:`tests.programs.multihost_rank`, by rank."""
    out: dict[int, RankInfo] = {}
    for line in lines:
        match = _RANK_RE.search(line)
        if match:
            info = dict(part.split("=", 1) for part in match.group(1).split() if "=" in part)
            out[int(info["rank"])] = info
    return out


class TestHosts:
    """N test hosts plus a head on a private bridge; a context manager (:meth:`close` on exit).

    ``on_start`` is called with every long-lived process started (the init processes, mpirun),
    so a caller can track them too (the tests' ``procs`` fixture). ``timeout`` bounds each step.
    ``login_env``: the whole environment the agent gives the command it runs on a host, as sshd gives
    a login a fresh one (then only what the launcher itself forwards reaches the ranks: with Open
    MPI, ``OMPI_*`` variables and those named with ``-x``); None (the default): the caller's,
    passed through. Either way the hosts' configuration names the caller's quarantine marker
    directory (``$TRTLLM_LIVENESS_QUARANTINE_DIR``, where set), as a site's ``/etc/environment``
    would: a login environment gets it too, so every rank, however it is started, uses the test
    run's directory; and each host has its own ``/run`` (:meth:`run_directory`), so even a
    process without it never reads the machine's ``/run/trtllm-liveness``.
    """

    __test__ = False  # not a pytest test class

    def __init__(self, names: Sequence[str] = DEFAULT_HOSTS, *,
                 on_start: Callable[[subprocess.Popen[bytes]], None] | None = None, timeout: float = 15.0,
                 login_env: Mapping[str, str] | None = None) -> None:
        global _counter
        if len(set(names)) != len(names) or HEAD in names or not names or len(names) > 200:
            raise ValueError(f"host names must be unique, not {HEAD!r}, 1 to 200 of them: {names!r}")
        for name in names:
            if not re.fullmatch(r"[A-Za-z][A-Za-z0-9]{0,11}", name):
                raise ValueError(f"host name {name!r}: letters and digits, at most 12")
        _counter += 1
        self.prefix = f"{NS_PREFIX}{os.getpid()}-{_counter}-"
        self.names = tuple(names)
        self.timeout = timeout
        self.on_start = on_start
        self.login_env = None if login_env is None else dict(login_env)
        self.hub = self.prefix + "hub"
        self.head: TestHost | None = None
        self.hosts: dict[str, TestHost] = {}
        self.workdir = ""
        self.shared = ""
        self.agent = ""
        self._down_dir = ""
        self.jobs: list[MpiJob] = []
        self._netns_made: list[str] = []
        self._popens: list[subprocess.Popen[bytes]] = []
        self._closed = False

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> TestHosts:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def address_of(self, name: str, network: str = "mgmt") -> str:
        """Host ``name``'s address on the ``mgmt`` (its host name's) or the ``data`` network."""
        subnet = DATA_SUBNET if network == "data" else SUBNET
        return f"{subnet}.{1 if name == HEAD else 2 + self.names.index(name)}"

    def start(self) -> None:
        """Make the hub, the head and the hosts; return when each host's PID 1 runs. Raises
        :class:`TestHostsError` (call :meth:`close` then; the context manager does)."""
        remove_orphaned_namespaces()
        self.workdir = tempfile.mkdtemp(prefix="trtllm-testhosts-")
        self.shared = os.path.join(self.workdir, "shared")  # seen by the head and every host (a shared disk)
        os.mkdir(self.shared)
        os.chmod(self.shared, 0o1777)
        hosts_file = os.path.join(self.workdir, "hosts")
        with open(hosts_file, "w") as handle:
            handle.write("127.0.0.1 localhost\n")
            for name in (HEAD, *self.names):
                handle.write(f"{self.address_of(name)} {name}\n")
        init = os.path.join(self.workdir, "init.sh")
        with open(init, "w") as handle:
            handle.write(INIT_SCRIPT)
        os.chmod(init, 0o755)
        self._add_netns(self.hub)
        _ip("-n", self.hub, "link", "set", "lo", "up")
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        _ip("-n", self.hub, "link", "add", "br1", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br1", "up")
        for name in (HEAD, *self.names):
            os.makedirs(self.run_directory(name), mode=0o755)
        pending = [self._spawn(name, hosts_file, init) for name in (HEAD, *self.names)]
        for name, popen, veth in pending:
            self._await_ready(name, popen, veth)
        self._down_dir = os.path.join(self.workdir, "down")
        os.mkdir(self._down_dir)
        self._write_agent()

    def run_directory(self, name: str) -> str:
        """The directory host ``name`` (or the head) sees as ``/run``: its own, in the work
        directory, removed with it. What a host's processes find in their default quarantine
        marker directory, ``/run/trtllm-liveness``, is in ``<this>/trtllm-liveness``."""
        if not self.workdir:
            raise TestHostsError("start() first")
        return os.path.join(self.workdir, "run", name)

    def path_in(self, name: str, path: str) -> str:
        """Absolute ``path`` as host ``name``'s processes see it (its own ``/run``, ``/tmp``, ...),
        reached from here through its PID 1's root; valid while the host runs."""
        if not path.startswith("/"):
            raise ValueError(f"not an absolute path: {path!r}")
        return f"/proc/{self.host(name).pid1}/root{path}"

    @property
    def hosts_quarantine_dir(self) -> str:
        """Where every host's processes, as root, resolve the default ``quarantine_dir``: the
        hosts' configured ``$TRTLLM_LIVENESS_QUARANTINE_DIR`` (the caller's path, in each host's
        own private ``/tmp``), else ``/run/trtllm-liveness`` (each host's own ``/run``)."""
        configured = self._login_environment().get(QUARANTINE_DIR_VAR, "")
        return configured if configured.startswith("/") else DEFAULT_QUARANTINE_DIR

    def quarantine_directory(self, name: str) -> str:
        """Host ``name``'s own quarantine marker directory (:attr:`hosts_quarantine_dir` there),
        reached from here (:meth:`path_in`)."""
        return self.path_in(name, self.hosts_quarantine_dir)

    def start_in(self, name: str, argv: Sequence[str], *, wd: str = "/") -> subprocess.Popen[bytes]:
        """Start ``argv`` in host ``name`` (a server of that host, say), in a session of its own,
        tracked as the hosts' own processes (:meth:`adopt`: it ends with its host), and wait (at most
        :attr:`timeout`) for its first line on stdout, ``ready``. Raises :class:`TestHostsError`
        (with what it printed) when that line does not come."""
        popen = subprocess.Popen(self.host(name).nsenter_argv(argv, wd=wd), stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        self.adopt(popen)
        assert popen.stdout is not None
        lines: list[bytes] = []
        reader = threading.Thread(target=lambda: lines.append(popen.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(self.timeout)
        if not lines or lines[0].strip() != b"ready":
            raise TestHostsError(f"{' '.join(argv)} in host {name} did not say ready: {lines[:1]!r}")
        return popen

    def _add_netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._netns_made.append(name)

    def _spawn(self, name: str, hosts_file: str, init: str) -> tuple[str, subprocess.Popen[bytes], str]:
        netns = self.prefix + name
        veth = f"v{len(self._netns_made)}"  # inside the hub only
        self._add_netns(netns)
        _ip("-n", netns, "link", "set", "lo", "up")
        links = ((veth, "br0", "eth0", "mgmt"), ("d" + veth[1:], "br1", "eth1", "data"))
        for hub_end, bridge, inside, network in links:
            _ip("-n", self.hub, "link", "add", hub_end, "type", "veth", "peer", "name", inside, "netns", netns)
            _ip("-n", self.hub, "link", "set", hub_end, "master", bridge, "up")
            _ip("-n", netns, "addr", "add", f"{self.address_of(name, network)}/24", "dev", inside)
            _ip("-n", netns, "link", "set", inside, "up")
        if name == HEAD:
            ns_args = ["unshare", "--uts", "--mount", "--propagation", "private"]
        else:
            ns_args = ["unshare", "--pid", "--uts", "--mount", "--fork", "--mount-proc", "--propagation", "private"]
        argv = ["nsenter", f"--net=/run/netns/{netns}", *ns_args,
                init, name, hosts_file, "none" if name == HEAD else "tmpfs", self.run_directory(name), sys.executable,
                *kept_directories(), self.shared]
        popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 env={**os.environ, "REAPER": REAPER}, start_new_session=True)
        self._popens.append(popen)
        if self.on_start is not None:
            self.on_start(popen)
        return name, popen, veth

    def _await_ready(self, name: str, popen: subprocess.Popen[bytes], veth: str) -> None:
        assert popen.stdout is not None and popen.stderr is not None
        ready = threading.Event()
        line: list[bytes] = []

        def read() -> None:
            assert popen.stdout is not None
            line.append(popen.stdout.readline())
            ready.set()

        reader = threading.Thread(target=read, name=f"testhost-{name}-ready", daemon=True)
        reader.start()
        if not ready.wait(self.timeout) or line[0] != b"ready\n":
            popen.kill()
            err = b""
            with contextlib.suppress(subprocess.TimeoutExpired, ValueError):
                err = popen.communicate(timeout=5)[1] or b""
            raise TestHostsError(f"test host {name} did not come up: {err.decode(errors='replace').strip()}")
        popen.stdout.close()
        popen.stderr.close()
        if name == HEAD:
            pid1 = popen.pid
        else:
            try:
                with open(f"/proc/{popen.pid}/task/{popen.pid}/children") as handle:
                    children = [int(word) for word in handle.read().split()]
            except OSError as exc:
                raise TestHostsError(f"test host {name}: cannot read unshare's child: {exc}") from exc
            if len(children) != 1:
                raise TestHostsError(f"test host {name}: unshare has children {children}, expected its PID 1")
            pid1 = children[0]
        host = TestHost(name=name, netns=self.prefix + name, address=self.address_of(name), hub_veth=veth,
                        data_veth="d" + veth[1:],
                        holder=popen, pid1=pid1, pid1_start=start_time_of(pid1), pidns_inode=_pidns_inode(pid1),
                        own_pid_namespace=name != HEAD)
        if host.own_pid_namespace and _nspid(pid1)[-1:] != [1]:
            raise TestHostsError(f"test host {name}: pid {pid1} is not PID 1 of a namespace ({_nspid(pid1)})")
        if name == HEAD:
            self.head = host
        else:
            self.hosts[name] = host

    def _write_agent(self) -> None:
        cases = "\n".join(f"    {name}) pid={host.pid1} ;;" for name, host in self.hosts.items())
        self.agent = os.path.join(self.workdir, "agent.sh")
        with open(self.agent, "w") as handle:
            login = "" if self.login_env is None else "env -i " + " ".join(
                shlex.quote(f"{key}={value}") for key, value in self._login_environment().items()) + " "
            handle.write(AGENT_SCRIPT.format(cases=cases, down=self._down_dir, login=login))
        os.chmod(self.agent, 0o755)

    def _login_environment(self) -> dict[str, str]:
        """:attr:`login_env` with what the hosts' configuration adds to every login: the caller's
        quarantine marker directory."""
        env = dict(self.login_env or {})
        quarantine = os.environ.get(QUARANTINE_DIR_VAR, "")
        if quarantine and QUARANTINE_DIR_VAR not in env:
            env[QUARANTINE_DIR_VAR] = quarantine
        return env

    def close(self) -> list[str]:
        """Remove everything: jobs, hosts, head, hub, by namespace. Idempotent; never raises for
        a cleanup step. Returns what could not be removed (empty normally)."""
        if self._closed:
            return self.leftovers()
        self._closed = True
        for job in self.jobs:
            job.kill()
        for host in self.hosts.values():  # the kernel kills a PID namespace with its PID 1
            _sigkill_verified(host.pid1, host.pid1_start)
        problems = []
        for host in self.hosts.values():  # an exiting PID 1 first waits for its namespace to die
            if not wait_for(functools.partial(_gone, host.pid1, host.pid1_start), self.timeout):
                problems.append(f"PID 1 of test host {host.name} ({host.pid1}) survives SIGKILL")
        for name in reversed(self._netns_made):
            stuck = kill_netns_processes(name, self.timeout)
            if stuck:
                problems.append(f"netns {name}: pids {stuck} survive SIGKILL")
        for popen in self._popens:
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(self.timeout)
            for stream in (popen.stdout, popen.stderr):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
        for job in self.jobs:
            job.close()
        for name in reversed(self._netns_made):
            if name in netns_names():
                out = _ip("netns", "del", name, check=False)
                if out.returncode != 0:
                    problems.append(f"ip netns del {name}: {out.stderr.strip()}")
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        return problems + self.leftovers()

    def leftovers(self) -> list[str]:
        """What of ours is still there: namespaces, their processes, root-ns links named like our
        veths (we never make any there), the work directory."""
        left = [f"netns {name}" for name in netns_names() if name.startswith(self.prefix)]
        left += [f"pid {popen.pid} (holder) alive" for popen in self._popens if popen.poll() is None]
        left += [f"host {host.name} PID 1 ({host.pid1}) alive" for host in self.hosts.values()
                 if host.pid1_start is not None and not _gone(host.pid1, host.pid1_start)]
        out = _ip("-o", "link", "show", "type", "veth", check=False)
        left += [f"root-ns veth {line.split(':')[1].strip()}" for line in out.stdout.splitlines()
                 if self.prefix in line]
        if self.workdir and os.path.exists(self.workdir):
            left.append(f"work directory {self.workdir}")
        return left

    # ------------------------------------------------------------------ running things

    def adopt(self, popen: subprocess.Popen[bytes]) -> None:
        """Track a long-lived process started for these hosts (``on_start`` sees it; :meth:`close`
        waits for it after ending every process of the hosts' namespaces)."""
        self._popens.append(popen)
        if self.on_start is not None:
            self.on_start(popen)

    def host(self, name: str) -> TestHost:
        if name == HEAD and self.head is not None:
            return self.head
        return self.hosts[name]

    def run(self, name: str, argv: Sequence[str], timeout: float = 10.0) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in host ``name`` (or the head) and wait, at most ``timeout`` s (then it is
        killed and ``subprocess.TimeoutExpired`` raised)."""
        return subprocess.run(self.host(name).nsenter_argv(argv), capture_output=True, text=True,
                              timeout=timeout, check=False, stdin=subprocess.DEVNULL)

    def mpi_env(self, *, fault_tolerant: bool = False, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """Environment for mpirun in the head: the project's Open MPI settings (configure_mpi_env),
        a fresh PRRTE session base per job (removed with the work directory), TCP between the
        hosts on our /24, the agent, no tree spawn, the venv's prefixes and bin first on PATH.

        The rig owns MPI's parameters: every ``OMPI_MCA_*``, ``PRTE_MCA_*`` and ``PMIX_MCA_*``
        variable of the caller's environment is left out (:data:`INHERITED_MCA_PREFIXES`), so a
        setting exported for single-node work cannot reach these jobs: with
        ``OMPI_MCA_btl_tcp_if_include=lo`` each rank would reach its own host's loopback for a
        peer on another host ("received unexpected process identifier", and the start fails).
        Only ``extra``, this job's own settings, overrides the rig's."""
        env = {key: value for key, value in os.environ.items() if not key.startswith(INHERITED_MCA_PREFIXES)}
        env[PRTE_TMPDIR_VAR] = tempfile.mkdtemp(prefix="prte-", dir=self.workdir)
        env["OMPI_MCA_btl_tcp_if_include"] = f"{DATA_SUBNET}.0/24"  # the ranks' traffic: the data network
        env["OMPI_MCA_mpi_ft_enable"] = "1" if fault_tolerant else "0"
        configure_mpi_env(env, fault_tolerant=fault_tolerant)  # btl, pml, root, mapping: the rest
        env["PRTE_MCA_plm_ssh_agent"] = self.agent
        env["PRTE_MCA_plm_ssh_no_tree_spawn"] = "1"
        for var in ("PRTE_PREFIX", "PMIX_PREFIX", "OPAL_PREFIX"):
            env[var] = sys.prefix
        env.update(extra or {})
        return env

    def mpirun(self, placement: Sequence[tuple[str, int]], program: Sequence[str], *,
               mpirun_args: Sequence[str] = (), fault_tolerant: bool = False,
               env: Mapping[str, str] | None = None, wrapper: Sequence[str] = ()) -> MpiJob:
        """Start ``[wrapper] mpirun --host a:n,b:m -n total --map-by slot [mpirun_args] program`` in the
        head, in a new session, stdout and stderr merged into :attr:`MpiJob.lines`. Returns at once.
        ``wrapper`` (e.g. ``trtllm-liveness launch --``) runs mpirun as its child."""
        hostlist = ",".join(f"{name}:{count}" for name, count in placement)
        total = sum(count for _, count in placement)
        mpirun = os.path.join(sys.prefix, "bin", "mpirun")
        # By slot: each host gets exactly its count, in order (the project's default policy,
        # ":oversubscribe", maps by package and would put every rank on the first host).
        argv = [*wrapper, mpirun, "--host", hostlist, "-n", str(total), "--map-by", "slot", *mpirun_args, *program]
        assert self.head is not None, "start() first"
        popen = subprocess.Popen(self.head.nsenter_argv(argv, wd=REPO_ROOT), stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 env=self.mpi_env(fault_tolerant=fault_tolerant, extra=env), start_new_session=True)
        self._popens.append(popen)
        if self.on_start is not None:
            self.on_start(popen)
        job = MpiJob(popen)
        self.jobs.append(job)
        job.start_reader()
        return job

    def rank_job(self, placement: Sequence[tuple[str, int]] = (("hostA", 2), ("hostB", 1), ("hostC", 1)), *,
                 ft: bool = False, mpirun_args: Sequence[str] = ()) -> MpiJob:
        """:meth:`mpirun` of :mod:`tests.programs.multihost_rank` (``--ft``: ULFM's error handling)."""
        program = [sys.executable, "-u", RANK_PROGRAM, *(["--ft"] if ft else [])]
        return self.mpirun(placement, program, mpirun_args=mpirun_args, fault_tolerant=ft)

    # ------------------------------------------------------------------ processes and faults

    def root_pid(self, name: str, pid_in_host: int) -> int | None:
        """The root-namespace pid of host ``name``'s process ``pid_in_host``, or None (gone)."""
        host = self.hosts[name]
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            nspid = _nspid(int(entry))
            if len(nspid) >= 2 and nspid[-1] == pid_in_host and _pidns_inode(int(entry)) == host.pidns_inode:
                return int(entry)
        return None

    def kill(self, name: str, pid_in_host: int, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` to host ``name``'s process ``pid_in_host`` through a pidfd, verified (after
        opening it) to be in that host's PID namespace. Returns its root-ns pid; raises
        ``ProcessLookupError`` if there is no such process."""
        fd, pid = self.pidfd_of(name, pid_in_host)
        try:
            signal.pidfd_send_signal(fd, sig)
        finally:
            os.close(fd)
        return pid

    def pidfd_of(self, name: str, pid_in_host: int) -> tuple[int, int]:
        """(a pidfd, the root-ns pid) of host ``name``'s process ``pid_in_host``: opened, then
        verified to pin that process of that host's PID namespace. The caller closes the fd.
        Raises ``ProcessLookupError`` if there is no such process."""
        pid = self.root_pid(name, pid_in_host)
        if pid is None:
            raise ProcessLookupError(f"no pid {pid_in_host} in test host {name}")
        fd = os.pidfd_open(pid)
        if _pidns_inode(pid) != self.hosts[name].pidns_inode or _nspid(pid)[-1:] != [pid_in_host]:
            os.close(fd)
            raise ProcessLookupError(f"pid {pid_in_host} of test host {name} went away")
        return fd, pid

    def crash(self, name: str, *, launcher_notices: bool = True) -> None:
        """SIGKILL host ``name``'s PID 1 (the kernel kills every process of the host) and wait,
        at most :attr:`timeout`, until it is gone. Its network stays as it was, so peers' TCP
        connections to it are closed (FIN/RST). ``launcher_notices=False`` keeps the launch
        agent's session to the host open (as a launcher that does not hold a session per host
        would): PRRTE then learns of the loss only from its own daemon connection."""
        host = self.hosts[name]
        if not launcher_notices:
            self._hold_sessions(name)
        _sigkill_verified(host.pid1, host.pid1_start)
        if not wait_for(functools.partial(_gone, host.pid1, host.pid1_start), self.timeout):
            raise TestHostsError(f"PID 1 of test host {name} survives SIGKILL")

    def partition(self, name: str, network: str = "both") -> None:
        """Cut host ``name`` off: its veths' hub ends go down (nothing is sent, no FIN, no RST):
        both networks (the host is unreachable), ``mgmt`` (only its management network: the
        launcher's and the liveness traffic; its ranks still reach their peers) or ``data``."""
        if network not in NETWORKS:
            raise ValueError(f"network must be one of {NETWORKS}, not {network!r}")
        for veth in self._veths(name, network):
            _ip("-n", self.hub, "link", "set", veth, "down")
        if name != HEAD and network != "data":
            self._hold_sessions(name)

    def _veths(self, name: str, network: str) -> list[str]:
        host = self.host(name)
        return [veth for veth, net in ((host.hub_veth, "mgmt"), (host.data_veth, "data")) if network in (net, "both")]

    def _hold_sessions(self, name: str) -> None:
        with open(os.path.join(self._down_dir, name), "w"):
            pass

    def heal(self, name: str) -> None:
        """Bring host ``name``'s links back up (both networks)."""
        for veth in self._veths(name, "both"):
            _ip("-n", self.hub, "link", "set", veth, "up")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self._down_dir, name))

    def is_partitioned(self, name: str) -> bool:
        out = _ip("-n", self.hub, "-o", "link", "show", self.host(name).hub_veth)
        return "state DOWN" in out.stdout or ",UP" not in out.stdout.split(">")[0]

    def silent_loss(self, name: str) -> None:
        """Cut the link, then crash: the host is gone and its peers hear nothing of it."""
        self.partition(name)
        self.crash(name)
