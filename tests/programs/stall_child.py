"""Child process: stall detection on an upstream-shaped fake, with real MPI ranks.

Usage: ``python -m tests.programs.stall_child '{"tree": "main" | "v12", "engine": {...FakeEngine knobs},
"requests": n, "max_tokens": m, "streaming": bool, "watch_s": s, "expect": "stall" | "none"}'`` with
``TRTLLM_WORKER_LIVENESS`` configuring the extension (``stall_timeout_s``, ``stall_action``).

Builds the engine with upstream's ``create()`` (the extension installed as the import hook does),
submits ``requests`` requests (after ``idle_first_s`` of an idle engine, watched too) and then
watches for ``watch_s`` seconds (monotonic, a bound, never an assertion), emitting one JSON record
at the end:

- ``stall``: the first :class:`StallInfo` seen (``stall_under_way``), or None;
- ``statuses``: the rank states seen while stalled;
- ``health``: ``check_health()`` (or ``not is_shutdown()`` on 1.2.x) once the stall was seen (with
  the option ``fatal``: once the engine's fatal error is set);
- ``fatal``: the fatal error's text, or None; ``errors``: how many requests ended with an error;
  ``finished``: how many finished with output;
- ``diagnosis``: the latest diagnosis' ranks (activity, innermost function) and odd rank out,
  once it finished (waited for up to ``diagnosis_s``).

With ``expect`` "none" it watches the whole ``watch_s`` (an engine that must never stall); with
"stall" it stops watching once the stall (or the fatal error) is seen. Then ``shutdown()`` (bounded),
or, with ``"shutdown": false``, nothing: the process ends at once (``ranks_alive`` in the record: the
ranks still running then). ``health_end``: the health read after the watch (upstream's own check
included), then up to ``settle_s`` for what that check did to the requests.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

from tests.support.ref_engine import emit
from tests.support.upstream_fakes import use_tree


def _spawned_ranks() -> list[list[int]]:
    """The ranks as the process tree has them (extension off: no identities): this process's
    grandchildren (this process -> prte -> ranks) running ``mpi4py.futures.server``, by pid."""
    def parent(pid: int) -> int:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return int(handle.read().rpartition(b")")[2].split()[1])

    found: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                if b"mpi4py.futures.server" in handle.read() and parent(parent(int(entry))) == os.getpid():
                    found.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return [[rank, pid] for rank, pid in enumerate(sorted(found))]


def _health(proxy: Any) -> bool:
    check = getattr(proxy, "check_health", None)
    return bool(check()) if callable(check) else not proxy.is_shutdown()


def _outcomes(results: list[Any], seen: dict[int, str]) -> dict[int, str]:
    """Each request's outcome so far ("finished", "error" or "pending"), reading without blocking."""
    import queue

    for index, result in enumerate(results):
        while seen.get(index, "pending") == "pending" and not result.finished:
            try:
                result._result_step(0)
            except queue.Empty:
                break
            except Exception:
                seen[index] = "error"
        if seen.get(index, "pending") == "pending" and result.finished:
            seen[index] = "finished"
    return {index: seen.get(index, "pending") for index in range(len(results))}


def main(options: dict[str, Any]) -> int:
    use_tree(str(options.get("tree", "main")))
    from trtllm_liveness.demo._mpi_env import configure_mpi_env

    configure_mpi_env()
    import importlib

    from trtllm_liveness.integrations.trtllm import patch_tensorrt_llm
    from trtllm_liveness.integrations.trtllm._state import stall_under_way

    proxy_module: Any = importlib.import_module("tensorrt_llm.executor.proxy")
    patch_tensorrt_llm(proxy_module)
    common = importlib.import_module("_trtllm_fake_common")
    executor_cls = importlib.import_module("tensorrt_llm.executor.executor").GenerationExecutor
    proxy = executor_cls.create(common.FakeEngine(**options.get("engine", {})), model_world_size=2)
    monitor = proxy.liveness_monitor  # None with liveness off
    ranks = [[i.rank, i.pid] for i in (monitor.identities if monitor is not None else [])] or _spawned_ranks()
    emit({"identities": ranks})
    stall: Any = None
    idle_until = time.monotonic() + float(options.get("idle_first_s", 0))
    while time.monotonic() < idle_until:  # an idle engine: watched, never stalled
        stall = stall or stall_under_way(proxy)
        time.sleep(0.01)
    results = [proxy.generate_async([rank + 1], max_tokens=int(options.get("max_tokens", 10**6)),
                                    streaming=bool(options.get("streaming", True)))
               for rank in range(int(options.get("requests", 2)))]
    expect_stall = options.get("expect", "stall") == "stall"
    seen: dict[int, str] = {}
    deadline = time.monotonic() + float(options.get("watch_s", 30))
    statuses: list[list[Any]] = []
    health: bool | None = None
    while time.monotonic() < deadline:
        current = stall_under_way(proxy)
        if current is not None and (stall is None or not statuses):
            stall = current
            statuses = [[s.identity.rank, s.state.value] for s in proxy.liveness_statuses()]
            health = _health(proxy)
        if expect_stall and (stall is not None or proxy.liveness_fatal_error is not None):
            break
        if not expect_stall and "pending" not in _outcomes(results, seen).values():
            break
        time.sleep(0.01)
    if options.get("fatal"):
        # A fatal stall: the stall is seen (the timer's record) a moment before its fatal path has
        # failed the engine; health is read once that fatal error is set.
        while time.monotonic() < deadline and proxy.liveness_fatal_error is None:
            time.sleep(0.01)
        health = _health(proxy) if proxy.liveness_fatal_error is not None else health
    elif health is None and proxy.liveness_fatal_error is not None:
        health = _health(proxy)
    diagnosis = None
    diagnoser = proxy.liveness_state.diagnoser
    if stall is not None or proxy.liveness_fatal_error is not None:
        diagnoser.done.wait(float(options.get("diagnosis_s", 20)))
        found = proxy.liveness_diagnosis()
        if found is not None:
            diagnosis = {"ranks": [[r.rank, r.activity.value, None if r.stuck_in is None else r.stuck_in.function,
                                    r.stacks.status.value if r.stacks is not None else None] for r in found.ranks],
                         "threads_in": {str(r.rank): sorted(stack.stuck_in.function for stack in r.stacks.threads
                                                            if stack.stuck_in is not None)
                                        for r in found.ranks if r.stacks is not None},
                         "odd": None if found.odd_rank_out is None else found.odd_rank_out.reason,
                         "summary": found.summary()}
    ended = time.monotonic() + 5
    while time.monotonic() < ended and proxy.liveness_fatal_error is not None \
            and "pending" in _outcomes(results, seen).values():
        time.sleep(0.01)
    health_end = _health(proxy)  # upstream's own check too (main's: its monitor's find_dead_worker)
    settled = time.monotonic() + float(options.get("settle_s", 0))
    while time.monotonic() < settled and "pending" in _outcomes(results, seen).values():
        time.sleep(0.01)
    outcomes = list(_outcomes(results, seen).values())
    errors, finished = outcomes.count("error"), outcomes.count("finished")
    fatal = proxy.liveness_fatal_error
    emit({"stall": None if stall is None else stall.to_dict(),
          "stall_quiet_s": None if stall is None else stall.quiet_s,
          "statuses": statuses, "health": health, "health_end": health_end,
          "fatal": None if fatal is None else str(fatal),
          "fatal_kind": None if fatal is None else fatal.event.kind.value,
          "errors": errors, "finished": finished, "diagnosis": diagnosis,
          "events": [event.kind.value for event in proxy.liveness_events],
          "ranks_alive": [rank for rank, pid in ranks if _alive(pid)]})
    if options.get("shutdown", True) is False:
        # An engine left as the fault left it (without the extension a shutdown may hang on a
        # stopped or dead rank): the harness kills this process's session.
        sys.stdout.flush()
        os._exit(0)
    proxy.shutdown()
    return 0


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (not gone, not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rpartition(b")")[2].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


if __name__ == "__main__":  # mpi4py's workers import this module as __worker__: nothing may run then
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(threadName)s %(levelname)s %(name)s: %(message)s")
    sys.exit(main(json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}))
