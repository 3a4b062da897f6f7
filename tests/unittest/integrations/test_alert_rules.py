"""The example alert rules in docs/alerts.yml: valid for promtool, firing as documented, on real metric names."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest

from tests.support.facilities import needs, require_facility
from tests.support.process_tracker import ProcessTracker

ROOT = Path(__file__).resolve().parents[3]
RULES = ROOT / "docs" / "alerts.yml"
RULE_TESTS = ROOT / "tests" / "unittest" / "promtool" / "alerts_test.yml"
DASHBOARD = ROOT / "docs" / "grafana-dashboard.json"
OBSERVABILITY = ROOT / "docs" / "observability.md"

pytestmark = [pytest.mark.timeout(60)]


def promtool(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("promtool")
    assert binary is not None
    return subprocess.run([binary, *args], cwd=cwd, capture_output=True, text=True, timeout=30, check=False)


@needs("promtool")
def test_promtool_check_rules_accepts_the_example_rules() -> None:
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 11 rules found" in result.stdout


@needs("promtool")
def test_promtool_check_rules_rejects_a_broken_rule(tmp_path: Path) -> None:
    """The check above can fail: the same file with one expression broken is refused."""
    broken = tmp_path / "alerts.yml"
    broken.write_text(RULES.read_text().replace("> 0\n", "> \n", 1))
    result = promtool("check", "rules", str(broken))
    assert result.returncode != 0, result.stdout


@needs("promtool")
def test_rules_fire_as_documented_in_promtool_unit_tests() -> None:
    result = promtool("test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


# Series of kube-state-metrics and node-problem-detector's node condition (through kube-state-metrics)
# that the rules and the dashboard read beside the package's own; docs/observability.md lists them.
EXTERNAL_METRICS = frozenset({
    "kube_pod_container_status_last_terminated_exitcode", "kube_pod_container_status_restarts_total",
    "kube_pod_info", "kube_node_status_condition",
})
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left",
                       "group_right"})


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: identifiers left once strings, label matchers,
    ranges and grouping clauses are removed, that are neither functions (followed by "(") nor keywords."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = _GROUPING.sub(" ", text)
    return {word for word in re.findall(r"(?<![\w$.])([a-zA-Z_:][a-zA-Z0-9_:]*)\b(?!\s*\()", text)
            if word not in _KEYWORDS}


def rule_exprs() -> list[str]:
    import yaml

    document = yaml.safe_load(RULES.read_text())
    return [rule["expr"] for group in document["groups"] for rule in group["rules"]]


def dashboard_exprs() -> list[str]:
    document = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in document["panels"] for target in panel["targets"]]


def served_metric_names(procs: ProcessTracker) -> set[str]:
    """The sample names the real exporter serves over HTTP, with a monitor watching a real process
    (so the state gauge has series)."""
    require_facility("prometheus")
    from trtllm_liveness.integrations.prometheus import LivenessMetrics
    from trtllm_liveness.monitor._monitor import WorkerProcessMonitor
    from trtllm_liveness.process._identity import capture_identity

    child = procs.sleeper()
    with WorkerProcessMonitor() as monitor:
        monitor.register([capture_identity(0, child.pid)])
        monitor.start()
        metrics = LivenessMetrics(monitor)
        server, _thread = metrics.start_http_server(0, "127.0.0.1")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=10) as reply:
                text = reply.read().decode()
        finally:
            server.shutdown()
            server.server_close()
            metrics.close()
    return set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", text, re.MULTILINE))


def test_metric_name_extraction_finds_names_and_skips_functions_and_labels() -> None:
    expr = ('histogram_quantile(0.99, sum by (le, kind) (rate(a_bucket{kind="died"}[5m]))) '
            '* on (pod) group_left (node) max by (pod, node) (kube_pod_info) or vector(0) and bool b_total')
    assert metric_names(expr) == {"a_bucket", "kube_pod_info", "b_total"}


def test_rules_and_dashboard_read_only_metrics_the_exporter_serves(procs: ProcessTracker) -> None:
    served = served_metric_names(procs)
    assert {"trtllm_liveness_worker_state", "trtllm_liveness_unkillable_workers",
            "trtllm_liveness_worker_failures_total", "trtllm_liveness_detection_latency_seconds_bucket"} <= served
    documented = OBSERVABILITY.read_text()
    for source, exprs in (("docs/alerts.yml", rule_exprs()), ("docs/grafana-dashboard.json", dashboard_exprs())):
        used = set().union(*(metric_names(expr) for expr in exprs))
        assert any(name.startswith("trtllm_liveness_") for name in used), source
        unknown = sorted(used - served - EXTERNAL_METRICS)
        assert unknown == [], f"{source} reads metrics nothing serves: {unknown}"
        for name in sorted(used & EXTERNAL_METRICS):
            assert f"`{name}`" in documented, f"{name} ({source}) is not listed in {OBSERVABILITY.name}"
    tested = set(re.findall(r"\b(?:trtllm_liveness|kube)_\w+", RULE_TESTS.read_text()))
    assert tested <= served | EXTERNAL_METRICS, tested - served - EXTERNAL_METRICS


def test_every_alert_has_a_promtool_unit_test_with_input_series() -> None:
    import yaml

    alerts = {rule["alert"] for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]}
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    fired = {case["alertname"] for test in tests for case in test["alert_rule_test"] if case.get("exp_alerts")}
    assert alerts == fired, f"alerts without a unit test that makes them fire: {sorted(alerts - fired)}"
