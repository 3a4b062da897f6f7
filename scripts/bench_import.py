#!/usr/bin/env python3
"""Benchmark what the autoload ``.pth`` costs every interpreter of an environment.

A throwaway venv (no pip, removed at the end) gets a path file that puts this repository on
``sys.path`` and the autoload ``.pth`` from ``write_pth``. Its interpreter runs ``-c pass`` in three
configurations, interleaved in a shuffled order in every round, median of ``--reps`` runs each:

- ``base``: the autoload ``.pth`` switched out (renamed);
- ``off``: the ``.pth`` in, ``TRTLLM_WORKER_LIVENESS`` unset;
- ``on``: the ``.pth`` in, ``TRTLLM_WORKER_LIVENESS=1``, no ``tensorrt_llm`` imported (every child
  of a launcher that switches liveness on).

``import_off_ms`` and ``import_on_no_engine_ms`` are those medians minus ``base``'s. Then one start
per configuration reports the modules of this package it imported, the threads it runs and, with an
``os.register_at_fork`` recorder loaded by a ``.pth`` that ``site`` runs before all others, the
at-fork hooks registered during start-up: ``at_fork_hooks_off`` is that count with the ``.pth``
and liveness off minus the count without it (hooks of the standard library that our imports pull
in count too). ``on_settings`` (``TRTLLM_WORKER_LIVENESS=d_state_timeout_s=30``, which must be
validated when the hook is installed) is reported for information, without a target.

Targets: import_off_ms <= 2, modules_off <= 2, at_fork_hooks_off == 0, import_on_no_engine_ms <= 5.

Usage: scripts/bench_import.py [--json] [--reps N]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

from tests.support.autoload_site import REPORT, AutoloadSite, StartupReport, throwaway_site

RUN_TIMEOUT_S = 60.0
MIN_REPS = 20


@dataclass(frozen=True)
class Config:
    name: str
    autoload: bool
    liveness: str | None


BASE = Config("base", autoload=False, liveness=None)
OFF = Config("off", autoload=True, liveness=None)
ON = Config("on", autoload=True, liveness="1")
ON_SETTINGS = Config("on_settings", autoload=True, liveness="d_state_timeout_s=30")
CONFIGS = (BASE, OFF, ON, ON_SETTINGS)


@dataclass(frozen=True)
class Startup:
    """One configuration's start-up figures."""

    median_ms: float
    report: StartupReport
    report_base: StartupReport


def _run(site: AutoloadSite, config: Config, code: str) -> tuple[float, str]:
    site.autoload(config.autoload)
    start = time.perf_counter()
    done = subprocess.run(site.argv(code), env=site.env(config.liveness), capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, check=False)
    elapsed_ms = (time.perf_counter() - start) * 1000.0
    if done.returncode != 0 or done.stderr.strip():
        raise RuntimeError(f"{config.name}: exit {done.returncode}, stderr: {done.stderr.strip()}")
    return elapsed_ms, done.stdout


def _report(site: AutoloadSite, config: Config) -> StartupReport:
    return StartupReport.parse(_run(site, config, REPORT)[1].strip().splitlines()[-1])


def measure(site: AutoloadSite, reps: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {config.name: [] for config in CONFIGS}
    for config in CONFIGS:  # warm-up: byte-code caches, page cache
        _run(site, config, "pass")
    order = list(CONFIGS)
    for _ in range(reps):
        random.shuffle(order)
        for config in order:
            times[config.name].append(_run(site, config, "pass")[0])
    return times


def _hooks(report: StartupReport) -> int:
    assert report.at_fork_calls is not None, "the fork probe did not load"
    return len(report.at_fork_calls)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object after the table")
    parser.add_argument("--reps", type=int, default=30,
                        help=f"runs per configuration (default 30, at least {MIN_REPS})")
    args = parser.parse_args()
    reps = max(args.reps, MIN_REPS)

    t0 = time.monotonic()
    with throwaway_site() as site:
        times = measure(site, reps)
        reports = {config.name: _report(site, config) for config in CONFIGS}
        site.probe(True)
        probed = {config.name: _report(site, config) for config in CONFIGS}
        site.probe(False)
    total = time.monotonic() - t0

    medians = {name: statistics.median(values) for name, values in times.items()}
    base = reports["base"]
    hooks_base = _hooks(probed["base"])
    print(f"autoload .pth start-up cost: python -c pass, {reps} interleaved runs per configuration")
    print(f"{'config':<12} {'median ms':>10} {'minus base':>11} {'pkg modules':>12} {'stdlib+ modules':>16} "
          f"{'at-fork hooks':>14} {'threads':>8}")
    for config in CONFIGS:
        name = config.name
        report = reports[name]
        extra_stdlib = len(report.modules - base.modules - report.package_modules)
        print(f"{name:<12} {medians[name]:>10.2f} {medians[name] - medians['base']:>11.2f} "
              f"{len(report.package_modules):>12} {extra_stdlib:>16} {_hooks(probed[name]) - hooks_base:>14} "
              f"{report.os_threads:>8}")
    for name in ("off", "on"):
        print(f"{name}: package modules {sorted(reports[name].package_modules)}; "
              f"at-fork hooks by {[list(call) for call in probed[name].at_fork_calls or ()][hooks_base:]}")

    results = {
        "import_off_ms": round(medians["off"] - medians["base"], 3),
        "modules_off": len(reports["off"].package_modules),
        "at_fork_hooks_off": _hooks(probed["off"]) - hooks_base,
        "import_on_no_engine_ms": round(medians["on"] - medians["base"], 3),
    }
    targets = {
        "import_off_ms": results["import_off_ms"] <= 2.0,
        "modules_off": results["modules_off"] <= 2,
        "at_fork_hooks_off": results["at_fork_hooks_off"] == 0,
        "import_on_no_engine_ms": results["import_on_no_engine_ms"] <= 5.0,
    }
    limits = {"import_off_ms": "<= 2", "modules_off": "<= 2", "at_fork_hooks_off": "== 0",
              "import_on_no_engine_ms": "<= 5"}
    for key, passed in targets.items():
        print(f"{'PASS' if passed else 'FAIL'} {key} = {results[key]} (target {limits[key]})")
    print(f"total {total:.1f}s")

    if args.json:
        out = {
            **results,
            "reps": reps,
            "base_ms": round(medians["base"], 3),
            "threads_off": reports["off"].os_threads - base.os_threads,
            "stdlib_modules_off": len(reports["off"].modules - base.modules - reports["off"].package_modules),
            "modules_on_no_engine": len(reports["on"].package_modules),
            "at_fork_hooks_on_no_engine": _hooks(probed["on"]) - hooks_base,
            "tensorrt_llm_imported_on": any(m.split(".")[0] == "tensorrt_llm" for m in reports["on"].modules),
            "import_on_settings_no_engine_ms": round(medians["on_settings"] - medians["base"], 3),
            "all_targets_met": all(targets.values()),
            "total_s": round(total, 2),
        }
        print(json.dumps(out))
    return 0 if all(targets.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
