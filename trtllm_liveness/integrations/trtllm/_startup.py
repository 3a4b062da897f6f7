"""What an engine's start needs besides upstream's constructor: its monitor, its metrics on
trtllm-serve's page, the one line saying liveness is on, and the session's ``submit`` wrapped so
that every rank runs :func:`~._worker_entry.liveness_worker_entry` with what it needs (identity side
channel, proxy identity, progress channel, agent hub). Called by
:class:`._mixin.LivenessProxyMixin`; none of it runs when disabled.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import weakref
from collections.abc import Callable
from typing import Any

from ..._config import LivenessConfig
from ...monitor._monitor import WorkerProcessMonitor
from ...process._identity import ProcessIdentity
from ._engine_stall import beat_interval
from ._features import detect_features, upstream_skips_registration, warn_once, warn_session_hooks
from ._hosts import connect_hub, start_hub, wants_hub
from ._side_channel import IdentityChannel
from ._state import EngineLiveness, state_of
from ._worker_entry import liveness_worker_entry, proxy_identity
from ._worker_spec import SPEC_KWARG, ProxyIdentity, WorkerSpec

logger = logging.getLogger(__name__.rpartition(".")[0])


def new_monitor(config: LivenessConfig) -> WorkerProcessMonitor:
    """The engine's monitor: deaths from the start; before READY, wedge verdicts only with the
    start-up bound (none by default); :meth:`~WorkerProcessMonitor.arm_wedge_detection` at READY
    switches to the READY bound."""
    startup = config.startup_d_state_timeout_s or None
    return WorkerProcessMonitor(d_state_timeout_s=startup if startup is not None else config.d_state_timeout_s or None,
                                scan_interval_s=config.scan_interval_s, wedge_armed=startup is not None)


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
        state.metrics = LivenessMetrics(state.monitor, observe=state.config.observe)
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


def wrap_session(proxy: Any, state: EngineLiveness) -> Callable[[], None] | None:
    """Wrap ``proxy.mpi_session.submit`` so that every rank's task runs in
    :func:`~._worker_entry.liveness_worker_entry`; opens the identity side channel where upstream
    registers no identities, the progress channel and the agent hub where wanted. Returns the
    function that restores the session's own ``submit`` (None when there is nothing to wrap)."""
    session = getattr(proxy, "mpi_session", None)
    warn_session_hooks(session, owned=state.owns_session)
    submit = getattr(session, "submit", None)
    if session is None or not callable(submit):
        return None
    channel: IdentityChannel | None = None
    # main sends the ranks' identities itself, but registers them only for sessions it spawned:
    # for an mpirun-launched (MpiCommSession) or remote session it skips them, so the side
    # channel serves there too (as on 1.2.x, which sends none).
    if not detect_features(type(proxy)._liveness_base).identities_signal or upstream_skips_registration(session):
        ref = weakref.ref(proxy)

        def on_identities(identities: list[ProcessIdentity]) -> None:
            owner = ref()
            monitor = None if owner is None else state_of(owner).monitor
            if monitor is None:
                return
            try:
                monitor.register(identities)
            except RuntimeError:  # closed meanwhile
                return
            logger.info("liveness: watching %d worker ranks", len(identities))

        channel = IdentityChannel(on_identities, state.config.identities_timeout_s,
                                  exclude_pids=frozenset({os.getpid()}))
        state.channel = channel
    try:
        me: ProxyIdentity | None = ProxyIdentity.from_sequence(proxy_identity())
    except Exception:
        logger.warning("liveness: could not read the proxy's own identity: no proxy-death watch", exc_info=True)
        me = None
    hub_wanted = state.hub is None and state.monitor is not None and wants_hub(state.config, session)
    progress = None
    if state.stall is not None:
        config = state.config
        progress = state.stall.open_channel(beat_interval(config.stall_timeout_s, config.stopped_timeout_s,
                                                          config.heartbeat_timeout_s if hub_wanted else 0.0))
    if hub_wanted and state.monitor is not None:
        state.hub = start_hub(state.config, state.monitor, state.stall.clock if state.stall is not None else None)
        if state.hub is not None:
            connect_hub(state, state.hub)
    hub = state.hub.agent_settings() if state.hub is not None else None

    def wrapped_submit(task: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        kwargs[SPEC_KWARG] = WorkerSpec(task, me, channel.spec if channel is not None else None, progress, hub)
        return submit(liveness_worker_entry, *args, **kwargs)

    session.submit = wrapped_submit

    def restore() -> None:
        with contextlib.suppress(AttributeError):
            del session.submit  # back to the class's method

    return restore

