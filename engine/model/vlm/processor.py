"""Image bytes to model pixels: decode (Pillow), check, RGB, shortest-edge bicubic resize, center crop,
rescale and normalise as transformers' ``CLIPImageProcessor`` (PIL backend), and the content hash that keys
an image's tokens in the prefix cache."""

from __future__ import annotations

import hashlib
import io
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from engine.model.vlm.config import ProcessorConfig
from engine.model.vlm.qwen3 import Qwen3ProcessorConfig, qwen_pixels

# Formats a request may carry (Pillow's names), and their MIME types for data: URLs.
FORMATS = {
    "PNG": "image/png",
    "JPEG": "image/jpeg",
    "WEBP": "image/webp",
    "GIF": "image/gif",
    "BMP": "image/bmp",
}
PAD_BASE = 1 << 31  # image pad ids lie in [2**31, 2**32): never a vocabulary id, still a u32 page-key token


class ImageError(ValueError):
    """An image that cannot be used; the message says why (the caller names the field)."""


@dataclass(frozen=True)
class ProcessedImage:
    """One image ready for the vision tower: ``pixels`` float32 ``(C, H, W)`` (CLIP) or flattened patches
    ``(t * rows * cols, patch_dim)`` with ``grid`` ``(t, rows, cols)`` (Qwen3-VL), ``digest`` the SHA-256
    of those pixels (hex; the grid follows from them and the settings), ``pad_value`` the token id its
    image tokens carry in the prompt."""

    pixels: torch.Tensor
    digest: str
    grid: tuple[int, int, int] | None = None

    @property
    def pad_value(self) -> int:
        return PAD_BASE + int(self.digest[:16], 16) % PAD_BASE


def open_image(data: bytes, max_pixels: int) -> Image.Image:
    """Decode ``data`` (PNG, JPEG, WebP, GIF or BMP) as RGB; ``ImageError`` for another format, a damaged
    file or more than ``max_pixels`` pixels (checked before the pixels are decoded)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=list(FORMATS))
            w, h = img.size
            if w * h > max_pixels:
                raise ImageError(f"image is {w}x{h} = {w * h} pixels, more than the limit {max_pixels}")
            img.load()
    except ImageError:
        raise
    except (
        OSError,
        ValueError,
        SyntaxError,
        Image.DecompressionBombError,
        Image.DecompressionBombWarning,
    ) as exc:
        raise ImageError(f"not a readable image ({', '.join(sorted(FORMATS))}): {exc}") from None
    return img.convert("RGB")


def preprocess(img: Image.Image, cfg: ProcessorConfig | Qwen3ProcessorConfig) -> ProcessedImage:
    """``CLIPImageProcessor`` on one RGB image: float32 ``(3, crop_height, crop_width)`` and its hash; with
    Qwen3-VL settings its patches and grid (``qwen3.qwen_pixels``). ``ImageError`` for an image the
    settings cannot take (an aspect ratio above 200)."""
    if isinstance(cfg, Qwen3ProcessorConfig):
        try:
            patches, grid = qwen_pixels(img, cfg)
        except ValueError as exc:
            raise ImageError(str(exc)) from None
        return ProcessedImage(patches, image_digest(patches, grid), grid)
    if cfg.do_resize:
        w, h = img.size
        short, long = (w, h) if w <= h else (h, w)
        new_short, new_long = cfg.shortest_edge, int(cfg.shortest_edge * long / short)
        size = (new_short, new_long) if w <= h else (new_long, new_short)
        if size != img.size:
            img = img.resize(size, resample=Image.Resampling(cfg.resample))
    arr = np.asarray(img, dtype=np.float32) if not cfg.do_rescale else np.asarray(img).astype(np.float32)
    if cfg.do_center_crop:
        h, w = arr.shape[:2]
        top, left = (h - cfg.crop_height) // 2, (w - cfg.crop_width) // 2
        if top < 0 or left < 0:  # smaller than the crop: pad with zeros around it, as transformers does
            padded = np.zeros((max(h, cfg.crop_height), max(w, cfg.crop_width), 3), dtype=np.float32)
            pt, pl = (padded.shape[0] - h) // 2, (padded.shape[1] - w) // 2
            padded[pt : pt + h, pl : pl + w] = arr
            arr, (h, w) = padded, padded.shape[:2]
            top, left = (h - cfg.crop_height) // 2, (w - cfg.crop_width) // 2
        arr = arr[top : top + cfg.crop_height, left : left + cfg.crop_width]
    if cfg.do_rescale:
        arr = arr * np.float32(cfg.rescale_factor)
    if cfg.do_normalize:
        arr = (arr - np.asarray(cfg.image_mean, np.float32)) / np.asarray(cfg.image_std, np.float32)
    pixels = torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1), dtype=np.float32))
    return ProcessedImage(pixels, image_digest(pixels))


def image_digest(pixels: torch.Tensor, grid: tuple[int, int, int] | None = None) -> str:
    """SHA-256 (hex) of float32 ``pixels`` and, when given, their ``grid`` (the same values cut into
    another grid are another image)."""
    data = pixels.numpy().tobytes()
    if grid is not None:
        data += repr(tuple(int(g) for g in grid)).encode()
    return hashlib.sha256(data).hexdigest()
