"""``trtllm-liveness config check [VALUE]``, the installed console script: the parser an engine runs
at start-up, run beforehand; 0 and the effective settings when valid, 1 naming the bad key when not."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.facilities import needs
from tests.support.waits import WAIT_SCALE
from trtllm_liveness import LivenessConfig
from trtllm_liveness._config import ENV_VAR

pytestmark = [pytest.mark.real_process, pytest.mark.timeout(60), needs("console-script")]

CLI = Path(sys.executable).parent / "trtllm-liveness"


def config_check(*args: str, value: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {key: item for key, item in os.environ.items() if key != ENV_VAR}
    if value is not None:
        env[ENV_VAR] = value
    return subprocess.run([str(CLI), "config", "check", *args], capture_output=True, text=True,
                          timeout=30 * WAIT_SCALE, start_new_session=True, env=env)


def settings_of(stdout: str) -> dict[str, tuple[bool, str]]:
    """The table's rows: name -> (marked as set by the value, value as printed)."""
    rows = {}
    for line in stdout.splitlines()[2:]:
        mark, name, value = line[0], *line[2:].split(None, 1)
        rows[name] = (mark == "*", value.strip())
    return rows


def test_a_valid_value_prints_every_setting_and_marks_what_it_sets() -> None:
    result = config_check("exit_on_fatal=1,stall_timeout_s=120,quarantine_dir=/var/q")
    assert result.returncode == 0, result
    assert result.stdout.startswith("VALID: ") and "liveness on" in result.stdout.splitlines()[0]
    rows = settings_of(result.stdout)
    assert list(rows) == [spec.name for spec in dataclasses.fields(LivenessConfig)]
    assert {name for name, (marked, _) in rows.items() if marked} == {"enabled", "exit_on_fatal", "stall_timeout_s",
                                                                       "quarantine_dir"}
    assert rows["stall_timeout_s"] == (True, "120") and rows["quarantine_dir"] == (True, "/var/q")
    assert rows["d_state_timeout_s"] == (False, "30") and rows["quarantine_hook"] == (False, "(empty)")


def test_without_an_argument_the_environments_value_is_checked() -> None:
    result = config_check("--json", value="d_state_timeout_s=5,enabled=0")
    assert result.returncode == 0, result
    document = json.loads(result.stdout)
    assert document["valid"] is True and document["enabled"] is False
    assert document["changed"] == ["d_state_timeout_s"]
    assert document["settings"] == dataclasses.asdict(LivenessConfig(d_state_timeout_s=5))
    unset = config_check()
    assert unset.returncode == 0 and unset.stdout.startswith(f"VALID: {ENV_VAR} is unset: liveness off"), unset


@pytest.mark.parametrize(("value", "named"), [
    ("bogus=3", ["unknown key 'bogus'", "valid keys are"]),
    ("exit_code=0", ["exit_code", "got 0"]),
    ("stall_action=kill", ["stall_action", "'kill'"]),
    ("d_state_timeout_s=soon", ["d_state_timeout_s", "'soon'"]),
    ("@/nonexistent/liveness.conf", ["/nonexistent/liveness.conf"]),
])
def test_an_invalid_value_exits_1_naming_the_key_and_value(value: str, named: list[str]) -> None:
    given = config_check(value)
    assert given.returncode == 1, given
    first = given.stdout.splitlines()[0]
    assert first.startswith("INVALID: ") and all(text in first for text in named), first
    from_env = config_check("--json", value=value)
    assert from_env.returncode == 1, from_env
    document = json.loads(from_env.stdout)
    assert document["valid"] is False and document["error"].startswith(f"{ENV_VAR}: ")
    assert all(text in document["error"] for text in named), document


def test_a_settings_file_is_read_as_the_engine_reads_it(tmp_path: Path) -> None:
    path = tmp_path / "liveness.conf"
    path.write_text("# server settings\nexit_on_fatal=1\nstall_timeout_s=120\n")
    result = config_check("--json", value=f"@{path}")
    assert result.returncode == 0, result
    assert json.loads(result.stdout)["changed"] == ["enabled", "stall_timeout_s", "exit_on_fatal"]
    path.write_text("exit_on_fatal=maybe\n")
    bad = config_check(f"@{path}")
    assert bad.returncode == 1 and "exit_on_fatal" in bad.stdout and str(path) in bad.stdout, bad


def test_bad_arguments_are_status_2() -> None:
    assert config_check("a=1", "b=2").returncode == 2
    assert subprocess.run([str(CLI), "config", "frobnicate"], capture_output=True, timeout=30 * WAIT_SCALE,
                          start_new_session=True).returncode == 2
