"""Running a command as another user (uid 65534) wherever the checkout lives: a Python that user
can run, and a copy of the package that user can read (a checkout under a 0700 directory is
unreachable for anyone else)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import trtllm_liveness

RUN_TIMEOUT = 60

OTHER_USER = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def reachable_by_others(path: str) -> bool:
    """Whether every directory from / down to ``path`` lets any user through (o+x)."""
    parts = Path(path).resolve().parts
    return all(os.stat(os.path.join(*parts[:i])).st_mode & 0o001 for i in range(1, len(parts) + 1))


def interpreter_for_others() -> tuple[str | None, list[str]]:
    """A Python (3.10+) that uid 65534 can run with a readable standard library, and what was tried."""
    tried = []
    for candidate in dict.fromkeys([os.path.realpath(sys.executable), getattr(sys, "_base_executable", ""),
                                    shutil.which("python3") or "", "/usr/bin/python3"]):
        if not candidate:
            continue
        tried.append(candidate)
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            probe = subprocess.run([*OTHER_USER, candidate, "-E", "-s", "-c",
                                    "import argparse, json, sys; print(sys.version_info >= (3, 10))"],
                                   capture_output=True, text=True, timeout=RUN_TIMEOUT, check=False)
            if probe.returncode == 0 and probe.stdout.strip() == "True":
                return candidate, tried
    return None, tried


@contextlib.contextmanager
def package_readable_by_others() -> Iterator[Path]:
    """A copy of this package in a fresh directory that every user can read, wherever the
    checkout lives (a checkout under a 0700 directory is unreachable for another user); removed
    at the end."""
    base = next((d for d in (tempfile.gettempdir(), "/tmp", "/var/tmp", "/dev/shm")
                 if os.path.isdir(d) and reachable_by_others(d)), None)
    if base is None:
        pytest.skip("no temporary directory that another user can reach")
    root = Path(tempfile.mkdtemp(prefix="trtllm-other-user-", dir=base))
    try:
        shutil.copytree(Path(trtllm_liveness.__file__).parent, root / "trtllm_liveness",
                        ignore=shutil.ignore_patterns("__pycache__"))
        for directory, _dirs, files in os.walk(root):
            os.chmod(directory, 0o755)
            for name in files:
                os.chmod(os.path.join(directory, name), 0o644)
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)
