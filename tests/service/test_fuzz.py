"""Property-based fuzzing of the real HTTP API from its own OpenAPI schema: no 5xx, and every
response matches the schema (status code, content type, body)."""

import os

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.server import running_service

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def live_schema(repository):
    with running_service(repository) as (url, _proc):
        yield schemathesis.openapi.from_url(f"{url}/openapi.json")


schema = schemathesis.pytest.from_fixture("live_schema")


# CI replays a fixed sequence of examples; FUZZ_EXAMPLES=500 FUZZ_RANDOM=1 explores new ones.
@schema.parametrize()
@settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "60")), derandomize=not os.environ.get("FUZZ_RANDOM"),
          deadline=None, suppress_health_check=list(HealthCheck))
def test_api_from_its_schema(case):
    case.call_and_validate(checks=[not_a_server_error, status_code_conformance, content_type_conformance,
                                   response_schema_conformance], timeout=30)
