"""The load script's small variant in the suite: simulated agents (register, heartbeats, every worker's
metrics at the agent's default intervals), REST clients and a websocket against a real daphne, Celery,
Redis and PostgreSQL, each process's connection pool smaller than the server's limit: no request fails and
the database never holds more connections than the pools allow. Skipped when no PostgreSQL answers."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
TEST_REDIS_URL = os.environ.get("CONTROLPLANE_TEST_REDIS_URL", "redis://127.0.0.1:6379/13")
PG_SERVER = os.environ.get("CONTROLPLANE_TEST_POSTGRES_SERVER", "postgres://postgres@127.0.0.1:5432/postgres")
POOL = 3


def _max_connections() -> int | None:
    import psycopg

    try:
        with psycopg.connect(PG_SERVER, connect_timeout=3, autocommit=True) as conn:
            return int(conn.execute("SHOW max_connections").fetchone()[0])
    except psycopg.Error:
        return None


@pytest.mark.slow
def test_a_small_fleet_under_load_gets_no_errors_within_the_pool_bound(tmp_path):
    limit = _max_connections()
    if limit is None:
        pytest.skip(f"no PostgreSQL at {PG_SERVER}")
    out = tmp_path / "load.json"
    argv = [sys.executable, "-m", "controlplane.bench.agents", "--agents", "4", "--duration", "20",
            "--rest-clients", "4", "--processes", "1", "--pool-max-size", str(POOL),
            "--postgres-server", PG_SERVER, "--redis-url", TEST_REDIS_URL, "--json", str(out)]  # fmt: skip
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=400)
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    (result,) = json.loads(out.read_text())
    assert result["errors"] == 0, result["error_samples"]
    assert done.returncode == 0
    # every agent heartbeat at 5 s intervals for 20 s (agents send no metrics: the TSDB scrapes workers); the
    # websocket subscribed to the fleet and every worker group
    assert result["requests"]["heartbeat"] >= 4 * 2 and result["ws_subscribe_s"] is not None
    # one daphne and one Celery worker, each pooled: never more connections than the two pools
    assert 0 < result["peak_db_connections"] <= 2 * POOL < limit


def test_process_counts_take_a_websocket_only_daphne():
    from controlplane.bench.agents import _parse_counts

    assert _parse_counts("1,2, 1+ws") == [(1, False), (2, False), (1, True)]
    with pytest.raises(ValueError, match=re.escape("'1+http' is not N or N+ws")):
        _parse_counts("1+http")
