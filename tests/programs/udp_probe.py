"""Round trips of UDP probes between two test hosts: what a network path delays and drops.

``python -m tests.programs.udp_probe serve PORT``: echo every datagram back (prints ``ready <its pid>``).
``python -m tests.programs.udp_probe probe ADDRESS PORT COUNT INTERVAL WAIT``: send COUNT numbered
probes, one every INTERVAL s, then wait WAIT s for the last answers; print one JSON object:
``{"sent": N, "rtt_s": [round trip of each probe answered, in probe order]}``. Standard library.
"""

from __future__ import annotations

import json
import os
import select
import socket
import struct
import sys
import time


def serve(port: int) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", port))
    sys.stdout.write(f"ready {os.getpid()}\n")
    sys.stdout.flush()
    while True:
        data, peer = sock.recvfrom(2048)
        sock.sendto(data, peer)


def probe(address: str, port: int, count: int, interval: float, wait: float) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.connect((address, port))
    sent: dict[int, float] = {}
    rtts: dict[int, float] = {}
    start = time.monotonic()
    deadline = start + count * interval + wait
    n = 0
    while True:
        now = time.monotonic()
        if n < count and now >= start + n * interval:
            sent[n] = now
            sock.send(struct.pack("!I", n))
            n += 1
            continue
        if now >= deadline:
            break
        next_send = start + n * interval if n < count else deadline
        ready, _, _ = select.select([sock], [], [], max(0.0, min(next_send, deadline) - now))
        if ready:
            try:
                data = sock.recv(2048)
            except OSError:  # an ICMP error from an earlier probe
                continue
            if len(data) == 4:
                seq = struct.unpack("!I", data)[0]
                if seq in sent and seq not in rtts:
                    rtts[seq] = time.monotonic() - sent[seq]
    print(json.dumps({"sent": n, "rtt_s": [rtts[seq] for seq in sorted(rtts)]}), flush=True)


def main(argv: list[str]) -> int:
    if argv[:1] == ["serve"] and len(argv) == 2:
        serve(int(argv[1]))
    elif argv[:1] == ["probe"] and len(argv) == 6:
        probe(argv[1], int(argv[2]), int(argv[3]), float(argv[4]), float(argv[5]))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
