"""Per-tenant cached tokens on a worker's page: the engine's own exporter as a real Prometheus holds its
scrapes, read with PromQL over the hit rate's window (the counters' increase between them), the tenants with
the most cached tokens first, the rest (and the worker's own ``other``) summed as ``other``."""

import time
from types import SimpleNamespace

from controlplane.telemetry import worker_view
from controlplane.telemetry.metrics import top_tenants
from engine.server.metrics import EngineMetrics
from engine.server.tenants import salt_label


def _admit(metrics: EngineMetrics, salt, prompt: int, device: int, host: int = 0, storage: int = 0):
    cached = {"device": device, "host": host, "storage": storage}
    req = SimpleNamespace(input_ids=[1] * prompt, arrival=time.perf_counter(), cache_salt=salt, cached=cached,
                          misses=None)  # fmt: skip
    metrics.on_admit(req)


def test_a_scrape_keeps_the_top_tenants_by_cached_tokens_and_sums_the_rest_as_other(tsdb):
    state = {"num_running_reqs": 0, "num_waiting_reqs": 0, "max_total_num_tokens": 1000}
    metrics = EngineMetrics("m", lambda: state)
    salts = [f"salt-{i}" for i in range(20)] + [None]  # 16 labels of their own, then the worker's "other"
    for salt in salts:  # each tenant's series from 0 in the first scrape: the table covers the window
        _admit(metrics, salt, prompt=0, device=0)
    first = metrics.render().decode()
    for i in range(20):
        _admit(metrics, f"salt-{i}", prompt=100, device=i, host=1)
    _admit(metrics, None, prompt=50, device=0)
    now = time.time()
    tsdb.serve([("w0", now - 20, first), ("w0", now - 5, metrics.render().decode())])
    rows = worker_view.points(["w0"])["w0"]["latest"]["tenants"]
    assert len(rows) == 9 and rows[-1]["tenant"] == "other"
    assert [r["tenant"] for r in rows[:2]] == [salt_label("salt-15"), salt_label("salt-14")]
    assert rows[0] == {
        "tenant": salt_label("salt-15"),
        "prompt": 100.0,
        "device": 15.0,
        "host": 1.0,
        "storage": 0,
    }
    everything = {"prompt": 20 * 100 + 50, "device": sum(range(20)), "host": 20, "storage": 0}
    assert {k: sum(r[k] for r in rows) for k in everything} == everything  # nothing lost in "other"


def test_top_tenants_without_leftovers_has_no_other_row():
    rows = top_tenants({"a": {"prompt": 10, "device": 1, "host": 0, "storage": 0}}, n=8)
    assert rows == [{"tenant": "a", "prompt": 10, "device": 1, "host": 0, "storage": 0}]
