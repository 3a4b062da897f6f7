"""QuarantineSettings: the quarantine's settings as one typed record that can travel to another host.

A non-restartable failure of a rank on another host is quarantined on that host, by that host's
agent (:mod:`trtllm_liveness.multihost._agent`): the marker in its own ``quarantine_dir``, the
actions for its own node. The agent runs in a rank, which has no :class:`~trtllm_liveness.LivenessConfig`
of the engine's (an engine's settings may be given in code), so the proxy hands it these in the
hub's settings (:attr:`~trtllm_liveness.multihost.AgentSettings.quarantine`; the rank re-checks the
record it receives with :meth:`check`). The checks are the engine's own: the values must be
valid ``LivenessConfig`` settings. ``quarantine_dir`` travels as configured and is resolved on the
host that writes (:func:`~._marker.resolve_directory`: that host's environment and user).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .._config import LivenessConfig

__all__ = ["QuarantineSettings"]

_SWITCHES = ("quarantine_slurm_drain", "quarantine_k8s_cordon", "quarantine_k8s_taint")


@dataclass(frozen=True)
class QuarantineSettings:
    """The ``quarantine_*`` settings a failure uses (see :class:`~trtllm_liveness.LivenessConfig`):
    where the marker goes and which actions run, each bounded by ``quarantine_action_timeout_s``.
    Building one checks it (``ValueError`` naming the field)."""

    quarantine_dir: str
    quarantine_slurm_drain: bool
    quarantine_k8s_cordon: bool
    quarantine_k8s_taint: bool
    quarantine_hook: str
    quarantine_action_timeout_s: float

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise ``ValueError`` naming the first field of the wrong type or value."""
        for name in _SWITCHES:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"quarantine settings: {name} must be a bool, got {getattr(self, name)!r:.80}")
        timeout = self.quarantine_action_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise ValueError(f"quarantine settings: quarantine_action_timeout_s must be a number, got {timeout!r:.80}")
        try:  # the engine's own checks: paths absolute or empty, timeout > 0 and finite
            LivenessConfig(**self.to_spec())
        except ValueError as exc:
            raise ValueError(f"quarantine settings: {str(exc).removeprefix('LivenessConfig: ')}") from None

    @classmethod
    def from_config(cls, config: LivenessConfig) -> QuarantineSettings:
        """The quarantine settings of ``config``."""
        return cls(**{spec.name: getattr(config, spec.name) for spec in dataclasses.fields(cls)})

    def to_spec(self) -> dict[str, Any]:
        """Plain JSON types, as :class:`~trtllm_liveness.LivenessConfig` takes them."""
        return dataclasses.asdict(self)
