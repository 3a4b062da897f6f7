"""``trtllm-liveness demo --hosts N --fault remote-kill|host-crash|partition|remote-wedge``.

Runs, from a checkout, the upstream-shaped engine (the fake TensorRT-LLM main tree of tests/fakes,
``MpiCommSession`` under a real ``mpirun``) across N test hosts made of namespaces on this machine
(tests/helpers/testhosts.py: root, ``ip``, ``nsenter``, ``unshare``), with the extension on and one
request in flight; injects the fault on hostB and prints the timeline: the fault, the engine's fatal
error (host, rank, pid, cause), the pending request failed, health false, and what the bounded
shutdown reported for each host. Everything it makes (namespaces, veths, cgroups) is removed on
every exit path. The test hosts and the fakes are test code, not installed with the package: hence
the checkout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

HOST_FAULTS = ("remote-kill", "host-crash", "partition", "remote-wedge")
_REPO = Path(__file__).resolve().parents[2]


def run(args: argparse.Namespace) -> int:
    if args.fault not in HOST_FAULTS:
        print(f"--hosts takes --fault {'|'.join(HOST_FAULTS)}, not {args.fault}", file=sys.stderr)
        return 2
    if not 2 <= args.hosts <= 6:
        print("--hosts must be between 2 and 6", file=sys.stderr)
        return 2
    if not (_REPO / "tests" / "helpers" / "multihost_engine.py").is_file():
        print("the multi-host demo runs from a checkout (its test hosts and the upstream-shaped fakes are in "
              "tests/)", file=sys.stderr)
        return 2
    sys.path.insert(0, str(_REPO))
    from tests.helpers import multihost_engine as engine
    from tests.helpers.testhosts import TestHosts, unavailable

    reason = unavailable()
    if reason is not None:
        print(f"cannot make test hosts here: {reason}", file=sys.stderr)
        return 2
    names = tuple(f"host{chr(ord('A') + index)}" for index in range(args.hosts))
    layout = tuple((name, 2 if name in ("hostA", "hostB") else 1) for name in names)
    with TestHosts(names) as hosts:
        settings = "d_state_timeout_s=2,shutdown_term_s=1,shutdown_kill_s=1"
        job, ready = engine.start_engine(hosts, layout=layout, liveness=settings)
        view = {rank: f"{host}:{pid}" for rank, (_state, host, pid, _method) in sorted(ready["hosts"].items())}
        victim_rank = 3  # hostB's second rank: watched by hostB's agent (rank 2)
        from ._faults import FreezerGroup

        group = FreezerGroup()
        try:
            t0 = _inject(hosts, group, args.fault, engine.pid_on(ready, victim_rank))
            fatal = engine.wait_fatal(job, t0, 30)
            stops: list[dict[str, Any]] = []
            if job.wait_for(lambda lines: any(line.startswith('{"shutdown_s"') for line in lines), 30):
                stops = engine.record(job, '{"shutdown_s"')["host_stops"]
        finally:
            group.remove()  # thawed first: a frozen process would keep its host's PID 1 from ending
        result = {"fault": args.fault, "hosts": list(names), "ranks": view, "detected_ms": fatal.ms,
                  "kind": fatal.kind, "rank": fatal.rank, "host": fatal.host, "message": fatal.message,
                  "pending_request_failed": fatal.pending_failed, "host_stops": stops}
        job.kill()
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{len(names)} test hosts, ranks (host:pid in its host): {view}; the proxy is rank 0 on hostA")
        print(f"  0.0 ms  fault: {args.fault} on hostB")
        if fatal.ms is None:
            print("  nothing detected within 30 s")
        else:
            print(f"{fatal.ms:6.1f} ms  engine fatal error ({fatal.kind}, rank {fatal.rank} on {fatal.host}): "
                  f"{fatal.message}")
            print(f"          pending request failed: {fatal.pending_failed}; health: false")
        for stop in stops:
            print(f"          shutdown, host {stop['host']}: {stop['outcome']}"
                  f"{' (' + stop['detail'] + ')' if stop['detail'] else ''}")
    return 0 if fatal.ms is not None else 1


def _inject(hosts: Any, group: Any, fault: str, victim_pid: int) -> float:
    import os
    import signal

    if fault == "remote-kill":
        fd, _pid = hosts.pidfd_of("hostB", victim_pid)
        try:
            t0 = time.monotonic()
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        finally:
            os.close(fd)
        return t0
    if fault == "remote-wedge":
        t0 = time.monotonic()
        group.freeze([hosts.root_pid("hostB", victim_pid)])
        return t0
    t0 = time.monotonic()
    (hosts.crash if fault == "host-crash" else hosts.partition)("hostB")
    return t0
