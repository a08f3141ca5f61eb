"""restart_with_flags launch validation through the REST API: flags are checked on every worker against its
own engine's flags (as its agent reports them: KVFleet's parser here, upstream SGLang's own for an upstream
worker), a bad one is a 400 naming the field and the closest real flag, and nothing is created."""

import pytest
from cp_factories import EngineWorkerFactory, HostFactory

from controlplane.inventory.services.flags import flags_edit
from controlplane.operations.models import Operation
from engine.agent.engines import upstream_flags
from engine.agent.spec import WorkerSpec, flag_table
from tests.support.sglang_upstream import sglang_python

pytestmark = pytest.mark.django_db

KV_LINE = ["--model-path=smollm2", "--port=30001", "--page-size=16", "--enable-hierarchical-cache"]


def kvfleet_worker(**kwargs):
    spec = WorkerSpec(name="x", model="smollm2", role="mixed", host="127.0.0.1", port=1, url="", flags=[])
    return EngineWorkerFactory(
        host=HostFactory(), command_line=KV_LINE, launch_flags=flag_table(spec), **kwargs
    )


def launch(client, workers, flags):
    body = {"kind": "restart_with_flags", "workers": [w.pk for w in workers], "flags": flags, "reason": "t"}
    return client.post("/api/v1/operations/", body, format="json")


def test_a_misspelt_flag_is_refused_naming_the_field_and_the_closest_flag(api_as):
    worker = kvfleet_worker(name="kv-a")
    got = launch(api_as("operator"), [worker], {"set": {"pge_size": 32}})
    assert got.status_code == 400, got.content
    error = got.json()["error"]
    assert error["code"] == "bad_flags"
    (why,) = error["detail"]["flags"]["set"]["pge_size"]
    assert "kv-a: not a launch flag of KVFleet's engine" in why and "did you mean 'page_size'?" in why
    assert "set.pge_size" in error["message"]
    upstream_only = launch(api_as("operator"), [worker], {"set": {"tokenizer_path": "/t"}})
    (why,) = upstream_only.json()["error"]["detail"]["flags"]["set"]["tokenizer_path"]
    assert why == "kv-a: --tokenizer-path is an SGLang flag not supported by KVFleet"  # as the CLI says
    assert not Operation.objects.exists()


@pytest.mark.parametrize(
    ("flags", "part", "name", "says"),
    [
        ({"set": {"admin_api_key": "k"}}, "set", "admin_api_key", "is a secret"),
        ({"set": {"port": 31000}}, "set", "port", "cannot change by a restart"),
        ({"set": {"disaggregation_mode": "prefill"}}, "set", "disaggregation_mode", "rebalance"),
        ({"set": {"enable_hierarchical_cache": 1}}, "set", "enable_hierarchical_cache", "is a switch"),
        ({"set": {"page_size": True}}, "set", "page_size", "takes a value"),
        ({"remove": ["max_running_requests"]}, "remove", "max_running_requests", "not on its command line"),
    ],
)
def test_flags_no_restart_may_change_are_refused(api_as, flags, part, name, says):
    got = launch(api_as("operator"), [kvfleet_worker()], flags)
    assert got.status_code == 400, got.content
    assert says in got.json()["error"]["detail"]["flags"][part][name][0]
    assert not Operation.objects.exists()


@pytest.mark.parametrize(
    "flags", [None, {}, {"set": {}}, {"set": [1]}, {"add": {}}, {"set": {"a": 1}, "remove": ["a"]}]
)
def test_a_malformed_change_is_refused(api_as, flags):
    got = launch(api_as("operator"), [kvfleet_worker()], flags)
    assert got.status_code == 400 and "flags" in got.json()["error"]["detail"], got.content


def test_a_worker_no_agent_runs_cannot_be_restarted(api_as):
    by_hand = EngineWorkerFactory(name="by-hand")
    got = launch(api_as("operator"), [kvfleet_worker(), by_hand], {"set": {"page_size": 32}})
    assert got.status_code == 400
    error = got.json()["error"]
    assert error["code"] == "not_supported" and error["detail"]["workers"][0].startswith(
        "by-hand: no agent runs"
    )


def test_a_valid_change_launches_with_sglang_names(api_as):
    worker = kvfleet_worker()
    got = launch(
        api_as("operator"), [worker], {"set": {"--page-size": 32}, "remove": ["enable-hierarchical-cache"]}
    )
    assert got.status_code == 201, got.content
    assert got.json()["flags"] == {"set": {"page_size": 32}, "remove": ["enable_hierarchical_cache"]}
    assert got.json()["kind"] == "restart_with_flags"


def test_the_edit_keeps_each_flag_in_its_place_and_is_idempotent():
    table = kvfleet_worker().launch_flags
    change = {"set": {"page_size": 32, "max_running_requests": 4}, "remove": ["enable_hierarchical_cache"]}
    once = flags_edit(KV_LINE, table, change)
    assert once == ["--model-path=smollm2", "--port=30001", "--page-size=32", "--max-running-requests=4"]
    assert flags_edit(once, table, change) == once
    assert flags_edit(KV_LINE, table, {"set": {"enable_hierarchical_cache": False}}) == KV_LINE[:3]


def test_upstream_flags_are_checked_against_upstream_sglangs_own_parser(api_as):
    """An upstream worker's flags are its SGLang's (that interpreter's parser): KVFleet's own flag is named as
    such, a misspelt upstream flag gets the closest upstream one, an upstream-only flag is taken."""
    up = upstream_flags(sglang_python())
    table = {k: [opt, takes] for k, (opt, takes, _) in up.flags.items()}
    kv = kvfleet_worker()
    upstream = EngineWorkerFactory(
        name="up-a", host=kv.host, engine="sglang", engine_version=up.version,
        command_line=["--model-path=/m", "--port=30002", "--page-size=16"], launch_flags=table,
    )  # fmt: skip
    client = api_as("operator")
    ours = launch(client, [upstream], {"set": {"tenant_keys_file": "/k"}})
    assert ours.status_code == 400
    why = ours.json()["error"]["detail"]["flags"]["set"]["tenant_keys_file"][0]
    assert why == f"up-a: tenant_keys_file is KVFleet's own flag: SGLang {up.version} has none"
    typo = launch(client, [upstream], {"set": {"max_runing_requests": 4}})
    assert (
        "did you mean 'max_running_requests'?"
        in typo.json()["error"]["detail"]["flags"]["set"]["max_runing_requests"][0]
    )
    assert launch(client, [upstream], {"set": {"max_running_requests": 4}}).status_code == 201
