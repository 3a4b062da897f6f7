"""docs/Dockerfile's steps, without a container runtime: the wheel built as its builder stage builds
it (from the files that stage copies), then the one install script its final stage runs
(docs/image-install.sh), in a fresh virtualenv outside the checkout with the Dockerfile's default
extras; then ``trtllm-liveness doctor`` there as in the image, which here has no TensorRT-LLM
(doctor's documented status for that: 4), and the autoload the script installed.

The Dockerfile is read, not trusted: the test takes the builder's ``COPY`` sources, its wheel command,
the final stage's script and the extras' default from it, so the two cannot drift apart.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import venv
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.waits import WAIT_SCALE

pytestmark = [pytest.mark.real_process, pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[3]
DOCKERFILE = REPO / "docs" / "Dockerfile"
RELEASE_IMAGE = "nvcr.io/nvidia/tensorrt-llm/release"


def _stages() -> list[list[str]]:
    """The Dockerfile's instructions (continuation lines joined, comments dropped), per stage; the
    global ARGs before the first FROM are stage 0."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    stages: list[list[str]] = [[]]
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("FROM "):
            stages.append([])
        stages[-1].append(line)
    return stages


def _run(argv: list[str], *, cwd: Path, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout * WAIT_SCALE,
                          start_new_session=True, check=False)


def _user_env(root: Path) -> dict[str, str]:
    """The image's view: the virtualenv's bin first on PATH, nothing of the checkout on any path."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTHONPATH", "VIRTUAL_ENV", "TRTLLM_WORKER_LIVENESS", "PYTHONSTARTUP")}
    env["PATH"] = f"{root / 'venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


def test_the_dockerfile_layers_the_wheel_and_one_install_script_on_the_release_image() -> None:
    globals_, builder, final = _stages()
    assert f"ARG TRTLLM_IMAGE={RELEASE_IMAGE}" in globals_ and "ARG TRTLLM_VERSION" in globals_, globals_
    assert builder[0] == "FROM ${TRTLLM_IMAGE}:${TRTLLM_VERSION} AS wheel", builder
    assert final[0] == "FROM ${TRTLLM_IMAGE}:${TRTLLM_VERSION}", final  # the release image, its tag a build ARG
    runs = [line for line in final if line.startswith("RUN ")]
    assert len(runs) == 1 and "sh /tmp/trtllm-liveness/image-install.sh /tmp/trtllm-liveness" in runs[0], runs
    assert "COPY docs/image-install.sh /tmp/trtllm-liveness/" in final
    assert "COPY --from=wheel /wheel/ /tmp/trtllm-liveness/" in final


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A virtualenv where the Dockerfile's steps ran: the builder stage's wheel, then the script."""
    _globals, builder, final = _stages()
    root = tmp_path_factory.mktemp("image")
    assert not root.resolve().is_relative_to(REPO)
    source = root / "src"
    source.mkdir()
    for line in builder:
        if line.startswith("COPY "):
            *names, target = shlex.split(line)[1:]
            assert target.startswith("/src/"), line
            for name in names:
                origin = REPO / name
                destination = source / target.removeprefix("/src/").strip("/")
                if origin.is_dir():
                    shutil.copytree(origin, destination, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
                else:
                    destination.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(origin, destination / origin.name)
    [build] = [line for line in builder if line.startswith("RUN ")]
    argv = shlex.split(build)[1:]
    assert argv[:3] == ["python3", "-m", "pip"] and argv[-1] == "/src", argv
    wheel_dir = root / "wheel"
    argv = [sys.executable, *argv[1:-1], str(source)]
    argv[argv.index("/wheel")] = str(wheel_dir)
    built = _run(argv, cwd=root, env=_user_env(root))
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    venv.EnvBuilder(with_pip=True, clear=True).create(root / "venv")
    [extras] = [line.split("=", 1)[1] for line in final if line.startswith("ARG TRTLLM_LIVENESS_EXTRAS=")]
    env = {**_user_env(root), "TRTLLM_LIVENESS_EXTRAS": extras}
    ran = _run(["sh", str(REPO / "docs" / "image-install.sh"), str(wheel_dir)], cwd=root, env=env, timeout=600)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    site = _run(["python3", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=root,
                env=env).stdout.strip()
    pth = f"{site}/trtllm_liveness_autoload.pth"
    assert site.startswith(str(root / "venv")), site
    # The script's own checks: the autoload written, then found current, then the version.
    assert f"installed {pth}\ninstalled: {pth}\ntrtllm-liveness " in ran.stdout, ran.stdout
    yield root


def test_doctor_in_the_installed_environment_says_tensorrt_llm_is_not_installed(installed: Path) -> None:
    doctor = _run(["trtllm-liveness", "doctor"], cwd=installed, env=_user_env(installed))
    assert doctor.returncode == 4, doctor  # docs/doctor.md: 4, TensorRT-LLM not installed
    assert doctor.stdout.splitlines() == [
        "tensorrt_llm: not installed (not importable from this interpreter)",
        "settings: TRTLLM_WORKER_LIVENESS unset: liveness off (the autoload launcher sets it to 1)",
        "coverage: not installed (exit status 4)"], doctor
    where = _run(["python3", "-c", "import trtllm_liveness; print(trtllm_liveness.__file__)"], cwd=installed,
                 env=_user_env(installed))
    assert where.stdout.startswith(str(installed / "venv")), where  # the wheel's copy, not the checkout's


def test_the_autoload_hooks_every_python_of_the_environment_once_switched_on(installed: Path) -> None:
    hooked = "import sys; print(getattr(sys.meta_path[0], '_target', None))"
    on = _run(["python3", "-c", hooked], cwd=installed, env={**_user_env(installed), "TRTLLM_WORKER_LIVENESS": "1"})
    off = _run(["python3", "-c", hooked], cwd=installed, env=_user_env(installed))
    assert on.stdout.strip() == "tensorrt_llm.executor.proxy", on
    assert off.stdout.strip() != "tensorrt_llm.executor.proxy", off
    status = _run(["trtllm-liveness", "autoload", "status"], cwd=installed, env=_user_env(installed))
    assert status.returncode == 0, status  # installed and current
    extra = _run(["python3", "-c", "import kubernetes"], cwd=installed, env=_user_env(installed))
    assert extra.returncode == 0, extra  # the default extra: the node helper's client
