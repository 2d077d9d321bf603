"""Stage latency histograms kept in Redis, so every worker adds to one cluster-wide histogram
that the API exports to Prometheus and the dashboard turns into p50 and p95."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import redis

from keys.names import stage_latency
from workers.messages import Stage

BOUNDS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, float("inf"))


def _field(bound: float) -> str:
    return "le:+Inf" if bound == float("inf") else f"le:{bound}"


def bucket_field(seconds: float) -> str:
    """The histogram field a job of ``seconds`` counts in; the publish script adds it."""
    return _field(BOUNDS[bisect.bisect_left(BOUNDS, seconds)])


@dataclass(frozen=True, slots=True)
class Histogram:
    """Cumulative counts per upper bound, as Prometheus wants them."""

    cumulative: list[tuple[float, int]]
    total: float
    count: int

    def quantile(self, q: float) -> float | None:
        """The upper bound of the bucket holding quantile ``q``; None with no observations."""
        if not self.count:
            return None
        for bound, n in self.cumulative:
            if n >= q * self.count:
                return bound
        return None


def read(client: redis.Redis, stage: Stage) -> Histogram:
    raw: dict[bytes, bytes] = client.hgetall(stage_latency(stage.value))  # type: ignore[assignment]
    fields = {k.decode(): float(v) for k, v in raw.items()}
    running, cumulative = 0, []
    for bound in BOUNDS:
        running += int(fields.get(_field(bound), 0))
        cumulative.append((bound, running))
    return Histogram(cumulative, fields.get("sum", 0.0), int(fields.get("count", 0)))
