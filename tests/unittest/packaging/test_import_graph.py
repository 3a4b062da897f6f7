"""The package's import graph, read from the source tree: the production paths never reach the
drill's or the demo's code.

Every import counts: module-level ones, those inside functions, type-only ones (under
``TYPE_CHECKING``), ``import_module`` of a literal name and a face's lazy exports (its
``_SOURCES``). What a module imports, it imports with its parent packages (their ``__init__``
runs first).

- nothing under ``multihost/``, nor anything it imports however indirectly within the package, is
  under ``drill/`` or ``demo/``: every remote host's rank runs the host agent
  (``multihost/_agent.py``), a server's as much as a drill's;
- the same for ``integrations/``: the engine's side of every server. A drill's engine hands the
  engine its hub class (``integrations/trtllm/_hosts.py``'s ``use_hub_class``), and its hub hands
  the agents their fault handler in their settings; neither is imported from here;
- the graph has no circles (type-only imports included). A module's own parent packages are no
  edge of it for this check: they are initialised before it whatever it imports.
"""

from __future__ import annotations

import ast
import collections
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
PACKAGE = REPO / "trtllm_liveness"
# Code for drills and demos only: a server's engine and its ranks must run without ever importing it.
NOT_IN_PRODUCTION = ("drill", "demo")
PRODUCTION = ("multihost", "integrations")

pytestmark = pytest.mark.timeout(60)


def _module_names(package: Path) -> dict[str, Path]:
    """Every module of ``package`` (a folder with ``__init__.py``) by its dotted name."""
    names = {}
    for path in sorted(package.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = path.relative_to(package.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _imports(name: str, path: Path, known: set[str]) -> list[tuple[int, str]]:
    """(line, module) of every import in the module ``name`` at ``path``. A name taken from a
    package (``from . import _wire``) is that submodule where the package has one."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found += [(node.lineno, f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
                      for alias in node.names]
        elif (isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_SOURCES" for t in node.targets)
              and isinstance(node.value, ast.Dict)):  # a face's lazy exports: module -> names
            found += [(key.lineno, f"{package}{key.value}" if key.value.startswith(".") else key.value)
                      for key in node.value.keys if isinstance(key, ast.Constant) and isinstance(key.value, str)]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
              in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            target = node.args[0].value
            found.append((node.lineno, f"{package}{target}" if target.startswith(".") else target))
    return found


def _graph(package: Path, parents: bool = True) -> dict[str, list[tuple[int, str]]]:
    """Each module's imports within ``package`` (with the parent packages each one runs, unless
    ``parents`` is False)."""
    modules = _module_names(package)
    known = set(modules)
    graph: dict[str, list[tuple[int, str]]] = {}
    for name, path in modules.items():
        edges = []
        for line, target in _imports(name, path, known):
            while target and target not in known and "." in target:  # ``import a.b.c`` of an attribute
                target = target.rpartition(".")[0]
            parts = target.split(".")  # the module itself first, then the packages it runs
            ends = range(len(parts), 0, -1) if parents else range(len(parts), len(parts) - 1, -1)
            edges += [(line, ".".join(parts[:end])) for end in ends
                      if ".".join(parts[:end]) in known and ".".join(parts[:end]) != name]
        graph[name] = edges
    return graph


def _under(name: str, root: str, folders: tuple[str, ...]) -> bool:
    return any(name == f"{root}.{folder}" or name.startswith(f"{root}.{folder}.") for folder in folders)


def _reached(graph: dict[str, list[tuple[int, str]]], start: str, root: str, folders: tuple[str, ...]) -> str | None:
    """The shortest import chain from ``start`` to a module under ``folders`` (None: there is none)."""
    via: dict[str, tuple[str, int] | None] = {start: None}
    queue = collections.deque([start])
    while queue:
        name = queue.popleft()
        for line, target in graph.get(name, []):
            if target in via:
                continue
            via[target] = (name, line)
            if _under(target, root, folders):
                steps, at = [target], via[target]
                while at is not None:
                    steps.append(f"{at[0]}:{at[1]}")
                    at = via[at[0]]
                return " -> ".join(reversed(steps))
            queue.append(target)
    return None


def _violations(package: Path, production: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    root = package.name
    graph = _graph(package)
    chains = (_reached(graph, name, root, forbidden) for name in sorted(graph) if _under(name, root, production))
    return [chain for chain in chains if chain is not None]


def _circles(graph: dict[str, list[tuple[int, str]]]) -> list[list[str]]:
    """The graph's circles: each strongly connected set of two or more modules (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(name: str) -> None:  # the package's depth stays far below the recursion limit
        index[name] = low[name] = len(index)
        stack.append(name)
        for _line, target in graph.get(name, []):
            if target not in index:
                visit(target)
                low[name] = min(low[name], low[target])
            elif target in stack:
                low[name] = min(low[name], index[target])
        if low[name] == index[name]:
            members = [stack.pop()]
            while members[-1] != name:
                members.append(stack.pop())
            if len(members) > 1:
                circles.append(sorted(members))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return sorted(circles)


def test_the_import_graph_has_no_circles() -> None:
    circles = _circles(_graph(PACKAGE, parents=False))
    assert circles == [], "modules importing each other (type-only imports included):\n" + "\n".join(
        " <-> ".join(circle) for circle in circles)


def test_the_circle_check_sees_a_type_only_circle(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "_a.py").write_text("from ._b import B\n")
    (package / "_b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ._a import A\n")
    (package / "_c.py").write_text("from . import _a\n")
    assert _circles(_graph(package, parents=False)) == [["pkg._a", "pkg._b"]]


@pytest.mark.parametrize("production", PRODUCTION)
def test_production_code_never_imports_the_drill_or_the_demo(production: str) -> None:
    found = _violations(PACKAGE, (production,), NOT_IN_PRODUCTION)
    assert found == [], f"{production}/ reaches {'/ or '.join(NOT_IN_PRODUCTION)}/ (module:line of each import):\n" \
        + "\n".join(found)


def test_the_host_agent_is_in_the_graph_with_what_it_imports() -> None:
    """The check walks what it must: the agent's module and its imports, found by their names."""
    graph = _graph(PACKAGE)
    agent = {target for _line, target in graph["trtllm_liveness.multihost._agent"]}
    assert {"trtllm_liveness.multihost", "trtllm_liveness.multihost._wire", "trtllm_liveness.monitor._monitor",
            "trtllm_liveness.stop._bounded_stop", "trtllm_liveness.diagnose._diagnosis"} <= agent, agent


def test_the_check_sees_every_kind_of_import(tmp_path: Path) -> None:
    """Each kind of import reaches the forbidden folder in a package made for it (so a pass above
    means something): type-only, inside a function, relative, of a submodule, ``import_module``,
    and through another module."""
    package = tmp_path / "pkg"
    for folder in ("", "prod", "drill"):
        (package / folder).mkdir(exist_ok=True)
        (package / folder / "__init__.py").write_text("")
    (package / "drill" / "_faults.py").write_text("")
    (package / "_middle.py").write_text("def late() -> None:\n    import pkg.drill._faults\n")
    (package / "prod" / "_typed.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                               "    from ..drill._faults import X\n")
    (package / "prod" / "_late.py").write_text("def late() -> None:\n    from ..drill import _faults\n")
    (package / "prod" / "_named.py").write_text("import importlib\nimportlib.import_module('pkg.drill')\n")
    (package / "prod" / "_indirect.py").write_text("from .. import _middle\n")
    (package / "prod" / "_clean.py").write_text("import os\nfrom . import _clean\n")
    (package / "prod" / "_face.py").write_text("_SOURCES = {'pkg.drill._faults': ('X',)}\n")
    assert _violations(package, ("prod",), ("drill",)) == [
        "pkg.prod._face:1 -> pkg.drill._faults",
        "pkg.prod._indirect:1 -> pkg._middle:2 -> pkg.drill._faults",
        "pkg.prod._late:2 -> pkg.drill._faults",
        "pkg.prod._named:2 -> pkg.drill",
        "pkg.prod._typed:3 -> pkg.drill._faults",
    ]
