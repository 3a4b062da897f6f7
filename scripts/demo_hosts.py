"""The multi-host demo: a real fault on one of N test hosts, and the timeline of what follows.

``.venv/bin/python scripts/demo_hosts.py --hosts N --fault FAULT [--json]``, FAULT one of ``remote-kill``,
``stop``, ``host-crash``, ``partition``, ``remote-wedge``.

Runs, from a checkout, the upstream-shaped engine (the fake TensorRT-LLM main tree of tests/fakes,
``MpiCommSession`` under a real ``mpirun``) across N test hosts made of namespaces on this machine
(tests/support/testhosts.py: root, ``ip``, ``nsenter``, ``unshare``), with the extension on and one
request in flight (tests/support/multihost_engine.py); injects the fault on hostB and prints the
timeline: the fault, the engine's fatal error line (host, rank, pid, cause, evidence), the pending
request failed, and what the bounded shutdown reported for each host. ``stop`` SIGSTOPs rank 3 on
hostB (beside hostB's agent, rank 2) while every step waits for every rank: the engine stalls,
and the demo also prints the fatal verdict's snapshot of every rank, taken by each host's agent
before the stop, which names the stopped rank and its host. Everything it makes (namespaces,
veths, cgroups) is removed on every exit path. The test hosts and the fakes are test code, not
installed with the package: hence a script of the checkout (``bash scripts/demo.sh --hosts N`` runs it).
"""

from __future__ import annotations

import argparse
import json
import sys

HOST_FAULTS = ("remote-kill", "stop", "host-crash", "partition", "remote-wedge")


def run(args: argparse.Namespace) -> int:
    if args.fault not in HOST_FAULTS:
        print(f"--hosts takes --fault {'|'.join(HOST_FAULTS)}, not {args.fault}", file=sys.stderr)
        return 2
    if not 2 <= args.hosts <= 6:
        print("--hosts must be between 2 and 6", file=sys.stderr)
        return 2
    from tests.support import multihost_engine as engine
    from tests.support.testhosts import unavailable
    from trtllm_liveness.diagnose._diagnosis_text import snapshot_lines
    from trtllm_liveness.exit._snapshot_record import FatalSnapshot

    reason = unavailable()
    if reason is not None:
        print(f"cannot make test hosts here: {reason}", file=sys.stderr)
        return 2
    names = tuple(f"host{chr(ord('A') + index)}" for index in range(args.hosts))
    layout = engine.layout_of(names)
    if args.fault == "remote-kill":
        fatal = engine.remote_kill(layout, victim=3)  # hostB's second rank: its agent (rank 2) sees it die
    elif args.fault == "stop":
        fatal = engine.remote_stop(names=names)
    elif args.fault == "remote-wedge":
        fatal = engine.remote_wedge(names=names)
    else:
        fatal = engine.host_fault("crash" if args.fault == "host-crash" else "partition", names, layout)
    where = ", ".join(f"{name}: {count} rank{'s' if count > 1 else ''}" for name, count in layout)
    result = {"fault": args.fault, "hosts": dict(layout), "detected_ms": fatal.ms, "kind": fatal.kind,
              "rank": fatal.rank, "host": fatal.host, "message": fatal.message,
              "pending_request_failed": fatal.pending_failed, "host_stops": fatal.host_stops,
              "fatal_line": fatal.fatal_line, "snapshot": fatal.snapshot}
    if args.json:
        print(json.dumps(result))
        return 0 if fatal.ms is not None else 1
    print(f"{len(names)} test hosts ({where}); the proxy and its agent hub: rank 0 on hostA; "
          "hostB's agent: rank 2")
    print(f"{0.0:9.1f} ms  fault: {args.fault} on hostB" + (" (rank 3 SIGSTOPped)" if args.fault == "stop" else ""))
    if fatal.ms is None:
        print("           nothing detected")
        return 1
    print(f"{fatal.ms:9.1f} ms  engine fatal error ({fatal.kind}, rank {fatal.rank} on {fatal.host}): "
          f"{fatal.fatal_line or fatal.message}")
    print(f"             pending request failed: {fatal.pending_failed}; health false")
    if args.fault == "stop":
        print("\n".join(snapshot_lines(None if fatal.snapshot is None else FatalSnapshot.from_dict(fatal.snapshot))))
    for stop in fatal.host_stops:
        unkillable = f"; unkillable: {[item[2] for item in stop['unkillable']]}" if stop["unkillable"] else ""
        print(f"             shutdown, host {stop['host']}: {stop['outcome']}"
              f"{' (' + stop['detail'] + ')' if stop['detail'] else ''}{unkillable}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/demo_hosts.py", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=3, metavar="N", help="test hosts (2 to 6; default 3)")
    parser.add_argument("--fault", choices=HOST_FAULTS, default="remote-kill", help="the fault on hostB")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
