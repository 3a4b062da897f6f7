"""Activate worker liveness where no ``executor_cls`` can be passed (``trtllm-serve``, Dynamo).

When ``TRTLLM_WORKER_LIVENESS`` switches liveness on, this patches
``tensorrt_llm.executor.proxy.GenerationExecutorProxy`` with the liveness subclass: at once if
TensorRT-LLM is already imported, else the moment it is (an import hook on that one module).
Workers need nothing: the patched proxy wraps the worker entry it submits.

Ways to load it, pick one:

- ``python -m trtllm_liveness.integrations.trtllm_autoload [--] COMMAND ARGS...`` for any command,
  a binary that starts Python later too (:data:`USAGE`, its help text, says what it sets and exits
  with): every Python the command starts with this package importable installs the hook at
  start-up and goes on to the ``sitecustomize`` it would have run, and the command keeps this
  process's pid (PID 1 in a container stays the server);
- a ``.pth`` file in the environment's site-packages with the one line :data:`PTH_LINE`
  (:func:`write_pth` writes it, :func:`remove_pth` removes it, :func:`pth_status` says where it
  is), which every Python process of that environment then runs at start-up; the line does
  nothing once the package is uninstalled;
- ``import trtllm_liveness.integrations.trtllm_autoload`` at the top of your own launcher.

What it costs every interpreter (the ``.pth``): with liveness off, the line imports the package
(whose names load lazily) and :mod:`trtllm_liveness._switch`, reads the variable and stops: no
other module, no thread, no at-fork hook. With liveness on, it also imports this module, which
imports nothing else and puts one finder first on ``sys.meta_path`` that answers only for
``tensorrt_llm.executor.proxy``; the integration itself loads when TensorRT-LLM does. A settings
value installs the hook too (docs/configuration.md "Check a value" says where it is validated).
docs/performance.md "Import cost" has the figures (``scripts/bench_import.py``).
"""

import _thread
import os
import sys

from .._switch import ENV_VAR, EXIT_INVALID_SETTING, autoload_wanted
from . import patch_when_imported

TYPE_CHECKING = False
if TYPE_CHECKING:  # no typing, collections.abc or importlib.abc at run time: see the docstring
    from collections.abc import Sequence
    from types import ModuleType

    from .._config import LivenessConfig

__all__ = ["PTH_LINE", "SITE_DIR", "install", "main", "pth_status", "remove_pth", "write_pth"]

_TARGET = "tensorrt_llm.executor.proxy"
# A .pth line that starts with "import" is executed by site; this one imports this module (and
# installs the hook) only when the switch is not plainly off, and nothing at all once the package
# is gone (pip uninstall leaves a file written by write_pth behind: a line that raised would print
# an error at every Python start). The package is looked up with the finders on sys.meta_path
# themselves (an editable install's included), so the check imports no module.
PTH_LINE = (
    "import sys; "
    "any(hasattr(f, 'find_spec') and f.find_spec('trtllm_liveness', None) for f in sys.meta_path) and "
    "__import__('trtllm_liveness._switch', fromlist=('autoload_wanted',)).autoload_wanted() and "
    "__import__('trtllm_liveness.integrations.trtllm_autoload')\n"
)
PTH_NAME = "trtllm_liveness_autoload.pth"
# The directory whose sitecustomize.py installs the hook in the interpreters a launched command starts.
SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_autoload_site")
_lock = _thread.allocate_lock()  # threading.Lock itself, without importing threading
_installed = False


def _patch(module: "ModuleType") -> None:
    from .trtllm import patch_tensorrt_llm

    patch_tensorrt_llm(module)


def install(force: bool = False) -> bool:
    """Install the patch (now or at TensorRT-LLM's import) if the environment switches liveness
    on, or always with ``force``. Idempotent and thread-safe. Returns whether the hook is active.

    A settings value (neither a plain word nor unset) counts as on (``autoload_wanted``): the
    engine validates it when it starts (``LivenessConfig``), so that a malformed one fails that
    start instead of leaving the server unprotected, and no interpreter pays for ``dataclasses`` here."""
    global _installed
    if not force and not autoload_wanted():
        return False
    with _lock:
        if _installed:
            return True
        patch_when_imported(_TARGET, _patch)
        _installed = True
    return True


def _pth_path(site_dir: "str | None") -> str:
    """The ``.pth`` file's path in ``site_dir`` (default: this environment's site-packages)."""
    if site_dir is None:
        import sysconfig

        site_dir = sysconfig.get_paths()["purelib"]
    return os.path.join(site_dir, PTH_NAME)


def write_pth(site_dir: "str | None" = None) -> str:
    """Write the ``.pth`` file that loads this module at every interpreter start (default: this
    environment's site-packages); returns its path."""
    path = _pth_path(site_dir)
    with open(path, "w") as handle:
        handle.write(PTH_LINE)
    return path


def remove_pth(site_dir: "str | None" = None) -> "str | None":
    """Remove the ``.pth`` file :func:`write_pth` wrote; its path, or ``None`` if there was none."""
    path = _pth_path(site_dir)
    try:
        os.unlink(path)
    except FileNotFoundError:
        return None
    return path


def pth_status(site_dir: "str | None" = None) -> "tuple[str, str | None]":
    """``(path, state)``: ``state`` is ``None`` when there is no file, ``"current"`` when it holds
    :data:`PTH_LINE`, ``"other"`` when it holds something else (an older line: rewrite it)."""
    path = _pth_path(site_dir)
    try:
        with open(path) as handle:
            text = handle.read()
    except FileNotFoundError:
        return path, None
    return path, "current" if text == PTH_LINE else "other"


USAGE = """usage: python -m trtllm_liveness.integrations.trtllm_autoload [--] COMMAND [ARGS...]
       python -m trtllm_liveness.integrations.trtllm_autoload -m MODULE [ARGS...]

Runs COMMAND (any program: trtllm-serve, python -c ..., a shell script) with TensorRT-LLM worker
liveness switched on in every Python it starts: TRTLLM_WORKER_LIVENESS=1 unless already set (its
settings form, key=value,... or @file, is kept), and this package's sitecustomize first on
PYTHONPATH. The command replaces this process (same pid). The value is checked first, with the
parser an engine runs ('trtllm-liveness config check' prints what it sets): an invalid one starts
nothing and names the bad key and value.
Exit status: the command's; 78 (EX_CONFIG) for an invalid TRTLLM_WORKER_LIVENESS, 127 when
COMMAND is not found, 2 for a usage error.
"""

EXIT_NOT_FOUND = 127  # the shell's status for a command not found


def _say(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def launch_env(environ: "dict[str, str]") -> "dict[str, str]":
    """The environment a launched command gets: switch on unless set, our ``sitecustomize`` first."""
    env = dict(environ)
    env.setdefault(ENV_VAR, "1")  # running through this launcher means "on"
    rest = [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry and entry != SITE_DIR]
    env["PYTHONPATH"] = os.pathsep.join([SITE_DIR, *rest])
    return env


def launch_setting(who: str, hint: str = "") -> "tuple[dict[str, str], LivenessConfig] | int":
    """For a launcher (:func:`main`, ``trtllm-liveness launch``): the environment its command gets
    (:func:`launch_env` of this process's) and the switch value in it, parsed as an engine start
    parses it (reading ``@file``); for an invalid value, one line on stderr (``WHO: ERROR; nothing
    started`` and ``hint``) and :data:`EXIT_INVALID_SETTING` instead.

    Parsed in the launchers alone, so no other interpreter pays for ``_config``."""
    from .._config import parse_value

    env = launch_env(dict(os.environ))
    try:
        return env, parse_value(env[ENV_VAR])
    except ValueError as exc:
        _say(f"{who}: {exc}; nothing started{hint}")
        return EXIT_INVALID_SETTING


def find_command(who: str, name: str) -> "str | None":
    """Where ``name`` runs from, looked up on ``PATH`` (the launched command's, which
    :func:`launch_env` keeps); ``None`` after ``WHO: command not found: NAME`` on stderr."""
    import shutil

    found = shutil.which(name, path=os.environ.get("PATH"))
    if found is None:
        _say(f"{who}: command not found: {name}")
    return found


def main(argv: "Sequence[str] | None" = None) -> int:
    """The launcher (see :data:`USAGE`); returns only on an error (else it execs the command)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["-h"], ["--help"]):
        sys.stdout.write(USAGE)
        return 0
    if args[:1] == ["--"]:
        args = args[1:]
    if not args or args == ["-m"]:
        sys.stderr.write(USAGE)
        return 2
    script_without_x = os.sep in args[0] and os.path.isfile(args[0]) and not os.access(args[0], os.X_OK)
    if args[0] == "-m" or script_without_x:
        program, argv_out = sys.executable, [sys.executable, *args]
    else:
        found = find_command("trtllm_autoload", args[0])
        if found is None:
            return EXIT_NOT_FOUND
        program, argv_out = found, args
    prepared = launch_setting("trtllm_autoload", " (see 'trtllm-liveness config check')")
    if isinstance(prepared, int):
        return prepared
    env, config = prepared
    state = "on" if config.enabled else "off"
    _say(f"trtllm-liveness: worker liveness {state} ({ENV_VAR}={env[ENV_VAR]}) for: {' '.join(args)}")
    try:
        os.execve(program, argv_out, env)
    except OSError as exc:
        _say(f"trtllm_autoload: cannot run {args[0]}: {exc}")
        return 126

if __name__ == "__main__":
    # One module object holds the hook's state, also when the .pth has already imported it.
    from trtllm_liveness.integrations import trtllm_autoload as _autoload

    sys.exit(_autoload.main())
else:
    install()
