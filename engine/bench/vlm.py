"""TTFT of an image request whose image was seen before (embedding cache and prefix KV hit) vs a new image
(vision tower + prefill of the image tokens), on one worker, measured in the same run.

``python -m engine.bench.vlm [--requests 12] [--image-size 224] [--vision-layers 6] [--mm-global-cache]``

A random LLaVA (CLIP tower ``image-size`` px / patch 14, ``vision-layers`` layers of width 384; a 4-layer
Llama text tower of width 256) is written with transformers into a temporary folder and served by
``engine.launch_server`` (CPU, float32). TTFT is the client's: the wall time of a ``/generate`` with
``max_new_tokens`` 1 (image decoding, the vision tower and the prefill all fall inside it). Miss: a new
random image each request; hit: one image repeated (after one warm-up request). Requests alternate miss /
hit; printed: median TTFT of each and the ratio miss / hit.

``--mm-global-cache`` (EPD): a ``mooncake_master``, two ``--encoder-only --enable-mm-global-cache`` workers
(Mooncake over TCP) and a ``--language-only`` worker whose only encoder is the second one. The first
encoder (the seeder) encodes ``requests`` images first, as a language-only worker would ask it, so their
embeddings are in Mooncake but never in the measured encoder's LRU. Then, ``requests`` rounds of one request
per kind, order rotating: ``miss`` a new image (store lookup misses, vision tower, background write),
``global`` a seeded image (found in Mooncake, no vision tower), ``local`` one image the measured encoder
already holds in its LRU. Each prompt starts with its own text, so the worker's prefix cache holds none of
its image tokens (the most cached tokens of each kind is printed); each request waits for the encoder's
background write of the one before. Printed: median TTFT per kind, miss / global and global / local, and
the measured encoder's counter deltas (``mm_global_cache_hits`` must equal ``requests``), with a warning
when the counters do not match the kinds.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import torch
import transformers
import zmq
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


def generate(url: str, image: str, text: str = f"describe {IMAGE} the picture") -> tuple[float, dict]:
    """One ``/generate`` of ``text`` with ``image`` (a data URL), 1 token out: (TTFT in s, its meta_info)."""
    body = {"text": text, "image_data": image, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    start = time.perf_counter()
    resp = httpx.post(f"{url}/generate", json=body, timeout=300)
    resp.raise_for_status()
    return time.perf_counter() - start, resp.json().get("meta_info", {})


def ttft(url: str, image: str) -> float:
    return generate(url, image)[0]


KINDS = ("miss", "global", "local")
MOONCAKE_ENV = {
    "MOONCAKE_PROTOCOL": "tcp",
    "MOONCAKE_GLOBAL_SEGMENT_SIZE": "64mb",
    "MOONCAKE_LOCAL_BUFFER_SIZE": "16mb",
}


def _encoder_info(url: str) -> dict:
    return httpx.get(f"{url}/server_info", timeout=30).json()


def encode_body(image, rid: str, receiver: str) -> dict:
    """The ``/encode`` request of an encoder-only worker for one preprocessed ``image``, whose embeddings go
    to the ZMQ ``receiver`` URL under request id ``rid``."""
    px = image.pixels
    return {
        "rid": rid,
        "receiver": receiver,
        "images": [
            {
                "digest": image.digest,
                "shape": list(px.shape),
                "pixels": base64.b64encode(px.numpy().tobytes()).decode(),
            }
        ],
    }


class Receiver:
    """A ZMQ PULL socket on a free local port counting the embedding messages per request id."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PULL)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.url = f"tcp://127.0.0.1:{port}"
        self.got: set[str] = set()
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop:
            if poller.poll(100):
                rid, _header, _data = self.sock.recv_multipart()
                self.got.add(rid.decode())

    def close(self) -> None:
        self._stop = True
        self._thread.join()
        self.sock.close(0)
        self.ctx.term()


def wait_written(url: str, timeout: float = 60.0) -> dict:
    """Poll encoder ``url`` until every image it encoded is in the global cache (``mm_global_cache_writes``
    equals ``images_encoded``); its ``/server_info``. Raises ``RuntimeError`` on a failed or dropped write
    or past ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        info = _encoder_info(url)
        if info["mm_global_cache_errors"] or info["mm_global_cache_dropped_writes"]:
            raise RuntimeError(f"encoder {url}: global cache write failed: {info}")
        if info["mm_global_cache_writes"] >= info["images_encoded"]:
            return info
        if time.monotonic() > deadline:
            raise RuntimeError(f"encoder {url}: writes not done after {timeout} s: {info}")
        time.sleep(0.02)


def seed(encoder: str, folder: Path, images: list[str]) -> None:
    """Have ``encoder`` (an ``--encoder-only`` worker with the global cache) encode ``images`` (data URLs)
    as a language-only worker would ask it, so their embeddings land in Mooncake; returns once written."""
    from engine.model.loader import load_checkpoint
    from engine.model.vlm.processor import open_image, preprocess

    processor = load_checkpoint(folder).vlm.processor
    receiver = Receiver()
    try:
        for i, url in enumerate(images):
            image = preprocess(open_image(base64.b64decode(url.split(",", 1)[1]), 1 << 30), processor)
            resp = httpx.post(
                f"{encoder}/encode", json=encode_body(image, f"seed-{i}", receiver.url), timeout=600
            )
            resp.raise_for_status()
    finally:
        receiver.close()
    wait_written(encoder)


def global_trials(worker: str, encoder: str, requests: int, size: int, seeded: list[str]) -> dict:
    """``requests`` rounds of one request per kind, the kinds' order rotating: ``miss`` a new image (store
    lookup misses, vision tower, background write), ``global`` an image another encoder wrote to the store,
    ``local`` one image ``encoder`` already holds in its LRU. Every prompt starts with its own text, so the
    worker's prefix cache never holds its image tokens. After each request the encoder's writes are waited
    for, so no background write overlaps the next one. Returns per kind the TTFTs (s) and cached tokens,
    the encoder's counter deltas over the rounds and the 1-min load average before and after them."""
    local = png(2 * 10**6, size)
    generate(worker, local, f"warm-local {IMAGE} the picture")
    generate(worker, png(2 * 10**6 + 1, size), f"warm-miss {IMAGE} the picture")
    wait_written(encoder)
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    cached: dict[str, list[int]] = {k: [] for k in KINDS}
    before, load = _encoder_info(encoder), os.getloadavg()[0]
    for i in range(requests):
        images = {"miss": png(3 * 10**6 + i, size), "global": seeded[i], "local": local}
        for k in KINDS[i % 3 :] + KINDS[: i % 3]:
            t, meta = generate(worker, images[k], f"{i:03d} {k} {IMAGE} the picture")
            times[k].append(t)
            cached[k].append(int(meta.get("cached_tokens", 0)))
            wait_written(encoder)
    after = _encoder_info(encoder)
    keys = ("mm_global_cache_hits", "mm_global_cache_misses", "images_encoded", "mm_embedding_cache_hits")
    delta = {k: after[k] - before[k] for k in keys}
    return {"times": times, "cached": cached, "delta": delta, "load": (load, os.getloadavg()[0])}


def run_global(args: argparse.Namespace, folder: Path) -> dict:
    """Mooncake master, a seeding encoder, the measured encoder (both ``--enable-mm-global-cache``) and a
    language-only worker pointed at the measured encoder only; the trials of :func:`global_trials`."""
    from engine.fleet.mooncake_master import MooncakeMaster

    base = ["--model-path", str(folder), "--page-size", "1"]
    enc_flags = [*base, "--encoder-only", "--enable-mm-global-cache"]
    with MooncakeMaster() as master:
        env = {**MOONCAKE_ENV, "MOONCAKE_MASTER": master.master_address}
        env["MOONCAKE_TE_META_DATA_SERVER"] = master.metadata_url
        with (
            ServerProcess(enc_flags, timeout=600, env=env) as seeder,
            ServerProcess(enc_flags, timeout=600, env=env) as encoder,
            ServerProcess([*base, "--language-only", "--encoder-urls", encoder.url], timeout=600) as worker,
        ):
            seeded = [png(4 * 10**6 + i, args.image_size) for i in range(args.requests)]
            seed(seeder.url, folder, seeded)
            return global_trials(worker.url, encoder.url, args.requests, args.image_size, seeded)


def print_global(args: argparse.Namespace, r: dict) -> None:
    med = {k: statistics.median(v) * 1e3 for k, v in r["times"].items()}
    print(
        f"image {args.image_size}px ({(args.image_size // 14) ** 2} image tokens), vision layers "
        f"{args.vision_layers}, {args.requests} requests each, cores {os.cpu_count()}, "
        f"1-min load average {r['load'][0]:.2f} at the first request, {r['load'][1]:.2f} after the last"
    )
    labels = {
        "miss": "miss   (new image: encode + store write)",
        "global": "global (hit in Mooncake, not in LRU)",
        "local": "local  (hit in the encoder's LRU)",
    }
    for k in KINDS:
        print(f"TTFT {labels[k]:42s} median {med[k]:8.1f} ms  (max cached tokens {max(r['cached'][k])})")
    print(f"ratio miss / global hit     {med['miss'] / med['global']:8.2f}x")
    print(f"ratio global / local hit    {med['global'] / med['local']:8.2f}x")
    d = r["delta"]
    print(
        f"measured encoder over the trials: mm_global_cache_hits +{d['mm_global_cache_hits']}, "
        f"mm_global_cache_misses +{d['mm_global_cache_misses']}, images_encoded +{d['images_encoded']}, "
        f"mm_embedding_cache_hits +{d['mm_embedding_cache_hits']}"
    )
    n = args.requests
    want = {"mm_global_cache_hits": n, "images_encoded": n, "mm_embedding_cache_hits": n}
    if any(d[k] != v for k, v in want.items()):
        print(f"WARNING: counters differ from {want}: the kinds were not what they claim")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--vision-layers", type=int, default=6)
    ap.add_argument("--mm-global-cache", action="store_true", help="EPD: Mooncake embedding hit vs miss")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_model(folder, args.image_size, args.vision_layers)
        if args.mm_global_cache:
            print_global(args, run_global(args, folder))
            return
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
