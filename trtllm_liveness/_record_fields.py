"""A record's JSON form: written from its dataclass declaration, read back strictly.

:class:`JsonRecord` derives a frozen dataclass's ``to_dict()`` and ``from_dict()`` from its
fields' type hints (resolved once per class). A :class:`JsonFields` takes the mapping and the names
the record's form has; every accessor checks one field's type (``bool`` is never an int; a number
may be an int; sequences are JSON arrays) and raises ``ValueError`` naming the record, the field
and what was found. Derived fields (the form writes them for readers, the record computes them)
are checked against the rebuilt record by :meth:`JsonFields.agrees`. Standard library only.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import operator
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, NamedTuple, TypeVar

__all__ = ["JsonFields", "JsonRecord"]

_E = TypeVar("_E", bound=enum.Enum)


class JsonFields:
    """The fields of one record's JSON form. ``ValueError`` at construction if ``data`` is not a
    mapping, lacks one of ``required`` or has a name that is neither ``required`` nor ``optional``
    (unless ``newer_fields``: a form another version of the package writes, read for what it knows)."""

    def __init__(self, record: str, data: object, *, required: Iterable[str], optional: Iterable[str] = (),
                 newer_fields: bool = False) -> None:
        self._record = record
        if not isinstance(data, Mapping):
            raise ValueError(f"{record}: expected a JSON object, got {type(data).__name__}")
        required, optional = tuple(required), tuple(optional)
        missing = [name for name in required if name not in data]
        if missing:
            raise ValueError(f"{record}: missing field(s) {', '.join(missing)}")
        unknown = sorted(str(name) for name in data if name not in required and name not in optional)
        if unknown and not newer_fields:
            raise ValueError(f"{record}: unknown field(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted((*required, *optional)))}")
        self._data: Mapping[str, Any] = data

    def has(self, name: str) -> bool:
        """Whether the form has field ``name``."""
        return name in self._data

    def get(self, name: str) -> Any:
        """The value of field ``name`` as the form has it (None where it lacks it)."""
        return self._data.get(name)

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


class JsonRecord:
    """A frozen dataclass whose JSON form is derived from its declaration: :meth:`to_dict` writes
    the fields (enums by value, tuples as arrays, nested records through their own ``to_dict``) and
    :meth:`from_dict` reads them back strictly, each by its type hint: ``int``, ``float`` (an int
    read as a float), ``str``, ``bool``, ``X | None``, an enum, ``tuple[int, ...]``,
    ``tuple[str, ...]``, a nested record (a class with ``to_dict`` and ``from_dict``) or a tuple of
    them; any other type is a ``TypeError`` when the class's form is first derived.

    A subclass may set ``json_form`` (what the form writes, in order: fields, and derived
    properties that the form writes for readers and :meth:`from_dict` checks with
    :meth:`JsonFields.agrees`; a field left out is not written and is read as its default),
    ``json_optional`` (fields the form may lack, read as their default), ``json_keys`` (a field's
    or property's key in the form where it is not its name), ``json_round`` (the digits a float
    field or property is written rounded to; null stays null) and ``json_unchecked`` (derived
    properties written for readers but never compared: what rests on the writer's host). Each
    names fields and properties, never keys.
    """

    json_form: ClassVar[tuple[str, ...]] = ()
    json_optional: ClassVar[tuple[str, ...]] = ()
    json_keys: ClassVar[Mapping[str, str]] = {}
    json_round: ClassVar[Mapping[str, int]] = {}
    json_unchecked: ClassVar[tuple[str, ...]] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (:meth:`from_dict` reads it back)."""
        data: dict[str, Any] = {}
        for name, key, write in (_FORMS.get(type(self)) or _form_of(type(self))).writers:  # a plain loop: the cheapest
            value = getattr(self, name)
            data[key] = value if write is None else write(value)
        return data

    @classmethod
    def from_dict(cls: type[_R], data: object) -> _R:
        """The record :meth:`to_dict` wrote; ``ValueError`` naming the record and the field otherwise."""
        form = _form_of(cls)
        fields = JsonFields(cls.__name__, data, required=form.required, optional=form.optional)
        record = cls(**{name: read(fields, key) for name, key, read in form.readers if fields.has(key)})
        for name, key, write in form.derived:
            fields.agrees(key, write(getattr(record, name)))
        return record


_R = TypeVar("_R", bound=JsonRecord)
_Writer = Callable[[Any], Any] | None
_Reader = Callable[[JsonFields, str], Any]


def _json(value: Any) -> Any:
    """A derived property's value in JSON form (its type is not declared as a field's is)."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_json(item) for item in value]
    return value.to_dict() if isinstance(value, JsonRecord) else value


def _is_record(hint: Any) -> bool:
    return isinstance(hint, type) and callable(getattr(hint, "from_dict", None)) and hasattr(hint, "to_dict")


def _optional(inner: _Reader) -> _Reader:
    return lambda fields, name: None if fields.get(name) is None else inner(fields, name)


def _codec(owner: type, name: str, hint: Any) -> tuple[_Writer, _Reader]:
    """How field ``name`` of ``owner``, declared ``hint``, is written (None: as it is) and read."""
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        inner = [arg for arg in args if arg is not type(None)]
        if len(inner) == 1 and len(args) == 2:
            write, read = _codec(owner, name, inner[0])
            return (None if write is None else lambda value: None if value is None else write(value)), _optional(read)
    elif hint in _SCALARS:
        return None, _SCALARS[hint]
    elif isinstance(hint, type) and issubclass(hint, enum.Enum):
        return operator.attrgetter("value"), lambda fields, name: fields.choice(name, hint)
    elif _is_record(hint):
        return operator.methodcaller("to_dict"), lambda fields, name: hint.from_dict(fields.get(name))
    elif typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis:
        item = args[0]
        if item in (int, str):
            return list, JsonFields.integers if item is int else JsonFields.texts
        if _is_record(item):
            return (lambda value: [element.to_dict() for element in value],
                    lambda fields, name: tuple(item.from_dict(element) for element in fields.objects(name)))
    raise TypeError(f"{owner.__name__}.{name}: no JSON form for type {hint!r}")


_SCALARS: dict[Any, _Reader] = {int: JsonFields.integer, float: JsonFields.number, str: JsonFields.text,
                                bool: JsonFields.flag}


class _Form(NamedTuple):
    writers: tuple[tuple[str, str, _Writer], ...]  # (name, key, how it is written)
    readers: tuple[tuple[str, str, _Reader], ...]
    required: tuple[str, ...]  # keys
    optional: tuple[str, ...]
    derived: tuple[tuple[str, str, Callable[[Any], Any]], ...]  # those from_dict compares


# Filled on each class's first use; two threads that derive one class's form at once derive the same.
_FORMS: dict[type, _Form] = {}


def _rounded(write: _Writer, digits: int | None) -> _Writer:
    if digits is None:
        return write
    return lambda value: None if value is None else round(value if write is None else write(value), digits)


def _form_of(cls: type[JsonRecord]) -> _Form:
    """The codecs of ``cls``'s fields, from its type hints (resolved once per class)."""
    form = _FORMS.get(cls)
    if form is not None:
        return form
    hints = typing.get_type_hints(cls)
    declared = tuple(item.name for item in dataclasses.fields(cls))  # type: ignore[arg-type]
    names = cls.json_form or declared
    derived = tuple(name for name in names if name not in declared)
    written = [name for name in names if name in declared]
    if not all(isinstance(getattr(cls, name, None), property) for name in derived) or not (
            set(cls.json_optional) <= set(written) and set(cls.json_unchecked) <= set(derived)
            and {*cls.json_keys, *cls.json_round} <= set(names)):
        raise TypeError(f"{cls.__name__}: a json_* option names what is neither a field nor a property of its form")
    codecs = {name: _codec(cls, name, hints[name]) for name in written}
    key = {name: cls.json_keys.get(name, name) for name in names}
    write = {name: _rounded(codecs[name][0] if name in codecs else _json, cls.json_round.get(name)) for name in names}
    form = _Form(writers=tuple((name, key[name], write[name]) for name in names),
                 readers=tuple((name, key[name], codecs[name][1]) for name in written),
                 required=tuple(key[name] for name in written if name not in cls.json_optional),
                 optional=tuple(key[name] for name in (*derived, *cls.json_optional)),
                 derived=tuple((name, key[name], write[name] or _json) for name in derived
                               if name not in cls.json_unchecked))
    return _FORMS.setdefault(cls, form)
