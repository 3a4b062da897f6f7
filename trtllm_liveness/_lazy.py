"""Lazy re-exports for the folders' faces: each name is imported from its module on first use,
so importing one module of a folder never loads its siblings (disabled means free)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, MutableMapping

__all__ = ["lazy_exports"]


def lazy_exports(package: str, sources: Mapping[str, str],
                 namespace: MutableMapping[str, object]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """A module ``__getattr__`` and ``__dir__`` for ``package``: ``sources`` maps each public name to
    the submodule (relative to ``package``) that defines it; a resolved name is cached in
    ``namespace`` (the package's ``globals()``). Thread-safe through importlib's module lock."""

    def __getattr__(name: str) -> object:
        source = sources.get(name)
        if source is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{source}"), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(sources))

    return __getattr__, __dir__
