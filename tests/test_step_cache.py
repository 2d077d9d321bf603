"""Step caching: a policy and its parameters are part of every trajectory key, hook state
checkpoints without pickle, and the Wan family's output under each policy is bit-identical to
``WanPipeline`` with the same diffusers hook enabled (CPU, float32, one thread per op)."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import redis
import torch

from cachesvc.connect import open_cache
from cachesvc.waiting import wait_until
from config.settings import ApiSettings, Settings
from keys import CfgCache, CfgMode, Fingerprint, StepCache, StepCachePolicy, chain_root
from tests.workers_harness import (
    make_spec,
    reference,
    rewind,
    run_request,
    serve_api,
    version_0,
    wait_done,
)
from workers.engine.hook_state import HookStateError, decode, encode
from workers.queue.spec_json import spec_from_json, spec_to_json

MODEL = Fingerprint("transformer", "0" * 32)


def root(cache: StepCache) -> str:
    return chain_root(make_spec(step_cache=cache), MODEL, {}, "float32").hex


def test_the_policy_and_every_parameter_are_in_the_key_and_defaults_are_spelled_out() -> None:
    roots = {root(StepCache()), root(StepCache.create("first_block")),
             root(StepCache.create("first_block", threshold=0.3)),
             root(StepCache.create("taylorseer")), root(StepCache.create("taylorseer", warmup=4))}
    assert len(roots) == 5
    default = StepCache.create(StepCachePolicy.FIRST_BLOCK)
    assert StepCache.create("first_block", threshold=default.param("threshold")) == default
    assert root(StepCache.create("first_block", threshold=default.param("threshold"))) == \
        root(default)


def test_magcache_keys_hold_the_models_ratios_which_decide_its_skips() -> None:
    spec = make_spec(step_cache=StepCache.create("magcache"))
    roots = {chain_root(spec, MODEL, {}, "float32", ratios).hex
             for ratios in [(1.0, 0.9, 0.8), (1.0, 0.9, 0.7)]}
    assert len(roots) == 2  # recalibrated ratios: another trajectory, other keys
    first_block = make_spec(step_cache=StepCache.create("first_block"))
    assert (chain_root(first_block, MODEL, {}, "float32", (1.0, 0.9)).hex
            == chain_root(first_block, MODEL, {}, "float32").hex)


@pytest.mark.parametrize("given, message", [
    ({"policy": "first_block", "interval": 2}, "step_cache.interval does not apply"),
    ({"policy": "taylorseer", "max_order": 0}, "step_cache.max_order must be from 1"),
    ({"policy": "first_block", "threshold": 0.0}, "step_cache.threshold must be from"),
])
def test_a_parameter_out_of_place_or_range_is_refused_by_name(given: dict[str, object],
                                                              message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StepCache.create(**given)  # type: ignore[arg-type]


def test_the_record_keeps_the_policy_and_reads_records_from_before_it() -> None:
    spec = make_spec(step_cache=StepCache.create("taylorseer", interval=3))
    assert spec_from_json(spec_to_json(spec)) == spec
    old = version_0(make_spec())
    del old["step_cache"]
    assert spec_from_json(json.dumps(old)).step_cache == StepCache()


def test_hook_state_round_trips_through_safetensors_form_without_pickle() -> None:
    state = {"cond": ({"residual": torch.arange(6.0).reshape(2, 3), "step": 4, "last": None,
                       "factors": {0: {0: torch.ones(2, dtype=torch.bfloat16)}, 1: {}},
                       "dtypes": (torch.float32,), "device": torch.device("cpu"),
                       "shapes": (torch.Size([1, 2]),), "flag": False, "pair": [1.5, None]},
                      None),
             "uncond": (None, None)}
    tree, tensors = encode(state, "hooks")
    back = decode(json.loads(json.dumps(tree)), tensors, torch.device("cpu"))
    fields = back["cond"][0]
    assert fields is not None and back["cond"][1] is None and back["uncond"] == (None, None)
    assert torch.equal(fields["residual"], state["cond"][0]["residual"])  # type: ignore[index]
    assert fields["factors"][0][0].dtype == torch.bfloat16 and fields["factors"][1] == {}
    assert {k: v for k, v in fields.items() if k not in ("residual", "factors")} == \
        {k: v for k, v in state["cond"][0].items()  # type: ignore[union-attr]
         if k not in ("residual", "factors")}


def test_hook_state_that_has_no_checkpoint_form_is_refused_by_name() -> None:
    with pytest.raises(HookStateError, match=r"cond\[0\]\.hook is a object"):
        encode({"cond": ({"hook": object()},)}, "hooks")
    with pytest.raises(HookStateError, match="not a torch dtype"):
        decode({"cond": [{"x": {"dtype": "load"}}]}, {}, torch.device("cpu"))
    with pytest.raises(HookStateError, match="unknown hook state node"):
        decode({"cond": [{"x": {"pickle": "..."}}]}, {}, torch.device("cpu"))


@pytest.mark.slow
@pytest.mark.parametrize("cache", [StepCache.create("first_block", threshold=0.3),
                                   StepCache.create("taylorseer", interval=2, warmup=1)],
                         ids=lambda c: c.policy.value)
def test_wan_under_a_step_cache_matches_the_pipeline_with_the_same_hook(
        worker_settings: Settings, client: redis.Redis, pool: object, pipe: object,
        cache: StepCache) -> None:
    spec = make_spec(seed=61, num_inference_steps=8, step_cache=cache)
    frames = run_request(worker_settings, client, spec)
    record = wait_done(client, spec)
    assert (record.counter("lookups:step"), record.counter("lookups:cfg")) == (16, 0)
    assert record.counter("hits:step") > 0
    assert np.array_equal(frames, reference(pipe, spec))
    assert not np.array_equal(frames, reference(pipe, make_spec(seed=61,
                                                                num_inference_steps=8)))


@pytest.mark.slow
def test_a_tenant_default_applies_to_requests_that_name_no_policy_and_the_status_shows_it(
        worker_settings: Settings, client: redis.Redis, pool: object) -> None:
    # The tenant's approximate-reuse default rides along: a default the same way.
    api = ApiSettings(step_cache_defaults={worker_settings.default_tenant: "first_block"},
                      reuse_defaults={worker_settings.default_tenant: "approximate"})
    small = {"width": 32, "height": 32, "num_frames": 5, "num_inference_steps": 4,
             "output_format": "npy", "seed": 3}
    with serve_api(worker_settings, api) as url, httpx.Client(base_url=url) as http:

        def per_policy() -> dict[str, float]:
            """The tenant's first-block forwards on /metrics, by outcome."""
            found = {"computed": 0.0, "skipped": 0.0}
            for line in http.get("/metrics").text.splitlines():
                if (line.startswith("diffcache_step_cache_forwards_total{")
                        and 'policy="first_block"' in line
                        and f'tenant="{worker_settings.default_tenant}"' in line):
                    outcome = line.partition('outcome="')[2].partition('"')[0]
                    found[outcome] = float(line.rpartition(" ")[2])
            return found

        # What earlier requests of this tenant left there (the stack is the session's).
        before = per_policy()
        named = http.post("/v1/generate", json={"prompt": "a fox", **small,
                                                "step_cache": {"policy": "off"},
                                                "reuse": {"mode": "exact"}})
        default = http.post("/v1/generate", json={"prompt": "a fox", **small})
        assert named.status_code == default.status_code == 202, (named.text, default.text)
        statuses = {}
        for name, answer in (("named", named), ("default", default)):
            request_id = answer.json()["id"]
            wait_until(lambda r=request_id: http.get(f"/v1/requests/{r}").json()["state"]
                       == "DONE", timeout_s=120, what=f"{request_id} DONE")
            statuses[name] = http.get(f"/v1/requests/{request_id}").json()

        def added() -> dict[str, float] | None:
            """This request's first-block forwards on /metrics, once the worker has flushed."""
            now = per_policy()
            found = {outcome: now[outcome] - before[outcome] for outcome in now}
            return found if sum(found.values()) >= 8 else None

        shown_on_metrics = wait_until(added, timeout_s=60, what="per-policy forwards")
    assert statuses["named"]["step_cache"] is None
    assert statuses["named"]["reuse"]["mode"] == "exact"
    assert statuses["default"]["reuse"]["mode"] == "approximate"
    shown = statuses["default"]["step_cache"]
    assert shown["policy"] == "first_block" and shown["params"] == {"threshold": 0.2}
    assert shown["forwards"] == 8  # 4 guided steps
    assert shown_on_metrics == {"computed": 8 - shown["skipped"], "skipped": shown["skipped"]}


@pytest.mark.slow
def test_a_step_cache_composes_with_the_interval_tier_and_resumes_bit_exactly(
        worker_settings: Settings, client: redis.Redis, pool: object) -> None:
    """Both approximations at once: the interval tier's residual and the hooks' state are
    both in the checkpoint, so a resume half-way gives the uninterrupted output."""
    both = {"cfg_cache": CfgCache(CfgMode.INTERVAL, 2),
            "step_cache": StepCache.create("first_block", threshold=0.3)}
    spec = make_spec(seed=67, num_inference_steps=8, **both)
    frames = run_request(worker_settings, client, spec)
    record = wait_done(client, spec)
    assert record.counter("cfg_reused") == 4 and record.counter("hits:step") > 0
    cache = open_cache(worker_settings)
    try:
        rewind(worker_settings, cache, record, 4)
    finally:
        cache.close()
    again = make_spec(seed=67, num_inference_steps=8, **both)
    assert np.array_equal(run_request(worker_settings, client, again), frames)
    assert wait_done(client, again).counter("resumed_from") == 4
