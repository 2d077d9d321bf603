"""The spec a request record holds: it round-trips exactly, and records written by the release
before schedules carried guidance and requests carried a CFG mode still read."""

from __future__ import annotations

import json

from keys import CfgCache, CfgMode, PromptSegment
from tests.workers_harness import make_spec
from workers.queue.spec_json import spec_from_json, spec_to_json


def test_a_spec_round_trips_through_its_record() -> None:
    spec = make_spec(schedule=(PromptSegment("a fox", "blurry", 2, 3.5),
                               PromptSegment("a wolf", "dark", 4)),
                     cfg_cache=CfgCache(CfgMode.INTERVAL, 3), priority="batch")
    assert spec_from_json(spec_to_json(spec)) == spec


def test_a_record_of_the_previous_release_still_reads() -> None:
    spec = make_spec()
    old = json.loads(spec_to_json(spec))
    del old["cfg_cache"]
    old["schedule"] = [entry[:3] for entry in old["schedule"]]
    assert spec_from_json(json.dumps(old)) == spec
