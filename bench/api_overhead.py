"""Control-plane overhead of the HTTP API: POST to DONE through the API versus the direct
submit function, on the same stack, workers and workload, requests alternating between the two.

Each request is tiny (one 32x32 frame, one step) so that compute varies little; the overhead of
a pair is the difference of its two latencies. The HTTP side follows the request's server-sent
events, as ``diffcache generate`` does; the direct side waits on the record's notifications as
the API's event stream does. Then, with the workers stopped, it counts the Redis commands per
second that 200 open event streams of requests where nothing happens cost.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from bench.common import bench_parser, bench_stack, report, start_workers
from cachesvc.redis_client import RedisClient, open_redis
from config.settings import ApiSettings, ModelSettings, Settings, child_environ
from keys import GenerationSpec, OutputFormat
from supervision.processes import ChildProcess, free_port
from workers.main import ensure_model
from workers.queue.events import RecordEvents
from workers.queue.schema import State
from workers.queue.submit import new_request_id, submit

IDLE_STREAMS = 200
IDLE_SECONDS = 20.0
TINY = {"width": 32, "height": 32, "num_frames": 1, "num_inference_steps": 1}


def serve(settings: Settings) -> tuple[str, ChildProcess]:
    """The API in a process of its own, as `diffcache up` runs it."""
    port = free_port("127.0.0.1")
    configured = settings.model_copy(update={"api": ApiSettings(port=port)})
    child = ChildProcess("api", [sys.executable, "-m", "api"],
                         settings.data_dir / "logs" / "api.log", child_environ(configured))
    child.start()
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        # Ready, not only alive: the API links to the store (and loads torch for it) in the
        # background, which would otherwise land in the first measured pairs.
        try:
            return httpx.get(f"{url}/readyz").status_code == 200
        except httpx.HTTPError:
            return False

    child.wait_healthy(healthy, 60, f"see {child.log_path}")
    return url, child


def tiny_spec(settings: Settings, prompt: str, seed: int) -> GenerationSpec:
    return GenerationSpec.create(request_id=new_request_id(), tenant=settings.default_tenant,
                                 prompt=prompt, guidance_scale=5.0, seed=seed,
                                 output_format=OutputFormat.NPY, **TINY)  # type: ignore[arg-type]


def direct(settings: Settings, events: RecordEvents, prompt: str, seed: int) -> float:
    spec = tiny_spec(settings, prompt, seed)
    start = time.perf_counter()
    submit(events.records.redis, spec)
    *_, record = events.follow(spec.tenant, spec.request_id, timeout_s=120)
    if record.state is not State.DONE:
        raise SystemExit(f"request {spec.request_id} ended {record.state.value}: {record.error}")
    return time.perf_counter() - start


def commands_processed(client: RedisClient) -> int:
    return int(client.info("stats")["total_commands_processed"])


async def idle_stream_commands(url: str, settings: Settings, client: RedisClient) -> float:
    """Redis commands per second while ``IDLE_STREAMS`` event streams follow requests that
    nothing runs (the workers are stopped), past their first event."""
    specs = [tiny_spec(settings, f"an idle request {i}", i) for i in range(IDLE_STREAMS)]
    for spec in specs:
        submit(client, spec)

    async def follow(http: httpx.AsyncClient, request_id: str, opened: asyncio.Event) -> None:
        async with http.stream("GET", f"/v1/requests/{request_id}/events") as stream:
            async for line in stream.aiter_lines():
                if line.startswith("event: progress"):
                    opened.set()

    limits = httpx.Limits(max_connections=IDLE_STREAMS + 10)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=None) as http:
        opened = [asyncio.Event() for _ in specs]
        tasks = [asyncio.create_task(follow(http, s.request_id, o))
                 for s, o in zip(specs, opened, strict=True)]
        await asyncio.wait_for(asyncio.gather(*(o.wait() for o in opened)), 60)
        before, start = commands_processed(client), time.perf_counter()
        await asyncio.sleep(IDLE_SECONDS)
        # The two INFO calls count themselves.
        spent = commands_processed(client) - before - 2
        seconds = time.perf_counter() - start
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return spent / seconds


def via_http(http: httpx.Client, prompt: str, seed: int) -> float:
    """POST, then follow the request's server-sent events to its end, as the CLI does."""
    start = time.perf_counter()
    request_id = http.post("/v1/generate", json={"prompt": prompt, "seed": seed,
                                                 "output_format": "npy", **TINY}).json()["id"]
    with http.stream("GET", f"/v1/requests/{request_id}/events") as events:
        for line in events.iter_lines():
            if line.startswith("event: end"):
                break
    return time.perf_counter() - start


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--requests", type=int, default=30, help="pairs of requests")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as model_dir, bench_stack(segment_mib=256) as base:
        settings = base.model_copy(update={"model": ModelSettings(dir=Path(model_dir),
                                                                  preset="test")})
        ensure_model(settings)
        children = start_workers(settings, settings.data_dir / "logs")
        url, api = serve(settings)
        client = open_redis(settings)
        events = RecordEvents(client)
        pairs = []
        try:
            with httpx.Client(base_url=url) as http:
                for i in range(args.requests + 2):  # two warm-up pairs
                    prompt = f"a cat number {i % 5}"
                    first_http = i % 2 == 0
                    a = via_http(http, prompt, i) if first_http else direct(settings, events,
                                                                             prompt, i)
                    b = direct(settings, events, prompt, i + 10_000) if first_http else \
                        via_http(http, prompt, i + 10_000)
                    http_s, direct_s = (a, b) if first_http else (b, a)
                    if i >= 2:
                        pairs.append((direct_s, http_s))
            for child in children:
                child.stop()
            idle_rate = asyncio.run(idle_stream_commands(url, settings, client))
        finally:
            events.close()
            api.stop()
            for child in children:
                child.stop()
    direct_ms = np.array([d for d, _ in pairs]) * 1e3
    http_ms = np.array([h for _, h in pairs]) * 1e3
    overhead = http_ms - direct_ms
    result = {"bench": "api_overhead", "requests": len(pairs),
              "overhead_ms_p50": round(float(np.percentile(overhead, 50)), 2),
              "overhead_ms_p99": round(float(np.percentile(overhead, 99)), 2),
              "idle_streams": IDLE_STREAMS,
              "idle_stream_redis_cmds_per_s": round(idle_rate, 1)}
    report("POST to DONE: HTTP API vs direct submit (ms)", ["path", "p50", "p99"],
           [["direct submit", float(np.median(direct_ms)), float(np.percentile(direct_ms, 99))],
            ["HTTP API", float(np.median(http_ms)), float(np.percentile(http_ms, 99))],
            ["overhead (paired)", result["overhead_ms_p50"], result["overhead_ms_p99"]],
            [f"Redis commands/s, {IDLE_STREAMS} idle event streams", idle_rate, ""]],
           result)


if __name__ == "__main__":
    main()
