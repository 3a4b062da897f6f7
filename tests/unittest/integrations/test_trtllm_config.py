"""LivenessConfig: environment variable and llm_args parsing, strict validation."""

from __future__ import annotations

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


def test_llm_args_overrides_env() -> None:
    args = SimpleNamespace(worker_liveness={"d_state_timeout_s": 2})
    config = LivenessConfig.resolve(args, {ENV_VAR: "0"})
    assert config.enabled and config.d_state_timeout_s == 2.0
    assert LivenessConfig.resolve(SimpleNamespace(worker_liveness=False), {ENV_VAR: "1"}).enabled is False
    assert LivenessConfig.resolve(SimpleNamespace(), {}, default_enabled=True).enabled is True
    assert LivenessConfig.resolve(None, {}).enabled is False


@pytest.mark.parametrize("value", ["yes", 3, [1], {"nope": 1}, {"d_state_timeout_s": True}])
def test_bad_llm_args_raise(value: object) -> None:
    with pytest.raises(ValueError, match="worker_liveness"):
        LivenessConfig.from_llm_args(SimpleNamespace(worker_liveness=value))


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
    args = SimpleNamespace(worker_liveness={"shutdown_grace_s": 0.5})
    assert LivenessConfig.from_llm_args(args, base=base).shutdown_grace_s == 0.5
