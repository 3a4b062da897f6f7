"""What a scenario watches while its fault plays out: health, requests, logs, dying threads.

:func:`observe` polls the executor from the fault on (health, every pending request failed, token
progress) within ``observe_s`` and times each against the fault; :func:`run_control` keeps requests
flowing without a fault and counts every alarm (each one false); :class:`HealthHammer` calls
``check_health()`` from several threads through the fault; :class:`CriticalLog` and
:class:`ThreadExceptions` collect the package's CRITICAL records and the exceptions that end threads.
Every wait is bounded.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from ._scenario_executor import expected_tokens, health, settled_fatal_error, submit
from ._scenario_faults import PidfdFloor
from ._scenario_records import ControlOutcome, Detection, HealthProbeOutcome, ScenarioOptions

if TYPE_CHECKING:
    from ..exit._snapshot_record import FatalSnapshot

__all__ = ["CriticalLog", "HealthHammer", "ThreadExceptions", "observe", "run_control"]


class CriticalLog(logging.Handler):
    """Collects CRITICAL records of the package (the watcher's death is logged so)."""

    def __init__(self) -> None:
        super().__init__(logging.CRITICAL)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class ThreadExceptions:
    """Records exceptions that end threads (mpi4py's manager thread, ours), then lets the previous
    hook print them as usual."""

    def __init__(self) -> None:
        self.messages: list[str] = []
        self.times: list[float] = []  # time.monotonic() of each
        self._previous = threading.excepthook

    def __enter__(self) -> ThreadExceptions:
        threading.excepthook = self._hook
        return self

    def __exit__(self, *exc: object) -> None:
        threading.excepthook = self._previous

    def _hook(self, args: threading.ExceptHookArgs) -> None:
        name = args.thread.name if args.thread is not None else "?"
        self.times.append(time.monotonic())
        self.messages.append(f"{name}: {args.exc_type.__name__}: {args.exc_value}")
        self._previous(args)


class HealthHammer:
    """``n`` threads calling ``check_health()`` in a loop, recording (called, returned, answer)."""

    def __init__(self, proxy: Any, probe: str, n: int) -> None:
        self.stop = threading.Event()
        self.calls: list[list[tuple[float, float, bool]]] = [[] for _ in range(n)]
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._loop, args=(proxy, probe, self.calls[i]),
                                         name=f"scenario-health-{i}", daemon=True) for i in range(n)]
        for thread in self.threads:
            thread.start()

    def _loop(self, proxy: Any, probe: str, calls: list[tuple[float, float, bool]]) -> None:
        while not self.stop.is_set():
            t_call = time.monotonic()
            try:
                answer = health(proxy, probe)
            except Exception as exc:
                self.errors.append(repr(exc))
                return
            calls.append((t_call, time.monotonic(), answer))
            time.sleep(0.0002)

    def finish(self, linger_s: float = 0.3) -> HealthProbeOutcome:
        self.stop.wait(linger_s)  # keep asking for a moment after the fault was handled
        self.stop.set()
        for thread in self.threads:
            thread.join(5)
        flat = [call for calls in self.calls for call in calls]
        first_false = min((returned for _, returned, answer in flat if not answer), default=None)
        # A True answer to a call that began after the first False had been returned is inconsistent.
        late_true = 0 if first_false is None else sum(
            1 for called, _, answer in flat if answer and called > first_false)
        flips = sum(1 for calls in self.calls for a, b in itertools.pairwise(calls) if not a[2] and b[2])
        return HealthProbeOutcome(
            threads=len(self.threads), calls=len(flat), false_answers=sum(1 for *_, answer in flat if not answer),
            inconsistent=late_true + flips, errors=tuple(self.errors),
            threads_alive=sum(1 for t in self.threads if t.is_alive()))


def observe(opts: ScenarioOptions, proxy: Any, results: list[Any], t0: float,
            floor: PidfdFloor | None) -> tuple[Detection, Any, int]:
    """Watch from the fault (``t0``) until health is False and every request failed (a stall, for
    ``stop``), at most until ``t0 + observe_s``. Returns the detection (each moment in ms after
    ``t0``), the executor's fatal error (settled) and how many requests are still not done."""
    deadline = t0 + opts.observe_s
    health_false = failed_all = stalled = None
    last_progress = t0
    last_tokens = sum(len(r.tokens) for r in results)
    while time.monotonic() < deadline:
        now = time.monotonic()
        if health_false is None and not health(proxy, opts.health_probe):
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

    new_request_error = None
    if health_false is not None:
        try:
            proxy.generate_async([1, 2, 3])
        except Exception as exc:
            new_request_error = type(exc).__name__
    detection = Detection(
        detected_ms=ms(events[0].detected_at) if events else None, health_false_ms=ms(health_false),
        requests_failed_ms=ms(failed_all),
        e2e_ms=ms(max(health_false, failed_all)) if health_false and failed_all else None,
        stall_detected_ms=ms(stalled), floor_ms=None if floor is None else floor.elapsed_ms(t0),
        pending_errors=tuple(sorted({type(r.error).__name__ for r in results if r.error is not None})),
        new_request_error=new_request_error, window_s=opts.observe_s)
    fatal = settled_fatal_error(proxy, wait=health_false is not None)
    return detection, fatal, sum(1 for r in results if not r.done)


def run_control(opts: ScenarioOptions, proxy: Any, results: list[Any],
                stop: threading.Event) -> tuple[ControlOutcome, Any, int]:
    """No fault: keep ``requests`` requests in flight for ``control_s`` seconds; count alarms.
    Returns the count, the executor's fatal error and how many requests are still not done."""
    deadline = time.monotonic() + opts.control_s
    active = list(results)
    prompts = list(range(len(results)))
    completed = errors = wrong = health_false = 0
    checks = 0
    while time.monotonic() < deadline:
        checks += 1
        if not health(proxy, opts.health_probe):
            health_false += 1
        for index, result in enumerate(active):
            if not result.done:
                continue
            if result.error is not None:
                errors += 1
            elif result.tokens != expected_tokens(opts, prompts[index]):
                wrong += 1
            completed += 1
            prompts[index] = completed % 1000
            active[index] = submit(opts, proxy, prompts[index], stop)
        time.sleep(0.005)
    for result in active:
        result.wait(30)
    fatal = getattr(proxy, "_fatal_error", None)
    events = len(getattr(proxy, "liveness_events", []))
    control = ControlOutcome(
        control_s=opts.control_s, requests_completed=completed, request_errors=errors, wrong_tokens=wrong,
        health_checks=checks, health_false=health_false, alarms=health_false + events + (fatal is not None) + errors)
    return control, fatal, sum(1 for r in active if not r.done)


SNAPSHOT_WAIT_S = 5.0
"""How long a scenario waits for the extension's snapshot of its ranks (its own bound is shorter)."""


def snapshot_of_ranks(proxy: Any, reason: str) -> FatalSnapshot | None:
    """The extension's bounded snapshot of the executor's ranks now (its ``Diagnoser``, as a fatal
    verdict takes it: a short CPU window, the stacks), as the typed record the fatal path logs:
    each rank's host, state, wait channel, CPU class, stack source, and the rank the evidence names
    (a stopped one first). None without liveness, or when it did not end within ``SNAPSHOT_WAIT_S``."""
    state = getattr(proxy, "liveness_state", None)
    diagnoser = getattr(state, "diagnoser", None)
    if diagnoser is None:
        return None
    from ..diagnose._diagnosis_text import snapshot_record

    taken: list[Any] = []
    done = threading.Event()

    def keep(diagnosis: Any) -> None:
        taken.append(diagnosis)
        done.set()

    if not diagnoser.request(reason, keep, snapshot=True) or not done.wait(SNAPSHOT_WAIT_S):
        return None
    hosts = {identity.rank: identity.hostname for identity in proxy.liveness_monitor.identities}
    return snapshot_record(taken[0], reason, hosts=hosts)
