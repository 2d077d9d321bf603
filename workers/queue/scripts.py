"""The Lua scripts that change request records and streams, and the typed arguments of each.

A script lives in ``lua/<name>.lua``. It runs after a prelude generated here from the record
schema (state names, state sets, field names, result codes) and ``lua/common.lua``, then lines
that bind every KEYS and ARGV slot to a local named after its argument field, so no script
addresses an argument by position or repeats a state set by hand.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from functools import cache
from importlib import resources
from typing import Any, ClassVar

import redis
from redis.client import Pipeline
from redis.commands.core import Script

from workers.queue.messages import ATTEMPTS_PER_GENERATION
from workers.queue.schema import (
    CHECKPOINT_PREFIX,
    IDLE,
    LATE_PREFIX,
    RESUMABLE,
    TERMINAL,
    TRANSITIONS,
    Field,
    KindField,
    StageField,
    State,
)


class Result(IntEnum):
    """What every record script answers; each documents which of these it can return."""

    OK = 1
    MISSING = 2  # there is no such request
    STALE = 3  # a newer delivery attempt holds the stage
    SUPERSEDED = 4  # the request moved on to a newer generation since this job was written
    ALREADY_DONE = 5  # the stage already published for this generation
    FINISHED = 6  # the request is done, failed or cancelled
    NOT_ALLOWED = 7  # the request is not in a state this change starts from
    OVER_BOUND = 8  # a bound was reached (recomputes, admission, decode credits)
    SEEN = 9  # submit: the request id was accepted before
    OVER_TENANT_BOUND = 10  # admission: the tenant's bound was reached


EVENTS_SUFFIX = ":events"


def events_channel(record_key: str) -> str:
    """The pub/sub channel on which every script that writes the record announces it."""
    return record_key + EVENTS_SUFFIX


def key(*, rest: bool = False) -> Any:
    """A KEYS slot; with ``rest`` (a tuple, last) it takes every remaining slot."""
    return field(metadata={"slot": "KEYS", "rest": rest})


def arg(*, table: bool = False) -> Any:
    """An ARGV slot; with ``table`` (a RecordWrite, mapping or sequence) it travels as JSON
    and reaches Lua as a table."""
    return field(metadata={"slot": "ARGV", "table": table})


@dataclass(frozen=True, slots=True)
class RecordWrite:
    """Fields a script writes to a record: ``set`` replaces, ``add`` increments (counters that
    must sum over every attempt, such as cache hits)."""

    set: Mapping[str, object] = field(default_factory=dict)
    add: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in (*self.set, *self.add):
            check_field(name)

    def to_json(self) -> str:
        # Strings throughout: Lua numbers lose integers past 2^53 and format floats their way.
        return json.dumps({"set": {k: str(v) for k, v in self.set.items()},
                           "add": {k: str(v) for k, v in self.add.items()}})

    def __or__(self, other: RecordWrite) -> RecordWrite:
        add = dict(self.add)
        for name, amount in other.add.items():
            add[name] = add.get(name, 0) + amount
        return RecordWrite({**self.set, **other.set}, add)


NOTHING = RecordWrite()


def check_field(name: str) -> None:
    """Refuse a record field the schema does not name: a typo would otherwise be a field
    nothing ever reads."""
    prefix, sep, rest = name.partition(":")
    known = (name in Field.__members__.values() if not sep
             else (prefix in StageField.__members__.values()
                   or prefix in KindField.__members__.values()
                   or (prefix == CHECKPOINT_PREFIX and rest.isdigit())))
    if not known:
        raise ValueError(f"{name!r} is not a request record field (workers/queue/schema.py)")


class ScriptArgs:
    """Base of every script's argument object: its fields, in order, are its KEYS slots and
    then its ARGV slots; ``NAME`` is the file in ``lua/``."""

    NAME: ClassVar[str]

    def keys(self) -> list[str]:
        return [v for f in _slots(type(self), "KEYS") for v in _flat(getattr(self, f.name))]

    def argv(self) -> list[str]:
        return [_wire(getattr(self, f.name)) for f in _slots(type(self), "ARGV")]


def _slots(cls: type, kind: str) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(cls) if f.metadata.get("slot") == kind]


def _flat(value: object) -> list[str]:
    return [str(v) for v in value] if isinstance(value, tuple) else [str(value)]


def _wire(value: object) -> str:
    if isinstance(value, RecordWrite):
        return value.to_json()
    if isinstance(value, Enum):
        return str(value.value)
    if isinstance(value, Mapping | list | tuple):
        return json.dumps(value)
    return str(value)


def _lua_table(entries: Mapping[str, object]) -> str:
    return "{" + ", ".join(f"[{json.dumps(k)}] = {_lua_value(v)}"
                           for k, v in entries.items()) + "}"


def _lua_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, Mapping):
        return _lua_table(value)
    return json.dumps(str(value))


def _lua_set(states: frozenset[State]) -> str:
    return _lua_table({s.value: True for s in sorted(states)})


@cache
def prelude() -> str:
    """Constants generated from the schema, then the shared functions of ``common.lua``."""
    lines = [
        "-- Generated by workers/queue/scripts.py from workers/queue/schema.py.",
        f"local STATE = {_lua_table({s.name: s.value for s in State})}",
        f"local TERMINAL = {_lua_set(TERMINAL)}",
        f"local RESUMABLE = {_lua_set(RESUMABLE)}",
        f"local IDLE = {_lua_set(IDLE)}",
        "local TRANSITIONS = " + _lua_table({s.value: {t.value: True for t in sorted(moves)}
                                             for s, moves in TRANSITIONS.items()}),
        f"local F = {_lua_table({f.name: f.value for f in Field})}",
        f"local STAGE_FIELD = {_lua_table({f.name: f.value for f in StageField})}",
        f"local KIND_FIELD = {_lua_table({f.name: f.value for f in KindField})}",
        f"local R = {_lua_table({r.name: r.value for r in Result})}",
        f"local EVENTS_SUFFIX = {json.dumps(EVENTS_SUFFIX)}",
        f"local CHECKPOINT_PREFIX = {json.dumps(CHECKPOINT_PREFIX)}",
        f"local LATE_PREFIX = {json.dumps(LATE_PREFIX)}",
        f"local ATTEMPTS_PER_GENERATION = {ATTEMPTS_PER_GENERATION}",
    ]
    return "\n".join(lines) + "\n" + _source("common") + "\n"


def _bindings(cls: type[ScriptArgs]) -> str:
    lines = [f"local {f.name} = {{unpack(KEYS, {i})}}" if f.metadata["rest"]
             else f"local {f.name} = KEYS[{i}]"
             for i, f in enumerate(_slots(cls, "KEYS"), 1)]
    lines += [f"local {f.name} = cjson.decode(ARGV[{i}])" if f.metadata["table"]
              else f"local {f.name} = ARGV[{i}]"
              for i, f in enumerate(_slots(cls, "ARGV"), 1)]
    return "\n".join(lines) + "\n"


def _source(name: str) -> str:
    return resources.files("workers.queue").joinpath("lua", f"{name}.lua").read_text()


def source(cls: type[ScriptArgs]) -> str:
    """The whole text Redis runs for ``cls``'s script."""
    return prelude() + _bindings(cls) + _source(cls.NAME)


def slot_comment(cls: type[ScriptArgs]) -> list[str]:
    """The slot names, in order, that the header of ``cls``'s file must document."""
    return [f.name for f in _slots(cls, "KEYS")] + [f.name for f in _slots(cls, "ARGV")]


class Scripts:
    """Scripts registered on one client; ``run`` executes one, directly or in a pipeline."""

    def __init__(self, client: redis.Redis) -> None:
        self.redis = client
        self._registered: dict[type[ScriptArgs], Script] = {}

    def _script(self, cls: type[ScriptArgs]) -> Script:
        script = self._registered.get(cls)
        if script is None:
            script = self._registered[cls] = self.redis.register_script(source(cls))
        return script

    def run(self, args: ScriptArgs, pipe: Pipeline | None = None) -> Any:
        return self._script(type(args))(keys=args.keys(), args=args.argv(), client=pipe)

    def result(self, args: ScriptArgs) -> Result:
        return Result(int(self.run(args)))

    def results(self, many: Sequence[ScriptArgs]) -> list[Result]:
        """Run several scripts in one round trip; each is atomic on its own."""
        pipe = self.redis.pipeline(transaction=False)
        for args in many:
            self.run(args, pipe)
        return [Result(int(code)) for code in pipe.execute()]
