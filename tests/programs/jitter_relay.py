"""A delaying layer-2 relay between pairs of interfaces: every frame waits a random time before it
goes on (the jitter of a lossy test network, ``tests/support/netem.py``; this kernel has no netem).

Usage (in the namespace that holds the interfaces: the test hosts' hub)::

    python -m tests.programs.jitter_relay --max-delay 0.2 [--stats FILE] A1:B1 [A2:B2 ...]

Each frame read on ``A`` goes out on ``B`` and the reverse, ``uniform(0, max_delay)`` seconds after
it was read, each frame drawn independently (so frames may overtake each other, as netem's
``delay D/2 D/2`` does). Prints ``ready`` once its sockets are bound; ends on SIGTERM/SIGINT.

Two things a software relay must do that a bridge does not:

* a frame the sender's kernel left for the device to checksum (``TP_STATUS_CSUMNOTREADY``: veths
  pass TCP/UDP with a partial checksum) gets its IPv4 TCP/UDP checksum computed here, or the
  receiver would drop it as corrupt;
* frames larger than the MTU (segmentation offload) cannot be sent through a packet socket: the
  test hosts turn offload off (``gso_max_segs 1``) and the relay counts any that still come.

``--stats FILE`` rewrites FILE with a JSON object every second: frames forwarded, fixed, dropped
(oversized, queue full, send failed) and how late frames left after their due time (p50/p99/max
in ms: a relay starved of CPU delays more than it was asked to).
"""

from __future__ import annotations

import argparse
import collections
import heapq
import json
import os
import random
import select
import signal
import socket
import struct
import sys
import time

ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_AUXDATA = 8
PACKET_IGNORE_OUTGOING = 23
TP_STATUS_CSUMNOTREADY = 1 << 3
MAX_FRAME = 1514  # MTU 1500 + Ethernet header
MAX_QUEUED = 20000
_CHECKSUM_OFFSET = {6: 16, 17: 6}  # TCP, UDP: where the checksum sits in the L4 header


def _ones_sum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return total


def complete_checksum(frame: bytes) -> bytes:
    """``frame`` with its IPv4 TCP/UDP checksum computed (other frames unchanged)."""
    if len(frame) < 34 or frame[12:14] != b"\x08\x00":
        return frame
    ihl = (frame[14] & 0x0F) * 4
    proto = frame[23]
    offset = _CHECKSUM_OFFSET.get(proto)
    total = struct.unpack_from("!H", frame, 16)[0]
    start, end = 14 + ihl, 14 + total
    if offset is None or end > len(frame) or end - start < offset + 2:
        return frame
    segment = bytearray(frame[start:end])
    segment[offset:offset + 2] = b"\0\0"
    pseudo = frame[26:34] + struct.pack("!BBH", 0, proto, len(segment))
    checksum = ~_ones_sum(pseudo + bytes(segment)) & 0xFFFF
    if proto == 17 and checksum == 0:
        checksum = 0xFFFF
    segment[offset:offset + 2] = struct.pack("!H", checksum)
    return frame[:start] + bytes(segment) + frame[end:]


def packet_socket(ifname: str) -> socket.socket:
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)  # not the frames we send on it
    sock.setsockopt(SOL_PACKET, PACKET_AUXDATA, 1)
    sock.bind((ifname, ETH_P_ALL))
    sock.setblocking(False)
    return sock


class Relay:
    def __init__(self, pairs: list[tuple[str, str]], max_delay: float) -> None:
        self.max_delay = max_delay
        self.routes: dict[int, tuple[socket.socket, socket.socket]] = {}
        for left, right in pairs:
            a, b = packet_socket(left), packet_socket(right)
            self.routes[a.fileno()] = (a, b)
            self.routes[b.fileno()] = (b, a)
        self.queue: list[tuple[float, int, socket.socket, bytes]] = []
        self.count = 0
        self.stats = {"forwarded": 0, "checksums": 0, "oversized": 0, "queue_full": 0, "send_failed": 0}
        self.lateness: collections.deque[float] = collections.deque(maxlen=100_000)  # the latest frames'
        self.stopping = False

    def run(self, stats_path: str | None) -> None:
        poller = select.poll()
        for fd in self.routes:
            poller.register(fd, select.POLLIN)
        next_stats = time.monotonic() + 1.0
        while not self.stopping:
            now = time.monotonic()
            while self.queue and self.queue[0][0] <= now:
                due, _n, out, frame = heapq.heappop(self.queue)
                try:
                    out.send(frame)
                    self.stats["forwarded"] += 1
                    self.lateness.append(now - due)
                except OSError:  # the link is down (a partition) or the device is gone
                    self.stats["send_failed"] += 1
            if stats_path and now >= next_stats:
                self.write_stats(stats_path)
                next_stats = now + 1.0
            wait = min(next_stats - now, self.queue[0][0] - now if self.queue else 1.0)
            for fd, _events in poller.poll(max(0, int(wait * 1000) + 1)):
                self.read(*self.routes[fd])
        if stats_path:
            self.write_stats(stats_path)

    def read(self, source: socket.socket, target: socket.socket) -> None:
        for _ in range(256):
            try:
                frame, ancillary, _flags, _address = source.recvmsg(65536, socket.CMSG_SPACE(32))
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            status = 0
            for level, kind, data in ancillary:
                if level == SOL_PACKET and kind == PACKET_AUXDATA and len(data) >= 4:
                    status = struct.unpack_from("I", data)[0]
            if len(frame) > MAX_FRAME:
                self.stats["oversized"] += 1
                continue
            if len(self.queue) >= MAX_QUEUED:
                self.stats["queue_full"] += 1
                continue
            if status & TP_STATUS_CSUMNOTREADY:
                frame = complete_checksum(frame)
                self.stats["checksums"] += 1
            self.count += 1
            due = time.monotonic() + random.uniform(0.0, self.max_delay)
            heapq.heappush(self.queue, (due, self.count, target, frame))

    def write_stats(self, path: str) -> None:
        late = sorted(self.lateness)

        def q(p: float) -> float | None:
            return round(late[min(len(late) - 1, int(p * len(late)))] * 1000, 2) if late else None

        body = {**self.stats, "late_p50_ms": q(0.5), "late_p99_ms": q(0.99), "late_max_ms": q(1.0),
                "max_delay_s": self.max_delay}
        tmp = f"{path}.tmp"
        with open(tmp, "w") as handle:
            json.dump(body, handle)
        os.replace(tmp, path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-delay", type=float, required=True, help="each frame waits uniform(0, this) s")
    parser.add_argument("--stats", default=None, help="a file rewritten every second with the relay's counters")
    parser.add_argument("pairs", nargs="+", help="A:B interface pairs")
    args = parser.parse_args()
    if not 0 <= args.max_delay <= 10:
        parser.error("--max-delay must be in [0, 10]")
    pairs = []
    for pair in args.pairs:
        left, sep, right = pair.partition(":")
        if not sep or not left or not right:
            parser.error(f"not an A:B pair: {pair!r}")
        pairs.append((left, right))
    relay = Relay(pairs, args.max_delay)

    def stop(signum: int, frame: object) -> None:
        relay.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        os.nice(-10)  # the delays must be the ones drawn, also when the machine's cores are busy
    except OSError:
        pass
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    relay.run(args.stats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
