"""``scripts/soak_healthy.py --smoke --families cpu-throttle,memory --json``: a hard but healthy
condition raises no verdict, and the real fault after it is reported with its expected kind;
nothing is left behind.

The CI smoke of the healthy-chaos soak: the two families no other test covers, once each, 3 s of
its condition on fresh test hosts, then its real fault. The others' look-alikes have tests of
their own: slow I/O in ``D`` (``monitor/test_wedge.py``), short stops
(``integrations/test_stopped_rank.py``), a lossy management link (``test_lossy_network.py``), a
management outage (``test_agents.py``); ``soak_healthy.py`` runs all six, for 10 minutes. The
counts only, never a time against a bound (``real_faults_reported``: the expected verdicts;
whether each came within its bound is the script's own target, ``real_faults_detected``, proven on
a quiet machine).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.facilities import needs
from tests.support.process_tracker import ProcessTracker
from tests.support.waits import WAIT_SCALE

pytestmark = [pytest.mark.real_process, pytest.mark.timeout(420),
              needs("testhosts", "mpi", "fuse", "memcg", "cpucg", "nftables")]

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "scripts" / "soak_healthy.py"
FAMILIES = {"cpu-throttle", "memory"}


def test_the_smoke_soak_has_no_false_verdict_and_reports_every_real_fault(procs: ProcessTracker) -> None:
    argv = [sys.executable, str(SCRIPT), "--smoke", "--families", ",".join(sorted(FAMILIES)), "--json"]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    procs.popens.append(proc)
    procs.track(proc.pid)
    out, err = proc.communicate(timeout=360 * WAIT_SCALE)
    text = out.decode()
    assert text.strip(), err.decode()[-3000:]
    result = json.loads(text.strip().splitlines()[-1])
    context = f"{text[-6000:]}\n{err.decode()[-3000:]}"
    rounds = result["rounds"]
    assert {r["family"] for r in rounds} == FAMILIES and len(rounds) == len(FAMILIES), context
    assert all(not r["error"] for r in rounds), context  # every round ran
    assert result["false_verdicts"] == 0, context
    assert result["healthy_seconds"] >= result["healthy_target_s"] >= 3 * len(FAMILIES), context
    assert all(r["iterations"] > 0 for r in rounds), context  # the engine served under every condition
    assert result["real_faults_injected"] == len(FAMILIES), context
    assert result["real_faults_reported"] == result["real_faults_injected"], context
    assert all(r["kind"] == r["expected"] for r in rounds), context
    assert result["leftovers"] == [] and all(r["leftovers"] == [] for r in rounds), context
