"""A lossy, jittery network between the proxy and its remote hosts (tests/support/netem.py).

The rig first: an impaired host's link really drops and delays (UDP probes from the head). Then the
engine with its agents (tests/support/multihost_engine.py) at the default heartbeat timeout, hostB
and hostC behind a management link that loses 1% of the frames each way and delays each by up to
0.2 s: no false alarm in the window, and a partition of hostB (both networks) is still found.
The 60 s measurement at 1% and 0.2 s alone is ``scripts/bench_multihost.py``
(``false_alarms_netem_60s``); no timing is asserted.
"""

from __future__ import annotations

import time

import pytest

from tests.support import netem
from tests.support.facilities import needs
from tests.support.multihost_engine import DEFAULTS, Engine, timed_fatal
from tests.support.testhosts import TestHosts

pytestmark = [pytest.mark.multihost, pytest.mark.real_process, pytest.mark.mpi, needs("testhosts", "mpi", "nftables")]

WINDOW_S = 8.0  # ~10 PINGs of each agent


@pytest.mark.timeout(90)
def test_an_impaired_link_drops_and_delays(test_hosts: TestHosts) -> None:
    """1% loss each way, each frame delayed uniform(0, 0.2) s each way: round trips from the head
    spread over 0-0.4 s (median ~0.2 s) and some probes are lost; an unimpaired host answers at
    once. The delays asserted are the relay's own, a lower bound: load can only add to them."""
    impairment = netem.impair(test_hosts, ["hostB"])
    clean = netem.measure_path(test_hosts, "hostA", count=100, interval=0.005)
    bad = netem.measure_path(test_hosts, "hostB", count=500, interval=0.002)
    median_clean, median_bad = clean.quantile(0.5), bad.quantile(0.5)
    assert median_clean is not None and median_bad is not None, (clean, bad)
    assert median_bad >= median_clean + 0.1, (median_clean, median_bad)
    low, high = bad.quantile(0.1), bad.quantile(0.9)
    assert low is not None and high is not None and high - low >= 0.1, (low, high)  # spread: jitter
    assert len(bad.rtt_s) < bad.sent, "no probe of 500 lost at ~2% a round trip"
    assert netem.dropped(test_hosts, "hostB") > 0
    stats = impairment.relay_stats() or {}
    assert stats.get("oversized", 0) == 0 and stats.get("queue_full", 0) == 0, stats


@pytest.mark.timeout(120)
def test_no_false_alarm_on_a_lossy_jittery_network_and_a_partition_is_still_found(test_hosts: TestHosts) -> None:
    """The default heartbeat over the impaired links: every rank stays alive for the window; then
    hostB's link goes down and hostB is lost."""
    netem.impair(test_hosts, ["hostB", "hostC"])
    engine = Engine(test_hosts, liveness=DEFAULTS)
    quiet = timed_fatal(engine, time.monotonic(), WINDOW_S, shutdown=False)
    assert quiet.ms is None, f"false alarm: {quiet.message}\n{engine.diagnostics()}"
    test_hosts.partition("hostB")
    fatal = engine.wait_fatal()
    engine.assert_fatal(fatal, ["lost"], 2)
    assert "and no progress of the engine" in fatal["fatal"], fatal
