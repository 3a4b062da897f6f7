"""The reference MPI executor dressed up as what Dynamo and trtllm-serve hold, for child-process helpers.

- :func:`build_executor`: a reference proxy (1.2.x or main flavour), with or without the liveness
  extension, whose ranks write their identities to ``announce_dir`` (so a harness can kill one
  even without liveness).
- :class:`FakeLLM`: the part of ``tensorrt_llm.LLM`` the consumers touch: ``_executor``,
  ``shutdown()`` and, where upstream has it, ``_check_health()``.
- :class:`DynamoShapedEngine`: mirrors ``dynamo/trtllm/engine.py``'s ``TensorRTLLMEngine``
  (ai-dynamo 1.6.1) method for method: ``supports_health_check``, ``check_health``,
  ``get_health_check_fatal_error``, ``shutdown`` and ``_get_health_check_fn`` (``llm._check_health``
  first, else ``llm._executor.check_health``). Differences: it is handed a built ``LLM``-like
  object instead of building one from ``engine_args`` in ``initialize()``; it logs through
  ``logging`` instead of ``logging.error`` on the root logger; no encoder / disaggregation / KV
  routing parts. The real module cannot be imported here: it imports ``tensorrt_llm``.
"""

from __future__ import annotations

import json
import logging
import signal
from typing import Any

from trtllm_liveness.demo import PROXY_CLASSES, configure_mpi_env
from trtllm_liveness.demo._executor_worker import read_announced_identities
from trtllm_liveness.process import ProcessIdentity, _pidfd

logger = logging.getLogger(__name__)


def build_executor(mode: str, announce_dir: str, *, workers: int = 2, liveness: bool | None = True,
                   options: dict[str, Any] | None = None) -> Any:
    """Start a reference executor (blocks until its ranks are ready; MPI env configured first).

    ``liveness``: True = extension on, configured with ``options`` in code (the class's
    ``config``); False = upstream class; None = the liveness class with no configuration of its
    own, so ``TRTLLM_WORKER_LIVENESS`` decides (what the import hook does for ``trtllm-serve``).
    """
    configure_mpi_env()
    base = PROXY_CLASSES[mode]
    cls: Any = base
    if liveness is not False:
        from trtllm_liveness import LivenessConfig
        from trtllm_liveness.integrations.trtllm import liveness_proxy_class

        config = LivenessConfig(**{"enabled": True, "scan_interval_s": 0.1, **(options or {})}) if liveness else None
        cls = liveness_proxy_class(base, default_enabled=False, config=config)
    worker_kwargs = {"token_delay_s": 0.01, "announce_dir": announce_dir, "llm_args": None}
    return cls(worker_kwargs, model_world_size=workers)


def read_identities(announce_dir: str, count: int, timeout: float = 20.0) -> list[ProcessIdentity]:
    """The ranks' identities as the reference workers announced them. Raises ``TimeoutError``."""
    return read_announced_identities(announce_dir, count, timeout)


def kill_rank(identity: ProcessIdentity) -> None:
    """SIGKILL one rank through a pidfd verified against its start time (never a recycled pid)."""
    signal_rank(identity, signal.SIGKILL)


def signal_rank(identity: ProcessIdentity, signum: int) -> None:
    """Send ``signum`` to one rank through a pidfd verified against its start time."""
    _pidfd.signal_verified(identity.pid, identity.start_time, signum)


class FakeLLM:
    """``tensorrt_llm.LLM`` as its consumers see it. ``check_health_attr``: whether the LLM has
    ``_check_health`` (1.2.x: ``not executor.is_shutdown()``; for ``"executor"`` it defers to
    ``executor.check_health()`` where present, as trtllm-serve's health does on main)."""

    def __init__(self, executor: Any, check_health_attr: str | None) -> None:
        self._executor = executor
        if check_health_attr == "is_shutdown":
            self._check_health = lambda: not executor.is_shutdown()
        elif check_health_attr == "executor":
            check = getattr(executor, "check_health", None)
            self._check_health = check if callable(check) else (lambda: not executor.is_shutdown())

    def shutdown(self) -> None:
        self._executor.shutdown()


class DynamoShapedEngine:
    """``dynamo.trtllm.engine.TensorRTLLMEngine``'s health and shutdown surface (see module doc)."""

    def __init__(self, llm: Any) -> None:
        self._llm: Any = llm

    def shutdown(self) -> None:
        if self._llm:
            try:
                self._llm.shutdown()
            except Exception as e:
                logger.error(f"Error during shutdown: {e}")
            finally:
                self._llm = None

    def supports_health_check(self) -> bool:
        return self._get_health_check_fn() is not None

    def check_health(self) -> bool:
        if self._llm is None:
            return False
        check_health = self._get_health_check_fn()
        if check_health is None:
            return True
        return bool(check_health())

    def get_health_check_fatal_error(self) -> BaseException | None:
        if self._llm is None:
            return None
        executor = getattr(self._llm, "_executor", None)
        error: BaseException | None = getattr(executor, "_fatal_error", None)
        return error

    def _get_health_check_fn(self) -> Any:
        if self._llm is None:
            return None
        check_health = getattr(self._llm, "_check_health", None)
        if callable(check_health):
            return check_health
        executor = getattr(self._llm, "_executor", None)
        check_health = getattr(executor, "check_health", None)
        if callable(check_health):
            return check_health
        return None


def emit(record: dict[str, Any]) -> None:
    """One JSON line on stdout for the parent (helpers talk to tests and the bench this way)."""
    import sys

    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


EXTENSION_THREAD_PREFIXES = ("trtllm-liveness", "liveness-")  # every thread the extension names


def extension_threads() -> list[str]:
    """The names of the live threads the extension started (for a child's record after ``shutdown()``)."""
    import threading

    return [thread.name for thread in threading.enumerate()
            if thread.name.startswith(EXTENSION_THREAD_PREFIXES) and thread.is_alive()]
