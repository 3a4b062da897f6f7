"""The wheel, outside the checkout: built from the tracked sources, metadata checked, installed in a
fresh virtualenv, and used there as a user would (no ``PYTHONPATH``, working directory elsewhere).

What a TensorRT-LLM container gets is ``pip install trtllm-liveness`` without extras: the package
has no dependencies (the container's mpi4py and pyzmq serve). The demo needs the ``mpi`` extra
(Open MPI's wheel, mpi4py, pyzmq), installed here on top for its leg only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from collections.abc import Iterator
from pathlib import Path

import pytest

import trtllm_liveness
from tests.support.facilities import needs
from tests.support.process_tracker import ProcessTracker
from tests.support.waits import WAIT_SCALE

pytestmark = [pytest.mark.real_process, pytest.mark.slow, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[3]
# What the wheel is built from: the files a source distribution holds (no tests, no .venv).
SOURCES = ("pyproject.toml", "README.md", "trtllm_liveness")


def _run(argv: list[str], *, cwd: Path, timeout: float = 300, env: dict[str, str] | None = None,
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout * WAIT_SCALE,
                          env=env, start_new_session=True)


def _clean_env(fresh: Path) -> dict[str, str]:
    # The user's view: the fresh venv's bin first, nothing of this checkout on any path.
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTHONPATH", "VIRTUAL_ENV", "TRTLLM_WORKER_LIVENESS", "PYTHONSTARTUP")}
    env["PATH"] = f"{fresh / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = tmp_path_factory.mktemp("sdist")
    for name in SOURCES:
        origin = REPO / name
        if origin.is_dir():
            shutil.copytree(origin, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(origin, source / name)
    out = tmp_path_factory.mktemp("dist")
    built = _run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), "."], cwd=source)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    wheels = sorted(out.glob("trtllm_liveness-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("fresh")
    venv.EnvBuilder(with_pip=True, clear=True).create(root / "venv")
    env = root / "venv"
    installed = _run([str(env / "bin" / "python"), "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                      str(wheel)], cwd=root, env=_clean_env(env))
    assert installed.returncode == 0, installed.stderr[-3000:]
    yield env


def test_wheel_metadata_passes_twine_check(wheel: Path) -> None:
    checked = _run([sys.executable, "-m", "twine", "check", "--strict", str(wheel)], cwd=wheel.parent)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert wheel.name.startswith(f"trtllm_liveness-{trtllm_liveness.__version__}-")


def test_the_wheel_holds_the_package_data(wheel: Path) -> None:
    import zipfile

    names = set(zipfile.ZipFile(wheel).namelist())
    assert "trtllm_liveness/py.typed" in names
    # The autoload launcher's start-up hook: without it the launcher is silently inert.
    assert "trtllm_liveness/integrations/_autoload_site/sitecustomize.py" in names
    assert not any(name.startswith("tests/") for name in names)


def test_installed_cli_answers_outside_the_checkout(fresh: Path, procs: ProcessTracker) -> None:
    cwd = fresh.parent
    env = _clean_env(fresh)
    cli = str(fresh / "bin" / "trtllm-liveness")
    where = _run([str(fresh / "bin" / "python"), "-c", "import trtllm_liveness; print(trtllm_liveness.__file__)"],
                 cwd=cwd, env=env)
    assert where.stdout.strip().startswith(str(fresh)), where  # the wheel's copy, not the checkout's
    version = _run([cli, "--version"], cwd=cwd, env=env)
    assert version.returncode == 0 and trtllm_liveness.__version__ in version.stdout, version
    doctor = _run([cli, "doctor"], cwd=cwd, env=env)
    assert doctor.returncode == 4, doctor  # documented: 4 = tensorrt_llm not installed
    sleeper = procs.sleeper()
    scanned = _run([cli, "scan", str(sleeper.pid), "--window", "0"], cwd=cwd, env=env)
    assert scanned.returncode == 0, scanned


@needs("mpi")
def test_installed_demo_runs_with_the_mpi_extra(fresh: Path, wheel: Path) -> None:
    env = _clean_env(fresh)
    # The demo's extra, from the index (pip's cache after setup): what a user types for the demo.
    extra = _run([str(fresh / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                  f"{wheel}[mpi]"], cwd=fresh.parent, env=env)
    assert extra.returncode == 0, extra.stderr[-3000:]
    demo = _run([str(fresh / "bin" / "trtllm-liveness"), "demo", "--json"], cwd=fresh.parent, env=env, timeout=180)
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
