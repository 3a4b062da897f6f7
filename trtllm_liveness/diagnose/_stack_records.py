"""The records of a rank's Python stacks, whichever source took them.

Two sources fill them: ``py-spy`` reading the rank's memory from outside (:mod:`._py_spy`: needs
ptrace rights, gives OS thread ids, names and GIL flags) and the rank's own ``faulthandler``
writing every thread's stack into a file on a signal (:mod:`._faulthandler_stacks`: needs no
ptrace, only the hook registered at the rank's start). :class:`RankStacks` says which source
gave the stacks (``source``) and why the other was not used (``other``).

A frame's file is told to be the standard library's by its name alone (never a ``stat`` of a
path the target gave: it may be on a stalled mount).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import os
import re
import sys
import sysconfig
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar

from .._record_fields import JsonRecord

__all__ = ["RankStacks", "StackFrame", "StackSource", "StackStatus", "ThreadStack", "parse_stack_text"]


class StackStatus(str, enum.Enum):
    """Whether a rank's Python stacks were taken, and if not why."""

    TAKEN = "taken"
    SKIPPED_TASK_IN_D = "skipped-task-in-d"
    SKIPPED_NOT_RUNNING = "skipped-not-running"  # zombie, gone, unreadable
    SKIPPED_STOPPED = "skipped-stopped"  # stopped (T): its dump handler cannot run
    NO_PY_SPY = "no-py-spy"
    NOT_REGISTERED = "not-registered"  # no faulthandler dump registered in the rank
    TIMED_OUT = "timed-out"
    DID_NOT_EXIT = "did-not-exit"  # timed out, SIGKILLed, and still there (itself stuck in D)
    FAILED = "failed"


class StackSource(str, enum.Enum):
    """Where a rank's stacks came from."""

    PY_SPY = "py-spy"
    FAULTHANDLER = "faulthandler"


@dataclass(frozen=True)
class StackFrame(JsonRecord):
    """One Python frame."""

    function: str
    file: str
    line: int

    def describe(self) -> str:
        """``function (file:line)`` with the file's base name."""
        return f"{self.function} ({os.path.basename(self.file)}:{self.line})"


@dataclass(frozen=True)
class ThreadStack(JsonRecord):
    """The Python stack of one thread, innermost frame first.

    ``tid`` is the OS thread id (None where the source does not give it: ``faulthandler`` names
    threads by their ``pthread`` id, which maps to an OS id only for the main thread). ``active``
    and ``owns_gil`` are False where the source does not tell (``faulthandler``). The form's
    ``stuck_in`` (:attr:`stuck_function`) is derived (by this host's standard library paths), so
    recomputed on reading, never compared.
    """

    json_form = ("tid", "name", "active", "owns_gil", "stuck_function", "frames")
    json_keys: ClassVar[Mapping[str, str]] = {"stuck_function": "stuck_in"}
    json_unchecked = ("stuck_function",)

    tid: int | None
    name: str
    active: bool
    owns_gil: bool
    frames: tuple[StackFrame, ...]

    @property
    def stuck_in(self) -> StackFrame | None:
        """The innermost frame outside the standard library (``Event.wait`` says less than its
        caller); the innermost frame when every frame is the standard library's."""
        for frame in self.frames:
            if not _is_stdlib(frame.file):
                return frame
        return self.frames[0] if self.frames else None

    @property
    def stuck_function(self) -> str | None:
        """:attr:`stuck_in`'s function, if known."""
        stuck = self.stuck_in
        return None if stuck is None else stuck.function


@dataclass(frozen=True)
class RankStacks(JsonRecord):
    """The outcome of taking one rank's stacks; ``threads`` is empty unless ``status`` is TAKEN.

    ``source`` is the source that gave the result (None when no source was tried, e.g. a rank
    that is gone); ``other_source`` says why the other source was not used (empty when it was not
    needed or not known). ``took_ms`` is kept to a tenth of a millisecond, as its JSON form has it.
    """

    status: StackStatus
    detail: str = ""
    took_ms: float = 0.0
    source: StackSource | None = None
    other_source: str = ""
    threads: tuple[ThreadStack, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "took_ms", round(self.took_ms, 1))

    def main_thread(self, pid: int) -> ThreadStack | None:
        """The stack of the thread whose id is ``pid`` (the main thread), else the first one."""
        for thread in self.threads:
            if thread.tid == pid:
                return thread
        return self.threads[0] if self.threads else None

    def with_source(self, source: StackSource | None, other: str = "") -> RankStacks:
        """This result, naming its source and why the other one was not used."""
        return dataclasses.replace(self, source=source, other_source=other)


def parse_stack_text(text: str, thread_head: re.Pattern[str], frame_line: re.Pattern[str],
                     thread: Callable[[re.Match[str], tuple[StackFrame, ...]], ThreadStack],
                     frame: Callable[[re.Match[str]], StackFrame], *,
                     one_dump: bool = False) -> tuple[ThreadStack, ...]:
    """The threads of a plain-text stack dump, innermost frame first: a line ``thread_head``
    matches starts a thread (``thread`` makes it of that match and its frames), each line under it
    that ``frame_line`` matches is a frame (``frame`` makes it); other lines are skipped. With
    ``one_dump``, a thread's head right after a frame line (no blank line between) starts the next
    dump, which is not read."""
    threads: list[ThreadStack] = []
    head: re.Match[str] | None = None
    frames: list[StackFrame] = []
    blank = True

    def flush() -> None:
        if head is not None:
            threads.append(thread(head, tuple(frames)))

    for line in text.splitlines():
        started = thread_head.match(line)
        if started is not None:
            if one_dump and head is not None and not blank:
                break  # the next dump
            flush()
            head, frames, blank = started, [], False
            continue
        blank = not line.strip()
        found = frame_line.match(line)
        if found is not None and head is not None:
            frames.append(frame(found))
    flush()
    return tuple(threads)


@functools.lru_cache(maxsize=1)
def _stdlib_dirs() -> tuple[str, ...]:
    # This interpreter's own paths (local files, read once), as given and resolved.
    paths = sysconfig.get_paths()
    found: set[str] = set()
    for key in ("stdlib", "platstdlib"):
        if key in paths:
            found.update({paths[key] + os.sep, os.path.realpath(paths[key]) + os.sep})
    return tuple(sorted(found))


@functools.lru_cache(maxsize=1)
def _stdlib_module_files() -> frozenset[str]:
    # Base names of this interpreter's stdlib modules, from the name list (no filesystem access).
    return frozenset(f"{name}.py" for name in getattr(sys, "stdlib_module_names", ()))


def _is_stdlib(filename: str) -> bool:
    # By the string alone: the names come from the target (its mount namespace, perhaps a stalled
    # NFS or FUSE path), and a stat or realpath of one could block this scan in D.
    if filename.startswith("<frozen"):
        return True
    if "site-packages" in filename or "dist-packages" in filename:
        return False
    if "/" not in filename:  # py-spy's text dump shows base names
        return filename in _stdlib_module_files()
    return filename.startswith(_stdlib_dirs()) or bool(re.search(r"/lib/python3\.\d+/[^/]+\.py$", filename))
