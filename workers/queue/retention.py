"""Retention: what keeps Redis bounded however many requests it has served.

``Retention.sweep`` trims the stage streams of entries every consumer group has acknowledged,
deletes finished request records older than ``retention.finished_request_s`` with their index
entries, trims old dead letters and forgets the consumers of workers that exited. The sweeper of
``diffcache up`` calls it periodically; one call does a bounded amount of work.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import redis

from cachesvc.redis_client import RedisClient
from config.settings import RetentionSettings
from keys.names import (
    InvalidTenantError,
    check_tenant,
    dead_letter_stream,
    request_index,
    request_record,
    tenants_registry,
)
from workers.queue.messages import Stage
from workers.queue.queue_server import queue_server
from workers.queue.script_args import ExpireRecordsArgs, TrimStreamArgs
from workers.queue.scripts import Scripts, execute
from workers.queue.streams import stage_streams

log = logging.getLogger(__name__)

# Index entries read per round trip; a sweep reads up to ``sweep_batch`` per tenant.
_PAGE = 500

class RetentionError(RuntimeError):
    """A sweep step failed against Redis; the message names the step. The next sweep retries."""


@dataclass(frozen=True, slots=True)
class SweepReport:
    """What one sweep removed, and whether it stopped at its batch limit with more to do."""

    stream_entries: int
    records: int
    dead_letters: int
    consumers: int
    backlog: bool


@dataclass(frozen=True, slots=True)
class _Cursor:
    """Where a tenant's index walk resumes: kept records stay in the index, so without a cursor
    a long-running or parked request at its head would stall every later sweep."""

    score: float
    skip: int  # records kept at exactly ``score``, already examined


_START = _Cursor(float("-inf"), 0)


def _index_pattern() -> tuple[str, str]:
    """The text before and after the tenant in a request index key, from ``keys.names``."""
    probe = "tenant"
    head, _, tail = request_index(probe).partition(probe)
    return head, tail


class Retention:
    """Trims, expiries and clean-ups that keep Redis from growing with every request served."""

    def __init__(self, client: RedisClient, settings: RetentionSettings) -> None:
        self.redis = client
        self.settings = settings
        self.scripts = Scripts(client)
        self._cursors: dict[str, _Cursor] = {}
        # Tenants found by scanning for request indexes: a tenant whose requests never reached
        # the cache (all cancelled while queued, say) never joins the tenants registry.
        self._found: set[str] = set()
        self._scan_cursor = 0
        self._head, self._tail = _index_pattern()

    def sweep(self, now_s: float | None = None) -> SweepReport:
        """One bounded pass over every kind of retained data; ``now_s`` defaults to the clock."""
        now = time.time() if now_s is None else now_s
        entries, consumers = self._trim_streams(now)
        records, backlog = self._expire_records(now)
        dead = self._trim_dead_letters(now)
        report = SweepReport(entries, records, dead, consumers, backlog)
        if entries or records or dead or consumers:
            log.info("retention removed %d stream entries, %d request records, %d dead letters "
                     "and %d idle consumers%s", entries, records, dead, consumers,
                     "; more remain" if backlog else "")
        return report

    def _trim_streams(self, now: float) -> tuple[int, int]:
        idle_ms = int(self.settings.dead_consumer_s * 1000)
        kept_since_ms = max(0, int((now - self.settings.acknowledged_s) * 1000))
        streams: list[str] = []
        try:
            for stage in Stage:
                streams += stage_streams(self.redis, stage)
            results = execute(self.redis, lambda pipe: [
                self.scripts.run(TrimStreamArgs(stream, idle_ms, kept_since_ms), pipe)
                for stream in streams])
            for result in results:
                if isinstance(result, Exception):
                    raise result
        except redis.RedisError as exc:
            raise RetentionError(f"could not trim the stage streams {streams}: {exc}") from exc
        return (sum(int(trimmed) for trimmed, _ in results),
                sum(int(forgotten) for _, forgotten in results))

    def _trim_dead_letters(self, now: float) -> int:
        # Stream ids start with the unix ms they were added at.
        floor = f"{int((now - self.settings.dead_letter_s) * 1000)}-0"
        try:
            return int(self.redis.xtrim(dead_letter_stream(), minid=floor, approximate=False))
        except redis.RedisError as exc:
            raise RetentionError(f"could not trim {dead_letter_stream()} to {floor}: "
                                 f"{exc}") from exc

    def _tenants(self) -> list[str]:
        """Registered tenants, and those one more page of a keyspace scan finds."""
        try:
            registered: set[bytes] = self.redis.smembers(  # type: ignore[assignment]
                tenants_registry())
            keys: list[bytes]
            # Every request index carries the queue's hash tag: on a cluster, one server.
            self._scan_cursor, keys = queue_server(self.redis).scan(  # type: ignore[assignment]
                self._scan_cursor, match=f"{self._head}*{self._tail}",
                count=self.settings.sweep_batch, _type="zset")
        except redis.RedisError as exc:
            raise RetentionError(f"could not list tenants: {exc}") from exc
        for raw in keys:
            name = raw.decode().removeprefix(self._head).removesuffix(self._tail)
            try:
                self._found.add(check_tenant(name))
            except InvalidTenantError:
                continue  # another key that happens to match the pattern
        return sorted(self._found | {t.decode() for t in registered})

    def _expire_records(self, now: float) -> tuple[int, bool]:
        removed, backlog = 0, False
        # A record changes after it is submitted, never before: only requests submitted
        # before the cutoff can have finished before it.
        cutoff_ms = int((now - self.settings.finished_request_s) * 1000)
        for tenant in self._tenants():
            try:
                gone, more = self._expire_tenant(tenant, cutoff_ms)
            except redis.RedisError as exc:
                raise RetentionError(f"could not expire request records of tenant {tenant!r}: "
                                     f"{exc}") from exc
            removed += gone
            backlog = backlog or more
        return removed, backlog

    def _expire_tenant(self, tenant: str, cutoff_ms: int) -> tuple[int, bool]:
        """Examine up to ``sweep_batch`` of the tenant's requests submitted before the cutoff,
        oldest first from where the last sweep stopped; (removed, whether more remain)."""
        index = request_index(tenant)
        cursor = self._cursors.get(tenant, _START)
        budget, removed = self.settings.sweep_batch, 0
        while budget > 0:
            page: list[tuple[bytes, float]] = self.redis.zrangebyscore(  # type: ignore[assignment]
                index, cursor.score, cutoff_ms, start=cursor.skip, num=min(budget, _PAGE),
                withscores=True)
            if not page:
                self._cursors.pop(tenant, None)  # reached the cutoff: start over next time
                return removed, False
            ids = [raw.decode() for raw, _ in page]
            gone: list[int] = self.scripts.run(ExpireRecordsArgs(
                index, tuple(request_record(tenant, i) for i in ids),
                f"{cutoff_ms / 1000:.3f}", tuple(ids)))
            removed += sum(gone)
            if len(page) < min(budget, _PAGE):
                self._cursors.pop(tenant, None)
                return removed, False
            budget -= len(page)
            last = page[-1][1]
            kept_at_last = sum(1 for (_, score), g in zip(page, gone, strict=True)
                               if score == last and not g)
            cursor = _Cursor(last, kept_at_last + (cursor.skip if last == cursor.score else 0))
        self._cursors[tenant] = cursor
        return removed, True
