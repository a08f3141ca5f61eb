"""Qwen3-VL (vision tower with deepstack, interleaved M-RoPE over a Qwen3 decoder) and Qwen2.5-VL (window
attention tower, sectioned M-RoPE over a Qwen2 decoder) against transformers on the same random weights:
our patches and grid against transformers' PIL image processor, logits at every position and greedy
tokens with zero, one and two images of different shapes (transformers' model is fed the pixel values
our preprocessing makes)."""

from __future__ import annotations

import io
import json
import shutil

import pytest
import torch
from model_testlib import PageAllocator
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from vlm_testlib import (
    QWEN_PROCESSOR,
    QWEN_SIZE,
    png,
    qwen_hf_kwargs,
    save_tiny_qwen3vl,
    save_tiny_qwen25vl,
)

from engine.cache.device_pool import DeviceKVPool
from engine.model.errors import ModelLoadError
from engine.model.forward_batch import ForwardBatch
from engine.model.loader.hf_folder import load_hf_config, load_hf_folder
from engine.model.runner import ModelRunner
from engine.model.vlm.mm import ImageSlot, batch_embeds, expand_prompt, mrope_positions
from engine.model.vlm.processor import open_image, preprocess


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen2_5_vl"])
def qwen(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    save = save_tiny_qwen3vl if request.param == "qwen3_vl" else save_tiny_qwen25vl
    hf = save(folder, seed=5)
    return folder, hf, ModelRunner(folder, dtype="float32")


def _processed(runner, images):
    return [preprocess(open_image(b, 10**6), runner.vlm.processor) for b in images]


def _slots(runner, procs):
    merge = runner.vlm.vision.spatial_merge_size
    out = []
    for p in procs:
        _, rows, cols = p.grid
        out.append(ImageSlot(p.pad_value, p.digest, rows * cols // merge**2, (rows // merge, cols // merge)))
    return out


def _prompt(runner, n_images):
    image = runner.vlm.vision.image_token_id
    text = runner.tokenizer.encode("the quick brown fox jumps", add_special_tokens=False)
    out = text[:2]
    for k in range(n_images):  # text between images: transformers takes adjacent image tokens as one image
        out += [image, text[2 + k]]
    return out + text[2 + n_images :]


def _engine_greedy(runner, prompt, images, steps):
    """Prefill in chunks of 5 tokens (an image split across chunks), then greedy decode; returns the
    prompt's logits ``(P, V)``, the expanded ids and the new tokens."""
    procs = _processed(runner, images)
    ids, items = expand_prompt(prompt, runner.vlm.vision.image_token_id, _slots(runner, procs))
    for item, e in zip(items, runner.vision.encode_images(procs), strict=True):
        item.embeds = e
    pool = DeviceKVPool(256, 4, **vars(runner.kv_pool_spec()))
    alloc = PageAllocator(pool)
    slots = torch.zeros(0, dtype=torch.long)
    logits = []
    for start in range(0, len(ids), 5):
        end = min(start + 5, len(ids))
        slots = alloc.extend(slots, end)
        batch = ForwardBatch.from_sequences([ids[start:end]], [slots])
        batch.mm_embeds = batch_embeds([(items, start, end)])
        batch.mrope_positions = mrope_positions([(items, start, end)])
        logits.append(runner.forward(batch, pool, return_all_logits=True))
    out = [int(logits[-1][-1].argmax())]
    for _ in range(steps - 1):
        n = slots.shape[0] + 1
        slots = alloc.extend(slots, n)
        batch = ForwardBatch.for_decode([out[-1]], [slots])
        batch.mrope_positions = mrope_positions([(items, n - 1, n)])
        out.append(int(runner.forward(batch, pool)[0].argmax()))
    return torch.cat(logits), ids, out


def _hf(hf, ids, procs, steps):
    x = torch.tensor([ids])
    kwargs = qwen_hf_kwargs(x, procs, hf.config.image_token_id)
    with torch.no_grad():
        logits = hf(input_ids=x, **kwargs).logits[0]
        gen = hf.generate(
            x,
            attention_mask=torch.ones_like(x),
            do_sample=False,
            max_new_tokens=steps,
            min_new_tokens=steps,
            eos_token_id=None,
            pad_token_id=0,
            **kwargs,
        )
    return logits, gen[0, len(ids) :].tolist()


@pytest.mark.parametrize("n_images", [0, 1, 2])
def test_logits_and_greedy_tokens_match_transformers(qwen, n_images):
    _, hf, runner = qwen
    images = [png(20 + i, size) for i, size in enumerate([(48, 32), (32, 64)][:n_images])]
    ours, ids, our_tokens = _engine_greedy(runner, _prompt(runner, n_images), images, steps=8)
    hf_ids = [runner.vlm.vision.image_token_id if t >= 2**31 else t for t in ids]
    theirs, their_tokens = _hf(hf, hf_ids, _processed(runner, images), steps=8)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert our_tokens == their_tokens


def test_image_and_deepstack_change_the_output(qwen):
    """The image reaches the logits; Qwen3-VL's embeddings carry its deepstack rows."""
    _, _, runner = qwen
    prompt = _prompt(runner, 1)
    a, _, _ = _engine_greedy(runner, prompt, [png(1, (48, 32))], steps=1)
    b, _, _ = _engine_greedy(runner, prompt, [png(2, (48, 32))], steps=1)
    assert (a[-1] - b[-1]).abs().max() > 1e-2
    hidden = runner.config.hidden_size
    proc = _processed(runner, [png(1, (48, 32))])
    embeds = runner.vision.encode_images(proc)[0]
    deepstack = len(runner.vlm.vision.deepstack)  # Qwen3-VL: 2; Qwen2.5-VL: none
    assert embeds.shape == (6, hidden * (1 + deepstack))  # 48 x 32 px: 3 x 2 tokens


def test_processor_matches_transformers(qwen):
    _, _, runner = qwen
    ref = Qwen2VLImageProcessorPil(
        size=QWEN_SIZE, image_mean=[0.5] * 3, image_std=[0.5] * 3, **QWEN_PROCESSOR
    )
    for size in [(48, 36), (200, 30), (17, 90)]:
        data = png(7, size)
        ours = preprocess(open_image(data, 10**6), runner.vlm.processor)
        theirs = ref(Image.open(io.BytesIO(data)).convert("RGB"), return_tensors="pt")
        assert list(ours.grid) == theirs["image_grid_thw"][0].tolist()
        torch.testing.assert_close(ours.pixels, theirs["pixel_values"], rtol=0, atol=1e-5)


def test_mrope_positions_follow_transformers(qwen):
    """Our positions for a prompt with two images equal transformers' ``get_rope_index``, also when
    computed in pieces (a chunk boundary inside an image, one decode position)."""
    _, hf, runner = qwen
    procs = _processed(runner, [png(3, (48, 32)), png(4, (32, 64))])
    ids, items = expand_prompt(_prompt(runner, 2), runner.vlm.vision.image_token_id, _slots(runner, procs))
    x = torch.tensor([[runner.vlm.vision.image_token_id if t >= 2**31 else t for t in ids]])
    ref, delta = hf.model.get_rope_index(
        x, (x == hf.config.image_token_id).int(), torch.tensor([p.grid for p in procs])
    )
    whole = mrope_positions([(items, 0, len(ids))])
    assert torch.equal(whole, ref[:, 0])
    pieces = torch.cat(
        [mrope_positions([(items, s, min(s + 4, len(ids)))]) for s in range(0, len(ids), 4)], 1
    )
    assert torch.equal(pieces, whole)
    n = len(ids) + 3
    assert mrope_positions([(items, n - 1, n)])[:, 0].tolist() == [n - 1 + int(delta)] * 3


def test_mrope_sections_that_do_not_cover_the_head_are_refused_naming_the_field(qwen, tmp_path):
    folder, _, _ = qwen
    cfg = json.loads((folder / "config.json").read_text())
    cfg["text_config"]["rope_parameters"]["mrope_section"] = [4, 2, 1]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="rope_parameters.mrope_section: three sections summing to"):
        load_hf_config(tmp_path)


def test_mrope_sections_are_read_from_older_rope_scaling_too(qwen, tmp_path):
    """Published Qwen3-VL files keep the sections in ``text_config.rope_scaling`` beside ``rope_theta``."""
    folder, _, runner = qwen
    cfg = json.loads((folder / "config.json").read_text())
    text = cfg["text_config"]
    text["rope_scaling"] = {k: v for k, v in text.pop("rope_parameters").items() if k != "rope_theta"}
    text["rope_theta"] = 5000.0
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_hf_config(tmp_path) == runner.config
    assert runner.config.mrope_section == tuple(cfg["text_config"]["rope_scaling"]["mrope_section"])


def test_a_chat_template_json_is_the_template(qwen, tmp_path):
    """Qwen-VL checkpoints ship their template as ``chat_template.json``: it is read (before
    ``tokenizer_config.json``'s)."""
    folder, _, _ = qwen
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    (tmp_path / "chat_template.json").write_text(
        json.dumps({"chat_template": "T{{ messages[0]['content'] }}"})
    )
    tok = load_hf_folder(tmp_path).tokenizer
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=False) == "Thi"


def test_an_older_flat_config_loads_the_same(qwen, tmp_path):
    """Published Qwen2.5-VL files keep the text settings at the top level, M-RoPE as ``rope_scaling``
    ``{"type": "mrope", "mrope_section": ...}``: the same model config and vision settings load."""
    folder, _, runner = qwen
    cfg = json.loads((folder / "config.json").read_text())
    text = cfg.pop("text_config")
    rope = text.pop("rope_parameters")
    flat = {**text, **cfg, "rope_theta": rope.pop("rope_theta"), "rope_scaling": {**rope, "type": "mrope"}}
    flat["rope_scaling"].pop("rope_type")
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(flat))
    assert load_hf_config(tmp_path) == runner.config
    assert load_hf_folder(tmp_path).vlm == runner.vlm
