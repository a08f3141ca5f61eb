"""A language-only worker's side of EPD (``--language-only --encoder-urls ...``): it asks an encoder
(``POST /encode``, ``engine/server/encoder_server.py``) to encode a request's images and deliver the
embeddings, and hands them to the request. ``--encoder-transfer-backend``:

* ``zmq_to_scheduler``: the worker binds one ZMQ PULL socket; the encoder pushes the embeddings there.
* ``mooncake``: the worker takes a slot of its registered receive buffer
  (:class:`engine.server.encoder_transfer.EmbeddingReceiver`) for the request, the encoder writes the
  embeddings into it over Mooncake's TransferEngine before it answers, the worker copies them out and returns
  the slot. A slot an encoder may still write into (no answer: timeout, dropped connection) is held back
  until the request's deadline plus a grace period; no free slot within ``timeout_s`` is a 503.

Every ``/encode`` names the backend; an encoder started with another one refuses it (400 naming
``--encoder-transfer-backend``), which ends as this request's 503 below.

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
import time
import uuid
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import httpx
import numpy as np
import torch
import zmq

from engine.model.vlm.config import VLMConfig
from engine.model.vlm.processor import ProcessedImage
from engine.server.encoder_transfer import LATE_WRITE_GRACE_S, EmbeddingReceiver
from engine.server.http_utils import HTTPError

logger = logging.getLogger(__name__)


class EncoderClient:
    """An ``Embedder`` (``engine/server/images.py``) over encoder workers; ``host`` is the address encoders
    push or write to (this worker's). ``backend``: ``zmq_to_scheduler`` or ``mooncake`` (then each receive
    slot holds ``max_images`` images' embeddings; raises ``TransferBackendError`` when Mooncake cannot start).
    ``requests_per_encoder`` counts the requests each encoder delivered."""

    def __init__(
        self,
        urls: list[str],
        vlm: VLMConfig,
        host: str = "127.0.0.1",
        timeout_s: float = 30.0,
        backend: str = "zmq_to_scheduler",
        max_images: int = 8,
    ) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        self.vlm, self.timeout_s, self.backend = vlm, timeout_s, backend
        self.transfer: EmbeddingReceiver | None = None
        self._next = itertools.count()
        self._pending: dict[str, Future] = {}
        self._lock = threading.Lock()
        self.requests_per_encoder = dict.fromkeys(self.urls, 0)
        self._http = httpx.Client(timeout=timeout_s)
        self.receiver = ""
        if backend == "mooncake":
            per_image = vlm.vision.max_tokens_per_image * vlm.vision.embed_dim * 4
            self.transfer = EmbeddingReceiver(host, max(1, max_images) * per_image)
            return
        self._ctx: zmq.Context = zmq.Context.instance()
        self._pull = self._ctx.socket(zmq.PULL)
        port = self._pull.bind_to_random_port(f"tcp://{host}")
        self.receiver = f"tcp://{host}:{port}"
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
                fut.set_result((meta["digests"], _split(embeds, meta["tokens"])))
            except (ValueError, KeyError, TypeError) as exc:
                fut.set_exception(ValueError(f"bad embeddings message: {exc}"))

    def transfer_stats(self) -> dict:
        """``/server_info``'s ``encoder_transfer_buffers``: the receive slots (mooncake; ``free == slots``
        when no request holds one) or the requests waiting on the ZMQ socket (zmq_to_scheduler)."""
        if self.transfer is not None:
            return {"backend": self.backend, **self.transfer.pool.stats()}
        with self._lock:
            return {"backend": self.backend, "pending": len(self._pending)}

    def __call__(self, images: list[ProcessedImage]) -> list[torch.Tensor]:
        """Embeddings ``(tokens, embed_dim)`` per image; ``HTTPError(503)`` if no encoder delivers or
        (mooncake) no receive slot frees up within ``timeout_s``."""
        body_images = [
            {
                "digest": p.digest,
                "shape": list(p.pixels.shape),
                "pixels": base64.b64encode(p.pixels.numpy().tobytes()).decode(),
                **({} if p.grid is None else {"grid": list(p.grid)}),
            }
            for p in images
        ]
        shapes = [(self.vlm.image_slot(p).length, self.vlm.vision.embed_dim) for p in images]
        start = next(self._next)
        errors = []
        slot = None
        try:
            for k in range(len(self.urls)):
                url = self.urls[(start + k) % len(self.urls)]
                if self.transfer is not None and slot is None:
                    slot = self._acquire()
                try:
                    digests, embeds = self._ask(url, body_images, slot)
                except _Unanswered as exc:  # the encoder may still write into the slot: hold it back
                    if slot is not None:
                        assert self.transfer is not None
                        self.transfer.pool.release_at(slot, exc.deadline + LATE_WRITE_GRACE_S)
                        slot = None
                    errors.append(f"{url}: {exc}")
                    logger.warning("encoder %s failed (%s); trying the next", url, exc)
                    continue
                except Exception as exc:  # any failure of one encoder: try the next
                    errors.append(f"{url}: {exc}")
                    logger.warning("encoder %s failed (%s); trying the next", url, exc)
                    continue
                if digests != [p.digest for p in images]:
                    errors.append(f"{url}: embeddings for other images")
                    continue
                if [tuple(e.shape) for e in embeds] != shapes:
                    errors.append(
                        f"{url}: embeddings of shapes {[tuple(e.shape) for e in embeds]}, not {shapes}"
                    )
                    continue
                self.requests_per_encoder[url] += 1
                return embeds
        finally:
            if slot is not None:
                assert self.transfer is not None
                self.transfer.pool.release(slot)
        raise HTTPError(503, "no encoder delivered the image embeddings: " + "; ".join(errors))

    def _acquire(self) -> int:
        assert self.transfer is not None
        try:
            return self.transfer.pool.acquire(self.timeout_s)
        except TimeoutError as exc:
            raise HTTPError(503, f"--encoder-transfer-backend mooncake: {exc}") from None

    def _post(self, url: str, body: dict, deadline: float) -> dict:
        """The encoder's JSON answer; ``_Unanswered`` when it may still be working, ``RuntimeError`` for an
        answer other than 200 (with the encoder's own message)."""
        try:
            resp = self._http.post(f"{url}/encode", json=body)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise RuntimeError(f"cannot connect ({exc})") from None
        except httpx.TransportError as exc:
            raise _Unanswered(f"no answer ({type(exc).__name__}: {exc})", deadline) from None
        if resp.status_code != 200:
            try:
                message = resp.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = resp.text[:500]
            raise RuntimeError(f"HTTP {resp.status_code}: {message}")
        return resp.json()

    def _ask(self, url: str, images: list[dict], slot: int | None) -> tuple[list[str], list[torch.Tensor]]:
        rid = uuid.uuid4().hex
        deadline = time.time() + self.timeout_s
        if self.transfer is not None:
            assert slot is not None
            body = {
                "rid": rid,
                "transfer_backend": "mooncake",
                "transfer": self.transfer.target(slot, deadline),
                "images": images,
            }
            answer = self._post(url, body, deadline)
            if answer.get("transfer_backend") != "mooncake":
                got = answer.get("transfer_backend")
                raise RuntimeError(
                    f"the encoder answered for --encoder-transfer-backend {got!r}, not mooncake"
                )
            try:
                return answer["digests"], _split(self.transfer.read(slot, answer["shape"]), answer["tokens"])
            except (KeyError, TypeError, ValueError, RuntimeError) as exc:
                raise RuntimeError(f"bad embeddings answer: {exc}") from None
        fut: Future = Future()
        with self._lock:
            self._pending[rid] = fut
        try:
            body = {
                "rid": rid,
                "transfer_backend": self.backend,
                "receiver": self.receiver,
                "images": images,
            }
            self._post(url, body, deadline)
            try:
                return fut.result(timeout=self.timeout_s)
            except FutureTimeout:
                raise RuntimeError(f"no embeddings within {self.timeout_s:g} s") from None
        finally:
            with self._lock:
                self._pending.pop(rid, None)


def _split(embeds: torch.Tensor, tokens: list[int]) -> list[torch.Tensor]:
    """The rows ``(sum(tokens), embed_dim)`` of a request's images, one tensor per image; ``ValueError``
    when the counts do not add up."""
    if not isinstance(tokens, list) or sum(tokens) != embeds.shape[0]:
        raise ValueError(f"tokens {tokens!r} do not add up to {embeds.shape[0]} rows")
    return list(embeds.split(tokens))


class _Unanswered(RuntimeError):
    """The encoder took the request but gave no answer; it may still write until ``deadline``."""

    def __init__(self, message: str, deadline: float) -> None:
        super().__init__(message)
        self.deadline = deadline
