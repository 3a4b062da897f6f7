"""The liveness switch, read with nothing but ``os``: what every interpreter pays for the autoload.

The autoload ``.pth`` (see :mod:`trtllm_liveness.integrations.trtllm_autoload`) runs in every
Python process of its environment (pip, MPI ranks, tokenizer workers), so the part of it that runs
while liveness is off is this module alone: one environment lookup, no thread, no at-fork hook, no
module imported (the package's ``__init__`` imports its names lazily). Importing this module has no
side effect.

``TRTLLM_WORKER_LIVENESS`` unset, empty or a false word means off and a true word means on; any
other value (``key=value[,key=value...]``, ``@file``, or malformed) is for
:meth:`~trtllm_liveness.LivenessConfig.from_env` to parse and validate (it may also say
``enabled=0``). The variable's name and the words are the same as ``_config``'s (a test checks
that both read every plain word alike); this module does not import ``_config``, whose
``dataclasses`` import alone costs several milliseconds.
"""

import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = ["ENV_VAR", "EXIT_INVALID_SETTING", "FALSE_WORDS", "TRUE_WORDS", "autoload_wanted", "switch_word"]

ENV_VAR = "TRTLLM_WORKER_LIVENESS"
TRUE_WORDS = frozenset({"1", "true", "on", "yes"})
FALSE_WORDS = frozenset({"0", "false", "off", "no"})
# What a launcher (the autoload's, ``trtllm-liveness launch``) exits with for an invalid value, having
# started nothing: sysexits' EX_CONFIG.
EXIT_INVALID_SETTING = 78


def switch_word(environ: "Mapping[str, str] | None" = None) -> "bool | None":
    """``False`` when ``ENV_VAR`` in ``environ`` (default ``os.environ``) is unset, empty or a false
    word, ``True`` for a true word (case and surrounding blanks ignored), ``None`` for anything
    else: the settings form, valid or not, which the caller parses with ``LivenessConfig``."""
    raw = (os.environ if environ is None else environ).get(ENV_VAR)
    if raw is None:
        return False
    word = raw.strip().lower()
    if not word or word in FALSE_WORDS:
        return False
    if word in TRUE_WORDS:
        return True
    return None


def autoload_wanted(environ: "Mapping[str, str] | None" = None) -> bool:
    """Whether the autoload must be imported: unless the switch is plainly off (a settings value is
    imported, so that it is validated and its errors reported as before)."""
    return switch_word(environ) is not False
