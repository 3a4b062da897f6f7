"""What a process is, read and acted on safely: the first step of the flow.

- :mod:`._procfs`: parsing of ``/proc`` (state, start time, threads, signals, namespaces); pure,
  ``PROCFS_PATH`` read on every call so tests can point it at a fake tree;
- :mod:`._pidfd`: pidfd syscalls: open a handle, verify it against a start time, signal through it;
- :mod:`._identity`: :class:`ProcessIdentity`, who a worker is in a form that survives PID reuse and
  crosses IPC and hosts;
- :mod:`._mm_read`: bounded reads of ``/proc/PID`` files that take the target's mmap lock;
- :mod:`._oom`: whether a SIGKILL came from the kernel's OOM killer;
- :mod:`._thread_sampler`: which of a process's threads are in ``D`` (uninterruptible sleep), sampled
  once or scan after scan.

Standard library only; nothing here starts a thread.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from ._identity import ProcessIdentity as ProcessIdentity
    from ._identity import capture_identity as capture_identity
    from ._identity import is_local as is_local
    from ._identity import local_hostname as local_hostname
    from ._identity import local_pid_namespace as local_pid_namespace
    from ._identity import parse_identities as parse_identities
    from ._mm_read import MmReader as MmReader
    from ._mm_read import SkippedRead as SkippedRead
    from ._oom import OomProbe as OomProbe
    from ._pidfd import is_exited as is_exited
    from ._pidfd import open_pidfd as open_pidfd
    from ._pidfd import open_verified_pidfd as open_verified_pidfd
    from ._pidfd import send_signal as send_signal
    from ._pidfd import signal_verified as signal_verified
    from ._pidfd import verify_start_time as verify_start_time
    from ._thread_sampler import DStateSample as DStateSample
    from ._thread_sampler import ThreadSampler as ThreadSampler
    from ._thread_sampler import sample_d_state as sample_d_state

__all__ = [
    "DStateSample",
    "MmReader",
    "OomProbe",
    "ProcessIdentity",
    "SkippedRead",
    "ThreadSampler",
    "capture_identity",
    "is_exited",
    "is_local",
    "local_hostname",
    "local_pid_namespace",
    "open_pidfd",
    "open_verified_pidfd",
    "parse_identities",
    "sample_d_state",
    "send_signal",
    "signal_verified",
    "verify_start_time",
]

_SOURCES = {
    "ProcessIdentity": "_identity",
    "capture_identity": "_identity",
    "parse_identities": "_identity",
    "local_hostname": "_identity",
    "local_pid_namespace": "_identity",
    "is_local": "_identity",
    "open_pidfd": "_pidfd",
    "open_verified_pidfd": "_pidfd",
    "send_signal": "_pidfd",
    "signal_verified": "_pidfd",
    "verify_start_time": "_pidfd",
    "is_exited": "_pidfd",
    "MmReader": "_mm_read",
    "SkippedRead": "_mm_read",
    "OomProbe": "_oom",
    "DStateSample": "_thread_sampler",
    "ThreadSampler": "_thread_sampler",
    "sample_d_state": "_thread_sampler",
}

if not TYPE_CHECKING:
    from .._lazy import lazy_exports

    __getattr__, __dir__ = lazy_exports(__name__, _SOURCES, globals())
