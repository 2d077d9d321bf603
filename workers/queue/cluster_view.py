"""The cluster as the queue side sees it, for dashboards and scrapes: queue depths and the age
of the oldest waiting job, stage latencies, the watchdog's rescues, each worker's adapters and
engine, the served model, and a tenant's latest requests. ``api/`` reads all of it through
``QueueClient.view``, never through the reader modules or the keys themselves."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from cachesvc.redis_client import RedisClient
from keys import Priority
from keys.names import request_index
from workers.queue.messages import Stage
from workers.queue.metrics import engine as engine_metrics
from workers.queue.metrics import stages as stage_metrics
from workers.queue.metrics.adapters import WorkerAdapters, read_adapter_stats
from workers.queue.metrics.engine import ROW_BOUNDS, Occupancy
from workers.queue.metrics.reuse import read_steps_reused
from workers.queue.metrics.stages import Histogram
from workers.queue.metrics.step_cache import read_step_cache
from workers.queue.queue_server import on_queue_server
from workers.queue.records import Records
from workers.queue.schema import RequestRecord
from workers.queue.served_model import ServedModel, read_lora_targets, read_served
from workers.queue.streams import oldest_waiting, queue_counts
from workers.queue.watchdog import RescueReason, read_rescued

# The records a view reads are of these types: its callers import them from here.
__all__ = ["ClusterView", "EngineView", "Occupancy", "QueueDepth", "WorkerAdapters"]


@dataclass(frozen=True, slots=True)
class QueueDepth:
    """One stage and class's jobs: waiting for a worker, and taken but not acknowledged."""

    stage: Stage
    priority: Priority
    waiting: int
    in_flight: int
    oldest_waiting_s: float  # 0 when none waits, or when the view was not asked for ages


@dataclass(frozen=True, slots=True)
class EngineView:
    """What the denoise engines reported: forwards per row count, the wait to join, and how
    full each worker's engine is."""

    rows: Mapping[int, int]
    join_wait: Histogram
    occupancy: list[Occupancy]
    row_bounds: tuple[int, ...] = ROW_BOUNDS


class ClusterView:
    """Reads of the queue side's cluster-wide state, each its own round trip or few."""

    def __init__(self, client: RedisClient) -> None:
        self.redis = client
        self._records = Records(client)

    def queues(self, *, ages: bool = False) -> Iterator[QueueDepth]:
        """Every stage and class; with ``ages``, the seconds the oldest waiting job has
        waited, on the Redis server's clock (entry ids carry it, and this host's may be
        skewed)."""
        counts = queue_counts(self.redis)
        now_ms = self._redis_now_ms() if ages and any(w for w, _ in counts.values()) else 0
        for (stage, priority), (waiting, taken) in counts.items():
            age_s = 0.0
            if now_ms and waiting and (entry := oldest_waiting(self.redis, stage, priority)):
                age_s = max(0, now_ms - int(entry.partition("-")[0])) / 1000
            yield QueueDepth(stage, priority, waiting, taken, age_s)

    def latency(self, stage: Stage, priority: Priority) -> Histogram:
        """Seconds per job of ``stage`` in class ``priority``."""
        return stage_metrics.read(self.redis, stage, priority)

    def rescued(self) -> dict[tuple[Stage, RescueReason], int]:
        """Requests the watchdog re-queued, by stage and reason."""
        return read_rescued(self.redis)

    def adapters(self) -> list[WorkerAdapters]:
        return read_adapter_stats(self.redis)

    def engine(self) -> EngineView:
        return EngineView(engine_metrics.read_rows(self.redis),
                          engine_metrics.read_join_wait(self.redis),
                          engine_metrics.read_occupancy(self.redis))

    def served(self) -> ServedModel | None:
        """The model the workers serve; None before any has published it."""
        return read_served(self.redis)

    def lora_targets(self) -> dict[str, tuple[int, int]]:
        """The linear layers (in, out features) a LoRA may adapt, as denoise workers last
        published them; empty before one has started."""
        return read_lora_targets(self.redis)

    def recent(self, tenant: str, count: int) -> list[RequestRecord]:
        """``tenant``'s latest ``count`` requests whose records remain, newest first."""
        ids: list[bytes] = self.redis.zrevrange(  # type: ignore[assignment]
            request_index(tenant), 0, count - 1)
        records = (self._records.get(tenant, raw.decode()) for raw in ids)
        return [r for r in records if r is not None]

    @staticmethod
    def step_cache(totals: Mapping[str, float]) -> Iterator[tuple[str, str, float]]:
        """(policy, outcome, forwards) of the step cache, from a tenant's cache counters."""
        return read_step_cache(totals)

    @staticmethod
    def steps_reused(totals: Mapping[str, float]) -> float:
        """Denoising steps approximate reuse took from checkpoints, from a tenant's counters."""
        return read_steps_reused(totals)

    def _redis_now_ms(self) -> int:
        # The queue's server's clock, which stamped the stream entries ages are read from.
        seconds, micros = on_queue_server(self.redis, lambda r: r.time())
        return int(seconds) * 1000 + int(micros) // 1000
