"""The TensorRT-LLM integration against the upstream-shaped fakes of 1.2.x and main (tests/fakes/).

Unit checks run in this process (feature detection, payload validation, the side channel);
everything that spawns MPI workers or imports a fake ``tensorrt_llm`` runs in a child process in
its own session (``run_scenario``, which also kills and reports whatever it left behind). The
end-to-end checks build the executor through upstream's own ``GenerationExecutor.create(engine,
model_world_size=N)`` of the fake, with a ``FakeEngine`` (the scenario option ``engine``).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.facilities import needs
from tests.support.process_tracker import ProcessTracker
from tests.support.upstream_fakes import FAKE_ENGINE, tree
from tests.support.victims import names_a_victim
from tests.support.waits import WAIT_SCALE, wait_until
from trtllm_liveness.demo import GenerationExecutorProxy, MainGenerationExecutorProxy
from trtllm_liveness.demo._scenario_launcher import run_scenario
from trtllm_liveness.demo._scenario_records import ScenarioResult
from trtllm_liveness.integrations import trtllm as integ
from trtllm_liveness.integrations.trtllm._mixin import _subscriber
from trtllm_liveness.integrations.trtllm._shim import MonitorShim
from trtllm_liveness.integrations.trtllm._side_channel import IdentityChannel
from trtllm_liveness.monitor import WorkerProcessMonitor
from trtllm_liveness.process import ProcessIdentity, capture_identity

pytestmark = [pytest.mark.timeout(120), needs("mpi")]


def fake_path(version: str) -> str:
    return str(tree(version))


# ----------------------------------------------------------------------------- unit


def test_feature_detection_tells_the_versions_apart() -> None:
    v12 = integ.detect_features(GenerationExecutorProxy)
    main = integ.detect_features(MainGenerationExecutorProxy)
    assert v12.flavour == "1.2" and not v12.check_health and not v12.set_fatal_error and not v12.mark_engine_dead
    assert main.flavour == "main" and main.check_health and main.set_fatal_error and main.mark_engine_dead
    assert main.error_monitor_loop
    # A liveness subclass is probed as its upstream base.
    assert integ.detect_features(integ.liveness_proxy_class(GenerationExecutorProxy)) == v12


def test_liveness_proxy_class_is_cached_and_unwraps() -> None:
    cls = integ.liveness_proxy_class(GenerationExecutorProxy)
    assert integ.liveness_proxy_class(cls) is cls
    assert issubclass(cls, GenerationExecutorProxy) and cls.__mro__[1] is integ.LivenessProxyMixin
    assert integ.liveness_proxy_class(GenerationExecutorProxy, default_enabled=True) is not cls


def test_bad_config_raises_before_any_worker_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRTLLM_WORKER_LIVENESS", "d_state_timeout_s=soon")
    cls = integ.liveness_proxy_class(GenerationExecutorProxy)
    with pytest.raises(ValueError, match="d_state_timeout_s"):
        cls({"llm_args": None})


@pytest.mark.parametrize("payload", [None, "x", 42, {"rank": 0}])
def test_shim_rejects_a_payload_that_is_no_list_without_crashing(payload: Any,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    with WorkerProcessMonitor() as monitor:
        shim = MonitorShim(monitor)
        with caplog.at_level(logging.ERROR):
            shim.register(payload)
        assert monitor.identities == []
        assert "rejected" in caplog.text


def test_shim_rejects_per_element_and_keeps_the_rest(procs: ProcessTracker, caplog: pytest.LogCaptureFixture) -> None:
    """One bad element (or None fields, or the proxy's own pid) is rejected on its own, with a
    log line: the rest of the payload is watched (rejecting it whole would leave every rank
    unwatched)."""
    a, b = procs.sleeper(), procs.sleeper()
    good_a, good_b = capture_identity(1, a.pid), capture_identity(2, b.pid)
    unverified = (good_b.rank, good_b.pid, None, good_b.hostname, None)  # upstream's Optional fields
    own = tuple(capture_identity(0))  # rank 0 inside the proxy (MpiCommSession)
    payload = [own, ("a", 1, 2, "h", 3), tuple(good_a), unverified, (1, 999, 5, "h", 3)]
    with WorkerProcessMonitor() as monitor:
        shim = MonitorShim(monitor)
        with caplog.at_level(logging.WARNING):
            shim.register(payload)
        assert [(i.rank, i.pid) for i in monitor.identities] == [(1, a.pid), (2, b.pid)]
        assert "rejected" in caplog.text  # the bad element and the duplicate rank, each logged
        assert os.getpid() not in [i.pid for i in monitor.identities]
        b.kill()
        assert wait_until(lambda: shim.find_dead_worker() is not None, 10)
        assert shim.find_dead_worker().pid == b.pid  # type: ignore[union-attr]  # watched by pidfd


def test_shim_close_marks_expected_exits_not_deaths(procs: ProcessTracker) -> None:
    """Upstream main's pre_shutdown() closes its monitor when expected exits begin: no death then."""
    child = procs.sleeper()
    closes: list[int] = []
    with WorkerProcessMonitor() as monitor:
        shim = MonitorShim(monitor, on_close=lambda: closes.append(1))
        shim.register([tuple(capture_identity(1, child.pid))])
        shim.close()
        assert closes == [1]
        assert monitor.identities  # the liveness monitor stays open: the proxy owns it


def test_shim_accepts_upstream_shaped_identities(procs: ProcessTracker) -> None:
    child = procs.sleeper()
    ident = capture_identity(3, child.pid)

    class UpstreamIdentity:  # upstream's object shape: attributes, not a tuple
        def __init__(self, i: ProcessIdentity) -> None:
            for name in ProcessIdentity._fields:
                setattr(self, name, getattr(i, name))

    with WorkerProcessMonitor() as monitor:
        shim = MonitorShim(monitor)
        shim.register([UpstreamIdentity(ident)])
        shim.register([tuple(ident)])  # the same again: no second registration
        assert monitor.identities == [ident]
        assert shim.find_dead_worker() is None
        shim.close()  # upstream's close must not close the liveness monitor
        child.kill()
        assert wait_until(lambda: shim.find_dead_worker() == ident, 10)


@pytest.fixture
def channel_events() -> Iterator[tuple[Any, list[list[ProcessIdentity]]]]:
    got: list[list[ProcessIdentity]] = []
    channel = IdentityChannel(got.append, timeout_s=30)
    try:
        yield channel, got
    finally:
        channel.close()


def _send(address: str, data: bytes) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(address)
    sock.send(data)
    sock.close()
    ctx.term()


def test_side_channel_rejects_forged_and_garbage_then_accepts_valid(
    procs: ProcessTracker, channel_events: tuple[Any, list[list[ProcessIdentity]]], caplog: pytest.LogCaptureFixture
) -> None:
    channel, got = channel_events
    child = procs.sleeper()
    ident = list(capture_identity(0, child.pid))
    with caplog.at_level(logging.ERROR):
        _send(channel.address, b"\x80not json")
        _send(channel.address, json.dumps({"token": "forged", "identities": [ident]}).encode())
        _send(channel.address, json.dumps({"token": channel.token, "identities": [[0, 1, 2, "h", 3]]}).encode())
        _send(channel.address, b"[" * 200_000)  # nested too deep for json: RecursionError
        assert wait_until(lambda: caplog.text.count("rejected") >= 4, 10)
    assert got == []
    _send(channel.address, json.dumps({"token": channel.token, "identities": [ident]}).encode())
    assert wait_until(lambda: got == [[ProcessIdentity(*ident)]], 10)


def test_identity_channel_under_a_tmpdir_too_long_for_a_socket_address_still_receives(
        procs: ProcessTracker, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A TMPDIR whose socket path would not fit ``sockaddr_un`` (a batch system's job directory can
    be long): the channel's socket goes to a short private directory instead of failing the
    engine's start, the leader's identities arrive, and nothing is left in either place."""
    import tempfile

    long_tmpdir = tmp_path / ("t" * 110)
    long_tmpdir.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long_tmpdir))
    got: list[list[ProcessIdentity]] = []
    channel = IdentityChannel(got.append, timeout_s=30)
    directory = os.path.dirname(channel.address[len("ipc://"):])
    try:
        assert not directory.startswith(str(long_tmpdir)) and os.stat(directory).st_mode & 0o077 == 0
        ident = list(capture_identity(0, procs.sleeper().pid))
        _send(channel.address, json.dumps({"token": channel.token, "identities": [ident]}).encode())
        assert wait_until(lambda: got == [[ProcessIdentity(*ident)]], 10)
    finally:
        channel.close()
    assert wait_until(lambda: not os.path.exists(directory), 10)
    assert list(long_tmpdir.iterdir()) == []


def test_subscriber_holds_the_proxy_weakly() -> None:
    class Owner:
        def __init__(self) -> None:
            self.seen: list[Any] = []

        def _liveness_on_event(self, event: Any) -> None:
            self.seen.append(event)

    import weakref

    owner = Owner()
    callback = _subscriber(weakref.ref(owner))  # type: ignore[arg-type]
    callback("e")  # type: ignore[arg-type]
    assert owner.seen == ["e"]
    del owner
    callback("again")  # type: ignore[arg-type]  # must not raise once the proxy is gone


# ----------------------------------------------------------------------------- fakes, import hook


def _python(code: str, version: str, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "PYTHONPATH": fake_path(version), **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env,
                          timeout=60 * WAIT_SCALE, start_new_session=True)


@pytest.mark.parametrize("version", ["v12", "main"])
def test_import_hook_patches_the_proxy_only_when_enabled(version: str) -> None:
    code = (
        "import trtllm_liveness.integrations.trtllm_autoload\n"
        "import tensorrt_llm.executor as pkg, tensorrt_llm.executor.proxy as p\n"
        "print(p.GenerationExecutorProxy.__name__, pkg.GenerationExecutorProxy is p.GenerationExecutorProxy)\n"
    )
    on = _python(code, version, TRTLLM_WORKER_LIVENESS="1")
    assert on.stdout.split() == ["LivenessGenerationExecutorProxy", "True"], on.stderr
    off = _python(code, version, TRTLLM_WORKER_LIVENESS="0")
    assert off.stdout.split() == ["GenerationExecutorProxy", "True"], off.stderr
    late = _python("import tensorrt_llm.executor.proxy as p\nimport trtllm_liveness.integrations.trtllm_autoload\n"
                   "print(p.GenerationExecutorProxy.__name__)", version, TRTLLM_WORKER_LIVENESS="1")
    assert late.stdout.strip() == "LivenessGenerationExecutorProxy", late.stderr


def test_lazy_executor_class_attribute_imports_tensorrt_llm_only_on_use() -> None:
    code = ("import sys\nimport trtllm_liveness.integrations.trtllm as t\n"
            "assert 'tensorrt_llm' not in sys.modules\n"
            "cls = t.LivenessGenerationExecutor\n"
            "from tensorrt_llm.executor.executor import GenerationExecutor\n"
            "print(issubclass(cls, GenerationExecutor), 'tensorrt_llm' in sys.modules)")
    result = _python(code, "main")
    assert result.stdout.split() == ["True", "True"], result.stderr


# ----------------------------------------------------------------------------- fakes, real MPI


def run_fake(version: str, env: dict[str, str] | None = None, **options: Any) -> ScenarioResult:
    """One scenario iteration on the fake tree ``trtllm_<version>``; nothing may be left behind."""
    options.setdefault("observe_s", 15 * WAIT_SCALE)
    options.setdefault("engine", FAKE_ENGINE)
    run = run_scenario(options, 60 * WAIT_SCALE, env={"PYTHONPATH": fake_path(version), **(env or {})})
    assert run.survivors == (), f"processes left behind: {run.survivors}"
    assert run.results and run.done, f"scenario failed: {run.problems()}"
    return run.results[0]


@pytest.mark.mpi
@pytest.mark.parametrize(("version", "mode", "via", "rank"), [
    ("v12", "1.2", "executor_cls", 1),
    ("v12", "1.2", "autoload", 0),
    ("main", "main", "executor_cls", 0),
    ("main", "main", "autoload", 1),
])
def test_fake_trtllm_sigkill_end_to_end(version: str, mode: str, via: str, rank: int) -> None:
    env = {"TRTLLM_WORKER_LIVENESS": "1"} if via == "autoload" else {}
    out = run_fake(version, env, mode=mode, via=via, fault="kill", fault_rank=rank)
    assert out.proxy_class == "LivenessGenerationExecutorProxy"
    assert out.victim is not None and out.victim.rank == rank and out.in_flight == out.options.requests
    d, sh = out.detection, out.shutdown
    assert d is not None and sh is not None
    assert d.health_false_ms is not None and d.requests_failed_ms is not None
    assert names_a_victim(out, out.fatal_error), out.fatal_error
    assert [(e.kind, e.identity.rank, e.identity.pid) for e in out.events][:1] == [("died", rank, out.victim.pid)]
    # Upstream's pre_shutdown() body runs once (its once-flag, serialized by the mixin); the fatal
    # path's helper and the harness's shutdown() may both call it, so up to two entries.
    assert sh.pre_shutdown_runs == 1 and 1 <= sh.pre_shutdown_calls <= 2
    # Every pending request failed with the engine's error: upstream main's EngineDeadError (its
    # _mark_engine_dead), on 1.2.x an ErrorResponse per request (upstream's RequestError).
    assert d.pending_errors == (("EngineDeadError",) if version == "main" else ("RequestError",))
    assert out.pending_not_done == 0
    expected = "EngineDeadError" if version == "main" else "WorkerFailedError"
    assert d.new_request_error == expected
    assert sh.shutdown_ms is not None and not sh.by_harness
    assert out.survivors == ()


@pytest.mark.mpi
def test_fake_without_liveness_is_untouched_and_hangs() -> None:
    out = run_fake("v12", {"TRTLLM_WORKER_LIVENESS": "0"}, mode="1.2", via="autoload", liveness=False,
                   fault="kill", observe_s=1.5)
    assert out.proxy_class == "GenerationExecutorProxy"
    assert out.in_flight == out.options.requests  # the requests were streaming when the rank died
    assert out.detection is not None and out.detection.health_false_ms is None
    assert out.pending_not_done == out.options.requests and out.fatal_error is None and out.events == ()
    assert out.shutdown is not None and out.shutdown.by_harness  # upstream 1.2.x would wait forever


def test_identity_channel_times_out_and_cleans_up(caplog: pytest.LogCaptureFixture) -> None:
    got: list[Any] = []
    with caplog.at_level(logging.ERROR):
        channel = IdentityChannel(got.append, timeout_s=0.2)
        directory = os.path.dirname(channel.address[len("ipc://"):])
        assert wait_until(lambda: not os.path.exists(directory), 10)
        channel.close()
    assert got == [] and "no worker identities" in caplog.text
    assert not any(t.name == "trtllm-liveness-identities" and t.is_alive() for t in threading.enumerate())
