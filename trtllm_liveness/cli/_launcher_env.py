"""How the switch reaches every Python a launcher starts, on every host: ``trtllm-liveness launch``'s
environment and the launcher arguments that carry it.

The hook is installed by this package's ``sitecustomize`` (first on ``PYTHONPATH``, see
:func:`~trtllm_liveness.integrations.trtllm_autoload.launch_env`), so three variables must reach
every rank: ``PYTHONPATH``, ``TRTLLM_WORKER_LIVENESS`` and the outcome directory
(:data:`~trtllm_liveness.exit._outcome.OUTCOME_ENV`). On the launching host any launcher passes its
environment on; what each launcher needs to carry them to other hosts (Open MPI's ``-x``, an
``srun`` ``--export`` list, Hydra's whole environment) is in docs/multihost.md, after
"``trtllm-liveness launch`` is the one wrapper". Open MPI's ``-x NAME`` go right after the
launcher's name (repeating a name the user gave is harmless); ``srun --export=NIL`` cannot carry
them, as ``NONE`` cannot; anything else (``trtllm-serve`` itself, ``torchrun``, a script) is one
host, whose environment is inherited.

An ``mpirun``/``mpiexec`` is told apart by its ``--version`` (one bounded run; Open MPI says
"Open MPI", Hydra "HYDRA"); one that answers neither gets nothing added and a note.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .._switch import ENV_VAR
from ..exit._outcome import OUTCOME_ENV

__all__ = ["FORWARDED_VARS", "Forwarding", "forwarding_for", "mpi_flavour"]

FORWARDED_VARS = ("PYTHONPATH", ENV_VAR, OUTCOME_ENV)
_MPI_NAMES = ("mpirun", "mpiexec", "orterun", "prterun")
_VERSION_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Forwarding:
    """The launcher's arguments with what carries the switch to other hosts, and in words what was
    done (``how``, for the one "on" line) or why it could not be (``problem``, a note)."""

    argv: tuple[str, ...]
    env: Mapping[str, str]
    how: str
    problem: str = ""


def _is_mpi_launcher(word: str) -> bool:
    name = os.path.basename(word)
    return any(name == base or name.startswith(base + ".") or name.startswith(base + "-") for base in _MPI_NAMES)


def mpi_flavour(launcher: str, env: Mapping[str, str]) -> str:
    """``openmpi``, ``hydra`` or ``unknown``, from ``launcher --version`` (bounded; a launcher that
    cannot be run is ``unknown``: running the command itself then reports it)."""
    try:
        done = subprocess.run([launcher, "--version"], capture_output=True, text=True, errors="replace",
                              timeout=_VERSION_TIMEOUT_S, env=dict(env), stdin=subprocess.DEVNULL, check=False)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    text = (done.stdout + done.stderr).lower()
    if "open mpi" in text or "openrte" in text or "prrte" in text:
        return "openmpi"
    if "hydra" in text or "mpich" in text or "intel(r) mpi" in text:
        return "hydra"
    return "unknown"


# srun's options that take their value as the next word (``-N 2``, ``--nodes 2``); any other word
# after an option's end is the program, whose own arguments are never read.
_SRUN_SHORT_WITH_VALUE = frozenset("ABcdDeGiJLmMnNopqrStTwWx")
_SRUN_LONG_WITH_VALUE = frozenset({
    "--account", "--acctg-freq", "--bcast", "--begin", "--chdir", "--clusters", "--comment", "--constraint",
    "--container", "--core-spec", "--cores-per-socket", "--cpu-bind", "--cpu-freq", "--cpus-per-gpu",
    "--cpus-per-task", "--dependency", "--distribution", "--error", "--exclude", "--export", "--gpu-bind",
    "--gpus", "--gpus-per-node", "--gpus-per-socket", "--gpus-per-task", "--gres", "--gres-flags", "--het-group",
    "--hint", "--input", "--job-name", "--jobid", "--licenses", "--mem", "--mem-bind",
    "--mem-per-cpu", "--mem-per-gpu", "--mpi", "--network", "--nodefile", "--nodelist", "--nodes", "--ntasks",
    "--ntasks-per-core", "--ntasks-per-gpu", "--ntasks-per-node", "--ntasks-per-socket", "--output",
    "--partition", "--prolog", "--epilog", "--qos", "--reservation", "--signal", "--sockets-per-node",
    "--switches", "--task-epilog", "--task-prolog", "--thread-spec", "--threads-per-core", "--time",
    "--time-min", "--tmp", "--uid", "--gid", "--wait", "--wckey",
})


def _srun_options(argv: Sequence[str]) -> int:
    """How many words of ``argv`` (srun's arguments, without ``srun``) are srun's own options."""
    index = 0
    while index < len(argv):
        word = argv[index]
        if word in ("--", "-") or not word.startswith("-"):  # the end of the options, or the program
            return index
        takes_next = (word in _SRUN_LONG_WITH_VALUE if word.startswith("--")
                      else len(word) == 2 and word[1] in _SRUN_SHORT_WITH_VALUE)
        index += 2 if takes_next and "=" not in word else 1
    return len(argv)


def _export_value(argv: Sequence[str]) -> tuple[int, str] | None:
    """(index of the word holding the value, the value) of srun's last ``--export`` among srun's
    own options (never in the program's arguments), or None."""
    found = None
    options = _srun_options(argv)
    for index, word in enumerate(argv[:options]):
        if word.startswith("--export="):
            found = (index, word[len("--export="):])
        elif word == "--export" and index + 1 < options:
            found = (index + 1, argv[index + 1])
    return found


def _with_names(value: str) -> str | None:
    """An ``--export`` value that also carries :data:`FORWARDED_VARS`; None where it cannot."""
    items = [item for item in value.split(",") if item]
    head = items[0].upper() if items else "NONE"
    if head in ("NONE", "NIL"):
        return None
    if head == "ALL":
        return value
    names = {item.split("=", 1)[0] for item in items}
    return ",".join([*items, *(name for name in FORWARDED_VARS if name not in names)])


def _srun(argv: list[str], env: dict[str, str]) -> Forwarding:
    found = _export_value(argv[1:])
    if found is not None:
        index, value = found[0] + 1, found[1]
        widened = _with_names(value)
        if widened is None:
            return Forwarding(tuple(argv), env, "",
                              f"srun --export={value} passes none of {', '.join(FORWARDED_VARS)}: ranks on "
                              "other nodes run unprotected (use --export=ALL or list them)")
        if widened != value:
            argv[index] = f"--export={widened}" if argv[index].startswith("--export=") else widened
            return Forwarding(tuple(argv), env, "forwarded to every node: srun --export with their names")
        return Forwarding(tuple(argv), env, "forwarded to every node: srun --export=ALL")
    exported = env.get("SLURM_EXPORT_ENV")
    if exported is not None:
        widened = _with_names(exported)
        if widened is None:
            return Forwarding(tuple(argv), env, "",
                              f"SLURM_EXPORT_ENV={exported} passes none of {', '.join(FORWARDED_VARS)}: ranks "
                              "on other nodes run unprotected")
        env["SLURM_EXPORT_ENV"] = widened
    return Forwarding(tuple(argv), env, "forwarded to every node: srun exports the environment")


def forwarding_for(argv: Sequence[str], env: Mapping[str, str]) -> Forwarding:
    """What to run so that :data:`FORWARDED_VARS` of ``env`` reach every rank of ``argv``'s launcher."""
    words, environment = list(argv), dict(env)
    launcher = os.path.basename(words[0])
    if launcher == "srun":
        return _srun(words, environment)
    if not _is_mpi_launcher(words[0]):
        return Forwarding(tuple(words), environment, "")
    flavour = mpi_flavour(words[0], environment)
    if flavour == "openmpi":
        flags = [part for name in FORWARDED_VARS for part in ("-x", name)]
        return Forwarding((words[0], *flags, *words[1:]), environment,
                          f"forwarded to every host: {launcher} {' '.join(flags)}")
    if flavour == "hydra":
        return Forwarding(tuple(words), environment, f"forwarded to every host: {launcher} (Hydra) passes the "
                                                     "environment")
    return Forwarding(tuple(words), environment, "",
                      f"{launcher} --version names neither Open MPI nor MPICH/Hydra: make it pass "
                      f"{', '.join(FORWARDED_VARS)} to the ranks of other hosts")
