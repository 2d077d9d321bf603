"""``/dashboard``: one self-contained page (no CDN) fed by ``/v1/dashboard`` every few seconds.

The JSON sums every tenant's per-minute cache counters from Redis, so it shows the whole
cluster: hit rate per cache kind, compute saved, bytes served, queues, latency and requests.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

from api.deps import Svc
from api.service import Service, status_of
from cachesvc.counters import read_buckets, read_totals, tenants
from keys import KeyKind
from keys.names import request_index
from workers import stage_metrics
from workers.messages import Stage
from workers.streams import queue_counts

WINDOW_MINUTES = 30
RECENT = 15
KINDS = [KeyKind.EMBEDDING, KeyKind.CFG, KeyKind.CHECKPOINT, KeyKind.OUTPUT]
PAGE = Path(__file__).parent / "static" / "dashboard.html"


def dashboard_data(svc: Service) -> dict[str, Any]:
    now = int(time.time() // 60)
    minutes = range(now - WINDOW_MINUTES + 1, now + 1)
    totals: dict[int, dict[str, float]] = {m: {} for m in minutes}
    recent = []
    known = tenants(svc.redis)
    for tenant in known:
        for minute, fields in read_buckets(svc.redis, tenant, minutes).items():
            for field, value in fields.items():
                totals[minute][field] = totals[minute].get(field, 0.0) + value
        ids: list[bytes] = svc.redis.zrevrange(  # type: ignore[assignment]
            request_index(tenant), 0, RECENT - 1)
        for raw in ids:
            record = svc.records.get(tenant, raw.decode())
            if record is not None:
                recent.append({"tenant": tenant, **status_of(record).model_dump()})

    def series(field: str) -> list[float]:
        return [totals[m].get(field, 0.0) for m in minutes]

    hit_rate = {}
    for kind in KINDS:
        lookups, hits = series(f"{kind.value}.lookups"), series(f"{kind.value}.hits")
        hit_rate[kind.value] = [h / n if n else None for h, n in zip(hits, lookups,
                                                                     strict=True)]
    saved = [sum(totals[m].get(f"{k.value}.compute_seconds_saved", 0.0) for k in KeyKind)
             for m in minutes]
    served = [sum(totals[m].get(f"{k.value}.bytes_read", 0.0) for k in KeyKind)
              for m in minutes]
    queues = [{"stage": stage.value, "priority": priority.value, "waiting": waiting,
               "in_flight": in_flight}
              for (stage, priority), (waiting, in_flight) in queue_counts(svc.redis).items()]
    # Lifetime reuse per tenant and kind: lookups, hits and the compute they saved.
    reuse = []
    for tenant in known:
        lifetime = read_totals(svc.redis, tenant)
        reuse += [{"tenant": tenant, "kind": kind.value,
                   **{e: lifetime.get(f"{kind.value}.{e}", 0.0)
                      for e in ("lookups", "hits", "compute_seconds_saved")}}
                  for kind in KINDS]
    latency = {}
    for stage in Stage:
        h = stage_metrics.read(svc.redis, stage)
        latency[stage.value] = {"p50": h.quantile(0.5), "p95": h.quantile(0.95),
                                "count": h.count}
    recent.sort(key=lambda r: r["updated_at"], reverse=True)
    return {"minutes": [m * 60 for m in minutes], "hit_rate": hit_rate,
            "compute_saved_s": saved, "bytes_served": served, "queues": queues,
            "latency": latency, "reuse": reuse, "recent": recent[:RECENT]}


router = APIRouter()


@router.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
def page() -> HTMLResponse:
    return HTMLResponse(PAGE.read_text())


@router.get("/v1/dashboard")
def data(svc: Svc) -> dict[str, Any]:
    """Everything the dashboard draws, for the last 30 minutes."""
    return dashboard_data(svc)
