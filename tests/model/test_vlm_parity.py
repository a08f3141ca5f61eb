"""LLaVA (CLIP tower + projector over the Llama decoder) against transformers on the same random weights:
pixels, logits at every position and greedy tokens, with and without images."""

from __future__ import annotations

import io

import pytest
import torch
import transformers
from model_testlib import PageAllocator
from PIL import Image
from vlm_testlib import png, save_tiny_llava

from engine.cache.device_pool import DeviceKVPool
from engine.model.forward_batch import ForwardBatch
from engine.model.runner import ModelRunner
from engine.model.vlm.mm import ImageSlot, batch_embeds, expand_prompt
from engine.model.vlm.processor import open_image, preprocess


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llava")
    hf = save_tiny_llava(folder, seed=3)
    return folder, hf, ModelRunner(folder, dtype="float32")


def _prompt(runner: ModelRunner, n_images: int) -> list[int]:
    image = runner.vlm.vision.image_token_id
    text = runner.tokenizer.encode("the quick brown fox", add_special_tokens=False)
    return [*text[:2], *([image] * n_images), *text[2:], image][: len(text) + n_images]


def _engine_greedy(runner, prompt, images, steps):
    """Prefill (in chunks of 7 tokens, so an image is split across chunks) then greedy decode; returns the
    prompt's logits ``(P, V)`` and the new tokens."""
    procs = [preprocess(open_image(b, 10**6), runner.vlm.processor) for b in images]
    n = runner.vlm.vision.tokens_per_image
    ids, items = expand_prompt(
        prompt, runner.vlm.vision.image_token_id, [ImageSlot(p.pad_value, p.digest, n) for p in procs]
    )
    if procs:
        embeds = runner.vision.encode(torch.stack([p.pixels for p in procs]))
        for item, e in zip(items, embeds, strict=True):
            item.embeds = e
    spec = runner.kv_pool_spec()
    pool = DeviceKVPool(256, 4, **vars(spec))
    alloc = PageAllocator(pool)
    slots = torch.zeros(0, dtype=torch.long)
    logits = []
    for start in range(0, len(ids), 7):
        end = min(start + 7, len(ids))
        slots = alloc.extend(slots, end)
        batch = ForwardBatch.from_sequences([ids[start:end]], [slots])
        batch.mm_embeds = batch_embeds([(items, start, end)])
        logits.append(runner.forward(batch, pool, return_all_logits=True))
    out = [int(logits[-1][-1].argmax())]
    for _ in range(steps - 1):
        slots = alloc.extend(slots, slots.shape[0] + 1)
        batch = ForwardBatch.for_decode([out[-1]], [slots])
        out.append(int(runner.forward(batch, pool)[0].argmax()))
    return torch.cat(logits), ids, out


def _hf(hf, prompt, images, steps):
    ids = torch.tensor([prompt])
    kwargs = {}
    if images:
        proc = transformers.CLIPImageProcessorPil(
            size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
        )
        kwargs["pixel_values"] = proc([Image.open(io.BytesIO(b)) for b in images], return_tensors="pt")[
            "pixel_values"
        ]
    with torch.no_grad():
        logits = hf(input_ids=ids, **kwargs).logits[0]
        gen = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=steps,
            min_new_tokens=steps,
            eos_token_id=None,
            pad_token_id=0,
            **kwargs,
        )
    return logits, gen[0, len(prompt) :].tolist()


@pytest.mark.parametrize("n_images", [0, 1, 2])
def test_logits_and_greedy_tokens_match_transformers(llava, n_images):
    folder, hf, runner = llava
    prompt = _prompt(runner, n_images)
    images = [png(10 + i, (40 + 8 * i, 32)) for i in range(n_images)]
    ours, ids, our_tokens = _engine_greedy(runner, prompt, images, steps=8)
    hf_prompt = [runner.vlm.vision.image_token_id if t >= 2**31 else t for t in ids]
    theirs, their_tokens = _hf(hf, hf_prompt, images, steps=8)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert our_tokens == their_tokens


def test_image_changes_the_output(llava):
    """The image reaches the logits: two different images give different logits for the same text."""
    _, _, runner = llava
    prompt = _prompt(runner, 1)
    a, _, _ = _engine_greedy(runner, prompt, [png(1)], steps=1)
    b, _, _ = _engine_greedy(runner, prompt, [png(2)], steps=1)
    assert (a[-1] - b[-1]).abs().max() > 1e-2


def test_processor_matches_transformers(llava):
    folder, _, runner = llava
    data = png(7, (48, 36))
    ours = preprocess(open_image(data, 10**6), runner.vlm.processor).pixels
    ref = transformers.CLIPImageProcessorPil.from_pretrained(folder)(
        Image.open(io.BytesIO(data)), return_tensors="pt"
    )
    torch.testing.assert_close(ours, ref["pixel_values"][0], rtol=0, atol=1e-5)


def test_pad_values_key_images_by_content(llava):
    _, _, runner = llava
    cfg = runner.vlm.processor
    a, a2, b = (preprocess(open_image(png(s), 10**6), cfg) for s in (1, 1, 2))
    assert a.pad_value == a2.pad_value != b.pad_value
    assert a.pad_value >= runner.tokenizer.vocab_size
