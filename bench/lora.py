"""Adapter-aware routing: 24 seeded requests alternating between 3 LoRA adapters, on two denoise
workers, with routing on and then off (each phase under its own tenant, so nothing is shared).

Reports the adapter swaps each phase made (a worker changing the adapters it runs with), the
throughput of the routed phase over the unrouted one, and whether their outputs are identical.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import xxhash
from safetensors.torch import save as save_safetensors

from bench.common import bench_parser, model_stack, report, wait_all, workers
from cachesvc.connect import open_cache
from cachesvc.redis_client import RedisClient, open_redis
from config.settings import Settings
from keys import GenerationSpec, LoraUse, OutputFormat, StoreKey, adapter_key
from keys.names import adapter_stats
from workers.queue.metrics.adapters import read_adapter_stats
from workers.queue.records import Records
from workers.queue.submit import new_request_id, submit
from workers.stages.media import decode_npy

ADAPTERS = 3


def random_lora(model_dir: Path, seed: int, rank: int = 4,
                targets: tuple[str, ...] = ("attn1.to_q", "attn1.to_v")
                ) -> dict[str, torch.Tensor]:
    """A diffusers-format LoRA on the linear layers of the folder's transformer whose names
    end with ``targets``."""
    import diffusers

    from workers.families.base import component_config

    model_class = getattr(diffusers, component_config(model_dir, "transformer")["_class_name"])
    model = model_class.from_pretrained(model_dir / "transformer")
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.endswith(targets):
            state[f"transformer.{name}.lora_A.weight"] = 0.2 * torch.randn(
                rank, module.in_features, generator=g)
            state[f"transformer.{name}.lora_B.weight"] = 0.2 * torch.randn(
                module.out_features, rank, generator=g)
    return state


def phase(settings: Settings, tenant: str, adapters: list[bytes], requests: int,
          steps: int) -> tuple[float, int, list[bytes]]:
    """Seconds for the batch, swaps made, and the outputs, in request order."""
    cache = open_cache(settings)
    hashes = []
    for adapter in adapters:
        content_hash = xxhash.xxh3_128_hexdigest(adapter)
        cache.put(adapter_key(tenant, content_hash),
                  torch.frombuffer(bytearray(adapter), dtype=torch.uint8))
        hashes.append(content_hash)
    client: RedisClient = open_redis(settings)
    client.delete(adapter_stats())
    specs = [GenerationSpec.create(
        request_id=new_request_id(), tenant=tenant, prompt="a heron at dawn",
        negative_prompt="blurry", width=32, height=32, num_frames=5,
        num_inference_steps=steps, guidance_scale=5.0, seed=500 + i,
        output_format=OutputFormat.NPY, loras=(LoraUse(hashes[i % len(hashes)], 0.8),))
        for i in range(requests)]
    with workers(settings, settings.data_dir / "logs" / tenant):
        start = time.perf_counter()
        for spec in specs:
            submit(client, spec)
        done = wait_all(Records(client), specs)
        seconds = time.perf_counter() - start
        swaps = sum(w.swaps for w in read_adapter_stats(client))
    outputs = []
    for spec in specs:
        output = cache.get(StoreKey.parse(done[spec.request_id].output_key or ""), lookup=False)
        if output is None:
            raise SystemExit(f"the output of {spec.request_id} is gone from the store")
        outputs.append(decode_npy(output.numpy().tobytes()).tobytes())
    cache.close()
    return seconds, swaps, outputs


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    with model_stack() as base:
        adapters = [save_safetensors(random_lora(base.model_dir, seed))
                    for seed in range(ADAPTERS)]
        runs = {}
        for routing in (True, False):
            settings = base.model_copy(update={"workers": base.workers.model_copy(update={
                "denoise_workers": 2, "adapter_routing": routing, "preempt": False})})
            runs[routing] = phase(settings, "routed" if routing else "unrouted", adapters,
                                  args.requests, args.steps)
    (routed_s, routed_swaps, routed_out), (plain_s, plain_swaps, plain_out) = \
        runs[True], runs[False]
    result = {"bench": "lora", "adapters": ADAPTERS, "requests": args.requests,
              "swaps_routed": routed_swaps, "swaps_unrouted": plain_swaps,
              "throughput_ratio": round(plain_s / routed_s, 3),
              "identical": routed_out == plain_out}
    report("24 requests over 3 adapters, two denoise workers", ["routing", "seconds", "swaps"],
           [["on", routed_s, routed_swaps], ["off", plain_s, plain_swaps]], result)


if __name__ == "__main__":
    main()
