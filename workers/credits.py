"""Decode credits: flow control between denoise and decode.

A denoise job takes a credit before it starts and holds it until its latents are decoded, so
at most ``limit`` trajectories are denoising or waiting for decode, and final latents never pile
up behind a slow decode pool. Holders are request records: a holder whose request has finished,
failed, been cancelled or parked gives its credit back the next time anyone asks for one, so an
abandoned job cannot leak a credit; a re-queued job gives it back at once.
"""

from __future__ import annotations

import redis

from keys.names import decode_credits, request_record

# KEYS: credits, holder record. ARGV: limit, now. 1 if the holder has (or now takes) a credit.
_ACQUIRE = """
if redis.call('ZSCORE', KEYS[1], KEYS[2]) then return 1 end
for _, holder in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local state = redis.call('HGET', holder, 'state')
  if not state or state == 'DONE' or state == 'FAILED' or state == 'CANCELLED'
     or state == 'PREEMPTED' then
    redis.call('ZREM', KEYS[1], holder)
  end
end
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[2], KEYS[2])
return 1
"""


class Credits:
    def __init__(self, client: redis.Redis, limit: int) -> None:
        self.redis = client
        self.limit = limit
        self._acquire = client.register_script(_ACQUIRE)

    def acquire(self, tenant: str, request_id: str, now_ms: int) -> bool:
        """Take a credit for the request (idempotent for a holder); False if none is free."""
        return int(self._acquire(keys=[decode_credits(), request_record(tenant, request_id)],
                                 args=[self.limit, now_ms])) == 1

    def release(self, tenant: str, request_id: str) -> None:
        self.redis.zrem(decode_credits(), request_record(tenant, request_id))

    def holders(self) -> int:
        return int(self.redis.zcard(decode_credits()))
