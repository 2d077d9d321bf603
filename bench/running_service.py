"""A ``diffcache up`` in a subprocess, driven as an operator and a client would: through the
REST API, ``/readyz`` and signals. Shared by the fault-injection benchmark and tests."""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.service_process import ServiceProcess, diffcache_environ
from cachesvc.waiting import wait_until
from keys import GenerationSpec

DEADLINE_S = 240.0
TERMINAL = {"DONE", "FAILED", "CANCELLED"}


@dataclass
class RunningService:
    process: ServiceProcess
    url: str
    data_dir: Path

    @classmethod
    def start(cls, data_dir: Path, model_dir: Path, port: int,
              **settings: str) -> RunningService:
        """``diffcache up`` with the test-sized model in ``model_dir``; returns once it is up.
        ``settings`` are extra DIFFCACHE_* variables."""
        environ = diffcache_environ(**{
            "DIFFCACHE_DATA_DIR": str(data_dir), "DIFFCACHE_MODEL__DIR": str(model_dir),
            "DIFFCACHE_MODEL__PRESET": "test", "DIFFCACHE_MODEL__DEVICE": "cpu",
            "DIFFCACHE_STORE__SEGMENT_MIB": "64",
            "DIFFCACHE_API__PORT": str(port),
            # A killed worker's entries are taken over quickly, and workers poll often.
            "DIFFCACHE_WORKERS__IDLE_TIMEOUT_S": "3", "DIFFCACHE_WORKERS__BLOCK_MS": "200",
            **settings})
        process = ServiceProcess(environ, "up")
        try:
            out = process.wait_for_start()
            if "is up" not in out:
                raise RuntimeError(f"diffcache up failed:\n{out[-2000:]}{store_logs(data_dir)}")
        except BaseException:
            process.kill_tree()
            raise
        return cls(process, f"http://127.0.0.1:{port}", data_dir)

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def stop(self) -> int:
        """SIGTERM, as an operator stops it; the exit status."""
        return self.process.stop(signal.SIGTERM, 120)

    def kill(self) -> None:
        self.process.kill_tree()

    def call(self, method: str, path: str, *, ok_503: bool = False,
             **kwargs: Any) -> httpx.Response:
        """An API call that waits out the API or Redis restarting (refused, or 503 unless
        ``ok_503``: /readyz answers 503 with its checks)."""

        def answered() -> httpx.Response | None:
            try:
                answer = httpx.request(method, f"{self.url}{path}", timeout=10, **kwargs)
            except httpx.TransportError:
                return None
            if answer.status_code != 503 or (ok_503 and "children" in answer.json()):
                return answer
            return None

        return wait_until(answered, timeout_s=DEADLINE_S, interval_s=0.2,
                          what=f"an answer to {method} {path}")

    def generate(self, spec: GenerationSpec, adapters: dict[str, float] | None = None) -> str:
        """Submit ``spec`` (its prompt, size, steps and seed) as an npy request, with the
        uploaded ``adapters`` (name -> scale); its id."""
        segment = spec.schedule[0]
        answer = self.call("POST", "/v1/generate", json={
            "prompt": segment.prompt, "negative_prompt": segment.negative_prompt,
            "width": spec.width, "height": spec.height, "num_frames": spec.num_frames,
            "num_inference_steps": spec.num_inference_steps,
            "guidance_scale": spec.guidance_scale, "seed": spec.seed, "output_format": "npy",
            "loras": [{"name": n, "scale": s} for n, s in (adapters or {}).items()]})
        if answer.status_code != 202:
            raise RuntimeError(f"generate answered {answer.status_code}: {answer.text}")
        request_id: str = answer.json()["id"]
        return request_id

    def upload_adapter(self, name: str, data: bytes) -> None:
        answer = self.call("POST", "/v1/adapters", params={"name": name}, content=data)
        if answer.status_code not in (200, 201):
            raise RuntimeError(f"adapter upload answered {answer.status_code}: {answer.text}")

    @property
    def redis_url(self) -> str:
        """The service's Valkey, from the endpoints ``diffcache up`` writes."""
        endpoints = json.loads((self.data_dir / "endpoints.json").read_text())
        url: str = endpoints["redis_url"]
        return url

    def status(self, request_id: str) -> dict[str, Any]:
        found: dict[str, Any] = self.call("GET", f"/v1/requests/{request_id}").json()
        return found

    def wait(self, request_id: str, states: set[str] = TERMINAL) -> dict[str, Any]:
        """The request's status once it is in one of ``states``."""

        def arrived() -> dict[str, Any] | None:
            now = self.status(request_id)
            return now if now["state"] in states else None

        return wait_until(arrived, timeout_s=DEADLINE_S, interval_s=0.1,
                          what=f"request {request_id} in one of {sorted(states)}")

    def result(self, request_id: str) -> bytes:
        answer = self.call("GET", f"/v1/requests/{request_id}/result")
        if answer.status_code != 200:
            raise RuntimeError(f"result of {request_id}: {answer.status_code} {answer.text}")
        return answer.content

    def children(self) -> dict[str, dict[str, Any]]:
        """Every supervised child by name, as ``/readyz`` reports it."""
        ready = self.call("GET", "/readyz", ok_503=True).json()
        return {c["name"]: c for c in ready["children"]}

    def kill_child(self, name: str) -> None:
        """SIGKILL one child and wait until the supervisor has it running again."""
        before = self.children()[name]
        os.kill(before["pid"], signal.SIGKILL)

        def restarted() -> bool:
            # Empty while Redis itself restarts: the statuses live there.
            now = self.children().get(name)
            return bool(now and now["restarts"] > before["restarts"] and now["alive"])

        wait_until(restarted, timeout_s=DEADLINE_S, interval_s=0.2,
                   what=f"{name} running again after its kill")


def store_logs(data_dir: Path, lines: int = 15) -> str:
    """The ends of the Mooncake logs: where a store that would not start says why."""
    tails = []
    for name in ("mooncake_master", "mooncake_client"):
        path = data_dir / "logs" / f"{name}.log"
        if path.exists():
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            tails.append(f"\n--- {path} ends:\n" + "\n".join(tail))
    return "".join(tails)
