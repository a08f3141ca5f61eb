"""EPD embedding transfer: a language-only worker fetching image embeddings from an encoder with
``--encoder-transfer-backend mooncake`` vs ``zmq_to_scheduler``, and vs a raw TransferEngine write of the
same bytes, measured in the same run.

``python -m engine.bench.encoder_transfer [--trials 15] [--image-size 336] [--text-hidden 2048]
[--images 1 4]``

The random LLaVA of ``engine.bench.vlm`` (CLIP tower ``image-size`` px / patch 14, so 576 tokens per image at
336 px, 2 vision layers; projector and one text layer of width ``text-hidden``) is written into a temporary
folder. Two encoder workers run it (``engine.launch_server --encoder-only``, CPU), one per backend. This
process plays the language-only worker with the engine's own ``EncoderClient`` (what a ``--language-only``
worker runs), one per backend. Each case sends the same ``n`` images every trial, so after the warm-up the
encoders answer from their embedding cache and no vision tower runs: a fetch is the ``/encode`` round trip
(the pixels go up as base64 JSON, the embeddings come back by the backend, the client copies them out).

* engine: wall time of one ``EncoderClient([...])`` call, per backend, the backends alternating first;
* raw: two TransferEngines in this process (``open_transfer_engine``, the helper both sides use), each with
  a registered buffer of the embeddings' size; one ``batch_transfer_sync_write`` of those bytes, timed
  around the call.

Prints per case the medians and bests of each, the ratio zmq / mooncake of the medians (> 1: mooncake is
faster) and raw / mooncake of the bests (the share of a mooncake fetch that the raw transfer of the same
bytes would take). Also the transfer alone: the mooncake encoder's own write time per request (staging copy
+ TransferEngine write, the mean over the trials from its ``encoder_transfer_seconds_total``) against the
mean raw write, and checks that both backends delivered the same embeddings.
"""

from __future__ import annotations

import argparse
import base64
import os
import platform
import statistics
import tempfile
import time
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path

import httpx
import torch

from engine.bench.launcher import ServerProcess
from engine.bench.vlm import png, write_model
from engine.disaggregation.transport import batched_write, open_transfer_engine
from engine.model.loader import load_checkpoint
from engine.model.vlm.processor import open_image, preprocess
from engine.server.encoder_client import EncoderClient

BACKENDS = ("mooncake", "zmq_to_scheduler")


class RawPair:
    """Two TransferEngines on loopback with one registered buffer of ``nbytes`` each."""

    def __init__(self, nbytes: int) -> None:
        flag = "bench raw TransferEngine"
        self.src_engine, _ = open_transfer_engine("127.0.0.1", flag)
        self.dst_engine, self.dst_session = open_transfer_engine("127.0.0.1", flag)
        self.src = torch.randn(nbytes // 4)
        self.dst = torch.zeros(nbytes // 4)
        self.nbytes = self.src.numel() * 4
        for engine, buf in ((self.src_engine, self.src), (self.dst_engine, self.dst)):
            if engine.register_memory(buf.data_ptr(), self.nbytes) != 0:
                raise RuntimeError("could not register the raw buffers")

    def write(self) -> float:
        start = time.perf_counter()
        rc = batched_write(
            self.src_engine, self.dst_session, [self.src.data_ptr()], [self.dst.data_ptr()], [self.nbytes]
        )
        took = time.perf_counter() - start
        if rc < 0:
            raise RuntimeError(f"raw write failed (rc {rc})")
        return took

    def close(self) -> None:
        self.src_engine.unregister_memory(self.src.data_ptr())
        self.dst_engine.unregister_memory(self.dst.data_ptr())


def _sent(url: str) -> float:
    return httpx.get(f"{url}/server_info", timeout=30).json()["encoder_transfer_seconds_total"]


def run_case(clients: dict[str, EncoderClient], images: list, trials: int) -> dict:
    """Median/best seconds per backend and of the raw write, over ``trials`` (after one warm-up), and the
    mean of the mooncake encoder's own write time (``encoder_transfer_seconds_total``) and of raw."""
    seconds: dict[str, list[float]] = {b: [] for b in (*BACKENDS, "raw")}
    out = {b: clients[b](images) for b in BACKENDS}  # warm-up: encodes once, fills the encoders' caches
    for a, b in zip(out["mooncake"], out["zmq_to_scheduler"], strict=True):
        if not torch.equal(a, b):
            raise RuntimeError("the two backends delivered different embeddings")
    nbytes = sum(e.numel() * 4 for e in out["mooncake"])
    raw = RawPair(nbytes)
    url = clients["mooncake"].urls[0]
    try:
        raw.write()
        sent0 = _sent(url)
        for trial in range(trials):
            order = BACKENDS if trial % 2 == 0 else BACKENDS[::-1]
            for backend in order:
                start = time.perf_counter()
                clients[backend](images)
                seconds[backend].append(time.perf_counter() - start)
            seconds["raw"].append(raw.write())
        write_mean = (_sent(url) - sent0) / trials
    finally:
        raw.close()
    med = {k: statistics.median(v) for k, v in seconds.items()}
    best = {k: min(v) for k, v in seconds.items()}
    raw_mean = statistics.mean(seconds["raw"])
    return {
        "images": len(images),
        "MiB": nbytes / 2**20,
        "med": med,
        "best": best,
        "write": write_mean,
        "raw_mean": raw_mean,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=15)
    ap.add_argument("--image-size", type=int, default=336)
    ap.add_argument("--text-hidden", type=int, default=2048)
    ap.add_argument("--images", type=int, nargs="+", default=[1, 4])
    args = ap.parse_args(argv)
    limit = ["--limit-mm-data-per-request", f'{{"image": {max(args.images)}}}']
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        folder = Path(tmp)
        write_model(folder, args.image_size, 2, text_hidden=args.text_hidden, text_layers=1)
        vlm = load_checkpoint(folder).vlm
        clients = {}
        for backend in BACKENDS:
            flags = ["--model-path", str(folder), "--encoder-only", "--encoder-transfer-backend", backend]
            enc = stack.enter_context(ServerProcess([*flags, *limit], timeout=600))
            clients[backend] = EncoderClient([enc.url], vlm, backend=backend, max_images=max(args.images))
        rows = []
        for n in args.images:
            images = []
            for i in range(n):
                data = base64.b64decode(png(1000 * n + i, args.image_size).split(",", 1)[1])
                images.append(preprocess(open_image(data, 1 << 30), vlm.processor))
            rows.append(run_case(clients, images, args.trials))
        leftover = clients["mooncake"].transfer_stats()
    print(f"# KVFleet EPD embedding transfer benchmark, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC")
    print(
        f"host: {platform.node()}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}; Mooncake TransferEngine over TCP loopback; {args.image_size} px images, "
        f"{vlm.vision.tokens_per_image} tokens x {args.text_hidden} float32 per image; {args.trials} trials"
    )
    print(
        "\n| images | embeddings MiB | mooncake ms p50 (best) | zmq_to_scheduler ms p50 (best) "
        "| raw TE ms p50 (best) | zmq / mooncake (p50) | raw / mooncake (best) "
        "| encoder write ms (mean) | raw TE ms (mean) | raw / encoder write (mean) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        med, best = r["med"], r["best"]
        cells = [str(r["images"]), f"{r['MiB']:.1f}"]
        cells += [f"{med[k] * 1e3:.1f} ({best[k] * 1e3:.1f})" for k in (*BACKENDS, "raw")]
        cells += [f"{med['zmq_to_scheduler'] / med['mooncake']:.2f}", f"{best['raw'] / best['mooncake']:.2f}"]
        cells += [
            f"{r['write'] * 1e3:.1f}",
            f"{r['raw_mean'] * 1e3:.1f}",
            f"{r['raw_mean'] / r['write']:.2f}",
        ]
        print("| " + " | ".join(cells) + " |")
    print(f"\nreceive slots after the run: {leftover}")


if __name__ == "__main__":
    main()
