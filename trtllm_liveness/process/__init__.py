"""What a process is, read and acted on safely: the first step of the flow.

- :mod:`._procfs`: parsing of ``/proc`` (state, start time, threads, signals, namespaces); pure,
  ``PROCFS_PATH`` read on every call so tests can point it at a fake tree;
- :mod:`._pidfd`: pidfd syscalls: open a handle, verify it against a start time, signal through it;
- :mod:`._identity`: :class:`ProcessIdentity`, who a worker is in a form that survives PID reuse and
  crosses IPC and hosts;
- :mod:`._mm_read`: bounded reads of ``/proc/PID`` files that take the target's mmap lock;
- :mod:`._oom`: whether a SIGKILL came from the kernel's OOM killer;
- :mod:`._thread_sampler`: which of a process's threads are in ``D`` (uninterruptible sleep), sampled
  once or scan after scan;
- :mod:`trtllm_liveness._errors`: what they raise: :class:`LivenessError` and its subclasses (a
  process gone, a zombie, a reused PID, access denied), :class:`InvalidIdentityError`.

Standard library only; nothing here starts a thread.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from .._errors import AccessDenied, InvalidIdentityError, LivenessError, PidReused, ProcessGone, ProcessZombie
    from ._identity import (
        ProcessIdentity,
        capture_identity,
        is_local,
        local_hostname,
        local_pid_namespace,
        parse_identities,
    )
    from ._mm_read import MmReader, SkippedRead
    from ._oom import OomProbe
    from ._pidfd import is_exited, open_pidfd, open_verified_pidfd, send_signal, signal_verified, verify_start_time
    from ._thread_sampler import DStateSample, ThreadSampler, sample_d_state

__all__ = ["AccessDenied", "DStateSample", "InvalidIdentityError", "LivenessError", "MmReader", "OomProbe", "PidReused",
           "ProcessGone", "ProcessIdentity", "ProcessZombie", "SkippedRead", "ThreadSampler", "capture_identity",
           "is_exited", "is_local", "local_hostname", "local_pid_namespace", "open_pidfd", "open_verified_pidfd",
           "parse_identities", "sample_d_state", "send_signal", "signal_verified", "verify_start_time"]

_SOURCES = {
    ".._errors": ("AccessDenied", "InvalidIdentityError", "LivenessError", "PidReused", "ProcessGone", "ProcessZombie"),
    "._identity": ("ProcessIdentity", "capture_identity", "is_local", "local_hostname", "local_pid_namespace",
        "parse_identities"),
    "._mm_read": ("MmReader", "SkippedRead"),
    "._oom": ("OomProbe",),
    "._pidfd": ("is_exited", "open_pidfd", "open_verified_pidfd", "send_signal", "signal_verified",
        "verify_start_time"),
    "._thread_sampler": ("DStateSample", "ThreadSampler", "sample_d_state"),
}

if not TYPE_CHECKING:
    from .._lazy import lazy_exports

    __getattr__, __dir__ = lazy_exports(__name__, _SOURCES, globals())
