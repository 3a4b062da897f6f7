"""docs/configuration.md against the code: every ``LivenessConfig`` field with its real default, and
every environment variable name the package's source reads or sets."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from trtllm_liveness import LivenessConfig
from trtllm_liveness._config import format_setting

pytestmark = [pytest.mark.timeout(30)]

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "configuration.md"
PACKAGE = ROOT / "trtllm_liveness"

# Where the source names an environment variable: a lookup in an environment mapping, a module
# constant whose name says it holds one, or a literal of this package's or upstream's prefixes.
_NAME = r"\"([A-Z][A-Za-z0-9_]{2,})\""
_ENV_PATTERNS = (
    re.compile(r"\benv(?:iron)?\b(?:\.get|\.setdefault|\.pop)?\s*[\(\[]\s*" + _NAME),
    re.compile(r"^\s*[A-Z0-9_]*(?:ENV|VAR)[A-Z0-9_]*\s*(?::\s*\w+\s*)?=\s*" + _NAME, re.MULTILINE),
    re.compile(r"\"((?:TRTLLM|TLLM)_[A-Z0-9_]+)\""),
)


def settings_table() -> dict[str, str]:
    """The table under "## Settings": setting -> default as written (backticks removed)."""
    section = DOC.read_text().split("## Settings", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        match = re.match(r"\| `(\w+)` \| ([^|]+) \|", line)
        if match:
            rows[match.group(1)] = match.group(2).strip().strip("`")
    return rows


def environment_names_in_source() -> set[str]:
    names: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        for pattern in _ENV_PATTERNS:
            names.update(pattern.findall(text))
        if path.name == "_mpi_env.py":  # the demo's Open MPI defaults: a mapping of variable names
            from trtllm_liveness.demo._mpi_env import MPI_ENV_DEFAULTS

            names.update(MPI_ENV_DEFAULTS)
    return names


def test_every_setting_is_documented_with_its_real_default() -> None:
    documented = settings_table()
    fields = {spec.name: spec.default for spec in dataclasses.fields(LivenessConfig)}
    assert list(documented) == list(fields), "the table must list every field, in the class's order"
    for name, default in fields.items():
        expected = format_setting(default) or "(empty)"
        assert documented[name] == expected, f"{name}: documented {documented[name]!r}, the code says {expected!r}"


def test_every_environment_variable_of_the_source_is_documented() -> None:
    names = environment_names_in_source()
    # The scan finds what it must (a broken pattern would make this test pass on nothing).
    assert {"TRTLLM_WORKER_LIVENESS", "TRTLLM_LIVENESS_QUARANTINE_DIR", "TRTLLM_LIVENESS_OUTCOME",
            "TRTLLM_LIVENESS_PROXY_WATCH", "TRTLLM_LIVENESS_QUARANTINE_REASON", "PROMETHEUS_MULTIPROC_DIR",
            "NODE_NAME", "SLURMD_NODENAME", "OMPI_MCA_mpi_ft_enable", "PYTHONPATH"} <= names, names
    text = DOC.read_text()
    missing = sorted(name for name in names if f"`{name}`" not in text)
    assert missing == [], f"read or set by trtllm_liveness/ but not in {DOC.name}: {missing}"


def test_the_recommended_server_settings_are_valid() -> None:
    from trtllm_liveness._config import parse_value

    value = re.search(r"For a server: `([^`]+)`", DOC.read_text())
    assert value is not None
    config = parse_value(value.group(1))
    assert config.exit_on_fatal and config.stall_timeout_s == 120
