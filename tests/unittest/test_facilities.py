"""The test session's required-facility switch (TRTLLM_LIVENESS_REQUIRE) and temp-dir leak check.

Each case runs a small test file in a child pytest with this repository's conftest as a plugin and
its own TMPDIR (so the child's session directory and leak check stay apart from this session's).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.children import REPO_ROOT
from tests.support.process_tracker import ProcessTracker
from tests.support.waits import WAIT_SCALE

pytestmark = [pytest.mark.timeout(180)]

# "freezer" is made unavailable in the child, whatever this machine has.
CASES = '''
import os
import tempfile

import pytest

from tests.support import facilities
from tests.support.facilities import needs, require_or_skip

facilities.FACILITIES["freezer"] = lambda: "pretend: no freezer here"


@needs("freezer")
def test_marker() -> None:
    pass


@pytest.mark.freezer
def test_named_marker() -> None:
    pass


def test_helper() -> None:
    require_or_skip("freezer", "pretend: no freezer here")


@needs("fuse")
def test_other_reason_skip_with_a_facility_marker() -> None:
    pytest.skip("some other reason")


def test_unmarked_skip() -> None:
    pytest.skip("nothing to do with facilities")


def test_leaks_a_directory() -> None:
    if os.environ.get("LEAK"):
        tempfile.mkdtemp(prefix="trtllm-ref-")
'''


def _run(procs: ProcessTracker, tmp_path: Path, require: str | None, *, leak: bool = False) -> tuple[int, str]:
    (tmp_path / "test_cases.py").write_text(CASES)
    env = {k: v for k, v in os.environ.items() if k not in ("TRTLLM_LIVENESS_REQUIRE", "PYTEST_ADDOPTS")}
    env["TMPDIR"] = str(tmp_path)
    env["PYTHONPATH"] = str(REPO_ROOT)
    if require is not None:
        env["TRTLLM_LIVENESS_REQUIRE"] = require
    if leak:
        env["LEAK"] = "1"
    argv = [sys.executable, "-m", "pytest", "-q", "-rA", "-W", "ignore::pytest.PytestUnknownMarkWarning",
            "-p", "no:cacheprovider", "-p", "tests.conftest",
            "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path / "test_cases.py")]
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    procs.popens.append(proc)
    procs.track(proc.pid)
    out, _ = proc.communicate(timeout=120 * WAIT_SCALE)
    return proc.returncode, out.decode()


def test_without_the_switch_a_missing_facility_skips(procs: ProcessTracker, tmp_path: Path) -> None:
    status, out = _run(procs, tmp_path, None)
    assert status == 0, out
    assert "5 skipped" in out and "1 passed" in out, out
    assert "[freezer] pretend: no freezer here" in out


def test_a_required_facility_turns_each_of_its_skips_into_a_failure(procs: ProcessTracker, tmp_path: Path) -> None:
    status, out = _run(procs, tmp_path, "freezer,fuse")
    assert status == 1, out
    summary = [line for line in out.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    # A failure at setup (the marker's probe) is pytest's "error"; in the body a "failure".
    for name in ("test_marker", "test_named_marker", "test_helper", "test_other_reason_skip_with_a_facility_marker"):
        assert any(f"::{name} " in line for line in summary), out
    assert "2 failed, 1 passed, 1 skipped" in out and "2 errors" in out, out
    assert "required (TRTLLM_LIVENESS_REQUIRE) but unavailable: pretend: no freezer here" in out
    assert "skipped although TRTLLM_LIVENESS_REQUIRE requires fuse: some other reason" in out


def test_all_requires_every_facility(procs: ProcessTracker, tmp_path: Path) -> None:
    status, out = _run(procs, tmp_path, "all")
    assert status == 1 and "2 failed" in out and "2 errors" in out, out


def test_an_unknown_facility_name_is_an_error_at_session_start(procs: ProcessTracker, tmp_path: Path) -> None:
    status, out = _run(procs, tmp_path, "freezer,no-such-thing")
    assert status == 4, out  # pytest's usage error: nothing ran
    assert "unknown facilities no-such-thing" in out and "known: all," in out
    assert "passed" not in out


def test_a_leaked_temp_directory_fails_the_session_and_is_removed(procs: ProcessTracker, tmp_path: Path) -> None:
    status, out = _run(procs, tmp_path, None, leak=True)
    assert status == 1, out
    assert "LEAKED by tests" in out and "trtllm-ref-" in out and "left behind (removed)" in out
    # The child's session directory (and the leaked entry in it) is gone; nothing else was made.
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("trtllm-")) == []
