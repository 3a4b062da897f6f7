"""Integrations of the liveness core with the systems around it.

Each module imports its third-party dependency lazily or at its own import, never from the core:
``trtllm`` (TensorRT-LLM proxy and workers), ``dynamo`` (NVIDIA Dynamo runtime), ``prometheus``
(metrics).

:class:`PatchingFinder` is the one import hook of the package (the autoload's, on the proxy's
module; the ranks', on upstream's hang detector), installed by :func:`patch_when_imported`: it
imports nothing but ``sys``, so that the autoload costs an interpreter no module beyond its own.
"""

import sys

__all__: "list[str]" = []  # machinery only: the integrations are its submodules

TYPE_CHECKING = False
if TYPE_CHECKING:  # no typing or importlib at run time: see the docstring
    from collections.abc import Callable, Sequence
    from importlib.abc import Loader
    from importlib.machinery import ModuleSpec
    from types import ModuleType


class _PatchingLoader:
    """Runs the real loader, then patches the module; every other attribute is the real loader's
    (``get_source``, ``is_package``, resource readers), so tracebacks and introspection still work."""

    def __init__(self, wrapped: "Loader", patch: "Callable[[ModuleType], None]") -> None:
        self._wrapped = wrapped
        self._patch = patch

    def exec_module(self, module: "ModuleType") -> None:
        self._wrapped.exec_module(module)
        self._patch(module)

    def __getattr__(self, name: str) -> object:
        return getattr(self._wrapped, name)


class PatchingFinder:
    """Intercepts only the module ``target`` names: the other finders find it, and ``patch(module)``
    runs right after it executed. A plain class (the import system needs only ``find_spec``)."""

    def __init__(self, target: str, patch: "Callable[[ModuleType], None]") -> None:
        self._target = target
        self._patch = patch

    def find_spec(
        self, fullname: str, path: "Sequence[str] | None", target: "ModuleType | None" = None
    ) -> "ModuleSpec | None":
        if fullname != self._target:
            return None
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            if isinstance(finder, PatchingFinder) or find_spec is None:  # one patch per module: the first's
                continue
            spec: ModuleSpec | None = find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                # Not an importlib.abc.Loader subclass (importing that costs every interpreter).
                spec.loader = _PatchingLoader(spec.loader, self._patch)  # type: ignore[assignment]
                return spec
        return None


def patch_when_imported(target: str, patch: "Callable[[ModuleType], None]") -> None:
    """Run ``patch(module)`` on the module ``target`` now if it is imported, else right after it is
    (a :class:`PatchingFinder` first on ``sys.meta_path``; it stays: a module imported again is
    patched again, so ``patch`` skips a module it patched already)."""
    module = sys.modules.get(target)
    if module is not None:
        patch(module)
    else:
        sys.meta_path.insert(0, PatchingFinder(target, patch))
