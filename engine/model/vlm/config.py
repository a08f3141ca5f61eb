"""The vision half of a LLaVA checkpoint (Qwen3-VL's: ``qwen3.py``): ``config.json`` (``vision_config``,
feature layer and strategy, projector) and ``preprocessor_config.json`` (resize, crop, normalisation), as
transformers writes them."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.model.errors import ModelLoadError
from engine.model.vlm.mm import ImageSlot
from engine.model.vlm.qwen3 import Qwen3ProcessorConfig, Qwen3VisionConfig, is_qwen3_vl, load_qwen3_config

if TYPE_CHECKING:
    from engine.model.vlm.processor import ProcessedImage

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class VisionConfig:
    """CLIP vision tower + LLaVA projector shape and feature selection.

    ``feature_layer``: index into the tower's hidden states (0 = embeddings after ``pre_layrnorm``; negative
    counts from the last layer's output, transformers' ``vision_feature_layer``); ``strategy``: ``default``
    drops the class token, ``full`` keeps it. ``image_token_id``: the placeholder token the chat template
    writes once per image.
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str
    feature_layer: int
    strategy: str
    projector_act: str
    projector_bias: bool
    text_hidden_size: int
    image_token_id: int

    @property
    def layers_run(self) -> int:
        """How many encoder layers produce the selected hidden state."""
        n = self.num_hidden_layers
        return self.feature_layer if self.feature_layer >= 0 else n + 1 + self.feature_layer

    @property
    def tokens_per_image(self) -> int:
        """Image tokens one image occupies in the prompt."""
        patches = (self.image_size // self.patch_size) ** 2
        return patches + (1 if self.strategy == "full" else 0)

    @property
    def max_tokens_per_image(self) -> int:
        """The most image tokens one image takes (every image takes as many here)."""
        return self.tokens_per_image

    @property
    def embed_dim(self) -> int:
        """Width of one image token's embedding row."""
        return self.text_hidden_size


@dataclass(frozen=True)
class ProcessorConfig:
    """``CLIPImageProcessor`` settings: shortest-edge resize (bicubic), center crop, rescale, normalise."""

    shortest_edge: int
    crop_height: int
    crop_width: int
    do_resize: bool = True
    do_center_crop: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    resample: int = 3


@dataclass(frozen=True)
class VLMConfig:
    """A vision-language checkpoint's vision tower and image processor: LLaVA's (CLIP) or Qwen3-VL's."""

    vision: VisionConfig | Qwen3VisionConfig
    processor: ProcessorConfig | Qwen3ProcessorConfig

    @property
    def mrope(self) -> bool:
        """Image tokens take 3D (M-RoPE) positions and each image its own token count (Qwen3-VL)."""
        return isinstance(self.vision, Qwen3VisionConfig)

    def image_slot(self, image: ProcessedImage) -> ImageSlot:
        """What ``image`` takes in a prompt: its tokens (fixed for CLIP; a Qwen3-VL grid of ``t x rows x
        cols`` patches makes ``t * rows/merge x cols/merge``) and, for M-RoPE, their grid."""
        if not isinstance(self.vision, Qwen3VisionConfig) or image.grid is None:
            return ImageSlot(image.pad_value, image.digest, self.vision.tokens_per_image)
        t, rows, cols = image.grid
        m = self.vision.spatial_merge_size
        return ImageSlot(image.pad_value, image.digest, t * (rows // m) * (cols // m), (rows // m, cols // m))

    def digest(self) -> str:
        """SHA-256 of every vision and processor setting (part of the L3 namespace: image KV made under
        other settings never aliases)."""
        text = json.dumps(
            {"vision": asdict(self.vision), "processor": asdict(self.processor)}, sort_keys=True
        )
        return hashlib.sha256(text.encode()).hexdigest()


def is_vlm(cfg: dict[str, Any]) -> bool:
    """A ``config.json`` of a vision-language model this engine serves (LLaVA or Qwen3-VL)."""
    return is_llava(cfg) or is_qwen3_vl(cfg)


def is_llava(cfg: dict[str, Any]) -> bool:
    return cfg.get("model_type") == "llava" or "LlavaForConditionalGeneration" in (
        cfg.get("architectures") or []
    )


def load_vlm_config(folder: Path, cfg: dict[str, Any]) -> VLMConfig:
    """Vision settings of a LLaVA ``config.json`` (``cfg``) and ``folder/preprocessor_config.json``.

    Raises ``ModelLoadError`` naming the file and the field for what this engine cannot run (a vision tower
    other than CLIP, a list of feature layers, an unknown strategy or activation). A Qwen3-VL checkpoint:
    ``engine/model/vlm/qwen3.py``'s settings.
    """
    if is_qwen3_vl(cfg):
        return VLMConfig(*load_qwen3_config(folder, cfg))
    source = str(folder / "config.json")
    vc = cfg.get("vision_config") or {}
    if vc.get("model_type", "clip_vision_model") != "clip_vision_model":
        raise ModelLoadError(
            source, f"vision_config.model_type {vc.get('model_type')!r}: only CLIP is supported"
        )
    layer = cfg.get("vision_feature_layer", -2)
    if not isinstance(layer, int):
        raise ModelLoadError(source, "vision_feature_layer: only a single layer index is supported")
    strategy = cfg.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ModelLoadError(source, f"vision_feature_select_strategy {strategy!r}: expected default or full")
    act = vc.get("hidden_act", "quick_gelu")
    proj_act = cfg.get("projector_hidden_act", "gelu")
    for name, value in (("vision_config.hidden_act", act), ("projector_hidden_act", proj_act)):
        if value not in _ACTS:
            raise ModelLoadError(source, f"{name} {value!r}: supported {sorted(_ACTS)}")
    text = cfg.get("text_config") or {}
    try:
        vision = VisionConfig(
            hidden_size=int(vc.get("hidden_size", 768)),
            intermediate_size=int(vc.get("intermediate_size", 3072)),
            num_hidden_layers=int(vc.get("num_hidden_layers", 12)),
            num_attention_heads=int(vc.get("num_attention_heads", 12)),
            image_size=int(vc.get("image_size", 224)),
            patch_size=int(vc.get("patch_size", 32)),
            num_channels=int(vc.get("num_channels", 3)),
            layer_norm_eps=float(vc.get("layer_norm_eps", 1e-5)),
            hidden_act=act,
            feature_layer=layer,
            strategy=strategy,
            projector_act=proj_act,
            projector_bias=bool(cfg.get("multimodal_projector_bias", True)),
            text_hidden_size=int(text["hidden_size"]),
            image_token_id=int(cfg.get("image_token_index", cfg.get("image_token_id", 32000))),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(source, f"bad vision settings: {exc!r}") from None
    if not 0 < vision.layers_run <= vision.num_hidden_layers:
        raise ModelLoadError(source, f"vision_feature_layer {layer} is outside the vision tower")
    return VLMConfig(vision, _processor(folder / "preprocessor_config.json", vision.image_size))


_ACTS = ("quick_gelu", "gelu", "gelu_pytorch_tanh")


def _processor(path: Path, image_size: int) -> ProcessorConfig:
    raw: dict[str, Any] = {}
    if path.is_file():
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ModelLoadError(path, f"not valid JSON: {exc}") from None
    size = raw.get("size", {"shortest_edge": image_size})
    edge = size.get("shortest_edge") if isinstance(size, dict) else size
    crop = raw.get("crop_size", {"height": image_size, "width": image_size})
    if isinstance(crop, int):
        crop = {"height": crop, "width": crop}
    if not isinstance(edge, int) or not isinstance(crop, dict):
        raise ModelLoadError(path, "size.shortest_edge and crop_size must be integers")
    out = ProcessorConfig(
        shortest_edge=edge,
        crop_height=int(crop["height"]),
        crop_width=int(crop["width"]),
        do_resize=bool(raw.get("do_resize", True)),
        do_center_crop=bool(raw.get("do_center_crop", True)),
        do_rescale=bool(raw.get("do_rescale", True)),
        rescale_factor=float(raw.get("rescale_factor", 1 / 255)),
        do_normalize=bool(raw.get("do_normalize", True)),
        image_mean=tuple(raw.get("image_mean", CLIP_MEAN)),
        image_std=tuple(raw.get("image_std", CLIP_STD)),
        resample=int(raw.get("resample", 3)),
    )
    if (out.crop_height, out.crop_width) != (image_size, image_size) and out.do_center_crop:
        raise ModelLoadError(
            path, f"crop_size {crop} does not match the vision tower's image_size {image_size}"
        )
    return out
