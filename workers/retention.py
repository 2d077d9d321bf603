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
from typing import Any

import redis

from cachesvc.settings import RetentionSettings
from keys import Priority
from keys.names import (
    InvalidTenantError,
    check_tenant,
    dead_letter_stream,
    request_index,
    request_record,
    stage_stream,
    tenants_registry,
)
from workers.messages import Stage, State

log = logging.getLogger(__name__)

# Index entries read per round trip; a sweep reads up to ``sweep_batch`` per tenant.
_PAGE = 500

# KEYS[1] a stage stream. ARGV[1]: idle ms after which a consumer with nothing pending is
# forgotten. Returns {entries trimmed, consumers forgotten}.
#
# One script, so no group can read or claim between finding the floor and trimming to it. The
# floor is the lowest id any group still needs: its oldest pending entry, or, with nothing
# pending, the entry after its last-delivered id (everything after that is unread). Exact MINID
# drops whole nodes (up to 100 entries each) in one step and walks only the node at the floor,
# so a call costs about one step per hundred entries acknowledged since the previous sweep.
_TRIM_STREAM = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {0, 0} end
local floor_ms, floor_seq
local forgotten = 0
local groups = redis.call('XINFO', 'GROUPS', KEYS[1])
if #groups == 0 then return {0, 0} end  -- no reader yet: every entry is unread
for _, raw in ipairs(groups) do
  local g = {}
  for i = 1, #raw, 2 do g[raw[i]] = raw[i + 1] end
  local ms, seq
  if tonumber(g['pending']) > 0 then
    local oldest = redis.call('XPENDING', KEYS[1], g['name'])[2]
    ms, seq = string.match(oldest, '^(%d+)-(%d+)$')
    ms, seq = tonumber(ms), tonumber(seq)
  else
    ms, seq = string.match(g['last-delivered-id'], '^(%d+)-(%d+)$')
    -- Sequence numbers count entries added within one millisecond: far below 2^53.
    ms, seq = tonumber(ms), tonumber(seq) + 1
  end
  if not floor_ms or ms < floor_ms or (ms == floor_ms and seq < floor_seq) then
    floor_ms, floor_seq = ms, seq
  end
  for _, rawc in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], g['name'])) do
    local c = {}
    for i = 1, #rawc, 2 do c[rawc[i]] = rawc[i + 1] end
    if tonumber(c['pending']) == 0 and tonumber(c['idle']) > tonumber(ARGV[1]) then
      redis.call('XGROUP', 'DELCONSUMER', KEYS[1], g['name'], c['name'])
      forgotten = forgotten + 1
    end
  end
end
local floor = string.format('%.0f-%.0f', floor_ms, floor_seq)
return {redis.call('XTRIM', KEYS[1], 'MINID', floor), forgotten}
"""

# KEYS[1] a tenant's request index, then the records of ARGV[2..]. ARGV[1]: the cutoff in unix
# seconds, then the request ids. Returns 1 per request whose record is gone, 0 per one kept.
#
# Records are deleted here rather than given an EXPIRE: a FAILED or CANCELLED request can be
# resumed, and a TTL set before that would delete it mid-flight. The script checks the state
# and the last change at the moment of deletion, so it cannot race a resume or a late write,
# and it drops the index entry in the same step, so the index never names a missing record.
_EXPIRE_RECORDS = """
local cutoff = tonumber(ARGV[1])
local gone = {}
for i = 2, #KEYS do
  local state, updated, created = unpack(redis.call('HMGET', KEYS[i], 'state', 'updated_at',
                                                    'created_at'))
  local remove = false
  if TERMINAL then
    local at = tonumber(updated or created or '')
    if at and at <= cutoff then
      redis.call('DEL', KEYS[i])
      remove = true
    end
  elseif not state then
    remove = redis.call('EXISTS', KEYS[i]) == 0  -- deleted by hand: a dangling index entry
  end
  if remove then
    redis.call('ZREM', KEYS[1], ARGV[i])
    gone[#gone + 1] = 1
  else
    gone[#gone + 1] = 0
  end
end
return gone
""".replace("TERMINAL", " or ".join(f"state == '{s.value}'" for s in State if s.terminal))


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

    def __init__(self, client: redis.Redis, settings: RetentionSettings) -> None:
        self.redis = client
        self.settings = settings
        self._trim_stream = client.register_script(_TRIM_STREAM)
        self._expire = client.register_script(_EXPIRE_RECORDS)
        self._cursors: dict[str, _Cursor] = {}
        # Tenants found by scanning for request indexes: a tenant whose requests never reached
        # the cache (all cancelled while queued, say) never joins the tenants registry.
        self._found: set[str] = set()
        self._scan_cursor = 0
        self._head, self._tail = _index_pattern()

    def sweep(self, now_s: float | None = None) -> SweepReport:
        """One bounded pass over every kind of retained data; ``now_s`` defaults to the clock."""
        now = time.time() if now_s is None else now_s
        entries, consumers = self._trim_streams()
        records, backlog = self._expire_records(now)
        dead = self._trim_dead_letters(now)
        report = SweepReport(entries, records, dead, consumers, backlog)
        if entries or records or dead or consumers:
            log.info("retention removed %d stream entries, %d request records, %d dead letters "
                     "and %d idle consumers%s", entries, records, dead, consumers,
                     "; more remain" if backlog else "")
        return report

    def _trim_streams(self) -> tuple[int, int]:
        idle_ms = int(self.settings.dead_consumer_s * 1000)
        streams = [stage_stream(stage.value, p.value) for stage in Stage for p in Priority]
        pipe = self.redis.pipeline(transaction=False)
        for stream in streams:
            self._trim_stream(keys=[stream], args=[idle_ms], client=pipe)
        try:
            results: list[Any] = pipe.execute()
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
            self._scan_cursor, keys = self.redis.scan(  # type: ignore[assignment]
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
            gone: list[int] = self._expire(
                keys=[index, *(request_record(tenant, i) for i in ids)],
                args=[f"{cutoff_ms / 1000:.3f}", *ids])
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
