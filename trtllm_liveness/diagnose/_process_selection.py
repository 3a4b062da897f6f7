"""Which processes to scan: the operator's filters behind ``trtllm-liveness scan --name/--parent/--cgroup``.

:func:`select` matches every process of the host against the filters given (process name or
command line, descendant of a pid, member of a cgroup), never the scanning command itself or its
ancestors (their command lines carry the filter string). Command lines are read through
:class:`~trtllm_liveness.process._mm_read.MmReader` with a deadline, so a process stuck on its
mmap lock cannot hang the selection; such a read is reported in :attr:`Selection.skipped`.

Standard library only; never sends a signal.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from ..process import _procfs
from ..process._mm_read import DEFAULT_TIMEOUT_S, MmReader, SkippedRead, read_cmdline

__all__ = ["Selection", "select"]


@dataclass(frozen=True)
class Selection:
    """The processes a filter matched, and the reads it could not make while matching.

    A process in ``skipped`` could not be matched by its command line (its comm was still
    compared); scan it by pid, or select it with ``parent``/``cgroup``, which need no such read.
    """

    pids: tuple[int, ...]
    skipped: tuple[SkippedRead, ...] = ()


def _cgroup_paths(pid: int) -> list[str]:
    # /proc/<pid>/cgroup: "hierarchy-id:controllers:path" per line (v1), "0::path" (v2).
    # Here, not in process/_procfs.py: nothing but the operator's selection needs it.
    try:
        data = _procfs.read_whole(f"{_procfs.PROCFS_PATH}/{pid}/cgroup")
    except OSError:
        return []
    paths = []
    for line in data.decode("utf-8", "replace").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            paths.append(parts[2])
    return paths


def _pids_of_cgroup_dir(directory: str) -> set[int]:
    found: set[int] = set()
    for root, _dirs, files in os.walk(directory):
        if "cgroup.procs" not in files:
            continue
        try:
            with open(os.path.join(root, "cgroup.procs")) as handle:
                found.update(int(line) for line in handle if line.strip().isdigit())
        except OSError:
            continue
    return found


def _in_cgroup(paths: list[str], wanted: str) -> bool:
    wanted = wanted.rstrip("/") or "/"
    return any(
        path == wanted or path.startswith(wanted + "/") or wanted == "/"
        for path in paths
    )


def select(
    *, name: str | None = None, parent: int | None = None, cgroup: str | None = None,
    read_timeout_s: float = DEFAULT_TIMEOUT_S, reader: MmReader | None = None,
) -> Selection:
    """PIDs matching every given filter, sorted; the calling process and its ancestors excluded.

    ``name``: substring of the process name (``comm``) or of its command line joined by spaces
    (e.g. ``mpi4py.futures.server``). ``parent``: descendants of that pid, at any depth (MPI
    spawned workers are grandchildren of the launcher). ``cgroup``: an existing cgroup directory
    (e.g. ``/sys/fs/cgroup/freezer/job``: its ``cgroup.procs`` and those of its sub-groups), or a
    cgroup path as written in ``/proc/<pid>/cgroup`` (``/system.slice/job.service``: that group
    and below). Raises ``ValueError`` when no filter is given. Reads one ``stat`` per process on
    the host (a few ms for hundreds); thread-safe.

    ``name`` reads the command line of each candidate whose comm does not match, through
    ``reader`` (default: a fresh :class:`MmReader` with ``read_timeout_s``): at most
    ``read_timeout_s`` for each that hangs on its mm lock, up to the reader's bound on stuck
    helpers. Unlike the scan's report, a process in ``D`` is read too (with that deadline):
    skipping it would hide the wedged worker the filter is meant to find. Reads that timed out or
    were skipped are in :attr:`Selection.skipped`, and those processes are not matched.
    """
    if name is None and parent is None and cgroup is None:
        raise ValueError("give at least one filter: name, parent or cgroup")
    infos: dict[int, _procfs.StatInfo] = {}
    for pid in _procfs.list_pids():
        info = _procfs.stat_or_none(pid)
        if info is not None:
            infos[pid] = info
    # The scanning command's own shell and launcher carry the filter string in their command
    # lines; never report them.
    pid = os.getpid()
    excluded = {pid}
    while pid > 1 and pid in infos:
        pid = infos[pid].ppid
        excluded.add(pid)
    candidates = set(infos) - excluded
    if parent is not None:
        children: dict[int, list[int]] = {}
        for pid, info in infos.items():
            children.setdefault(info.ppid, []).append(pid)
        descendants: set[int] = set()
        stack = [parent]
        while stack:
            for child in children.get(stack.pop(), []):
                if child not in descendants:
                    descendants.add(child)
                    stack.append(child)
        candidates &= descendants
    if cgroup is not None:
        # Only a real cgroup directory (it has cgroup.procs) is walked: "/" is a cgroup path too,
        # and walking the root filesystem would take minutes.
        if os.path.isfile(os.path.join(cgroup, "cgroup.procs")):
            candidates &= _pids_of_cgroup_dir(cgroup)
        else:
            candidates = {pid for pid in candidates if _in_cgroup(_cgroup_paths(pid), cgroup)}
    skipped: list[SkippedRead] = []
    if name is not None:
        matched = set()
        with MmReader(read_timeout_s) if reader is None else contextlib.nullcontext(reader) as mm_reader:
            for pid in sorted(candidates):
                if name in infos[pid].comm:
                    matched.add(pid)
                    continue
                cmdline, skip = read_cmdline(pid, mm_reader, None)
                if skip is not None:
                    skipped.append(skip)
                elif name in " ".join(cmdline):
                    matched.add(pid)
        candidates = matched
    return Selection(tuple(sorted(candidates)), tuple(skipped))
