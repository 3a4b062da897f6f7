"""Prometheus metrics: a real ``/metrics`` page scraped after a real SIGKILL of a real process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.facilities import require_facility
from tests.support.process_tracker import ProcessTracker, state_of
from tests.support.stuck_processes import StuckChild
from tests.support.waits import wait_until
from trtllm_liveness import EventKind, WorkerEvent
from trtllm_liveness.monitor import WorkerProcessMonitor
from trtllm_liveness.process import capture_identity

require_facility("prometheus", allow_module_level=True)
prometheus_client = pytest.importorskip("prometheus_client", reason="the optional prometheus_client is not installed")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from trtllm_liveness.integrations import prometheus as metrics_module  # noqa: E402
from trtllm_liveness.integrations.prometheus import LivenessMetrics  # noqa: E402

pytestmark = [pytest.mark.real_process, pytest.mark.timeout(60)]

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def scrape_registry(metrics: LivenessMetrics) -> Samples:
    return parse(prometheus_client.generate_latest(metrics.registry).decode())


@pytest.fixture
def served() -> Iterator[list[LivenessMetrics]]:
    """LivenessMetrics created in the test, closed (and their HTTP servers stopped) afterwards."""
    made: list[LivenessMetrics] = []
    yield made
    for metrics in made:
        metrics.close()


def test_metrics_page_after_a_real_sigkill(procs: ProcessTracker) -> None:
    children = [procs.sleeper() for _ in range(3)]
    identities = [capture_identity(rank, child.pid) for rank, child in enumerate(children)]
    got = threading.Event()
    with WorkerProcessMonitor() as monitor:
        metrics = LivenessMetrics(monitor)
        server, _thread = metrics.start_http_server(0, "127.0.0.1")
        try:
            monitor.subscribe(lambda event: got.set())
            monitor.register(identities)
            monitor.start()
            url = f"http://127.0.0.1:{server.server_port}/metrics"
            with urllib.request.urlopen(url, timeout=10) as response:
                before = parse(response.read().decode())
            assert value(before, "trtllm_liveness_worker_state", rank="2", host=identities[2].hostname,
                         state="alive") == 1
            assert value(before, "trtllm_liveness_worker_failures_total", kind="died") == 0

            metrics.note_fault(2)
            os.kill(children[2].pid, signal.SIGKILL)
            assert got.wait(10)
            with urllib.request.urlopen(url, timeout=10) as response:
                assert response.status == 200
                assert response.headers["Content-Type"].startswith("text/plain")
                after = parse(response.read().decode())
        finally:
            server.shutdown()
            server.server_close()
            metrics.close()

    host = identities[0].hostname
    assert value(after, "trtllm_liveness_worker_failures_total", kind="died") == 1
    assert value(after, "trtllm_liveness_worker_failures_total", kind="wedged") == 0
    assert value(after, "trtllm_liveness_detection_latency_seconds_count", kind="died", origin="noted") == 1
    assert value(after, "trtllm_liveness_detection_latency_seconds_sum", kind="died", origin="noted") >= 0
    assert value(after, "trtllm_liveness_detection_latency_seconds_bucket", kind="died", origin="noted",
                 le="+Inf") == 1
    # The noted fault time wins over the monitor's own: nothing under exit_seen for this death.
    assert value(after, "trtllm_liveness_detection_latency_seconds_count", kind="died", origin="exit_seen") == 0
    dead_state = {
        state for state in ("exited", "zombie")
        if value(after, "trtllm_liveness_worker_state", rank="2", host=host, state=state) == 1
    }
    assert len(dead_state) == 1
    assert value(after, "trtllm_liveness_worker_state", rank="2", host=host, state="alive") == 0
    assert value(after, "trtllm_liveness_worker_state", rank="0", host=host, state="alive") == 1
    assert value(after, "trtllm_liveness_worker_state", rank="1", host=host, state="alive") == 1
    assert value(after, "trtllm_liveness_unkillable_workers") == 0


def test_unkillable_gauge_and_wedge_counts_on_a_stuck_process(
    procs: ProcessTracker, stuck_child: StuckChild
) -> None:
    """Over both sources of real D (freezer, FUSE)."""
    child = stuck_child.popen
    identity = capture_identity(0, child.pid)
    events: list[WorkerEvent] = []
    with WorkerProcessMonitor(d_state_timeout_s=0.3, scan_interval_s=0.05) as monitor:
        metrics = LivenessMetrics(monitor)
        try:
            monitor.subscribe(events.append)
            monitor.register([identity])
            monitor.start()
            try:
                assert wait_until(lambda: state_of(child.pid) == "D", 10)
                assert wait_until(lambda: any(e.kind is EventKind.WEDGED for e in events), 10)
                os.kill(child.pid, signal.SIGKILL)
                assert wait_until(lambda: any(e.kind is EventKind.UNKILLABLE for e in events), 10)
                stuck = scrape_registry(metrics)
            finally:
                # Also on failure: a live process would keep a freezer group from being removed.
                os.kill(child.pid, signal.SIGKILL)
                stuck_child.release()  # the pending SIGKILL ends it now
            assert wait_until(lambda: any(e.kind is EventKind.DIED for e in events), 10)
            dead = scrape_registry(metrics)
        finally:
            metrics.close()

    assert value(stuck, "trtllm_liveness_unkillable_workers") == 1
    assert value(stuck, "trtllm_liveness_worker_state", rank="0", host=identity.hostname, state="unkillable") == 1
    assert value(stuck, "trtllm_liveness_worker_failures_total", kind="wedged") == 1
    assert value(stuck, "trtllm_liveness_worker_failures_total", kind="unkillable") == 1
    # No fault time was noted: the monitor's own D-state start (the event's fault_at) is used, so
    # the wedge's latency is at least the 0.3 s D-state timeout.
    for kind in ("wedged", "unkillable"):
        assert value(stuck, "trtllm_liveness_detection_latency_seconds_count", kind=kind, origin="d_state_start") == 1
        assert value(stuck, "trtllm_liveness_detection_latency_seconds_count", kind=kind, origin="noted") == 0
    assert value(stuck, "trtllm_liveness_detection_latency_seconds_bucket", kind="wedged", origin="d_state_start",
                 le="0.25") == 0
    assert value(dead, "trtllm_liveness_unkillable_workers") == 0
    assert value(dead, "trtllm_liveness_worker_failures_total", kind="died") == 1


def test_private_registry_by_default_and_default_registry_on_request(served: list[LivenessMetrics]) -> None:
    first, second = LivenessMetrics(), LivenessMetrics()  # two private registries: no name clash
    served += [first, second]
    default_names = {family.name for family in prometheus_client.REGISTRY.collect()}
    assert not any(name.startswith("trtllm_liveness") for name in default_names)
    assert value(scrape_registry(first), "trtllm_liveness_unkillable_workers") == 0

    shared = LivenessMetrics(use_default_registry=True)
    try:
        names = {family.name for family in prometheus_client.REGISTRY.collect()}
        assert {"trtllm_liveness_worker_failures", "trtllm_liveness_unkillable_workers"} <= names
        with pytest.raises(ValueError):
            LivenessMetrics(use_default_registry=True)  # names must be unique in one registry
    finally:
        shared.close()
    names = {family.name for family in prometheus_client.REGISTRY.collect()}
    assert not any(name.startswith("trtllm_liveness") for name in names)
    with pytest.raises(ValueError):
        LivenessMetrics(registry=prometheus_client.CollectorRegistry(), use_default_registry=True)


def test_reattach_after_restart_keeps_counts_and_never_counts_twice(
    procs: ProcessTracker, served: list[LivenessMetrics]
) -> None:
    metrics = LivenessMetrics(fault_time=lambda event: event.detected_at - 0.25)
    served.append(metrics)
    first, second = procs.sleeper(), procs.sleeper()
    with WorkerProcessMonitor() as old, WorkerProcessMonitor() as new:
        old.register([capture_identity(0, first.pid)])
        metrics.attach(old)
        os.kill(first.pid, signal.SIGKILL)
        assert wait_until(lambda: old.check() is not None, 10)
        metrics.detach()
        metrics.attach(old)  # again: the late-subscriber replay must not count the death twice
        assert value(scrape_registry(metrics), "trtllm_liveness_worker_failures_total", kind="died") == 1

        new.register([capture_identity(0, second.pid)])
        metrics.attach(new)  # a restarted executor's monitor replaces the old one
        samples = scrape_registry(metrics)
        assert value(samples, "trtllm_liveness_worker_state", rank="0", host=new.identities[0].hostname,
                     state="alive") == 1
        assert value(samples, "trtllm_liveness_worker_failures_total", kind="died") == 1
        # The fault_time callback supplied the fault time: one observation, at least 0.25 s.
        assert value(samples, "trtllm_liveness_detection_latency_seconds_count", kind="died", origin="noted") == 1
        assert value(samples, "trtllm_liveness_detection_latency_seconds_bucket", kind="died", origin="noted",
                     le="0.1") == 0

        metrics.detach()
        assert not any(name == "trtllm_liveness_worker_state" for name, _ in scrape_registry(metrics))


def test_clear_import_error_without_prometheus_client() -> None:
    code = (
        "import sys; sys.modules['prometheus_client'] = None\n"
        "try:\n"
        "    import trtllm_liveness.integrations.prometheus\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
        "    sys.exit(3)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 3, result.stderr
    assert "prometheus_client" in result.stdout
    assert "pip install" in result.stdout


def test_latency_from_the_monitor_alone_after_a_real_sigkill(procs: ProcessTracker) -> None:
    """Nobody noted the fault: the exit the monitor saw is the fault time (origin exit_seen)."""
    child = procs.sleeper()
    got = threading.Event()
    with WorkerProcessMonitor() as monitor:
        metrics = LivenessMetrics(monitor)
        try:
            monitor.register([capture_identity(0, child.pid)])
            monitor.subscribe(lambda event: got.set())
            monitor.start()
            os.kill(child.pid, signal.SIGKILL)
            assert got.wait(10)
            assert wait_until(lambda: value(scrape_registry(metrics), "trtllm_liveness_worker_failures_total",
                                            kind="died") == 1, 10)
            samples = scrape_registry(metrics)
        finally:
            metrics.close()
    assert value(samples, "trtllm_liveness_detection_latency_seconds_count", kind="died", origin="exit_seen") == 1
    assert value(samples, "trtllm_liveness_detection_latency_seconds_count", kind="died", origin="noted") == 0
    assert value(samples, "trtllm_liveness_detection_latency_seconds_sum", kind="died", origin="exit_seen") >= 0


def test_an_observing_engines_verdict_counts_as_would_fail_not_as_a_failure(procs: ProcessTracker) -> None:
    """``observe=True`` (the engine's observe mode): a real death counts in would_fail, by kind; the
    failures counter and the latency stay at 0 (nothing failed)."""
    child = procs.sleeper()
    got = threading.Event()
    with WorkerProcessMonitor() as monitor:
        metrics = LivenessMetrics(monitor, observe=True)
        try:
            monitor.register([capture_identity(0, child.pid)])
            monitor.subscribe(lambda event: got.set())
            monitor.start()
            os.kill(child.pid, signal.SIGKILL)
            assert got.wait(10)
            assert wait_until(lambda: value(scrape_registry(metrics), "trtllm_liveness_would_fail_total",
                                            kind="died") == 1, 10)
            samples = scrape_registry(metrics)
        finally:
            metrics.close()
    assert value(samples, "trtllm_liveness_worker_failures_total", kind="died") == 0
    assert value(samples, "trtllm_liveness_detection_latency_seconds_count", kind="died", origin="exit_seen") == 0


def test_late_attach_counts_the_failure_but_observes_no_latency(procs: ProcessTracker) -> None:
    child = procs.sleeper()
    with WorkerProcessMonitor() as monitor:
        monitor.register([capture_identity(0, child.pid)])
        os.kill(child.pid, signal.SIGKILL)
        assert wait_until(lambda: monitor.check() is not None, 10)
        metrics = LivenessMetrics(monitor)  # attaches after the death: the event is handed over late
        try:
            samples = scrape_registry(metrics)
        finally:
            metrics.close()
    assert value(samples, "trtllm_liveness_worker_failures_total", kind="died") == 1
    for origin in ("noted", "exit_seen"):
        assert value(samples, "trtllm_liveness_detection_latency_seconds_count", kind="died", origin=origin) == 0


def test_d_state_start_on_the_event_is_the_wedge_fault_time(procs: ProcessTracker, served: list[LivenessMetrics]
                                                            ) -> None:
    child = procs.sleeper()
    identity = capture_identity(0, child.pid)
    metrics = LivenessMetrics()
    served.append(metrics)
    with WorkerProcessMonitor() as monitor:
        metrics.attach(monitor)
        detected = time.monotonic()
        # Delivered as a monitor would (to the subscriber, after the attach), with exact times.
        metrics._on_event(WorkerEvent(EventKind.WEDGED, identity, "thread in D", detected_at=detected,
                                      fault_at=detected - 2.0))
        metrics._on_event(WorkerEvent(EventKind.UNKILLABLE, identity, "SIGKILL pending", detected_at=detected))
    samples = scrape_registry(metrics)
    assert value(samples, "trtllm_liveness_detection_latency_seconds_count", kind="wedged",
                 origin="d_state_start") == 1
    assert value(samples, "trtllm_liveness_detection_latency_seconds_bucket", kind="wedged",
                 origin="d_state_start", le="1.0") == 0  # at least the 2 s the thread was in D
    # An event without fault_at (and nothing noted): nothing observed rather than a made-up latency.
    assert value(samples, "trtllm_liveness_detection_latency_seconds_count", kind="unkillable",
                 origin="d_state_start") == 0
    assert value(samples, "trtllm_liveness_worker_failures_total", kind="unkillable") == 1


DOCS = Path(__file__).resolve().parents[3] / "docs" / "metrics.md"


def test_every_exported_family_and_label_is_documented(procs: ProcessTracker, served: list[LivenessMetrics]
                                                       ) -> None:
    """docs/metrics.md names each family, label and label value exported (the module docstring points there)."""
    child = procs.sleeper()
    with WorkerProcessMonitor() as monitor:
        monitor.register([capture_identity(0, child.pid)])
        metrics = LivenessMetrics(monitor)
        served.append(metrics)
        # prometheus_client's own *_created series (unless the process disabled them) are not ours to document.
        families = [family for family in text_string_to_metric_families(metrics.exposition())
                    if not family.name.endswith("_created")]
    assert "docs/metrics.md" in (metrics_module.__doc__ or "")
    table = DOCS.read_text()
    assert {family.name for family in families} == {
        "trtllm_liveness_worker_state", "trtllm_liveness_unkillable_workers", "trtllm_liveness_worker_failures",
        "trtllm_liveness_would_fail", "trtllm_liveness_detection_latency_seconds",
    }
    for family in families:
        shown = family.name + ("_total" if family.type == "counter" else "")
        assert shown in table, shown
        for sample in family.samples:
            for label, label_value in sample.labels.items():
                if label == "le":
                    continue
                assert f"`{label}`" in table, (family.name, label)
                if label not in ("rank", "host"):
                    assert f"`{label_value}`" in table, (family.name, label, label_value)
