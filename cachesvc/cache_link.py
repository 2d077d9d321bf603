"""A store connection made in the background, so that a process serves whatever needs no
store (health, status, events, results on disk, admission) from its first second, and answers
503 for the rest until the store client is up.

The connection is made on a thread: a restarted API listens within a second instead of after
its store client's set-up (10 s and more when the master is slow). It holds byte entries, not
the tensor cache: the API never loads torch.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from cachesvc.errors import StoreUnavailableError
from cachesvc.redis_client import RedisClient
from config.settings import Settings

if TYPE_CHECKING:
    from cachesvc.byte_entries import ByteEntries

log = logging.getLogger(__name__)

FIRST_RETRY_S = 0.5
MAX_RETRY_S = 8.0


class CacheLink:
    """Connects to the store on a thread, retrying with back-off until it succeeds or is
    closed; ``cache`` is the connection, or StoreUnavailableError while there is none yet."""

    def __init__(self, settings: Settings, client: RedisClient) -> None:
        self._settings = settings
        self._client = client
        self._cache: ByteEntries | None = None
        self._last_error = "connecting"
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._connect, name="store-link", daemon=True)
        self._thread.start()

    @property
    def cache(self) -> ByteEntries:
        cache = self._cache
        if cache is None:
            raise StoreUnavailableError(self.status, op="connect")
        return cache

    @property
    def connected(self) -> bool:
        return self._cache is not None

    @property
    def status(self) -> str:
        """What the link is doing, for a readiness page."""
        if self._cache is not None:
            return "connected"
        return f"the store client is not connected yet ({self._last_error})"

    def wait(self, timeout_s: float) -> bool:
        """Whether the link connected within ``timeout_s``."""
        self._thread.join(timeout_s)
        return self.connected

    def _connect(self) -> None:
        delay = FIRST_RETRY_S
        while not self._closed.is_set():
            try:
                from cachesvc.byte_entries import open_byte_entries  # Mooncake loads here

                cache = open_byte_entries(self._settings, self._client)
                if self._closed.is_set():  # closed while it connected: nobody will use it
                    cache.close()
                    return
                self._cache = cache
                log.info("store client connected")
                return
            except Exception as exc:  # logged; the link outlives any failed attempt
                self._last_error = f"{type(exc).__name__}: {exc}"
                log.warning("store client not connected (%s); retrying in %.1f s", exc, delay)
            if self._closed.wait(delay):
                return
            delay = min(delay * 2, MAX_RETRY_S)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop connecting and close the connection. A connect attempt still blocked in the
        store's client is not waited for past ``timeout_s``: it closes what it opens."""
        self._closed.set()
        self._thread.join(timeout_s)
        if self._cache is not None:
            self._cache.close()
