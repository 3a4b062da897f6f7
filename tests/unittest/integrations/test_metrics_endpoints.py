"""Liveness metrics on the servers' own Prometheus pages, over real HTTP, after a real SIGKILL.

- trtllm-serve's ``/prometheus/metrics``: a fresh registry with only a ``MultiProcessCollector``,
  served through ``make_asgi_app`` (as upstream's ``OpenAIServer.mount_metrics``), in a child
  process in prometheus multiprocess mode (tests/programs/metrics_serve_child.py);
- Dynamo's system ``/metrics`` of the real ai-dynamo-runtime (tests/programs/dynamo_metrics_worker.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.support.children import free_port
from tests.support.facilities import require_facility
from tests.support.process_tracker import ProcessTracker
from tests.support.waits import wait_until
from trtllm_liveness.process._identity import local_hostname

require_facility("prometheus", allow_module_level=True)

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

pytestmark = [pytest.mark.real_process, pytest.mark.timeout(90)]

ROOT = Path(__file__).resolve().parents[3]
SERVE_CHILD = "tests.programs.metrics_serve_child"
DYNAMO_CHILD = "tests.programs.dynamo_metrics_worker"

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def liveness_samples(text: str) -> Samples:
    """The trtllm_liveness_* samples of a page (other lines: the server's own metrics, not parsed)."""
    ours = "\n".join(line for line in text.splitlines() if "trtllm_liveness_" in line) + "\n"
    samples: Samples = {}
    for family in text_string_to_metric_families(ours):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def scrape(url: str) -> Samples:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            assert response.status == 200
            return liveness_samples(response.read().decode())
    except (urllib.error.URLError, OSError):
        return {}


def start_child(procs: ProcessTracker, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    """``python -m argv[0] argv[1:]`` from the repository root (so ``tests.support`` imports)."""
    child = subprocess.Popen([sys.executable, "-m", *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=env, cwd=ROOT, start_new_session=True)
    procs.popens.append(child)
    procs.track(child.pid)
    return child


def stop_child(child: subprocess.Popen[bytes]) -> tuple[int, str]:
    """Ask the child to quit (stdin), wait for it (bounded), return its status and stderr."""
    assert child.stdin is not None and child.stderr is not None
    try:
        child.stdin.write(b"quit\n")
        child.stdin.close()
    except OSError:
        pass  # already gone: its status tells
    try:
        returncode = child.wait(30)
    except subprocess.TimeoutExpired:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
        raise
    stderr = child.stderr.read().decode()
    child.stderr.close()
    return returncode, stderr


def dead_state(samples: Samples, rank: str, host: str) -> set[str]:
    return {state for state in ("exited", "zombie")
            if value(samples, "trtllm_liveness_worker_state", rank=rank, host=host, state=state) == 1}


def test_trtllm_serve_prometheus_page_in_multiprocess_mode(procs: ProcessTracker, tmp_path: Path) -> None:
    workers = [procs.sleeper() for _ in range(2)]
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    child = start_child(procs, [SERVE_CHILD, "early", *(str(w.pid) for w in workers)],
                        env)
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line, child.stderr.read().decode()[-3000:] if child.stderr else ""
    started = json.loads(line)
    assert started["multiprocess"] is True
    url = f"http://127.0.0.1:{started['port']}/prometheus/metrics"
    host = local_hostname()

    def alive(samples: Samples, rank: str) -> bool:
        return value(samples, "trtllm_liveness_worker_state", rank=rank, host=host, state="alive") == 1

    assert wait_until(lambda: all(alive(scrape(url), rank) for rank in ("0", "1")), 20)
    before = scrape(url)
    assert value(before, "trtllm_liveness_worker_failures_total", kind="died") == 0
    assert value(before, "trtllm_liveness_unkillable_workers") == 0

    os.kill(workers[1].pid, signal.SIGKILL)

    assert wait_until(lambda: len(dead_state(scrape(url), "1", host)) == 1, 20)
    after = scrape(url)

    # A transition without an event (an exit after a shutdown began) reaches the files through
    # the refresh thread, not only through event delivery.
    assert child.stdin is not None
    child.stdin.write(b"expect\n")
    child.stdin.flush()
    assert child.stdout.readline() == b"expecting\n"
    os.kill(workers[0].pid, signal.SIGKILL)
    assert wait_until(lambda: value(scrape(url), "trtllm_liveness_worker_state", rank="0", host=host,
                                    state="exited-expected") == 1, 20)
    expected = scrape(url)
    returncode, stderr = stop_child(child)
    assert returncode == 0, stderr[-3000:]
    assert value(after, "trtllm_liveness_worker_failures_total", kind="died") == 1
    assert value(after, "trtllm_liveness_worker_state", rank="1", host=host, state="alive") == 0
    assert alive(after, "0")
    assert value(after, "trtllm_liveness_detection_latency_seconds_count", kind="died", origin="exit_seen") == 1
    assert value(after, "trtllm_liveness_unkillable_workers") == 0
    assert value(expected, "trtllm_liveness_worker_state", rank="0", host=host, state="alive") == 0
    assert value(expected, "trtllm_liveness_worker_failures_total", kind="died") == 1  # not a failure


def test_prometheus_client_imported_before_the_dir_is_set_warns(procs: ProcessTracker, tmp_path: Path) -> None:
    """What happens when liveness metrics are built before trtllm-serve sets the variable: loud, not silent."""
    worker = procs.sleeper()
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    child = start_child(procs, [SERVE_CHILD, "late", str(worker.pid)], env)
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line, child.stderr.read().decode()[-3000:] if child.stderr else ""
    started = json.loads(line)
    assert started["multiprocess"] is False
    with urllib.request.urlopen(f"http://127.0.0.1:{started['port']}/prometheus/metrics", timeout=5) as response:
        page = response.read().decode()
    returncode, stderr = stop_child(child)
    assert returncode == 0, stderr[-3000:]
    assert "trtllm_liveness_" not in page
    assert "prometheus_client was imported before it was" in stderr


def test_dynamo_system_metrics_carry_liveness_metrics(procs: ProcessTracker) -> None:
    require_facility("dynamo")
    workers = [procs.sleeper() for _ in range(2)]
    port = free_port()
    env = dict(os.environ, DYN_SYSTEM_PORT=str(port), DYN_SYSTEM_HOST="127.0.0.1", DYN_TCP_RPC_HOST="127.0.0.1",
               DYN_LOG="warn")
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    child = start_child(procs, [DYNAMO_CHILD, *(str(w.pid) for w in workers)], env)
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line == b"serving\n", child.stderr.read().decode()[-3000:] if child.stderr else ""
    url = f"http://127.0.0.1:{port}/metrics"
    host = local_hostname()

    assert wait_until(lambda: value(scrape(url), "trtllm_liveness_worker_state", rank="1", host=host,
                                    state="alive") == 1, 20)
    before = scrape(url)
    assert value(before, "trtllm_liveness_worker_failures_total", kind="died") == 0

    os.kill(workers[1].pid, signal.SIGKILL)

    assert wait_until(lambda: value(scrape(url), "trtllm_liveness_worker_failures_total", kind="died") == 1, 20)
    after = scrape(url)
    returncode, stderr = stop_child(child)
    assert returncode == 0, stderr[-3000:]
    assert len(dead_state(after, "1", host)) == 1
    assert value(after, "trtllm_liveness_worker_state", rank="0", host=host, state="alive") == 1
    assert value(after, "trtllm_liveness_detection_latency_seconds_count", kind="died", origin="exit_seen") == 1
    assert workers[0].poll() is None


def test_expose_metrics_on_dynamo_refuses_what_it_cannot_use(monkeypatch: pytest.MonkeyPatch) -> None:
    from trtllm_liveness.integrations.dynamo import expose_metrics_on_dynamo

    # Switched on: an engine without a monitor is an error (off, it is a no-op: test_switch_off.py).
    monkeypatch.setenv("TRTLLM_WORKER_LIVENESS", "1")

    class NoMetrics:
        pass

    class Endpoint:
        class metrics:  # the attribute name of Dynamo's Endpoint
            @staticmethod
            def register_prometheus_expfmt_callback(callback: object) -> None:
                raise AssertionError("must not register for an engine without a monitor")

    with pytest.raises(TypeError, match="register_prometheus_expfmt_callback"):
        expose_metrics_on_dynamo(NoMetrics(), NoMetrics())
    with pytest.raises(ValueError, match="no liveness monitor"):
        expose_metrics_on_dynamo(Endpoint(), NoMetrics())


ENGINE_CHILD = "tests.programs.metrics_engine_child"
FAKE_MAIN = ROOT / "tests" / "fakes" / "trtllm_main"


def _engine_env(**extra: str) -> dict[str, str]:
    env = {key: val for key, val in os.environ.items() if key != "PROMETHEUS_MULTIPROC_DIR"}
    return {**env, "PYTHONPATH": os.pathsep.join([str(ROOT), str(FAKE_MAIN)]), "TRTLLM_WORKER_LIVENESS": "1",
            **extra}


@pytest.mark.mpi
def test_an_engine_with_return_perf_metrics_exports_its_ranks_to_the_serve_page(
    procs: ProcessTracker, tmp_path: Path
) -> None:
    # Nothing in the child builds LivenessMetrics: with PROMETHEUS_MULTIPROC_DIR set for the
    # server, the extension does when the engine starts, and trtllm-serve's page shows the ranks.
    child = start_child(procs, [ENGINE_CHILD], _engine_env(PROMETHEUS_MULTIPROC_DIR=str(tmp_path)))
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line, child.stderr.read().decode()[-3000:] if child.stderr else ""
    started = json.loads(line)
    url = f"http://127.0.0.1:{started['port']}/prometheus/metrics"
    host = local_hostname()
    ranks = {int(rank): pid for rank, pid in started["ranks"].items()}
    assert sorted(ranks) == [0, 1]
    for pid in ranks.values():
        procs.track(pid)
    assert wait_until(lambda: all(value(scrape(url), "trtllm_liveness_worker_state", rank=str(rank), host=host,
                                        state="alive") == 1 for rank in ranks), 20)
    os.kill(ranks[1], signal.SIGKILL)
    assert wait_until(lambda: value(scrape(url), "trtllm_liveness_worker_failures_total", kind="died") == 1, 20)
    returncode, stderr = stop_child(child)
    assert returncode == 0, stderr[-3000:]


@pytest.mark.mpi
def test_without_the_multiproc_dir_the_engine_warns_and_imports_no_prometheus(procs: ProcessTracker) -> None:
    # Importing prometheus_client before trtllm-serve sets the variable would drop upstream's own
    # metrics from its page: one WARNING saying what to set instead.
    child = start_child(procs, [ENGINE_CHILD], _engine_env())
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line, child.stderr.read().decode()[-3000:] if child.stderr else ""
    started = json.loads(line)
    assert started["port"] is None and started["prometheus_imported"] is False
    for pid in started["ranks"].values():
        procs.track(pid)
    returncode, stderr = stop_child(child)
    assert returncode == 0, stderr[-3000:]
    assert stderr.count("PROMETHEUS_MULTIPROC_DIR is not") == 1, stderr[-3000:]
