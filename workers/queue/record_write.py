"""What a script writes to a request record: fields set and counters added, each field checked
against the record schema, and a job's cache ledger as the counters it adds."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache

from pydantic_core import to_json

from cachesvc.ledger import Tally
from keys import KeyKind
from workers.queue.schema import CHECKPOINT_PREFIX, Field, KindField, StageField


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


