"""The spec a request record holds: it round-trips exactly through the one wire style, and
records written by earlier releases (before the envelope, and before schedules carried
guidance and requests carried a CFG mode) still read; anything else is a typed error."""

from __future__ import annotations

import json

import pytest

from cachesvc.wire import UnknownVersionError, WireError
from keys import CfgCache, CfgMode, PromptSegment
from tests.workers_harness import make_spec, version_0
from workers.queue.spec_json import spec_from_json, spec_to_json


def test_a_spec_round_trips_through_its_record() -> None:
    spec = make_spec(schedule=(PromptSegment("a fox", "blurry", 2, 3.5),
                               PromptSegment("a wolf", "dark", 4)),
                     cfg_cache=CfgCache(CfgMode.INTERVAL, 3), priority="batch")
    assert spec_from_json(spec_to_json(spec)) == spec
    assert json.loads(spec_to_json(spec))["v"] == 1


def test_records_of_earlier_releases_still_read() -> None:
    spec = make_spec(schedule=(PromptSegment("a fox", "blurry", 2, 3.5),
                               PromptSegment("a wolf", "dark", 4)))
    assert spec_from_json(json.dumps(version_0(spec))) == spec
    plain = make_spec()
    older = version_0(plain)
    del older["cfg_cache"]
    older["schedule"] = [entry[:3] for entry in older["schedule"]]  # type: ignore[attr-defined]
    assert spec_from_json(json.dumps(older)) == plain


def test_a_newer_or_foreign_payload_is_a_typed_error_naming_it() -> None:
    newer = json.loads(spec_to_json(make_spec()))
    newer["v"] = 2
    with pytest.raises(UnknownVersionError, match="request: version 2") as caught:
        spec_from_json(json.dumps(newer))
    assert caught.value.version == 2
    foreign = dict(newer, v=1, kind="child status")
    with pytest.raises(WireError, match="holds a 'child status' payload"):
        spec_from_json(json.dumps(foreign))
    broken = dict(newer, v=1)
    broken["value"] = dict(broken["value"], width="wide")
    with pytest.raises(WireError, match="request: unreadable version 1"):
        spec_from_json(json.dumps(broken))
