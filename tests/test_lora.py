"""LoRA adapters through the worker pool: loaded from the store by hash, applied at their scales,
bit-identical to ``WanPipeline`` after ``load_lora_weights`` and ``set_adapters`` (CPU, float32,
one thread per op); a request that differs only in its adapter or scale shares no entry."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import redis
import torch
import xxhash
from safetensors.torch import save as save_safetensors

from api.metrics import ClusterCollector, registry_with
from bench.lora import random_lora
from cachesvc.connect import open_cache
from config.settings import Settings
from keys import LoraUse, adapter_key
from tests.workers_harness import make_spec, reference, run_request, wait_done
from workers.families import wan
from workers.families.base import CPU
from workers.queue.cluster_view import ClusterView
from workers.queue.metrics.adapters import read_adapter_stats

pytestmark = pytest.mark.slow
TENANT = "lora"


def upload(settings: Settings, state: dict[str, torch.Tensor], tenant: str = TENANT) -> str:
    """Put an adapter in the store as the API does; its content hash."""
    data = save_safetensors(state)
    content_hash = xxhash.xxh3_128_hexdigest(data)
    cache = open_cache(settings)
    try:
        cache.put(adapter_key(tenant, content_hash),
                  torch.frombuffer(bytearray(data), dtype=torch.uint8))
    finally:
        cache.close()
    return content_hash


def test_adapters_apply_bit_identically_and_key_every_entry(
        worker_settings: Settings, client: redis.Redis, pool: object, model_dir: Path,
        pipe: object) -> None:
    state = random_lora(model_dir, seed=1)
    content_hash = upload(worker_settings, state)
    adapted = make_spec(tenant=TENANT, seed=61, loras=(LoraUse(content_hash, 0.7),))
    frames = run_request(worker_settings, client, adapted)

    lora_pipe = wan.FAMILY.reference(model_dir, CPU)
    lora_pipe.pipe.load_lora_weights(state, adapter_name="a")  # type: ignore[attr-defined]
    lora_pipe.pipe.set_adapters(["a"], [0.7])  # type: ignore[attr-defined]
    assert np.array_equal(frames, reference(lora_pipe, adapted))
    base = make_spec(tenant=TENANT, seed=61)
    assert not np.array_equal(frames, reference(pipe, base))  # the adapter did something

    # The same request at another scale shares no CFG, checkpoint or output entry.
    rescaled = make_spec(tenant=TENANT, seed=61, loras=(LoraUse(content_hash, 0.3),))
    other = run_request(worker_settings, client, rescaled)
    record = wait_done(client, rescaled)
    assert record.hits().get("output", 0) == 0
    assert record.hits().get("cfg", 0) == 0 and record.hits().get("ckpt", 0) == 0
    assert not np.array_equal(frames, other)
    # Without adapters the same worker runs the base model exactly: they were disabled.
    assert np.array_equal(run_request(worker_settings, client, base), reference(pipe, base))

    # /metrics shows what the worker that ran the second request did: it loaded the adapter
    # (or found it loaded by the first) and holds it still.
    registry = registry_with(ClusterCollector(ClusterView(client)))
    labels = {"worker": record.fields["worker:denoise"]}
    assert (registry.get_sample_value("diffcache_lora_loads_total", labels) or 0) >= 1
    # It holds this adapter (and any that other tests' requests left on a shared worker).
    held = {w.consumer: w.held for w in read_adapter_stats(client)}[labels["worker"]]
    assert content_hash in held
    assert registry.get_sample_value("diffcache_lora_held", labels) == len(held)
