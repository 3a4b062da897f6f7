"""What the autoload ``.pth`` costs every interpreter of the environment it is installed in.

Each test starts the interpreter of a throwaway venv whose site-packages holds the autoload
``.pth`` (see ``tests/support/autoload_site.py``) and reads what start-up left behind: modules,
threads, ``sys.meta_path`` and, through a recorder a ``.pth`` sorted first installs, every
``os.register_at_fork`` call. With liveness off only the switch may be imported; with it on but
no TensorRT-LLM only the import hook may be installed. No timing is asserted here (that is
``scripts/bench_import.py``).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.autoload_site import PACKAGE, REPORT, AutoloadSite, StartupReport, throwaway_site
from tests.support.process_tracker import ProcessTracker
from tests.support.waits import WAIT_SCALE
from trtllm_liveness import LivenessConfig, _config, _switch
from trtllm_liveness.integrations.trtllm_autoload import PTH_LINE

pytestmark = [pytest.mark.timeout(180), pytest.mark.real_process]

FAKES = Path(__file__).resolve().parents[2] / "fakes"
# What reading the switch may import: the package (whose __init__ imports nothing) and the switch.
SWITCH_MODULES = frozenset({PACKAGE, f"{PACKAGE}._switch"})
# With liveness on and no TensorRT-LLM: the switch, plus the module that holds the import hook.
HOOK_MODULES = SWITCH_MODULES | {f"{PACKAGE}.integrations", f"{PACKAGE}.integrations.trtllm_autoload"}
# The one finder it installs: the integrations' import hook, which patches upstream's proxy on import.
HOOK_FINDER = f"{PACKAGE}.integrations.PatchingFinder"
# What installed environments may still have: the .pth line of earlier releases.
LEGACY_PTH_LINE = "import trtllm_liveness.integrations.trtllm_autoload\n"


@pytest.fixture(scope="module")
def site() -> Iterator[AutoloadSite]:
    with throwaway_site() as made:
        yield made


@pytest.fixture(autouse=True)
def _fresh_state(site: AutoloadSite) -> Iterator[None]:
    site.autoload(True)
    site.probe(True)
    yield
    site.autoload(True)
    site.probe(False)


def _run(procs: ProcessTracker, site: AutoloadSite, code: str, liveness: str | None,
         extra_env: dict[str, str] | None = None) -> tuple[str, str]:
    env = {**site.env(liveness), **(extra_env or {})}
    proc = subprocess.Popen(site.argv(code), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    procs.popens.append(proc)
    procs.track(proc.pid)
    out, err = proc.communicate(timeout=60 * WAIT_SCALE)
    assert proc.returncode == 0, err.decode()
    return out.decode(), err.decode()


def _startup(procs: ProcessTracker, site: AutoloadSite, liveness: str | None) -> tuple[StartupReport, str]:
    out, err = _run(procs, site, REPORT, liveness)
    return StartupReport.parse(out.strip().splitlines()[-1]), err


def _baseline(procs: ProcessTracker, site: AutoloadSite) -> StartupReport:
    site.autoload(False)
    try:
        return _startup(procs, site, None)[0]
    finally:
        site.autoload(True)


def _assert_no_thread_and_no_fork_hook(report: StartupReport, base: StartupReport) -> None:
    assert report.os_threads == base.os_threads == 1
    assert report.python_threads == 1
    assert report.at_fork_calls is not None and base.at_fork_calls is not None, "the fork probe did not load"
    ours = [call for call in report.at_fork_calls if any(module.startswith(PACKAGE) for module in call)]
    assert ours == []
    assert report.at_fork_calls == base.at_fork_calls  # none from the stdlib modules we would pull in either


def test_the_pth_line_is_what_write_pth_installs(site: AutoloadSite) -> None:
    assert site.autoload_pth.read_text() == PTH_LINE


@pytest.mark.parametrize("liveness", [None, "", "0", "off", " False "])
def test_autoload_off_imports_only_the_switch_and_starts_nothing(
    procs: ProcessTracker, site: AutoloadSite, liveness: str | None
) -> None:
    base = _baseline(procs, site)
    report, err = _startup(procs, site, liveness)
    assert err == ""
    assert report.modules - base.modules <= SWITCH_MODULES  # not one standard-library module more
    assert not report.package_modules - SWITCH_MODULES
    assert not any(entry.startswith(PACKAGE) for entry in report.meta_path)
    _assert_no_thread_and_no_fork_hook(report, base)


def test_a_legacy_pth_line_off_imports_no_core_module_and_starts_nothing(
    procs: ProcessTracker, site: AutoloadSite
) -> None:
    base = _baseline(procs, site)
    site.autoload(False)
    legacy = site.site_packages / "trtllm_liveness_legacy.pth"
    legacy.write_text(LEGACY_PTH_LINE)
    try:
        report, err = _startup(procs, site, None)
    finally:
        legacy.unlink()
    assert err == ""
    assert report.modules - base.modules <= HOOK_MODULES
    assert not any(entry.startswith(PACKAGE) for entry in report.meta_path)
    _assert_no_thread_and_no_fork_hook(report, base)


@pytest.mark.parametrize("liveness", ["1", "on", "d_state_timeout_s=5,scan_interval_s=0.5"])
def test_autoload_on_without_tensorrt_llm_installs_only_the_import_hook(
    procs: ProcessTracker, site: AutoloadSite, liveness: str
) -> None:
    base = _baseline(procs, site)
    report, err = _startup(procs, site, liveness)
    assert err == ""
    finders = [entry for entry in report.meta_path if entry.startswith(PACKAGE)]
    assert finders == [HOOK_FINDER], report.meta_path
    assert not any(module.split(".")[0] == "tensorrt_llm" for module in report.modules)
    # The settings form is not validated at start-up (the engine start does that): it costs the
    # same as the plain switch.
    assert report.modules - base.modules <= HOOK_MODULES  # not one standard-library module more
    _assert_no_thread_and_no_fork_hook(report, base)


def test_autoload_on_with_a_malformed_value_installs_the_hook_and_validates_nothing_at_start_up(
    procs: ProcessTracker, site: AutoloadSite
) -> None:
    """A settings value, valid or not, only installs the import hook: no config parsing (no
    ``_config``, no ``dataclasses``) in every interpreter of the environment; the engine start
    raises the ``ValueError`` (``test_autoload_launcher.py``)."""
    base = _baseline(procs, site)
    code = REPORT + "print('alive')\n"
    out, err = _run(procs, site, code, "scan_interval_s=-3")
    lines = out.strip().splitlines()
    assert lines[-1] == "alive" and err == ""
    report = StartupReport.parse(lines[-2])
    finders = [entry for entry in report.meta_path if entry.startswith(PACKAGE)]
    assert finders == [HOOK_FINDER], report.meta_path
    assert f"{PACKAGE}._config" not in report.modules
    assert "dataclasses" not in report.modules - base.modules
    assert report.modules - base.modules <= HOOK_MODULES
    _assert_no_thread_and_no_fork_hook(report, base)


def test_the_pth_hook_patches_the_proxy_when_tensorrt_llm_is_imported(
    procs: ProcessTracker, site: AutoloadSite
) -> None:
    code = ("import tensorrt_llm.executor.proxy as p\n"
            "print(p.GenerationExecutorProxy.__name__)\n")
    fake = {"PYTHONPATH": str(FAKES / "trtllm_main")}
    on, _ = _run(procs, site, code, "1", fake)
    assert on.strip() == "LivenessGenerationExecutorProxy"
    off, _ = _run(procs, site, code, None, fake)
    assert off.strip() == "GenerationExecutorProxy"


def test_importing_the_package_imports_no_submodule_until_a_name_is_used(
    procs: ProcessTracker, site: AutoloadSite
) -> None:
    site.autoload(False)
    code = (
        "import sys\n"
        "def mine(): return sorted(m for m in sys.modules if m.startswith('trtllm_liveness'))\n"
        "import trtllm_liveness as t\n"
        "imported = mine()\n"
        "report = t.StopReport\n"
        "after_one = mine()\n"
        "from trtllm_liveness import LivenessConfig, liveness_executor_class\n"
        "resolved = sorted(name for name in t.__all__ if getattr(t, name) is not None)\n"
        "try:\n"
        "    t.no_such_name\n"
        "    missing = 'no error'\n"
        "except AttributeError as exc:\n"
        "    missing = str(exc)\n"
        "import json\n"
        "print(json.dumps({'imported': imported, 'after_one': after_one, 'report': report.__module__,\n"
        "                  'resolved': resolved, 'all': sorted(t.__all__), 'dir': sorted(dir(t)),\n"
        "                  'missing': missing, 'doc': t.__doc__ or ''}))\n"
    )
    out, _ = _run(procs, site, code, None)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["imported"] == [PACKAGE]
    assert f"{PACKAGE}.stop._stop_report" in result["after_one"] and result["report"] == f"{PACKAGE}.stop._stop_report"
    assert not any(name.startswith(f"{PACKAGE}.integrations") for name in result["after_one"])
    assert result["resolved"] == result["all"]
    assert set(result["all"]) <= set(result["dir"])
    assert "no_such_name" in result["missing"]
    assert "Public API" in result["doc"]



@pytest.mark.parametrize(("raw", "expected"), [
    (None, False), ("", False), ("  ", False), ("0", False), (" FALSE ", False), ("off", False), ("no", False),
    ("1", True), ("true", True), (" On", True), ("YES", True),
    ("d_state_timeout_s=5", None), ("enabled=0", None), ("@/no/such/file", None), ("bogus", None),
])
def test_the_switch_reads_each_plain_word_as_the_config_does(raw: str | None, expected: bool | None) -> None:
    assert _switch.ENV_VAR == _config.ENV_VAR
    environ = {} if raw is None else {_config.ENV_VAR: raw}
    assert _switch.switch_word(environ) is expected
    assert _switch.autoload_wanted(environ) is (expected is not False)
    if expected is not None:
        assert LivenessConfig.from_env(environ).enabled is expected
