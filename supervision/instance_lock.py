"""One running stack per data directory: an exclusive lock taken before anything starts.

Two stacks on one directory would run two Valkeys appending to one AOF, which can corrupt
what the first one holds. The lock is an ``flock`` on a file that names the holder, so the
second start fails at once with one line naming the first; the kernel drops the lock when
its holder dies, even by ``kill -9``.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path
from typing import IO

from supervision.processes import StartupError

LOCK_FILE = "diffcache.lock"


class InstanceLock:
    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / LOCK_FILE
        self._file: IO[str] | None = None

    def acquire(self, api_url: str) -> None:
        """Take the lock, or raise StartupError naming the stack that holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = self.path.open("a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = _holder(handle.read())
            handle.close()
            raise StartupError("diffcache", f"a stack is already running on {self.path.parent} "
                               f"({holder})", "Stop it first, or give this one another "
                               "--data-dir") from None
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"pid": os.getpid(), "api_url": api_url}))
        handle.flush()
        self._file = handle

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing drops the flock
            self._file = None


def _holder(text: str) -> str:
    try:
        found = json.loads(text)
        return f"pid {int(found['pid'])}, API {found['api_url']}"
    except (ValueError, KeyError, TypeError):
        return "its pid is unknown"
