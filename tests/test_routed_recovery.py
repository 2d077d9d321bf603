"""Routed jobs survive their worker: kill -9 of the denoise worker that holds a LoRA adapter,
with one routed job being denoised and another unread in its inbox behind it. Both end DONE
once, bit-identical to ``WanPipeline`` with the adapter (CPU, float32, one thread per op), and
the dead worker's decode credit is given back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from bench.lora import random_lora
from cachesvc.waiting import wait_until
from config.settings import Settings
from keys import LoraUse
from keys.names import decode_credits, request_record, worker_inbox
from supervision.processes import ChildProcess
from tests.test_lora import upload
from tests.test_preemption import LONG, decode_entries_for
from tests.workers_harness import (
    make_spec,
    read_frames,
    reference,
    start_worker,
    stop_owner_when,
    wait_done,
    wait_for,
    worker_named,
)
from workers.families import wan
from workers.families.base import CPU
from workers.queue.messages import Job, Stage
from workers.queue.metrics.adapters import read_adapter_stats
from workers.queue.schema import State
from workers.queue.submit import submit

pytestmark = pytest.mark.slow
TENANT = "routed"


def routed(client: redis.Redis, stream: str) -> list[str]:
    """Request ids of every entry of ``stream``, read or not."""
    entries: list[Any] = client.xrange(stream)  # type: ignore[assignment]
    return [Job.from_json(fields[b"job"]).request_id for _, fields in entries]


def test_routed_jobs_of_a_killed_worker_finish_once_and_bit_identically(
        worker_settings: Settings, client: redis.Redis,
        pool: dict[Stage, list[ChildProcess]], model_dir: Path, tmp_path: Path) -> None:
    denoisers = pool[Stage.DENOISE]
    while sum(c.alive() for c in denoisers) < 2:  # one to die, one to take over
        denoisers.append(start_worker(worker_settings, Stage.DENOISE, tmp_path, client,
                                      f"denoise-routed-{len(denoisers)}"))
    state = random_lora(model_dir, seed=7)
    lora = (LoraUse(upload(worker_settings, state, tenant=TENANT), 0.8),)
    warm = make_spec(tenant=TENANT, seed=70, loras=lora)
    submit(client, warm)
    holder_name = wait_done(client, warm).fields["worker:denoise"]
    wait_until(lambda: any(w.consumer == holder_name and lora[0].hash in w.active
                           for w in read_adapter_stats(client)), timeout_s=30,
               what="the adapter's worker publishing that it runs it")

    first = make_spec(tenant=TENANT, seed=71, loras=lora, **LONG)
    second = make_spec(tenant=TENANT, seed=72, loras=lora)
    submit(client, first)
    running = wait_for(client, first, State.DENOISING, min_step=1)
    assert running["worker:denoise"] == holder_name  # routed to the worker that runs it
    submit(client, second)
    inbox = worker_inbox(Stage.DENOISE.value, holder_name)
    # Routed to the same worker: unread in its inbox, or already beside the first in its
    # engine (pending under it). Either way it dies with that worker and must come back.
    wait_until(lambda: second.request_id in routed(client, inbox), timeout_s=60,
               what="the second job routed to the first one's worker")
    holder, _ = stop_owner_when(client, first, Stage.DENOISE, denoisers,
                                lambda f: int(f.get("step", 0)) >= 2)
    assert holder is worker_named(denoisers, holder_name)
    holder.kill()  # SIGKILL, mid-step, holding one routed job and the other routed to it

    records = [wait_done(client, spec, timeout_s=180) for spec in (first, second)]
    assert [r.state for r in records] == [State.DONE, State.DONE], records
    assert records[0].fields["worker:denoise"] != holder_name  # taken over, not restarted
    lora_pipe = wan.FAMILY.reference(model_dir, CPU)
    lora_pipe.pipe.load_lora_weights(state, adapter_name="a")  # type: ignore[attr-defined]
    lora_pipe.pipe.set_adapters(["a"], [0.8])  # type: ignore[attr-defined]
    for spec, record in zip((first, second), records, strict=True):
        assert decode_entries_for(client, spec) == 1  # done once
        assert client.zscore(decode_credits(), request_record(spec.tenant,
                                                              spec.request_id)) is None
        assert np.array_equal(read_frames(worker_settings, record),
                              reference(lora_pipe, spec)), spec.request_id
