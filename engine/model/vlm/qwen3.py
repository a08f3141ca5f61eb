"""Qwen3-VL's (and Qwen2.5-VL's) vision side, following transformers' ``Qwen3VLVisionModel``
(``Qwen2_5_VisionTransformerPretrainedModel``) and ``Qwen2VLImageProcessor`` numerics.

Processing: the image is resized (bicubic) to a multiple of ``patch_size * merge_size`` on each side within
``[min_pixels, max_pixels]`` (``smart_resize``), rescaled, normalised and cut into flattened patches of
``C * temporal_patch_size * patch_size**2`` values (the frame repeated ``temporal_patch_size`` times), laid
out block by block (each ``merge_size x merge_size`` block of patches contiguous); ``grid`` is
``(1, rows, cols)`` in patches.

Tower: a Conv3d patch embedding (a linear map of each flattened patch), learned position embeddings
bilinearly resampled from their square grid to the image's grid, pre-norm blocks (LayerNorm, attention
with 2D rotary positions over the image's own patches, GELU-tanh MLP), then the patch merger (LayerNorm,
each 2x2 block concatenated, linear-GELU-linear into the text model's width). The blocks named in
``deepstack_visual_indexes`` also feed their own mergers (LayerNorm after the concatenation); those
"deepstack" features are added to the text model's hidden states at the image tokens after its first
layers. ``encode`` returns them side by side: ``(tokens, text_hidden * (1 + len(deepstack)))``.

Qwen2.5-VL (``variant="qwen2_5"``): RMSNorm instead of LayerNorm, SiLU-gated MLPs, no patch-embedding bias
and no learned positions; blocks other than ``fullatt_block_indexes`` attend within windows of
``window_size`` pixels (the patches regrouped window by window, whole merge blocks, and put back after the
merger, ``ln_q`` + ``mlp.0`` / ``mlp.2``); no deepstack.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from engine.model.errors import ModelLoadError

if TYPE_CHECKING:
    from engine.model.vlm.processor import ProcessedImage

_PREFIXES = ("model.visual.", "visual.")


@dataclass(frozen=True)
class Qwen3VisionConfig:
    """The vision tower's shape. ``image_token_id``: the placeholder the chat template writes once per
    image; ``deepstack``: block indices whose merged output is added after text layers 0, 1, ...;
    ``max_tokens_per_image``: image tokens at the processor's ``max_pixels`` (buffer sizes)."""

    hidden_size: int
    intermediate_size: int
    depth: int
    num_heads: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int
    num_position_embeddings: int
    hidden_act: str
    rope_theta: float
    deepstack: tuple[int, ...]
    text_hidden_size: int
    image_token_id: int
    max_tokens_per_image: int
    # Qwen2.5-VL: RMSNorm, SiLU-gated MLPs, no learned positions, attention within windows of
    # ``window_size`` pixels except in the ``fullatt_blocks``
    variant: str = "qwen3"  # "qwen3" | "qwen2_5"
    window_size: int = 0
    fullatt_blocks: tuple[int, ...] = ()

    @property
    def embed_dim(self) -> int:
        """Width of one image token's embedding row: the main merger's and each deepstack merger's."""
        return self.text_hidden_size * (1 + len(self.deepstack))

    @property
    def patch_dim(self) -> int:
        """Values in one flattened patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


@dataclass(frozen=True)
class Qwen3ProcessorConfig:
    """``Qwen2VLImageProcessor`` settings (``size.shortest_edge`` / ``longest_edge`` are pixel counts)."""

    min_pixels: int
    max_pixels: int
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    resample: int = 3


_ARCHS = {"Qwen3VLForConditionalGeneration": "qwen3_vl", "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl"}


def qwen_vl_type(cfg: dict[str, Any]) -> str | None:
    """``qwen3_vl`` or ``qwen2_5_vl`` for a ``config.json`` of either, else None."""
    if cfg.get("model_type") in _ARCHS.values():
        return cfg["model_type"]
    return next((_ARCHS[a] for a in cfg.get("architectures") or [] if a in _ARCHS), None)


def is_qwen3_vl(cfg: dict[str, Any]) -> bool:
    """Qwen3-VL or Qwen2.5-VL (one vision family, served by this module)."""
    return qwen_vl_type(cfg) is not None


def qwen_text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The text model's settings: ``text_config``, or (older Qwen2.5-VL files) the top level."""
    text = cfg.get("text_config")
    if text:
        return dict(text)
    return {k: v for k, v in cfg.items() if k not in ("vision_config", "architectures", "model_type")}


def load_qwen3_config(folder: Path, cfg: dict[str, Any]) -> tuple[Qwen3VisionConfig, Qwen3ProcessorConfig]:
    """Vision settings of a Qwen3-VL ``config.json`` (``cfg``) and ``folder/preprocessor_config.json``.

    Raises ``ModelLoadError`` naming the file and the field for what this engine cannot run.
    """
    source = str(folder / "config.json")
    vc = cfg.get("vision_config") or {}
    text = qwen_text_config(cfg)
    rope = vc.get("rope_parameters") or {}
    if rope.get("rope_type", "axial") != "axial":
        raise ModelLoadError(
            source, f"vision_config.rope_parameters.rope_type {rope['rope_type']!r}: expected axial"
        )
    qwen2_5 = qwen_vl_type(cfg) == "qwen2_5_vl"
    act = vc.get("hidden_act", "silu" if qwen2_5 else "gelu_pytorch_tanh")
    if act not in _VISION_ACTS:
        raise ModelLoadError(source, f"vision_config.hidden_act {act!r}: supported {sorted(_VISION_ACTS)}")
    try:
        processor = _processor(folder / "preprocessor_config.json", vc)
        merge = int(vc.get("spatial_merge_size", 2))
        vision = Qwen3VisionConfig(
            hidden_size=int(vc.get("hidden_size", 1152)),
            intermediate_size=int(vc.get("intermediate_size", 4304)),
            depth=int(vc.get("depth", 27)),
            num_heads=int(vc.get("num_heads", 16)),
            patch_size=int(vc.get("patch_size", 16)),
            temporal_patch_size=int(vc.get("temporal_patch_size", 2)),
            spatial_merge_size=merge,
            in_channels=int(vc.get("in_channels", 3)),
            num_position_embeddings=int(vc.get("num_position_embeddings", 2304)),
            hidden_act=act,
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            deepstack=()
            if qwen2_5
            else tuple(int(i) for i in vc.get("deepstack_visual_indexes", (8, 16, 24))),
            text_hidden_size=int(text["hidden_size"]),
            image_token_id=int(cfg.get("image_token_id", 151655)),
            max_tokens_per_image=processor.max_pixels // (processor.patch_size * processor.merge_size) ** 2,
            variant="qwen2_5" if qwen2_5 else "qwen3",
            window_size=int(vc.get("window_size", 112)) if qwen2_5 else 0,
            fullatt_blocks=tuple(int(i) for i in vc.get("fullatt_block_indexes", ())) if qwen2_5 else (),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(source, f"bad vision settings: {exc!r}") from None
    if int(vc.get("out_hidden_size", vision.text_hidden_size)) != vision.text_hidden_size:
        raise ModelLoadError(source, "vision_config.out_hidden_size differs from text_config.hidden_size")
    if any(not 0 <= i < vision.depth for i in vision.deepstack):
        raise ModelLoadError(source, "vision_config.deepstack_visual_indexes: outside the vision blocks")
    if len(vision.deepstack) > int(text.get("num_hidden_layers", 0)):
        raise ModelLoadError(source, "vision_config.deepstack_visual_indexes: more than the text layers")
    side = math.isqrt(vision.num_position_embeddings)
    if not qwen2_5 and side * side != vision.num_position_embeddings:
        raise ModelLoadError(source, "vision_config.num_position_embeddings must be a square")
    if (processor.patch_size, processor.merge_size, processor.temporal_patch_size) != (
        vision.patch_size,
        merge,
        vision.temporal_patch_size,
    ):
        raise ModelLoadError(
            folder / "preprocessor_config.json",
            "patch_size, merge_size and temporal_patch_size differ from config.json's vision_config",
        )
    return vision, processor


_VISION_ACTS = {"gelu": "none", "gelu_pytorch_tanh": "tanh", "silu": ""}


def _processor(path: Path, vc: dict[str, Any]) -> Qwen3ProcessorConfig:
    import json

    raw: dict[str, Any] = {}
    if path.is_file():
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ModelLoadError(path, f"not valid JSON: {exc}") from None
    size = raw.get("size") or {}
    min_pixels = raw.get("min_pixels", size.get("shortest_edge", 56 * 56))
    max_pixels = raw.get("max_pixels", size.get("longest_edge", 28 * 28 * 1280))
    return Qwen3ProcessorConfig(
        min_pixels=int(min_pixels),
        max_pixels=int(max_pixels),
        patch_size=int(raw.get("patch_size", vc.get("patch_size", 16))),
        merge_size=int(raw.get("merge_size", vc.get("spatial_merge_size", 2))),
        temporal_patch_size=int(raw.get("temporal_patch_size", vc.get("temporal_patch_size", 2))),
        do_resize=bool(raw.get("do_resize", True)),
        do_rescale=bool(raw.get("do_rescale", True)),
        rescale_factor=float(raw.get("rescale_factor", 1 / 255)),
        do_normalize=bool(raw.get("do_normalize", True)),
        image_mean=tuple(raw.get("image_mean", (0.5, 0.5, 0.5))),
        image_std=tuple(raw.get("image_std", (0.5, 0.5, 0.5))),
        resample=int(raw.get("resample", 3)),
    )


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """``(height, width)`` rounded to multiples of ``factor`` with a pixel count in ``[min_pixels,
    max_pixels]``, keeping the aspect ratio as closely as possible (transformers' ``smart_resize``).
    ``ValueError`` for an aspect ratio above 200."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.0f} is above 200")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def qwen_pixels(img: Image.Image, cfg: Qwen3ProcessorConfig) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """One RGB image to float32 patches ``(rows * cols, patch_dim)`` and its grid ``(1, rows, cols)``.
    ``ValueError`` for an aspect ratio above 200."""
    factor = cfg.patch_size * cfg.merge_size
    if cfg.do_resize:
        h, w = smart_resize(img.height, img.width, factor, cfg.min_pixels, cfg.max_pixels)
        if (w, h) != img.size:
            img = img.resize((w, h), resample=Image.Resampling(cfg.resample))
    elif img.height % factor or img.width % factor:
        raise ValueError(f"{img.width}x{img.height} is not a multiple of {factor} and do_resize is off")
    arr = np.asarray(img).astype(np.float32)
    if cfg.do_rescale:
        arr = arr * np.float32(cfg.rescale_factor)
    if cfg.do_normalize:
        arr = (arr - np.asarray(cfg.image_mean, np.float32)) / np.asarray(cfg.image_std, np.float32)
    arr = arr.transpose(2, 0, 1)  # (C, H, W)
    c, p, m, t = arr.shape[0], cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    rows, cols = arr.shape[1] // p, arr.shape[2] // p
    patches = arr.reshape(c, rows // m, m, p, cols // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], t, p, p))
    flat = np.ascontiguousarray(patches.reshape(rows * cols, c * t * p * p), dtype=np.float32)
    return torch.from_numpy(flat), (1, rows, cols)


def split_qwen3_tensors(
    tensors: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A Qwen3-VL checkpoint's tensors as (text tower under ``model.*`` / ``lm_head.*``, vision tower
    without its ``model.visual.`` prefix)."""
    text, vision = {}, {}
    for name, t in tensors.items():
        v = next((name[len(p) :] for p in _PREFIXES if name.startswith(p)), None)
        if v is not None:
            vision[v] = t
            continue
        for old, new in (("model.language_model.", "model."), ("language_model.", "model.")):
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        text[name] = t
    return text, vision


def _segments(lengths: list[int]) -> list[slice]:
    """Consecutive slices of the given lengths."""
    ends = list(itertools.accumulate(lengths))
    return [slice(e - n, e) for n, e in zip(lengths, ends, strict=True)]


def _norm(x: torch.Tensor, w: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
    """LayerNorm (eps 1e-6) with a bias, RMSNorm (float32, eps 1e-6) without one."""
    if w[1] is None:
        return w[0] * F.rms_norm(x.float(), (x.shape[-1],), eps=1e-6).to(x.dtype)
    return F.layer_norm(x, (x.shape[-1],), w[0], w[1], eps=1e-6)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Qwen3VisionEncoder:
    """Patches to image embeddings; see the module docstring. ``vision``: tensors named as under
    ``model.visual.``. Raises ``ModelLoadError`` naming ``source`` for a missing or mis-shaped tensor."""

    def __init__(
        self,
        cfg: Qwen3VisionConfig,
        vision: Mapping[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        source: str = "model",
    ) -> None:
        self.cfg, self.dtype, self.device = cfg, dtype, device
        d, inter = cfg.hidden_size, cfg.intermediate_size
        used: set[str] = set()

        def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            if name not in vision:
                raise ModelLoadError(source, f"missing vision tensor {name!r}")
            t = vision[name]
            if tuple(t.shape) != shape:
                raise ModelLoadError(
                    source, f"vision tensor {name!r} has shape {tuple(t.shape)}, expected {shape}"
                )
            used.add(name)
            return t.to(device=device, dtype=dtype).contiguous()

        def lin(name: str, out: int, inp: int) -> tuple[torch.Tensor, torch.Tensor]:
            return take(f"{name}.weight", (out, inp)), take(f"{name}.bias", (out,))

        qwen2_5 = cfg.variant == "qwen2_5"

        def norm(name: str, width: int) -> tuple[torch.Tensor, torch.Tensor | None]:
            """LayerNorm (weight, bias), or RMSNorm (weight, None) for Qwen2.5-VL."""
            return take(f"{name}.weight", (width,)), None if qwen2_5 else take(f"{name}.bias", (width,))

        def mlp(pre: str) -> dict[str, Any]:
            if qwen2_5:
                gate, up = lin(f"{pre}.gate_proj", inter, d), lin(f"{pre}.up_proj", inter, d)
                return {"gate_up": (torch.cat([gate[0], up[0]]), torch.cat([gate[1], up[1]])),
                        "down": lin(f"{pre}.down_proj", d, inter)}  # fmt: skip
            return {"fc1": lin(f"{pre}.linear_fc1", inter, d), "fc2": lin(f"{pre}.linear_fc2", d, inter)}

        c, t, p = cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size
        weight = take("patch_embed.proj.weight", (d, c, t, p, p)).reshape(d, -1)
        self.patch = (weight, None if qwen2_5 else take("patch_embed.proj.bias", (d,)))
        self.pos_embed = None if qwen2_5 else take("pos_embed.weight", (cfg.num_position_embeddings, d))
        self.blocks = [
            {
                "norm1": norm(f"blocks.{i}.norm1", d),
                "norm2": norm(f"blocks.{i}.norm2", d),
                "qkv": lin(f"blocks.{i}.attn.qkv", 3 * d, d),
                "proj": lin(f"blocks.{i}.attn.proj", d, d),
                **mlp(f"blocks.{i}.mlp"),
            }
            for i in range(cfg.depth)
        ]
        merged = d * cfg.spatial_merge_size**2

        def merger(name: str, post_norm: bool) -> dict[str, Any]:
            if qwen2_5:  # ln_q, then mlp.0 / GELU / mlp.2
                return {"norm": norm(f"{name}.ln_q", d), "post": False,
                        "fc1": lin(f"{name}.mlp.0", merged, merged),
                        "fc2": lin(f"{name}.mlp.2", cfg.text_hidden_size, merged)}  # fmt: skip
            return {
                "norm": norm(f"{name}.norm", merged if post_norm else d),
                "post": post_norm,
                "fc1": lin(f"{name}.linear_fc1", merged, merged),
                "fc2": lin(f"{name}.linear_fc2", cfg.text_hidden_size, merged),
            }

        self.merger = merger("merger", False)
        self.deepstack = [merger(f"deepstack_merger_list.{k}", True) for k in range(len(cfg.deepstack))]
        unused = sorted(set(vision) - used)
        if unused:
            raise ModelLoadError(source, f"unexpected vision tensors {unused[:5]}")
        head_dim = d // cfg.num_heads
        spatial = head_dim // 2
        self.inv_freq = 1.0 / (
            cfg.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float32, device=device) / spatial)
        )

    def _positions(self, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Resampled position embeddings ``(rows * cols, d)`` and rotary (h, w) indices ``(rows * cols,
        2)``, both in block order."""
        cfg, m = self.cfg, self.cfg.spatial_merge_size

        def blocks(x: torch.Tensor) -> torch.Tensor:  # (r, c, ...) -> (r * c, ...) in block order
            x = x.reshape(rows // m, m, cols // m, m, *x.shape[2:]).transpose(1, 2)
            return x.reshape(rows * cols, *x.shape[4:])

        if self.pos_embed is None:  # Qwen2.5-VL: rotary positions only
            pos = torch.zeros((), dtype=self.dtype, device=self.device)
        else:
            side = math.isqrt(cfg.num_position_embeddings)
            table = self.pos_embed.float().T.reshape(1, -1, side, side)
            grid = F.interpolate(table, size=(rows, cols), mode="bilinear", align_corners=True)[
                0
            ]  # (d, r, c)
            pos = blocks(grid.permute(1, 2, 0))
        hw = torch.stack(torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij"), dim=-1).to(
            self.device
        )
        return pos.to(self.dtype), blocks(hw)

    def _merge(self, w: dict[str, Any], x: torch.Tensor) -> torch.Tensor:
        merged = self.cfg.hidden_size * self.cfg.spatial_merge_size**2
        flat = x.reshape(-1, merged)
        x = _norm(flat, w["norm"]) if w["post"] else _norm(x, w["norm"]).reshape(-1, merged)
        return F.linear(F.gelu(F.linear(x, *w["fc1"])), *w["fc2"])

    def _windows(self, t: int, rows: int, cols: int) -> tuple[torch.Tensor, list[int]]:
        """Qwen2.5-VL's window order: merge blocks ``(t * rows/m * cols/m,)`` regrouped window by window
        (windows of ``window_size / patch / m`` blocks a side, raster over the image, each frame apart),
        and the windows' lengths in patches."""
        m = self.cfg.spatial_merge_size
        side = self.cfg.window_size // m // self.cfg.patch_size
        lh, lw = rows // m, cols // m
        index = torch.arange(t * lh * lw).reshape(t, lh, lw)
        pad_h, pad_w = -lh % side, -lw % side
        padded = F.pad(index, (0, pad_w, 0, pad_h), value=-1)
        nh, nw = (lh + pad_h) // side, (lw + pad_w) // side
        padded = padded.reshape(t, nh, side, nw, side).permute(0, 1, 3, 2, 4).reshape(t * nh * nw, -1)
        lengths = [int(n) * m * m for n in (padded >= 0).sum(1).tolist() if n]
        return padded[padded >= 0], lengths

    def encode_images(self, images: Sequence[ProcessedImage]) -> list[torch.Tensor]:
        """Embeddings ``(tokens, embed_dim)`` of each image (its patches and grid), one image at a time.
        ``ValueError`` for an image without a grid or whose patches do not fill it."""
        out = []
        for p in images:
            if p.grid is None or p.pixels.shape != (p.grid[0] * p.grid[1] * p.grid[2], self.cfg.patch_dim):
                raise ValueError(
                    f"image {p.digest[:12]}: pixels {tuple(p.pixels.shape)} do not fit grid {p.grid}"
                )
            out.append(self.encode_one(p.pixels, p.grid))
        return out

    @torch.inference_mode()
    def encode_one(self, patches: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """``(t * rows * cols, patch_dim)`` patches of one image to ``(tokens, embed_dim)``, ``tokens =
        t * rows * cols / merge**2``."""
        cfg = self.cfg
        t, rows, cols = grid
        x = F.linear(patches.to(device=self.device, dtype=self.dtype), *self.patch)
        pos, hw = self._positions(rows, cols)
        x = x + (pos.repeat(t, 1) if pos.dim() else pos)
        freqs = hw.repeat(t, 1)[..., None].float() * self.inv_freq  # (n, 2, head_dim / 4)
        freqs = torch.cat((freqs[:, 0], freqs[:, 1]), dim=-1)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # (n, 1, head_dim)
        cos, sin = emb.cos(), emb.sin()
        n, d, heads = x.shape[0], cfg.hidden_size, cfg.num_heads
        full = _segments([rows * cols] * t)
        order, windows = None, full
        if cfg.window_size:  # Qwen2.5-VL: patches regrouped window by window (whole merge blocks)
            unit = cfg.spatial_merge_size**2
            blocks, lengths = self._windows(t, rows, cols)
            order = (blocks[:, None] * unit + torch.arange(unit)).reshape(-1).to(self.device)
            x, cos, sin = x[order], cos[order], sin[order]
            windows = _segments(lengths)
        deep = []
        for i, w in enumerate(self.blocks):
            spans = full if not cfg.window_size or i in cfg.fullatt_blocks else windows
            h = _norm(x, w["norm1"])
            q, k, v = F.linear(h, *w["qkv"]).view(n, 3, heads, d // heads).unbind(1)
            q = (q.float() * cos + _rotate_half(q.float()) * sin).to(self.dtype)
            k = (k.float() * cos + _rotate_half(k.float()) * sin).to(self.dtype)
            out = torch.cat(
                [
                    F.scaled_dot_product_attention(
                        q[f].transpose(0, 1), k[f].transpose(0, 1), v[f].transpose(0, 1)
                    ).transpose(0, 1)
                    for f in spans
                ]
            )
            x = x + F.linear(out.reshape(n, d), *w["proj"])
            x = x + self._mlp(w, _norm(x, w["norm2"]))
            if i in cfg.deepstack:
                deep.append(self._merge(self.deepstack[cfg.deepstack.index(i)], x))
        out = torch.cat([self._merge(self.merger, x), *deep], dim=-1)
        if order is not None:  # back to the image's block order
            out = out[torch.argsort(order[:: cfg.spatial_merge_size**2] // cfg.spatial_merge_size**2)]
        return out

    def _mlp(self, w: dict[str, Any], h: torch.Tensor) -> torch.Tensor:
        if "gate_up" in w:  # Qwen2.5-VL: SiLU-gated
            gate, up = F.linear(h, *w["gate_up"]).chunk(2, dim=-1)
            return F.linear(F.silu(gate) * up, *w["down"])
        return F.linear(
            F.gelu(F.linear(h, *w["fc1"]), approximate=_VISION_ACTS[self.cfg.hidden_act]), *w["fc2"]
        )
