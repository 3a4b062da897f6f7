"""The one lazy-export mechanism of the package's faces (PEP 562, as ``concurrent.futures`` does).

Standard library only, and nothing imported at load beyond ``collections.abc``: the root loads this
module on its first attribute lookup, never when it is imported (with liveness off nothing but the
switch may run in an interpreter).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping


def lazy_exports(package: str, sources: Mapping[str, tuple[str, ...]], namespace: MutableMapping[str, object],
                 ) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` (PEP 562) of a package's face, the one mechanism
    every face of this package uses: ``sources`` maps each module (relative to ``package``, as
    ``importlib.import_module`` takes it) to the public names it defines. A name is imported on its
    first use and then cached in ``namespace`` (the face's ``globals()``), so importing one module
    of a folder never loads its siblings. Thread-safe through importlib's module lock."""
    where = {name: module for module, names in sources.items() for name in names}

    def __getattr__(name: str) -> object:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        import importlib

        value = getattr(importlib.import_module(module, package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(where))

    return __getattr__, __dir__
