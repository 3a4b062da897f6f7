"""The growth table of scripts/bench_detection.py: how each cost grows with the engine.

Columns: 8, 64, 256 and 1024 ranks watched on one host (one monitor over local sleepers:
``growth_<metric>_<n>``), then 4, 18 and 128 hosts of 4 ranks (scripts/_host_scale.py: the real
agent code over sleeper ranks, one machine: ``growth_<metric>_hosts_<n>``). Printed as text, and
with ``--markdown`` as the table docs/performance.md and the README show, so that regenerating
those is one command.
"""

from __future__ import annotations

from typing import Any

GROWTH_RANKS = (8, 64, 256, 1024)
GROWTH_HOSTS = (4, 18, 128)
GROWTH_METRICS = ("detect_p50_us", "detect_p99_us", "check_us", "idle_cpu_ms_per_s", "memory_kib", "fds")

# (label, metrics shown in one cell, digits); the Markdown table has the first MARKDOWN_ROWS, short
# enough for the README (its words are counted, cells included).
ROWS: tuple[tuple[str, tuple[str, ...], int], ...] = (
    ("kill -> event, p50/p99 µs", ("detect_p50_us", "detect_p99_us"), 0),
    ("one check, µs", ("check_us",), 1),
    ("idle CPU, ms/s", ("idle_cpu_ms_per_s",), 2),
    ("memory, KiB", ("memory_kib",), 0),
    ("descriptors", ("fds",), 0),
    ("each host's agent, idle CPU ms/s", ("agent_cpu_ms_per_s",), 2),
)
MARKDOWN_ROWS = 4

NOTES = (
    "Ranks columns: one monitor over that many local sleeper processes (one thread each; a real rank has ten "
    "or more, and the wedge scan reads each thread), wedge scan every 1 s; the event is the subscriber's call; "
    "a check is one `find_dead_worker()`; idle CPU is the watcher thread's; memory is the Python heap "
    "(`tracemalloc`) the monitor added.",
    "Hosts columns: the real agent hub alone in a process and that many hosts of 4 ranks, each host the real "
    "agent code (`HostAgent`) over 3 sleeper ranks. 4 hosts: real test hosts (a network, PID, UTS and mount "
    "namespace each, on a bridge; the hub on a fifth) where the machine can make them (`growth_placement_hosts_4` "
    "in the JSON says which); 18 and 128 hosts: simulated, a UTS namespace each on this machine's loopback. All "
    "share this machine's cores. 18 hosts are the 72 ranks of an NVL72 rack. The event is the hub's, through "
    "the agent and its wire; idle CPU is the hub's process, no request but progress flowing on every host (each "
    "agent's iterations once per 15 s, the interval at `stall_timeout_s=120`), minus the same hub with no host "
    "in the same run; "
    "memory and descriptors are what the hub added.",
)


def _cell(g: dict[str, Any], key: str, digits: int) -> str:
    value = g.get(key)
    return "-" if not isinstance(value, (int, float)) else f"{value:.{digits}f}"


def _cells(g: dict[str, Any], metrics: tuple[str, ...], digits: int, sep: str = " / ") -> list[str]:
    keys = [[f"growth_{m}_{n}" for m in metrics] for n in GROWTH_RANKS]
    keys += [[f"growth_{m}_hosts_{n}" for m in metrics] for n in GROWTH_HOSTS]
    return [sep.join(_cell(g, key, digits) for key in cell) for cell in keys]


def print_text(g: dict[str, Any]) -> None:
    """The table as text (``-`` where a column was not measured)."""
    columns = [str(n) for n in GROWTH_RANKS] + [f"{h} hosts" for h in GROWTH_HOSTS]
    print("growth with the engine: ranks watched on one host, then hosts (simulated: see the notes)")
    print(f"{'':46}" + "".join(f"{c:>14}" for c in columns))
    for label, metrics, digits in ROWS:
        print(f"{label:46}" + "".join(f"{c:>14}" for c in _cells(g, metrics, digits)))
    for note in NOTES:
        print(f"  {note}")


def markdown(g: dict[str, Any], command: str) -> str:
    """The table in Markdown (the first :data:`MARKDOWN_ROWS` rows), with the command that produced
    it above and the notes below, each a paragraph."""
    head = ["cost", f"{GROWTH_RANKS[0]} ranks", *map(str, GROWTH_RANKS[1:]), f"{GROWTH_HOSTS[0]} hosts",
            *(f"{h} (NVL72)" if h == 18 else str(h) for h in GROWTH_HOSTS[1:])]
    lines = [f"`{command}`:", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, metrics, digits in ROWS[:MARKDOWN_ROWS]:
        lines.append("| " + " | ".join([label, *_cells(g, metrics, digits, sep="/")]) + " |")
    for note in NOTES:
        lines += ["", note]
    return "\n".join(lines)
