"""Pieces of the local fleet that start fast: Redis is started (and stopped) only when none answers."""

from __future__ import annotations

import shutil

import pytest
from localfleet import LocalFleet, free_port, redis_answers


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


def test_pd_mode_router_pairs_the_prefill_with_its_bootstrap_port(tmp_path):
    from deploy.router import router_command

    fleet = LocalFleet(log_dir=tmp_path, pd=True)
    fleet.worker_urls, fleet.worker_roles = (
        ["http://127.0.0.1:1", "http://127.0.0.1:2"],
        ["prefill", "decode"],
    )
    fleet.env = {"DEMO_BOOTSTRAP_PORT": "8190"}
    argv = router_command(fleet._pd_router_workers(), 3, 4)
    joined = " ".join(argv)
    assert "--pd-disaggregation --prefill http://127.0.0.1:1 8190 --decode http://127.0.0.1:2" in joined
    assert "--worker-urls" not in argv
