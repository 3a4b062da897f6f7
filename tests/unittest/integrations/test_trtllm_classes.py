"""Class building without a process-wide swap, and the loud degraded modes (routes, hooks).

In-process, against a minimal upstream layout: ``GenerationExecutor.create`` routes by name to
``GenerationExecutor._create_ipc_executor``, which looks the proxy class up in the proxy module
at call time (as upstream's ``from .proxy import GenerationExecutorProxy`` does).
"""

from __future__ import annotations

import logging
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.waits import wait_until
from trtllm_liveness import LivenessConfig
from trtllm_liveness.integrations import trtllm as integ
from trtllm_liveness.integrations.trtllm import _features

pytestmark = [pytest.mark.timeout(60)]

PROXY_MODULE = "fake_upstream_executor_proxy"


class UpstreamProxy:
    """What the extension needs of upstream's proxy; the constructor waits on ``worker_kwargs["gate"]``."""

    def __init__(self, worker_kwargs: dict[str, Any], model_world_size: int = 1, mpi_session: Any = None,
                 **_unused: Any) -> None:
        self.mpi_session = mpi_session
        self.mpi_futures: list[Any] = []
        self.doing_shutdown = False
        gate = worker_kwargs.get("gate")
        if gate is not None:
            gate.wait(20)
        self._start_executor_workers(worker_kwargs)

    def _start_executor_workers(self, worker_kwargs: dict[str, Any]) -> None:
        del worker_kwargs

    def submit(self, request: Any) -> Any:
        return request

    def pre_shutdown(self) -> None:
        self.doing_shutdown = True

    def shutdown(self) -> None:
        self.pre_shutdown()

    def is_shutdown(self) -> bool:
        return self.doing_shutdown


UpstreamProxy.__module__ = PROXY_MODULE
UpstreamProxy.__qualname__ = UpstreamProxy.__name__ = "GenerationExecutorProxy"


class GenerationExecutor:
    @staticmethod
    def _create_ipc_executor(worker_kwargs: dict[str, Any], model_world_size: int = 1, mpi_session: Any = None,
                             postproc_worker_config: Any = None, is_llm_executor: Any = None,
                             use_worker: bool = False) -> Any:
        if use_worker:
            return ("in-process worker", worker_kwargs)
        proxy_cls = sys.modules[PROXY_MODULE].GenerationExecutorProxy  # looked up at call time
        return proxy_cls(worker_kwargs, model_world_size=model_world_size, mpi_session=mpi_session)

    @staticmethod
    def create(**kwargs: Any) -> Any:
        if kwargs.get("orchestrator_type") == "rpc":
            return ("rpc proxy", kwargs)
        return GenerationExecutor._create_ipc_executor(kwargs, use_worker=bool(kwargs.get("return_logits")))


@pytest.fixture
def upstream(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    module = types.ModuleType(PROXY_MODULE)
    module.GenerationExecutorProxy = UpstreamProxy  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, PROXY_MODULE, module)
    monkeypatch.setattr(_features, "_WARNED", set())
    original = vars(GenerationExecutor)["_create_ipc_executor"]
    yield module
    GenerationExecutor._create_ipc_executor = original  # type: ignore[method-assign]


def _shutdown(executor: Any) -> None:
    if isinstance(executor, UpstreamProxy):
        executor.shutdown()


def test_two_engines_built_at_once_each_get_what_they_asked_for(upstream: types.ModuleType) -> None:
    """The liveness class does not leak to an engine built meanwhile."""
    liveness_cls = integ.liveness_executor_class(GenerationExecutor, UpstreamProxy,
                                                 config=LivenessConfig(enabled=True, scan_interval_s=0.1))
    gate = threading.Barrier(2)
    built: dict[str, Any] = {}
    errors: list[BaseException] = []

    def build(name: str, cls: Any) -> None:
        try:
            built[name] = cls.create(gate=gate)
        except BaseException as exc:
            errors.append(exc)

    with_liveness = threading.Thread(target=build, args=("with", liveness_cls))
    with_liveness.start()
    # The liveness engine is inside its (long) model load before the plain one is created.
    assert wait_until(lambda: gate.n_waiting == 1, 10)
    plain = threading.Thread(target=build, args=("without", GenerationExecutor))
    plain.start()
    with_liveness.join(20)
    plain.join(20)
    try:
        assert errors == []
        assert isinstance(built["with"], integ.LivenessProxyMixin)
        assert built["with"].liveness_config.enabled
        assert type(built["without"]) is UpstreamProxy
        assert upstream.GenerationExecutorProxy is UpstreamProxy  # nothing was swapped
    finally:
        for executor in built.values():
            _shutdown(executor)


def test_nested_build_in_the_same_thread_gets_upstreams_class(upstream: types.ModuleType) -> None:
    liveness_cls = integ.liveness_executor_class(GenerationExecutor, UpstreamProxy,
                                                 config=LivenessConfig(enabled=True))
    first = liveness_cls.create()
    second = GenerationExecutor.create()
    try:
        assert isinstance(first, integ.LivenessProxyMixin) and type(second) is UpstreamProxy
    finally:
        _shutdown(first)
        _shutdown(second)


@pytest.mark.parametrize(("kwargs", "route"), [({"orchestrator_type": "rpc"}, "rpc"),
                                               ({"return_logits": True}, "single-process")])
def test_uncovered_routes_warn_once_naming_the_route(upstream: types.ModuleType, kwargs: dict[str, Any],
                                                     route: str, caplog: pytest.LogCaptureFixture) -> None:
    """The rpc, ray and single-process routes get no liveness: each warns once, naming the route."""
    liveness_cls = integ.liveness_executor_class(GenerationExecutor, UpstreamProxy)
    with caplog.at_level(logging.WARNING, logger="trtllm_liveness"):
        first = liveness_cls.create(**kwargs)
        second = liveness_cls.create(**kwargs)
    assert not isinstance(first, integ.LivenessProxyMixin) and not isinstance(second, integ.LivenessProxyMixin)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and route in r.getMessage()]
    assert len(warnings) == 1, caplog.text
    assert "not covered" in warnings[0]


def test_each_missing_hook_warns_once_naming_what_is_not_covered(caplog: pytest.LogCaptureFixture,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_features, "_WARNED", set())

    class Bare:  # no _start_executor_workers, no pre_shutdown
        def __init__(self, worker_kwargs: Any, *args: Any, **kwargs: Any) -> None:
            pass

        def submit(self, request: Any) -> Any:
            return request

        def shutdown(self) -> None:
            pass

    cls = integ.liveness_proxy_class(Bare, config=LivenessConfig(enabled=True))
    with caplog.at_level(logging.WARNING, logger="trtllm_liveness"):
        for _ in range(2):
            proxy = cls({"llm_args": None})
            proxy.shutdown()
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sum("no _start_executor_workers" in m for m in messages) == 1, messages
    assert sum("no pre_shutdown" in m for m in messages) == 1, messages
    assert all("not covered" in m for m in messages if " has no " in m)
