"""Running the library's scripts: loaded once per process and server (again where a server lost
it), called one at a time or many in one round trip, on the queue's server. The scripts
themselves are ``lua/<name>.lua``, their arguments ``script_args``, the library
``script_library``."""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import redis
from redis.client import Pipeline
from redis.exceptions import MovedError

from cachesvc.redis_client import RedisClient
from workers.queue.queue_server import on_queue_server
from workers.queue.script_library import BATCH, Result, function_name, library
from workers.queue.script_slots import ScriptArgs

# Connection pools of the servers this process has loaded the library on.
_LOADED: weakref.WeakSet[redis.ConnectionPool] = weakref.WeakSet()


def load_library(server: redis.Redis, *, again: bool = False) -> None:
    """Load the library once per server: the queue's (``queue_server``), where every script
    runs (``again``: it lost the library, as one restarted without persistence does; a replica
    promoted in a master's place has it, as functions replicate). Loading is idempotent:
    REPLACE swaps it atomically."""
    if server.connection_pool in _LOADED and not again:
        return
    server.function_load(library()[0], replace=True)
    _LOADED.add(server.connection_pool)


def lost_library(error: object) -> bool:
    """Whether ``error`` says the server does not have the library (it was restarted without
    persistence, or flushed its functions)."""
    return isinstance(error, redis.ResponseError) and "function not found" in str(error).lower()


def execute(client: RedisClient, queue: Callable[[Pipeline], object]) -> list[Any]:
    """Run the commands ``queue`` puts in a pipeline, in one round trip on the queue's server
    (``on_queue_server``: if the queue's slot moved to a promoted replica, they run there).
    Errors come back in place, as ``execute(raise_on_error=False)`` has them."""
    return on_queue_server(client, lambda server: _pipelined(server, queue))


def _pipelined(server: redis.Redis, queue: Callable[[Pipeline], object]) -> list[Any]:
    """``execute`` on one server; if it lost the library, load it and run the commands once
    more. A MOVED answer is raised, to run them on the slot's new master (either way no FCALL
    ran, so nothing runs twice)."""
    load_library(server)
    for attempt in range(2):
        pipe = server.pipeline(transaction=False)
        queue(pipe)
        results: list[Any] = pipe.execute(raise_on_error=False)
        if attempt == 0 and any(lost_library(r) for r in results):
            load_library(server, again=True)
            continue
        if (moved := next((r for r in results if isinstance(r, MovedError)), None)) is not None:
            raise moved
        return results
    raise AssertionError("unreachable")


class Scripts:
    """The library's functions on one client; ``run`` calls one, directly or in a pipeline."""

    def __init__(self, client: RedisClient) -> None:
        # The library is loaded at the first call, not here: a process must start (and answer
        # 503) while Redis is away.
        self.redis = client

    def run(self, args: ScriptArgs, pipe: Pipeline | None = None) -> Any:
        """Call the script of ``args``; queued in ``pipe`` when one is given (run it with
        ``execute``, which loads the library first and again if the server lost it)."""
        name, keys, argv = function_name(type(args)), args.keys(), args.argv()
        if pipe is not None:
            return pipe.fcall(name, len(keys), *keys, *argv)
        (answer,) = execute(self.redis, lambda p: p.fcall(name, len(keys), *keys, *argv))
        if isinstance(answer, Exception):
            raise answer
        return answer

    def result(self, args: ScriptArgs) -> Result:
        return Result(int(self.run(args)))

    def results(self, many: Sequence[ScriptArgs]) -> list[Result]:
        """Run several scripts in one round trip, those of one script in one command (the
        ``batch`` function), in order; each call is atomic on its own."""
        return [Result(int(code)) for code in self.answers(many)]

    def answers(self, many: Sequence[ScriptArgs]) -> list[Any]:
        """``results``, with each call's answer as the script returned it."""
        return self.answers_then(many, None)[0] if many else []

    def answers_then(self, many: Sequence[ScriptArgs],
                     then: ScriptArgs | None) -> tuple[list[Any], Any]:
        """``answers``, then one more call ``then`` in the same round trip (its answer, None
        without one). A worker publishes what it finished and takes its next jobs together:
        Redis writes both to its log in one fsync, where two round trips cost two."""
        kinds = list(dict.fromkeys(type(a) for a in many))
        def queue(pipe: Pipeline) -> None:
            for cls in kinds:
                self._batch([a for a in many if type(a) is cls], pipe)
            if then is not None:
                self.run(then, pipe)

        replies = execute(self.redis, queue)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        following = replies.pop() if then is not None else None
        by_kind = {cls: iter(answers) for cls, answers in zip(kinds, replies, strict=True)}
        answers = [next(by_kind[type(a)]) for a in many]
        for answer in answers:  # every call ran; the first that failed is reported
            if isinstance(answer, Exception):
                raise answer
        return answers, following

    def _batch(self, calls: Sequence[ScriptArgs], pipe: Pipeline) -> None:
        keys = [a.keys() for a in calls]
        argv = [a.argv() for a in calls]
        shapes = json.dumps([[len(k), len(v)] for k, v in zip(keys, argv, strict=True)])
        flat_keys = [k for ks in keys for k in ks]
        pipe.fcall(f"{library()[1]}_{BATCH}", len(flat_keys), *flat_keys,
                   type(calls[0]).NAME, shapes, *(v for vs in argv for v in vs))
