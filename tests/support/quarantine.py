"""Shared pieces of the quarantine tests: a configuration for a marker directory, and the fixture
that forgets what this process recorded (the record is process-wide: one marker per failure)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from trtllm_liveness import LivenessConfig
from trtllm_liveness.quarantine._host_policy import _reset_for_tests


def config_for(directory: Path, **options: object) -> LivenessConfig:
    """Liveness on, the marker in ``directory``, no device check unless ``options`` say so."""
    return LivenessConfig(**{"enabled": True, "quarantine_dir": str(directory), "quarantine_devices": "",
                             **options})  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def fresh_quarantine_state() -> Iterator[None]:
    """Autouse in every test module that imports it."""
    _reset_for_tests()
    yield
    _reset_for_tests()
