"""Schemathesis against the control plane's own OpenAPI (drf-spectacular), in-process through the WSGI app,
as an operator and as a viewer, with a bounded number of generated requests per operation: no 5xx, every
response with a documented status matches its schema, and every response has a declared content type."""

import json

import pytest
import schemathesis
from django.core.wsgi import get_wsgi_application
from drf_spectacular.generators import SchemaGenerator
from drf_spectacular.renderers import OpenApiJsonRenderer
from hypothesis import HealthCheck, settings
from schemathesis.checks import content_type_conformance, not_a_server_error, response_schema_conformance

APP = get_wsgi_application()
SPEC = json.loads(OpenApiJsonRenderer().render(SchemaGenerator().get_schema(request=None, public=True)))
# The what-if replay runs the engine's CLI in a child process (torch import, seconds per valid case); its
# validation and results are checked in test_capacity.py, so the fuzz run leaves that one operation out.
schema = schemathesis.openapi.from_dict(SPEC).exclude(path="/api/v1/capacity/whatif/", method="POST")
schema.config.phases.coverage.enabled = False  # generated cases only, MAX_EXAMPLES per operation


@schemathesis.check
def no_server_error_but_a_502_naming_a_worker(ctx, response, case):
    """``not_a_server_error``, except the 502 a worker-proxying call answers when its worker (here a URL
    nothing listens on) is unreachable: the documented gateway error, not a control-plane failure."""
    if response.status_code == 502 and response.json()["error"]["code"] == "worker_error":
        return None
    return not_a_server_error(ctx, response, case)


CHECKS = [no_server_error_but_a_502_naming_a_worker, response_schema_conformance, content_type_conformance]
MAX_EXAMPLES = 6


@pytest.fixture
def wsgi_in_test_transaction():
    """Keep the test's DB connection open across WSGI requests (what django.test.Client does)."""
    from django.core import signals
    from django.db import close_old_connections

    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    yield
    signals.request_started.connect(close_old_connections)
    signals.request_finished.connect(close_old_connections)


@pytest.fixture
def fleet(db, wsgi_in_test_transaction, fake_router):
    """A few real rows so generated ids hit something: a host with a GPU, a worker behind a (fake) router, a
    storage profile, a config profile with one revision, an operation the system created."""
    from cp_factories import (
        ConfigRevisionFactory,
        EngineWorkerFactory,
        GpuFactory,
        HostFactory,
        RouterFactory,
        StorageProfileFactory,
    )

    host = HostFactory(name="fuzz-host")
    GpuFactory(host=host)
    from controlplane.operations.services import operation_create

    router = RouterFactory(url=fake_router.url)
    worker = EngineWorkerFactory(host=host, router=router, url="http://127.0.0.1:9/w1")
    fake_router.add(worker.url)
    StorageProfileFactory()
    revision = ConfigRevisionFactory()
    revision.profile.head_number = 1
    revision.profile.save()
    operation_create(kind="detach", workers=[worker], actor=None, dispatch=False)


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_api_matches_its_schema(case, personas, fleet):
    for role in ("operator", "viewer"):
        headers = {"Authorization": f"Bearer {personas[role][1]}"}
        case.call_and_validate(app=APP, headers=headers, checks=CHECKS)
