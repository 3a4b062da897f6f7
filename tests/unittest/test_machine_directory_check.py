"""The session's guard on the machine's quarantine marker directory (``tests/support/leak_checks.py``,
wired in ``tests/conftest.py``): it must see every kind of change, and the session must point the
package's default at a directory of its own. Every path here is the test's own (``tmp_path``):
nothing under ``/run`` is made."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.leak_checks import MachineDirectoryCheck
from trtllm_liveness.quarantine._marker import DEFAULT_QUARANTINE_DIR, QUARANTINE_DIR_VAR, resolve_directory


def test_an_untouched_directory_reads_unchanged_whether_it_exists_or_not(tmp_path: Path) -> None:
    absent = MachineDirectoryCheck(str(tmp_path / "absent"))
    assert absent.before is None and absent.changed() == ""
    (tmp_path / "there").mkdir()
    (tmp_path / "there" / "quarantine.json").write_text("{}")
    there = MachineDirectoryCheck(str(tmp_path / "there"))
    os.listdir(tmp_path / "there")  # reading changes nothing the check compares
    assert there.changed() == ""


def test_every_change_is_reported(tmp_path: Path) -> None:
    directory = tmp_path / "machine-q"
    check = MachineDirectoryCheck(str(directory))
    directory.mkdir()
    (directory / "quarantine.json").write_text("{}")
    assert check.changed() == f"{directory} was created (now holding ['quarantine.json'])"

    check = MachineDirectoryCheck(str(directory))
    marker = directory / "quarantine.json"
    replacement = directory / ".tmp"
    replacement.write_text('{"version": 1}')
    replacement.rename(marker)  # what write_marker does: a new file renamed over the old one
    assert check.changed() == f"{directory} changed: rewritten ['quarantine.json']"

    check = MachineDirectoryCheck(str(directory))
    (directory / "quarantine.json.lock").write_text("")
    marker.unlink()
    assert check.changed() == f"{directory} changed: new ['quarantine.json.lock']; gone ['quarantine.json']"

    check = MachineDirectoryCheck(str(directory))
    for entry in directory.iterdir():
        entry.unlink()
    directory.rmdir()
    assert check.changed() == f"{directory} was removed"


def test_the_session_watches_the_machines_directory_and_points_the_default_at_its_own() -> None:
    from tests.conftest import _MACHINE_QUARANTINE

    assert [check.path for check in _MACHINE_QUARANTINE] == [DEFAULT_QUARANTINE_DIR]
    assert _MACHINE_QUARANTINE[0].changed() == ""  # so far in this session
    session = os.environ.get(QUARANTINE_DIR_VAR, "")
    assert session.startswith(os.environ["TMPDIR"] + os.sep), session
    assert resolve_directory(DEFAULT_QUARANTINE_DIR) == session
    # ...and every child inherits it: a child resolves the default to the same directory.
    code = ("from trtllm_liveness.quarantine._marker import DEFAULT_QUARANTINE_DIR, resolve_directory; "
            "print(resolve_directory(DEFAULT_QUARANTINE_DIR))")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert child.returncode == 0 and child.stdout.strip() == session, child
