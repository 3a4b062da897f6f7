"""What an engine's start needs besides upstream's constructor: its monitor, its metrics on
trtllm-serve's page, the one line saying liveness is on, and which session kinds upstream main
leaves unregistered. Called by :class:`._mixin.LivenessProxyMixin`; none of it runs when disabled.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Any

from ..._config import LivenessConfig
from ...monitor._monitor import WorkerProcessMonitor
from ._features import warn_once
from ._state import EngineLiveness

logger = logging.getLogger(__name__.rpartition(".")[0])


def new_monitor(config: LivenessConfig) -> WorkerProcessMonitor:
    """The engine's monitor: deaths from the start; before READY, wedge verdicts only with the
    start-up bound (none by default); :func:`arm_wedges` switches to the READY bound."""
    startup = config.startup_d_state_timeout_s or None
    return WorkerProcessMonitor(d_state_timeout_s=startup if startup is not None else config.d_state_timeout_s or None,
                                scan_interval_s=config.scan_interval_s, wedge_armed=startup is not None)


def arm_wedges(monitor: WorkerProcessMonitor, config: LivenessConfig) -> None:
    # Time in D before READY does not count towards the READY bound (the monitor resets it).
    monitor.arm_wedge_detection(d_state_timeout_s=config.d_state_timeout_s)


def export_metrics(state: EngineLiveness, llm_args: Any) -> None:
    # trtllm-serve with return_perf_metrics serves /prometheus/metrics from prometheus_client's
    # multiprocess files (a fresh registry holding only a MultiProcessCollector), so metrics
    # reach that page only through those files: only when PROMETHEUS_MULTIPROC_DIR is set before
    # prometheus_client's first import. Upstream sets the variable itself, but after the engine
    # exists; importing prometheus_client here without it would fix prometheus_client in its
    # single-process mode and drop upstream's own trtllm_* metrics from that page. So: only with
    # the variable already set (by the user, for the server), else one WARNING and no import.
    if not getattr(llm_args, "return_perf_metrics", False) or state.monitor is None:
        return
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        warn_once("metrics", "PROMETHEUS_MULTIPROC_DIR", "liveness: return_perf_metrics is set but "
                  "PROMETHEUS_MULTIPROC_DIR is not: the liveness metrics are not on trtllm-serve's "
                  "/prometheus/metrics (set PROMETHEUS_MULTIPROC_DIR in the server's environment)")
        return
    try:
        from ..prometheus import LivenessMetrics
    except ImportError as exc:
        warn_once("metrics", "prometheus_client", "liveness: no liveness metrics on /prometheus/metrics: %s", exc)
        return
    try:
        state.metrics = LivenessMetrics(state.monitor)
    except Exception:
        logger.warning("liveness: could not export the liveness metrics", exc_info=True)


def announce(base: type, config: LivenessConfig) -> None:
    # One line per engine saying that liveness is on (a user who switched it on by environment
    # must be able to see that it took). Servers seldom configure Python logging (trtllm-serve's
    # own logger is not it), and an INFO record without a handler is dropped: then stderr.
    line = (f"worker liveness on for {base.__module__}.{base.__qualname__} "
            f"(d_state_timeout_s={config.d_state_timeout_s:g}, exit_on_fatal={int(config.exit_on_fatal)})")
    if logger.isEnabledFor(logging.INFO) and logger.hasHandlers():
        logger.info("liveness: %s", line)
        return
    with contextlib.suppress(Exception):  # a closed stderr must not fail the engine's start
        sys.stderr.write(f"trtllm-liveness: {line}\n")
        sys.stderr.flush()


# Session kinds whose ranks upstream main does not register (docs/upstream-contract.md, "Sessions").
UNREGISTERED_SESSION_KINDS = frozenset({"MpiCommSession", "RemoteMpiCommSessionClient"})


def upstream_skips_registration(session: Any) -> bool:
    return any(cls.__name__ in UNREGISTERED_SESSION_KINDS for cls in type(session).__mro__)
