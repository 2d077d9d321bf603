"""A family defined here, outside ``workers/families/``, serves a request through the API and
the three workers: ``model.family`` names it by its import path, every worker imports it, and
no other source file knows its name. Its output is bit-identical to its pipeline (one thread
per op, CPU, float32, the test preset)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import httpx
import imageio.v3 as iio
import numpy as np
import openai
import pytest

from cachesvc.waiting import wait_until
from config.settings import ApiSettings
from tests.workers_harness import answered_record, model_service, reference, serve_api
from workers.families import UnknownFamilyError, family_named, qwen_image, resolve
from workers.families.base import CPU

# A renamed copy of a built-in family is a family of its own to the service: its name is in
# the served model, every record and every route; nothing else of the tree names it.
FAMILY = dataclasses.replace(qwen_image.FAMILY, name="plug-image")
PLUG_IN = f"{__name__}:FAMILY"


def test_a_plug_in_is_named_by_its_import_path(qwen_model_dir: Path, tmp_path: Path) -> None:
    assert family_named(PLUG_IN) is FAMILY
    assert family_named("plug-image") is FAMILY  # registered once imported
    assert resolve(PLUG_IN, tmp_path, "test") is FAMILY  # a folder still to be built
    for path, why in [(f"{__name__}:MISSING", "no importable attribute"),
                      ("no_such_module:FAMILY", "no importable attribute"),
                      (f"{__name__}:PLUG_IN", "is a str, not a"),
                      (":FAMILY", "is not package.module:ATTRIBUTE"),
                      (".relative:FAMILY", "is not package.module:ATTRIBUTE"),
                      (f"{__name__}:BADLY_NAMED", "must be lower-case")]:
        with pytest.raises(UnknownFamilyError, match=why):
            family_named(path)
    with pytest.raises(UnknownFamilyError, match="registered already"):
        family_named(f"{__name__}:IMPOSTOR")


IMPOSTOR = dataclasses.replace(qwen_image.FAMILY, name="plug-image", presets=("shapes",))
BADLY_NAMED = dataclasses.replace(qwen_image.FAMILY, name="plug/image")


@pytest.mark.slow  # a stack and three workers: about a minute
def test_a_plug_in_family_serves_through_the_api_and_the_workers(
        tmp_path: Path, qwen_model_dir: Path) -> None:
    with model_service(tmp_path, qwen_model_dir, "plug", family=PLUG_IN) as service, \
            serve_api(service.settings, ApiSettings()) as url, \
            httpx.Client(base_url=url) as http:
        wait_until(lambda: http.get("/readyz").status_code == 200, timeout_s=60,
                   what="the API ready")
        sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        (listed,) = sdk.models.list().data
        assert listed.id == f"plug-image/{qwen_model_dir.name}"
        answer = sdk.images.generate(model="plug-image", prompt="a red circle",
                                     response_format="url",
                                     extra_body={"seed": 5, "num_inference_steps": 3})
        assert answer.data and answer.data[0].url
        record = answered_record(service.client, service.settings, answer.data[0].url)
        status = http.get(f"/v1/requests/{record.spec.request_id}").json()
        assert status["model"]["family"] == "plug-image"
        kept = http.get(answer.data[0].url)
        assert kept.status_code == 200, kept.text
        pipe = FAMILY.reference(qwen_model_dir, CPU)
        assert np.array_equal(iio.imread(kept.content, extension=".png"),
                              reference(pipe, record.spec)[0])
