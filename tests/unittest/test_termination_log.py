"""The termination message: written bounded, from its own thread, never blocking, never raising."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import pytest

from trtllm_liveness._config import LivenessConfig
from trtllm_liveness._termination_log import (
    MESSAGE_LIMIT_BYTES,
    TERMINATION_LOG_DEFAULT,
    bounded_message,
    write_termination_message,
)

pytestmark = pytest.mark.timeout(30)


def _written(path: Path, message: str, **kwargs: bool) -> None:
    writer = write_termination_message(str(path), message, **kwargs)
    assert isinstance(writer, threading.Thread)
    writer.join(10)
    assert not writer.is_alive()


def test_an_explicit_path_is_created_and_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "termination-log"
    _written(path, "rank 1 (pid 42) killed by SIGKILL\n")
    assert path.read_text() == "rank 1 (pid 42) killed by SIGKILL\n"
    _written(path, "short\n")
    assert path.read_text() == "short\n"  # truncated first: no tail of the older message


def test_a_missing_file_is_not_created_where_creation_is_off(tmp_path: Path) -> None:
    # The rule for the default path: outside a container that asked for one, nothing is made.
    path = tmp_path / "termination-log"
    _written(path, "x", create=False)
    assert not path.exists()


def test_the_message_is_cut_to_the_kubernetes_limit_at_a_character_boundary(tmp_path: Path) -> None:
    path = tmp_path / "termination-log"
    message = "é" * MESSAGE_LIMIT_BYTES  # 2 bytes each
    _written(path, message)
    data = path.read_bytes()
    assert len(data) <= MESSAGE_LIMIT_BYTES
    assert data.decode("utf-8") == "é" * (MESSAGE_LIMIT_BYTES // 2)
    assert bounded_message("ok") == b"ok"


def test_a_fifo_without_reader_does_not_block_and_is_refused(tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with caplog.at_level(logging.WARNING, logger="trtllm_liveness._termination_log"):
        _written(fifo, "x")  # a blocking open would wait for a reader for good
    assert "not written" in caplog.text


def test_a_directory_or_bad_parent_is_logged_not_raised(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="trtllm_liveness._termination_log"):
        _written(tmp_path, "x")
        _written(tmp_path / "no" / "such" / "dir" / "log", "x")
    assert caplog.text.count("not written") == 2


def test_empty_path_is_off() -> None:
    assert write_termination_message("", "x") is None


def test_config_key_defaults_to_kubernetes_path_and_validates() -> None:
    assert LivenessConfig().termination_log == TERMINATION_LOG_DEFAULT
    env = "TRTLLM_WORKER_LIVENESS"
    assert LivenessConfig.from_env({env: "termination_log="}).termination_log == ""
    assert LivenessConfig.from_env({env: "termination_log=/run/x"}).termination_log == "/run/x"
    with pytest.raises(ValueError, match="absolute path"):
        LivenessConfig.from_env({env: "termination_log=relative"})
    with pytest.raises(ValueError, match="must be a string"):
        LivenessConfig(termination_log=3)  # type: ignore[arg-type]
