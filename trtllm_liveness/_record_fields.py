"""Strict reading of a record's JSON form (what its ``to_dict()`` writes), for ``from_dict()``.

A :class:`JsonFields` takes the mapping and the names the record's form has; every accessor checks
one field's type (``bool`` is never an int; a number may be an int; sequences are JSON arrays) and
raises ``ValueError`` naming the record, the field and what was found. Derived fields (the form
writes them for readers, the record computes them) are checked against the rebuilt record by
:meth:`JsonFields.agrees`. Standard library only; no state beyond the mapping.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

__all__ = ["JsonFields"]

_E = TypeVar("_E", bound=enum.Enum)


class JsonFields:
    """The fields of one record's JSON form. ``ValueError`` at construction if ``data`` is not a
    mapping, lacks one of ``required`` or has a name that is neither ``required`` nor ``optional``."""

    def __init__(self, record: str, data: object, *, required: Iterable[str], optional: Iterable[str] = ()) -> None:
        self._record = record
        if not isinstance(data, Mapping):
            raise ValueError(f"{record}: expected a JSON object, got {type(data).__name__}")
        required, optional = tuple(required), tuple(optional)
        missing = [name for name in required if name not in data]
        if missing:
            raise ValueError(f"{record}: missing field(s) {', '.join(missing)}")
        unknown = sorted(str(name) for name in data if name not in required and name not in optional)
        if unknown:
            raise ValueError(f"{record}: unknown field(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted((*required, *optional)))}")
        self._data: Mapping[str, Any] = data

    def has(self, name: str) -> bool:
        """Whether the form has field ``name``."""
        return name in self._data

    def _bad(self, name: str, expected: str) -> ValueError:
        return ValueError(f"{self._record}: field {name!r} must be {expected}, got {self._data.get(name)!r}")

    def integer(self, name: str) -> int:
        """An int (not a bool)."""
        value = self._data.get(name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._bad(name, "an int")
        return int(value)

    def integer_or_none(self, name: str) -> int | None:
        """An int or null."""
        return None if self._data.get(name) is None else self.integer(name)

    def number(self, name: str) -> float:
        """A finite number (an int or a float, not a bool)."""
        value = self._data.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self._bad(name, "a finite number")
        return float(value)

    def number_or_none(self, name: str) -> float | None:
        """A finite number or null."""
        return None if self._data.get(name) is None else self.number(name)

    def text(self, name: str) -> str:
        """A string."""
        value = self._data.get(name)
        if not isinstance(value, str):
            raise self._bad(name, "a string")
        return value

    def flag(self, name: str) -> bool:
        """A bool."""
        value = self._data.get(name)
        if not isinstance(value, bool):
            raise self._bad(name, "a bool")
        return value

    def integers(self, name: str) -> tuple[int, ...]:
        """An array of ints."""
        value = self._data.get(name)
        if not isinstance(value, (list, tuple)) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
            raise self._bad(name, "an array of ints")
        return tuple(int(v) for v in value)

    def texts(self, name: str) -> tuple[str, ...]:
        """An array of strings."""
        value = self._data.get(name)
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise self._bad(name, "an array of strings")
        return tuple(value)

    def objects(self, name: str) -> tuple[object, ...]:
        """An array (of objects, each for its record's own ``from_dict``)."""
        value = self._data.get(name)
        if not isinstance(value, (list, tuple)):
            raise self._bad(name, "an array")
        return tuple(value)

    def choice(self, name: str, kind: type[_E]) -> _E:
        """One of ``kind``'s values."""
        value = self._data.get(name)
        try:
            return kind(value)
        except ValueError:
            allowed = ", ".join(repr(member.value) for member in kind)
            raise self._bad(name, f"one of {allowed}") from None

    def agrees(self, name: str, derived: object) -> None:
        """A derived field, where the form has it, equals what the rebuilt record computes."""
        if name in self._data and (type(self._data[name]) is not type(derived) or self._data[name] != derived):
            raise ValueError(f"{self._record}: field {name!r} is {self._data[name]!r}, but the record's other "
                             f"fields give {derived!r}")
