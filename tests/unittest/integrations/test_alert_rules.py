"""The example alert rules in docs/alerts.yml: valid for promtool, firing as documented, on real metric names."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.facilities import needs, require_facility

ROOT = Path(__file__).resolve().parents[3]
RULES = ROOT / "docs" / "alerts.yml"
RULE_TESTS = ROOT / "tests" / "unittest" / "promtool" / "alerts_test.yml"

pytestmark = [pytest.mark.timeout(60)]


def promtool(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("promtool")
    assert binary is not None
    return subprocess.run([binary, *args], cwd=cwd, capture_output=True, text=True, timeout=30, check=False)


@needs("promtool")
def test_promtool_check_rules_accepts_the_example_rules() -> None:
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 5 rules found" in result.stdout


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


def test_rules_use_only_metric_names_the_package_exports() -> None:
    require_facility("prometheus")
    from trtllm_liveness.integrations.prometheus import LivenessMetrics

    metrics = LivenessMetrics()
    try:
        # Sample names, and family names from TYPE lines (the state gauge has no samples without a monitor).
        exported = set(re.findall(r"^(?:# TYPE )?(trtllm_liveness_\w+)", metrics.exposition(), re.MULTILINE))
    finally:
        metrics.close()
    used = set(re.findall(r"\btrtllm_liveness_\w+", RULES.read_text()))
    assert used, "no liveness metric in the rules"
    assert used <= exported, used - exported
    tested = set(re.findall(r"\btrtllm_liveness_\w+", RULE_TESTS.read_text()))
    assert tested <= exported, tested - exported
