"""The CFG unconditional-branch cache over real workers: the exact tier reuses a prediction only
for identical inputs and never changes an output; the interval tier is approximate, opt-in, and
resumes bit-exactly because its residual is part of every checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
import redis

from cachesvc.connect import open_cache
from config.settings import Settings
from keys import CfgCache, CfgMode
from tests.workers_harness import make_spec, reference, rewind, run_request, wait_done

# Starts worker processes, a browser or a whole service: left out of the fast subset.
pytestmark = pytest.mark.slow

STEPS = 6


def test_prompt_variations_from_one_seed_reuse_the_first_unconditional_step(
        worker_settings: Settings, client: redis.Redis, pool: object, pipe: object) -> None:
    first = make_spec(prompt="a red fox in the snow", seed=41, num_inference_steps=STEPS)
    run_request(worker_settings, client, first)
    variation = make_spec(prompt="a grey wolf in the snow", seed=41, num_inference_steps=STEPS)
    frames = run_request(worker_settings, client, variation)
    record = wait_done(client, variation)
    # Same seed and negative prompt: only step 0 sees the same latents, so only it hits.
    assert (record.counter("lookups:cfg"), record.counter("hits:cfg")) == (STEPS, 1)
    assert record.counter("forwards") == 2 * STEPS - 1
    assert np.array_equal(frames, reference(pipe, variation))  # reuse changed nothing

    off = make_spec(prompt="a brown bear in the snow", seed=41, num_inference_steps=STEPS,
                    cfg_cache=CfgCache(CfgMode.OFF))
    run_request(worker_settings, client, off)
    record = wait_done(client, off)
    assert (record.counter("lookups:cfg"), record.counter("forwards")) == (0, 2 * STEPS)


def test_the_interval_tier_skips_branches_and_resumes_bit_exactly(
        worker_settings: Settings, client: redis.Redis, pool: object, pipe: object) -> None:
    interval = CfgCache(CfgMode.INTERVAL, 2)
    spec = make_spec(prompt="a small boat at sea", seed=52, num_inference_steps=STEPS,
                     cfg_cache=interval)
    frames = run_request(worker_settings, client, spec)
    record = wait_done(client, spec)
    assert record.counter("cfg_reused") == STEPS // 2  # steps 1, 3 and 5 reuse the residual
    assert record.counter("forwards") == STEPS + STEPS // 2
    assert record.counter("resumed_from") == 0  # never shares the exact trajectory's chain
    exact = reference(pipe, spec)
    assert not np.array_equal(frames, exact)  # approximate, as asked
    # Resume at step 3: step 3 reuses the residual of step 2, which only the checkpoint holds.
    cache = open_cache(worker_settings)
    try:
        rewind(worker_settings, cache, record, 3)
    finally:
        cache.close()
    again = make_spec(prompt="a small boat at sea", seed=52, num_inference_steps=STEPS,
                      cfg_cache=interval)
    assert np.array_equal(run_request(worker_settings, client, again), frames)
    assert wait_done(client, again).counter("resumed_from") == 3
