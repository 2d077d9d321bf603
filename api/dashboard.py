"""``/dashboard``: one self-contained page (no CDN) fed by ``/v1/dashboard`` every few seconds.

The JSON sums the per-minute cache counters of the tenants the caller may see (its own with a
tenant key; all with an admin key or none configured): hit rate per cache kind, compute saved,
bytes served and requests, plus the cluster's queues and latency. The page holds no data.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

from api.deps import Svc, Viewer
from api.service import Service, status_of
from cachesvc.counters import read_buckets, read_totals, tenants
from cachesvc.value_index import held
from cachesvc.value_sweep import store_capacity
from keys import KeyKind, Priority
from supervision.supervisor import read_published
from workers.queue.cluster_view import EngineView
from workers.queue.messages import Stage

WINDOW_MINUTES = 30
RECENT = 15
KINDS = [KeyKind.EMBEDDING, KeyKind.IMAGE_EMBEDDING, KeyKind.CFG, KeyKind.CHECKPOINT,
         KeyKind.OUTPUT, KeyKind.ADAPTER, KeyKind.IMAGE, KeyKind.IMAGE_LATENT,
         KeyKind.IMAGE_MASK, KeyKind.STEP, KeyKind.APPROXIMATE]
PAGE = Path(__file__).parent / "static" / "dashboard.html"


def dashboard_data(svc: Service, visible: list[str] | None = None) -> dict[str, Any]:
    """The dashboard's figures over the ``visible`` tenants; None is every tenant."""
    now = int(time.time() // 60)
    minutes = range(now - WINDOW_MINUTES + 1, now + 1)
    totals: dict[int, dict[str, float]] = {m: {} for m in minutes}
    recent = []
    view = svc.queue.view
    known = tenants(svc.redis) if visible is None else visible
    for tenant in known:
        for minute, fields in read_buckets(svc.redis, tenant, minutes).items():
            for field, value in fields.items():
                totals[minute][field] = totals[minute].get(field, 0.0) + value
        recent += [{"tenant": tenant, **status_of(record).model_dump()}
                   for record in view.recent(tenant, RECENT)]

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
    queues = [{"stage": q.stage.value, "priority": q.priority.value, "waiting": q.waiting,
               "in_flight": q.in_flight} for q in view.queues()]
    # Lifetime reuse per tenant and kind: lookups, hits, the compute they saved, what the
    # cache wrote and refused to write (write admission), what it holds now and what left it
    # (the value sweeper's evictions, and entries it found the store had dropped).
    reuse, shares = [], []
    capacity = store_capacity(svc.settings)
    for tenant in known:
        lifetime = read_totals(svc.redis, tenant)
        now_held = held(svc.redis, tenant)
        reuse += [{"tenant": tenant, "kind": kind.value, "bytes_held": now_held.get(kind, 0),
                   **{e: lifetime.get(f"{kind.value}.{e}", 0.0)
                      for e in ("lookups", "hits", "compute_seconds_saved", "bytes_written",
                                "writes_refused", "evictions", "found_gone")}}
                  for kind in KINDS]
        shares.append({"tenant": tenant, "bytes_held": sum(now_held.values()),
                       "share": sum(now_held.values()) / capacity})
    latency: dict[str, dict[str, dict[str, float | None]]] = {}
    for stage in Stage:
        for priority in Priority:
            h = view.latency(stage, priority)
            latency.setdefault(stage.value, {})[priority.value] = {
                "p50": h.quantile(0.5), "p95": h.quantile(0.95), "count": h.count}
    children = [{"name": c.name, "role": c.role, "alive": c.alive, "restarts": c.restarts,
                 "last_exit": c.describe_exit(), "crash_looping": c.crash_looping}
                for c in read_published(svc.redis)]
    recent.sort(key=lambda r: r["updated_at"], reverse=True)
    return {"minutes": [m * 60 for m in minutes], "hit_rate": hit_rate,
            "compute_saved_s": saved, "bytes_served": served, "queues": queues,
            "latency": latency, "children": children,
            "adapters": [asdict(a) for a in view.adapters()],
            "engine": engine_view(view.engine()),
            "rescued": [{"stage": stage.value, "reason": reason.value, "count": count}
                        for (stage, reason), count in sorted(view.rescued().items())],
            "model": asdict(model) if (model := view.served()) else None,
            "reuse": reuse, "shares": shares, "max_share": svc.settings.cache.max_share,
            "recent": recent[:RECENT]}


def engine_view(engine: EngineView) -> dict[str, Any]:
    """Rows per forward, the wait to join, and each denoise worker's occupancy."""
    forwards = sum(engine.rows.values())
    mean = sum(r * n for r, n in engine.rows.items()) / forwards if forwards else None
    wait = engine.join_wait
    return {"forwards": forwards, "rows_per_forward": mean,
            "join_wait_p50": wait.quantile(0.5), "join_wait_p95": wait.quantile(0.95),
            "workers": [asdict(o) for o in engine.occupancy]}


router = APIRouter()


@router.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
def page() -> HTMLResponse:
    return HTMLResponse(PAGE.read_text())


@router.get("/v1/dashboard")
def data(svc: Svc, visible: Viewer) -> dict[str, Any]:
    """Everything the dashboard draws, for the last 30 minutes: the caller's own tenant, or
    every tenant for an admin key."""
    return dashboard_data(svc, visible)
