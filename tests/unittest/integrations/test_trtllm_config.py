"""LivenessConfig: the environment variable (inline or a file), env_overrides, strict validation."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from trtllm_liveness._config import ENV_VAR, LivenessConfig

pytestmark = [pytest.mark.timeout(30)]


@pytest.mark.parametrize(("raw", "enabled"), [("1", True), ("on", True), ("0", False), ("false", False), ("", False)])
def test_env_switch(raw: str, enabled: bool) -> None:
    assert LivenessConfig.from_env({ENV_VAR: raw}).enabled is enabled


def test_env_keys_enable_and_set_values() -> None:
    config = LivenessConfig.from_env({ENV_VAR: "d_state_timeout_s=5, scan_interval_s=0.25,exit_on_fatal=1"})
    assert config.enabled and config.d_state_timeout_s == 5.0 and config.scan_interval_s == 0.25
    assert config.exit_on_fatal is True
    assert LivenessConfig.from_env({ENV_VAR: "enabled=0,d_state_timeout_s=5"}).enabled is False


@pytest.mark.parametrize(
    ("raw", "key"),
    [("bogus=1", "bogus"), ("d_state_timeout_s=abc", "d_state_timeout_s"), ("scan_interval_s=0", "scan_interval_s"),
     ("shutdown_kill_s=-1", "shutdown_kill_s"), ("exit_code=300", "exit_code"),
     ("exit_on_fatal=maybe", "exit_on_fatal"),
     ("d_state_timeout_s=nan", "d_state_timeout_s"), ("garbage", "garbage")],
)
def test_bad_env_values_name_the_key(raw: str, key: str) -> None:
    with pytest.raises(ValueError, match=key):
        LivenessConfig.from_env({ENV_VAR: raw})


def test_llm_args_worker_liveness_is_not_read() -> None:
    # Upstream's llm_args is strict (extra="forbid"): a field of ours could never be set, and the
    # extension must not pretend it reads one.
    args = SimpleNamespace(worker_liveness={"d_state_timeout_s": 2})
    config = LivenessConfig.resolve(args, {ENV_VAR: "0"})
    assert config.enabled is False and config.d_state_timeout_s == LivenessConfig().d_state_timeout_s
    assert not hasattr(LivenessConfig, "from_llm_args")


def test_env_overrides_of_upstream_main_win_over_the_environment() -> None:
    args = SimpleNamespace(env_overrides={ENV_VAR: "d_state_timeout_s=2", "OTHER": "x"})
    config = LivenessConfig.resolve(args, {ENV_VAR: "0"})
    assert config.enabled and config.d_state_timeout_s == 2.0
    assert LivenessConfig.resolve(SimpleNamespace(env_overrides={ENV_VAR: "0"}), {ENV_VAR: "1"}).enabled is False
    assert LivenessConfig.resolve(SimpleNamespace(env_overrides={}), {ENV_VAR: "1"}).enabled is True
    assert LivenessConfig.resolve(SimpleNamespace(env_overrides=None), {}, default_enabled=True).enabled is True
    assert LivenessConfig.resolve(None, {}).enabled is False


@pytest.mark.parametrize("overrides", ["yes", [1], {ENV_VAR: 3}, {ENV_VAR: "bogus=1"}])
def test_bad_env_overrides_raise(overrides: object) -> None:
    with pytest.raises(ValueError, match="env_overrides"):
        LivenessConfig.from_env_overrides(SimpleNamespace(env_overrides=overrides))


def test_class_config_is_the_base_the_environment_refines() -> None:
    base = LivenessConfig(enabled=True, d_state_timeout_s=4, exit_code=9)
    config = LivenessConfig.resolve(None, {ENV_VAR: "exit_code=3"}, base=base)
    assert (config.enabled, config.d_state_timeout_s, config.exit_code) == (True, 4.0, 3)
    assert LivenessConfig.resolve(None, {}, base=base) == base


def test_env_names_a_config_file(tmp_path: Path) -> None:
    conf = tmp_path / "liveness.conf"
    conf.write_text("# liveness for this server\nd_state_timeout_s = 5\n\nexit_on_fatal=1, exit_code=4  # why\n")
    config = LivenessConfig.from_env({ENV_VAR: f"@{conf}"})
    assert config.enabled and config.d_state_timeout_s == 5.0 and config.exit_on_fatal and config.exit_code == 4
    off = tmp_path / "off.conf"
    off.write_text("0\n")
    assert LivenessConfig.from_env({ENV_VAR: f"@{off}"}).enabled is False
    empty = tmp_path / "empty.conf"
    empty.write_text("# nothing\n")
    assert LivenessConfig.from_env({ENV_VAR: f"@{empty}"}).enabled is True


def test_bad_config_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read"):
        LivenessConfig.from_env({ENV_VAR: f"@{tmp_path / 'missing.conf'}"})
    with pytest.raises(ValueError, match="not a regular file"):
        LivenessConfig.from_env({ENV_VAR: f"@{tmp_path}"})
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):  # and never blocks on open()
        LivenessConfig.from_env({ENV_VAR: f"@{fifo}"})
    bad = tmp_path / "bad.conf"
    bad.write_text("scan_interval_s=fast\n")
    with pytest.raises(ValueError, match=r"bad\.conf.*scan_interval_s"):
        LivenessConfig.from_env({ENV_VAR: f"@{bad}"})
    big = tmp_path / "big.conf"
    big.write_text("#" * (65 << 10))
    with pytest.raises(ValueError, match="larger than"):
        LivenessConfig.from_env({ENV_VAR: f"@{big}"})
    with pytest.raises(ValueError, match="file path"):
        LivenessConfig.from_env({ENV_VAR: "@"})


def test_startup_d_state_timeout_is_a_key() -> None:
    config = LivenessConfig.from_env({ENV_VAR: "startup_d_state_timeout_s=600"})
    assert config.startup_d_state_timeout_s == 600.0 and LivenessConfig().startup_d_state_timeout_s == 0.0
    with pytest.raises(ValueError, match="startup_d_state_timeout_s"):
        LivenessConfig.from_env({ENV_VAR: "startup_d_state_timeout_s=-1"})


def test_env_round_trip() -> None:
    config = LivenessConfig(enabled=True, d_state_timeout_s=7.5, exit_code=3)
    assert LivenessConfig.from_env({ENV_VAR: config.to_env()}) == config


def test_exit_options_parse_and_exit_code_zero_is_refused() -> None:
    config = LivenessConfig.from_env({ENV_VAR: "exit_on_fatal=1,exit_timeout_s=7.5,exit_delay_s=0"})
    assert (config.exit_on_fatal, config.exit_timeout_s, config.exit_delay_s) == (True, 7.5, 0.0)
    for raw in ("exit_code=0", "exit_timeout_s=-1"):
        with pytest.raises(ValueError, match=raw.split("=")[0]):
            LivenessConfig.from_env({ENV_VAR: raw})


def test_base_built_with_int_values_still_accepts_fractions() -> None:
    # The field's type decides, not the base's current value (10 is an int here).
    base = LivenessConfig(enabled=True, shutdown_grace_s=10)
    assert LivenessConfig.from_env({ENV_VAR: "shutdown_grace_s=2.5"}, base=base).shutdown_grace_s == 2.5
    args = SimpleNamespace(env_overrides={ENV_VAR: "shutdown_grace_s=0.5"})
    assert LivenessConfig.from_env_overrides(args, base=base).shutdown_grace_s == 0.5


def test_stall_action_and_hosts_are_enums_written_as_their_values() -> None:
    """The same accepted values and syntax; in code an enum member (its string also accepted), in
    the variable, JSON and the settings' display the value itself."""
    import json

    from trtllm_liveness._config import HostsMode, StallAction, format_setting

    config = LivenessConfig.from_env({ENV_VAR: "stall_action= fatal ,hosts=off"})
    assert config.stall_action is StallAction.FATAL and config.hosts is HostsMode.OFF
    in_code = LivenessConfig(stall_action="fatal", hosts="off")  # type: ignore[arg-type]
    assert in_code == LivenessConfig(stall_action=StallAction.FATAL, hosts=HostsMode.OFF)
    assert in_code.stall_action is StallAction.FATAL
    assert "stall_action=fatal" in config.to_env() and "hosts=off" in config.to_env()
    assert LivenessConfig.from_env({ENV_VAR: config.to_env()}) == config
    assert format_setting(config.hosts) == "off" and json.dumps({"hosts": config.hosts}) == '{"hosts": "off"}'
    for raw, message in (("stall_action=kill", "stall_action must be one of report, fatal, got 'kill'"),
                         ("hosts=maybe", "hosts must be one of auto, on, off, got 'maybe'")):
        with pytest.raises(ValueError, match=message):
            LivenessConfig.from_env({ENV_VAR: raw})
    with pytest.raises(ValueError, match="LivenessConfig: hosts must be one of auto, on, off, got 'x'"):
        LivenessConfig(hosts="x")  # type: ignore[arg-type]
