"""Activate worker liveness where no ``executor_cls`` can be passed (``trtllm-serve``, Dynamo).

Importing this module does nothing unless ``TRTLLM_WORKER_LIVENESS`` switches liveness on (so it
costs one environment lookup otherwise). When on, it patches
``tensorrt_llm.executor.proxy.GenerationExecutorProxy`` with the liveness subclass: at once if
TensorRT-LLM is already imported, else the moment it is (an import hook on that one module).
Workers need nothing: the patched proxy wraps the worker entry it submits.

Ways to load it, pick one:

- ``python -m trtllm_liveness.integrations.trtllm_autoload trtllm-serve MODEL ...`` (or
  ``... -m module args``): installs the hook, then runs the command in this interpreter;
- a ``.pth`` file in the environment's site-packages whose one line is
  ``import trtllm_liveness.integrations.trtllm_autoload`` (:func:`write_pth` writes it), which
  every Python process of that environment then runs at start-up;
- ``import trtllm_liveness.integrations.trtllm_autoload`` at the top of your own launcher.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import os
import runpy
import shutil
import sys
import sysconfig
import threading
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from .._config import ENV_VAR, LivenessConfig

__all__ = ["PTH_LINE", "install", "main", "write_pth"]

logger = logging.getLogger(__name__)

_TARGET = "tensorrt_llm.executor.proxy"
PTH_LINE = "import trtllm_liveness.integrations.trtllm_autoload\n"
_lock = threading.Lock()
_installed = False


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, wrapped: importlib.abc.Loader) -> None:
        self._wrapped = wrapped

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._wrapped.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._wrapped.exec_module(module)
        from .trtllm import patch_tensorrt_llm

        patch_tensorrt_llm(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Intercepts only ``tensorrt_llm.executor.proxy``; defers to the other finders for the spec."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname != _TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


def install(force: bool = False) -> bool:
    """Install the patch (now or at TensorRT-LLM's import) if the environment switches liveness
    on, or always with ``force``. Idempotent and thread-safe. Raises ``ValueError`` for a
    malformed ``TRTLLM_WORKER_LIVENESS``. Returns whether the hook is active."""
    global _installed
    if not force and not LivenessConfig.from_env().enabled:
        return False
    with _lock:
        if _installed:
            return True
        module = sys.modules.get(_TARGET)
        if module is not None:
            from .trtllm import patch_tensorrt_llm

            patch_tensorrt_llm(module)
        else:
            sys.meta_path.insert(0, _Finder())
        _installed = True
    return True


def write_pth(site_dir: str | None = None, name: str = "trtllm_liveness_autoload.pth") -> str:
    """Write the ``.pth`` file that loads this module at every interpreter start; returns its path."""
    directory = site_dir or sysconfig.get_paths()["purelib"]
    path = os.path.join(directory, name)
    with open(path, "w") as handle:
        handle.write(PTH_LINE)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m trtllm_liveness.integrations.trtllm_autoload [-m module | command] args...``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        sys.stderr.write(__doc__ or "")
        return 2
    os.environ.setdefault(ENV_VAR, "1")  # running through this launcher means "on"
    install()
    if args[0] == "-m" and len(args) > 1:
        sys.argv = args[1:]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        return 0
    script = args[0] if os.path.exists(args[0]) else shutil.which(args[0])
    if script is None:
        sys.stderr.write(f"trtllm_autoload: command not found: {args[0]}\n")
        return 127
    sys.argv = [script, *args[1:]]
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
else:
    try:
        install()
    except ValueError as exc:  # loaded from a .pth: report, do not break every interpreter
        logger.error("trtllm_liveness autoload not installed: %s", exc)
