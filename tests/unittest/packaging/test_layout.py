"""The package's layout limits, read from the source tree: what a reader can rely on finding.

- at most 8 modules at the package root (the rest lives in a folder per step of the flow);
- no module over 600 lines;
- every module name unique in the package tree (``__init__.py`` and ``__main__.py`` aside);
- the product never imports the tests, and never names the test fakes (``tests.helpers``,
  ``tests/fakes``, ``_trtllm_fake_common``), comments included;
- every test module name unique across ``tests/`` (one file name per concern; ``__init__.py`` and
  ``conftest.py`` aside).
"""

from __future__ import annotations

import ast
import collections
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
PACKAGE = REPO / "trtllm_liveness"
TESTS = REPO / "tests"

MAX_ROOT_MODULES = 8
MAX_MODULE_LINES = 600
# What the product may never mention: the test support and the fakes of tensorrt_llm are test code.
FORBIDDEN_MENTIONS = ("tests.helpers", "tests/fakes", "_trtllm_fake_common")
SHARED_NAMES = {"__init__.py", "__main__.py"}
SHARED_TEST_NAMES = {"__init__.py", "conftest.py"}

pytestmark = pytest.mark.timeout(60)


def _sources(root: Path) -> list[Path]:
    return sorted(path for path in root.rglob("*.py") if "__pycache__" not in path.parts)


def _text_files(root: Path) -> list[Path]:
    return sorted(path for path in root.rglob("*") if path.is_file() and "__pycache__" not in path.parts
                  and path.suffix not in (".pyc", ".so"))


def _duplicates(paths: list[Path], root: Path, shared: set[str]) -> dict[str, list[str]]:
    by_name = collections.defaultdict(list)
    for path in paths:
        if path.name not in shared:
            by_name[path.name].append(str(path.relative_to(root)))
    return {name: where for name, where in by_name.items() if len(where) > 1}


def _imports_of_tests(path: Path) -> list[str]:
    """Where ``path`` imports ``tests`` (an import statement, or ``import_module("tests...")``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
              in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            names = [node.args[0].value]
        found += [f"line {node.lineno}: {name}" for name in names  # type: ignore[attr-defined]
                  if name == "tests" or name.startswith("tests.")]
    return found


def test_the_package_root_holds_at_most_eight_modules() -> None:
    root = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, f"{len(root)} modules at the package root: {root}"


def test_no_module_is_over_600_lines() -> None:
    long = {str(path.relative_to(REPO)): lines for path in _sources(PACKAGE)
            if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}, f"modules over {MAX_MODULE_LINES} lines (split them by job): {long}"


def test_every_module_name_is_unique_in_the_package() -> None:
    assert _duplicates(_sources(PACKAGE), REPO, SHARED_NAMES) == {}


def test_the_package_never_names_the_test_fakes() -> None:
    found = [f"{path.relative_to(REPO)}:{number}: {line.strip()}"
             for path in _text_files(PACKAGE)
             for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
             if any(mention in line for mention in FORBIDDEN_MENTIONS)]
    assert found == [], "\n".join(found)


def test_no_module_of_the_package_imports_the_tests() -> None:
    found = {str(path.relative_to(REPO)): where for path in _sources(PACKAGE) if (where := _imports_of_tests(path))}
    assert found == {}, found


def test_every_test_module_name_is_unique_across_tests() -> None:
    sources = [path for path in _sources(TESTS) if "fakes" not in path.relative_to(TESTS).parts]
    assert _duplicates(sources, REPO, SHARED_TEST_NAMES) == {}


def test_the_checks_see_what_they_look_for(tmp_path: Path) -> None:
    """Each check finds its violation when one is there (so a pass above means something)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "_same.py").write_text("")
    (tmp_path / "b" / "_same.py").write_text("")
    (tmp_path / "a" / "__init__.py").write_text("")
    (tmp_path / "b" / "__init__.py").write_text("")
    assert _duplicates(_sources(tmp_path), tmp_path, SHARED_NAMES) == {"_same.py": ["a/_same.py", "b/_same.py"]}
    user = tmp_path / "user.py"
    user.write_text("import os\nimport tests.support.waits\nfrom tests import conftest\nfrom . import tests\n"
                    "import importlib\nimportlib.import_module('tests.programs.x')\n")
    assert _imports_of_tests(user) == ["line 2: tests.support.waits", "line 3: tests",
                                       "line 6: tests.programs.x"]
