"""Outputs on disk, beside the store: a DONE request's result outlives the store's memory.

The store holds every output in memory only, so a restart of the service or the loss of a
storage node would lose them all. Decode also writes each output here, and the API serves it
from here when the store no longer has it, until the output's TTL has passed. Uploaded LoRA
adapters are kept the same way, with no TTL (``uploads/adapters.py``).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from pathlib import Path

from keys import StoreKey

log = logging.getLogger(__name__)


class OutputFiles:
    def __init__(self, root: Path, ttl_s: float) -> None:
        self.root = root
        self.ttl_s = ttl_s

    def path(self, key: StoreKey) -> Path:
        # Tenant and ident are both validated key parts: no separator can escape the root.
        return self.root / key.tenant / key.ident

    def write(self, key: StoreKey, data: bytes) -> None:
        """Write atomically: a reader sees the whole file or none."""
        target = self.path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.{uuid.uuid4().hex}.partial")
        with partial.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        partial.replace(target)

    def read(self, key: StoreKey) -> bytes | None:
        """The output's bytes, or None when there is no file or its TTL has passed."""
        target = self.path(key)
        try:
            if self._expired(target.stat().st_mtime):
                target.unlink(missing_ok=True)
                return None
            return target.read_bytes()
        except FileNotFoundError:
            return None

    def sweep(self) -> int:
        """Remove files past their TTL; returns how many."""
        removed = 0
        if not self.root.is_dir():
            return 0
        for path in self.root.glob("*/*"):
            try:
                if self._expired(path.stat().st_mtime):
                    path.unlink(missing_ok=True)
                    removed += 1
            except FileNotFoundError:
                continue  # removed by a concurrent reader
        if removed:
            log.info("removed %d expired output files", removed)
        return removed

    def _expired(self, mtime: float) -> bool:
        return mtime + self.ttl_s <= time.time()
