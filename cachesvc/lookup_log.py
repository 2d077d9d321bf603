"""A log of every lookup and write of a valued entry, one JSON line each, so that a trace can be
replayed offline against an ideal policy with the same memory (``bench.pressure``). Off unless
``cache.lookup_log_dir`` names a folder; each process appends to a file of its own there.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from keys import StoreKey


class Access(StrEnum):
    HIT = "hit"
    MISS = "miss"
    WRITE = "write"


@dataclass(frozen=True, slots=True)
class LoggedAccess:
    """One line of the log: when, what happened to which entry, its bytes and its cost (the
    compute seconds its header records; 0 for a miss, which knows neither)."""

    at: float
    access: Access
    key: str
    size: int
    cost_s: float


class LookupLog:
    """This process's lines, appended to ``<folder>/<pid>.jsonl``."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        # Line-buffered: a worker stopped by a signal leaves every line it logged.
        self._file = (folder / f"{os.getpid()}.jsonl").open("a", buffering=1)
        self._lock = threading.Lock()

    def log(self, access: Access, key: StoreKey, size: int = 0, cost_s: float = 0.0) -> None:
        line = json.dumps({"at": time.time(), "access": access.value, "key": str(key),
                           "size": size, "cost_s": round(cost_s, 6)})
        with self._lock:
            self._file.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read_log(folder: Path) -> list[LoggedAccess]:
    """Every process's lines in ``folder``, in the order they happened."""
    return sorted(_lines(folder), key=lambda a: a.at)


def _lines(folder: Path) -> Iterator[LoggedAccess]:
    for path in sorted(folder.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            raw = json.loads(line)
            yield LoggedAccess(float(raw["at"]), Access(raw["access"]), str(raw["key"]),
                               int(raw["size"]), float(raw["cost_s"]))
