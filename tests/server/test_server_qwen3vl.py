"""A Qwen3-VL worker over HTTP (one module-scoped server with L2 and a file L3): ``/generate``
``image_data`` and OpenAI ``image_url`` parts give transformers' greedy tokens on the same weights (fed our
preprocessing's patches and grids) with images of different sizes; the same image's tokens are served
from the device cache, L2 and L3 with the same output (M-RoPE positions of the text after a cached image
included)."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import openai
import pytest
import torch
from server_testlib import ThreadedServer, wait_idle

from engine.model.runner import ModelRunner
from engine.model.vlm.processor import open_image, preprocess
from engine.server.args import parse_args
from engine.server.builder import build_engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from vlm_testlib import QWEN_IMAGE_TOKEN, data_url, png, qwen_hf_kwargs, save_tiny_qwen3vl  # noqa: E402

STEPS = 6
IMAGE = "<|vision_start|>" + QWEN_IMAGE_TOKEN + "<|vision_end|>"


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-qwen3vl-server")
    hf = save_tiny_qwen3vl(folder, seed=7)
    return folder, hf, ModelRunner(folder, dtype="float32")


@pytest.fixture(scope="module")
def server(qwen, tmp_path_factory):
    folder, _, runner = qwen
    store = tmp_path_factory.mktemp("qwen3vl-l3")
    args = parse_args(
        [
            "--model-path", str(folder), "--page-size", "1", "--limit-mm-data-per-request", '{"image": 2}',
            "--enable-hierarchical-cache", "--hicache-storage-backend", "file",
            "--hicache-storage-backend-extra-config", f'{{"file_path": "{store}", "prefetch_threshold": 4}}',
            "--hicache-io-backend", "direct", "--hicache-storage-prefetch-policy", "wait_complete",
        ]
    )  # fmt: skip
    engine = build_engine(args, runner=runner)
    with ThreadedServer(engine) as srv:
        yield srv
    engine.scheduler.stop()


def hf_greedy(hf, runner, text: str, images: list[bytes]) -> tuple[list[int], int]:
    """transformers' greedy tokens for ``text`` (one image token per image) and the expanded prompt's
    length; the model gets our patches and grids."""
    procs = [preprocess(open_image(b, 10**6), runner.vlm.processor) for b in images]
    counts = iter(runner.vlm.image_slot(p).length for p in procs)
    image_id = runner.vlm.vision.image_token_id
    ids = [
        x
        for t in runner.tokenizer.encode(text, False)
        for x in ([t] * next(counts) if t == image_id else [t])
    ]
    x = torch.tensor([ids])
    kwargs = qwen_hf_kwargs(x, procs, image_id)
    with torch.no_grad():
        out = hf.generate(
            x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=STEPS,
            min_new_tokens=STEPS, eos_token_id=None, pad_token_id=0, **kwargs,
        )  # fmt: skip
    return out[0, len(ids) :].tolist(), len(ids)


def generate(srv, text: str, images) -> dict:
    body = {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": STEPS, "ignore_eos": True}}
    if images is not None:
        body["image_data"] = images
    resp = httpx.post(f"{srv.url}/generate", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


@pytest.mark.parametrize("sizes", [[], [(48, 32)], [(32, 64), (40, 40)]])
def test_generate_with_image_data_matches_transformers(server, qwen, sizes):
    _, hf, runner = qwen
    images = [png(60 + i, size) for i, size in enumerate(sizes)]
    text = "the quick " + " and ".join([IMAGE] * len(images)) + " brown fox"
    out = generate(server, text, [data_url(b) for b in images] if images else None)
    expected, prompt_len = hf_greedy(hf, runner, text, images)
    assert out["output_ids"] == expected
    assert out["meta_info"]["prompt_tokens"] == prompt_len


def test_chat_image_url_part_through_the_openai_sdk(server, qwen):
    _, hf, runner = qwen
    image = png(3, (64, 48))
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    content = [
        {"type": "text", "text": "what is "},
        {"type": "image_url", "image_url": {"url": data_url(image)}},
    ]
    out = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": content}], max_tokens=STEPS, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    prompt = f"<|im_start|>user\nwhat is {IMAGE}<|im_end|>\n<|im_start|>assistant\n"
    expected = runner.tokenizer.decode(hf_greedy(hf, runner, prompt, [image])[0], skip_special_tokens=True)
    assert out.choices[0].message.content == expected


def _flush(sched):
    sched.require_idle("flush cache")
    sched.cache.reset()


def test_same_image_reuses_its_tokens_in_every_tier(server, qwen):
    """The second request for an image takes its tokens from the device cache, then (evicted) from L2,
    then (flushed) from L3, each time with transformers' output; another image diverges at its first
    token."""
    _, hf, runner = qwen
    engine = server.engine
    before = "a paged KV cache stores "
    text = before + IMAGE + " keys and values"
    image = png(101, (48, 32))
    first = len(runner.tokenizer.encode(before + "<|vision_start|>", add_special_tokens=False))
    last = first + 6  # 48 x 32 px: 3 x 2 image tokens
    expected, _ = hf_greedy(hf, runner, text, [image])
    cold = generate(server, text, data_url(image))
    assert cold["meta_info"]["cached_tokens"] <= first and cold["output_ids"] == expected
    l1 = generate(server, text, data_url(image))
    assert l1["meta_info"]["cached_tokens"] >= last and l1["output_ids"] == expected
    other = generate(server, text, data_url(png(102, (48, 32))))["meta_info"]
    assert first - 1 <= other["cached_tokens"] <= first
    wait_idle(engine)
    engine.scheduler.call(lambda s: s.cache.evict(10**6)).result(30)
    wait_idle(engine)
    l2 = generate(server, text, data_url(image))
    assert l2["meta_info"]["cached_tokens_details"]["host"] >= last and l2["output_ids"] == expected
    wait_idle(engine)
    engine.scheduler.call(_flush).result(30)
    l3 = generate(server, text, data_url(image))
    assert l3["meta_info"]["cached_tokens_details"]["storage"] >= last and l3["output_ids"] == expected


def test_an_image_the_processor_cannot_take_is_a_400_naming_the_field(server, monkeypatch):
    submitted = []
    real = server.engine.scheduler.submit
    monkeypatch.setattr(server.engine.scheduler, "submit", lambda req: submitted.append(req) or real(req))
    body = {"text": IMAGE, "image_data": data_url(png(1, (402, 2))), "sampling_params": {"max_new_tokens": 1}}
    resp = httpx.post(f"{server.url}/generate", json=body, timeout=60)
    assert resp.status_code == 400
    assert resp.json()["error"]["message"].startswith("image_data: aspect ratio 201 is above 200")
    assert submitted == []
