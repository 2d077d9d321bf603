"""Counter truth: over a mixed workload of one tenant, the hits and lookups its request records
show add up, kind by kind, to the cluster cache counters that ``/metrics`` exports: no hit is
shown that was not counted, and every lookup is counted whether it hit or missed."""

from __future__ import annotations

import time
import uuid

import pytest
import redis
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from api.metrics import ClusterCollector, registry_with
from cachesvc.connect import open_cache
from cachesvc.waiting import wait_until
from config.settings import Settings
from keys import GenerationSpec, KeyKind, StoreKey
from tests.workers_harness import lose_output, make_spec, record_fields, wait_done
from workers.queue.cluster_view import ClusterView
from workers.queue.lifecycle import Lifecycle
from workers.queue.records import Records
from workers.queue.schema import KindField, PreemptMode, RequestRecord, State
from workers.queue.submit import submit

# Starts worker processes, a browser or a whole service: left out of the fast subset.
pytestmark = pytest.mark.slow

KINDS = (KeyKind.EMBEDDING, KeyKind.OUTPUT, KeyKind.CFG, KeyKind.CHECKPOINT)
SHORT = {"num_inference_steps": 6}  # a checkpoint after every step (a tenth of 6 rounds up)
LONG = {"num_inference_steps": 40, "width": 64, "height": 64}  # long enough to preempt


def again(spec: GenerationSpec) -> GenerationSpec:
    """The identical request under a new request id: the same trajectory, the same output."""
    return make_spec(spec.tenant, seed=spec.seed,
                     **{k: getattr(spec, k) for k in ("num_inference_steps", "width", "height")})


def preempted(client: redis.Redis, spec: GenerationSpec, mode: PreemptMode) -> None:
    """Submit ``spec`` and, once its denoise worker has reported a step, ask it to make way."""

    def denoising() -> bool:
        fields = record_fields(client, spec)
        assert fields.get("state") not in ("DONE", "FAILED"), \
            f"{spec.request_id} finished before it could be preempted: {fields}"
        return fields.get("state") == State.DENOISING.value and int(fields.get("step", 0)) >= 1

    submit(client, spec)
    wait_until(denoising, timeout_s=120, interval_s=0.005,
               what=f"{spec.request_id} denoising at step 1")
    assert Lifecycle(client).ask_preempt(spec.tenant, spec.request_id, mode)


def exported(client: redis.Redis, tenant: str) -> dict[str, int]:
    """``<kind>.hits`` and ``<kind>.lookups`` of ``tenant`` as a ``/metrics`` scrape reports
    them: the API's collector, rendered to the exposition format and parsed back."""
    text = generate_latest(registry_with(ClusterCollector(ClusterView(client)))).decode()
    out = {f"{kind.value}.{event}": 0 for kind in KINDS for event in ("hits", "lookups")}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            event = sample.name.removeprefix("diffcache_cache_").removesuffix("_total")
            field = f"{sample.labels.get('kind')}.{event}"
            if sample.labels.get("tenant") == tenant and field in out:
                assert sample.value == int(sample.value), sample
                out[field] = int(sample.value)
    return out


def recorded(records: list[RequestRecord]) -> dict[str, int]:
    """The same figures summed over the request records, with what attempts refused after a
    request ended counted apart on its record."""
    out: dict[str, int] = {}
    for kind in KINDS:
        for prefix, event in ((KindField.HITS, "hits"), (KindField.LOOKUPS, "lookups")):
            out[f"{kind.value}.{event}"] = sum(
                r.per_kind(prefix, with_late=True).get(kind.value, 0) for r in records)
    return out


class Workload:
    """Requests of one tenant, run one after another; ``done`` holds each one's final record."""

    def __init__(self, settings: Settings, client: redis.Redis) -> None:
        self.settings = settings
        self.client = client
        self.records = Records(client)
        self.tenant = f"truth-{uuid.uuid4().hex[:8]}"
        self.done: list[RequestRecord] = []

    def finish(self, spec: GenerationSpec) -> RequestRecord:
        record = wait_done(self.client, spec)
        assert record.state is State.DONE, record
        self.done.append(record)
        return record

    def run(self, spec: GenerationSpec) -> RequestRecord:
        submit(self.client, spec)
        return self.finish(spec)

    def forget_output_and_checkpoints_after(self, record: RequestRecord, step: int) -> None:
        """Take ``record``'s output, and its checkpoints past ``step``, out of the store."""
        cache = open_cache(self.settings)
        try:
            assert lose_output(self.settings, cache, record)
            for after, key in record.checkpoints().items():
                if after > step:
                    assert cache.remove(StoreKey.parse(key))
        finally:
            cache.close()

    def repeats(self) -> None:
        """Computed from scratch (every lookup misses; guidance 5 runs and caches the CFG
        branch), then again under new request ids: once served whole at encode (embeddings and
        output hit), once with the output and the checkpoints past step 3 gone, so denoise
        resumes at step 3 and re-denoises steps 3..5 on the same latents, which the exact CFG
        tier serves."""
        base = make_spec(self.tenant, seed=1, **SHORT)
        first = self.run(base)
        assert self.run(again(base)).counter(KindField.HITS.of(KeyKind.OUTPUT)) == 1
        self.forget_output_and_checkpoints_after(first, 3)
        recomputed = self.run(again(base))
        assert recomputed.counter("resumed_from") == 3
        assert recomputed.counter(KindField.HITS.of(KeyKind.CFG)) == 3

    def preemptions(self) -> None:
        """One request parked mid-denoise and resumed by hand (encode runs again, denoise goes
        on from the checkpoint); one re-queued, which comes back by itself."""
        parked = make_spec(self.tenant, seed=2, **LONG)
        requeued = make_spec(self.tenant, seed=3, **LONG)
        preempted(self.client, parked, PreemptMode.PARK)
        wait_until(lambda: (r := self.records.get(self.tenant, parked.request_id)) is not None
                   and r.state is State.PREEMPTED, timeout_s=60, interval_s=0.01,
                   what=f"{parked.request_id} parked")
        preempted(self.client, requeued, PreemptMode.REQUEUE)
        stopped = self.records.get(self.tenant, parked.request_id)
        assert stopped is not None and stopped.state is State.PREEMPTED
        Lifecycle(self.client).resume(stopped)
        for spec, resumes in ((parked, 1), (requeued, 0)):
            record = self.finish(spec)
            assert record.counter("preemptions") == 1, record
            assert record.counter("resumes") == resumes, record
            assert record.counter("resumed_from") >= 1, record


def settled_export(client: redis.Redis, tenant: str, expected: dict[str, int],
                   flush_s: float) -> dict[str, int]:
    """The exported figures once every worker's counters have reached Redis. Workers flush
    every ``flush_s``: two scrapes more than two flushes apart that agree (or a scrape that
    matches the records, checked again that long after) leave nothing on its way."""
    gap_s = 2 * flush_s + 0.2
    previous: dict[str, int] = {}

    def settled() -> bool:
        nonlocal previous
        now = exported(client, tenant)
        if now in (expected, previous):
            return True
        previous = now
        time.sleep(gap_s)
        return False

    wait_until(settled, timeout_s=60, interval_s=0.01,
               what=f"{tenant}'s exported counters settled")
    time.sleep(gap_s)
    return exported(client, tenant)


def test_record_hits_and_lookups_add_up_to_the_exported_counters(
        worker_settings: Settings, client: redis.Redis, pool: object) -> None:
    work = Workload(worker_settings, client)
    work.repeats()
    work.preemptions()
    expected = recorded(work.done)
    for kind in KINDS:  # the workload reached every kind's hit path
        assert expected[f"{kind.value}.hits"] > 0, (kind, expected)
    observed = settled_export(client, work.tenant, expected,
                              worker_settings.cache.stats_flush_s)
    print(f"\n{work.tenant}: records {expected}\n{work.tenant}: /metrics {observed}")
    diff = {k: (expected[k], observed[k]) for k in expected if expected[k] != observed[k]}
    assert not diff, f"(records, /metrics) that disagree: {diff}"
