"""The termination message: written bounded, from its own thread, never blocking, never raising."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import pytest

from trtllm_liveness._config import LivenessConfig
from trtllm_liveness.exit._termination_log import (
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


def test_an_explicit_path_is_created_and_overwritten(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "termination-log"
    path.write_text("an older container's longer message\n")
    _written(path, "rank 1 (pid 42) killed by SIGKILL\n")
    assert path.read_text() == "rank 1 (pid 42) killed by SIGKILL\n"  # truncated first: no older tail


def test_only_the_first_fatal_error_of_the_process_is_written(tmp_path: Path) -> None:
    # Two engines failing one after the other: the first reason stays (they would race otherwise).
    path = tmp_path / "termination-log"
    _written(path, "first\n")
    assert write_termination_message(str(path), "second\n") is None
    assert path.read_text() == "first\n"


def test_a_symlink_at_the_path_is_not_followed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep me\n")
    link = tmp_path / "termination-log"
    link.symlink_to(victim)
    with caplog.at_level(logging.WARNING, logger="trtllm_liveness.exit._termination_log"):
        _written(link, "x")
    assert victim.read_text() == "keep me\n"
    assert "not written" in caplog.text


def test_a_missing_file_is_not_created_where_creation_is_off(tmp_path: Path) -> None:
    # The rule for the default path: outside a container that asked for one, nothing is made
    # (and no thread is started for it).
    path = tmp_path / "termination-log"
    assert write_termination_message(str(path), "x", create=False) is None
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
    with caplog.at_level(logging.WARNING, logger="trtllm_liveness.exit._termination_log"):
        _written(fifo, "x")  # a blocking open would wait for a reader for good
    assert "not written" in caplog.text


@pytest.mark.parametrize("where", ["directory", "missing parent"])
def test_a_directory_or_bad_parent_is_logged_not_raised(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                        where: str) -> None:
    path = tmp_path if where == "directory" else tmp_path / "no" / "such" / "dir" / "log"
    with caplog.at_level(logging.WARNING, logger="trtllm_liveness.exit._termination_log"):
        _written(path, "x")
    assert caplog.text.count("not written") == 1


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
