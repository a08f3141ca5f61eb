"""Each router record knows which router answers at its URL: adding one through the API probes it (real smg
1.13.0 and real sglang-router 0.3.2, the latter from its own venv), the record and the console page show its
kind and version and, per route, whether a request's ``cache_salt`` reaches the workers; a router that drops
it fails a worker's isolation check with a problem naming the router and the supported way (a real engine
worker behind it)."""

import pytest
from cp_factories import EngineWorkerFactory, RouterFactory

from controlplane.audit.models import AuditEvent
from controlplane.inventory.models import Router
from controlplane.inventory.services import router_identify
from engine.bench.launcher import ServerProcess
from engine.fleet.router import RouterProcess
from engine.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.django_db]
ROUTES = ["/generate", "/v1/completions", "/v1/chat/completions"]


@pytest.fixture(scope="module")
def smg():
    with RouterProcess([], ready=False) as router:
        yield router


@pytest.fixture(scope="module")
def sglang_router(sglang_router_env):
    with RouterProcess([], ready=False, kind="sglang-router") as router:
        yield router


def _add(api_as, name: str, url: str) -> dict:
    resp = api_as("admin").post("/api/v1/inventory/routers/", {"name": name, "url": url}, format="json")
    assert resp.status_code == 201, resp.content
    return resp.json()


def test_adding_smg_records_its_kind_version_and_that_salts_reach_the_workers(api_as, smg):
    body = _add(api_as, "r-smg", smg.url)
    assert (body["kind"], body["version"]) == ("smg", "1.13.0") and body["identified_at"]
    assert body["cache_salt"] == {
        "identified": True,
        "router": "smg 1.13.0",
        "routes": dict.fromkeys(ROUTES, True),
        "warning": "",
        "grpc_workers": [],
        "grpc_warning": "",
    }
    event = AuditEvent.objects.get(action="router_identified")
    assert event.after == {"kind": "smg", "version": "1.13.0"}


def test_adding_sglang_router_says_which_routes_drop_the_salt(api_as, sglang_router):
    body = _add(api_as, "r-032", sglang_router.url)
    assert (body["kind"], body["version"]) == ("sglang-router", "")
    salt = body["cache_salt"]
    assert salt["router"] == "sglang-router (version not reported)"
    assert salt["routes"] == {"/generate": False, "/v1/completions": True, "/v1/chat/completions": False}
    assert "drops cache_salt on /generate, /v1/chat/completions" in salt["warning"]
    assert "--tenant-keys-file" in salt["warning"] and "Authorization" in salt["warning"]


def test_a_router_that_does_not_answer_is_not_identified_and_says_so(api_as):
    body = _add(api_as, "r-gone", f"http://127.0.0.1:{free_port()}")
    assert (body["kind"], body["version"], body["identified_at"]) == ("", "", None)
    assert not body["cache_salt"]["identified"]
    assert body["cache_salt"]["routes"] == dict.fromkeys(ROUTES)
    assert "has not been identified yet" in body["cache_salt"]["warning"]


def test_a_router_replaced_under_its_url_is_identified_again_and_audited(smg):
    router = RouterFactory(name="r-moved", url=smg.url, kind="sglang-router", version="")
    assert router_identify(router=router)
    router.refresh_from_db()
    assert (router.kind, router.version) == ("smg", "1.13.0")
    event = AuditEvent.objects.get(action="router_identified", object_id=str(router.pk))
    assert event.before == {"kind": "sglang-router", "version": ""}


def test_the_router_page_shows_the_kind_and_each_routes_salt(client, personas, sglang_router):
    router = RouterFactory(name="r-page", url=sglang_router.url)
    client.force_login(personas["viewer"][0])
    html = client.get(f"/routers/{router.pk}/").content.decode()
    assert Router.objects.get(pk=router.pk).kind == "sglang-router"  # the page probed it
    assert "sglang-router (version not reported)" in html
    assert html.count("reaches the worker") == 1 and html.count(">dropped<") == 2
    assert 'data-testid="cache-salt-warning"' in html and "--tenant-keys-file" in html


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir):
    with ServerProcess(["--model-path", str(tiny_model_dir), "--page-size", "16"]) as worker:
        yield worker.url


def test_a_worker_behind_a_router_that_drops_the_salt_fails_its_isolation_check(
    api_as, personas, engine_url, sglang_router, smg
):
    leaky = RouterFactory(name="r-leaky", url=sglang_router.url)
    router_identify(router=leaky)
    worker = EngineWorkerFactory(name="w-leaky", url=engine_url, router=leaky)
    resp = api_as("operator").post(f"/api/v1/inventory/workers/{worker.pk}/check-isolation/", {"words": 48})
    assert resp.status_code == 200, resp.content
    body = resp.json()
    assert body["ok"] is False and body["verdict"] == "failed"
    assert body["probes"][1]["cached"] == {
        "device": 0,
        "host": 0,
        "storage": 0,
    }  # the worker alone keeps them
    (problem,) = body["problems"]
    assert problem.startswith("through router r-leaky: sglang-router (version not reported) drops cache_salt")
    assert body["router"]["routes"]["/generate"] is False

    sound = RouterFactory(name="r-sound", url=smg.url)
    router_identify(router=sound)
    worker.router = sound
    worker.save(update_fields=["router"])
    resp = api_as("operator").post(f"/api/v1/inventory/workers/{worker.pk}/check-isolation/", {"words": 48})
    body = resp.json()
    assert body["ok"] is True and body["problems"] == [] and body["router"]["router"] == "smg 1.13.0"


def test_server_info_through_smg_is_a_json_answer_never_an_empty_body(engine_url):
    """Issue 40: the demo's router answered ``/server_info`` with an empty body. smg 1.13.0 forwards
    ``/get_server_info`` (SGLang's alias) to a worker and answers ``/server_info`` with a JSON 404 naming
    the URL, so a client learns which path to use (docs/upstream.md)."""
    import httpx

    from engine.fleet.router import worker_args

    with RouterProcess(worker_args([engine_url]), min_workers=1) as router:
        missing = httpx.get(f"{router.url}/server_info", timeout=30)
        assert missing.status_code == 404
        assert missing.json()["error"]["message"] == "Invalid URL (GET /server_info)"
        info = httpx.get(f"{router.url}/get_server_info", timeout=30)
        own = httpx.get(f"{engine_url}/server_info", timeout=30).json()
        assert info.status_code == 200
        assert info.json()["max_total_num_tokens"] == own["max_total_num_tokens"] > 0
