"""The load poll over HTTP (``GET /v1/loads``, ``GET /loads``): upstream SGLang's body with the worker's own
figures, sections picked by ``include`` (an unknown one a 400 naming it), a PD worker's queues by upstream's
names; a request in flight shows as running; a real
smg 1.13.0 in front polls it (its ``/get_loads`` and ``smg_engine_*`` metrics carry the worker's figures) and
takes ``max_running_requests`` from ``/server_info`` as the worker's label (a decode worker's PD admission
window)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from engine.bench.launcher import ServerProcess
from engine.fleet.router import RouterProcess, worker_args

pytestmark = pytest.mark.slow
ALL = "core,disagg,queues,memory"


@pytest.fixture(scope="module")
def worker(tiny_model_dir):
    flags = ["--model-path", str(tiny_model_dir), "--page-size", "16", "--max-running-requests", "7",
             "--max-total-tokens", "2048"]  # fmt: skip
    with ServerProcess(flags) as server:
        yield server.url


def test_every_section_reports_the_workers_own_figures(worker):
    body = httpx.get(f"{worker}/v1/loads", params={"include": ALL}, timeout=10).json()
    info = httpx.get(f"{worker}/server_info", timeout=10).json()
    assert body["version"] == info["version"] and body["dp_rank_count"] == 1 and body["timestamp"]
    (rank,) = body["loads"]
    assert rank["dp_rank"] == 0 and rank["max_running_requests"] == info["max_running_requests"] == 7
    assert rank["max_total_num_tokens"] == info["max_total_num_tokens"] == rank["memory"]["token_capacity"]
    assert rank["token_usage"] == round(rank["num_used_tokens"] / rank["max_total_num_tokens"], 4)
    assert rank["queues"] == {"waiting": rank["num_waiting_reqs"]}
    assert rank["disaggregation"] == {"mode": "null"}
    model = httpx.get(f"{worker}/model_info", timeout=10).json()
    assert rank["memory"]["kv_cache_gb"] == round(model["kv_bytes_per_token"] * 2048 / 1e9, 6)
    for unmeasured in ("gen_throughput", "utilization", "cache_hit_rate"):
        assert unmeasured not in rank  # absent, not a made-up 0


def test_loads_is_the_same_body_and_every_section_is_the_default(worker):
    core = httpx.get(f"{worker}/loads", params={"include": "core"}, timeout=10).json()["loads"][0]
    assert "queues" not in core and "memory" not in core and "disaggregation" not in core
    assert core["max_running_requests"] == 7
    every = httpx.get(f"{worker}/loads", timeout=10).json()["loads"][0]  # upstream's default: all
    assert {"queues", "memory", "disaggregation"} <= set(every)


def test_an_unknown_section_is_a_400_naming_include(worker):
    resp = httpx.get(f"{worker}/v1/loads", params={"include": "core,gpu"}, timeout=10)
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == "include" and "'gpu'" in error["message"] and "memory" in error["message"]


def test_a_pd_workers_queues_carry_upstreams_names(tiny_model_dir):
    flags = ["--model-path", str(tiny_model_dir), "--page-size", "16", "--disaggregation-mode", "decode",
             "--disaggregation-transfer-backend", "fake"]  # fmt: skip
    with ServerProcess(flags) as decode:
        rank = httpx.get(f"{decode.url}/v1/loads", params={"include": "disagg"}, timeout=10).json()["loads"][
            0
        ]
    assert rank["disaggregation"] == {"mode": "decode", "decode_prealloc_queue_reqs": 0,
                                      "decode_transfer_queue_reqs": 0}  # fmt: skip


def test_a_request_in_flight_shows_as_running(worker):
    body = {"text": "count to a thousand:", "sampling_params": {"max_new_tokens": 400, "temperature": 0,
                                                                 "ignore_eos": True}}  # fmt: skip
    answer: list = []  # the response, or the exception that stopped the request
    done = threading.Event()

    def send():
        try:
            answer.append(httpx.post(f"{worker}/generate", json=body, timeout=300))
        except Exception as exc:  # shown by the assertion below
            answer.append(exc)
        done.set()

    threading.Thread(target=send, daemon=True).start()
    seen, polls = 0, []
    deadline = time.monotonic() + 120
    while not done.is_set() and time.monotonic() < deadline and not seen:
        rank = httpx.get(f"{worker}/v1/loads", timeout=10).json()["loads"][0]
        seen = rank["num_running_reqs"]  # decoding: it holds its KV
        used = rank["num_used_tokens"]
        polls.append((seen, rank["num_waiting_reqs"], used))
        time.sleep(0.05)
    assert seen == 1 and used > 0, (answer, polls[-5:], len(polls))
    assert done.wait(300)
    assert answer[0].status_code == 200, answer


def test_smg_polls_the_loads_and_labels_the_running_window(worker):
    with RouterProcess(
        worker_args([worker]), min_workers=1, extra=("--load-monitor-interval", "1")
    ) as router:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            loads = httpx.get(f"{router.url}/get_loads", timeout=5).json()["loads"]
            if loads:
                break
            time.sleep(0.2)
        (rank,) = loads
        assert rank["worker"] == worker and rank["max_total_num_tokens"] == 2048
        assert rank["max_running_requests"] == 7
        (entry,) = httpx.get(f"{router.url}/workers", timeout=5).json()["workers"]
        assert entry["labels"]["max_running_requests"] == "7"
        metrics = httpx.get(router.metrics_url, timeout=5).text
        assert f'smg_engine_running_requests{{worker="{worker}"' in metrics
