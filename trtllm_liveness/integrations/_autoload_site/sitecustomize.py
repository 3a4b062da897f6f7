"""Installs the TensorRT-LLM liveness hook at interpreter start-up, for commands the autoload
launcher (``python -m trtllm_liveness.integrations.trtllm_autoload COMMAND``) runs.

The launcher puts this directory first on ``PYTHONPATH``; ``site`` imports the first
``sitecustomize`` it finds, which is this one. It installs the hook when the switch is not plainly
off and this interpreter can import the package (another Python the command starts, without the
package, is left alone), then imports the ``sitecustomize`` that would have run without it (a
distribution's or the user's), so nothing of theirs is lost.
"""

import os
import sys


def _install() -> None:
    try:
        from trtllm_liveness._switch import autoload_wanted
    except ImportError:  # a Python without the package: nothing to do here
        return
    if autoload_wanted():
        import trtllm_liveness.integrations.trtllm_autoload  # noqa: F401  (installs on import)


def _chain() -> None:
    # Import the next sitecustomize on sys.path (this directory left out) under the same name.
    here = os.path.dirname(os.path.abspath(__file__))
    me = sys.modules.pop(__name__, None)
    saved = list(sys.path)
    sys.path[:] = [entry for entry in saved if os.path.abspath(entry or os.curdir) != here]
    try:
        import sitecustomize  # type: ignore[import-not-found]  # noqa: F401
    except Exception as exc:
        # None found: nothing to say; theirs exists and failed: say so, as site would.
        if not (isinstance(exc, ImportError) and exc.name == "sitecustomize"):
            sys.stderr.write(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{exc!r}\n")
        if me is not None:
            sys.modules[__name__] = me
    finally:
        sys.path[:] = saved


_install()
_chain()
