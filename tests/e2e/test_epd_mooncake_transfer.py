"""EPD with ``--encoder-transfer-backend mooncake`` (embeddings written by Mooncake's TransferEngine, TCP on
loopback, into the language-only worker's registered receive slots) against ``zmq_to_scheduler``: real
encoder and language-only worker processes of the same tiny random LLaVA.

Fleet: encoder M and language-only worker LM (both mooncake), encoder Z and language-only worker LZ (both
zmq_to_scheduler). A mismatch is checked with the language-only worker's own encoder client
(``EncoderClient``, what LM and LZ run) in this process, pointed at the encoder of the other backend.
"""

from __future__ import annotations

import base64
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from engine.bench.launcher import ServerProcess
from engine.model.loader import load_checkpoint
from engine.model.vlm.processor import open_image, preprocess
from engine.server.encoder_client import EncoderClient
from engine.server.http_utils import HTTPError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from vlm_testlib import IMAGE_TOKEN, png, save_tiny_llava  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # four workers start on a shared 2-core host

START_S = 600.0
SP = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
MOONCAKE = ["--encoder-transfer-backend", "mooncake"]
ZMQ = ["--encoder-transfer-backend", "zmq_to_scheduler"]
TEXT_HIDDEN = 64  # vlm_testlib's tiny LLaVA


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llava-epd-mooncake")
    save_tiny_llava(folder, seed=11)
    common = ["--model-path", str(folder), "--page-size", "4", "--random-seed", "0"]
    procs: dict[str, ServerProcess] = {}
    try:
        for name, flags in (("M", MOONCAKE), ("Z", ZMQ)):
            procs[name] = ServerProcess([*common, "--encoder-only", *flags], timeout=START_S)
        for name, flags, enc in (("LM", MOONCAKE, "M"), ("LZ", ZMQ, "Z")):
            lang = [*common, "--language-only", "--encoder-urls", procs[enc].url, *flags]
            procs[name] = ServerProcess(lang, timeout=START_S)
        with ThreadPoolExecutor(len(procs)) as pool:  # start together; each waits for its own health
            list(pool.map(lambda p: p.__enter__(), procs.values()))
        yield {"folder": folder, **{name: p.url for name, p in procs.items()}}
    finally:
        for proc in procs.values():
            proc.__exit__(None, None, None)


def _gen(url: str, text: str, images: list[bytes]) -> httpx.Response:
    body = {"text": text, "sampling_params": SP}
    if images:
        body["image_data"] = ["data:image/png;base64," + base64.b64encode(b).decode() for b in images]
    return httpx.post(f"{url}/generate", json=body, timeout=120)


def _buffers(url: str) -> dict:
    return httpx.get(f"{url}/server_info", timeout=10).json()["encoder_transfer_buffers"]


@pytest.mark.parametrize("n_images", [1, 2])
def test_mooncake_transfer_output_equals_zmq_to_scheduler_token_for_token(fleet, n_images):
    images = [png(40 + 10 * n_images + i) for i in range(n_images)]
    text = "the quick " + IMAGE_TOKEN * n_images + " brown fox"
    want = _gen(fleet["LZ"], text, images)
    sent = httpx.get(f"{fleet['M']}/server_info").json()["encoder_transfer_bytes_total"]
    got = _gen(fleet["LM"], text, images)
    assert want.status_code == 200 and got.status_code == 200, (want.text, got.text)
    assert got.json()["output_ids"] == want.json()["output_ids"]
    assert got.json()["meta_info"]["prompt_tokens"] == want.json()["meta_info"]["prompt_tokens"]
    enc = {k: httpx.get(f"{fleet[k]}/server_info").json() for k in ("M", "Z")}
    assert enc["M"]["encoder_transfer_backend"] == "mooncake" and enc["M"]["images_encoded"] >= n_images
    per_image = enc["M"]["tokens_per_image"] * TEXT_HIDDEN * 4  # float32 rows of the text width
    assert enc["M"]["encoder_transfer_bytes_total"] - sent == n_images * per_image
    assert enc["Z"]["encoder_transfer_buffers"] is None


def test_receive_and_send_buffers_return_to_baseline_after_concurrent_requests(fleet):
    """More requests in flight than the worker has receive slots: some wait for a slot, all are served
    with the zmq_to_scheduler worker's tokens, and afterwards every slot on both sides is free again."""
    base_l, base_e = _buffers(fleet["LM"]), httpx.get(f"{fleet['M']}/server_info").json()
    assert base_l["backend"] == "mooncake" and base_l["free"] == base_l["slots"] >= 1
    jobs = [
        ("a " + IMAGE_TOKEN * (1 + i % 2) + " b", [png(80 + i), png(90 + i)][: 1 + i % 2]) for i in range(10)
    ]
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda j: _gen(fleet["LM"], *j), jobs))
    want = [_gen(fleet["LZ"], *j) for j in jobs]
    for g, w in zip(got, want, strict=True):
        assert g.status_code == 200, g.text
        assert g.json()["output_ids"] == w.json()["output_ids"]
    assert _buffers(fleet["LM"]) == base_l
    assert (
        httpx.get(f"{fleet['M']}/server_info").json()["encoder_transfer_buffers"]
        == (base_e["encoder_transfer_buffers"])
    )
    assert _buffers(fleet["LZ"]) == {"backend": "zmq_to_scheduler", "pending": 0}


def test_a_mooncake_worker_meeting_a_zmq_encoder_fails_naming_the_flag_and_returns_its_slot(fleet):
    vlm = load_checkpoint(fleet["folder"]).vlm
    client = EncoderClient([fleet["Z"]], vlm, backend="mooncake", timeout_s=30)
    try:
        base = client.transfer_stats()
        image = preprocess(open_image(png(5), 1 << 30), vlm.processor)
        with pytest.raises(HTTPError) as err:
            client([image])
        assert err.value.status == 503
        assert "--encoder-transfer-backend mismatch: this encoder runs zmq_to_scheduler" in err.value.message
        assert "asked for 'mooncake'" in err.value.message, err.value.message
        assert client.transfer_stats() == base and base["free"] == base["slots"]
    finally:
        assert client.transfer is not None
        client.transfer.close()


def test_a_zmq_worker_meeting_a_mooncake_encoder_fails_naming_the_flag(fleet):
    vlm = load_checkpoint(fleet["folder"]).vlm
    client = EncoderClient([fleet["M"]], vlm, backend="zmq_to_scheduler", timeout_s=30)
    image = preprocess(open_image(png(6), 1 << 30), vlm.processor)
    with pytest.raises(HTTPError) as err:
        client([image])
    assert err.value.status == 503
    assert "--encoder-transfer-backend mismatch: this encoder runs mooncake" in err.value.message
    assert client.transfer_stats() == {"backend": "zmq_to_scheduler", "pending": 0}


def test_an_encoder_refuses_a_zmq_request_when_it_runs_mooncake(fleet):
    body = {"rid": "r", "transfer_backend": "zmq_to_scheduler", "receiver": "tcp://127.0.0.1:1", "images": []}
    resp = httpx.post(f"{fleet['M']}/encode", json=body, timeout=10)
    assert resp.status_code == 400
    assert (
        "--encoder-transfer-backend mismatch: this encoder runs mooncake" in resp.json()["error"]["message"]
    )
    del body["transfer_backend"]  # a body without the field asks for zmq_to_scheduler
    assert httpx.post(f"{fleet['M']}/encode", json=body, timeout=10).status_code == 400


def test_a_mooncake_encode_without_a_transfer_target_is_a_400_naming_it(fleet):
    body = {"rid": "r", "transfer_backend": "mooncake", "images": [{"digest": "x"}]}
    resp = httpx.post(f"{fleet['M']}/encode", json=body, timeout=10)
    assert resp.status_code == 400 and resp.json()["error"]["message"].startswith("transfer:")
