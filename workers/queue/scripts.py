"""The Lua scripts that change request records and streams, and the typed arguments of each.

A script lives in ``lua/<name>.lua``. Every script is a function of one Redis function library
(``FUNCTION LOAD``, once per process and server): a prelude generated here from the record schema
(state names, state sets, field names, result codes) and ``lua/common.lua``, then one function
per script whose first lines bind every KEYS and ARGV slot to a local named after its argument
field, so no script addresses an argument by position or repeats a state set by hand.
"""

from __future__ import annotations

import dataclasses
import json
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from functools import cache
from importlib import resources
from typing import Any, ClassVar

import redis
import xxhash
from pydantic_core import to_json
from redis.client import Pipeline
from redis.exceptions import MovedError

from cachesvc.connect import RedisClient
from cachesvc.ledger import Tally
from keys import KeyKind
from keys.names import request_record_lua
from workers.queue.messages import ATTEMPTS_PER_GENERATION, MESSAGE_VERSION
from workers.queue.queue_server import on_queue_server
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
        # An empty write, the most common, travels as nothing (``table_arg`` in common.lua).
        if not self.set and not self.add:
            return ""
        # Strings throughout: Lua numbers lose integers past 2^53 and format floats their way.
        # pydantic-core's encoder: two of these travel with every dispatch.
        return to_json({"set": {k: str(v) for k, v in self.set.items()},
                        "add": {k: str(v) for k, v in self.add.items()}}).decode()

    def __or__(self, other: RecordWrite) -> RecordWrite:
        # Most writes merge with an empty one: handing back the other side skips a copy and a
        # check of every field, twice per dispatch.
        if not other.set and not other.add:
            return self
        if not self.set and not self.add:
            return other
        add = dict(self.add)
        for name, amount in other.add.items():
            add[name] = add.get(name, 0) + amount
        return RecordWrite({**self.set, **other.set}, add)


NOTHING = RecordWrite()


def tally_fields(taken: Mapping[KeyKind, Tally],
                 at_least: Sequence[KeyKind] = ()) -> RecordWrite:
    """A job's ledger (``cachesvc.ledger``), as the counters its record adds: the same
    lookups and hits the cache counters were given. The kinds ``at_least`` are written even
    when none was looked up, so the record shows them as 0 rather than not at all."""
    add: dict[str, int] = {}
    for kind, tally in {**{k: Tally(0, 0) for k in at_least}, **taken}.items():
        add[KindField.LOOKUPS.of(kind)] = tally.lookups
        add[KindField.HITS.of(kind)] = tally.hits
    return RecordWrite(add=add) if add else NOTHING


@cache  # a few dozen names, checked for every field of every write
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
                                        for f in _slots(cls, "KEYS"))
    return found


def _arg_wires(cls: type) -> tuple[tuple[str, Callable[[Any], str]], ...]:
    """(field, how its value travels) for each ARGV slot, chosen once from the field's type."""
    found = _ARG_WIRES.get(cls)
    if found is None:
        found = _ARG_WIRES[cls] = tuple((f.name, _WIRES.get(str(f.type), _wire))
                                        for f in _slots(cls, "ARGV"))
    return found


def _slots(cls: type, kind: str) -> list[dataclasses.Field[Any]]:
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
        f"local MESSAGE_VERSION = {MESSAGE_VERSION}",
        f"local RECORD_KEY = {request_record_lua()}",
    ]
    return "\n".join(lines) + "\n" + _source("common") + "\n"


def _bindings(cls: type[ScriptArgs]) -> str:
    lines = [f"local {f.name} = {{unpack(KEYS, {i})}}" if f.metadata["rest"]
             else f"local {f.name} = KEYS[{i}]"
             for i, f in enumerate(_slots(cls, "KEYS"), 1)]
    lines += [f"local {f.name} = table_arg(ARGV[{i}])" if f.metadata["table"]
              else f"local {f.name} = ARGV[{i}]"
              for i, f in enumerate(_slots(cls, "ARGV"), 1)]
    return "\n".join(lines) + "\n"


def _source(name: str) -> str:
    return resources.files("workers.queue").joinpath("lua", f"{name}.lua").read_text()


def slot_comment(cls: type[ScriptArgs]) -> list[str]:
    """The slot names, in order, that the header of ``cls``'s file must document."""
    return [f.name for f in _slots(cls, "KEYS")] + [f.name for f in _slots(cls, "ARGV")]


def script_types() -> list[type[ScriptArgs]]:
    """Every script's argument type, in a fixed order."""
    from workers.queue import script_args  # noqa: F401 -- defines them; it imports this module

    return sorted(ScriptArgs.__subclasses__(), key=lambda cls: cls.NAME)


BATCH = "batch"  # lua/batch.lua: many calls of one script in one command


@cache
def library() -> tuple[str, str]:
    """The library every script is a function of, and its name.

    The prelude's tables are built once, when the library loads, instead of on every call of
    every script (5 us each on Valkey here, two calls per dispatch). The name carries a digest
    of the text, so processes of two releases sharing one Redis each call their own."""
    bodies = {cls.NAME: _bindings(cls) + _source(cls.NAME) for cls in script_types()}
    digest = xxhash.xxh3_64_hexdigest((prelude() + json.dumps(bodies)
                                       + _source(BATCH)).encode())
    name = f"diffcache_{digest[:12]}"
    # Each script's body becomes a local function (prefixed: some share a name with a function
    # of common.lua), registered under its own name and callable by ``batch``.
    # Called alone, a script never defers its latency counts or acknowledgements (``batch``
    # does, and ends by applying them).
    functions = "".join(f"local function script_{script}(KEYS, ARGV)\n{body}\nend\n"
                        f"redis.register_function('{name}_{script}', function(KEYS, ARGV)\n"
                        f"  stop_deferring()\n  return script_{script}(KEYS, ARGV)\nend)\n"
                        for script, body in bodies.items())
    table = "local SCRIPTS = {" + ", ".join(f"{s} = script_{s}" for s in bodies) + "}\n"
    return (f"#!lua name={name}\n{prelude()}{functions}{table}{_source(BATCH)}\n"
            f"redis.register_function('{name}_{BATCH}', {BATCH})\n", name)


def function_name(cls: type[ScriptArgs]) -> str:
    return f"{library()[1]}_{cls.NAME}"


# Connection pools of the servers this process has loaded the library on.
_LOADED: weakref.WeakSet[redis.ConnectionPool] = weakref.WeakSet()


def load_library(server: redis.Redis, *, again: bool = False) -> None:
    """Load the library once per server: the queue's (``queue_server``), where every script
    runs (``again``: it lost the library, as one restarted without persistence does; a replica
    promoted in a master's place has it, as functions replicate). Loading is idempotent:
    REPLACE swaps it atomically."""
    if server.connection_pool in _LOADED and not again:
        return
    server.function_load(library()[0], replace=True)
    _LOADED.add(server.connection_pool)


def lost_library(error: object) -> bool:
    """Whether ``error`` says the server does not have the library (it was restarted without
    persistence, or flushed its functions)."""
    return isinstance(error, redis.ResponseError) and "function not found" in str(error).lower()


def execute(client: RedisClient, queue: Callable[[Pipeline], object]) -> list[Any]:
    """Run the commands ``queue`` puts in a pipeline, in one round trip on the queue's server
    (``on_queue_server``: if the queue's slot moved to a promoted replica, they run there).
    Errors come back in place, as ``execute(raise_on_error=False)`` has them."""
    return on_queue_server(client, lambda server: _pipelined(server, queue))


def _pipelined(server: redis.Redis, queue: Callable[[Pipeline], object]) -> list[Any]:
    """``execute`` on one server; if it lost the library, load it and run the commands once
    more. A MOVED answer is raised, to run them on the slot's new master (either way no FCALL
    ran, so nothing runs twice)."""
    load_library(server)
    for attempt in range(2):
        pipe = server.pipeline(transaction=False)
        queue(pipe)
        results: list[Any] = pipe.execute(raise_on_error=False)
        if attempt == 0 and any(lost_library(r) for r in results):
            load_library(server, again=True)
            continue
        if (moved := next((r for r in results if isinstance(r, MovedError)), None)) is not None:
            raise moved
        return results
    raise AssertionError("unreachable")


class Scripts:
    """The library's functions on one client; ``run`` calls one, directly or in a pipeline."""

    def __init__(self, client: RedisClient) -> None:
        # The library is loaded at the first call, not here: a process must start (and answer
        # 503) while Redis is away.
        self.redis = client

    def run(self, args: ScriptArgs, pipe: Pipeline | None = None) -> Any:
        """Call the script of ``args``; queued in ``pipe`` when one is given (run it with
        ``execute``, which loads the library first and again if the server lost it)."""
        name, keys, argv = function_name(type(args)), args.keys(), args.argv()
        if pipe is not None:
            return pipe.fcall(name, len(keys), *keys, *argv)
        (answer,) = execute(self.redis, lambda p: p.fcall(name, len(keys), *keys, *argv))
        if isinstance(answer, Exception):
            raise answer
        return answer

    def result(self, args: ScriptArgs) -> Result:
        return Result(int(self.run(args)))

    def results(self, many: Sequence[ScriptArgs]) -> list[Result]:
        """Run several scripts in one round trip, those of one script in one command (the
        ``batch`` function), in order; each call is atomic on its own."""
        return [Result(int(code)) for code in self.answers(many)]

    def answers(self, many: Sequence[ScriptArgs]) -> list[Any]:
        """``results``, with each call's answer as the script returned it."""
        return self.answers_then(many, None)[0] if many else []

    def answers_then(self, many: Sequence[ScriptArgs],
                     then: ScriptArgs | None) -> tuple[list[Any], Any]:
        """``answers``, then one more call ``then`` in the same round trip (its answer, None
        without one). A worker publishes what it finished and takes its next jobs together:
        Redis writes both to its log in one fsync, where two round trips cost two."""
        kinds = list(dict.fromkeys(type(a) for a in many))
        def queue(pipe: Pipeline) -> None:
            for cls in kinds:
                self._batch([a for a in many if type(a) is cls], pipe)
            if then is not None:
                self.run(then, pipe)

        replies = execute(self.redis, queue)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        following = replies.pop() if then is not None else None
        by_kind = {cls: iter(answers) for cls, answers in zip(kinds, replies, strict=True)}
        answers = [next(by_kind[type(a)]) for a in many]
        for answer in answers:  # every call ran; the first that failed is reported
            if isinstance(answer, Exception):
                raise answer
        return answers, following

    def _batch(self, calls: Sequence[ScriptArgs], pipe: Pipeline) -> None:
        keys = [a.keys() for a in calls]
        argv = [a.argv() for a in calls]
        shapes = json.dumps([[len(k), len(v)] for k, v in zip(keys, argv, strict=True)])
        flat_keys = [k for ks in keys for k in ks]
        pipe.fcall(f"{library()[1]}_{BATCH}", len(flat_keys), *flat_keys,
                   type(calls[0]).NAME, shapes, *(v for vs in argv for v in vs))
