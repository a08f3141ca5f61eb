"""Image inputs of a vision-language worker: where the bytes come from, the checks, and the prompt's image
tokens with their embeddings.

Sources, as upstream's ``image_url`` content parts and ``/generate`` ``image_data``: a ``data:`` URL with
base64 (``data:image/png;base64,...``), bare base64, or, only under ``--allowed-local-media-path DIR``, a
local path inside DIR (``file://`` or plain). Remote URLs are refused (a worker may have no internet).
Every problem is ``HTTPError(400)`` naming the field; nothing is queued.
"""

from __future__ import annotations

import base64
import binascii
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from engine.model.vlm.config import VLMConfig
from engine.model.vlm.mm import MMItem, expand_prompt
from engine.model.vlm.processor import FORMATS, ImageError, ProcessedImage, open_image, preprocess
from engine.server.http_utils import HTTPError

Embedder = Callable[[list[ProcessedImage]], list[torch.Tensor]]
"""Image embeddings ``(tokens, embed_dim)`` for each processed image, in order."""


def image_bytes(source: str, field: str, local_dir: Path | None) -> bytes:
    """The bytes ``source`` names; ``HTTPError(400)`` naming ``field`` for a remote URL, a MIME type that
    is not an image format the worker reads, bad base64, or a path outside ``local_dir``."""
    if not isinstance(source, str) or not source:
        raise HTTPError(400, f"{field}: expected a data: URL with a base64 image")
    if source.startswith(("http://", "https://")):
        raise HTTPError(
            400,
            f"{field}: remote image URLs are not fetched (workers may have no internet access); send the "
            "image inline as a data: URL (data:image/png;base64,...)",
        )
    if source.startswith("data:"):
        header, sep, payload = source[5:].partition(",")
        mime, *params = header.split(";")
        if not sep or "base64" not in params:
            raise HTTPError(400, f"{field}: a data: URL must be base64 (data:<mime>;base64,<data>)")
        if mime not in FORMATS.values():
            raise HTTPError(
                400, f"{field}: MIME type {mime!r} is not supported; use one of {sorted(FORMATS.values())}"
            )
        return _b64(payload, field)
    if source.startswith("file://") or source.startswith("/"):
        return _local(source.removeprefix("file://"), field, local_dir)
    return _b64(source, field)


def _b64(payload: str, field: str) -> bytes:
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise HTTPError(400, f"{field}: not valid base64") from None


def _local(path: str, field: str, local_dir: Path | None) -> bytes:
    if local_dir is None:
        raise HTTPError(
            400,
            f"{field}: local image paths are refused unless the worker runs with --allowed-local-media-path",
        )
    resolved = Path(path).resolve()
    if not resolved.is_relative_to(local_dir):
        raise HTTPError(400, f"{field}: {path} is outside --allowed-local-media-path")
    try:
        return resolved.read_bytes()
    except OSError as exc:
        raise HTTPError(400, f"{field}: cannot read {path}: {exc.strerror}") from None


class EmbeddingCache:
    """Image embeddings by content digest, least recently used out first (upstream's multimodal embedding
    cache); ``hits`` / ``misses`` count lookups. Thread-safe."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, digest: str) -> torch.Tensor | None:
        with self._lock:
            value = self._items.get(digest)
            if value is None:
                self.misses += 1
                return None
            self.hits += 1
            self._items.move_to_end(digest)
            return value

    def put(self, digest: str, embeds: torch.Tensor) -> None:
        with self._lock:
            self._items[digest] = embeds
            self._items.move_to_end(digest)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)


def local_embedder(encode: Embedder, cache: EmbeddingCache, shared=None) -> Embedder:
    """Embeddings from a vision tower in this process (``encode``: the tower's ``encode_images``), cached
    by digest: the in-process ``cache`` first, then ``shared`` (an
    :class:`engine.server.mm_global_cache.MMGlobalCache`, or None), and only the images neither holds are
    encoded (and written to both)."""

    def lookup(digest: str) -> torch.Tensor | None:
        found = cache.get(digest)
        if found is None and shared is not None:
            found = shared.get(digest)
            if found is not None:
                cache.put(digest, found)
        return found

    def embed(images: list[ProcessedImage]) -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [lookup(p.digest) for p in images]
        todo = [i for i, e in enumerate(out) if e is None]
        if todo:
            embeds = encode([images[i] for i in todo])
            for i, e in zip(todo, embeds, strict=True):
                cache.put(images[i].digest, e)
                if shared is not None:
                    shared.put(images[i].digest, e)
                out[i] = e
        return [e for e in out if e is not None]

    return embed


class ImageInputs:
    """The image side of a request: sources to pixels (checked), the prompt's image tokens expanded to
    content-keyed pad ids, and each image's embeddings from ``embedder`` (None on a PD decode worker,
    which never prefills: it needs only the token layout).

    ``max_images``: images one prompt may carry (``--limit-mm-data-per-request``); ``max_pixels``: pixels
    per image (``--max-image-pixels``); ``local_dir``: ``--allowed-local-media-path``.
    """

    def __init__(
        self,
        cfg: VLMConfig,
        embedder: Embedder | None,
        max_images: int,
        max_pixels: int,
        local_dir: Path | None,
    ) -> None:
        self.cfg, self.embedder = cfg, embedder
        self.max_images, self.max_pixels, self.local_dir = max_images, max_pixels, local_dir

    def load(self, sources: Sequence[tuple[str, str]]) -> list[ProcessedImage]:
        """``(field, source)`` pairs to processed images; ``HTTPError(400)`` naming the field."""
        if len(sources) > self.max_images:
            field = sources[self.max_images][0]
            raise HTTPError(
                400,
                f"{field}: {len(sources)} images, more than the limit {self.max_images} per request "
                "(--limit-mm-data-per-request)",
            )
        out = []
        for field, source in sources:
            data = image_bytes(source, field, self.local_dir)
            try:
                out.append(preprocess(open_image(data, self.max_pixels), self.cfg.processor))
            except ImageError as exc:
                raise HTTPError(400, f"{field}: {exc}") from None
        return out

    def prepare(
        self, ids: list[int], sources: Sequence[tuple[str, str]], field: str
    ) -> tuple[list[int], list[MMItem]]:
        """``ids`` (one image token per image) with image tokens expanded, and the items with embeddings.

        ``field`` names the image list in errors (a placeholder count that differs from the image count).
        Raises ``HTTPError(400)``; an encoder that cannot answer raises ``HTTPError(503)``.
        """
        images = self.load(sources)
        try:
            slots = [self.cfg.image_slot(p) for p in images]
            ids, items = expand_prompt(ids, self.cfg.vision.image_token_id, slots)
        except ValueError as exc:
            raise HTTPError(400, f"{field}: {exc}") from None
        if items and self.embedder is not None:
            for item, embeds in zip(items, self.embedder(images), strict=True):
                item.embeds = embeds
        return ids, items
