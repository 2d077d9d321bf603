"""The typed tensor cache every worker uses: get, put, exists, remove and batched forms. Each
lookup is counted once (hit or miss, bytes, compute saved): through the job's ledger when the
caller passes one (``cachesvc.ledger``), which also tallies it for the job's record.

Entries are self-describing (``cachesvc.codec``) and every read verifies the header and the whole
payload's checksum before it returns (``entry_reader``): a corrupt entry is counted, removed and
reported as a miss, never returned; an expired one likewise. A miss is ``None``; an unreachable
store raises ``StoreUnavailableError``. The ``slot``/``put_from`` and ``get_into`` pair is the
zero-copy path.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from cachesvc.buffers import BufferPool, RegisteredBuffer, TensorSlot
from cachesvc.codec import TensorSpec
from cachesvc.counted_store import CountedStore
from cachesvc.counters import BUCKET_RETENTION_S, Event, QueuedCounters
from cachesvc.entry_reader import Entry, EntryReader
from cachesvc.entry_writer import EntryWriter
from cachesvc.errors import StoreUnavailableError
from cachesvc.ledger import Ledger
from cachesvc.lookup_log import Access, LookupLog
from cachesvc.policy import KindPolicy, policies
from cachesvc.redis_client import REDIS_ERRORS, RedisClient
from cachesvc.single_flight import Outcome, SingleFlight
from cachesvc.store_backend import StoreBackend
from cachesvc.ttl_index import TtlIndex
from cachesvc.value_index import VALUED, ValueIndex, forget, hold, release
from cachesvc.write_admission import WriteAdmission
from config.settings import CacheSettings, StoreSettings
from keys import StoreKey
from keys.names import flight_lock

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Cached:
    """A tensor from ``get_or_compute`` and how it was obtained."""

    tensor: torch.Tensor
    outcome: Outcome | None  # None: the store was unavailable and the tensor was computed


class TensorCache:
    def __init__(self, store: StoreBackend, client: RedisClient, settings: CacheSettings,
                 store_settings: StoreSettings, *,
                 stats_bucket_s: int = BUCKET_RETENTION_S) -> None:
        self.store = store
        self.counters = QueuedCounters(client, settings.stats_flush_s,
                                       bucket_retention_s=stats_bucket_s)
        self.ttl_index = TtlIndex(client)
        self._policies = policies(settings)
        self._redis = client
        self.values = ValueIndex(client)
        self._inputs_held_s = settings.inputs_held_s
        self.counters.also_flush(self.values.flush)
        self.lookups = (LookupLog(settings.lookup_log_dir)
                        if settings.lookup_log_dir is not None else None)
        self._pool = BufferPool(store, store_settings.buffer_slab_mib << 20,
                                store_settings.buffer_slabs)
        self._flight = SingleFlight(client, lease_s=settings.single_flight_lease_s,
                                    wait_s=settings.single_flight_wait_s)
        self._store = CountedStore(store, self.counters)
        self._reader = EntryReader(self._store, self._pool, self.counters)
        self._writer = EntryWriter(self._store, self._pool, self._policies, self.ttl_index,
                                   self.counters, self.values, self.lookups)
        self.admission = WriteAdmission(client, settings, self.counters)

    def close(self) -> None:
        """Flush counters and release registered memory and the store connection."""
        self.counters.close()
        self._writer.close()
        self._pool.close()
        self.store.close()
        if self.lookups is not None:
            self.lookups.close()

    def policy(self, key: StoreKey) -> KindPolicy:
        return self._policies[key.kind]

    def ledger(self, tenant: str) -> Ledger:
        """A job's ledger: the lookups made with it are counted here and in its tally, which
        the job writes to its record."""
        return Ledger(self.counters, tenant)

    # Writing ----------------------------------------------------------------------------------

    @contextmanager
    def slot(self, spec: TensorSpec) -> Iterator[TensorSlot]:
        """Registered memory for one entry of ``spec``, for the zero-copy ``put_from``."""
        with self._writer.slot(spec) as slot:
            yield slot

    def put_from(self, key: StoreKey, slot: TensorSlot, *, cost_s: float = 0.0) -> None:
        """Store the entry laid out in ``slot``; ``cost_s`` is what computing it took. Every
        write goes through ``admission``, which may refuse a kind that is not read back."""
        if self.admission.admit([key])[0]:
            self._writer.put_from(key, slot, cost_s)

    def put(self, key: StoreKey, tensor: torch.Tensor, *, cost_s: float = 0.0) -> None:
        """Store a copy of ``tensor``. Content-keyed writes are idempotent: the first one wins."""
        if self.admission.admit([key])[0]:
            self._writer.put(key, tensor, cost_s)

    def batch_put(self, items: Sequence[tuple[StoreKey, torch.Tensor]], *,
                  cost_s: float | Sequence[float] = 0.0) -> None:
        """Store several tensors in one round trip; they must share one kind's policy (they
        may be of several tenants). ``cost_s`` is what computing each took: one figure for
        all, or one per item."""
        if not items:
            return
        costs = [cost_s] * len(items) if isinstance(cost_s, float | int) else list(cost_s)
        if len(costs) != len(items):
            raise ValueError(f"batch_put of {len(items)} entries given {len(costs)} costs")
        taken = self.admission.admit([key for key, _ in items])
        if not all(taken):
            items = [item for item, take in zip(items, taken, strict=True) if take]
            costs = [cost for cost, take in zip(costs, taken, strict=True) if take]
        if items:
            self._writer.put_many(items, costs)

    # Reading ----------------------------------------------------------------------------------

    def get_into(self, key: StoreKey, target: TensorSlot | RegisteredBuffer, *,
                 saved_s: float | None = None, ledger: Ledger | None = None
                 ) -> torch.Tensor | None:
        """The verified entry as a view into the target's registered memory (no copy), or None
        on a miss. A slot also says what the caller expects, so the read is sized from its spec
        and its header checked against the slot's; an entry of another spec is read whole and
        returned as it is, just as into a bare buffer."""
        if isinstance(target, TensorSlot):
            entry = self._reader.read(key, target.buffer, target.spec.entry_bytes, target)
        else:
            entry = self._reader.read(key, target, None)
        self._count_lookup(key, entry, saved_s, ledger)
        return None if entry is None else entry.tensor

    def get(self, key: StoreKey, *, saved_s: float | None = None, lookup: bool = True,
            ledger: Ledger | None = None) -> torch.Tensor | None:
        """A copy of the entry, or None on a miss. ``saved_s`` overrides the recorded cost;
        a lookup made with a job's ``ledger`` is counted there (every ``ledger`` below alike).

        ``lookup=False`` is for handing an entry on (a stage reading its input, the API
        serving an output): it counts bytes read, but no lookup, hit or saving, in the
        counters or the ledger, so hit rates measure reuse only.
        """
        entry = self._reader.fetch(key)
        if lookup:
            self._count_lookup(key, entry, saved_s, ledger)
        else:
            self._count_handoff(key, entry)
        return None if entry is None else entry.tensor

    def batch_get(self, keys: Sequence[StoreKey], *,
                  lookup: bool = True) -> list[torch.Tensor | None]:
        """Copies of several entries in one data round trip; None for each miss. A key may
        appear more than once (a prompt that is also the negative prompt): it is read once."""
        unique = list(dict.fromkeys(keys))  # Mooncake's batch read of one key twice fails
        found = self._reader.fetch_many(unique)
        for key in unique:
            if lookup:
                self._count_lookup(key, found.get(key), None, None)
            else:
                self._count_handoff(key, found.get(key))
        out: list[torch.Tensor | None] = []
        handed: set[StoreKey] = set()
        for key in keys:  # a repeated key gets its own copy: callers may write to theirs
            entry = found.get(key)
            out.append(None if entry is None else
                       entry.tensor.clone() if key in handed else entry.tensor)
            handed.add(key)
        return out

    def lookup_many(self, keys: Sequence[StoreKey],
                    ledgers: Sequence[Ledger | None] | None = None
                    ) -> list[torch.Tensor | None]:
        """``get`` of several keys that will mostly miss (a cache asked for entries it may
        never have seen): one existence round trip for all, then a read of each present one.
        Every key counts as a lookup, a hit or a miss, as ``get`` counts it, in its own job's
        ledger (``ledgers``, one per key) where it has one."""
        out: list[torch.Tensor | None] = []
        ledgers = ledgers if ledgers is not None else [None] * len(keys)
        for key, present, ledger in zip(keys, self.batch_exists(keys), ledgers, strict=True):
            entry = self._reader.fetch(key) if present else None  # it may go in between
            self._count_lookup(key, entry, None, ledger)
            out.append(None if entry is None else entry.tensor)
        return out

    def consume(self, key: StoreKey) -> torch.Tensor | None:
        """Read a single-consumer entry and delete it."""
        if not self.policy(key).delete_on_consume:
            raise ValueError(f"{key.kind} entries are shared and cannot be consumed: {key}")
        tensor = self.get(key)
        if tensor is not None:
            self.remove(key)
        return tensor

    def contains(self, key: StoreKey, ledger: Ledger | None = None) -> bool:
        """Whether ``key`` is cached, counted as a lookup: a hit or a miss without a read."""
        found = self.probe(key)
        self._count(key, {Event.LOOKUPS: 1.0, Event.HITS if found else Event.MISSES: 1.0},
                    ledger)
        return found

    def probe(self, key: StoreKey) -> bool:
        """Whether ``key`` is cached: a lookup in the lookup log, left to the caller to count
        (in a job's ledger, once it knows the lookup stands)."""
        found = self.exists(key)
        self._log(key, Access.HIT if found else Access.MISS)
        return found

    def hold_inputs(self, tenant: str, request_id: str, keys: Sequence[StoreKey]) -> None:
        """Keep ``keys``, the inputs of ``request_id`` on its way through the stages, from the
        value sweeper until ``release_inputs`` (or ``cache.inputs_held_s``). Best effort: a
        hold Redis could not take leaves the inputs to lineage, as before."""
        try:
            hold(self._redis, tenant, request_id, keys, time.time() + self._inputs_held_s)
        except REDIS_ERRORS as exc:
            log.warning("request %s: its inputs are not held from eviction (%s)",
                        request_id, exc)

    def release_inputs(self, tenant: str, request_id: str, keys: Sequence[StoreKey]) -> None:
        """``request_id`` is done with ``keys`` (a hold not released lapses on its own)."""
        try:
            release(self._redis, tenant, request_id, keys)
        except REDIS_ERRORS as exc:
            log.warning("request %s: its inputs stay held until the hold lapses (%s)",
                        request_id, exc)

    def log_missed(self, keys: Sequence[StoreKey]) -> None:
        """A search that found none of ``keys``, any one of which would have served it (a
        chain's checkpoints), for the lookup log; the caller counts it."""
        if self.lookups is not None:
            self.lookups.missed(keys)

    def exists(self, key: StoreKey) -> bool:
        return self._store.exists(key)

    def batch_exists(self, keys: Sequence[StoreKey]) -> list[bool]:
        return self._store.batch_exists(keys)

    def remove(self, key: StoreKey) -> bool:
        removed = self._store.remove(key)
        if key.kind in VALUED:
            self.values.flush()  # its write may still be queued: recorded after, it would stay
            forget(self._redis, [key])
        return removed

    def get_or_compute(self, key: StoreKey, compute: Callable[[], torch.Tensor],
                       ledger: Ledger | None = None) -> Cached:
        """The cached tensor, or ``compute()`` once across every process missing on ``key``."""

        def compute_and_put() -> Entry:
            self._log(key, Access.MISS)  # the lookup, logged before the write it leads to
            start = time.perf_counter()
            tensor = compute()
            if tensor.is_cuda:  # kernels are queued: the cost is their run, not their launch
                torch.cuda.synchronize(tensor.device)
            cost = time.perf_counter() - start
            try:
                self.put(key, tensor, cost_s=cost)
            except StoreUnavailableError:
                log.warning("computed %s but could not store it", key, exc_info=True)
            return Entry(tensor, cost, tensor.numel() * tensor.element_size())

        try:
            result = self._flight.run(flight_lock(key), lambda: self._reader.fetch(key),
                                      compute_and_put)
        except StoreUnavailableError:
            return Cached(compute(), None)
        hit = result.outcome in (Outcome.HIT, Outcome.WAITED)
        self._count_lookup(key, result.value if hit else None, None, ledger,
                           miss_logged=not hit)
        if result.outcome is Outcome.WAITED:
            self.counters.add(key.tenant, key.kind, Event.SINGLE_FLIGHT_WAITS)
        return Cached(result.value.tensor, result.outcome)

    # The ledger -------------------------------------------------------------------------------

    def _count_handoff(self, key: StoreKey, entry: Entry | None) -> None:
        """An entry handed on (not reused) counts its bytes only."""
        if entry is not None:
            self.counters.queue(key.tenant, key.kind, {Event.BYTES_READ: float(entry.nbytes)})

    def _count_lookup(self, key: StoreKey, entry: Entry | None, saved_s: float | None,
                      ledger: Ledger | None, *, miss_logged: bool = False) -> None:
        if entry is None:
            if not miss_logged:
                self._log(key, Access.MISS)
            events = {Event.LOOKUPS: 1.0, Event.MISSES: 1.0}
        else:
            self._log(key, Access.HIT, cost_s=entry.cost_s)
            self.values.read(key)
            events = {
                Event.LOOKUPS: 1.0,
                Event.HITS: 1.0,
                Event.BYTES_READ: float(entry.nbytes),
                Event.COMPUTE_SECONDS_SAVED: entry.cost_s if saved_s is None else saved_s,
            }
        self._count(key, events, ledger)

    def _log(self, key: StoreKey, access: Access, cost_s: float = 0.0) -> None:
        if self.lookups is not None:
            self.lookups.log(access, key, cost_s=cost_s)

    def _count(self, key: StoreKey, events: Mapping[Event, float],
               ledger: Ledger | None) -> None:
        if ledger is None:
            self.counters.queue(key.tenant, key.kind, events)
        elif ledger.tenant != key.tenant:  # a job looks up its own tenant's keys only
            raise ValueError(f"{key} looked up with the ledger of tenant {ledger.tenant!r}")
        else:
            ledger.count(key.kind, events)
