"""The autoload launcher and ``.pth`` line, in real interpreters: any command, a bad configuration
refused at engine start, nothing left behind or broken once the package is gone."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.facilities import needs
from tests.support.waits import WAIT_SCALE
from trtllm_liveness.integrations import trtllm_autoload as autoload

pytestmark = [pytest.mark.real_process, pytest.mark.timeout(120)]

FAKE_MAIN = Path(__file__).resolve().parents[2] / "fakes" / "trtllm_main"
VENV_BIN = os.path.dirname(sys.executable)
# Prints whether the hook's finder is first on sys.meta_path (what install() puts there).
HOOKED = ("import sys; print('hooked' if getattr(sys.meta_path[0], '_target', None) == 'tensorrt_llm.executor.proxy' "
          "else 'not hooked')")


def launch(*command: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {key: value for key, value in os.environ.items() if key != "TRTLLM_WORKER_LIVENESS"}
    # The venv's python first on PATH, as in an activated environment or a container's image.
    base["PATH"] = VENV_BIN + os.pathsep + base.get("PATH", "")
    return subprocess.run([sys.executable, "-m", "trtllm_liveness.integrations.trtllm_autoload", *command],
                          capture_output=True, text=True, env={**base, **(env or {})}, timeout=60 * WAIT_SCALE,
                          start_new_session=True)


def test_python_dash_c_gets_the_hook() -> None:
    # Before: the launcher ran the python binary as Python source ("cannot contain null bytes").
    result = launch("python", "-c", HOOKED)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "hooked", result.stderr
    assert "worker liveness on" in result.stderr  # one line says that liveness is on


def test_a_shell_wrapper_that_starts_python_later_gets_the_hook() -> None:
    result = launch("sh", "-c", f'exec python -c "{HOOKED}"')
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "hooked", result.stderr


def test_module_form_and_script_file(tmp_path: Path) -> None:
    script = tmp_path / "serve.py"
    script.write_text(HOOKED + "\n")  # not executable: run with this interpreter
    as_script = launch(str(script))
    assert as_script.stdout.strip() == "hooked", as_script.stderr
    pkg = tmp_path / "mod_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text(HOOKED + "\n")
    as_module = launch("-m", "mod_pkg", env={"PYTHONPATH": str(tmp_path)})
    assert as_module.stdout.strip() == "hooked", as_module.stderr


def test_the_command_keeps_the_launcher_pid() -> None:
    # exec, not a child: a container's PID 1 stays the server, signals reach it directly.
    proc = subprocess.Popen([sys.executable, "-m", "trtllm_liveness.integrations.trtllm_autoload",
                             "sh", "-c", "echo $$"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=60 * WAIT_SCALE)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert int(out.strip()) == proc.pid


def test_help_and_usage_errors_and_missing_commands() -> None:
    helped = launch("--help")
    assert helped.returncode == 0 and helped.stdout.startswith("usage:"), helped
    assert launch().returncode == 2
    missing = launch("no-such-command-anywhere")
    assert missing.returncode == 127 and "command not found: no-such-command-anywhere" in missing.stderr
    after_dashes = launch("--", "python", "-c", HOOKED)
    assert after_dashes.stdout.strip() == "hooked", after_dashes.stderr


def test_the_users_own_sitecustomize_still_runs(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text("print('theirs ran', flush=True)\n")
    result = launch("python", "-c", HOOKED, env={"PYTHONPATH": str(tmp_path)})
    # The launcher's own interpreter runs it too (same PYTHONPATH); the command's: theirs, then ours.
    assert result.stdout.splitlines()[-2:] == ["theirs ran", "hooked"], result


def test_switched_off_by_the_user_installs_nothing() -> None:
    result = launch("python", "-c", HOOKED, env={"TRTLLM_WORKER_LIVENESS": "0"})
    assert result.stdout.strip() == "not hooked", result.stderr
    assert "worker liveness off" in result.stderr


def test_a_bad_configuration_fails_the_engine_start_instead_of_running_unprotected() -> None:
    # The hook loaded as the .pth loads it (the launcher refuses the value before it starts
    # anything, below): the engine's start fails; the server never runs without liveness.
    code = textwrap.dedent("""
        import trtllm_liveness.integrations.trtllm_autoload
        from tensorrt_llm.executor.executor import GenerationExecutor
        from _trtllm_fake_common import FakeEngine  # on sys.path once the fake tree is imported
        try:
            GenerationExecutor.create(FakeEngine(), model_world_size=1)
        except ValueError as exc:
            print("refused:", exc)
            raise SystemExit(3)
        print("started unprotected")
    """)
    env = {key: value for key, value in os.environ.items() if key != "TRTLLM_WORKER_LIVENESS"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60 * WAIT_SCALE,
                            start_new_session=True, env={**env, "PYTHONPATH": str(FAKE_MAIN),
                                                         "TRTLLM_WORKER_LIVENESS": "d_state_timeout_s=soon"})
    assert result.returncode == 3, (result.stdout, result.stderr[-3000:])
    assert "refused:" in result.stdout and "d_state_timeout_s" in result.stdout


@pytest.mark.parametrize(("value", "named"), [
    ("bogus=3", "unknown key 'bogus'"),
    ("exit_code=0", "exit_code must be in [1, 255]"),
    ("@/nonexistent/liveness.conf", "'/nonexistent/liveness.conf'"),
])
def test_an_invalid_value_starts_nothing_and_names_the_key(value: str, named: str) -> None:
    result = launch("python", "-c", "print('the command ran')", env={"TRTLLM_WORKER_LIVENESS": value})
    assert result.returncode == autoload.EXIT_INVALID_SETTING == 78, result
    assert result.stdout == "", result.stdout  # the command never ran
    assert named in result.stderr and "worker liveness on" not in result.stderr, result.stderr


def test_a_settings_value_that_says_enabled_0_is_reported_off() -> None:
    result = launch("python", "-c", "print('ran')", env={"TRTLLM_WORKER_LIVENESS": "enabled=0,d_state_timeout_s=5"})
    assert result.returncode == 0 and result.stdout.strip() == "ran", result
    assert "worker liveness off" in result.stderr, result.stderr


def test_pth_line_is_a_no_op_once_the_package_is_gone(tmp_path: Path) -> None:
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    path = autoload.write_pth(str(site_dir))
    assert autoload.pth_status(str(site_dir)) == (path, "current")
    # -I -S: no PYTHONPATH, no site-packages, so this interpreter cannot import the package, as
    # after `pip uninstall` (which leaves a file written by write_pth behind).
    code = f"import site, sys; site.addsitedir({str(site_dir)!r}); print('ok', 'trtllm_liveness' in sys.modules)"
    result = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True,
                            timeout=60 * WAIT_SCALE, env={"TRTLLM_WORKER_LIVENESS": "1"})
    assert result.stdout.strip() == "ok False", result
    assert result.stderr == "", result.stderr  # before: "Error processing line 1 of ... ModuleNotFoundError"
    assert autoload.remove_pth(str(site_dir)) == path
    assert autoload.pth_status(str(site_dir)) == (path, None)
    assert autoload.remove_pth(str(site_dir)) is None


def test_pth_line_installs_the_hook_where_the_package_is(tmp_path: Path) -> None:
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    autoload.write_pth(str(site_dir))
    (site_dir / "older.pth").write_text("")
    code = f"import site; site.addsitedir({str(site_dir)!r}); {HOOKED}"
    # Run from elsewhere: the package is found as installed (here an editable install's own
    # finder on sys.meta_path), not from the working directory.
    on = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60 * WAIT_SCALE,
                        env={**os.environ, "TRTLLM_WORKER_LIVENESS": "1"}, cwd=tmp_path)
    assert on.stdout.strip() == "hooked", on.stderr
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60 * WAIT_SCALE,
                         env={**os.environ, "TRTLLM_WORKER_LIVENESS": "0"}, cwd=tmp_path)
    assert off.stdout.strip() == "not hooked", off.stderr


@needs("mpi")
def test_one_line_says_liveness_is_on_for_each_engine() -> None:
    # Servers seldom configure Python logging: the line must reach stderr anyway.
    code = textwrap.dedent("""
        from trtllm_liveness.demo._mpi_env import configure_mpi_env
        configure_mpi_env()  # Open MPI's wheel as root on loopback (the test machine)
        from tensorrt_llm.executor.executor import GenerationExecutor
        from _trtllm_fake_common import FakeEngine
        executor = GenerationExecutor.create(FakeEngine(), model_world_size=1)
        print("built", type(executor).__name__, flush=True)
        executor.shutdown()
    """)
    result = launch("python", "-c", code, env={"PYTHONPATH": str(FAKE_MAIN),
                                               "TRTLLM_WORKER_LIVENESS": "shutdown_grace_s=2"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "built LivenessGenerationExecutorProxy", result.stderr[-3000:]
    assert result.stderr.count("worker liveness on for tensorrt_llm.executor.proxy.GenerationExecutorProxy") == 1, \
        result.stderr[-3000:]
