"""The multi-host test's hands on the head's machine: read JSON calls from stdin, run them
against the head's API and Redis from inside its network namespace, and write each answer to
the file the call names. Started by ``bench.netns.Driver``."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import redis

from cachesvc.waiting import wait_until
from keys import Priority
from keys.names import request_record, stage_stream, supervised_children
from supervision.supervisor import CHILD_STATUS
from workers.queue.messages import Job, Stage

TENANT = "default"


class Calls:
    def __init__(self, api_url: str, redis_url: str) -> None:
        self.http = httpx.Client(base_url=api_url, timeout=120)
        self.redis = redis.Redis.from_url(redis_url)

    def ready(self) -> bool:
        try:
            return bool(self.http.get("/readyz").json()["ready"])
        except (httpx.HTTPError, ValueError, KeyError):
            return False

    def generate(self, body: dict[str, Any]) -> str:
        response = self.http.post("/v1/generate", json=body)
        response.raise_for_status()
        return str(response.json()["id"])

    def wait(self, id: str, out: str) -> dict[str, Any]:
        """Follow the request's events to its end; write its output to ``out`` if DONE."""
        with self.http.stream("GET", f"/v1/requests/{id}/events", timeout=300) as events:
            for line in events.iter_lines():
                if line.startswith("event: end"):
                    break
        status: dict[str, Any] = self.http.get(f"/v1/requests/{id}").json()
        if status["state"] == "DONE":
            Path(out).write_bytes(self.http.get(f"/v1/requests/{id}/result").content)
        return status

    def run_batch(self, bodies: list[dict[str, Any]], out_dir: str) -> dict[str, Any]:
        """Submit every body at once and wait for all; ids in order, wall seconds, and each
        one's output in ``out_dir``/<index>.npy."""
        start = time.perf_counter()
        ids = [self.generate(body) for body in bodies]
        for i, request_id in enumerate(ids):
            status = self.wait(request_id, f"{out_dir}/{i}.npy")
            if status["state"] != "DONE":
                raise RuntimeError(f"request {request_id} ended {status}")
        return {"ids": ids, "seconds": time.perf_counter() - start}

    def fields(self, id: str) -> dict[str, str]:
        raw: dict[bytes, bytes] = self.redis.hgetall(  # type: ignore[assignment]
            request_record(TENANT, id))
        return {k.decode(): v.decode() for k, v in raw.items()}

    def wait_fields(self, id: str, field: str, at_least: int) -> dict[str, str]:
        return self._record_when(id, lambda f: int(f.get(field, 0)) >= at_least,
                                 f"{id}'s {field} at {at_least}")

    def wait_state(self, id: str, state: str) -> dict[str, str]:
        return self._record_when(id, lambda f: f.get("state") == state, f"{id} {state}")

    def _record_when(self, id: str, ready: Callable[[dict[str, str]], bool],
                     what: str) -> dict[str, str]:
        def reached() -> dict[str, str] | None:
            fields = self.fields(id)
            return fields if ready(fields) else None

        return wait_until(reached, timeout_s=120, interval_s=0.005, what=what)

    def preempt(self, id: str, mode: str) -> dict[str, Any]:
        response = self.http.post(f"/v1/requests/{id}/preempt", json={"mode": mode})
        response.raise_for_status()
        return dict(response.json())

    def resume(self, id: str) -> str:
        response = self.http.post("/v1/resume", json={"request_id": id})
        response.raise_for_status()
        return str(response.json()["id"])

    def children(self) -> dict[str, int]:
        """``host/child`` -> pid of every supervised process in the cluster."""
        raw: dict[bytes, bytes] = self.redis.hgetall(  # type: ignore[assignment]
            supervised_children())
        statuses = {k.decode(): CHILD_STATUS.decode(v) for k, v in raw.items()}
        return {k: s.pid for k, s in statuses.items() if s.pid is not None}

    def decode_jobs(self, id: str) -> int:
        """How many decode jobs the request was ever handed: once means published once."""
        entries: Any = self.redis.xrange(stage_stream(Stage.DECODE.value,
                                                      Priority.INTERACTIVE.value))
        return sum(1 for _, f in entries if Job.from_json(f[b"job"]).request_id == id)


def main() -> None:
    calls = Calls(sys.argv[1], os.environ["DIFFCACHE_REDIS__URL"])
    for line in sys.stdin:
        call = json.loads(line)
        try:
            reply = {"result": getattr(calls, call["op"])(**call["args"])}
        except Exception as exc:
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        partial = Path(call["reply"] + ".partial")
        partial.write_text(json.dumps(reply))
        partial.replace(call["reply"])


if __name__ == "__main__":
    main()
