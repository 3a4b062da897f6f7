"""``scripts/setup.sh --demo``, what ``scripts/demo.sh`` runs: the demo's packages in ``.venv`` and
nothing else, no system package (on a Slurm node, apt's ``slurm-wlm`` or ``munge`` would start
packaged daemons).

Run on a copy of the checkout (its own ``.venv``), with recording stand-ins for the system's package
and service tools first on ``PATH``: the real ones are never reached. pip installs from the index
(its cache after this machine's own setup), as a user's first ``bash scripts/demo.sh`` does.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.waits import WAIT_SCALE

pytestmark = [pytest.mark.real_process, pytest.mark.slow, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[3]
# Every tool by which a setup could touch the machine's own state; each stand-in records its call.
SYSTEM_TOOLS = ("apt-get", "apt", "dpkg", "systemctl", "service", "invoke-rc.d", "sudo")
RECORDER = '#!/bin/sh\necho "$(basename "$0") $*" >>"{log}"\nexit 1\n'


def _checkout_copy(root: Path) -> Path:
    copy = root / "checkout"
    shutil.copytree(REPO, copy, ignore=shutil.ignore_patterns(".venv", ".git", "__pycache__", "*.pyc", "*.egg-info",
                                                              ".mypy_cache", ".ruff_cache", "build", "dist"))
    return copy


def _setup(copy: Path, root: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    stubs = root / "stubs"
    stubs.mkdir(exist_ok=True)
    calls = root / "system-calls.log"
    for tool in SYSTEM_TOOLS:
        path = stubs / tool
        path.write_text(RECORDER.format(log=calls))
        path.chmod(0o755)
    env = {key: value for key, value in os.environ.items() if key not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = f"{stubs}{os.pathsep}/usr/local/bin{os.pathsep}/usr/bin{os.pathsep}/bin"
    env["PYTHON"] = getattr(sys, "_base_executable", sys.executable)  # a Python outside any venv
    done = subprocess.run(["bash", str(copy / "scripts" / "setup.sh"), *args], capture_output=True, text=True,
                          env=env, timeout=420 * WAIT_SCALE, start_new_session=True, cwd=root)
    return done, calls.read_text().splitlines() if calls.exists() else []


def _imports(copy: Path, module: str) -> bool:
    python = copy / ".venv" / "bin" / "python"
    return subprocess.run([str(python), "-c", f"import {module}"], capture_output=True, timeout=60 * WAIT_SCALE,
                          cwd=copy.parent, check=False).returncode == 0


def test_the_demo_setup_installs_the_demo_and_nothing_else(tmp_path: Path) -> None:
    copy = _checkout_copy(tmp_path)
    done, system_calls = _setup(copy, tmp_path, "--demo")
    assert done.returncode == 0, done.stderr[-3000:]
    assert system_calls == [], f"the demo's setup ran system tools: {system_calls}"
    for module in ("trtllm_liveness.demo._demo_run", "mpi4py", "zmq", "tests.support.testhosts"):
        assert _imports(copy, module), f"{module} is not importable after setup.sh --demo"
    assert (copy / ".venv" / "bin" / "trtllm-liveness").exists()
    assert (copy / ".venv" / "bin" / "mpirun").exists()
    # What only the tests need stays out: the test, metrics, dynamo and dev extras, Dynamo's wheel.
    for module in ("pytest", "prometheus_client", "dynamo", "mypy"):
        assert not _imports(copy, module), f"setup.sh --demo installed {module}, which the demo does not need"


def test_a_bad_argument_is_refused_before_anything_is_made(tmp_path: Path) -> None:
    copy = _checkout_copy(tmp_path)
    done, system_calls = _setup(copy, tmp_path, "--minimal")
    assert done.returncode == 2, done
    assert "unknown argument '--minimal'" in done.stderr and "[--demo]" in done.stderr
    assert system_calls == [] and not (copy / ".venv").exists()
