"""EPD end to end: two encoder workers (``--encoder-only``), a language-only prefill worker fetching image
embeddings from them (``zmq_to_scheduler``), a decode worker and the real router (smg) in PD mode (KV over
Mooncake's TransferEngine, TCP), against an aggregated worker of the same tiny random LLaVA.

One module-scoped fleet; the encoder-failure test kills an encoder, so it runs last.
"""

from __future__ import annotations

import base64
import sys
import time
from pathlib import Path

import httpx
import pytest

from engine.bench.launcher import ServerProcess
from engine.fleet.mooncake_master import MooncakeMaster
from engine.fleet.router import RouterProcess
from engine.ports import free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from vlm_testlib import IMAGE_TOKEN, png, save_tiny_llava  # noqa: E402

pytestmark = pytest.mark.slow

START_S = 600.0
SP = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
FAIL_BOUND_S = 30.0  # one encoder down: the request is served by another within this


def _url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def epd_fleet(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llava-epd")
    save_tiny_llava(folder, seed=11)
    common = ["--model-path", str(folder), "--page-size", "4", "--random-seed", "0"]
    master = MooncakeMaster().start()  # the encoders' shared embedding cache (--enable-mm-global-cache)
    mooncake = {
        "MOONCAKE_MASTER": master.master_address,
        "MOONCAKE_TE_META_DATA_SERVER": master.metadata_url,
        "MOONCAKE_PROTOCOL": "tcp",
        "MOONCAKE_GLOBAL_SEGMENT_SIZE": "32mb",
        "MOONCAKE_LOCAL_BUFFER_SIZE": "8mb",
    }
    enc_flags = [*common, "--encoder-only", "--enable-mm-global-cache"]
    enc = [ServerProcess(enc_flags, timeout=START_S, env=mooncake) for _ in range(2)]
    agg = ServerProcess(common, timeout=START_S)
    procs = [*enc, agg]
    try:
        for proc in procs:
            proc.__enter__()
        bp = free_port()
        p_flags = [
            "--disaggregation-mode",
            "prefill",
            "--disaggregation-bootstrap-port",
            str(bp),
            "--language-only",
        ]
        p = ServerProcess([*common, *p_flags, "--encoder-urls", *(e.url for e in enc)], timeout=START_S)
        procs.append(p)
        p.__enter__()
        d = ServerProcess([*common, "--disaggregation-mode", "decode"], timeout=START_S)
        procs.append(d)
        d.__enter__()
        workers = ["--pd-disaggregation", "--prefill", p.url, str(bp), "--decode", d.url]
        with RouterProcess(workers) as router:
            yield {"enc": enc, "agg": agg, "p": p, "d": d, "router": router.url}
    finally:
        for proc in procs:
            proc.__exit__(None, None, None)
        master.stop()


def _gen(url: str, text: str, images: list[bytes]) -> httpx.Response:
    body = {"text": text, "sampling_params": SP}
    if images:
        body["image_data"] = [_url(b) for b in images]
    return httpx.post(f"{url}/generate", json=body, timeout=120)


@pytest.mark.parametrize("n_images", [0, 1, 2])
def test_epd_through_router_equals_aggregated(epd_fleet, n_images):
    images = [png(300 + n_images * 10 + i) for i in range(n_images)]
    text = "the quick " + IMAGE_TOKEN * n_images + " brown fox"
    want = _gen(epd_fleet["agg"].url, text, images)
    got = _gen(epd_fleet["router"], text, images)
    assert want.status_code == 200 and got.status_code == 200, got.text
    assert got.json()["output_ids"] == want.json()["output_ids"]
    assert got.json()["meta_info"]["prompt_tokens"] == want.json()["meta_info"]["prompt_tokens"]


def test_openai_chat_with_an_image_through_router_equals_aggregated(epd_fleet):
    content = [{"type": "text", "text": "look: "}, {"type": "image_url", "image_url": {"url": _url(png(77))}}]
    model = httpx.get(f"{epd_fleet['router']}/v1/models", timeout=10).json()["data"][0][
        "id"
    ]  # smg routes by it
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 6,
        "temperature": 0,
    }
    want = httpx.post(f"{epd_fleet['agg'].url}/v1/chat/completions", json=body, timeout=120)
    got = httpx.post(f"{epd_fleet['router']}/v1/chat/completions", json=body, timeout=120)
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["message"]["content"] == want.json()["choices"][0]["message"]["content"]


def test_requests_spread_over_the_encoders(epd_fleet):
    before = [httpx.get(f"{e.url}/server_info").json()["images_encoded"] for e in epd_fleet["enc"]]
    for i in range(4):
        assert _gen(epd_fleet["router"], IMAGE_TOKEN + " fox", [png(500 + i)]).status_code == 200
    after = [httpx.get(f"{e.url}/server_info").json()["images_encoded"] for e in epd_fleet["enc"]]
    assert all(a - b >= 1 for a, b in zip(after, before, strict=True)), (before, after)
    assert sum(after) - sum(before) == 4
    for enc, count in zip(epd_fleet["enc"], after, strict=True):
        lines = httpx.get(f"{enc.url}/metrics").text.splitlines()
        (images,) = [line for line in lines if line.startswith("sglang:encoder_images_total{")]
        assert float(images.split()[-1]) == count


def _encoder_counts(fleet) -> list[dict]:
    return [httpx.get(f"{e.url}/server_info").json() for e in fleet["enc"]]


def test_an_image_one_encoder_ran_is_a_global_cache_hit_on_the_other(epd_fleet):
    """Encoders are taken in turn, so two requests with one image (different text: no KV prefix hit) go
    to different encoders: the second finds the first's embedding in Mooncake and runs no vision tower,
    and its answer equals the aggregated worker's."""
    image = png(611)
    first = _gen(epd_fleet["router"], "one " + IMAGE_TOKEN + " cat", [image])
    assert first.status_code == 200, first.text
    before = _encoder_counts(epd_fleet)
    deadline = time.monotonic() + FAIL_BOUND_S  # every image encoded is written, in the background
    while sum(c["mm_global_cache_writes"] for c in before) < sum(c["images_encoded"] for c in before):
        assert time.monotonic() < deadline, before
        time.sleep(0.1)
        before = _encoder_counts(epd_fleet)
    text = "two " + IMAGE_TOKEN + " cat"
    got = _gen(epd_fleet["router"], text, [image])
    assert got.status_code == 200, got.text
    after = _encoder_counts(epd_fleet)
    for key, delta in (("mm_global_cache_hits", 1), ("images_encoded", 0), ("mm_embedding_cache_hits", 0)):
        assert sum(a[key] - b[key] for a, b in zip(after, before, strict=True)) == delta, (key, before, after)
    assert got.json()["output_ids"] == _gen(epd_fleet["agg"].url, text, [image]).json()["output_ids"]
    assert all(c["enable_mm_global_cache"] for c in after)


def test_the_language_only_prefill_has_no_vision_tower(epd_fleet):
    info = httpx.get(f"{epd_fleet['p'].url}/server_info").json()
    assert info["language_only"] is True and info["encoder_transfer_backend"] == "zmq_to_scheduler"
    assert httpx.get(f"{epd_fleet['enc'][0].url}/server_info").json()["encoder_only"] is True


def test_bad_encode_body_is_a_400(epd_fleet):
    resp = httpx.post(f"{epd_fleet['enc'][0].url}/encode", json={"rid": "x", "receiver": "tcp://127.0.0.1:1"})
    assert resp.status_code == 400 and "images" in resp.json()["error"]["message"]


def test_one_encoder_down_requests_go_to_the_other(epd_fleet):
    """Runs last: kills encoder 1. Every later request is served (by encoder 0) within the bound."""
    epd_fleet["enc"][1].proc.kill()
    epd_fleet["enc"][1].proc.wait()
    want = [_gen(epd_fleet["agg"].url, IMAGE_TOKEN + " dog", [png(700 + i)]).json() for i in range(3)]
    for i in range(3):
        start = time.monotonic()
        got = _gen(epd_fleet["router"], IMAGE_TOKEN + " dog", [png(700 + i)])
        assert got.status_code == 200, got.text
        assert time.monotonic() - start < FAIL_BOUND_S
        assert got.json()["output_ids"] == want[i]["output_ids"]
    _wait_clean(epd_fleet["p"].url, epd_fleet["d"].url)


def test_no_encoder_left_fails_clearly_within_the_bound_and_leaks_nothing(epd_fleet):
    """Runs last: with both encoders down an image request fails saying so, within the bound (P fails the
    room, so D does not wait for KV), and P and D hold no request afterwards; text-only requests still
    work."""
    for enc in epd_fleet["enc"]:
        enc.proc.kill()
        enc.proc.wait()
    start = time.monotonic()
    resp = _gen(epd_fleet["router"], IMAGE_TOKEN + " dog", [png(900)])
    assert time.monotonic() - start < FAIL_BOUND_S
    assert resp.status_code >= 500, resp.text
    assert "no encoder delivered the image embeddings" in resp.text, resp.text
    assert _gen(epd_fleet["router"], "the quick brown fox", []).status_code == 200
    _wait_clean(epd_fleet["p"].url, epd_fleet["d"].url)


def _wait_clean(*urls: str, timeout: float = FAIL_BOUND_S) -> None:
    """Each worker is idle and holds no KV slot for a request."""
    deadline = time.monotonic() + timeout
    for url in urls:
        while True:
            info = httpx.get(f"{url}/server_info", timeout=10).json()
            busy = info["num_waiting_reqs"] + info["num_running_reqs"] + info["num_pd_transfer_reqs"]
            if info["is_idle"] and busy == 0:
                break
            assert time.monotonic() < deadline, f"{url} still busy after {timeout} s"
            time.sleep(0.2)
