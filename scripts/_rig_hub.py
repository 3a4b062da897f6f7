"""The proxy's side of the host-scale rig (scripts/_host_scale.py): a real AgentHub alone, driven on stdin.

``python scripts/_rig_hub.py [ADDRESS [HEARTBEAT_TIMEOUT_S]]`` binds a real
:class:`~trtllm_liveness.multihost.AgentHub` (its default heartbeat timeout unless given) over a
real :class:`~trtllm_liveness.monitor.WorkerProcessMonitor` on ADDRESS (default 127.0.0.1), prints one JSON
line ``{"spec": <its endpoint, secret and heartbeat timeout>, "pid": <this pid>}``, then answers each
JSON command line on stdin with one JSON line (:data:`COMMANDS`). The monitor's subscriber stamps each event with
``time.monotonic()`` when it is delivered (the machine's one clock: comparable with the rig's own
stamps). The Python heap is traced (``tracemalloc``) from the hub's start until the first ``wait`` has
answered, so that the CPU windows after it run untraced. It ends at the end of its stdin (the rig
went away) or on ``{"cmd": "exit"}``; bad input is answered ``{"error": ...}``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

from trtllm_liveness import WorkerEvent
from trtllm_liveness.monitor import WorkerProcessMonitor
from trtllm_liveness.multihost import AgentHub


class RigHub:
    """The hub, its monitor and the events it delivered; one command at a time (the main thread)."""

    def __init__(self, bind: str, heartbeat_timeout_s: float | None = None) -> None:
        self.monitor = WorkerProcessMonitor()
        self.events: list[list[Any]] = []
        self._lock = threading.Lock()
        self.monitor.subscribe(self._on_event)
        hub = AgentHub(self.monitor, bind=bind) if heartbeat_timeout_s is None else \
            AgentHub(self.monitor, bind=bind, heartbeat_timeout_s=heartbeat_timeout_s)
        self.hub = hub.start()
        import zmq.utils.monitor  # noqa: F401  (what the hub's thread imports as it starts: not the hosts')

        self.fds_before = len(os.listdir("/proc/self/fd"))
        tracemalloc.start()
        self.heap_before = tracemalloc.get_traced_memory()[0]

    def _on_event(self, event: WorkerEvent) -> None:
        at = time.monotonic()
        with self._lock:
            self.events.append([event.identity.rank, event.identity.pid, event.kind.value, event.identity.hostname, at])

    def wait(self, command: dict[str, Any]) -> dict[str, Any]:
        """Until ``hosts`` hosts are connected (at most ``timeout`` s): how many are, and the heap
        and descriptors the hub added for them (the trace then stops)."""
        want, deadline = int(command["hosts"]), time.monotonic() + float(command.get("timeout", 60))
        while self._connected() < want and time.monotonic() < deadline:
            time.sleep(0.05)
        out: dict[str, Any] = {"hosts": self._connected(), "fds": len(os.listdir("/proc/self/fd")) - self.fds_before}
        if tracemalloc.is_tracing():
            out["heap_kib"] = (tracemalloc.get_traced_memory()[0] - self.heap_before) / 1024
            tracemalloc.stop()
        return out

    def _connected(self) -> int:
        return sum(view.connection == "connected" for view in self.hub.hosts())

    def hosts(self, _command: dict[str, Any]) -> dict[str, Any]:
        views = self.hub.hosts()
        return {"connected": sum(v.connection == "connected" for v in views), "hosts": len(views),
                "ranks": sum(len(v.ranks) for v in views)}

    def check(self, command: dict[str, Any]) -> dict[str, Any]:
        """The median cost of one ``find_dead_worker()`` over every rank the hub merged, in us."""
        samples = []
        for _ in range(int(command.get("calls", 2000))):
            t0 = time.perf_counter_ns()
            self.monitor.find_dead_worker()
            samples.append(time.perf_counter_ns() - t0)
        return {"us": statistics.median(samples) / 1000}

    def events_since(self, command: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            return {"events": self.events[int(command.get("since", 0)):]}


    def snapshot(self, command: dict[str, Any]) -> dict[str, Any]:
        """The whole engine's snapshot (:meth:`AgentHub.snapshot`, stacks on, as a fatal verdict
        takes it; ``stacks_timeout``: the agents' stacks bound, default the hub's), timed: ms, the
        ranks whose stacks came back, and each host's outcome."""
        bound = command.get("stacks_timeout")
        t0 = time.perf_counter()
        if bound is None:
            hosts = self.hub.snapshot(float(command.get("timeout", 5.0)))
        else:
            hosts = self.hub.snapshot(float(command.get("timeout", 5.0)), stacks_timeout_s=float(bound))
        ms = (time.perf_counter() - t0) * 1000
        ranks = [rank for host in hosts for rank in host.ranks]
        with_stacks = sum(rank.stacks is not None and rank.stacks.status.value == "taken" for rank in ranks)
        return {"ms": ms, "ranks": len(ranks), "ranks_with_stacks": with_stacks,
                "outcomes": sorted({host.outcome for host in hosts})}


COMMANDS: dict[str, Callable[[RigHub, dict[str, Any]], dict[str, Any]]] = {
    "wait": RigHub.wait, "hosts": RigHub.hosts, "check": RigHub.check, "events": RigHub.events_since,
    "snapshot": RigHub.snapshot,
}


def main() -> int:
    rig = RigHub(sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1",
                 float(sys.argv[2]) if len(sys.argv) > 2 else None)
    hub = rig.hub
    spec = {"endpoint": hub.endpoint, "secret": hub.secret.hex(), "heartbeat_timeout_s": hub.heartbeat_timeout_s}
    print(json.dumps({"spec": spec, "pid": os.getpid()}), flush=True)
    try:
        for line in sys.stdin:
            try:
                command = json.loads(line)
                if command.get("cmd") == "exit":
                    break
                answer = COMMANDS[command["cmd"]](rig, command)
            except (ValueError, KeyError, TypeError) as exc:
                answer = {"error": f"{type(exc).__name__}: {exc}"}
            print(json.dumps(answer), flush=True)
    finally:
        rig.hub.close()
        rig.monitor.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
