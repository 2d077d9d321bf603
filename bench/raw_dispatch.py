"""The Redis work a dispatch cannot avoid, as a baseline for ``bench.dispatch``: for each job,
read it from its stage's stream, acknowledge it, add the next stage's entry and write its
record once, pipelined in batches as the workers are, with no fencing, scripts or events."""

from __future__ import annotations

from typing import Any

from bench.common import NOOP_GO, NOOP_READY, NOOP_START_S
from cachesvc.redis_client import RedisClient, open_redis
from cachesvc.waiting import wait_until
from config.settings import Settings
from keys.names import consumer_group
from workers.queue.messages import Stage

GROUP = consumer_group("raw")


def raw_stream(stage: Stage) -> str:
    return f"bench:raw:{stage.value}"


def prepare(client: RedisClient, record_keys: list[str]) -> None:
    """Each job's entry in the first stage's stream, and the streams' consumer groups."""
    for stage in Stage:
        client.delete(raw_stream(stage))
        client.xgroup_create(raw_stream(stage), GROUP, id="0", mkstream=True)
    pipe = client.pipeline(transaction=False)
    for key in record_keys:
        pipe.xadd(raw_stream(Stage.ENCODE), {"job": key})
    pipe.execute()


def run_raw(stage: Stage, settings: Settings, batch: int) -> None:
    """One stage's loop over its raw stream, once the bench says go; it runs until stopped."""
    client = open_redis(settings)
    stream, following = raw_stream(stage), stage.next
    client.incr(NOOP_READY)
    wait_until(lambda: client.exists(NOOP_GO), timeout_s=NOOP_START_S, interval_s=0.001,
               what="the bench saying go")
    while True:
        got: Any = client.xreadgroup(GROUP, stage.value, {stream: ">"}, count=batch, block=50)
        if not got:
            continue
        pipe = client.pipeline(transaction=False)
        for entry_id, fields in got[0][1]:
            pipe.xack(stream, GROUP, entry_id)
            if following is not None:
                pipe.xadd(raw_stream(following), fields)
            pipe.hset(fields[b"job"], "state", stage.value)
        pipe.execute()


def acknowledged(client: RedisClient) -> int:
    """Jobs the last stage has read and acknowledged."""
    for group in client.xinfo_groups(raw_stream(Stage.DECODE)):
        if group["name"].decode() == GROUP:
            return int(group.get("entries-read") or 0) - int(group["pending"])
    return 0
