"""Steps that approximate reuse took from similar requests, per tenant: kept beside the cache
counters (whose ``approx`` kind counts its lookups, hits and seconds saved) under a field of
its own, so ``/metrics`` can export it."""

from __future__ import annotations

from collections.abc import Mapping

_FIELD = "approx:steps_reused"


def steps_reused(steps: int) -> dict[str, float]:
    """The counter field one approximate hit adds to its tenant's totals."""
    return {_FIELD: float(steps)}


def read_steps_reused(totals: Mapping[str, float]) -> float:
    """Steps reused over a tenant's totals (``read_totals``)."""
    return totals.get(_FIELD, 0.0)
