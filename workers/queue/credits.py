"""Decode credits: flow control between denoise and decode.

A denoise job takes a credit before it starts and holds it until its latents are decoded, so
at most ``limit`` trajectories are denoising or waiting for decode, and final latents never pile
up behind a slow decode pool. Holders are request records: a holder whose request has finished,
failed, been cancelled or parked gives its credit back the next time anyone asks for one, so an
abandoned job cannot leak a credit; a re-queued or recomputed job gives it back at once.
"""

from __future__ import annotations

from cachesvc.redis_client import RedisClient
from keys.names import decode_credits, request_record
from workers.queue.script_args import AcquireCreditArgs, ReleaseCreditArgs
from workers.queue.script_library import Result
from workers.queue.scripts import Scripts


class Credits:
    def __init__(self, client: RedisClient, limit: int) -> None:
        self.redis = client
        self.limit = limit
        self.scripts = Scripts(client)

    def acquire(self, tenant: str, request_id: str, now_ms: int) -> bool:
        """Take a credit for the request (idempotent for a holder); False if none is free."""
        return self.scripts.result(AcquireCreditArgs(
            decode_credits(), request_record(tenant, request_id), self.limit, now_ms)) is Result.OK

    def release(self, tenant: str, request_id: str) -> None:
        self.scripts.run(ReleaseCreditArgs(decode_credits(), request_record(tenant, request_id)))

    def holders(self) -> int:
        return int(self.redis.zcard(decode_credits()))
