"""What ``bench_overhead.py`` measures inside the ranks of the fake ``tensorrt_llm``.

Imported in every rank when the task's engine, a :class:`ProbedEngine`, is unpickled: that happens
before the task's function runs, so before the extension's rank entry (which starts the extension's
rank threads) and before the fake's ``worker_main``. The rank's ``sys.path`` is the proxy's (the
fake's ``MpiPoolSession`` passes it, as upstream), which holds ``scripts/`` and ``tests/fakes``.
Nothing here runs without a ``ProbedEngine``; the same probe runs with the extension off and on.

- **Threads**: at ``worker_main``'s entry, the threads that appeared since this import (the
  extension's rank threads: they are all started by its entry, before ``worker_main``), with their
  names (Python's for Python threads, the kernel's ``comm`` for native ones, e.g. ZMQ's), and the
  rank's thread count, go to ``<probe_dir>/rank<N>.json``.
- **Iterations**: the leader's ``HangDetector`` is wrapped so that each ``checkpoint()`` call of the
  executor loop (the extension's iteration reporter wraps the method when on) is timed in the loop
  itself; ``<probe_dir>/ticks.json`` gets the count, mean and percentiles when the engine shuts down.
"""

from __future__ import annotations

import importlib
import json
import os
import threading
import time
from array import array
from dataclasses import dataclass
from typing import Any

import _trtllm_fake_common as fake  # on sys.path once the fake tensorrt_llm was imported


def task_tids(pid: int | str = "self") -> set[int]:
    """Thread ids of ``pid`` (``/proc/<pid>/task``)."""
    return {int(name) for name in os.listdir(f"/proc/{pid}/task") if name.isdigit()}


_TIDS_AT_IMPORT = task_tids()


@dataclass(frozen=True)
class ProbedEngine(fake.FakeEngine):
    """The fake's engine, plus where the probe writes (a directory of the proxy's run)."""

    probe_dir: str = ""


def _write(path: str, record: dict[str, Any]) -> None:
    with open(path + ".tmp", "w") as handle:
        json.dump(record, handle)
    os.replace(path + ".tmp", path)  # a reader never sees half a file


def _thread_names() -> dict[int, str]:
    names = {thread.native_id: thread.name for thread in threading.enumerate() if thread.native_id is not None}
    for tid in task_tids():
        if tid not in names:
            try:
                with open(f"/proc/self/task/{tid}/comm") as handle:
                    names[tid] = handle.read().strip()
            except OSError:
                continue
    return names


def _record_threads(engine: Any) -> None:
    if not isinstance(engine, ProbedEngine) or not engine.probe_dir:
        return
    rank = fake.mpi_comm().Get_rank()
    names = _thread_names()
    added = sorted(set(names) - _TIDS_AT_IMPORT)
    _write(os.path.join(engine.probe_dir, f"rank{rank}.json"),
           {"rank": rank, "pid": os.getpid(), "threads": len(names),
            "added_threads": [{"tid": tid, "name": names[tid]} for tid in added]})


class _TimedDetector:
    """Times each ``checkpoint()`` as the executor loop calls it (through the class: the
    extension's wrapper when it is on)."""

    def __init__(self, inner: Any, probe_dir: str) -> None:
        self.inner = inner
        self.probe_dir = probe_dir
        self.samples = array("q")

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter_ns()
        result = self.inner.checkpoint(*args, **kwargs)
        self.samples.append(time.perf_counter_ns() - t0)
        return result

    def dump(self) -> None:
        ordered = sorted(self.samples)
        count = len(ordered)

        def pct(q: float) -> int | None:
            return ordered[min(count - 1, int(q * (count - 1)))] if count else None

        _write(os.path.join(self.probe_dir, "ticks.json"),
               {"count": count, "mean_ns": sum(ordered) / count if count else None,
                "p50_ns": pct(0.5), "p99_ns": pct(0.99)})


def _install() -> None:
    worker = importlib.import_module("tensorrt_llm.executor.worker")
    original_main = worker.worker_main_impl  # worker_main looks it up in its module at call time

    def worker_main_impl(**kwargs: Any) -> Any:
        _record_threads(kwargs.get("engine"))
        return original_main(**kwargs)

    worker.worker_main_impl = worker_main_impl

    original_detector = fake._hang_detector  # FakeEngineWorker looks it up in its module at call time
    current: list[ProbedEngine] = []

    def hang_detector() -> Any:
        inner = original_detector()
        if inner is None or not current:
            return inner
        return _TimedDetector(inner, current[0].probe_dir)

    fake._hang_detector = hang_detector
    original_init = fake.FakeEngineWorker.__init__
    original_shutdown = fake.FakeEngineWorker.shutdown

    def init(self: Any, engine: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(engine, ProbedEngine) and engine.probe_dir:
            current[:] = [engine]
        original_init(self, engine, *args, **kwargs)

    def shutdown(self: Any) -> None:
        original_shutdown(self)
        if isinstance(self.hang_detector, _TimedDetector):
            self.hang_detector.dump()

    fake.FakeEngineWorker.__init__ = init
    fake.FakeEngineWorker.shutdown = shutdown


_install()
