"""A throwaway Python environment with the autoload ``.pth`` installed, for import-cost checks.

:func:`throwaway_site` makes a ``venv`` (no pip) in a temporary directory whose site-packages holds
a path file that puts this repository on ``sys.path`` (as an installed wheel would be) and the
autoload ``.pth`` written by ``write_pth``; it is removed on exit, also on failure. The same
interpreter is started with the autoload ``.pth`` switched in or out (renamed), so "with" and
"without" differ by that one file only.

At-fork hooks cannot be listed (CPython keeps them in the interpreter state), so they are
counted: :meth:`AutoloadSite.probe` installs ``00_liveness_fork_probe.pth``, which ``site`` runs
before every other ``.pth`` of the directory (it processes them in sorted order) and which wraps
``os.register_at_fork`` to record each call and the module of each callable. Startup with the
autoload ``.pth`` minus startup without it is the number of hooks the autoload registered, its own
or the standard library's (``threading``, ``logging`` and ``random`` register one at import).

Used by ``tests/unittest/packaging/test_import_cost.py`` and ``scripts/bench_import.py``. Nothing here
starts a process: callers run :meth:`AutoloadSite.argv` with :meth:`AutoloadSite.env` themselves
(the tests through the ``procs`` tracker).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import venv
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from trtllm_liveness._config import ENV_VAR

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "trtllm_liveness"
_PROBE_MODULE = "_liveness_fork_probe"
# Sorted before every other .pth in the directory, so the wrapper is in place before they run.
_PROBE_PTH = "00_liveness_fork_probe.pth"
# Sorted before the autoload's .pth, whose import needs the package on sys.path.
_REPO_PTH = "01_trtllm_liveness_repo.pth"
_DISABLED = ".disabled"

_PROBE_SOURCE = '''"""Records every os.register_at_fork call made after it is imported (by a .pth sorted first)."""
import os

CALLS = []
_register = os.register_at_fork


def _recording_register_at_fork(**callbacks):
    CALLS.append(sorted({getattr(fn, "__module__", None) or "?" for fn in callbacks.values()}))
    return _register(**callbacks)


os.register_at_fork = _recording_register_at_fork
'''

# Run as ``python -c REPORT``: what start-up (site and every .pth) left behind, as one JSON line.
# ``sys.modules`` is copied before this script imports anything itself.
REPORT = """
import sys
_modules = sorted(sys.modules)
import json, os
_probe = sys.modules.get("_liveness_fork_probe")
_threading = sys.modules.get("threading")
print(json.dumps({
    "modules": _modules,
    "os_threads": len(os.listdir("/proc/self/task")),
    "python_threads": len(_threading.enumerate()) if _threading is not None else 1,
    "at_fork_calls": None if _probe is None else _probe.CALLS,
    "meta_path": [type(f).__module__ + "." + type(f).__qualname__ for f in sys.meta_path],
}))
"""


@dataclass(frozen=True)
class StartupReport:
    """What one interpreter start left behind (parsed from :data:`REPORT`'s output)."""

    modules: frozenset[str]
    os_threads: int
    python_threads: int
    at_fork_calls: tuple[tuple[str, ...], ...] | None
    meta_path: tuple[str, ...]

    @classmethod
    def parse(cls, line: str) -> StartupReport:
        raw = json.loads(line)
        calls = raw["at_fork_calls"]
        return cls(
            modules=frozenset(raw["modules"]),
            os_threads=int(raw["os_threads"]),
            python_threads=int(raw["python_threads"]),
            at_fork_calls=None if calls is None else tuple(tuple(call) for call in calls),
            meta_path=tuple(raw["meta_path"]),
        )

    @property
    def package_modules(self) -> frozenset[str]:
        return frozenset(m for m in self.modules if m == PACKAGE or m.startswith(PACKAGE + "."))


@dataclass(frozen=True)
class AutoloadSite:
    """The throwaway environment: its interpreter, its site-packages and the autoload ``.pth``."""

    root: Path
    python: Path
    site_packages: Path
    autoload_pth: Path

    def autoload(self, enabled: bool) -> None:
        """Switch the autoload ``.pth`` in or out (``site`` reads only names ending in ``.pth``)."""
        _toggle(self.autoload_pth, enabled)

    def probe(self, enabled: bool) -> None:
        """Switch the ``os.register_at_fork`` recorder in or out."""
        _toggle(self.site_packages / _PROBE_PTH, enabled)

    def argv(self, code: str) -> list[str]:
        return [str(self.python), "-c", code]

    def env(self, liveness: str | None) -> dict[str, str]:
        """The caller's environment without ``PYTHON*`` variables, with ``ENV_VAR`` set or unset."""
        env = {key: value for key, value in os.environ.items() if not key.startswith("PYTHON") and key != ENV_VAR}
        if liveness is not None:
            env[ENV_VAR] = liveness
        return env


def _toggle(path: Path, enabled: bool) -> None:
    disabled = path.with_name(path.name + _DISABLED)
    if enabled and disabled.exists():
        disabled.rename(path)
    elif not enabled and path.exists():
        path.rename(disabled)


@contextlib.contextmanager
def throwaway_site(repo_root: Path = REPO_ROOT) -> Iterator[AutoloadSite]:
    """A temporary venv with ``repo_root`` on its path and the autoload ``.pth`` (enabled) and the
    fork probe (disabled) in its site-packages; removed on exit."""
    from trtllm_liveness.integrations.trtllm_autoload import write_pth

    root = Path(tempfile.mkdtemp(prefix="trtllm-import-cost-"))
    try:
        venv.EnvBuilder(with_pip=False, symlinks=True, clear=True).create(root)
        candidates = sorted(root.glob("lib/python*/site-packages"))
        if len(candidates) != 1:
            raise RuntimeError(f"no single site-packages in the new venv {root}: {candidates}")
        site_packages = candidates[0]
        (site_packages / _REPO_PTH).write_text(f"{repo_root}\n")
        (site_packages / f"{_PROBE_MODULE}.py").write_text(_PROBE_SOURCE)
        (site_packages / (_PROBE_PTH + _DISABLED)).write_text(f"import {_PROBE_MODULE}\n")
        autoload_pth = Path(write_pth(str(site_packages)))
        yield AutoloadSite(root=root, python=root / "bin" / "python", site_packages=site_packages,
                           autoload_pth=autoload_pth)
    finally:
        shutil.rmtree(root, ignore_errors=True)
