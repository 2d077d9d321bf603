"""Control-plane overhead of the HTTP API: POST to DONE through the API versus the direct
submit function, on the same stack, workers and workload, requests alternating between the two.

Each request is tiny (one 32x32 frame, one step) so that compute varies little; the overhead of
a pair is the difference of its two latencies. The HTTP side follows the request's server-sent
events, as ``diffcache generate`` does; the direct side polls the record as often as the API's
event stream does.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from api.routes import EVENT_POLL_S
from bench.common import bench_stack, report, start_workers
from cachesvc.connect import open_redis
from cachesvc.processes import ChildProcess, free_port
from cachesvc.settings import ApiSettings, ModelSettings, Settings, child_environ
from keys import GenerationSpec, OutputFormat
from workers.main import ensure_model
from workers.messages import State
from workers.records import Records
from workers.submit import new_request_id, submit

POLL_S = EVENT_POLL_S
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
        try:
            return httpx.get(f"{url}/healthz").status_code == 200
        except httpx.HTTPError:
            return False

    child.wait_healthy(healthy, 60, f"see {child.log_path}")
    return url, child


def direct(settings: Settings, records: Records, prompt: str, seed: int) -> float:
    spec = GenerationSpec.create(request_id=new_request_id(), tenant=settings.default_tenant,
                                 prompt=prompt, guidance_scale=5.0, seed=seed,
                                 output_format=OutputFormat.NPY, **TINY)  # type: ignore[arg-type]
    start = time.perf_counter()
    submit(records.redis, spec)
    while True:
        record = records.get(spec.tenant, spec.request_id)
        if record is not None and record.state is State.DONE:
            return time.perf_counter() - start
        time.sleep(POLL_S)


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
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=30, help="pairs of requests")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as model_dir, bench_stack(segment_mib=256) as base:
        settings = base.model_copy(update={"model": ModelSettings(dir=Path(model_dir),
                                                                  preset="test")})
        ensure_model(settings)
        children = start_workers(settings, settings.data_dir / "logs")
        url, api = serve(settings)
        records = Records(open_redis(settings))
        pairs = []
        try:
            with httpx.Client(base_url=url) as http:
                for i in range(args.requests + 2):  # two warm-up pairs
                    prompt = f"a cat number {i % 5}"
                    first_http = i % 2 == 0
                    a = via_http(http, prompt, i) if first_http else direct(settings, records,
                                                                             prompt, i)
                    b = direct(settings, records, prompt, i + 10_000) if first_http else \
                        via_http(http, prompt, i + 10_000)
                    http_s, direct_s = (a, b) if first_http else (b, a)
                    if i >= 2:
                        pairs.append((direct_s, http_s))
        finally:
            api.stop()
            for child in children:
                child.stop()
    direct_ms = np.array([d for d, _ in pairs]) * 1e3
    http_ms = np.array([h for _, h in pairs]) * 1e3
    overhead = http_ms - direct_ms
    result = {"bench": "api_overhead", "requests": len(pairs),
              "overhead_ms_p50": round(float(np.percentile(overhead, 50)), 2),
              "overhead_ms_p99": round(float(np.percentile(overhead, 99)), 2)}
    report("POST to DONE: HTTP API vs direct submit (ms)", ["path", "p50", "p99"],
           [["direct submit", float(np.median(direct_ms)), float(np.percentile(direct_ms, 99))],
            ["HTTP API", float(np.median(http_ms)), float(np.percentile(http_ms, 99))],
            ["overhead (paired)", result["overhead_ms_p50"], result["overhead_ms_p99"]]],
           result)


if __name__ == "__main__":
    main()
