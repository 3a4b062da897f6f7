"""Fault-injection scenarios on the reference executor: the engine of the demo, tests and benchmark.

Run as ``python -m trtllm_liveness.reference._scenario '<json options>'`` in a child process
started with ``start_new_session=True`` (an MPI launcher may kill its whole process group). It
prints one JSON line per iteration and a final ``{"done": true}`` line, then ends with
``os._exit`` so no MPI/atexit join can hang it. Every wait is bounded by the options.

A scenario: start the executor (mode ``1.2`` or ``main``, liveness on or off), stream requests,
inject the fault into one rank (``kill`` = SIGKILL, ``stop`` = SIGSTOP, ``wedge`` = cgroup v1
freezer, which makes real ``D`` state), then time detection, health, failed requests and shutdown.
Without liveness, the hang is observed for ``observe_s`` and the workers are then killed by the
harness (the executor itself would wait forever).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import uuid
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Any

from .. import _pidfd
from .._identity import ProcessIdentity
from .._shutdown import stop_processes
from ._env import configure_mpi_env

FREEZER_ROOT = "/sys/fs/cgroup/freezer"


@dataclass
class ScenarioOptions:
    mode: str = "main"
    workers: int = 2
    liveness: bool = True
    fault: str = "kill"  # kill | stop | wedge | none
    fault_rank: int = 1
    fault_phase: str = "serving"  # serving | init
    requests: int = 4
    tokens: int = 400
    token_delay_s: float = 0.01
    init_delay_s: float = 0.0
    observe_s: float = 10.0
    stall_timeout_s: float = 1.0
    health_probe: str = "check_health"  # check_health | fatal_error (upstream's loop alone)
    d_state_timeout_s: float = 1.0
    scan_interval_s: float = 0.1
    shutdown_grace_s: float = 5.0
    shutdown_term_s: float = 0.5
    shutdown_kill_s: float = 1.0
    iterations: int = 1
    # How the executor is built: "class" (reference proxy class, mixed in directly);
    # "executor_cls" / "autoload" / "plain" go through an importable ``tensorrt_llm`` (the test
    # fakes): liveness_executor_class(GenerationExecutor).create(...), the import hook, or none.
    via: str = "class"


def _emit(record: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def _read_identities(directory: str, count: int, timeout: float) -> list[ProcessIdentity]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = []
        for rank in range(count):
            path = os.path.join(directory, f"rank{rank}.json")
            try:
                with open(path) as handle:
                    found.append(ProcessIdentity(*json.load(handle)))
            except (OSError, ValueError):
                break
        if len(found) == count:
            return found
        time.sleep(0.005)
    raise TimeoutError(f"workers did not announce themselves within {timeout}s")


class _Freezer:
    def __init__(self) -> None:
        self.path = os.path.join(FREEZER_ROOT, f"trtllm-liveness-scenario-{uuid.uuid4().hex[:12]}")
        os.mkdir(self.path)

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w") as handle:
            handle.write(value)

    def freeze(self, pid: int) -> None:
        for tid in [str(pid), *os.listdir(f"/proc/{pid}/task")]:
            with contextlib.suppress(OSError):
                self._write("tasks", tid)
        self._write("freezer.state", "FROZEN")

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            self._write("freezer.state", "THAWED")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.02)


def _inject(fault: str, identity: ProcessIdentity, freezer: _Freezer | None) -> None:
    if fault == "wedge":
        assert freezer is not None
        freezer.freeze(identity.pid)
        return
    sig = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}[fault]
    fd = _pidfd.open_verified_pidfd(identity.pid, identity.start_time)  # never a recycled pid
    try:
        _pidfd.send_signal(fd, sig)
    finally:
        os.close(fd)


def _build(opts: ScenarioOptions, worker_kwargs: dict[str, Any]) -> Any:
    if opts.via == "class":
        return _proxy_class(opts)(worker_kwargs, model_world_size=opts.workers)
    if opts.via == "autoload":
        import importlib

        importlib.import_module("trtllm_liveness.integrations.trtllm_autoload")
    from tensorrt_llm.executor.executor import GenerationExecutor  # the test fakes

    executor_cls: Any = GenerationExecutor
    if opts.via == "executor_cls":
        from ..integrations.trtllm import liveness_executor_class

        executor_cls = liveness_executor_class(GenerationExecutor)
    return executor_cls.create(model_world_size=opts.workers, **worker_kwargs)


def _proxy_class(opts: ScenarioOptions) -> type:
    from ._proxy import PROXY_CLASSES

    base = PROXY_CLASSES[opts.mode]
    if not opts.liveness:
        return base
    from ..integrations.trtllm import liveness_proxy_class

    return liveness_proxy_class(base, default_enabled=True)


def _health(proxy: Any, probe: str) -> bool:
    if probe == "fatal_error":
        return getattr(proxy, "_fatal_error", None) is None
    check = getattr(proxy, "check_health", None)
    return bool(check()) if callable(check) else not proxy.is_shutdown()


def run_once(opts: ScenarioOptions, iteration: int) -> dict[str, Any]:
    announce = tempfile.mkdtemp(prefix="trtllm-scenario-")
    llm_args = SimpleNamespace(worker_liveness={
        "d_state_timeout_s": opts.d_state_timeout_s, "scan_interval_s": opts.scan_interval_s,
        "shutdown_grace_s": opts.shutdown_grace_s, "shutdown_term_s": opts.shutdown_term_s,
        "shutdown_kill_s": opts.shutdown_kill_s,
    } if opts.liveness else False)
    worker_kwargs = {"token_delay_s": opts.token_delay_s, "init_delay_s": opts.init_delay_s,
                     "announce_dir": announce, "llm_args": llm_args}
    out: dict[str, Any] = {"iteration": iteration, "mode": opts.mode, "liveness": opts.liveness,
                           "fault": opts.fault, "fault_rank": opts.fault_rank, "phase": opts.fault_phase}
    freezer = _Freezer() if opts.fault == "wedge" else None
    if freezer is not None:
        out["freezer_path"] = freezer.path
    identities: list[ProcessIdentity] = []
    proxy: Any = None
    try:
        t_start = time.monotonic()
        if opts.fault_phase == "init":
            return _run_init_fault(opts, worker_kwargs, announce, freezer, out, identities)
        proxy = _build(opts, worker_kwargs)
        out["proxy_class"] = type(proxy).__name__
        out["ready_ms"] = (time.monotonic() - t_start) * 1e3
        identities.extend(_read_identities(announce, opts.workers, 10))
        out["pids"] = [identity.pid for identity in identities]
        _emit({"pids": out["pids"], "iteration": iteration})
        results = [proxy.generate_async([rank] * opts.tokens) for rank in range(opts.requests)]
        for result in results:
            result.started.wait(10)
        out["in_flight"] = sum(1 for result in results if result.started.is_set() and not result.done)
        if opts.fault == "none":
            out["tokens_ok"] = all(r.result(30) == [i] * opts.tokens for i, r in enumerate(results))
        else:
            victim = identities[opts.fault_rank]
            out["victim"] = {"rank": victim.rank, "pid": victim.pid}
            t0 = time.monotonic()
            _inject(opts.fault, victim, freezer)
            _observe(opts, proxy, results, t0, out)
        _finish(opts, proxy, identities, out)
        return out
    finally:
        if freezer is not None:
            freezer.remove()
        shutil.rmtree(announce, ignore_errors=True)


def _observe(opts: ScenarioOptions, proxy: Any, results: list[Any], t0: float, out: dict[str, Any]) -> None:
    deadline = t0 + opts.observe_s
    health_false = failed_all = stalled = None
    last_progress = t0
    last_tokens = sum(len(r.tokens) for r in results)
    while time.monotonic() < deadline:
        now = time.monotonic()
        if health_false is None and not _health(proxy, opts.health_probe):
            health_false = now
        if failed_all is None and all(r.done and r.error is not None for r in results):
            failed_all = max(r.finished_at for r in results)
        tokens = sum(len(r.tokens) for r in results)
        if tokens != last_tokens:
            last_tokens, last_progress = tokens, now
        elif stalled is None and now - last_progress >= opts.stall_timeout_s and not all(r.done for r in results):
            stalled = now
        if health_false is not None and failed_all is not None:
            break
        if opts.fault == "stop" and stalled is not None:
            break
        time.sleep(0.0005)
    events = list(getattr(proxy, "liveness_events", []))

    def ms(value: float | None) -> float | None:
        return None if value is None else round((value - t0) * 1e3, 3)

    out["detected_ms"] = ms(events[0].detected_at) if events else None
    out["health_false_ms"] = ms(health_false)
    out["requests_failed_ms"] = ms(failed_all)
    out["e2e_ms"] = ms(max(health_false, failed_all)) if health_false and failed_all else None
    out["stall_detected_ms"] = ms(stalled)
    out["events"] = [event.to_dict() for event in events]
    fatal = getattr(proxy, "_fatal_error", None)
    out["fatal_error"] = None if fatal is None else str(fatal)
    out["fatal_error_type"] = None if fatal is None else type(fatal).__name__
    out["pending_errors"] = sorted({type(r.error).__name__ for r in results if r.error is not None})
    out["pending_not_done"] = sum(1 for r in results if not r.done)
    out["new_request_error"] = None
    if health_false is not None:
        try:
            proxy.generate_async([1, 2, 3])
        except Exception as exc:
            out["new_request_error"] = type(exc).__name__
    out["detection_window_s"] = opts.observe_s


def _finish(opts: ScenarioOptions, proxy: Any, identities: list[ProcessIdentity], out: dict[str, Any]) -> None:
    if opts.liveness or opts.fault == "none":
        t = time.monotonic()
        proxy.shutdown()
        out["shutdown_ms"] = round((time.monotonic() - t) * 1e3, 3)
        out["pre_shutdown_calls"] = getattr(proxy, "liveness_pre_shutdown_calls", None)
        out["pre_shutdown_runs"] = proxy.pre_shutdown_runs
        report = getattr(proxy, "liveness_shutdown_report", None)
        out["shutdown_report"] = None if report is None else report.to_dict()
        out["unkillable"] = [] if report is None else [u.pid for u in report.unkillable]
        out["restartable"] = None if report is None else report.restartable
        fatal = getattr(proxy, "liveness_fatal_error", None)
        out["fatal_restartable"] = None if fatal is None else fatal.restartable
        if os.path.isdir(getattr(proxy, "_ipc_dir", "")):  # upstream's shutdown was abandoned
            with contextlib.suppress(Exception):
                proxy._close_queues()
    else:
        # The executor would wait forever: the harness ends the hang itself.
        stop_processes(identities, grace_s=0.0, kill_s=2.0)
        with contextlib.suppress(Exception):
            proxy.mpi_session.shutdown()
        with contextlib.suppress(Exception):
            proxy._close_queues()
        out["shutdown_ms"] = None
    out["survivors"] = [i.pid for i in identities if _alive(i)]


def _alive(identity: ProcessIdentity) -> bool:
    try:
        _pidfd.verify_start_time(identity.pid, identity.start_time)
    except Exception:
        return False
    return True


def _run_init_fault(opts: ScenarioOptions, worker_kwargs: dict[str, Any], announce: str,
                    freezer: _Freezer | None, out: dict[str, Any], identities: list[ProcessIdentity]) -> dict[str, Any]:
    holder: dict[str, Any] = {}

    def build() -> None:
        try:
            holder["proxy"] = _build(opts, worker_kwargs)
        except BaseException as exc:
            holder["error"] = exc

    builder = threading.Thread(target=build, name="scenario-build", daemon=True)
    builder.start()
    identities.extend(_read_identities(announce, opts.workers, 10))
    _emit({"pids": [i.pid for i in identities], "iteration": out["iteration"]})
    time.sleep(min(0.2, opts.init_delay_s / 4))
    victim = identities[opts.fault_rank]
    out["victim"] = {"rank": victim.rank, "pid": victim.pid}
    t0 = time.monotonic()
    _inject(opts.fault, victim, freezer)
    builder.join(opts.observe_s)
    out["init_hung"] = builder.is_alive()
    error = holder.get("error")
    out["init_error_ms"] = None if builder.is_alive() else round((time.monotonic() - t0) * 1e3, 3)
    out["init_error_type"] = None if error is None else type(error).__name__
    out["init_error"] = None if error is None else str(error)
    out["restartable"] = getattr(error, "restartable", None)
    if builder.is_alive() or "proxy" in holder:
        stop_processes(identities, grace_s=0.0, kill_s=2.0)
    out["survivors"] = [i.pid for i in identities if _alive(i)]
    return out


def main(argv: list[str]) -> None:
    options = ScenarioOptions(**json.loads(argv[0])) if argv else ScenarioOptions()
    if options.fault not in ("kill", "stop", "wedge", "none"):
        raise SystemExit(f"unknown fault {options.fault!r}")
    configure_mpi_env()
    code = 0
    try:
        for iteration in range(options.iterations):
            record = run_once(options, iteration)
            record["options"] = asdict(options)
            _emit(record)
        _emit({"done": True})
    except BaseException:
        _emit({"error": traceback.format_exc()})
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])


# ------------------------------------------------------------------- parent side (demo, bench, tests)


def session_members(sid: int) -> list[int]:
    """PIDs whose session id is ``sid`` (the scenario child's session: it, prte and the workers)."""
    members = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as handle:
                data = handle.read()
        except OSError:
            continue
        fields = data[data.rfind(b")") + 2:].split()
        if len(fields) > 3 and int(fields[3]) == sid and fields[0] not in (b"Z", b"X"):
            members.append(int(name))
    return members


def kill_session(sid: int, timeout: float = 5.0) -> list[int]:
    """SIGKILL every live member of session ``sid`` (verified by start time); return survivors.

    Only for a session this process created (``start_new_session=True``): its members are ours.
    """
    deadline = time.monotonic() + timeout
    while True:
        members = session_members(sid)
        if not members or time.monotonic() > deadline:
            return members
        for pid in members:
            with contextlib.suppress(Exception):
                start = _pidfd.verify_start_time(pid, None).start_time
                fd = _pidfd.open_verified_pidfd(pid, start)
                try:
                    _pidfd.send_signal(fd, signal.SIGKILL)
                finally:
                    os.close(fd)
        time.sleep(0.05)


def run_in_child(
    options: dict[str, Any], timeout: float, env: dict[str, str] | None = None
) -> tuple[list[dict[str, Any]], list[int]]:
    """Run a scenario in a new session with an outer ``timeout``; always kill what is left.

    Returns the JSON records it printed and the pids still alive after cleanup (should be none).
    """
    import subprocess

    child = subprocess.Popen(
        [sys.executable, "-m", "trtllm_liveness.reference._scenario", json.dumps(options)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
        env=None if env is None else {**os.environ, **env},
    )
    try:
        stdout, stderr = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_session(child.pid)
        stdout, stderr = child.communicate(timeout=10)
        stderr += b"\n[scenario timed out]"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
    # prte and the workers outlive a parent that exits: give them a moment, then kill them.
    deadline = time.monotonic() + 3
    while session_members(child.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    survivors = kill_session(child.pid)
    records = []
    for line in stdout.decode(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            records.append(json.loads(line))
    if not any(r.get("done") for r in records):
        records.append({"stderr": stderr.decode(errors="replace")[-4000:]})
    return records, survivors
