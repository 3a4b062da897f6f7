"""LivenessConfig: how the extension is switched on and tuned, strictly validated.

Two sources, applied in this order (later wins, key by key):

1. the ``TRTLLM_WORKER_LIVENESS`` environment variable: ``0``/``1`` (also ``true``/``false``,
   ``on``/``off``, ``yes``/``no``) or ``key=value,key=value`` (which also switches it on unless
   it says ``enabled=0``). TensorRT-LLM's ``MpiPoolSession`` forwards ``TRTLLM_*`` variables to
   the workers, so both sides read the same value.
2. the ``worker_liveness`` field of TensorRT-LLM's ``llm_args`` (read with ``getattr``, as
   upstream reads optional flags), which is ``True``/``False`` or a mapping of the same keys; it
   is what ``trtllm-serve --extra_llm_api_options file.yaml`` feeds.

A bad value is a ``ValueError`` that names the key and the source, raised when the executor
starts, never a silent default. Disabled means nothing else of the package runs.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any

__all__ = ["ENV_VAR", "LLM_ARGS_FIELD", "LivenessConfig"]

ENV_VAR = "TRTLLM_WORKER_LIVENESS"
LLM_ARGS_FIELD = "worker_liveness"

_TRUE = frozenset({"1", "true", "on", "yes"})
_FALSE = frozenset({"0", "false", "off", "no"})


@dataclasses.dataclass(frozen=True)
class LivenessConfig:
    """Settings of the TensorRT-LLM liveness extension. Immutable, so safe to share across threads.

    Attributes:
        enabled: whether the extension does anything at all.
        d_state_timeout_s: seconds a worker thread may stay in ``D`` before the worker counts as
            wedged (a non-restartable fatal error); 0 disables wedge detection.
        scan_interval_s: how often thread states are sampled for wedges.
        identities_timeout_s: how long the proxy waits for the workers' identities after
            submitting them (they come before the model is built).
        shutdown_grace_s: how long ``shutdown()`` lets a healthy engine stop by itself before
            it stops the remaining workers.
        shutdown_term_s: after SIGTERM, how long to wait before SIGKILL.
        shutdown_kill_s: after SIGKILL, how long to wait before reporting a rank unkillable.
        exit_on_fatal: after a fatal error, start the serving process's graceful shutdown once
            (SIGINT to itself, what ``trtllm-serve``'s ``/health`` intends and never does after a
            killed rank) and make the process exit with ``exit_code`` (for servers whose health
            endpoint never restarts them); see :class:`~trtllm_liveness._exit_guard.FatalExitGuard`.
        exit_code: exit status used by ``exit_on_fatal``; 1-255 (never 0 after an engine death).
        exit_delay_s: seconds between the fatal error and the graceful shutdown, so health
            endpoints and logs can report it first.
        exit_timeout_s: bound on the graceful shutdown: if the process still runs this long after
            it started, it is ended with ``os._exit(exit_code)`` (the remaining workers are
            stopped first, bounded by ``shutdown_term_s + shutdown_kill_s``).
    """

    enabled: bool = False
    d_state_timeout_s: float = 30.0
    scan_interval_s: float = 1.0
    identities_timeout_s: float = 600.0
    shutdown_grace_s: float = 10.0
    shutdown_term_s: float = 2.0
    shutdown_kill_s: float = 3.0
    exit_on_fatal: bool = False
    exit_code: int = 1
    exit_delay_s: float = 1.0
    exit_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for spec in dataclasses.fields(self):
            _check_value(spec.name, getattr(self, spec.name), "LivenessConfig")

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, *, base: LivenessConfig | None = None
    ) -> LivenessConfig:
        """Apply ``TRTLLM_WORKER_LIVENESS`` from ``environ`` (default ``os.environ``) to ``base``.

        Raises ``ValueError`` naming the variable and the key on a malformed value.
        """
        base = base if base is not None else cls()
        env = os.environ if environ is None else environ
        raw = env.get(ENV_VAR)
        if raw is None or not raw.strip():
            return base
        return base._apply(_parse_env(raw), ENV_VAR)

    @classmethod
    def from_llm_args(cls, llm_args: Any, *, base: LivenessConfig | None = None) -> LivenessConfig:
        """Apply ``getattr(llm_args, "worker_liveness", None)`` to ``base``.

        ``None`` leaves ``base`` unchanged; a bool switches it; a mapping sets keys (and switches
        it on unless it has ``enabled``). Raises ``ValueError`` on anything else.
        """
        base = base if base is not None else cls()
        value = getattr(llm_args, LLM_ARGS_FIELD, None) if llm_args is not None else None
        if value is None:
            return base
        source = f"llm_args.{LLM_ARGS_FIELD}"
        if isinstance(value, bool):
            return dataclasses.replace(base, enabled=value)
        if hasattr(value, "model_dump") and not isinstance(value, Mapping):
            value = value.model_dump()  # a pydantic sub-model
        if not isinstance(value, Mapping):
            raise ValueError(
                f"{source} must be a bool or a mapping of options, got {type(value).__name__}"
            )
        settings: dict[str, Any] = {"enabled": True}
        for key, item in value.items():
            settings[str(key)] = item
        return base._apply(settings, source)

    @classmethod
    def resolve(
        cls, llm_args: Any = None, environ: Mapping[str, str] | None = None, *, default_enabled: bool = False
    ) -> LivenessConfig:
        """Defaults, then the environment variable, then ``llm_args``. Raises ``ValueError``."""
        config = cls.from_env(environ, base=cls(enabled=default_enabled))
        return cls.from_llm_args(llm_args, base=config)

    def to_env(self) -> str:
        """This configuration as a ``TRTLLM_WORKER_LIVENESS`` value (round-trips through ``from_env``)."""
        parts = []
        for spec in dataclasses.fields(self):
            value = getattr(self, spec.name)
            parts.append(f"{spec.name}={int(value) if isinstance(value, bool) else value}")
        return ",".join(parts)

    def _apply(self, settings: Mapping[str, Any], source: str) -> LivenessConfig:
        known = {spec.name: spec for spec in dataclasses.fields(self)}
        changes: dict[str, Any] = {}
        for key, raw in settings.items():
            spec = known.get(key)
            if spec is None:
                raise ValueError(
                    f"{source}: unknown key {key!r}; valid keys are {', '.join(sorted(known))}"
                )
            # The field's own type (its class default's), not the current value's: a base built
            # with ``shutdown_grace_s=10`` must still accept ``shutdown_grace_s=2.5``.
            changes[key] = _coerce(key, raw, type(spec.default), source)
            _check_value(key, changes[key], source)
        return dataclasses.replace(self, **changes)


def _parse_env(raw: str) -> dict[str, Any]:
    text = raw.strip()
    lowered = text.lower()
    if lowered in _TRUE:
        return {"enabled": True}
    if lowered in _FALSE:
        return {"enabled": False}
    settings: dict[str, Any] = {"enabled": True}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(
                f"{ENV_VAR}={raw!r}: expected 0, 1 or key=value[,key=value...], got {item!r}"
            )
        settings[key.strip()] = value.strip()
    return settings


def _coerce(key: str, raw: Any, kind: type, source: str) -> Any:
    if kind is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.strip().lower() in _TRUE | _FALSE:
            return raw.strip().lower() in _TRUE
        if isinstance(raw, int) and raw in (0, 1):
            return bool(raw)
        raise ValueError(f"{source}: {key} must be a boolean (0/1/true/false), got {raw!r}")
    if isinstance(raw, bool):
        raise ValueError(f"{source}: {key} must be a number, got the boolean {raw!r}")
    try:
        if kind is int:
            if isinstance(raw, float) and not raw.is_integer():
                raise ValueError
            return int(raw)
        return float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{source}: {key} must be {'an int' if kind is int else 'a number'}, got {raw!r}") from None


def _check_value(key: str, value: Any, source: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{source}: {key} must be finite, got {value!r}")
    if key == "exit_code":
        if not 1 <= value <= 255:
            raise ValueError(f"{source}: exit_code must be in [1, 255] (never 0 after a fatal error), got {value!r}")
        return
    if key in ("scan_interval_s", "identities_timeout_s") and value <= 0:
        raise ValueError(f"{source}: {key} must be > 0, got {value!r}")
    if value < 0:
        raise ValueError(f"{source}: {key} must be >= 0, got {value!r}")
