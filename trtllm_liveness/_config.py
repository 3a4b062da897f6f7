"""LivenessConfig: how the extension is switched on and tuned, strictly validated.

docs/configuration.md ("Where settings come from") lists the sources, applied in order (later wins,
key by key), and the syntax of ``TRTLLM_WORKER_LIVENESS`` (:data:`ENV_VAR`). What the code adds:

- TensorRT-LLM's ``MpiPoolSession`` forwards ``TRTLLM_*`` variables to the workers, so both
  sides read the same value;
- the ``TRTLLM_WORKER_LIVENESS`` entry of ``llm_args.env_overrides`` is read here because upstream
  may apply ``env_overrides`` to ``os.environ`` only after the executor has started (see
  docs/upstream-contract.md);
- there is no ``llm_args`` field of this package: TensorRT-LLM's ``llm_args`` is a strict pydantic
  model that rejects unknown keys, so such a field would break start-up.

A bad value is a ``ValueError`` that names the key and the source, raised when the executor
starts, never a silent default. Disabled means nothing else of the package runs.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
from collections.abc import Iterable, Mapping
from typing import Any

from ._switch import ENV_VAR
from ._switch import FALSE_WORDS as _FALSE
from ._switch import TRUE_WORDS as _TRUE

__all__ = ["ENV_OVERRIDES_FIELD", "ENV_VAR", "LivenessConfig", "changed_settings", "format_setting", "parse_value"]

ENV_OVERRIDES_FIELD = "env_overrides"
_MAX_FILE_BYTES = 64 << 10
# The numeric settings bounded on both sides: [low, high].
_RANGES = {"hosts_port": (0, 65535), "heartbeat_timeout_s": (0.05, 3600), "heartbeat_ceiling_s": (1, 86400)}


class TextEnum(str, enum.Enum):
    """A ``str`` enum whose ``str()`` and ``format()`` are its value: settings, logs and JSON read
    ``fatal``, never ``StallAction.FATAL``."""

    __str__ = str.__str__

    def __format__(self, format_spec: str) -> str:
        return str.__format__(self, format_spec)


class StallAction(TextEnum):
    """What a stall does (the ``stall_action`` setting)."""

    REPORT = "report"
    FATAL = "fatal"


class HostsMode(TextEnum):
    """When an engine runs an agent hub (the ``hosts`` setting)."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"


@dataclasses.dataclass(frozen=True)
class LivenessConfig:
    """Settings of the TensorRT-LLM liveness extension. Immutable, so safe to share across threads.

    Attributes:
        enabled: whether the extension does anything at all.
        d_state_timeout_s: seconds a worker thread may stay in ``D`` without running (its
            context-switch count unchanged: the kernel's hung-task rule) before the worker counts
            as wedged (a non-restartable fatal error), once the engine is READY; 0 disables wedge
            detection. A thread that keeps waking from ``D`` (slow I/O) is never wedged.
        startup_d_state_timeout_s: the same bound before READY (model load, which may read
            weights from a slow cold mount); 0 (the default) means no wedge verdict during
            start-up at all: a slow but healthy start-up must never be killed. Deaths are
            reported during start-up in any case.
        scan_interval_s: how often thread states are sampled for wedges.
        identities_timeout_s: how long the proxy waits for the workers' identities after
            submitting them (they come before the model is built).
        stall_timeout_s: the engine is *stalled* when at least one request is pending and it made
            no progress (no output of any request, no executor iteration reported by a rank) for
            this long; 0 (the default) turns stall detection off. An idle engine is never stalled.
            See :mod:`trtllm_liveness.monitor._stall_timer`.
        stall_action: ``report`` (a WARNING with the diagnosis once per stall, state ``stalled`` in
            the statuses and metrics; health stays True) or ``fatal`` (the fatal path a death takes).
        stopped_timeout_s: a rank stopped by a signal (state ``T``: SIGSTOP, a terminal's Ctrl-Z)
            on every scan for this long, while requests are pending and the engine made no
            progress for as long, is a fatal verdict (restartable), whatever ``stall_timeout_s``
            says; 0 turns it off. A debugger's stop (``t``) never counts, nor does a pause shorter
            than this (py-spy's, a short SIGSTOP/SIGCONT), nor a scan gap (the proxy itself stopped).
        observe: make every verdict (death, wedge, unkillable, stall with ``stall_action=fatal``,
            stopped rank, lost host) one WARNING ``liveness: would fail: ...`` with its evidence
            and snapshot, counted per kind, and nothing else: no request failed, health unchanged,
            no rank stopped, no exit, no quarantine, no agent ending its host's ranks. For a
            rollout: observe, read the counter, then enforce.
        shutdown_grace_s: how long ``shutdown()`` lets a healthy engine stop by itself before
            it stops the remaining workers.
        shutdown_term_s: after SIGTERM, how long to wait before SIGKILL.
        shutdown_kill_s: after SIGKILL, how long to wait before reporting a rank unkillable.
        diagnosis_before_stop_s: after a fatal verdict, how long the bounded stop waits for the
            diagnosis' snapshot of the ranks before it signals one (0: no wait; the snapshot may
            then show ranks the stop ended).
        diagnosis_before_stop_hosts_s: the same bound where the engine spans hosts (an agent hub
            runs): every host's agent snapshots its own ranks (0.1 s of CPU time, 0.3 s for
            stacks) and the replies cross the network, so the whole engine's snapshot gets 1 s
            (remote hosts not answered by then are reported as such); at a stall, the naming waits
            as long at most for the remote ranks' thread states.
        exit_on_fatal: after a fatal error, start the serving process's graceful shutdown once
            (SIGINT to itself, what ``trtllm-serve``'s ``/health`` intends and never does after a
            killed rank) and make the process exit with ``exit_code`` (for servers whose health
            endpoint never restarts them); see :class:`~trtllm_liveness.exit._exit_guard.FatalExitGuard`.
        exit_code: exit status used by ``exit_on_fatal``; 1-255 (never 0 after an engine death).
        exit_delay_s: seconds between the fatal error and the graceful shutdown, so health
            endpoints and logs can report it first.
        exit_timeout_s: bound on the graceful shutdown: if the process still runs this long after
            it started, it is ended with ``os._exit(exit_code)`` (the remaining workers are
            stopped first, bounded by ``shutdown_term_s + shutdown_kill_s``).
        termination_log: where the first fatal error's one-line reason is written (Kubernetes'
            ``terminationMessagePath``; at most 4096 bytes, from a daemon thread, never blocking
            the exit). The default ``/dev/termination-log`` is written only where it exists (the
            kubelet mounts it); another absolute path is created if missing; empty: off.
        exit_code_unrestartable: exit status after a failure that is *not restartable* on this
            host (a worker wedged in ``D`` or unkillable: it still holds its GPU/NIC); 1-255,
            default 69 (sysexits' ``EX_UNAVAILABLE``). A Kubernetes Job's ``podFailurePolicy`` or
            a supervisor can tell it from ``exit_code``; a Deployment restarts whatever the code,
            hence the host marker below. Used by the exit guard and the Dynamo bridge.
        quarantine_dir: where a non-restartable failure leaves the host's quarantine marker
            (``quarantine.json``), which every start-up on the host reads: it refuses to start
            while a recorded process still exists or cannot be verified from its PID namespace
            (see :mod:`trtllm_liveness.quarantine._marker`). Default ``/run/trtllm-liveness``, or
            ``$TRTLLM_LIVENESS_QUARANTINE_DIR`` where set (non-root: ``$XDG_RUNTIME_DIR/trtllm-liveness``,
            else ``/tmp/trtllm-liveness-<uid>``); in a container, a ``hostPath`` mount of the host's
            directory. Empty: no marker, no check.
        quarantine_devices: ``:``-separated glob patterns of the accelerator device files; start-up
            refuses when a visible process holding one is in ``D`` in two samples. Empty: off.
        quarantine_override: start even on a quarantined host (logged as an error).
        quarantine_slurm_drain: on a non-restartable failure, ``scontrol update NodeName=...
            State=DRAIN Reason=...`` (needs SlurmUser's or root's rights).
        quarantine_k8s_cordon / quarantine_k8s_taint: on a non-restartable failure, cordon or taint
            (``trtllm-liveness/wedged=true:NoSchedule``) the node ``$NODE_NAME`` through the
            ``kubernetes`` client (extra ``k8s``; needs ``get``/``patch`` on ``nodes``).
        quarantine_hook: an executable run on a non-restartable failure with the marker's path as
            its argument and the reason in ``TRTLLM_LIVENESS_QUARANTINE_REASON``. Empty: none.
        quarantine_action_timeout_s: bound on each of those actions (it is killed after it) and on
            how long the exit waits for them.
        hosts: the multi-host agents (:mod:`trtllm_liveness.multihost`): ``auto`` (the default: on
            for sessions whose ranks ``mpirun``/``srun`` launched, ``MpiCommSession``, where ranks
            may be on other hosts), ``on`` (every session) or ``off``.
        hosts_bind: the address the proxy's agent hub binds (TCP): an interface's address or a
            host name reachable from every rank; ``*`` for every interface. Empty (the default):
            this host's name (what ``hostname`` resolves to). Bind only where the ranks can reach.
        hosts_port: the hub's TCP port; 0 (the default) picks a free one (the ranks learn it with
            their task). Fix it where a firewall must open it.
        hosts_advertise: the host name or address the ranks connect to, when it differs from
            ``hosts_bind`` (e.g. ``hosts_bind=*``); empty: ``hosts_bind``, or this host's name.
        heartbeat_timeout_s: a remote host from which nothing came this long (its agent PINGs the
            hub every three quarters of the timeout; the hub reads the kernel's "last heard" of the connection) is
            *suspect*: state ``suspect`` in the statuses, a metric, one WARNING once it lasts twice
            this; requests keep flowing. Silence alone never ends an engine: a suspect host is
            **lost** (fatal, naming the host and its ranks) when the engine also made no progress
            (no output, no executor iteration) for this long with requests pending, since every
            step needs every rank, and the host went silent no later than just after the engine
            stopped (a quarter of this, or 1.5 steps; later: after 5 times this without contact,
            or ``heartbeat_ceiling_s`` where shorter);
            a host whose connection closes is lost at once. Partition to verdict: about 1 to 1.1
            times it with requests in flight.
        heartbeat_ceiling_s: a suspect host is lost anyway after this long without contact while the
            engine shows no progress (idle, or ranks that report no iterations); its agent ends
            the host's ranks on the same rule, from its side. An engine that keeps making progress
            through a longer silence keeps its suspect host.
    """

    enabled: bool = False
    d_state_timeout_s: float = 30.0
    startup_d_state_timeout_s: float = 0.0
    scan_interval_s: float = 1.0
    identities_timeout_s: float = 600.0
    stall_timeout_s: float = 0.0
    stall_action: StallAction = StallAction.REPORT
    stopped_timeout_s: float = 30.0
    observe: bool = False
    shutdown_grace_s: float = 10.0
    shutdown_term_s: float = 2.0
    shutdown_kill_s: float = 3.0
    diagnosis_before_stop_s: float = 0.3
    diagnosis_before_stop_hosts_s: float = 1.0
    exit_on_fatal: bool = False
    exit_code: int = 1
    exit_delay_s: float = 1.0
    exit_timeout_s: float = 30.0
    termination_log: str = "/dev/termination-log"
    exit_code_unrestartable: int = 69
    quarantine_dir: str = "/run/trtllm-liveness"
    quarantine_devices: str = "/dev/nvidia*"
    quarantine_override: bool = False
    quarantine_slurm_drain: bool = False
    quarantine_k8s_cordon: bool = False
    quarantine_k8s_taint: bool = False
    quarantine_hook: str = ""
    quarantine_action_timeout_s: float = 10.0
    hosts: HostsMode = HostsMode.AUTO
    hosts_bind: str = ""
    hosts_port: int = 0
    hosts_advertise: str = ""
    heartbeat_timeout_s: float = 1.0
    heartbeat_ceiling_s: float = 60.0

    def __post_init__(self) -> None:
        for spec in dataclasses.fields(self):
            value = getattr(self, spec.name)
            if isinstance(spec.default, TextEnum):  # given as its value's string in code too
                object.__setattr__(self, spec.name, _coerce(spec.name, value, type(spec.default), "LivenessConfig"))
            elif isinstance(spec.default, str) and not isinstance(value, str):
                raise ValueError(f"LivenessConfig: {spec.name} must be a string, got {value!r}")
            _check_value(spec.name, getattr(self, spec.name), "LivenessConfig")

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, *, base: LivenessConfig | None = None
    ) -> LivenessConfig:
        """Apply ``TRTLLM_WORKER_LIVENESS`` from ``environ`` (default ``os.environ``) to ``base``.

        Raises ``ValueError`` naming the variable (or the file) and the key on a malformed value.
        Reads the named file when the value is ``@path`` (blocking file I/O, 64 KiB at most).
        """
        return parse_value((os.environ if environ is None else environ).get(ENV_VAR), ENV_VAR, base=base)

    @classmethod
    def from_env_overrides(cls, llm_args: Any, *, base: LivenessConfig | None = None) -> LivenessConfig:
        """Apply ``llm_args.env_overrides["TRTLLM_WORKER_LIVENESS"]`` (upstream main) to ``base``.

        Absent attribute, ``None`` or a mapping without the variable leave ``base`` unchanged; a
        non-mapping ``env_overrides`` or a non-string value is a ``ValueError``.
        """
        base = base if base is not None else cls()
        overrides = getattr(llm_args, ENV_OVERRIDES_FIELD, None)
        if overrides is None:
            return base
        source = f"llm_args.{ENV_OVERRIDES_FIELD}[{ENV_VAR!r}]"
        if not isinstance(overrides, Mapping):
            raise ValueError(f"llm_args.{ENV_OVERRIDES_FIELD} must be a mapping, got {type(overrides).__name__}")
        raw = overrides.get(ENV_VAR)
        if raw is None:
            return base
        if not isinstance(raw, str):
            raise ValueError(f"{source} must be a string, got {type(raw).__name__}")
        return base._apply_raw(raw, source)

    @classmethod
    def resolve(
        cls,
        llm_args: Any = None,
        environ: Mapping[str, str] | None = None,
        *,
        default_enabled: bool = False,
        base: LivenessConfig | None = None,
    ) -> LivenessConfig:
        """``base`` (else the defaults with ``enabled=default_enabled``), then the environment
        variable, then ``llm_args.env_overrides``; see the module docstring. Raises ``ValueError``."""
        start = base if base is not None else cls(enabled=default_enabled)
        config = cls.from_env(environ, base=start)
        return cls.from_env_overrides(llm_args, base=config)

    def _apply_raw(self, raw: str | None, source: str) -> LivenessConfig:
        if raw is None or not raw.strip():
            return self
        text = raw.strip()
        if not text.startswith("@"):
            return self._apply(_parse_lines([text], source, raw), source)
        path = text[1:].strip()
        lines = (line.split("#", 1)[0].strip() for line in _read_config_file(path, source).splitlines())
        return self._apply(_parse_lines(lines, f"{source} file {path!r}"), f"{source} file {path!r}")

    def to_env(self) -> str:
        """This configuration as a ``TRTLLM_WORKER_LIVENESS`` value (round-trips through ``from_env``)."""
        return ",".join(f"{key}={int(value) if isinstance(value, bool) else value}"
                        for key, value in dataclasses.asdict(self).items())

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


def parse_value(raw: str | None, source: str = ENV_VAR, *, base: LivenessConfig | None = None) -> LivenessConfig:
    """The configuration a ``TRTLLM_WORKER_LIVENESS`` value gives over ``base`` (default: the
    defaults): ``0``/``1``, ``key=value,...`` or ``@file``; ``None`` or blank leaves ``base``.

    What an engine start would do with the value, done beforehand: ``trtllm-liveness config
    check``, the autoload launcher and ``doctor`` call it. Raises ``ValueError`` naming ``source``,
    the key and the value (an unknown key lists the valid ones). Reads the file of ``@file``.
    """
    return (base if base is not None else LivenessConfig())._apply_raw(raw, source)


def format_setting(value: Any) -> str:
    """A setting's value as it is written in ``TRTLLM_WORKER_LIVENESS`` (``1``/``0`` for booleans,
    ``30`` rather than ``30.0``); the empty string stays empty."""
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def changed_settings(config: LivenessConfig) -> tuple[str, ...]:
    """The names of the settings of ``config`` that differ from the class's defaults, in field order."""
    return tuple(spec.name for spec in dataclasses.fields(config) if getattr(config, spec.name) != spec.default)


def _read_config_file(path: str, source: str) -> str:
    if not path:
        raise ValueError(f"{source}: '@' must be followed by a file path")
    # Checked before opening: open() on a FIFO would block until a writer appears.
    if os.path.exists(path) and not os.path.isfile(path):
        raise ValueError(f"{source}: {path!r} is not a regular file")
    try:
        with open(path, "rb") as handle:
            data = handle.read(_MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"{source}: cannot read the configuration file {path!r}: {exc.strerror or exc}") from None
    if len(data) > _MAX_FILE_BYTES:
        raise ValueError(f"{source}: the configuration file {path!r} is larger than {_MAX_FILE_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{source}: the configuration file {path!r} is not UTF-8 text") from None


def _parse_lines(lines: Iterable[str], source: str, raw: str | None = None) -> dict[str, Any]:
    """The settings of ``lines`` (stripped, comments removed): a bare true or false word sets
    ``enabled``, any other line is ``key=value[,key=value...]``; liveness is on unless one says
    otherwise. An error quotes ``raw`` (the variable's whole value), else the line."""
    settings: dict[str, Any] = {"enabled": True}
    for line in lines:
        if line.lower() in _TRUE | _FALSE:
            settings["enabled"] = line.lower() in _TRUE
        elif line:
            settings.update(_parse_items(line, source, line if raw is None else raw))
    return settings


def _parse_items(text: str, source: str, raw: str) -> dict[str, Any]:
    settings: dict[str, Any] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{source}={raw!r}: expected 0, 1, @file or key=value[,key=value...], got {item!r}")
        settings[key.strip()] = value.strip()
    return settings


def _coerce(key: str, raw: Any, kind: type, source: str) -> Any:
    if issubclass(kind, str):
        if not isinstance(raw, str):
            raise ValueError(f"{source}: {key} must be a string, got {raw!r}")
        value = raw.strip()
        if issubclass(kind, TextEnum) and value not in kind._value2member_map_:
            raise ValueError(f"{source}: {key} must be one of {', '.join(kind._value2member_map_)}, got {value!r}")
        return kind(value)
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
    if isinstance(value, TextEnum):  # one of its members: _coerce checked it
        return
    if key in ("hosts_bind", "hosts_advertise"):
        if not isinstance(value, str) or len(value) > 253 or any(c in value for c in "/ \t\0,=@[]"):
            raise ValueError(f"{source}: {key} must be a host name or address (or empty), got {value!r}")
        return
    if key in _RANGES:
        low, high = _RANGES[key]
        if not low <= value <= high:
            raise ValueError(f"{source}: {key} must be in [{low}, {high}], got {value!r}")
    if isinstance(value, str):
        if value and (not value.startswith("/") or "\0" in value or len(value) > 4096):
            raise ValueError(f"{source}: {key} must be an absolute path or empty (off), got {value!r}")
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{source}: {key} must be finite, got {value!r}")
    if key in ("exit_code", "exit_code_unrestartable"):
        if not 1 <= value <= 255:
            raise ValueError(f"{source}: {key} must be in [1, 255] (never 0 after a fatal error), got {value!r}")
        return
    if key in ("scan_interval_s", "identities_timeout_s", "quarantine_action_timeout_s") and value <= 0:
        raise ValueError(f"{source}: {key} must be > 0, got {value!r}")
    if value < 0:
        raise ValueError(f"{source}: {key} must be >= 0, got {value!r}")
