"""A lossy, jittery, bursty management network for test hosts (this kernel has no netem qdisc).

:func:`impair` gives chosen hosts of a started :class:`~tests.support.testhosts.TestHosts` a bad
management link (``eth0``: the liveness hub's and agents' traffic; the data network, MPI's, is left
alone), in both directions (:func:`bursts` adds runs of losses into one host):

* **loss**: nftables ``netdev`` ingress hooks drop each IPv4 frame crossing the link with
  probability ``loss_pct`` % (``numgen random mod 10000 < loss_pct * 100``, with counters): on the
  host's ``eth0`` (inside its namespace) for what comes in, where its frames reach the hub's bridge
  for what goes out; loopback traffic inside the host is untouched;
* **jitter**: the host's veth end in the hub no longer sits on the bridge: a relay process in the
  hub (``tests/programs/jitter_relay.py``) passes every frame between it and a new veth pair on the
  bridge, each frame after ``uniform(0, jitter_s)`` seconds, independently (frames may overtake
  each other, as with netem's ``delay J/2 J/2``). Every host and the head get ``gso_max_segs 1``
  on their ``eth0`` first: the relay cannot forward offloaded super-frames.

So a probe from the head to an impaired host and back is dropped with probability about
``2 * loss_pct`` % and takes ``uniform(0, J) + uniform(0, J)`` more (0 to 2J, J on average).
:func:`measure_path` measures exactly that with UDP probes (what the relay really does, also
under CPU load). The hub's veth of an impaired host is still its ``hub_veth``:
:meth:`~tests.support.testhosts.TestHosts.partition` works as before. Everything lives in the test
hosts' namespaces and goes with them (:meth:`~tests.support.testhosts.TestHosts.close`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from tests.support.testhosts import HEAD, REPO_ROOT, TestHosts, TestHostsError, _ip

NFT_TABLE = "tlh_netem"
LOSS_PCT = 1.0
JITTER_S = 0.2


@dataclass(frozen=True)
class Impairment:
    """What :func:`impair` did: the hosts, the settings, the relay (None without jitter) and its
    counters' file."""

    names: tuple[str, ...]
    loss_pct: float
    jitter_s: float
    relay: subprocess.Popen[bytes] | None
    stats_path: str

    def relay_stats(self) -> dict[str, object]:
        """The relay's counters (empty before its first report or without a relay)."""
        try:
            with open(self.stats_path) as handle:
                loaded = json.load(handle)
        except (OSError, ValueError):
            return {}
        return loaded if isinstance(loaded, dict) else {}


def unavailable() -> str | None:
    """Why impaired test hosts cannot be made here (nft missing), or None."""
    if shutil.which("nft") is None:
        return "nft (nftables) is not installed: scripts/setup.sh installs it with apt"
    return None


def _nft(netns: str, script: str, timeout: float = 10.0) -> str:
    try:
        out = subprocess.run(["nsenter", f"--net=/run/netns/{netns}", "nft", "-f", "-"], input=script,
                             capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise TestHostsError(f"nft in {netns}: no answer in {timeout} s") from exc
    if out.returncode != 0:
        raise TestHostsError(f"nft in {netns} failed (status {out.returncode}): {out.stderr.strip()}")
    return out.stdout


def loss_rules(device: str, loss_pct: float, table: str = NFT_TABLE) -> str:
    """An nftables table that drops ``loss_pct`` % of the IPv4 frames arriving on ``device``.

    An ingress hook, on purpose: a frame dropped there was already on the wire, as a lost frame is.
    A drop in the sender's own output path is not a loss: its stack is told (``EPERM``/``NET_XMIT_DROP``)
    and TCP sends the segment again at once, UDP's ``sendto`` fails."""
    per_10000 = round(loss_pct * 100)
    return (f"table netdev {table} {{\n"
            f"  chain ingress {{ type filter hook ingress device \"{device}\" priority 0; policy accept;\n"
            f"    meta protocol ip numgen random mod 10000 < {per_10000} counter drop; }}\n"
            f"}}\n")


def dropped(hosts: TestHosts, name: str) -> int:
    """Frames the loss rules of host ``name``'s link dropped so far (both directions, bursts included)."""
    total = 0
    for netns, argv in ((hosts.host(name).netns, ["list", "ruleset"]),
                        (hosts.hub, ["list", "table", "netdev", f"{NFT_TABLE}_{hosts.host(name).hub_veth}"])):
        out = subprocess.run(["nsenter", f"--net=/run/netns/{netns}", "nft", *argv], capture_output=True, text=True,
                             timeout=10, check=False)
        total += sum(int(n) for n in re.findall(r"counter packets (\d+)", out.stdout))
    return total


def impair(hosts: TestHosts, names: Sequence[str], *, loss_pct: float = LOSS_PCT,
           jitter_s: float = JITTER_S) -> Impairment:
    """Give hosts ``names`` of the started ``hosts`` a lossy (``loss_pct`` %, each way) and jittery
    (``uniform(0, jitter_s)`` s per frame, each way) link. Raises :class:`TestHostsError`."""
    reason = unavailable()
    if reason is not None:
        raise TestHostsError(reason)
    if not 0 <= loss_pct <= 100 or not 0 <= jitter_s <= 10:
        raise ValueError(f"loss_pct in [0, 100] and jitter_s in [0, 10], not {loss_pct}, {jitter_s}")
    names = tuple(names)
    for name in (HEAD, *hosts.names):
        _ip("-n", hosts.host(name).netns, "link", "set", "eth0", "gso_max_segs", "1")
    stats_path = os.path.join(hosts.workdir, "jitter-relay.json")
    pairs = []
    for name in names if jitter_s > 0 else ():
        veth = hosts.host(name).hub_veth
        inner, outer = f"j{veth}", f"k{veth}"
        _ip("-n", hosts.hub, "link", "set", veth, "nomaster")
        _ip("-n", hosts.hub, "link", "add", inner, "type", "veth", "peer", "name", outer)
        _ip("-n", hosts.hub, "link", "set", outer, "master", "br0", "up")
        _ip("-n", hosts.hub, "link", "set", inner, "up")
        pairs.append(f"{veth}:{inner}")
    for name in names if loss_pct > 0 else ():
        veth = hosts.host(name).hub_veth
        # Into the host: its eth0. Out of it: where its frames reach the bridge (with jitter the
        # relay's far end: a packet socket reads a frame before an ingress hook on the same device).
        _nft(hosts.host(name).netns, loss_rules("eth0", loss_pct))
        _nft(hosts.hub, loss_rules(f"k{veth}" if jitter_s > 0 else veth, loss_pct, f"{NFT_TABLE}_{veth}"))
    relay = _start_relay(hosts, pairs, jitter_s, stats_path) if pairs else None
    return Impairment(names, loss_pct, jitter_s, relay, stats_path)


BURST_TABLE = f"{NFT_TABLE}_bursts"


def bursts(hosts: TestHosts, name: str, *, drop: int = 2, every: int = 5) -> None:
    """Burst loss into host ``name`` (on top of :func:`impair`, or alone): of every ``every`` IPv4
    frames arriving on its management link, ``drop`` in a row are dropped (nftables ``numgen inc``:
    a deterministic pattern, so segments and their retransmissions are lost in runs, as on a
    congested or flapping link). Counted by :func:`dropped`. Raises :class:`TestHostsError`."""
    reason = unavailable()
    if reason is not None:
        raise TestHostsError(reason)
    if not 0 < drop < every <= 1000:
        raise ValueError(f"0 < drop < every <= 1000, not {drop}, {every}")
    _nft(hosts.host(name).netns,
         f"table netdev {BURST_TABLE} {{\n"
         f"  chain ingress {{ type filter hook ingress device \"eth0\" priority -1; policy accept;\n"
         f"    meta protocol ip numgen inc mod {every} < {drop} counter drop; }}\n"
         f"}}\n")


def _start_relay(hosts: TestHosts, pairs: list[str], jitter_s: float, stats_path: str) -> subprocess.Popen[bytes]:
    argv = ["nsenter", f"--net=/run/netns/{hosts.hub}", sys.executable, "-m", "tests.programs.jitter_relay",
            "--max-delay", str(jitter_s), "--stats", stats_path, *pairs]
    relay = subprocess.Popen(argv, cwd=REPO_ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": REPO_ROOT},
                             start_new_session=True)
    hosts.adopt(relay)
    line = _first_line(relay, hosts.timeout)
    if line != b"ready\n":
        err = b""
        if relay.poll() is not None and relay.stderr is not None:
            err = relay.stderr.read() or b""
        raise TestHostsError(f"the jitter relay did not start: {line!r} {err.decode(errors='replace')}")
    return relay


def _first_line(popen: subprocess.Popen[bytes], timeout: float) -> bytes:
    assert popen.stdout is not None
    ready, _, _ = select.select([popen.stdout], [], [], timeout)
    return popen.stdout.readline() if ready else b""


@dataclass(frozen=True)
class PathMeasure:
    """UDP probes from the head to a host and back: how many went, the round trips of those answered."""

    sent: int
    rtt_s: tuple[float, ...]

    @property
    def lost_pct(self) -> float:
        return 100.0 * (self.sent - len(self.rtt_s)) / self.sent if self.sent else 0.0

    def quantile(self, q: float) -> float | None:
        values = sorted(self.rtt_s)
        return values[min(len(values) - 1, int(q * len(values)))] if values else None


PROBE_PORT = 47123


def measure_path(hosts: TestHosts, name: str, count: int = 500, interval: float = 0.002,
                 wait: float = 1.5) -> PathMeasure:
    """``count`` UDP probes from the head to host ``name`` (an echo server there) and back."""
    server = subprocess.Popen(hosts.host(name).nsenter_argv([sys.executable, "-m", "tests.programs.udp_probe", "serve",
                                                             str(PROBE_PORT)], wd=REPO_ROOT),
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              env={**os.environ, "PYTHONPATH": REPO_ROOT}, start_new_session=True)
    hosts.adopt(server)
    server_pid = 0
    try:
        ready = _first_line(server, hosts.timeout).split()
        if len(ready) != 2 or ready[0] != b"ready":
            raise TestHostsError(f"the UDP echo server on {name} did not start")
        server_pid = int(ready[1])
        argv = [sys.executable, "-m", "tests.programs.udp_probe", "probe", hosts.address_of(name), str(PROBE_PORT),
                str(count), str(interval), str(wait)]
        out = subprocess.run(hosts.host(HEAD).nsenter_argv(argv, wd=REPO_ROOT), capture_output=True, text=True,
                             timeout=count * interval + wait + 30, check=False,
                             env={**os.environ, "PYTHONPATH": REPO_ROOT}, stdin=subprocess.DEVNULL)
        if out.returncode != 0:
            raise TestHostsError(f"UDP probes to {name} failed: {out.stderr.strip()[-500:]}")
        result = json.loads(out.stdout.strip().splitlines()[-1])
        return PathMeasure(int(result["sent"]), tuple(float(v) for v in result["rtt_s"]))
    finally:
        if server_pid:  # nsenter forked it into the host's PID namespace: end it there
            with contextlib.suppress(ProcessLookupError):
                hosts.kill(name, server_pid)
        server.kill()
        server.wait(10)
