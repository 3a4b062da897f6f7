"""What ``trtllm-liveness doctor`` reports: how much of the extension the installed TensorRT-LLM allows.

:func:`diagnose` finds ``tensorrt_llm`` with :func:`importlib.util.find_spec` (nothing imported
when it is absent), imports the few modules the extension touches, and checks each upstream name
it uses (the names and what their absence costs are those of docs/upstream-contract.md; the proxy
class is probed by :func:`._features.detect_features`, the same probe the extension runs).
docs/doctor.md gives each name's role (``attach``, ``needed``, ``optional``, ``unused``), the
verdicts with their exit statuses, and the check of this environment's ``TRTLLM_WORKER_LIVENESS``
(with :func:`trtllm_liveness._config.parse_value`, the parser an engine runs when it starts).

Never raises: an import that fails inside ``tensorrt_llm`` (any exception) is reported as
``inert`` with the error. While importing, file descriptor 1 points at stderr, so whatever the
import prints cannot corrupt ``--json`` output.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..._config import ENV_VAR, parse_value
from ..._record_fields import JsonRecord
from ._classes import CREATE_HOOK_MISSING, _routing_class
from ._features import (
    REPLACED_HOOKS,
    REQUIRED_HOOKS,
    SESSION_HOOKS,
    UNCOVERED_ROUTES,
    UpstreamFeatures,
    detect_features,
    find_symbol,
    has_attribute,
)
from ._progress import HANG_DETECTOR_MODULE

__all__ = ["COVERED", "DEGRADED", "EXIT_INVALID_SETTING", "EXIT_STATUS", "INERT", "NOT_INSTALLED", "DoctorReport",
           "HookCheck", "SettingCheck", "check_setting", "diagnose", "format_report"]

COVERED = "covered"
DEGRADED = "degraded"
INERT = "inert"
NOT_INSTALLED = "not installed"
EXIT_STATUS = {COVERED: 0, DEGRADED: 1, INERT: 3, NOT_INSTALLED: 4}
EXIT_INVALID_SETTING = 5  # TRTLLM_WORKER_LIVENESS would make every engine start fail

ATTACH, NEEDED, OPTIONAL, UNUSED = "attach", "needed", "optional", "unused"

PACKAGE = "tensorrt_llm"
PROXY_MODULE = "tensorrt_llm.executor.proxy"
EXECUTOR_MODULE = "tensorrt_llm.executor.executor"
SESSION_MODULE = "tensorrt_llm.llmapi.mpi_session"
ARGS_MODULE = "tensorrt_llm.llmapi.llm_args"
UTILS_MODULE = "tensorrt_llm._utils"


_NO_PROXY = "no proxy class to subclass or patch: no liveness on any route"


@dataclass(frozen=True)
class HookCheck(JsonRecord):
    """One upstream name: where it was looked for, whether it is there, its role, and what its
    absence means (what is not covered for ``attach``/``needed``, what the extension does instead
    for ``optional``)."""

    name: str
    where: str
    found: bool
    role: str
    if_missing: str

    @property
    def costs_coverage(self) -> bool:
        return not self.found and self.role in (ATTACH, NEEDED)


@dataclass(frozen=True)
class SettingCheck(JsonRecord):
    """``TRTLLM_WORKER_LIVENESS`` as this environment has it: ``value`` (``None`` when unset), whether
    it switches liveness on, and the parser's error for an invalid value (naming the key)."""

    value: str | None
    enabled: bool
    error: str | None = None


def check_setting() -> SettingCheck:
    """Parse this environment's ``TRTLLM_WORKER_LIVENESS`` as an engine start would; never raises."""
    raw = os.environ.get(ENV_VAR)
    try:
        return SettingCheck(raw, parse_value(raw).enabled)
    except ValueError as exc:
        return SettingCheck(raw, False, str(exc))


@dataclass(frozen=True)
class DoctorReport(JsonRecord):
    """The result of :func:`diagnose`; ``to_dict()`` is the ``--json`` form."""

    coverage: str
    location: str | None = None
    version: str | None = None
    flavour: str | None = None
    error: str | None = None
    patched: bool = False
    hooks: tuple[HookCheck, ...] = ()
    not_covered: tuple[str, ...] = ()
    uncovered_routes: tuple[str, ...] = field(default_factory=lambda: tuple(UNCOVERED_ROUTES.values()))
    setting: SettingCheck = field(default_factory=check_setting)

    json_form = ("coverage", "location", "version", "flavour", "error", "patched", "hooks", "not_covered",
                 "uncovered_routes", "setting", "exit_status")

    @property
    def exit_status(self) -> int:
        return EXIT_INVALID_SETTING if self.setting.error is not None else EXIT_STATUS[self.coverage]


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    # Imports of the real package print banners, some from C: move fd 1 itself, not sys.stdout.
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    try:
        saved = os.dup(1)
        os.dup2(2, 1)
    except OSError:
        yield
        return
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _import(name: str) -> tuple[Any, str | None]:
    """The module, or None and the error (never raises: a broken install is a finding)."""
    try:
        return importlib.import_module(name), None
    except (Exception, SystemExit) as exc:
        return None, _describe(exc)


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _version(package: Any) -> str | None:
    version = getattr(package, "__version__", None)
    if isinstance(version, str):
        return version
    with contextlib.suppress(Exception):
        from importlib import metadata

        return metadata.version(PACKAGE)
    return None


def _location(spec: Any) -> str | None:
    locations = list(getattr(spec, "submodule_search_locations", None) or [])
    return locations[0] if locations else getattr(spec, "origin", None)


def _proxy_checks(where: str, features: UpstreamFeatures) -> list[HookCheck]:
    return [HookCheck(name, where, features.has(name), role, text)
            for role, hooks in ((NEEDED, REQUIRED_HOOKS), (OPTIONAL, REPLACED_HOOKS)) for name, text in hooks.items()]


def _route_checks(proxy_base: type, features: UpstreamFeatures) -> list[HookCheck]:
    """Names whose role depends on the flavour (the route the extension takes on this version)."""
    where = _qualname(proxy_base)
    main = features.flavour == "main"
    checks = [
        HookCheck("is_shutdown", where, hasattr(proxy_base, "is_shutdown"), UNUSED if features.check_health else NEEDED,
                  "the health check without upstream's check_health (check_health() raises)"),
        HookCheck("_worker_process_monitor", where, has_attribute(proxy_base, "_worker_process_monitor"),
                  NEEDED if main else UNUSED,
                  "worker identities: upstream's identities message never reaches the extension (ranks unwatched)"),
    ]
    engine_dead = find_symbol(["EngineDeadError"], [proxy_base.__module__, "tensorrt_llm.executor.utils",
                                                    "tensorrt_llm.executor.result"])
    checks.append(HookCheck("EngineDeadError", "tensorrt_llm.executor.utils", isinstance(engine_dead, type), OPTIONAL,
                            "submit() after a fatal error raises the extension's WorkerFailedError"))
    response = find_symbol(["ErrorResponse"], ["tensorrt_llm.executor.utils"])
    checks.append(HookCheck("tensorrt_llm.executor.utils.ErrorResponse", "tensorrt_llm.executor.utils",
                            isinstance(response, type), UNUSED if features.mark_engine_dead else OPTIONAL,
                            "the exception object itself is put on a failed request's queue"))
    return checks


def _session_checks() -> list[HookCheck]:
    module, error = _import(SESSION_MODULE)
    session_cls: Any = getattr(module, "MpiSession", None) or getattr(module, "MpiPoolSession", None)
    found = isinstance(session_cls, type)
    where = _qualname(session_cls) if found else f"{SESSION_MODULE} ({error or 'no MpiSession'})"
    hooks = {"submit": "worker identities and the proxy-death watch", **SESSION_HOOKS}
    return [HookCheck(f"mpi_session.{name}", where, found and callable(getattr(session_cls, name, None)), NEEDED, text)
            for name, text in hooks.items()]


def _other_checks() -> list[HookCheck]:
    utils, error = _import(UTILS_MODULE)
    checks = [HookCheck("tensorrt_llm._utils.mpi_comm", UTILS_MODULE if error is None else f"{UTILS_MODULE} ({error})",
                        callable(getattr(utils, "mpi_comm", None)), NEEDED,
                        "identities gathered over the session's communicator: ranks gather over COMM_WORLD, which "
                        "hangs before worker_main under a sub-communicator session")]
    detector, error = _import(HANG_DETECTOR_MODULE)
    checks.append(HookCheck("HangDetector.checkpoint",
                            HANG_DETECTOR_MODULE if error is None else f"{HANG_DETECTOR_MODULE} ({error})",
                            callable(getattr(getattr(detector, "HangDetector", None), "checkpoint", None)), NEEDED,
                            "executor iterations as progress: with stall_timeout_s, only output counts, so a "
                            "non-streaming generation longer than stall_timeout_s is reported stalled"))
    args, error = _import(ARGS_MODULE)
    fields = getattr(getattr(args, "BaseLlmArgs", None), "model_fields", None) or {}
    checks.append(HookCheck("llm_args.env_overrides", ARGS_MODULE if error is None else f"{ARGS_MODULE} ({error})",
                            "env_overrides" in fields, OPTIONAL,
                            "configuration comes only from the class and TRTLLM_WORKER_LIVENESS"))
    return checks


def _verdict(hooks: list[HookCheck]) -> tuple[str, tuple[str, ...]]:
    lost = tuple(f"no {check.name}: {check.if_missing}" for check in hooks if check.costs_coverage)
    if any(check.costs_coverage and check.role == ATTACH for check in hooks):
        return INERT, lost
    return (DEGRADED if lost else COVERED), lost


def _probe(spec: Any) -> DoctorReport:
    location = _location(spec)
    package, error = _import(PACKAGE)
    if package is None:
        return DoctorReport(INERT, location=location, error=f"import {PACKAGE} failed: {error}",
                            hooks=(HookCheck(PROXY_MODULE, PROXY_MODULE, False, ATTACH, _NO_PROXY),),
                            not_covered=(f"no {PROXY_MODULE}: {_NO_PROXY}",))
    version = _version(package)
    proxy_module, error = _import(PROXY_MODULE)
    hooks = [HookCheck(PROXY_MODULE, PROXY_MODULE, proxy_module is not None, ATTACH, _NO_PROXY)]
    proxy_cls = getattr(proxy_module, "GenerationExecutorProxy", None)
    hooks.append(HookCheck("GenerationExecutorProxy", PROXY_MODULE, isinstance(proxy_cls, type), ATTACH, _NO_PROXY))
    executor_module, executor_error = _import(EXECUTOR_MODULE)
    executor_cls = getattr(executor_module, "GenerationExecutor", None)
    hooks.append(HookCheck(f"{EXECUTOR_MODULE}.GenerationExecutor", EXECUTOR_MODULE, isinstance(executor_cls, type),
                           NEEDED, "the executor_cls route: liveness_executor_class() raises ImportError"))
    owner = _routing_class(executor_cls) if isinstance(executor_cls, type) else None
    hooks.append(HookCheck("GenerationExecutor._create_ipc_executor", _qualname(owner) if owner else EXECUTOR_MODULE,
                           owner is not None, NEEDED, CREATE_HOOK_MISSING))
    flavour = None
    patched = False
    if isinstance(proxy_cls, type):
        base: type = getattr(proxy_cls, "_liveness_base", proxy_cls)
        patched = base is not proxy_cls
        features = detect_features(base)
        flavour = features.flavour
        hooks += _proxy_checks(_qualname(base), features)
        hooks += _route_checks(base, features)
    hooks += _session_checks()
    hooks += _other_checks()
    coverage, lost = _verdict(hooks)
    errors = [f"import {name} failed: {text}" for name, text in ((PROXY_MODULE, error),
                                                                   (EXECUTOR_MODULE, executor_error)) if text]
    return DoctorReport(coverage, location=location, version=version, flavour=flavour,
                        error="; ".join(errors) or None, patched=patched, hooks=tuple(hooks), not_covered=lost)


def diagnose() -> DoctorReport:
    """Probe the ``tensorrt_llm`` that this interpreter would import; never raises."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (Exception, SystemExit) as exc:  # e.g. a half-imported module without __spec__
        return DoctorReport(INERT, error=f"finding {PACKAGE} failed: {_describe(exc)}")
    if spec is None:
        return DoctorReport(NOT_INSTALLED)
    try:
        with _stdout_to_stderr():
            return _probe(spec)
    except (Exception, SystemExit) as exc:  # a layout no check foresaw: still a report, not a traceback
        return DoctorReport(INERT, location=_location(spec), error=f"probing {PACKAGE} failed: {_describe(exc)}")


def format_report(report: DoctorReport) -> list[str]:
    """The plain-text table (the command's default output), one string per line."""
    if report.coverage == NOT_INSTALLED:
        return [f"{PACKAGE}: not installed (not importable from this interpreter)", _setting_line(report.setting),
                _last_line(report)]
    head = f"{PACKAGE} {report.version or '(version unknown)'} at {report.location or '?'}"
    if report.flavour:
        head += f" (TensorRT-LLM {report.flavour} flavour)"
    lines = [head]
    if report.patched:
        lines.append("GenerationExecutorProxy is already the liveness class (the import hook is active)")
    if report.error:
        lines.append(f"error: {report.error}")
    if report.hooks:
        width = max(len(check.name) for check in report.hooks)
        lines.append(f"{'NAME':<{width}}  {'FOUND':<5}  {'ROLE':<8}  WHERE")
        for check in report.hooks:
            lines.append(f"{check.name:<{width}}  {'yes' if check.found else 'NO':<5}  {check.role:<8}  {check.where}")
        replaced = [check for check in report.hooks if not check.found and check.role == OPTIONAL]
        if replaced:
            lines.append("replaced by the extension (nothing lost):")
            lines += [f"  no {check.name}: {check.if_missing}" for check in replaced]
    if report.not_covered:
        lines.append("not covered:")
        lines += [f"  {text}" for text in report.not_covered]
    lines.append("never covered, on any version:")
    lines += [f"  {text}" for text in report.uncovered_routes]
    lines.append(_setting_line(report.setting))
    lines.append(_last_line(report))
    return lines


def _setting_line(setting: SettingCheck) -> str:
    if setting.error is not None:
        return f"settings: INVALID: {setting.error}: every engine start would fail"
    if setting.value is None or not setting.value.strip():
        return f"settings: {ENV_VAR} unset: liveness off (the autoload launcher sets it to 1)"
    return f"settings: {ENV_VAR}={setting.value!r}: valid, liveness {'on' if setting.enabled else 'off'}"


def _last_line(report: DoctorReport) -> str:
    if report.setting.error is not None:
        return f"coverage: {report.coverage}; settings invalid (exit status {report.exit_status})"
    return f"coverage: {report.coverage} (exit status {report.exit_status})"
