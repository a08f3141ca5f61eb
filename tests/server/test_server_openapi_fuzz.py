"""Schemathesis against the engine's own OpenAPI (``/openapi.json``, request bodies from
``engine.server.schemas``), over HTTP against a live engine (the tiny model, so generated requests that
generate hundreds of tokens stay fast), with a bounded number of generated requests per operation: no 5xx,
and the served schema is the one the app builds."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from server_testlib import ThreadedServer

from engine.server.app import create_app
from engine.server.args import parse_args
from engine.server.builder import build_engine

pytestmark = pytest.mark.slow
SPEC = create_app(None).openapi()  # building the schema reads no engine state
schema = schemathesis.openapi.from_dict(SPEC)
schema.config.phases.coverage.enabled = False  # generated cases only, MAX_EXAMPLES per operation
MAX_EXAMPLES = 6


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir, tiny_runner):
    args = parse_args(["--model-path", str(tiny_model_dir), "--enable-hierarchical-cache"])
    engine = build_engine(args, runner=tiny_runner)
    with ThreadedServer(engine) as server:
        assert httpx.get(f"{server.url}/openapi.json").json() == SPEC
        yield server.url
    engine.scheduler.stop()


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_engine_api_never_answers_5xx(case, engine_url):
    case.call_and_validate(base_url=engine_url, checks=[not_a_server_error], timeout=60)
