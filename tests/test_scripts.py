"""The queue's Lua scripts against their schema: each file documents exactly the slots its
argument object binds, no file spells a state or a field by hand, and the state machine refuses
a move it does not list."""

from __future__ import annotations

import dataclasses
import re
from importlib import resources

import pytest
import redis

from keys import GenerationSpec, OutputFormat
from keys.names import request_record
from workers.queue import script_args
from workers.queue.record_write import RecordWrite
from workers.queue.records import Records, initial_fields
from workers.queue.schema import TERMINAL, TRANSITIONS, Field, State, timestamp
from workers.queue.script_args import CancelArgs, ClaimArgs
from workers.queue.script_library import Result, slot_comment
from workers.queue.script_slots import ScriptArgs
from workers.queue.scripts import Scripts

LUA = resources.files("workers.queue").joinpath("lua")
ARG_TYPES = [cls for cls in vars(script_args).values()
             if isinstance(cls, type) and issubclass(cls, ScriptArgs) and cls is not ScriptArgs]


def documented_slots(text: str) -> list[str]:
    """The slot names a file's ``-- KEYS:`` and ``-- ARGV:`` header lines list, in order."""
    header = []
    for line in text.splitlines():
        if not line.startswith("--"):
            break
        header.append(line.removeprefix("--").strip())
    body = " ".join(header)
    names: list[str] = []
    for part in ("KEYS", "ARGV"):
        match = re.search(rf"{part}: (.*?)(?= ARGV:| Returns|$)", body)
        assert match, f"no {part} line"
        listed = re.sub(r"\([^)]*\)", "", match.group(1))  # drop the explanations
        names += [n.strip() for n in listed.split(",") if n.strip() and n.strip() != "none"]
    return names


def test_every_script_file_has_an_argument_object() -> None:
    files = {p.name.removesuffix(".lua") for p in LUA.iterdir() if p.name.endswith(".lua")}
    assert files - {"common", "batch"} == {cls.NAME for cls in ARG_TYPES}
    assert set(script_args.SCRIPT_TYPES) == set(ARG_TYPES), "the library's list misses one"


@pytest.mark.parametrize("cls", ARG_TYPES, ids=lambda c: c.NAME)
def test_header_names_every_slot_in_order(cls: type[ScriptArgs]) -> None:
    text = LUA.joinpath(f"{cls.NAME}.lua").read_text()
    assert documented_slots(text) == slot_comment(cls)


@pytest.mark.parametrize("name", sorted(p.name for p in LUA.iterdir()
                                        if p.name.endswith(".lua")))
def test_no_state_or_field_name_is_typed_by_hand(name: str) -> None:
    code = "\n".join(line.split("--")[0] for line in LUA.joinpath(name).read_text().splitlines())
    literals = set(re.findall(r"'([^']*)'", code))
    assert not literals & {s.value for s in State}
    assert not literals & {f.value for f in Field}


def test_a_write_naming_an_unknown_field_is_refused() -> None:
    with pytest.raises(ValueError, match="hit:embed"):
        RecordWrite({"hit:embed": 1})
    assert RecordWrite({"ckpt:3": "k"}, {"hits:embed": 1})  # schema names pass


def test_terminal_states_move_only_back_to_the_start() -> None:
    for state in TERMINAL:
        assert TRANSITIONS[state] == {state, State.QUEUED}


def spec(request_id: str) -> GenerationSpec:
    return GenerationSpec.create(
        request_id=request_id, tenant="scripts", prompt="p", width=16, height=16,
        num_frames=1, num_inference_steps=1, guidance_scale=1.0, seed=0,
        output_format=OutputFormat.NPY)


def test_a_move_the_schema_does_not_list_raises_before_writing(
        redis_client: redis.Redis) -> None:
    client = redis_client
    key = request_record("scripts", "illegal-move")
    client.hset(key, mapping={k: str(v)
                              for k, v in initial_fields(spec("illegal-move")).set.items()})
    scripts = Scripts(client)
    # DONE may not go back to ENCODING: a claim must fail loudly, not corrupt the record.
    client.hset(key, Field.STATE, State.DONE.value)
    assert scripts.result(CancelArgs(key, timestamp())) is Result.FINISHED
    client.hset(key, Field.STATE, State.DENOISED.value)
    with pytest.raises(redis.ResponseError, match="may not move from DENOISED to ENCODING"):
        scripts.run(ClaimArgs(key, "encode", 1, 0, State.ENCODING, timestamp(),
                              RecordWrite({Field.STEP: 9})))
    record = Records(client).get("scripts", "illegal-move")
    assert record is not None and record.state is State.DENOISED and record.step == 0


def test_argument_objects_are_frozen() -> None:
    args = CancelArgs("k", "0")
    with pytest.raises(dataclasses.FrozenInstanceError):
        args.now = "1"  # type: ignore[misc]


def recorded(client: redis.Redis, name: str) -> str:
    key = request_record("scripts", name)
    client.hset(key, mapping={k: str(v) for k, v in initial_fields(spec(name)).set.items()})
    return key


def test_one_failing_call_of_a_batch_leaves_the_others_to_run(
        redis_client: redis.Redis) -> None:
    good = [recorded(redis_client, f"batch-{i}") for i in range(2)]
    bad = recorded(redis_client, "batch-bad")
    redis_client.hset(bad, Field.STATE, State.DENOISED.value)  # may not move to ENCODING
    claims = [ClaimArgs(key, "encode", 1, 0, State.ENCODING, timestamp(), RecordWrite())
              for key in (good[0], bad, good[1])]
    with pytest.raises(redis.ResponseError, match="may not move from DENOISED"):
        Scripts(redis_client).results(claims)
    records = Records(redis_client)
    # One command for the three, yet the calls after the failing one ran, as alone they did.
    assert [records.get("scripts", f"batch-{i}").state for i in range(2)] == [  # type: ignore[union-attr]
        State.ENCODING, State.ENCODING]


def test_the_states_of_many_requests_read_together(redis_client: redis.Redis) -> None:
    recorded(redis_client, "states-a")
    moved = recorded(redis_client, "states-b")
    redis_client.hset(moved, Field.STATE, State.DONE.value)
    assert Records(redis_client).states(
        [("scripts", "states-a"), ("scripts", "states-b"), ("scripts", "no-such")]
    ) == [State.QUEUED, State.DONE, None]
