"""``trtllm-liveness config check [VALUE]``: is a ``TRTLLM_WORKER_LIVENESS`` value valid, and what
does it set?

It runs the parser an engine runs when it starts (:class:`~trtllm_liveness.LivenessConfig`)
beforehand: in a container's image, a job script, a CI check of a manifest. :data:`_DESCRIPTION`,
the ``--help`` text, and :data:`CONFIG_STATUS_HELP` say what it prints and exits with; an unknown
key's error lists the valid ones, and ``@file`` reads the file, as the engine would.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

from .._config import ENV_VAR, LivenessConfig, changed_settings, format_setting, parse_value
from ._arg_types import JSON_HELP, add_command
from ._exit_status import EXIT_FAILED, EXIT_OK
from ._output import print_result, printable

__all__ = ["CONFIG_STATUS_HELP", "add_config_parser", "run_config"]

CONFIG_STATUS_HELP = """\
exit status:
  0    valid (also: unset, which means liveness off); the effective settings are printed
  1    invalid: the first line names the bad key and value
  2    bad arguments
"""

_DESCRIPTION = f"""\
Check a {ENV_VAR} value with the parser an engine runs when it starts, and print the
settings it gives: every key with its effective value, '*' where the value sets it (else the
default). Without VALUE, the value of {ENV_VAR} in this environment. The forms:
  1 (or true/on/yes), 0 (false/off/no), key=value[,key=value...], @/path/to/liveness.conf
docs/configuration.md lists every key, its default and its meaning.
"""


def add_config_parser(sub: Any) -> None:
    """Add the ``config`` subcommand to ``sub`` (argparse subparsers)."""
    config = add_command(sub, "config", run_config, help=f"check a {ENV_VAR} value and print the settings it gives",
                         description=_DESCRIPTION, epilog=CONFIG_STATUS_HELP)
    config.add_argument("action", choices=["check"])
    config.add_argument("value", nargs="?", default=None, metavar="VALUE",
                        help=f"the value to check (default: ${ENV_VAR})")
    config.add_argument("--json", action="store_true", help=JSON_HELP)


def run_config(args: argparse.Namespace) -> int:
    """Run ``config check``; returns the exit status."""
    given = args.value is not None
    raw: str | None = args.value if given else os.environ.get(ENV_VAR)
    source = "the value" if given else ENV_VAR
    try:
        config = parse_value(raw, source)
    except ValueError as exc:
        print_result(args.json, {"valid": False, "value": raw, "error": str(exc)}, [f"INVALID: {printable(str(exc))}"])
        return EXIT_FAILED
    changed = changed_settings(config)
    print_result(args.json, {"valid": True, "value": raw, "enabled": config.enabled, "changed": list(changed),
                             "settings": dataclasses.asdict(config)},
                 map(printable, _lines(raw, source, config, changed)))
    return EXIT_OK


def _lines(raw: str | None, source: str, config: LivenessConfig, changed: tuple[str, ...]) -> list[str]:
    what = f"{ENV_VAR}={raw!r}" if source == ENV_VAR else f"{source} {raw!r}"
    if raw is None or not raw.strip():
        head = f"VALID: {ENV_VAR if source == ENV_VAR else source} is {'unset' if raw is None else 'empty'}: " \
               "liveness off, the defaults below (the autoload launcher sets it to 1 where unset)"
    else:
        head = f"VALID: {what}: liveness {'on' if config.enabled else 'off'}"
    lines = [head, "effective settings ('*': set by the value, else the default):"]
    width = max(len(spec.name) for spec in dataclasses.fields(config))
    for spec in dataclasses.fields(config):
        value = format_setting(getattr(config, spec.name))
        lines.append(f"{'*' if spec.name in changed else ' '} {spec.name:<{width}}  {value if value else '(empty)'}")
    return lines
