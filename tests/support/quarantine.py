"""Shared pieces of the quarantine tests: a configuration for a marker directory, and the fixture
giving each test a quarantine ledger of its own (the record is process-wide: one marker per
failure), the one of the test's own process ending."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trtllm_liveness import LivenessConfig
from trtllm_liveness.exit._process_ending import ProcessEnding, QuarantineLedger


def config_for(directory: Path, **options: object) -> LivenessConfig:
    """Liveness on, the marker in ``directory``, no device check unless ``options`` say so."""
    return LivenessConfig(**{"enabled": True, "quarantine_dir": str(directory), "quarantine_devices": "",
                             **options})  # type: ignore[arg-type]


def command_recorder(path: Path, log: str | Path) -> Path:
    """An executable at ``path`` that appends one line per call to ``log``: its arguments, ``|``,
    the reason a quarantine hook is given (``$TRTLLM_LIVENESS_QUARANTINE_REASON``). ``log`` is the
    path as the process that runs it sees it (in a test host, ``/run/...`` is that host's own). A
    stand-in for ``scontrol`` on ``PATH``, or a ``quarantine_hook``, that records what it was asked."""
    path.write_text(f'#!/bin/sh\nprintf \'%s|%s\\n\' "$*" "$TRTLLM_LIVENESS_QUARANTINE_REASON" >> {log}\n')
    os.chmod(path, 0o755)
    return path


def recorded_calls(log: str | Path) -> list[str]:
    """The lines :func:`command_recorder`'s executable wrote to ``log`` (none: no such file)."""
    try:
        return Path(log).read_text().splitlines()
    except FileNotFoundError:
        return []


@pytest.fixture(autouse=True)
def fresh_quarantine_state(fresh_process_ending: ProcessEnding) -> QuarantineLedger:
    """Autouse in every test module that imports it: the test's own (empty) quarantine ledger."""
    return fresh_process_ending.quarantine
