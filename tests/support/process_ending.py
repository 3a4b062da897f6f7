"""Each test as a process of its own, as far as the process's ending goes: the fixture installs a
fresh :class:`~trtllm_liveness.exit.ProcessEnding` (exit decision, outcome and quarantine ledgers,
termination-message claim, owned threads, cleanups) for the test and restores the previous one
after it. No atexit hook is registered for it: nothing of a test's ending runs at pytest's exit."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from trtllm_liveness.exit import _process_ending
from trtllm_liveness.exit._process_ending import ProcessEnding


@pytest.fixture(autouse=True)
def fresh_process_ending(monkeypatch: pytest.MonkeyPatch) -> Iterator[ProcessEnding]:
    """Autouse everywhere (tests/conftest.py imports it). The test's own threads of the ending
    (quarantine, records) are joined, each until its deadline, before the next test."""
    ending = ProcessEnding()
    monkeypatch.setattr(_process_ending, "_owner", ending)
    yield ending
    ending.threads.join()
