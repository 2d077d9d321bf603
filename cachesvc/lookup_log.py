"""A log of every lookup and write of a valued entry, one JSON line each, so that a trace can be
replayed offline against an ideal policy with the same memory (``bench.pressure``). Off unless
``cache.lookup_log_dir`` names a folder; each process appends to a file of its own there.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from cachesvc.value_index import VALUED
from keys import StoreKey

log = logging.getLogger(__name__)


class Access(StrEnum):
    HIT = "hit"
    MISS = "miss"
    WRITE = "write"


@dataclass(frozen=True, slots=True)
class LoggedAccess:
    """One line of the log: when, what happened to which entry, a write's bytes (header
    included; 0 for a lookup) and the compute seconds its header records (0 for a miss). Misses
    of one ``group`` were one search, which any one of its keys would have served (a chain's
    checkpoints)."""

    at: float
    access: Access
    key: str
    size: int = 0
    cost_s: float = 0.0
    group: str | None = None


class LookupLog:
    """This process's lines, appended to ``<folder>/<pid>.jsonl``. A log that cannot be
    written turns itself off with a warning: it must never fail a lookup."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        # Line-buffered: a worker stopped by a signal leaves every line it logged.
        self._file = (folder / f"{os.getpid()}.jsonl").open("a", buffering=1)
        self._lock = threading.Lock()
        self._groups = itertools.count()
        self._on = True

    def log(self, access: Access, key: StoreKey, size: int = 0, cost_s: float = 0.0, *,
            at: float | None = None) -> None:
        """One access to ``key``, at ``at`` (default: now) where it began."""
        if key.kind in VALUED:
            self._write([{"at": time.time() if at is None else at, "access": access.value,
                          "key": str(key), "size": size, "cost_s": round(cost_s, 6)}])

    def missed(self, keys: Sequence[StoreKey]) -> None:
        """One search that found none of ``keys``, any of which would have served it."""
        valued = [k for k in keys if k.kind in VALUED]
        if valued:
            at, group = time.time(), f"{os.getpid()}-{next(self._groups)}"
            self._write([{"at": at, "access": Access.MISS.value, "key": str(k),
                          "group": group} for k in valued])

    def close(self) -> None:
        with self._lock:
            self._on = False
            self._file.close()

    def _write(self, lines: list[dict[str, object]]) -> None:
        text = "".join(json.dumps(line) + "\n" for line in lines)
        with self._lock:
            if not self._on:
                return
            try:
                self._file.write(text)
            except (OSError, ValueError):
                log.warning("the lookup log could not be written; it is off from now on",
                            exc_info=True)
                self._on = False


def read_log(folder: Path) -> list[LoggedAccess]:
    """Every process's lines in ``folder``, in the order they happened."""
    return sorted(_lines(folder), key=lambda a: a.at)


def _lines(folder: Path) -> Iterator[LoggedAccess]:
    for path in sorted(folder.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            raw = json.loads(line)
            yield LoggedAccess(float(raw["at"]), Access(raw["access"]), str(raw["key"]),
                               int(raw.get("size", 0)), float(raw.get("cost_s", 0.0)),
                               raw.get("group"))
