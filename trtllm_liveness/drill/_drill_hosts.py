"""``trtllm-liveness drill --hosts``: the engine across hosts, started as the README's multi-host
line starts one, and the rank of another host its fault goes to.

docs/drill.md ("Across hosts") gives the launch line and the rank hit. In it ``launch`` carries the
hook and the settings to every host (``mpirun -x``), ``trtllm-llmapi-launch`` runs the engine in
rank 0 and makes the other ranks its MPI workers. The fault is never the agent's own rank's (the
agent reports the fault and, for a wedge, thaws it); that agent makes it
(:mod:`trtllm_liveness.drill._drill_faults`).
"""

from __future__ import annotations

import re
import shlex
import sys

from ._drill_records import DrillRank, EngineReady, choose_victim

__all__ = ["launch_argv", "parse_hosts", "remote_victim"]

_HOST_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")


def parse_hosts(value: str) -> tuple[tuple[str, int], ...]:
    """``node1:4,node2:4`` (``mpirun --host``'s form; a host without ``:N`` has 1 slot) as
    ``((host, slots), ...)``. Raises ``ValueError`` naming the bad entry."""
    hosts: list[tuple[str, int]] = []
    for entry in value.split(","):
        name, _, slots = entry.strip().partition(":")
        if not _HOST_RE.fullmatch(name) or (slots and not (slots.isdigit() and 1 <= int(slots) <= 4096)):
            raise ValueError(f"--hosts: bad entry {entry!r}: want HOST or HOST:SLOTS (as mpirun --host)")
        if any(name == seen for seen, _ in hosts):
            raise ValueError(f"--hosts: {name} is named twice")
        hosts.append((name, int(slots) if slots else 1))
    if len(hosts) < 2:
        raise ValueError("--hosts: name at least two hosts (the proxy's and one whose rank is hit)")
    return tuple(hosts)


def launch_argv(hosts: tuple[tuple[str, int], ...], mpirun: str, mpirun_args: str, launcher: str) -> list[str]:
    """What goes in front of the engine's ``python -m ...``: the README's multi-host line."""
    total = sum(slots for _, slots in hosts)
    return [sys.executable, "-m", "trtllm_liveness.cli", "launch", "--", mpirun, "--host",
            ",".join(f"{name}:{slots}" for name, slots in hosts), "-n", str(total), *shlex.split(mpirun_args),
            *shlex.split(launcher)]


def remote_victim(ready: EngineReady, wanted: int | None) -> DrillRank | str:
    """The rank of another host to hit (``wanted``, or the highest such rank), or why there is none."""
    candidates = [rank for rank in ready.ranks if rank.method == "agent" and rank.rank not in ready.agents
                  and rank.start_time is not None]
    return choose_victim(candidates, wanted,
                         where="a rank of another host outside its agent's own",
                         also=f"; the agents' ranks: {list(ready.agents)}",
                         none="no rank of a host other than the proxy's runs outside that host's agent: give such "
                              "a host at least 2 slots")
