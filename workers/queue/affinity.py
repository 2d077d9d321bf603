"""Adapter-aware routing: a denoise job whose LoRA adapters a live worker already runs with (or
at least holds) goes to that worker's inbox instead of the shared stream, so it needs no swap.
Without such a worker the job goes to the shared stream as any other."""

from __future__ import annotations

from collections.abc import Sequence

from cachesvc.redis_client import RedisClient
from keys.names import worker_inbox
from workers.queue.heartbeats import live_workers
from workers.queue.messages import Stage
from workers.queue.metrics.adapters import read_adapter_stats


class AdapterRouter:
    def __init__(self, client: RedisClient, live_within_s: float) -> None:
        self.redis = client
        self.live_within_s = live_within_s

    def inbox_for(self, adapters: Sequence[str]) -> str | None:
        """The inbox of the live denoise worker best placed to run ``adapters`` (hashes):
        one running exactly them, else one holding them all; None when none does."""
        if not adapters:
            return None
        wanted = set(adapters)
        live = live_workers(self.redis, Stage.DENOISE, self.live_within_s)
        workers = [w for w in read_adapter_stats(self.redis) if w.consumer in live]
        running = [w for w in workers if set(w.active) == wanted]
        holding = [w for w in workers if wanted <= set(w.held)]
        best = running or holding
        return worker_inbox(Stage.DENOISE.value, best[0].consumer) if best else None
