"""EPD encoder scale-out: images/s of one ``--encoder-only`` worker vs two on the same image stream.

``python -m engine.bench.encoder_scaleout [--images 48] [--concurrency 4] [--image-size 224]
[--vision-layers 6] [--torch-threads N]``

The random LLaVA of ``engine.bench.vlm`` (CLIP tower ``image-size`` px / patch 14, ``vision-layers`` layers
of width 384) is written into a temporary folder and served by ``engine.launch_server --encoder-only``
(CPU, float32). The bench plays the language-only prefill worker: it prepares the images as a worker does
(the checkpoint's processor), binds a ZMQ PULL socket as the receiver and sends ``POST /encode`` with one
image each, ``concurrency`` requests in flight, taking the encoders in turn as a language-only worker does.
Every image is new (no embedding cache hit). A request counts when its HTTP answer came back (the encoder
answers after it pushed the embeddings); the receiver checks that every image's embeddings arrived.
Printed per run: images/s over the stream (after one warm-up image per encoder), each encoder's share of
the images and its vision-tower busy share (encode seconds over the run's wall time, from
``/server_info``), and the ratio 2 encoders / 1. ``--torch-threads N`` sets ``OMP_NUM_THREADS`` of every
encoder (default: torch's own choice, all cores per encoder). The machine's core count is printed: two
encoders on the cores one encoder already uses compete for them, so the ratio says what the hardware
allows, not what a second device would add.
"""

from __future__ import annotations

import argparse
import base64
import itertools
import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx

from engine.bench.launcher import ServerProcess
from engine.bench.vlm import Receiver, encode_body, write_model
from engine.model.loader import load_checkpoint
from engine.model.vlm.processor import open_image, preprocess


def run(encoders: list[str], images: list, receiver: Receiver, concurrency: int, tag: str) -> dict:
    """Send ``images`` (one per request) over ``encoders`` in turn; images/s and per-encoder figures."""
    info0 = [httpx.get(f"{u}/server_info", timeout=30).json() for u in encoders]
    turn = itertools.cycle(range(len(encoders)))
    lock = threading.Lock()

    def one(i: int) -> None:
        with lock:
            k = next(turn)
        rid = f"{tag}-{i}"
        resp = httpx.post(
            f"{encoders[k]}/encode", json=encode_body(images[i], rid, receiver.url), timeout=600
        )
        resp.raise_for_status()

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(len(images))))
    wall = time.perf_counter() - start
    info1 = [httpx.get(f"{u}/server_info", timeout=30).json() for u in encoders]
    missing = [f"{tag}-{i}" for i in range(len(images)) if f"{tag}-{i}" not in receiver.got]
    deadline = time.monotonic() + 30
    while missing and time.monotonic() < deadline:  # the PULL thread may still be draining
        time.sleep(0.05)
        missing = [r for r in missing if r not in receiver.got]
    if missing:
        raise RuntimeError(f"{len(missing)} embeddings never arrived, e.g. {missing[0]}")
    encoded = [b["images_encoded"] - a["images_encoded"] for a, b in zip(info0, info1, strict=True)]
    seconds = [
        b["encode_seconds_total"] - a["encode_seconds_total"] for a, b in zip(info0, info1, strict=True)
    ]
    busy = [s / wall for s in seconds]
    return {"images_per_s": len(images) / wall, "wall_s": wall, "encoded": encoded, "busy": busy}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--vision-layers", type=int, default=6)
    ap.add_argument("--torch-threads", type=int, default=None)
    args = ap.parse_args()
    env = {"OMP_NUM_THREADS": str(args.torch_threads)} if args.torch_threads else None
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_model(folder, args.image_size, args.vision_layers)
        processor = load_checkpoint(folder).vlm.processor
        from engine.bench.vlm import png

        def image(seed: int):
            data = base64.b64decode(png(seed, args.image_size).split(",", 1)[1])
            return preprocess(open_image(data, 1 << 30), processor)

        streams = {n: [image(n * 100_000 + i) for i in range(args.images)] for n in (1, 2)}
        receiver = Receiver()
        results = {}
        try:
            for n in (1, 2):
                with ExitStack() as stack:
                    flags = ["--model-path", str(folder), "--encoder-only"]
                    servers = [
                        stack.enter_context(ServerProcess(flags, timeout=600, env=env)) for _ in range(n)
                    ]
                    urls = [s.url for s in servers]
                    for k, u in enumerate(urls):  # warm-up: one image each, not counted
                        warm = encode_body(image(10**7 + 10 * n + k), f"warm-{n}-{k}", receiver.url)
                        httpx.post(f"{u}/encode", json=warm, timeout=600).raise_for_status()
                    results[n] = run(urls, streams[n], receiver, args.concurrency, f"run{n}")
        finally:
            receiver.close()
    print(
        f"cores {os.cpu_count()}, torch threads per encoder {args.torch_threads or 'default'}, "
        f"image {args.image_size}px, vision layers {args.vision_layers}, {args.images} new images, "
        f"concurrency {args.concurrency}"
    )
    for n, r in results.items():
        per = ", ".join(f"{e} images busy {b:.0%}" for e, b in zip(r["encoded"], r["busy"], strict=True))
        print(f"{n} encoder(s): {r['images_per_s']:7.2f} images/s ({r['wall_s']:.1f} s; {per})")
    print(f"ratio 2 / 1 encoders       {results[2]['images_per_s'] / results[1]['images_per_s']:7.2f}x")


if __name__ == "__main__":
    main()
