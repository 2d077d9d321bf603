"""Forwards run under each step-cache policy, per tenant: computed in full, and those a hook
stood in for (part of). Kept beside the cache counters, under field names of their own, so
``/metrics`` can label them by policy."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from keys import StepCachePolicy

_PREFIX = "step_cache"
OUTCOMES = ("computed", "skipped")


def step_cache_fields(policy: StepCachePolicy, computed: int, skipped: int) -> dict[str, float]:
    """The counter fields a run's forwards add to its tenant's totals."""
    return {f"{_PREFIX}:{policy.value}:computed": float(computed),
            f"{_PREFIX}:{policy.value}:skipped": float(skipped)}


def read_step_cache(totals: Mapping[str, float]) -> Iterator[tuple[str, str, float]]:
    """(policy, outcome, forwards) for each policy a tenant's totals (``read_totals``) hold."""
    for name, value in totals.items():
        prefix, _, rest = name.partition(":")
        policy, _, outcome = rest.partition(":")
        if prefix == _PREFIX and outcome in OUTCOMES:
            yield policy, outcome, value
