"""``trtllm-liveness doctor`` and the degraded modes, each of which says so (a WARNING, once).

The command runs in child processes (the installed console script, and ``python -m
trtllm_liveness.cli``) with ``PYTHONPATH`` set to one ``tensorrt_llm``: the two fakes of
``tests/fakes``, none at all, and broken or minimal trees written to ``tmp_path``. The WARNING and
feature-detection tests run in this process on minimal upstream-shaped classes.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.children import HelperProcess
from tests.support.facilities import needs, require_facility
from tests.support.process_tracker import ProcessTracker
from tests.support.waits import WAIT_SCALE
from tests.unittest.integrations.test_trtllm_classes import (
    UpstreamProxy,  # its constructor runs _start_executor_workers
)
from trtllm_liveness import LivenessConfig
from trtllm_liveness.integrations import trtllm as integ
from trtllm_liveness.integrations.trtllm import _classes, _doctor, _features

pytestmark = [pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[3]
FAKES = ROOT / "tests" / "fakes"
CLI = Path(sys.executable).parent / "trtllm-liveness"
CONTRACT = ROOT / "docs" / "upstream-contract.md"
DOCTOR_DOC = ROOT / "docs" / "doctor.md"
# What the children must not inherit: another tensorrt_llm on the path, or liveness switched on.
_DROPPED_ENV = ("PYTHONPATH", "TRTLLM_WORKER_LIVENESS", "TLLM_LLMAPI_ZMQ_DEBUG", "TLLM_WORKER_USE_SINGLE_PROCESS")


@dataclass(frozen=True)
class Run:
    status: int
    out: str
    err: str

    def json(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.out)
        return data


def _env(tree: Path | None, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in _DROPPED_ENV}
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    env.update(extra or {})
    return env


def _run(procs: ProcessTracker, argv: list[str], tree: Path | None, extra: dict[str, str] | None = None) -> Run:
    proc = subprocess.Popen(argv, env=_env(tree, extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, cwd=ROOT)
    procs.popens.append(proc)
    procs.track(proc.pid)
    out, err = proc.communicate(timeout=60 * WAIT_SCALE)
    return Run(proc.returncode, out.decode(), err.decode())


def doctor(procs: ProcessTracker, tree: Path | None, *args: str) -> Run:
    require_facility("console-script")
    return _run(procs, [str(CLI), "doctor", *args], tree)


def _write_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def _not_covered_names(report: dict[str, Any]) -> set[str]:
    return {line.split(":", 1)[0].removeprefix("no ") for line in report["not_covered"]}


# ----------------------------------------------------------------------------- the fakes


def test_v12_fake_is_degraded_naming_what_is_not_covered(procs: ProcessTracker) -> None:
    table = doctor(procs, FAKES / "trtllm_v12")
    assert table.status == 1, table
    assert "coverage: degraded (exit status 1)" in table.out
    assert "Traceback" not in table.err
    report = doctor(procs, FAKES / "trtllm_v12", "--json").json()
    assert report["coverage"] == "degraded" and report["exit_status"] == 1 and report["flavour"] == "1.2"
    assert report["version"] == "1.2.1" and report["error"] is None
    # 1.2.x has no release_exit_joins/abandon on its sessions: exactly those are lost, each named.
    assert _not_covered_names(report) == {"mpi_session.release_exit_joins", "mpi_session.abandon",
                                          "HangDetector.checkpoint"}
    assert any("exit_on_fatal" in line for line in report["not_covered"])
    hooks = {hook["name"]: hook for hook in report["hooks"]}
    # The 1.2 route: what main adds is missing but replaced by the extension, so nothing lost there.
    for name in ("check_health", "_mark_engine_dead", "WORKER_PROCESS_IDENTITIES_SIGNAL", "_fatal_error"):
        assert not hooks[name]["found"] and hooks[name]["role"] == "optional", hooks[name]
    assert hooks["GenerationExecutor._create_ipc_executor"]["found"]
    for line in report["not_covered"]:
        assert line in table.out


def test_main_fake_is_covered(procs: ProcessTracker) -> None:
    table = doctor(procs, FAKES / "trtllm_main")
    assert table.status == 0, table
    assert "coverage: covered (exit status 0)" in table.out and "not covered:" not in table.out
    report = doctor(procs, FAKES / "trtllm_main", "--json").json()
    assert report["coverage"] == "covered" and report["exit_status"] == 0 and report["flavour"] == "main"
    assert report["not_covered"] == [] and report["patched"] is False
    hooks = {hook["name"]: hook for hook in report["hooks"]}
    assert all(hook["found"] for hook in report["hooks"] if hook["role"] in ("attach", "needed"))
    # main sets _fatal_error in GenerationExecutor.__init__: found although it is no class attribute.
    assert hooks["_fatal_error"]["found"] and hooks["_owns_mpi_session"]["found"]


def test_an_invalid_setting_is_exit_status_5_naming_the_key(procs: ProcessTracker) -> None:
    require_facility("console-script")
    bad = _run(procs, [str(CLI), "doctor"], FAKES / "trtllm_main", {"TRTLLM_WORKER_LIVENESS": "bogus=3"})
    assert bad.status == _doctor.EXIT_INVALID_SETTING == 5, bad
    assert "settings: INVALID: TRTLLM_WORKER_LIVENESS: unknown key 'bogus'" in bad.out, bad.out
    assert bad.out.splitlines()[-1] == "coverage: covered; settings invalid (exit status 5)"
    report = _run(procs, [str(CLI), "doctor", "--json"], None, {"TRTLLM_WORKER_LIVENESS": "exit_code=0"}).json()
    assert report["exit_status"] == 5 and report["coverage"] == "not installed"
    assert "exit_code" in report["setting"]["error"] and report["setting"]["value"] == "exit_code=0"
    good = _run(procs, [str(CLI), "doctor"], FAKES / "trtllm_main", {"TRTLLM_WORKER_LIVENESS": "stall_timeout_s=120"})
    assert good.status == 0 and "settings: TRTLLM_WORKER_LIVENESS='stall_timeout_s=120': valid, liveness on" \
        in good.out, good


def test_module_entry_point_reports_the_same(procs: ProcessTracker) -> None:
    run = _run(procs, [sys.executable, "-m", "trtllm_liveness.cli", "doctor", "--json"], FAKES / "trtllm_main")
    assert run.status == 0, run
    assert run.json() == doctor(procs, FAKES / "trtllm_main", "--json").json()


def test_import_hook_patched_class_is_probed_as_upstreams(procs: ProcessTracker) -> None:
    code = ("import sys, trtllm_liveness.integrations.trtllm_autoload; from trtllm_liveness.cli import main; "
            "sys.exit(main(['doctor', '--json']))")
    run = _run(procs, [sys.executable, "-c", code], FAKES / "trtllm_main", {"TRTLLM_WORKER_LIVENESS": "1"})
    assert run.status == 0, run
    report = run.json()
    assert report["patched"] is True and report["coverage"] == "covered"


def test_not_installed_exits_4(procs: ProcessTracker, tmp_path: Path) -> None:
    probe = _run(procs, [sys.executable, "-c", "import importlib.util, sys; "
                         "sys.exit(importlib.util.find_spec('tensorrt_llm') is not None)"], None)
    if probe.status != 0:
        pytest.skip("a tensorrt_llm is installed in this environment: 'not installed' cannot be produced")
    table = doctor(procs, tmp_path)
    assert table.status == 4, table
    assert "not installed" in table.out and table.err == ""
    report = doctor(procs, tmp_path, "--json").json()
    assert report["coverage"] == "not installed" and report["exit_status"] == 4 and report["hooks"] == []
    code = ("import sys; from trtllm_liveness.integrations.trtllm import _doctor; print(_doctor.diagnose().coverage, "
            "sorted(m for m in sys.modules if m.split('.')[0] in ('tensorrt_llm', 'mpi4py', 'zmq', 'torch')))")
    run = _run(procs, [sys.executable, "-c", code], tmp_path)
    assert run.status == 0 and run.out.strip() == "not installed []", run  # found by find_spec: nothing imported


# ----------------------------------------------------------------------------- broken and minimal trees


def test_package_without_executor_proxy_is_inert(procs: ProcessTracker, tmp_path: Path) -> None:
    tree = _write_tree(tmp_path, {"tensorrt_llm/__init__.py": "__version__ = '0.0.1'\n"})
    run = doctor(procs, tree, "--json")
    assert run.status == 3, run
    report = run.json()
    assert report["coverage"] == "inert" and report["version"] == "0.0.1"
    assert "tensorrt_llm.executor.proxy" in _not_covered_names(report)
    assert "ModuleNotFoundError" in report["error"]
    assert "Traceback" not in run.err


def test_import_error_inside_the_package_is_reported_not_raised(procs: ProcessTracker, tmp_path: Path) -> None:
    tree = _write_tree(tmp_path, {"tensorrt_llm/__init__.py": """\
        import os
        print("[TensorRT-LLM] banner on stdout")
        os.write(1, b"a C library writing to fd 1\\n")
        raise ImportError("libcudart.so.12: cannot open shared object file: No such file or directory")
        """})
    run = doctor(procs, tree, "--json")
    assert run.status == 3, run
    report = run.json()  # the banners went to stderr: stdout is one JSON object
    assert report["coverage"] == "inert"
    assert "ImportError" in report["error"] and "libcudart.so.12" in report["error"]
    assert "banner on stdout" in run.err and "Traceback" not in run.err
    table = doctor(procs, tree)
    assert table.status == 3 and "libcudart.so.12" in table.out and "coverage: inert (exit status 3)" in table.out


def test_proxy_module_without_the_proxy_class_is_inert(procs: ProcessTracker, tmp_path: Path) -> None:
    tree = _write_tree(tmp_path, {"tensorrt_llm/__init__.py": "", "tensorrt_llm/executor/__init__.py": "",
                                  "tensorrt_llm/executor/executor.py": MINIMAL_EXECUTOR,
                                  "tensorrt_llm/executor/proxy.py": "GenerationExecutorProxy = None\n"})
    run = doctor(procs, tree, "--json")
    assert run.status == 3, run
    report = run.json()
    assert report["coverage"] == "inert" and report["error"] is None
    assert "GenerationExecutorProxy" in _not_covered_names(report)


@pytest.mark.parametrize("body", ["raise RuntimeError('CUDA driver version is insufficient')\n",
                                  "import sys\nsys.exit(5)\n"])
def test_a_proxy_module_that_fails_at_import_is_inert(procs: ProcessTracker, tmp_path: Path, body: str) -> None:
    tree = _write_tree(tmp_path, {"tensorrt_llm/__init__.py": "", "tensorrt_llm/executor/__init__.py": "",
                                  "tensorrt_llm/executor/proxy.py": body})
    run = doctor(procs, tree, "--json")
    assert run.status == 3, run
    report = run.json()
    assert report["coverage"] == "inert"
    assert ("RuntimeError: CUDA driver" in report["error"]) or ("SystemExit: 5" in report["error"])
    assert "Traceback" not in run.err


MINIMAL_EXECUTOR = """\
    class GenerationExecutor:
        @staticmethod
        def create(**kwargs):
            raise NotImplementedError  # no _create_ipc_executor anywhere
    """
MINIMAL_PROXY = """\
    from .executor import GenerationExecutor

    class GenerationExecutorProxy(GenerationExecutor):
        def __init__(self, worker_kwargs, model_world_size=1, mpi_session=None, **kwargs):
            self.mpi_session = mpi_session

        def _start_executor_workers(self, worker_kwargs):
            pass

        def submit(self, request):
            return request

        def shutdown(self):
            pass

        def is_shutdown(self):
            return False
    """


def test_minimal_tree_is_degraded_naming_each_missing_hook(procs: ProcessTracker, tmp_path: Path) -> None:
    tree = _write_tree(tmp_path, {"tensorrt_llm/__init__.py": "", "tensorrt_llm/executor/__init__.py": "",
                                  "tensorrt_llm/executor/executor.py": MINIMAL_EXECUTOR,
                                  "tensorrt_llm/executor/proxy.py": MINIMAL_PROXY})
    run = doctor(procs, tree, "--json")
    assert run.status == 1, run
    report = run.json()
    lost = _not_covered_names(report)
    assert {"pre_shutdown", "GenerationExecutor._create_ipc_executor", "mpi_session.submit",
            "tensorrt_llm._utils.mpi_comm"} <= lost, report["not_covered"]
    assert "shutdown" not in lost and "submit" not in lost
    assert any("clean-exit marking" in line for line in report["not_covered"])


def test_every_name_the_doctor_reports_is_in_the_upstream_contract(procs: ProcessTracker) -> None:
    contract = CONTRACT.read_text()
    names = {hook["name"] for tree in ("trtllm_v12", "trtllm_main")
             for hook in doctor(procs, FAKES / tree, "--json").json()["hooks"]}
    assert len(names) > 20
    missing = [name for name in sorted(names) if not re.search("`" + re.escape(name) + r"[`(]", contract)]
    assert missing == [], f"named by the doctor but not in {CONTRACT.name}: {missing}"


def test_doctor_doc_lists_the_exit_statuses() -> None:
    text = DOCTOR_DOC.read_text()
    for coverage, status in _doctor.EXIT_STATUS.items():
        assert re.search(rf"\|\s*`?{status}`?\s*\|\s*{coverage}", text), (coverage, status)
    assert sorted(_doctor.EXIT_STATUS.values()) == [0, 1, 3, 4]


def test_help_does_not_import_the_integration(procs: ProcessTracker) -> None:
    code = ("import contextlib, io, sys; from trtllm_liveness import cli\n"
            "out = io.StringIO()\n"
            "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(out):\n"
            "    cli.main(['--help'])\n"
            "loaded = sorted(m for m in sys.modules if m.startswith('trtllm_liveness.integrations'))\n"
            "print('doctor' in out.getvalue(), loaded)\n")
    run = _run(procs, [sys.executable, "-c", code], None)
    assert run.status == 0, run
    assert run.out.strip() == "True []"


# ----------------------------------------------------------------------------- executor_cls on the fakes


@pytest.mark.mpi
@pytest.mark.real_process
@needs("mpi")
@pytest.mark.parametrize("tree", ["v12", "main"])
def test_llm_executor_cls_builds_the_liveness_proxy_watching_both_ranks(tree: str) -> None:
    """With the fakes' layout (``_create_ipc_executor`` on a base of ``GenerationExecutor``),
    ``LLM(executor_cls=liveness_executor_class())`` builds the liveness proxy, not upstream's plain
    one. Upstream's LLM API, real MPI ranks, both trees."""
    with HelperProcess("executor_cls_child", {"tree": tree}, {"TRTLLM_WORKER_LIVENESS": ""}) as child:
        record = child.read_record(60 * WAIT_SCALE, "built")
        child.read_record(30 * WAIT_SCALE, "done")
        status = child.wait_exit(30 * WAIT_SCALE)
        log = child.stderr_tail()
        survivors = child.close()
    assert record["liveness"] is True and record["built"] == "LivenessGenerationExecutorProxy", (record, log)
    ranks = record["ranks"]
    assert sorted(rank["rank"] for rank in ranks) == [0, 1], (record, log)
    assert all(rank["state"] == "alive" for rank in ranks), record
    pids = {rank["pid"] for rank in ranks}
    assert len(pids) == 2 and record["proxy_pid"] not in pids  # spawned ranks, not the proxy
    assert status == 0, log
    assert survivors == []


# ----------------------------------------------------------------------------- loud degraded modes (in-process)


@pytest.fixture
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_features, "_WARNED", set())


def _warnings(caplog: pytest.LogCaptureFixture, needle: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and needle in r.getMessage()]


def test_no_create_ipc_executor_in_the_mro_warns_once(fresh_warnings: None, caplog: pytest.LogCaptureFixture) -> None:
    """``_install_create_hook`` warns (once) when nothing defines ``_create_ipc_executor``."""

    class GenerationExecutor:
        @staticmethod
        def create(**kwargs: Any) -> Any:
            return kwargs

    with caplog.at_level(logging.WARNING, logger="trtllm_liveness"):
        for _ in range(3):
            integ.liveness_executor_class(GenerationExecutor, UpstreamProxy)
    warnings = _warnings(caplog, "_create_ipc_executor")
    assert len(warnings) == 1, caplog.text
    assert "not covered" in warnings[0] and "executor_cls" in warnings[0]


def test_create_ipc_executor_on_a_base_class_is_hooked(fresh_warnings: None) -> None:
    """The fakes' layout (routes on a base of ``GenerationExecutor``): the hook must land on the
    base that defines the method, and ``create`` must build the liveness proxy."""
    holder: dict[str, type] = {"proxy": UpstreamProxy}

    class Routes:
        @staticmethod
        def _create_ipc_executor(worker_kwargs: Any, model_world_size: int = 1, mpi_session: Any = None,
                                 postproc_worker_config: Any = None, is_llm_executor: Any = None,
                                 use_worker: bool = False) -> Any:
            return holder["proxy"](worker_kwargs, model_world_size=model_world_size, mpi_session=mpi_session)

    class GenerationExecutor(Routes):
        @staticmethod
        def create(**kwargs: Any) -> Any:
            return GenerationExecutor._create_ipc_executor({"llm_args": None})

    original = vars(Routes)["_create_ipc_executor"]
    try:
        assert _classes._routing_class(GenerationExecutor) is Routes
        cls = integ.liveness_executor_class(GenerationExecutor, UpstreamProxy,
                                            config=LivenessConfig(enabled=True, scan_interval_s=0.1))
        built = cls.create()
        try:
            assert isinstance(built, integ.LivenessProxyMixin), type(built)
        finally:
            built.shutdown()
        assert type(GenerationExecutor.create()) is UpstreamProxy  # a plain build stays upstream's
    finally:
        Routes._create_ipc_executor = original  # type: ignore[method-assign]


class _FatalInInit:
    def __init__(self) -> None:
        self._fatal_error: BaseException | None = None


class _StateInHelper:
    def __init__(self) -> None:
        self._init_state()

    def _init_state(self) -> None:
        self._engine_dead = False


class _OnlySetter:
    def _set_fatal_error(self, error: BaseException) -> None:
        self._fatal_error = error


def _logged(init: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(init)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)

    return wrapper


class _DecoratedInit:
    @_logged
    def __init__(self) -> None:
        self._fatal_error: BaseException | None = None


class _MainShapedProxy(_FatalInInit, UpstreamProxy):
    """main's shape: ``GenerationExecutor.__init__`` assigns ``_fatal_error``; the proxy calls it."""

    def __init__(self, worker_kwargs: Any, *args: Any, **kwargs: Any) -> None:
        _FatalInInit.__init__(self)
        UpstreamProxy.__init__(self, worker_kwargs, *args, **kwargs)

    def _set_fatal_error(self, error: BaseException) -> None:
        if self._fatal_error is None:
            self._fatal_error = error


def test_fatal_error_probe_sees_the_instance_attribute_main_sets_in_init() -> None:
    """The probe sees ``_fatal_error`` on main, where ``__init__`` sets it (``hasattr(cls, ...)`` is False)."""
    assert _features.detect_features(_MainShapedProxy).fatal_error
    assert not _features.detect_features(UpstreamProxy).fatal_error
    assert _features.has_attribute(_StateInHelper, "_engine_dead")  # one level of self.helper()
    assert not _features.has_attribute(_OnlySetter, "_fatal_error")  # set only on error: not there before
    assert _features.has_attribute(_DecoratedInit, "_fatal_error")  # read through functools.wraps


class _SetterOnlyProxy(_OnlySetter, UpstreamProxy):
    """``_set_fatal_error`` but no ``_fatal_error`` until an error: a probe on the setter would be wrong."""


@pytest.mark.parametrize("base", [_MainShapedProxy, UpstreamProxy, _SetterOnlyProxy])
def test_fatal_error_is_none_after_construction_either_way(base: type) -> None:
    """The caller of the field: the mixin creates ``_fatal_error`` only when the probe says upstream's
    constructor does, so a wrong "found" would leave Dynamo's ``_fatal_error`` read failing."""
    cls = integ.liveness_proxy_class(base, config=LivenessConfig(enabled=True, scan_interval_s=0.1))
    proxy = cls({"llm_args": None})
    try:
        assert proxy._fatal_error is None
    finally:
        proxy.shutdown()


def test_missing_hooks_warn_once_per_process_not_per_engine(fresh_warnings: None,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """Several engines, and several liveness classes of one upstream class, warn once per hook."""

    class Bare:  # no _start_executor_workers, no submit
        def __init__(self, worker_kwargs: Any, *args: Any, **kwargs: Any) -> None:
            self.doing_shutdown = False

        def pre_shutdown(self) -> None:
            self.doing_shutdown = True

        def shutdown(self) -> None:
            self.pre_shutdown()

    with caplog.at_level(logging.WARNING, logger="trtllm_liveness"):
        for interval in (0.1, 0.2, 0.1):
            config = LivenessConfig(enabled=True, scan_interval_s=interval)
            bare = integ.liveness_proxy_class(Bare, config=config)({"llm_args": None})
            bare.shutdown()
            # Its constructor starts the workers with mpi_session None: no identities, no proxy-death watch.
            sessionless = integ.liveness_proxy_class(UpstreamProxy, config=config)({"llm_args": None})
            sessionless.shutdown()
    for needle in ("no _start_executor_workers", "no submit", "no mpi_session"):
        found = _warnings(caplog, needle)
        assert len(found) == 1, (needle, caplog.text)
        assert "not covered" in found[0]


def test_session_hooks_warn_once_naming_what_is_not_covered(fresh_warnings: None,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    class OldSession:  # a 1.2.x MpiPoolSession: an mpi4py pool, no release_exit_joins()
        mpi_pool = object()

        def submit(self, task: Any) -> list[Any]:
            return []

    class CommSession:  # mpirun's ranks: no pool thread to join, so nothing is lost
        def submit(self, task: Any) -> list[Any]:
            return []

    with caplog.at_level(logging.WARNING, logger="trtllm_liveness"):
        _features.warn_session_hooks(CommSession(), owned=False)
        assert _warnings(caplog, "release_exit_joins") == []
        _features.warn_session_hooks(OldSession(), owned=True)  # the extension releases it itself
        assert _warnings(caplog, "release_exit_joins") == []
        for _ in range(2):
            _features.warn_session_hooks(OldSession(), owned=False)
            _features.warn_session_hooks(None)
    released = _warnings(caplog, "release_exit_joins")
    assert len(released) == 1 and "not covered" in released[0] and "exit_on_fatal" in released[0]
    assert len(_warnings(caplog, "no mpi_session")) == 1
