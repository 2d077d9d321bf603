"""What each cached entry is worth: its size, the compute it saves and its reads, kept per
tenant in Redis, with its GreedyDual-Size-Frequency priority, which the sweeper
(``cachesvc.value_sweep``) evicts by, lowest first: clock + (reads + p) * cost / size, where p
is the mean reads of the tenant's entries of that class, each entry counting at most
``READS_COUNTED`` (a class is a kind, and for a checkpoint its step too): the reads a new entry
can expect. Entries rarely read back (checkpoints at steps no resume or edit starts from) weigh
their cost by little, and a new embedding by the many reads its class sees.

Writes and reads are queued on the hot path and recorded by the counters' flush thread (a
script call per tenant for the writes and one for the reads), so a put or a hit never waits on
Redis for its value.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import Counter, defaultdict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cachesvc.redis_client import REDIS_ERRORS, RedisClient
from keys import KeyKind, StoreKey, checkpoint_step
from keys.names import value_clock, value_keys

log = logging.getLogger(__name__)

# The kinds the sweeper may evict: computed entries that lineage recomputes when lost. Not
# latents in flight between stages, uploads (adapters, images: nothing could make them again)
# or test entries.
VALUED = frozenset({KeyKind.EMBEDDING, KeyKind.CFG, KeyKind.CHECKPOINT, KeyKind.OUTPUT,
                    KeyKind.IMAGE_LATENT, KeyKind.IMAGE_EMBEDDING, KeyKind.IMAGE_MASK})
# Priorities are compute seconds per MiB held, times the reads an entry has had plus the
# reads its class's entries have had on average.
PER_BYTES = 1 << 20
# Writes kept for the next flush while Redis is unreachable; beyond it some are dropped (an
# unrecorded entry is left to Mooncake's own LRU).
MAX_PENDING = 100_000

# A record is "kind size cost reads class"; a record without its class (written before
# classes) is of its kind's.
_RECORD = """
local kind, size, cost, reads, class = string.match(rec, '(%S+) (%S+) (%S+) (%S+) ?(%S*)')
if class == '' then class = kind end
"""
# Past this many entries of a class written, both of its counts are halved, so that the mean
# follows the tenant's recent traffic.
REUSE_MEMORY = 10_000
# An entry's reads past this many do not count towards its class's mean: one prompt in
# everyone's use (the negative prompt) must not price every new embedding as if it were.
READS_COUNTED = 8
# ``expected(class)``: the reads per entry of the class, each entry's counted up to
# READS_COUNTED, from KEYS[4]; smoothed as Laplace's rule is, so that a class not yet seen
# starts at one half.
_EXPECTED = """
local function expected(class)
  local counts = redis.call('HMGET', KEYS[4], class .. ':entries', class .. ':reads')
  return (tonumber(counts[2] or 0) + 1) / (tonumber(counts[1] or 0) + 2)
end
"""

# KEYS: entries, priority, held, reuse. ARGV: clock, then key, kind, size, cost, class per
# entry. A key already recorded keeps its record (content-keyed writes: the first one wins).
_WRITE = f"""
{_EXPECTED}
local clock = tonumber(ARGV[1])
local added = 0
for i = 2, #ARGV, 5 do
  local kind, size, class = ARGV[i + 1], tonumber(ARGV[i + 2]), ARGV[i + 4]
  local rec = kind .. ' ' .. ARGV[i + 2] .. ' ' .. ARGV[i + 3] .. ' 0 ' .. class
  if redis.call('HSETNX', KEYS[1], ARGV[i], rec) == 1 then
    local per_byte = tonumber(ARGV[i + 3]) * {PER_BYTES} / math.max(size, 1)
    redis.call('ZADD', KEYS[2], clock + expected(class) * per_byte, ARGV[i])
    redis.call('HINCRBY', KEYS[3], kind, size)
    if redis.call('HINCRBY', KEYS[4], class .. ':entries', 1) > {REUSE_MEMORY} then
      local read = tonumber(redis.call('HGET', KEYS[4], class .. ':reads') or 0)
      redis.call('HSET', KEYS[4], class .. ':entries', {REUSE_MEMORY // 2},
                 class .. ':reads', math.floor(read / 2))
    end
    added = added + 1
  end
end
return added
"""

# ARGV: clock, then key, reads per entry read. An entry not recorded is left alone.
_READ = f"""
{_EXPECTED}
local clock = tonumber(ARGV[1])
for i = 2, #ARGV, 2 do
  local rec = redis.call('HGET', KEYS[1], ARGV[i])
  if rec then
    {_RECORD}
    local before = tonumber(reads)
    reads = before + tonumber(ARGV[i + 1])
    local counted = math.min(reads, {READS_COUNTED}) - math.min(before, {READS_COUNTED})
    if counted > 0 then
      redis.call('HINCRBY', KEYS[4], class .. ':reads', counted)
    end
    redis.call('HSET', KEYS[1], ARGV[i],
               kind .. ' ' .. size .. ' ' .. cost .. ' ' .. reads .. ' ' .. class)
    local per_byte = tonumber(cost) * {PER_BYTES} / math.max(tonumber(size), 1)
    redis.call('ZADD', KEYS[2], clock + (reads + expected(class)) * per_byte, ARGV[i])
  end
end
return 0
"""

# ARGV: keys. Returns each one's recorded size (0 where none was recorded).
_FORGET = f"""
local freed = {{}}
for i = 1, #ARGV do
  local rec = redis.call('HGET', KEYS[1], ARGV[i])
  freed[i] = 0
  if rec then
    {_RECORD}
    redis.call('HDEL', KEYS[1], ARGV[i])
    redis.call('HINCRBY', KEYS[3], kind, -tonumber(size))
    freed[i] = tonumber(size)
  end
  redis.call('ZREM', KEYS[2], ARGV[i])
end
return freed
"""


@dataclass(frozen=True, slots=True)
class EntryValue:
    """One entry's record: what it holds, what it cost, how often it was read."""

    kind: KeyKind
    size: int
    cost_s: float
    reads: int

    @classmethod
    def parse(cls, raw: bytes) -> EntryValue:
        kind, size, cost, reads = raw.decode().split()[:4]
        return cls(KeyKind(kind), int(size), float(cost), int(reads))


class ValueIndex:
    """The value records of every entry this process writes and reads."""

    def __init__(self, client: RedisClient) -> None:
        self._redis = client
        self._write_script = client.register_script(_WRITE)
        self._read_script = client.register_script(_READ)
        self._lock = threading.Lock()
        self._written: deque[tuple[StoreKey, int, float]] = deque(maxlen=MAX_PENDING)
        self._reads: Counter[StoreKey] = Counter()

    def written(self, key: StoreKey, size: int, cost_s: float) -> None:
        """An entry of ``size`` bytes that took ``cost_s`` to compute was written."""
        if key.kind in VALUED:
            # A cost that is not a finite, positive figure would poison the priority order.
            cost = cost_s if math.isfinite(cost_s) and cost_s > 0 else 0.0
            self._written.append((key, size, cost))

    def read(self, key: StoreKey) -> None:
        """An entry was read by a lookup that hit (a reuse; not a hand-off between stages)."""
        if key.kind in VALUED:
            with self._lock:
                self._reads[key] += 1

    def flush(self) -> None:
        """Record the queued writes, then the queued reads. Writes stay queued while Redis is
        unreachable; reads are dropped then (an entry's priority only lags)."""
        written: list[tuple[StoreKey, int, float]] = []
        while self._written:
            written.append(self._written.popleft())
        with self._lock:
            reads, self._reads = self._reads, Counter()
        if not written and not reads:
            return
        try:
            clock = read_clock(self._redis)
            by_tenant: dict[str, list[str | int | float]] = defaultdict(list)
            for key, size, cost_s in written:
                by_tenant[key.tenant] += [str(key), key.kind.value, size, f"{cost_s:.6g}",
                                          reuse_class(key)]
            for tenant, args in by_tenant.items():
                self._write_script(keys=value_keys(tenant), args=[clock, *args])
            read_args: dict[str, list[str | int | float]] = defaultdict(list)
            for key, n in reads.items():
                read_args[key.tenant] += [str(key), n]
            for tenant, args in read_args.items():
                self._read_script(keys=value_keys(tenant), args=[clock, *args])
        except REDIS_ERRORS:
            log.warning("could not record cache entry values; keeping the writes for the next "
                        "try", exc_info=True)
            self._written.extendleft(reversed(written))


def reuse_class(key: StoreKey) -> str:
    """The entries whose mean reads price ``key``'s: its kind's, and for a checkpoint
    its step's, since traffic reads some steps back (the latest, a schedule's switch) and not
    the others."""
    step = checkpoint_step(key)
    return key.kind.value if step is None else f"{key.kind.value}@{step}"


def _member(request_id: str, key: StoreKey | str) -> str:
    return f"{request_id}|{key}"


def hold(client: RedisClient, tenant: str, request_id: str, keys: Sequence[StoreKey],
         until: float) -> None:
    """Keep ``keys``, the inputs of ``request_id`` in flight, from eviction until it releases
    them, until it ends (``ValueSweeper``'s ``ended``), or until ``until`` (unix seconds) if
    neither is seen (its worker died, say)."""
    members = {_member(request_id, k): until for k in keys if k.kind in VALUED}
    if members:
        client.zadd(value_keys(tenant)[4], members)


def release(client: RedisClient, tenant: str, request_id: str,
            keys: Sequence[StoreKey]) -> None:
    """``request_id`` is done with ``keys``."""
    members = [_member(request_id, k) for k in keys if k.kind in VALUED]
    if members:
        client.zrem(value_keys(tenant)[4], *members)


def held_inputs(client: RedisClient, tenant: str, now: float) -> dict[str, dict[str, float]]:
    """The store keys each request in flight of ``tenant`` holds, by request id, each with
    when its hold lapses; lapsed holds are dropped."""
    needed = value_keys(tenant)[4]
    client.zremrangebyscore(needed, "-inf", now)
    members: list[tuple[bytes, float]] = client.zrangebyscore(  # type: ignore[assignment]
        needed, now, "+inf", withscores=True)
    holds: dict[str, dict[str, float]] = defaultdict(dict)
    for member, until in members:
        request_id, _, key = member.decode().partition("|")
        holds[request_id][key] = until
    return dict(holds)


# KEYS: the needed set. ARGV: member, lapse time, per hold. A hold taken again since it was
# read (a resumed request's encode) has a later lapse time, and stays.
_DROP = """
local dropped = 0
for i = 1, #ARGV, 2 do
  local lapses = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if lapses and tonumber(lapses) == tonumber(ARGV[i + 1]) then
    dropped = dropped + redis.call('ZREM', KEYS[1], ARGV[i])
  end
end
return dropped
"""


def drop_holds(client: RedisClient, tenant: str, holds: Mapping[str, Mapping[str, float]]) -> int:
    """Drop the holds in ``holds`` (request id -> key -> lapse time, as ``held_inputs`` read
    them): their requests have ended. How many were dropped."""
    args: list[str] = []
    for request_id, keys in holds.items():
        for key, until in keys.items():
            args += [_member(request_id, key), repr(until)]
    if not args:
        return 0
    return int(client.register_script(_DROP)(keys=[value_keys(tenant)[4]], args=args))


def read_clock(client: RedisClient) -> float:
    raw = client.get(value_clock())
    return float(raw) if raw else 0.0


def forget(client: RedisClient, keys: Sequence[StoreKey]) -> list[int]:
    """Drop the records of ``keys`` (removed or gone from the store); each one's recorded
    size, 0 where it had none."""
    by_tenant: dict[str, list[int]] = defaultdict(list)
    for i, key in enumerate(keys):
        by_tenant[key.tenant].append(i)
    freed = [0] * len(keys)
    script = client.register_script(_FORGET)
    for tenant, positions in by_tenant.items():
        sizes = script(keys=value_keys(tenant), args=[str(keys[i]) for i in positions])
        for i, size in zip(positions, sizes, strict=True):
            freed[i] = int(size)
    return freed


def held(client: RedisClient, tenant: str) -> dict[KeyKind, int]:
    """The bytes ``tenant``'s recorded entries hold, per kind."""
    raw: dict[bytes, bytes] = client.hgetall(value_keys(tenant)[2])  # type: ignore[assignment]
    return {KeyKind(k.decode()): int(v) for k, v in raw.items() if int(v) > 0}


def records(client: RedisClient, tenant: str, keys: Sequence[StoreKey]
            ) -> list[EntryValue | None]:
    """The records of ``keys`` of ``tenant``, None where one has none."""
    raw: list[bytes | None] = client.hmget(  # type: ignore[assignment]
        value_keys(tenant)[0], [str(k) for k in keys])
    return [None if r is None else EntryValue.parse(r) for r in raw]
