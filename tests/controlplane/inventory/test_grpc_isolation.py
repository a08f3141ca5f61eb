"""Issue 40: a gRPC worker (``--grpc-mode``) gets no ``cache_salt`` and no tenant API key from its router (the
SGLang gRPC proto has no field for either), so it cannot keep tenants apart. The control plane knows it from
the command line its agent reports (``EngineWorker.command_line``) or, for a worker added by hand, from
``grpc_mode`` in its ``/server_info``: the router's ``cache_salt`` names its gRPC workers and the supported
way, and the isolation check (API and ``kvfleet-agent check-isolation``) answers ``not_isolatable`` with that
reason instead of probing. Fake workers (real HTTP servers) stand in for the engines; the real gRPC worker's
``/server_info`` is pinned in tests/server/test_server_grpc_router.py."""

import pytest
from cp_factories import EngineWorkerFactory, RouterFactory

from controlplane.audit.models import AuditEvent
from engine.agent.cli import main
from engine.fleet.identity import serves_grpc
from engine.ports import free_port

pytestmark = pytest.mark.django_db
GRPC_LINE = ["--model-path=/models/SmolLM2", "--page-size=16", "--grpc-mode", "--smg-http-sidecar-port=30002"]


@pytest.mark.parametrize(
    ("line", "grpc"),
    [
        (GRPC_LINE, True),
        (["--smg-grpc-mode"], True),  # the alias
        (["--grpc-mode=true"], True),
        (["--grpc-mode=false"], False),
        (["--page-size=16", "--enable-metrics"], False),
        ([], False),  # no agent reported a command line: not known to serve gRPC
    ],
)
def test_a_worker_serves_grpc_when_its_command_line_says_grpc_mode(line, grpc):
    assert serves_grpc(line) is grpc


def test_the_router_names_its_grpc_workers_and_the_supported_way(api_as):
    router = RouterFactory(name="r-mixed", kind="smg", version="1.13.0")
    EngineWorkerFactory(name="w-http", router=router, command_line=["--page-size=16"])
    EngineWorkerFactory(name="w-grpc-b", router=router, command_line=GRPC_LINE)
    EngineWorkerFactory(name="w-grpc-a", router=router, command_line=["--smg-grpc-mode"])
    EngineWorkerFactory(name="w-elsewhere", command_line=GRPC_LINE)  # behind no router: not this one's
    salt = api_as("viewer").get(f"/api/v1/inventory/routers/{router.pk}/").json()["cache_salt"]
    assert salt["warning"] == "" and all(salt["routes"].values())  # smg 1.13.0 carries it to HTTP workers
    assert salt["grpc_workers"] == ["w-grpc-a", "w-grpc-b"]
    assert salt["grpc_warning"].startswith(
        "gRPC workers w-grpc-a, w-grpc-b (--grpc-mode) get no cache_salt and no tenant API key from the "
        "router: the SGLang gRPC proto has no field for either"
    )
    assert "HTTP workers with tenant API keys (the workers' --tenant-keys-file)" in salt["grpc_warning"]

    plain = RouterFactory(name="r-http", kind="smg", version="1.13.0")
    EngineWorkerFactory(name="w-http-2", router=plain, command_line=["--page-size=16"])
    salt = api_as("viewer").get(f"/api/v1/inventory/routers/{plain.pk}/").json()["cache_salt"]
    assert (salt["grpc_workers"], salt["grpc_warning"]) == ([], "")


def test_checking_a_grpc_worker_is_not_isolatable_without_a_probe(api_as, personas):
    """Its agent said --grpc-mode: nothing listens at its URL, and the answer still comes (not a 502),
    because no request is sent; a router that carries salts to HTTP workers changes nothing."""
    router = RouterFactory(name="r-smg", kind="smg", version="1.13.0")
    worker = EngineWorkerFactory(
        name="w-grpc", url=f"http://127.0.0.1:{free_port()}", router=router, command_line=GRPC_LINE
    )
    resp = api_as("operator").post(f"/api/v1/inventory/workers/{worker.pk}/check-isolation/", {"words": 48})
    assert resp.status_code == 200, resp.content
    body = resp.json()
    assert (body["ok"], body["verdict"], body["probes"], body["prompt_tokens"]) == (
        False,
        "not_isolatable",
        [],
        0,
    )
    (problem,) = body["problems"]
    assert problem.startswith("gRPC worker w-grpc (--grpc-mode) gets no cache_salt and no tenant API key")
    assert body["router"]["grpc_workers"] == ["w-grpc"]
    event = AuditEvent.objects.get(action="check_isolation")
    assert (event.outcome, event.actor) == ("failure", personas["operator"][0])
    assert event.after["verdict"] == "not_isolatable" and "w-grpc (--grpc-mode)" in event.message


def test_a_worker_added_by_hand_is_found_grpc_by_its_server_info(api_as, fake_worker):
    """No command line (no agent runs it): the check reads its /server_info, sees grpc_mode and stops there;
    the same worker without grpc_mode is probed (the fake answers no /generate: a 502)."""
    fake = fake_worker()
    fake.grpc_mode = True
    worker = EngineWorkerFactory(name="w-by-hand", url=fake.url)
    url = f"/api/v1/inventory/workers/{worker.pk}/check-isolation/"
    body = api_as("operator").post(url, {"words": 48}).json()
    assert body["verdict"] == "not_isolatable"
    assert body["problems"][0].startswith("gRPC worker w-by-hand (--grpc-mode)")
    assert ("GET", "/server_info") in fake.calls and not [c for c in fake.calls if c[0] == "POST"]

    fake.grpc_mode = False
    assert api_as("operator").post(url, {"words": 48}).status_code == 502
    assert ("POST", "/generate") in fake.calls


def test_the_agent_cli_says_not_isolatable_and_exits_1(fake_worker, capsys):
    fake = fake_worker()
    fake.grpc_mode = True
    assert main(["check-isolation", fake.url, "--words", "48"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("isolation: NOT ISOLATABLE\n")
    assert f"gRPC worker {fake.url} (--grpc-mode) gets no cache_salt" in out
    assert "--tenant-keys-file" in out and not [c for c in fake.calls if c[0] == "POST"]
