"""EPD encoder worker (``--encoder-only``): the vision tower and projector of a LLaVA checkpoint, no language
model, no KV. ``POST /encode`` takes a request's processed images and pushes their embeddings over ZMQ to the
receiver the language-only worker named (``zmq_to_scheduler``); the HTTP answer follows once they are sent.

Body: ``{"rid": str, "receiver": "tcp://host:port", "images": [{"digest": hex, "shape": [C, H, W],
"pixels": base64 of float32 C-order}]}``. ZMQ message (multipart): ``rid``, a JSON header ``{"shape":
[N, tokens, hidden], "dtype": "float32", "digests": [...]}``, the embeddings' bytes. A digest that does not
match its pixels (the two workers' processor settings or code differ) is a 400.
Also ``/health``, ``/server_info`` (``images_encoded``, ``encode_seconds_total``, embedding cache hits and
misses), ``/model_info`` and ``/metrics`` (the same counters in Prometheus text, ``model_name`` label:
``sglang:encoder_images_total``, ``sglang:encoder_encode_seconds_total``,
``sglang:mm_embedding_cache_hits_total``, ``sglang:mm_embedding_cache_misses_total``). With
``--enable-mm-global-cache`` embeddings are also looked up in and written to a shared Mooncake store
(:mod:`engine.server.mm_global_cache`), with its counters beside these (``mm_global_cache_*``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import json
import logging
import threading
import time

import numpy as np
import torch
import zmq
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from engine.cache.storage.base import StorageConfigError, StorageError
from engine.model.loader import load_checkpoint
from engine.model.runner import _parse_dtype
from engine.model.vlm.clip import VisionEncoder
from engine.model.vlm.processor import ProcessedImage
from engine.server.args import ArgumentError, ServerArgs
from engine.server.http_utils import HTTPError, error_response
from engine.server.images import EmbeddingCache, local_embedder
from engine.server.mm_global_cache import MMGlobalCache

log = logging.getLogger(__name__)


class EncoderService:
    """The vision tower of ``args.model_path`` with its embedding cache and counters."""

    def __init__(self, args: ServerArgs) -> None:
        ckpt = load_checkpoint(args.model_path)
        if ckpt.vlm is None:
            raise ArgumentError(f"--encoder-only: {args.model_path} is not a vision-language model")
        dtype = args.dtype if args.dtype != "auto" else ("float32" if args.device == "cpu" else "bfloat16")
        self.args, self.vlm = args, ckpt.vlm
        self.encoder = VisionEncoder(
            ckpt.vlm.vision,
            ckpt.vision_tensors,
            ckpt.projector_tensors,
            _parse_dtype(dtype),
            torch.device(args.device),
            ckpt.path,
        )
        self.cache = EmbeddingCache(args.mm_embedding_cache_size)
        self.global_cache = None
        if args.enable_mm_global_cache:
            try:
                self.global_cache, cfg = MMGlobalCache.connect(self.vlm.digest())
            except (StorageConfigError, StorageError) as exc:
                raise ArgumentError(f"--enable-mm-global-cache: {exc}") from exc
            log.info("mm global cache: Mooncake master %s (%s)", cfg.master_server_address, cfg.source)
        self.embed = local_embedder(self._encode, self.cache, self.global_cache)
        self.images_encoded = 0
        self.encode_seconds = 0.0
        self._lock = threading.Lock()
        self._ctx = zmq.Context.instance()
        self._sockets: dict[str, zmq.Socket] = {}

    def _encode(self, pixels: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        out = self.encoder.encode(pixels).float().cpu()
        with self._lock:
            self.images_encoded += pixels.shape[0]
            self.encode_seconds += time.perf_counter() - start
        return out

    def handle(self, body: dict) -> dict:
        """Encode one request's images and push them to its receiver; raises ``HTTPError(400)``."""
        rid, receiver, raw = body.get("rid"), body.get("receiver"), body.get("images")
        if not isinstance(rid, str) or not isinstance(receiver, str) or not receiver.startswith("tcp://"):
            raise HTTPError(400, "rid and receiver (tcp://host:port) are required")
        if not isinstance(raw, list) or not raw:
            raise HTTPError(400, "images: a non-empty list")
        images = [_image(i, item) for i, item in enumerate(raw)]
        embeds = torch.stack(self.embed(images)).float().contiguous()
        header = {"shape": list(embeds.shape), "dtype": "float32", "digests": [p.digest for p in images]}
        with self._lock:  # one PUSH socket per receiver, used by one thread at a time
            sock = self._sockets.get(receiver)
            if sock is None:
                sock = self._sockets[receiver] = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDTIMEO, 5000)
                sock.connect(receiver)
            try:
                sock.send_multipart([rid.encode(), json.dumps(header).encode(), embeds.numpy().tobytes()])
            except zmq.Again:
                raise HTTPError(503, f"receiver {receiver} did not take the embeddings within 5 s") from None
        return {"rid": rid, "images": len(images)}

    def metrics_text(self) -> str:
        """The counters of ``info`` in Prometheus text format."""
        name = self.args.model_name.replace("\\", "\\\\").replace('"', '\\"')
        lines = []
        for metric, value, help_text in (
            ("sglang:encoder_images_total", self.images_encoded, "Images run through the vision tower"),
            ("sglang:encoder_encode_seconds_total", self.encode_seconds, "Seconds spent in the vision tower"),
            (
                "sglang:mm_embedding_cache_hits_total",
                self.cache.hits,
                "Images served from the embedding cache",
            ),
            (
                "sglang:mm_embedding_cache_misses_total",
                self.cache.misses,
                "Images not in the embedding cache",
            ),
            *self._global_counters(),
        ):
            lines += [
                f"# HELP {metric} {help_text}",
                f"# TYPE {metric} counter",
                f'{metric}{{model_name="{name}"}} {value}',
            ]
        return "\n".join(lines) + "\n"

    def _global_counters(self) -> list[tuple[str, int, str]]:
        g = self.global_cache
        if g is None:
            return []
        return [
            ("sglang:mm_global_cache_hits_total", g.hits, "Images found in the Mooncake embedding cache"),
            ("sglang:mm_global_cache_misses_total", g.misses, "Images not in the Mooncake embedding cache"),
            ("sglang:mm_global_cache_writes_total", g.writes, "Embeddings written to the Mooncake cache"),
            ("sglang:mm_global_cache_errors_total", g.errors, "Mooncake embedding cache errors and timeouts"),
            ("sglang:mm_global_cache_corrupt_total", g.corrupt, "Entries failing their checksum (misses)"),
            ("sglang:mm_global_cache_dropped_writes_total", g.dropped_writes, "Writes dropped (queue full)"),
        ]

    def info(self) -> dict:
        g = self.global_cache
        return {
            "enable_mm_global_cache": g is not None,
            **(
                {}
                if g is None
                else {
                    f"mm_global_cache_{k}": getattr(g, k)
                    for k in ("hits", "misses", "writes", "errors", "corrupt", "dropped_writes")
                }
            ),
            "encoder_only": True,
            "model_path": self.args.model_path,
            "encoder_transfer_backend": self.args.encoder_transfer_backend,
            "images_encoded": self.images_encoded,
            "encode_seconds_total": round(self.encode_seconds, 6),
            "mm_embedding_cache_hits": self.cache.hits,
            "mm_embedding_cache_misses": self.cache.misses,
            "tokens_per_image": self.vlm.vision.tokens_per_image,
            "vision_digest": self.vlm.digest(),
        }


def _image(i: int, item: object) -> ProcessedImage:
    field = f"images.{i}"
    if not isinstance(item, dict):
        raise HTTPError(400, f"{field}: expected an object")
    try:
        data = base64.b64decode(item["pixels"], validate=True)
        shape = tuple(int(x) for x in item["shape"])
        pixels = torch.from_numpy(np.frombuffer(data, dtype=np.float32).reshape(shape).copy())
    except (KeyError, TypeError, ValueError, binascii.Error) as exc:
        raise HTTPError(400, f"{field}: bad pixels ({exc})") from None
    digest = hashlib.sha256(pixels.numpy().tobytes()).hexdigest()
    if digest != item.get("digest"):
        raise HTTPError(400, f"{field}.digest does not match its pixels")
    return ProcessedImage(pixels, digest)


def create_encoder_app(service: EncoderService) -> FastAPI:
    app = FastAPI(title="KVFleet encoder worker", docs_url=None, redoc_url=None)

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, exc: HTTPError):
        return error_response(exc.status, exc.message, exc.param)

    @app.get("/health")
    async def health():
        return JSONResponse({})

    @app.get("/server_info")
    async def server_info():
        return JSONResponse(service.info())

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(service.metrics_text(), media_type="text/plain; version=0.0.4")

    @app.get("/model_info")
    async def model_info():
        return JSONResponse(
            {"model_path": service.args.model_path, "is_generation": False, "encoder_only": True}
        )

    @app.post("/encode")
    async def encode(request: Request):
        try:
            body = json.loads(await request.body())
        except ValueError:
            raise HTTPError(400, "body: not valid JSON") from None
        if not isinstance(body, dict):
            raise HTTPError(400, "body: expected a JSON object")
        return JSONResponse(await asyncio.to_thread(service.handle, body))

    return app
