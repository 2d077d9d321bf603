"""Stage latency histograms kept in Redis, so every worker adds to one cluster-wide histogram
that the API exports to Prometheus and the dashboard turns into p50 and p95."""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from enum import StrEnum

from cachesvc.redis_client import RedisClient
from keys import Priority
from keys.names import stage_latency

# Upper bounds growing by 2^(1/4) from 10 ms past 60 s (52 buckets), so a quantile read by
# interpolating inside its bucket is within about 9 % of the true value across that range.
_RATIO = 2 ** 0.25
BOUNDS = (*(round(0.01 * _RATIO ** i, 5) for i in range(52)), float("inf"))


def _field(bound: float) -> str:
    return "le:+Inf" if bound == float("inf") else f"le:{bound}"


_FIELDS = tuple(_field(bound) for bound in BOUNDS)


def bucket_field(seconds: float) -> str:
    """The histogram field a job of ``seconds`` counts in; the publish script adds it."""
    return _FIELDS[bisect.bisect_left(BOUNDS, seconds)]


@dataclass(frozen=True, slots=True)
class Histogram:
    """Cumulative counts per upper bound, as Prometheus wants them."""

    cumulative: list[tuple[float, int]]
    total: float
    count: int

    def quantile(self, q: float) -> float | None:
        """Quantile ``q``, interpolated linearly inside the bucket that holds it (as
        Prometheus' ``histogram_quantile`` does); None with no observations."""
        if not self.count:
            return None
        rank = q * self.count
        lower, below = 0.0, 0
        for bound, n in self.cumulative:
            if n >= rank:
                if bound == float("inf"):
                    return lower  # past the last finite bound: the best we can say
                return lower + (bound - lower) * (rank - below) / max(n - below, 1)
            lower, below = bound, n
        return None


def read(client: RedisClient, stage: StrEnum, priority: Priority) -> Histogram:
    """The histogram of ``stage`` (a ``workers.queue.messages.Stage``: named by its value, so
    that the queue's metrics import nothing of the queue) at ``priority``."""
    return read_hash(client, stage_latency(stage.value, priority.value))


def read_hash(client: RedisClient, key: str) -> Histogram:
    """The histogram kept in the hash ``key`` (fields ``le:<bound>``, ``sum``, ``count``)."""
    raw: dict[bytes, bytes] = client.hgetall(key)  # type: ignore[assignment]
    fields = {k.decode(): float(v) for k, v in raw.items()}
    running, cumulative = 0, []
    for bound in BOUNDS:
        running += int(fields.get(_field(bound), 0))
        cumulative.append((bound, running))
    return Histogram(cumulative, fields.get("sum", 0.0), int(fields.get("count", 0)))
