"""A LLaVA worker over HTTP: images as OpenAI ``image_url`` parts and ``/generate`` ``image_data`` give
transformers' greedy tokens; bad images are a 400 naming the field with nothing queued; image tokens are
keyed by content in the prefix cache (device tier and, after a flush, L3)."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import openai
import pytest
import torch
from server_testlib import ThreadedServer, wait_idle

from engine.model.runner import ModelRunner
from engine.server.args import parse_args
from engine.server.builder import build_engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from vlm_testlib import IMAGE_TOKEN, data_url, png, save_tiny_llava  # noqa: E402

STEPS = 6


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llava-server")
    hf = save_tiny_llava(folder, seed=5)
    return folder, hf, ModelRunner(folder, dtype="float32")


@pytest.fixture(scope="module")
def vlm_server(llava, tmp_path_factory):
    folder, _, runner = llava
    store = tmp_path_factory.mktemp("vlm-l3")
    local = tmp_path_factory.mktemp("vlm-local-images")
    (local / "a.png").write_bytes(png(1))
    args = parse_args(
        [
            "--model-path", str(folder), "--page-size", "1", "--max-image-pixels", "4096",
            "--limit-mm-data-per-request", '{"image": 2}', "--allowed-local-media-path", str(local),
            "--enable-hierarchical-cache", "--hicache-storage-backend", "file",
            "--hicache-storage-backend-extra-config", f'{{"file_path": "{store}", "prefetch_threshold": 4}}',
            "--hicache-io-backend", "direct", "--hicache-storage-prefetch-policy", "wait_complete",
        ]
    )  # fmt: skip
    engine = build_engine(args, runner=runner)
    with ThreadedServer(engine) as server:
        yield server, local
    engine.scheduler.stop()


def _hf_greedy(hf, runner, text: str, images: list[bytes]) -> list[int]:
    import io

    import transformers
    from PIL import Image

    image_id, n = runner.vlm.vision.image_token_id, runner.vlm.vision.tokens_per_image
    text_ids = runner.tokenizer.encode(text, add_special_tokens=False)
    ids = torch.tensor([[x for t in text_ids for x in ([t] * n if t == image_id else [t])]])
    kwargs = {}
    if images:
        proc = transformers.CLIPImageProcessorPil(
            size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
        )
        kwargs["pixel_values"] = proc([Image.open(io.BytesIO(b)) for b in images], return_tensors="pt")[
            "pixel_values"
        ]
    with torch.no_grad():
        out = hf.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=STEPS,
            min_new_tokens=STEPS, eos_token_id=None, pad_token_id=0, **kwargs,
        )  # fmt: skip
    return out[0, ids.shape[1] :].tolist()


def _generate(server, text: str, images, **extra) -> httpx.Response:
    body = {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": STEPS, "ignore_eos": True}}
    if images is not None:
        body["image_data"] = images
    return httpx.post(f"{server.url}/generate", json=body | extra, timeout=60)


@pytest.mark.parametrize("n_images", [0, 1, 2])
def test_generate_with_image_data_matches_transformers(vlm_server, llava, n_images):
    server, _ = vlm_server
    _, hf, runner = llava
    images = [png(40 + i, (48, 40)) for i in range(n_images)]
    text = "the quick " + IMAGE_TOKEN * n_images + " brown fox"
    resp = _generate(server, text, [data_url(b) for b in images] if images else None)
    assert resp.status_code == 200, resp.text
    assert resp.json()["output_ids"] == _hf_greedy(hf, runner, text, images)
    assert (
        resp.json()["meta_info"]["prompt_tokens"] == len(runner.tokenizer.encode(text, False)) + 15 * n_images
    )


def test_chat_image_url_part_through_the_openai_sdk(vlm_server, llava):
    server, _ = vlm_server
    _, hf, runner = llava
    image = png(3)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    content = [
        {"type": "text", "text": "what is "},
        {"type": "image_url", "image_url": {"url": data_url(image)}},
    ]
    out = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": content}], max_tokens=STEPS, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    prompt = f"<|im_start|>user\nwhat is {IMAGE_TOKEN}<|im_end|>\n<|im_start|>assistant\n"
    expected = runner.tokenizer.decode(_hf_greedy(hf, runner, prompt, [image]), skip_special_tokens=True)
    assert out.choices[0].message.content == expected


def test_local_path_is_read_only_under_the_allowed_directory(vlm_server):
    server, local = vlm_server
    ok = _generate(server, IMAGE_TOKEN + " fox", str(local / "a.png"))
    assert ok.status_code == 200, ok.text
    outside = _generate(server, IMAGE_TOKEN + " fox", "/etc/hostname")
    assert outside.status_code == 400 and "outside --allowed-local-media-path" in outside.text


@pytest.mark.parametrize(
    ("images", "text", "field", "words"),
    [
        (["https://example.com/cat.png"], IMAGE_TOKEN, "image_data", "remote image URLs are not fetched"),
        ([data_url(b"hello", "text/plain")], IMAGE_TOKEN, "image_data", "MIME type 'text/plain'"),
        (["data:image/png;base64,@@@"], IMAGE_TOKEN, "image_data", "not valid base64"),
        ([data_url(b"not a png at all")], IMAGE_TOKEN, "image_data", "not a readable image"),
        ([data_url(png(1, (80, 80)))], IMAGE_TOKEN, "image_data", "6400 pixels, more than the limit 4096"),
        ([data_url(png(i)) for i in range(3)], IMAGE_TOKEN * 3, "image_data.2", "more than the limit 2"),
        ([data_url(png(1))], "no placeholder", "image_data", "0 image placeholders but 1 images"),
    ],
)
def test_bad_images_are_a_400_naming_the_field_and_queue_nothing(
    vlm_server, monkeypatch, images, text, field, words
):
    server, _ = vlm_server
    submitted = []
    real = server.engine.scheduler.submit
    monkeypatch.setattr(server.engine.scheduler, "submit", lambda req: submitted.append(req) or real(req))
    resp = _generate(server, text, images if len(images) > 1 else images[0])
    assert resp.status_code == 400
    message = resp.json()["error"]["message"]
    assert message.startswith(f"{field}:") and words in message
    assert submitted == []


def test_chat_bad_image_names_the_content_part(vlm_server):
    server, _ = vlm_server
    content = [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    resp = httpx.post(
        f"{server.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": content}]}
    )
    assert resp.status_code == 400
    assert resp.json()["error"]["message"].startswith("messages.0.content.1.image_url.url:")


def _image_span(text_before: str, runner) -> tuple[int, int]:
    start = len(runner.tokenizer.encode(text_before, add_special_tokens=False))
    return start, start + runner.vlm.vision.tokens_per_image


def test_same_image_reuses_its_kv_and_a_different_image_does_not(vlm_server, llava):
    server, _ = vlm_server
    runner = llava[2]
    before = "a paged KV cache stores "
    text = before + IMAGE_TOKEN + " keys and values"
    first, last = _image_span(before, runner)
    a, b = data_url(png(101)), data_url(png(102))
    assert _generate(server, text, a).json()["meta_info"]["cached_tokens"] <= first
    again = _generate(server, text, a).json()["meta_info"]
    assert again["cached_tokens"] >= last  # the image's tokens came from the cache
    other = _generate(server, text, b).json()["meta_info"]
    assert first - 1 <= other["cached_tokens"] <= first  # the text before the image, no image token


def _flush(sched):
    sched.require_idle("flush cache")
    sched.cache.reset()


def test_image_kv_comes_back_from_l2_and_l3(vlm_server, llava):
    """Evicted to L2, then flushed to L3 only: the same image's tokens are served from each tier, with the
    same output as the cold run."""
    server, _ = vlm_server
    engine, runner = server.engine, llava[2]
    before = "the lazy dog "
    text = before + IMAGE_TOKEN + " jumps over"
    _, last = _image_span(before, runner)
    image = data_url(png(201))
    cold = _generate(server, text, image).json()
    wait_idle(engine)
    engine.scheduler.call(lambda s: s.cache.evict(10**6)).result(30)
    wait_idle(engine)
    l2 = _generate(server, text, image).json()
    assert l2["meta_info"]["cached_tokens_details"]["host"] >= last
    wait_idle(engine)
    engine.scheduler.call(_flush).result(30)
    l3 = _generate(server, text, image).json()
    assert l3["meta_info"]["cached_tokens_details"]["storage"] >= last
    assert cold["output_ids"] == l2["output_ids"] == l3["output_ids"]
