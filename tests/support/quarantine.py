"""Shared pieces of the quarantine tests: a configuration for a marker directory, and the fixture
giving each test a quarantine ledger of its own (the record is process-wide: one marker per
failure), the one of the test's own process ending."""

from __future__ import annotations

from pathlib import Path

import pytest

from trtllm_liveness import LivenessConfig
from trtllm_liveness.exit._process_ending import ProcessEnding, QuarantineLedger


def config_for(directory: Path, **options: object) -> LivenessConfig:
    """Liveness on, the marker in ``directory``, no device check unless ``options`` say so."""
    return LivenessConfig(**{"enabled": True, "quarantine_dir": str(directory), "quarantine_devices": "",
                             **options})  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def fresh_quarantine_state(fresh_process_ending: ProcessEnding) -> QuarantineLedger:
    """Autouse in every test module that imports it: the test's own (empty) quarantine ledger."""
    return fresh_process_ending.quarantine
