"""Test-only helpers for vision-language models: a tiny random LLaVA checkpoint (CLIP tower, 32 px images,
2 vision layers, 2 text layers) that transformers writes, and PNG images."""

from __future__ import annotations

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
