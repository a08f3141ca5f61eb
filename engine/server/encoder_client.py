"""A language-only worker's side of EPD (``--language-only --encoder-urls ...``, ``zmq_to_scheduler``): it
binds one ZMQ PULL socket, asks an encoder (``POST /encode``, ``engine/server/encoder_server.py``) to encode a
request's images and push the embeddings to that socket, and hands them to the request.

Encoders are taken round-robin, so requests spread over them. An encoder that refuses the connection,
answers 5xx or does not deliver within ``timeout_s`` is skipped and the next one is tried; when none
delivers, the request fails with 503 naming each encoder and its reason (at most
``len(urls) * timeout_s``), before anything is queued.
"""

from __future__ import annotations

import base64
import itertools
import json
import logging
import threading
import uuid
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import httpx
import numpy as np
import torch
import zmq

from engine.model.vlm.config import VLMConfig
from engine.model.vlm.processor import ProcessedImage
from engine.server.http_utils import HTTPError

logger = logging.getLogger(__name__)


class EncoderClient:
    """An ``Embedder`` (``engine/server/images.py``) over encoder workers; ``host`` is the address encoders
    push to (this worker's). ``requests_per_encoder`` counts the requests each encoder delivered."""

    def __init__(
        self, urls: list[str], vlm: VLMConfig, host: str = "127.0.0.1", timeout_s: float = 30.0
    ) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        self.vlm, self.timeout_s = vlm, timeout_s
        self._next = itertools.count()
        self._pending: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._ctx = zmq.Context.instance()
        self._pull = self._ctx.socket(zmq.PULL)
        port = self._pull.bind_to_random_port(f"tcp://{host}")
        self.receiver = f"tcp://{host}:{port}"
        self.requests_per_encoder = dict.fromkeys(self.urls, 0)
        self._http = httpx.Client(timeout=timeout_s)
        threading.Thread(target=self._receive, name="encoder-receiver", daemon=True).start()

    def _receive(self) -> None:
        while True:
            try:
                rid, header, data = self._pull.recv_multipart()
            except zmq.ContextTerminated:
                return
            except ValueError:
                logger.warning("encoder receiver: a message without three parts; dropped")
                continue
            with self._lock:
                fut = self._pending.pop(rid.decode(), None)
            if fut is None:  # its request gave up on that encoder already
                continue
            try:
                meta = json.loads(header)
                embeds = torch.from_numpy(np.frombuffer(data, dtype=np.float32).reshape(meta["shape"]).copy())
                fut.set_result((meta["digests"], embeds))
            except (ValueError, KeyError, TypeError) as exc:
                fut.set_exception(ValueError(f"bad embeddings message: {exc}"))

    def __call__(self, images: list[ProcessedImage]) -> list[torch.Tensor]:
        """Embeddings ``(tokens_per_image, hidden)`` per image; ``HTTPError(503)`` if no encoder delivers."""
        body_images = [
            {
                "digest": p.digest,
                "shape": list(p.pixels.shape),
                "pixels": base64.b64encode(p.pixels.numpy().tobytes()).decode(),
            }
            for p in images
        ]
        start = next(self._next)
        errors = []
        for k in range(len(self.urls)):
            url = self.urls[(start + k) % len(self.urls)]
            try:
                digests, embeds = self._ask(url, body_images)
            except Exception as exc:  # any failure of one encoder: try the next
                errors.append(f"{url}: {exc}")
                logger.warning("encoder %s failed (%s); trying the next", url, exc)
                continue
            if digests != [p.digest for p in images]:
                errors.append(f"{url}: embeddings for other images")
                continue
            self.requests_per_encoder[url] += 1
            return list(embeds.unbind(0))
        raise HTTPError(503, "no encoder delivered the image embeddings: " + "; ".join(errors))

    def _ask(self, url: str, images: list[dict]) -> tuple[list[str], torch.Tensor]:
        rid = uuid.uuid4().hex
        fut: Future = Future()
        with self._lock:
            self._pending[rid] = fut
        try:
            resp = self._http.post(
                f"{url}/encode", json={"rid": rid, "receiver": self.receiver, "images": images}
            )
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:200]}")
            try:
                return fut.result(timeout=self.timeout_s)
            except FutureTimeout:
                raise RuntimeError(f"no embeddings within {self.timeout_s:g} s") from None
        finally:
            with self._lock:
                self._pending.pop(rid, None)
