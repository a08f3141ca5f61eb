"""Pieces of the local fleet that start fast: Redis is started (and stopped) only when none answers."""

from __future__ import annotations

import shutil

import pytest
from localfleet import LocalFleet, bootstrap_port, redis_answers

from engine.ports import free_port


@pytest.mark.skipif(
    shutil.which("redis-server") is None, reason="needs Debian redis-server (scripts/sysdeps.sh)"
)
def test_starts_redis_when_none_answers_and_stops_it(tmp_path):
    nobody = f"redis://127.0.0.1:{free_port()}/0"
    fleet = LocalFleet(log_dir=tmp_path)
    fleet.env = {"REDIS_URL": nobody, "PATH": "/usr/bin:/bin"}
    try:
        fleet._redis()
        url = fleet.env["REDIS_URL"]
        assert url != nobody and redis_answers(url)
        assert [name for name, _, _ in fleet.procs] == ["redis"]
    finally:
        fleet.stop()
    assert not redis_answers(url)


def test_uses_the_redis_that_answers(tmp_path):
    fleet = LocalFleet(log_dir=tmp_path)
    fleet.env = {"REDIS_URL": "redis://127.0.0.1:6379/0"}
    if not redis_answers(fleet.env["REDIS_URL"]):
        pytest.skip("no Redis on 127.0.0.1:6379 (the suite's shared Redis)")
    fleet._redis()
    assert fleet.procs == [] and fleet.env["REDIS_URL"] == "redis://127.0.0.1:6379/0"


def test_pd_demo_is_2p1d_with_a_bootstrap_port_each_and_role_switch(tmp_path):
    """`make demo PD=1` can be rebalanced: 2P1D (a target other than the current split exists), every
    worker with --enable-pd-role-switch and its own bootstrap port (the decode's for when it becomes one)."""
    from engine.agent.spec import load_spec
    from engine.fleet.router import router_command

    fleet = LocalFleet(log_dir=tmp_path, pd=True)
    assert fleet.spec.name == "fleet.pd.toml" and fleet.num_workers == 3
    env = {"KVFLEET_WORKER_ADMIN_KEY": "k" * 32, "MOONCAKE_MASTER": "m:1"}
    env["MOONCAKE_TE_META_DATA_SERVER"] = "http://m:2/metadata"
    env |= {f"DEMO_WORKER{i}_PORT": str(8100 + i) for i in range(3)}
    env |= {f"DEMO_BOOTSTRAP_PORT{i}": str(8190 + i) for i in range(3)}
    workers = load_spec(fleet.spec, env).workers
    assert [w.role for w in workers] == ["prefill", "prefill", "decode"]
    assert all("--enable-pd-role-switch" in w.flags for w in workers)
    fleet.worker_urls = [w.url for w in workers]
    fleet.worker_roles = [w.role for w in workers]
    fleet.bootstrap_ports = [bootstrap_port(w.flags) for w in workers]
    assert fleet.bootstrap_ports == [8190, 8191, 8192]
    joined = " ".join(router_command(fleet._pd_router_workers(), 3, 4))
    assert (
        "--pd-disaggregation --prefill http://127.0.0.1:8100 8190 --prefill http://127.0.0.1:8101 8191 "
        "--decode http://127.0.0.1:8102 --prefill-policy cache_aware --decode-policy round_robin"
    ) in joined


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pd_demo_router_accepts_a_1p2d_rebalance(tmp_path):
    """The running PD demo (2P1D, traffic through its router) takes a 1P2D target: POST /rebalances/
    answers 201 with a plan of one step (a prefill -> decode); per_step approval, so nothing switches, and
    the abort leaves the fleet as it was (the rollout itself: test_rebalance_real_engines.py)."""
    from localfleet import PY

    with LocalFleet(log_dir=tmp_path / "logs", pd=True) as fleet:
        assert fleet.worker_roles == ["prefill", "prefill", "decode"]
        traffic = ["--url", fleet.router_url, "--concurrency", "1", "--conversations", "2"]
        fleet.spawn("traffic", [PY, "-m", "engine.bench.traffic", *traffic, "--max-new-tokens", "4"])
        router = fleet.api("GET", "/api/v1/inventory/routers/").json()["results"][0]
        body = {"router": router["id"], "target": {"prefill": 1, "decode": 2}, "approval": "per_step"}
        created = fleet.api("POST", "/api/v1/rebalances/", json=body)
        assert created.status_code in (201, 202), created.text
        plan = created.json()
        assert [(s["from_role"], s["to_role"]) for s in plan["steps"]] == [("prefill", "decode")], plan
        aborted = fleet.api("POST", f"/api/v1/rebalances/{plan['id']}/abort/", json={"reason": "test"})
        assert aborted.status_code == 202, aborted.text
