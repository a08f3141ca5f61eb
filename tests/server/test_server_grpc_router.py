"""``--grpc-mode`` behind a real smg 1.13.0 (``grpc://`` worker URL, ``--policy cache_aware``): smg's
``/generate`` and ``/v1/completions`` answer with the greedy output the same worker gives over HTTP, smg
subscribes to the worker's ``SubscribeKvEvents`` and applies the stored blocks (its own
``smg_kv_event_*`` metrics), and its load poll reads the worker's figures. smg 1.13.0 does not carry
``cache_salt`` over gRPC (its SGLang proto has no field for it): the test pins that, as the docs say so.
Straight to the worker: a bad sampling value is INVALID_ARGUMENT naming it; ``GetTokenizer`` and
``FlushCache`` answer; its HTTP sidecar (``--smg-http-sidecar-port``) serves health and metrics, and its
``/server_info`` says ``grpc_mode``, so the isolation check calls it not isolatable without probing it. The
control plane finds the worker in smg by the ``grpc://`` URL its inventory row gives (drain, undrain)."""

from __future__ import annotations

import hashlib
import io
import re
import time
import zipfile

import grpc
import httpx
import pytest
from smg_grpc_proto.generated import common_pb2, sglang_scheduler_pb2, sglang_scheduler_pb2_grpc

from controlplane.inventory.models import EngineWorker
from controlplane.workerclient import RouterClient
from engine.agent.isolation import check_isolation
from engine.bench.launcher import ServerProcess
from engine.fleet.router import RouterProcess, worker_args
from engine.ports import free_port

pytestmark = pytest.mark.slow
SP = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
PROMPTS = [[(5 * i + k) % 300 + 3 for i in range(21)] for k in range(3)]
TEXT = "The quick brown fox jumps over the lazy dog, again and again"


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{name}\{{(.*)\}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            total += float(m.group(2))
    return total


def _poll_metric(router: RouterProcess, name: str, at_least: float, **labels: str) -> float:
    deadline = time.monotonic() + 30
    while True:
        value = _metric(httpx.get(router.metrics_url, timeout=5).text, name, **labels)
        if value >= at_least or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


def _completion(url: str, model: str, salt: str | None = None) -> dict:
    body = {"model": model, "prompt": TEXT, "max_tokens": 6, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_smg_serves_a_grpc_worker_and_subscribes_to_its_kv_events(tiny_model_dir):
    model = str(tiny_model_dir)
    flags = ["--model-path", model, "--page-size", "4"]
    with ServerProcess(flags) as http_worker:
        url = f"{http_worker.url}/generate"
        expected = [
            httpx.post(url, json={"input_ids": p, "sampling_params": SP}, timeout=60).json()["output_ids"]
            for p in PROMPTS
        ]
        expected_text = _completion(http_worker.url, model)["choices"][0]["text"]
    extra = ("--model-path", model, "--block-size", "4")
    sidecar = free_port()
    grpc_flags = [*flags, "--grpc-mode", "--smg-http-sidecar-port", str(sidecar), "--enable-metrics"]
    with (
        ServerProcess(grpc_flags) as worker,
        RouterProcess(worker_args([worker.url]), extra=extra, min_workers=1) as router,
    ):
        assert worker.url.startswith("grpc://")
        assert _poll_metric(router, "smg_kv_event_subscriptions_total", 1) >= 1
        for prompt, want in zip(PROMPTS, expected, strict=True):
            body = {"model": model, "input_ids": prompt, "sampling_params": SP}
            resp = httpx.post(f"{router.url}/generate", json=body, timeout=60)
            assert resp.status_code == 200, resp.text
            (answer,) = resp.json()
            assert answer["output_ids"] == want
        assert _completion(router.url, model)["choices"][0]["text"] == expected_text
        # every prompt's 5 whole pages (21 prompt + 6 output tokens, page 4: 6 pages) reached smg's index
        stored = _poll_metric(router, "smg_kv_event_blocks_total", 3 * 6, op="stored")
        assert stored >= 3 * 6
        metrics = httpx.get(router.metrics_url, timeout=5).text
        assert _metric(metrics, "smg_kv_event_parentless_stores_total") == 0
        (info,) = httpx.get(f"{router.url}/workers", timeout=5).json()["workers"]
        assert info["connection_mode"] == "grpc" and info["labels"]["max_running_requests"] == "256"
        # smg 1.13.0 drops cache_salt on its way to a gRPC worker: another salt hits the first one's pages
        _completion(router.url, model, salt="grpc-a")
        other = _completion(router.url, model, salt="grpc-b")
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        _direct_rpcs(worker.url.removeprefix("grpc://"))
        # the HTTP sidecar serves the worker's HTTP routes beside gRPC: health, metrics of the same engine
        side = f"http://127.0.0.1:{sidecar}"
        assert httpx.get(f"{side}/health", timeout=10).status_code == 200
        assert "sglang:prompt_tokens_total" in httpx.get(f"{side}/metrics", timeout=10).text
        # and its /server_info says grpc_mode, so the isolation check (agent CLI and control plane) sends
        # no probe and never calls the worker isolated: salts reach the sidecar, but tenants come over gRPC
        report = check_isolation(side, words=48)
        assert report.not_isolatable and not report.ok and report.probes == []
        # the control plane registers the sidecar's URL and the command line its agent reports; it finds the
        # worker in smg by the grpc:// URL those give, so drain takes it out and undrain puts it back
        line = [f"--port={worker.port}", "--grpc-mode", f"--smg-http-sidecar-port={sidecar}"]
        row = EngineWorker(url=side, command_line=line)
        assert row.router_url == worker.url
        client = RouterClient(router.url)
        assert client.remove_worker(row.router_url) is True
        deadline = time.monotonic() + 30  # smg marks it draining in a job of its own
        while client.find_worker(row.router_url) is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert client.find_worker(row.router_url) is None
        body = {"model": model, "input_ids": PROMPTS[0], "sampling_params": SP}
        assert httpx.post(f"{router.url}/generate", json=body, timeout=60).status_code != 200
        client.add_worker(row.router_url)  # once smg has dropped the draining entry
        assert client.find_worker(row.router_url)["connection_mode"] == "grpc"
        (answer,) = httpx.post(f"{router.url}/generate", json=body, timeout=60).json()
        assert answer["output_ids"] == expected[0]


def _direct_rpcs(address: str) -> None:
    """The worker's own answers: a bad sampling value is INVALID_ARGUMENT naming it, the tokenizer comes
    as a zip of the model folder's tokenizer files with its SHA-256, a new subscription starts with a
    snapshot of the pages held, an idle flush succeeds."""
    with grpc.insecure_channel(address) as channel:
        stub = sglang_scheduler_pb2_grpc.SglangSchedulerStub(channel)
        bad = sglang_scheduler_pb2.GenerateRequest(
            request_id="bad",
            tokenized=sglang_scheduler_pb2.TokenizedInput(input_ids=[5, 6, 7]),
            sampling_params=sglang_scheduler_pb2.SamplingParams(temperature=-1.0, max_new_tokens=2),
        )
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(bad, timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in err.value.details()
        chunks = list(stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=30))
        data = b"".join(c.data for c in chunks)
        assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
        names = zipfile.ZipFile(io.BytesIO(data)).namelist()
        assert "tokenizer.json" in names and "config.json" in names and "model.safetensors" not in names
        # a subscriber that joins now first gets a snapshot of the pages held (the e2e prompts' blocks)
        stream = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=30)
        first = next(stream)
        stream.cancel()
        assert first.HasField("snapshot") and first.snapshot.count == 1 and first.snapshot.blocks >= 3 * 6
        assert first.events[0].WhichOneof("data") == "cleared" and first.sequence_number > 0
        flushed = stub.FlushCache(common_pb2.FlushCacheRequest(), timeout=30)
        assert flushed.success, flushed.message
