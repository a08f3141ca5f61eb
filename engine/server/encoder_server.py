"""EPD encoder worker (``--encoder-only``): the vision tower (and projector) of a LLaVA or Qwen3-VL
checkpoint, no language model, no KV. ``POST /encode`` takes a request's processed images and delivers
their embeddings by the encoder's ``--encoder-transfer-backend``; the HTTP answer follows once they are
delivered.

Body: ``{"rid": str, "transfer_backend": "zmq_to_scheduler" | "mooncake" (absent: zmq_to_scheduler),
"images": [{"digest": hex, "shape": [C, H, W], "pixels": base64 of float32 C-order}]}`` (Qwen3-VL: shape
``[patches, patch_dim]`` and ``"grid": [t, rows, cols]``) plus, by backend:

* ``zmq_to_scheduler``: ``"receiver": "tcp://host:port"``; the ZMQ message (multipart) is ``rid``, a JSON
  header ``{"shape": [total_tokens, embed_dim], "tokens": [per image], "dtype": "float32", "digests":
  [...]}``, the embeddings' bytes (every image's rows, one image after the other);
  the answer is ``{"rid", "images", "transfer_backend"}``.
* ``mooncake``: ``"transfer": {"session_id", "addr", "capacity", "deadline"}`` (the worker's registered
  receive slot, :mod:`engine.server.encoder_transfer`); the embeddings (float32, C order) are written there
  by the TransferEngine and the answer adds the header's ``shape``, ``dtype`` and ``digests``.

A ``transfer_backend`` other than this encoder's is a 400 naming ``--encoder-transfer-backend``; a digest
that does not match its pixels (the two workers' processor settings or code differ) is a 400; embeddings
larger than ``capacity`` a 400; a ``deadline`` passed before the write a 504 (nothing written).
Also ``/health``, ``/server_info`` (``images_encoded``, ``encode_seconds_total``, embedding cache hits and
misses, ``encoder_transfer_seconds_total`` / ``_bytes_total``: time and bytes handed to the backend,
``encoder_transfer_buffers``: the mooncake staging slots), ``/model_info`` and ``/metrics`` (the image
and cache counters in Prometheus text, ``model_name`` label:
``sglang:encoder_images_total``, ``sglang:encoder_encode_seconds_total``,
``sglang:mm_embedding_cache_hits_total``, ``sglang:mm_embedding_cache_misses_total``). With
``--enable-mm-global-cache`` embeddings are also looked up in and written to a shared Mooncake store
(:mod:`engine.server.mm_global_cache`), with its counters beside these (``mm_global_cache_*``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
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
from engine.disaggregation.base import TransferBackendError
from engine.model.loader import load_checkpoint
from engine.model.runner import _parse_dtype
from engine.model.vlm.processor import ProcessedImage, image_digest
from engine.model.vlm.towers import make_vision_encoder
from engine.server.args import ArgumentError, ServerArgs
from engine.server.encoder_transfer import EmbeddingSender
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
        self.encoder = make_vision_encoder(ckpt, _parse_dtype(dtype), torch.device(args.device))
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
        self.transfer_seconds = 0.0  # time handing embeddings to the backend (see info())
        self.transfer_bytes = 0
        self._lock = threading.Lock()
        self._ctx: zmq.Context = zmq.Context.instance()
        self._sockets: dict[str, zmq.Socket] = {}
        self.sender: EmbeddingSender | None = None
        if args.encoder_transfer_backend == "mooncake":
            vision = self.vlm.vision
            per_request = args.max_images_per_request * vision.max_tokens_per_image * vision.embed_dim * 4
            host = args.host if args.host not in ("0.0.0.0", "::") else "127.0.0.1"
            try:
                self.sender = EmbeddingSender(host, max(per_request, 4 * vision.embed_dim))
            except TransferBackendError as exc:
                raise ArgumentError(str(exc)) from exc

    def _encode(self, images: list[ProcessedImage]) -> list[torch.Tensor]:
        start = time.perf_counter()
        out = [e.float().cpu() for e in self.encoder.encode_images(images)]
        with self._lock:
            self.images_encoded += len(images)
            self.encode_seconds += time.perf_counter() - start
        return out

    def handle(self, body: dict) -> dict:
        """Encode one request's images and deliver them by this encoder's ``--encoder-transfer-backend``;
        raises ``HTTPError`` (400 for a bad body or a backend other than this encoder's)."""
        backend = self.args.encoder_transfer_backend
        asked = body.get("transfer_backend", "zmq_to_scheduler")
        if asked != backend:
            raise HTTPError(
                400,
                f"--encoder-transfer-backend mismatch: this encoder runs {backend}, the language-only worker "
                f"asked for {asked!r}; start the encoders and the language-only workers with the same "
                "--encoder-transfer-backend",
            )
        rid, raw = body.get("rid"), body.get("images")
        if not isinstance(rid, str):
            raise HTTPError(400, "rid: a string is required")
        target = _mooncake_target(body) if backend == "mooncake" else _zmq_receiver(body)
        if not isinstance(raw, list) or not raw:
            raise HTTPError(400, "images: a non-empty list")
        images = [_image(i, item) for i, item in enumerate(raw)]
        try:
            parts = self.embed(images)
        except ValueError as exc:  # pixels that do not fit their grid
            raise HTTPError(400, f"images: {exc}") from None
        embeds = torch.cat(parts).float().contiguous()
        header = {
            "shape": list(embeds.shape),
            "tokens": [e.shape[0] for e in parts],
            "dtype": "float32",
            "digests": [p.digest for p in images],
        }
        start = time.perf_counter()
        if isinstance(target, dict):
            self._send_mooncake(target, embeds)
        else:
            self._push(target, rid, header, embeds)
        with self._lock:
            self.transfer_seconds += time.perf_counter() - start
            self.transfer_bytes += embeds.numel() * embeds.element_size()
        answer = {"rid": rid, "images": len(images), "transfer_backend": backend}
        return {**answer, **header} if isinstance(target, dict) else answer

    def _push(self, receiver: str, rid: str, header: dict, embeds: torch.Tensor) -> None:
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

    def _send_mooncake(self, target: dict, embeds: torch.Tensor) -> None:
        nbytes = embeds.numel() * embeds.element_size()
        if nbytes > target["capacity"]:
            raise HTTPError(
                400, f"transfer.capacity: {target['capacity']} bytes, the embeddings take {nbytes}"
            )
        if time.time() > target["deadline"]:  # the worker may have given this slot to another request
            raise HTTPError(504, "transfer.deadline passed before the embeddings were ready; nothing written")
        assert self.sender is not None
        try:
            self.sender.send(embeds, target["session_id"], target["addr"])
        except (TimeoutError, RuntimeError) as exc:
            raise HTTPError(503, f"mooncake embedding transfer to {target['session_id']}: {exc}") from None

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
            "encoder_transfer_buffers": None if self.sender is None else self.sender.pool.stats(),
            "images_encoded": self.images_encoded,
            "encode_seconds_total": round(self.encode_seconds, 6),
            # mooncake: staging copy + TransferEngine write, done; zmq_to_scheduler: queueing the message
            "encoder_transfer_seconds_total": round(self.transfer_seconds, 6),
            "encoder_transfer_bytes_total": self.transfer_bytes,
            "mm_embedding_cache_hits": self.cache.hits,
            "mm_embedding_cache_misses": self.cache.misses,
            # tokens per image: fixed (CLIP) or None when it follows each image's size (Qwen3-VL)
            "tokens_per_image": None if self.vlm.mrope else self.vlm.vision.max_tokens_per_image,
            "max_tokens_per_image": self.vlm.vision.max_tokens_per_image,
            "vision_digest": self.vlm.digest(),
        }


def _zmq_receiver(body: dict) -> str:
    receiver = body.get("receiver")
    if not isinstance(receiver, str) or not receiver.startswith("tcp://"):
        raise HTTPError(400, "receiver: tcp://host:port is required (zmq_to_scheduler)")
    return receiver


def _mooncake_target(body: dict) -> dict:
    """``transfer``: ``{"session_id": "host:port", "addr": int, "capacity": int, "deadline": unix s}``."""
    t = body.get("transfer")
    ok = (
        isinstance(t, dict)
        and isinstance(t.get("session_id"), str)
        and all(isinstance(t.get(k), int) and not isinstance(t.get(k), bool) for k in ("addr", "capacity"))
        and isinstance(t.get("deadline"), int | float)
    )
    if not ok:
        raise HTTPError(400, "transfer: {session_id, addr, capacity, deadline} is required (mooncake)")
    assert isinstance(t, dict), "checked in ok"
    return t


def _image(i: int, item: object) -> ProcessedImage:
    field = f"images.{i}"
    if not isinstance(item, dict):
        raise HTTPError(400, f"{field}: expected an object")
    try:
        data = base64.b64decode(item["pixels"], validate=True)
        shape = tuple(int(x) for x in item["shape"])
        pixels = torch.from_numpy(np.frombuffer(data, dtype=np.float32).reshape(shape).copy())
        grid = item.get("grid")
        grid = None if grid is None else (int(grid[0]), int(grid[1]), int(grid[2]))
    except (KeyError, TypeError, ValueError, IndexError, binascii.Error) as exc:
        raise HTTPError(400, f"{field}: bad pixels ({exc})") from None
    digest = image_digest(pixels, grid)
    if digest != item.get("digest"):
        raise HTTPError(400, f"{field}.digest does not match its pixels")
    return ProcessedImage(pixels, digest, grid)


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
