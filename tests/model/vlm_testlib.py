"""Test-only helpers for vision-language models: a tiny random LLaVA checkpoint (CLIP tower, 32 px images,
2 vision layers, 2 text layers) that transformers writes, and PNG images."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import torch
import transformers
from model_testlib import TINY_VOCAB, save_tiny_tokenizer
from PIL import Image

IMAGE_TOKEN = "<image>"
# LLaVA-style template: a list content's image parts become one image token each
VLM_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'text' %}{{ p['text'] }}{% else %}<image>{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_tiny_llava(folder: Path, seed: int = 0) -> transformers.LlavaForConditionalGeneration:
    """Write a random tiny LLaVA (CLIP 32 px / patch 8: 16 image tokens) + tokenizer + image processor into
    ``folder``; returns the fp32 HF reference model."""
    tok = save_tiny_tokenizer(folder)
    tok.add_special_tokens([IMAGE_TOKEN])
    tok.save(str(folder / "tokenizer.json"))
    image_id = tok.token_to_id(IMAGE_TOKEN)
    cfg_path = folder / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg["chat_template"] = VLM_CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(tok_cfg))
    torch.manual_seed(seed)
    vision = transformers.CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
        initializer_range=0.2,
    )
    text = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=TINY_VOCAB,
        initializer_range=0.2,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
    )
    cfg = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_id)
    model = transformers.LlavaForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # CLIP's default init is tiny: make the image visibly move the logits
        for p in model.model.vision_tower.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    model.save_pretrained(folder)
    transformers.CLIPImageProcessorPil(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
    ).save_pretrained(folder)
    return model


def png(seed: int, size: tuple[int, int] = (32, 32)) -> bytes:
    """A random RGB PNG of ``size`` (width, height)."""
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


QWEN_IMAGE_TOKEN = "<|image_pad|>"
# Qwen3-VL-style template: each image part is <|vision_start|><|image_pad|><|vision_end|>
QWEN_VL_CHAT_TEMPLATE = VLM_CHAT_TEMPLATE.replace("<image>", "<|vision_start|><|image_pad|><|vision_end|>")
QWEN_PROCESSOR = {"patch_size": 8, "merge_size": 2, "temporal_patch_size": 2}
QWEN_SIZE = {"shortest_edge": 16 * 16, "longest_edge": 64 * 64}


def _qwen_vision(**extra) -> dict:
    """The tiny Qwen-VL towers' shared shape: 3 blocks of width 32, patch 8, merge 2, into width 64."""
    return {
        "depth": 3,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "patch_size": 8,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": 64,
        "initializer_range": 0.2,
        **extra,
    }


def _qwen_text(**extra) -> dict:
    """The tiny Qwen-VL text towers' shared shape: 2 layers of width 64, 4 heads (2 KV heads)."""
    return {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": TINY_VOCAB,
        "initializer_range": 0.2,
        "max_position_embeddings": 512,
        **extra,
    }


def save_tiny_qwen3vl(folder: Path, seed: int = 0) -> transformers.Qwen3VLForConditionalGeneration:
    """Write a random tiny Qwen3-VL (vision: 3 blocks of width 32, patch 8, merge 2, deepstack after blocks
    0 and 1; text: 2 Qwen3 layers of width 64, interleaved M-RoPE sections 4/2/2) + tokenizer + image
    processor settings into ``folder``; returns the fp32 HF reference model. An image of H x W pixels
    (multiples of 16) takes H/16 * W/16 tokens; at most 16 (64 x 64 pixels)."""
    tok = save_tiny_tokenizer(folder)
    tok.add_special_tokens(["<|vision_start|>", "<|vision_end|>", QWEN_IMAGE_TOKEN])
    tok.save(str(folder / "tokenizer.json"))
    cfg_path = folder / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg["chat_template"] = QWEN_VL_CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(tok_cfg))
    torch.manual_seed(seed)
    vision = _qwen_vision(num_position_embeddings=16, deepstack_visual_indexes=[0, 1])
    text = _qwen_text(
        head_dim=16,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 5000.0,
            "mrope_section": [4, 2, 2],
            "mrope_interleaved": True,
        },
    )
    cfg = transformers.Qwen3VLConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=tok.token_to_id(QWEN_IMAGE_TOKEN),
        vision_start_token_id=tok.token_to_id("<|vision_start|>"),
        vision_end_token_id=tok.token_to_id("<|vision_end|>"),
        video_token_id=TINY_VOCAB - 1,
    )
    model = transformers.Qwen3VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # make the image and its deepstack features visibly move the logits
        for p in model.model.visual.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    model.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "image_processor_type": "Qwen2VLImageProcessor",
                "do_resize": True,
                "do_rescale": True,
                "do_normalize": True,
                "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5],
                "resample": 3,
                "size": QWEN_SIZE,
                **QWEN_PROCESSOR,
            }
        )
    )
    return model


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def qwen_hf_kwargs(x: torch.Tensor, procs: list, image_token_id: int) -> dict:
    """transformers' Qwen3-VL inputs beside ``input_ids`` ``x`` ``(1, L)`` (image tokens expanded): the
    token types M-RoPE needs and our processed images' patches and grids."""
    kwargs = {"mm_token_type_ids": (x == image_token_id).int()}
    if procs:
        kwargs["pixel_values"] = torch.cat([p.pixels for p in procs])
        kwargs["image_grid_thw"] = torch.tensor([p.grid for p in procs])
    return kwargs


def save_tiny_qwen25vl(folder: Path, seed: int = 0) -> transformers.Qwen2_5_VLForConditionalGeneration:
    """Write a random tiny Qwen2.5-VL (vision: 3 blocks of width 32, patch 8, merge 2, windows of 32 px =
    2 x 2 merged tokens except block 1 with full attention; text: 2 Qwen2 layers of width 64, M-RoPE
    sections 2/3/3) with the same tokenizer and processor settings as ``save_tiny_qwen3vl``."""
    save_tiny_qwen3vl(folder, seed)  # tokenizer, template and processor; config and weights replaced below
    tok_ids = json.loads((folder / "config.json").read_text())
    torch.manual_seed(seed)
    vision = _qwen_vision(window_size=32, fullatt_block_indexes=[1])
    text = _qwen_text(
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "mrope_section": [2, 3, 3]},
        bos_token_id=None,
        eos_token_id=None,
    )
    cfg = transformers.Qwen2_5_VLConfig(
        vision_config=vision,
        text_config=text,
        **{k: tok_ids[k] for k in ("image_token_id", "vision_start_token_id", "vision_end_token_id")},
        video_token_id=TINY_VOCAB - 1,
    )
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for p in model.model.visual.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    for f in folder.glob("*.safetensors"):
        f.unlink()
    model.save_pretrained(folder)
    return model
