"""How a script's typed arguments reach it: each dataclass field is a KEYS or an ARGV slot, in
order, and each value travels as a string (tables as JSON). The base of every argument type in
``script_args``."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import field
from enum import Enum
from typing import Any, ClassVar

from workers.queue.record_write import RecordWrite


def key(*, rest: bool = False) -> Any:
    """A KEYS slot; with ``rest`` (a tuple, last) it takes every remaining slot."""
    return field(metadata={"slot": "KEYS", "rest": rest})


def arg(*, table: bool = False) -> Any:
    """An ARGV slot; with ``table`` (a RecordWrite, mapping or sequence) it travels as JSON
    and reaches Lua as a table."""
    return field(metadata={"slot": "ARGV", "table": table})


class ScriptArgs:
    """Base of every script's argument object: its fields, in order, are its KEYS slots and
    then its ARGV slots; ``NAME`` is the file in ``lua/``."""

    NAME: ClassVar[str]

    def keys(self) -> list[str]:
        out: list[str] = []
        for name, rest in _key_names(type(self)):
            value = getattr(self, name)
            if rest:
                out += value
            else:
                out.append(value)
        return out

    def argv(self) -> list[str]:
        return [wire(getattr(self, name)) for name, wire in _arg_wires(type(self))]


# Each class's slots, worked out once: every dispatch packs two scripts' arguments.
_KEY_NAMES: dict[type, tuple[tuple[str, bool], ...]] = {}
_ARG_WIRES: dict[type, tuple[tuple[str, Callable[[Any], str]], ...]] = {}


def _key_names(cls: type) -> tuple[tuple[str, bool], ...]:
    """(field, whether it takes every remaining slot) for each KEYS slot."""
    found = _KEY_NAMES.get(cls)
    if found is None:
        found = _KEY_NAMES[cls] = tuple((f.name, bool(f.metadata["rest"]))
                                        for f in slots(cls, "KEYS"))
    return found


def _arg_wires(cls: type) -> tuple[tuple[str, Callable[[Any], str]], ...]:
    """(field, how its value travels) for each ARGV slot, chosen once from the field's type."""
    found = _ARG_WIRES.get(cls)
    if found is None:
        found = _ARG_WIRES[cls] = tuple((f.name, _WIRES.get(str(f.type), _wire))
                                        for f in slots(cls, "ARGV"))
    return found


def slots(cls: type, kind: str) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(cls) if f.metadata.get("slot") == kind]


def _wire(value: object) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, RecordWrite):
        return value.to_json()
    if isinstance(value, Enum):
        return str(value.value)
    if isinstance(value, Mapping | list | tuple):
        return json.dumps(value)
    return str(value)


# The argument types whose wire form needs no inspection of the value (the annotations are
# strings: this module and ``script_args`` use postponed evaluation).
_WIRES: dict[str, Callable[[Any], str]] = {"str": str, "int": str,
                                           "RecordWrite": RecordWrite.to_json}


