"""Schemathesis against the live API's own /openapi.json: no generated request gets a 5xx.

Limits are set tight (32x32, 5 frames, 2 steps) so the valid requests it generates are cheap
for the real workers behind the API."""

from __future__ import annotations

from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from config.settings import ApiSettings, Settings
from tests.workers_harness import serve_api

# Starts worker processes, a browser or a whole service: left out of the fast subset.
pytestmark = pytest.mark.slow

TIGHT = ApiSettings(max_width=32, max_height=32, max_frames=5, max_steps=2, sync_timeout_s=60)


def test_no_generated_request_gets_a_server_error(worker_settings: Settings,
                                                  pool: object) -> None:
    with serve_api(worker_settings, TIGHT) as url:
        schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
        operations = [result.ok() for result in schema.get_all_operations()]
        assert len(operations) >= 10
        for operation in operations:
            no_server_errors(operation)


def no_server_errors(operation: Any) -> None:
    @given(operation.as_strategy())
    @settings(max_examples=12, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    def check(case: Any) -> None:
        response = case.call(timeout=90)
        assert response.status_code < 500, (operation.label, response.text[:300])

    check()
