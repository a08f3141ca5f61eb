"""TTFT of an image request whose image was seen before (embedding cache and prefix KV hit) vs a new image
(vision tower + prefill of the image tokens), on one worker, measured in the same run.

``python -m engine.bench.vlm [--requests 12] [--image-size 224] [--vision-layers 6]``

A random LLaVA (CLIP tower ``image-size`` px / patch 14, ``vision-layers`` layers of width 384; a 4-layer
Llama text tower of width 256) is written with transformers into a temporary folder and served by
``engine.launch_server`` (CPU, float32). TTFT is the client's: the wall time of a ``/generate`` with
``max_new_tokens`` 1 (image decoding, the vision tower and the prefill all fall inside it). Miss: a new
random image each request; hit: one image repeated (after one warm-up request). Requests alternate miss /
hit; printed: median TTFT of each and the ratio miss / hit.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import torch
import transformers
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engine.bench.launcher import ServerProcess

IMAGE = "<image>"
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def write_model(
    folder: Path, image_size: int, vision_layers: int, text_hidden: int = 256, text_layers: int = 4
) -> None:
    """A random LLaVA + byte-level BPE tokenizer (with the image token) + CLIP image processor; the text
    tower is ``text_layers`` Llama layers of width ``text_hidden`` (the projector's output width)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["describe the picture in a few words please"] * 20, trainer)
    tok.add_special_tokens([IMAGE])
    tok.save(str(folder / "tokenizer.json"))
    cfg_tok = {"chat_template": TEMPLATE, "eos_token": "<|endoftext|>", "bos_token": None}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg_tok))
    vision = transformers.CLIPVisionConfig(
        hidden_size=384,
        intermediate_size=1536,
        num_hidden_layers=vision_layers,
        num_attention_heads=6,
        image_size=image_size,
        patch_size=14,
    )
    text = transformers.LlamaConfig(
        hidden_size=text_hidden,
        intermediate_size=4 * text_hidden if text_hidden <= 256 else text_hidden,
        num_hidden_layers=text_layers,
        num_attention_heads=max(4, text_hidden // 64),
        num_key_value_heads=2,
        vocab_size=tok.get_vocab_size(),
        max_position_embeddings=2048,
    )
    cfg = transformers.LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=tok.token_to_id(IMAGE)
    )
    torch.manual_seed(0)
    transformers.LlavaForConditionalGeneration(cfg).save_pretrained(folder)
    transformers.CLIPImageProcessorPil(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    ).save_pretrained(folder)


def png(seed: int, size: int) -> str:
    arr = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def ttft(url: str, image: str) -> float:
    body = {
        "text": f"describe {IMAGE} the picture",
        "image_data": image,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
    }
    start = time.perf_counter()
    resp = httpx.post(f"{url}/generate", json=body, timeout=300)
    resp.raise_for_status()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--vision-layers", type=int, default=6)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_model(folder, args.image_size, args.vision_layers)
        with ServerProcess(["--model-path", str(folder), "--page-size", "1"], timeout=600) as server:
            same = png(0, args.image_size)
            ttft(server.url, same)  # warm-up: the repeated image is now cached
            ttft(server.url, png(10**6, args.image_size))  # warm-up of the miss path
            miss, hit = [], []
            for i in range(args.requests):
                miss.append(ttft(server.url, png(i + 1, args.image_size)))
                hit.append(ttft(server.url, same))
    m, h = statistics.median(miss) * 1e3, statistics.median(hit) * 1e3
    tokens = (args.image_size // 14) ** 2
    print(
        f"image {args.image_size}px ({tokens} image tokens), vision layers {args.vision_layers}, "
        f"{args.requests} requests each"
    )
    print(f"TTFT miss (new image)      median {m:8.1f} ms")
    print(f"TTFT hit  (same image)     median {h:8.1f} ms")
    print(f"ratio miss / hit           {m / h:8.2f}x")


if __name__ == "__main__":
    main()
