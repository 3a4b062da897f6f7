"""Activate worker liveness where no ``executor_cls`` can be passed (``trtllm-serve``, Dynamo).

When ``TRTLLM_WORKER_LIVENESS`` switches liveness on, this patches
``tensorrt_llm.executor.proxy.GenerationExecutorProxy`` with the liveness subclass: at once if
TensorRT-LLM is already imported, else the moment it is (an import hook on that one module).
Workers need nothing: the patched proxy wraps the worker entry it submits.

Ways to load it, pick one:

- ``python -m trtllm_liveness.integrations.trtllm_autoload trtllm-serve MODEL ...`` (or
  ``... -m module args``): installs the hook, then runs the command in this interpreter;
- a ``.pth`` file in the environment's site-packages with the one line :data:`PTH_LINE`
  (:func:`write_pth` writes it), which every Python process of that environment then runs at
  start-up;
- ``import trtllm_liveness.integrations.trtllm_autoload`` at the top of your own launcher.

What it costs every interpreter (the ``.pth``): with liveness off, the line imports the package
(whose names load lazily) and :mod:`trtllm_liveness._switch`, reads the variable and stops: no
other module, no thread, no at-fork hook. With liveness on, it also imports this module, which
imports nothing else and puts one finder first on ``sys.meta_path`` that answers only for
``tensorrt_llm.executor.proxy``; the integration itself loads when TensorRT-LLM does. A settings
value (``key=value,...`` or ``@file``) is validated at start-up with ``LivenessConfig``, whose
``dataclasses`` import costs about 15 ms more; a malformed one is logged and installs nothing.
Importing this module directly (an older ``.pth`` line) costs the same plus this module when off.
``scripts/bench_import.py`` measures all of this.
"""

import _thread
import os
import sys

from .._switch import ENV_VAR, switch_word

TYPE_CHECKING = False
if TYPE_CHECKING:  # no typing, collections.abc or importlib.abc at run time: see the docstring
    from collections.abc import Sequence
    from importlib.abc import Loader
    from importlib.machinery import ModuleSpec
    from types import ModuleType

__all__ = ["PTH_LINE", "install", "main", "write_pth"]

_TARGET = "tensorrt_llm.executor.proxy"
# A .pth line that starts with "import" is executed by site; this one imports this module (and
# installs the hook) only when the switch is not plainly off.
PTH_LINE = (
    "import trtllm_liveness._switch as switch; "
    "switch.autoload_wanted() and __import__('trtllm_liveness.integrations.trtllm_autoload')\n"
)
_lock = _thread.allocate_lock()  # threading.Lock itself, without importing threading
_installed = False


class _PatchingLoader:
    """Runs the real loader, then patches the module; every other attribute is the real loader's
    (``get_source``, ``is_package``, resource readers), so tracebacks and introspection still work."""

    def __init__(self, wrapped: "Loader") -> None:
        self._wrapped = wrapped

    def create_module(self, spec: "ModuleSpec") -> "ModuleType | None":
        return self._wrapped.create_module(spec)

    def exec_module(self, module: "ModuleType") -> None:
        self._wrapped.exec_module(module)
        from .trtllm import patch_tensorrt_llm

        patch_tensorrt_llm(module)

    def __getattr__(self, name: str) -> object:
        return getattr(self._wrapped, name)


class _Finder:
    """Intercepts only ``tensorrt_llm.executor.proxy``; defers to the other finders for the spec.

    A plain class (the import system needs only ``find_spec``), so installing it imports nothing."""

    def find_spec(
        self, fullname: str, path: "Sequence[str] | None", target: "ModuleType | None" = None
    ) -> "ModuleSpec | None":
        if fullname != _TARGET:
            return None
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            if finder is self or find_spec is None:
                continue
            spec: ModuleSpec | None = find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                # Not an importlib.abc.Loader subclass (importing that costs every interpreter).
                spec.loader = _PatchingLoader(spec.loader)  # type: ignore[assignment]
                return spec
        return None


def _switched_on() -> bool:
    """The switch; raises ``ValueError`` for a malformed value. Only a settings value (neither a
    plain word nor unset) needs ``LivenessConfig``, and with it ``dataclasses``."""
    word = switch_word()
    if word is not None:
        return word
    from .._config import LivenessConfig

    return LivenessConfig.from_env().enabled


def install(force: bool = False) -> bool:
    """Install the patch (now or at TensorRT-LLM's import) if the environment switches liveness
    on, or always with ``force``. Idempotent and thread-safe. Raises ``ValueError`` for a
    malformed ``TRTLLM_WORKER_LIVENESS``. Returns whether the hook is active."""
    global _installed
    if not force and not _switched_on():
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
    if site_dir is None:
        import sysconfig

        site_dir = sysconfig.get_paths()["purelib"]
    path = os.path.join(site_dir, name)
    with open(path, "w") as handle:
        handle.write(PTH_LINE)
    return path


def main(argv: "Sequence[str] | None" = None) -> int:
    """``python -m trtllm_liveness.integrations.trtllm_autoload [-m module | command] args...``."""
    import runpy
    import shutil

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
    # One module object holds the hook's state, also when the .pth has already imported it.
    from trtllm_liveness.integrations import trtllm_autoload as _autoload

    sys.exit(_autoload.main())
else:
    try:
        install()
    except ValueError as exc:  # loaded from a .pth: report, do not break every interpreter
        import logging  # only here: logging (and threading with it) costs every interpreter

        logging.getLogger(__name__).error("trtllm_liveness autoload not installed: %s", exc)
