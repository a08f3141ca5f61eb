"""EPD of a tiny random Qwen3-VL, as docs/vlm.md starts it: an encoder (``--encoder-only``), a language-only
prefill worker fetching embeddings from it (``zmq_to_scheduler``), a decode worker and the real router
(smg) in PD mode; greedy tokens equal transformers' on the same weights for images of different sizes, and
the second request for an image reuses its tokens. A second encoder runs ``--encoder-transfer-backend
mooncake``: the language-only worker's own client (``EncoderClient``) in this process receives through
Mooncake's TransferEngine exactly the embeddings the tower computes here.
"""

from __future__ import annotations

import base64
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from engine.bench.launcher import ServerProcess
from engine.fleet.router import RouterProcess
from engine.model.loader import load_checkpoint
from engine.model.vlm.processor import image_digest, open_image, preprocess
from engine.model.vlm.towers import make_vision_encoder
from engine.ports import free_port
from engine.server.encoder_client import EncoderClient

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from vlm_testlib import QWEN_IMAGE_TOKEN, data_url, png, qwen_hf_kwargs, save_tiny_qwen3vl  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # four workers start on a shared 2-core host

START_S = 600.0
STEPS = 8
SP = {"max_new_tokens": STEPS, "temperature": 0, "ignore_eos": True}
IMAGE = "<|vision_start|>" + QWEN_IMAGE_TOKEN + "<|vision_end|>"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-qwen3vl-epd")
    hf = save_tiny_qwen3vl(folder, seed=13)
    common = ["--model-path", str(folder), "--page-size", "4", "--random-seed", "0"]
    bp = free_port()
    enc_z = ServerProcess([*common, "--encoder-only"], timeout=START_S)
    flags = [*common, "--encoder-only", "--encoder-transfer-backend", "mooncake"]
    enc_m = ServerProcess(flags, timeout=START_S)
    prefill = ServerProcess(
        [
            *common, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bp),
            "--language-only", "--encoder-urls", enc_z.url,
        ],
        timeout=START_S,
    )  # fmt: skip
    decode = ServerProcess([*common, "--disaggregation-mode", "decode"], timeout=START_S)
    procs = [enc_z, enc_m, prefill, decode]
    try:
        with ThreadPoolExecutor(len(procs)) as pool:  # start together; each waits for its own health
            list(pool.map(lambda p: p.__enter__(), procs))
        workers = ["--pd-disaggregation", "--prefill", prefill.url, str(bp), "--decode", decode.url]
        with RouterProcess(workers) as router:
            yield {"folder": folder, "hf": hf, "enc_z": enc_z.url, "enc_m": enc_m.url, "router": router.url}
    finally:
        for proc in procs:
            proc.__exit__(None, None, None)


def _hf_greedy(fleet, text: str, images: list[bytes]) -> list[int]:
    ckpt = load_checkpoint(fleet["folder"])
    vlm, tok = ckpt.vlm, ckpt.tokenizer
    procs = [preprocess(open_image(b, 10**6), vlm.processor) for b in images]
    counts = iter(vlm.image_slot(p).length for p in procs)
    image_id = vlm.vision.image_token_id
    ids = [x for t in tok.encode(text, False) for x in ([t] * next(counts) if t == image_id else [t])]
    x = torch.tensor([ids])
    with torch.no_grad():
        out = fleet["hf"].generate(
            x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=STEPS,
            min_new_tokens=STEPS, eos_token_id=None, pad_token_id=0, **qwen_hf_kwargs(x, procs, image_id),
        )  # fmt: skip
    return out[0, len(ids) :].tolist()


def _gen(url: str, text: str, images: list[bytes]) -> dict:
    body = {"text": text, "sampling_params": SP}
    if images:
        body["image_data"] = [data_url(b) for b in images]
    resp = httpx.post(f"{url}/generate", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _info(url: str) -> dict:
    return httpx.get(f"{url}/server_info", timeout=10).json()


@pytest.mark.parametrize("sizes", [[], [(48, 32)], [(32, 64), (40, 40)]])
def test_epd_through_the_router_gives_transformers_greedy_tokens(fleet, sizes):
    images = [png(80 + i, size) for i, size in enumerate(sizes)]
    text = "the quick " + " and ".join([IMAGE] * len(images)) + " brown fox"
    assert _gen(fleet["router"], text, images)["output_ids"] == _hf_greedy(fleet, text, images)


def test_the_second_request_for_an_image_reuses_its_tokens(fleet):
    """Same image, same text: the prefill worker serves the image's tokens from its cache (and the encoder
    answers from its embedding cache, running no tower), with transformers' output both times."""
    text, image = "a paged KV cache stores " + IMAGE + " keys", png(91, (64, 32))
    want = _hf_greedy(fleet, text, [image])
    first = _gen(fleet["router"], text, [image])
    before = _info(fleet["enc_z"])
    second = _gen(fleet["router"], text, [image])
    after = _info(fleet["enc_z"])
    assert first["output_ids"] == second["output_ids"] == want
    image_end = second["meta_info"]["prompt_tokens"] - 3  # "<|vision_end|> keys" follow the image tokens
    assert first["meta_info"]["cached_tokens"] < image_end - 8  # 8 image tokens: none came from a cache
    assert second["meta_info"]["cached_tokens"] >= image_end - 4  # page size 4: whole pages only
    assert after["images_encoded"] == before["images_encoded"]
    assert after["mm_embedding_cache_hits"] == before["mm_embedding_cache_hits"] + 1


def test_mooncake_transfer_delivers_the_towers_embeddings(fleet):
    """Images of two sizes (6 and 8 tokens, each row the main and two deepstack embeddings) through the
    mooncake encoder into this process's receive slot: equal to the tower run here."""
    ckpt = load_checkpoint(fleet["folder"])
    vlm = ckpt.vlm
    images = [
        preprocess(open_image(png(95 + i, s), 10**6), vlm.processor)
        for i, s in enumerate([(48, 32), (64, 32)])
    ]
    client = EncoderClient([fleet["enc_m"]], vlm, backend="mooncake", timeout_s=60)
    try:
        got = client(images)
        assert client.transfer_stats()["free"] == client.transfer_stats()["slots"]
    finally:
        assert client.transfer is not None
        client.transfer.close()
    want = make_vision_encoder(ckpt, torch.float32, torch.device("cpu")).encode_images(images)
    assert [tuple(g.shape) for g in got] == [(6, 192), (8, 192)]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6)
    info = _info(fleet["enc_m"])
    assert info["encoder_transfer_backend"] == "mooncake" and info["tokens_per_image"] is None
    assert info["encoder_transfer_bytes_total"] == (6 + 8) * 192 * 4


def test_patches_that_do_not_fill_their_grid_are_a_400(fleet):
    pixels = torch.zeros(4, 384)  # 4 patches of 3 x 2 x 8 x 8 values; a 4 x 4 grid needs 16
    image = {
        "digest": image_digest(pixels, (1, 4, 4)),
        "shape": [4, 384],
        "grid": [1, 4, 4],
        "pixels": base64.b64encode(pixels.numpy().tobytes()).decode(),
    }
    body = {"rid": "r", "receiver": "tcp://127.0.0.1:1", "images": [image]}
    resp = httpx.post(f"{fleet['enc_z']}/encode", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    assert "do not fit grid (1, 4, 4)" in resp.json()["error"]["message"]
