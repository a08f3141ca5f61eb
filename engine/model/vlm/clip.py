"""CLIP vision tower and LLaVA projector, following transformers' ``CLIPVisionTransformer`` and
``LlavaMultiModalProjector`` numerics: patch conv + class and position embeddings, ``pre_layrnorm``,
pre-norm encoder layers (scaled-dot-product attention, no mask; quick-GELU MLP), the hidden state of
``vision_feature_layer``, the class token dropped (``default``) or kept (``full``), then linear-GELU-linear
into the text model's hidden size."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F

from engine.model.errors import ModelLoadError
from engine.model.vlm.config import VisionConfig
from engine.model.vlm.processor import ProcessedImage

_PREFIXES = (
    "model.vision_tower.vision_model.",
    "vision_tower.vision_model.",
    "model.vision_tower.",
    "vision_tower.",
)
_PROJ_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")


def _act(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    return F.gelu(x, approximate="tanh" if name == "gelu_pytorch_tanh" else "none")


def split_vision_tensors(
    tensors: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A LLaVA checkpoint's tensors as (text tower under ``model.*`` / ``lm_head.*``, vision tower without its
    prefix, projector without its prefix); both transformers layouts (``language_model.model.*`` and
    ``model.language_model.*``) are read."""
    text, vision, proj = {}, {}, {}
    for name, t in tensors.items():
        v = next((name[len(p) :] for p in _PREFIXES if name.startswith(p)), None)
        if v is not None:
            vision[v] = t
            continue
        p = next((name[len(p) :] for p in _PROJ_PREFIXES if name.startswith(p)), None)
        if p is not None:
            proj[p] = t
            continue
        for old, new in (
            ("language_model.model.", "model."),
            ("language_model.lm_head.", "lm_head."),
            ("model.language_model.", "model."),
        ):
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        text[name] = t
    return text, vision, proj


class VisionEncoder:
    """Pixels ``(N, C, H, W)`` float32 to image embeddings ``(N, tokens_per_image, text_hidden)``.

    ``vision`` / ``projector``: tensors named as under ``vision_tower.`` / ``multi_modal_projector.``; layers
    past the selected feature layer (and ``post_layernorm``) are not used and not kept. Raises
    ``ModelLoadError`` naming ``source`` for a missing or mis-shaped tensor.
    """

    def __init__(
        self,
        cfg: VisionConfig,
        vision: Mapping[str, torch.Tensor],
        projector: Mapping[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        source: str = "model",
    ) -> None:
        self.cfg, self.dtype, self.device = cfg, dtype, device
        d, c, p = cfg.hidden_size, cfg.num_channels, cfg.patch_size
        positions = (cfg.image_size // p) ** 2 + 1

        def take(group: Mapping[str, torch.Tensor], name: str, shape: tuple[int, ...]) -> torch.Tensor:
            if name not in group:
                raise ModelLoadError(source, f"missing vision tensor {name!r}")
            t = group[name]
            if tuple(t.shape) != shape:
                raise ModelLoadError(
                    source, f"vision tensor {name!r} has shape {tuple(t.shape)}, expected {shape}"
                )
            return t.to(device=device, dtype=dtype).contiguous()

        self.class_embedding = take(vision, "embeddings.class_embedding", (d,))
        self.patch_weight = take(vision, "embeddings.patch_embedding.weight", (d, c, p, p))
        self.position_embedding = take(vision, "embeddings.position_embedding.weight", (positions, d))
        self.pre_norm = (take(vision, "pre_layrnorm.weight", (d,)), take(vision, "pre_layrnorm.bias", (d,)))
        self.layers = []
        for i in range(cfg.layers_run):
            pre = f"encoder.layers.{i}."

            def lin(n: str, out: int, inp: int, pre: str = pre) -> tuple[torch.Tensor, torch.Tensor]:
                return take(vision, f"{pre}{n}.weight", (out, inp)), take(vision, f"{pre}{n}.bias", (out,))

            qkv = [lin(f"self_attn.{n}_proj", d, d) for n in ("q", "k", "v")]
            self.layers.append(
                {
                    "ln1": (
                        take(vision, pre + "layer_norm1.weight", (d,)),
                        take(vision, pre + "layer_norm1.bias", (d,)),
                    ),
                    "ln2": (
                        take(vision, pre + "layer_norm2.weight", (d,)),
                        take(vision, pre + "layer_norm2.bias", (d,)),
                    ),
                    "qkv": (torch.cat([w for w, _ in qkv]), torch.cat([b for _, b in qkv])),
                    "out": lin("self_attn.out_proj", d, d),
                    "fc1": lin("mlp.fc1", cfg.intermediate_size, d),
                    "fc2": lin("mlp.fc2", d, cfg.intermediate_size),
                }
            )
        h = cfg.text_hidden_size

        def proj_lin(n: str, out: int, inp: int) -> tuple[torch.Tensor, torch.Tensor | None]:
            bias = take(projector, f"{n}.bias", (out,)) if cfg.projector_bias else None
            return take(projector, f"{n}.weight", (out, inp)), bias

        self.linear_1 = proj_lin("linear_1", h, d)
        self.linear_2 = proj_lin("linear_2", h, h)

    def encode_images(self, images: Sequence[ProcessedImage]) -> list[torch.Tensor]:
        """Embeddings ``(tokens_per_image, text_hidden)`` of each image, in one batch."""
        return list(self.encode(torch.stack([p.pixels for p in images])))

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``(N, C, image_size, image_size)`` pixels to ``(N, tokens_per_image, text_hidden)`` embeddings."""
        cfg = self.cfg
        x = pixel_values.to(device=self.device, dtype=self.dtype)
        patches = F.conv2d(x, self.patch_weight, stride=cfg.patch_size).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(x.shape[0], 1, -1)
        x = torch.cat([cls, patches], dim=1) + self.position_embedding
        x = F.layer_norm(x, (cfg.hidden_size,), *self.pre_norm, eps=cfg.layer_norm_eps)
        n, t, d = x.shape
        heads = cfg.num_attention_heads
        for w in self.layers:
            h = F.layer_norm(x, (d,), *w["ln1"], eps=cfg.layer_norm_eps)
            q, k, v = F.linear(h, *w["qkv"]).view(n, t, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, t, d)
            x = x + F.linear(a, *w["out"])
            h = F.layer_norm(x, (d,), *w["ln2"], eps=cfg.layer_norm_eps)
            x = x + F.linear(_act(cfg.hidden_act, F.linear(h, *w["fc1"])), *w["fc2"])
        if cfg.strategy == "default":
            x = x[:, 1:]
        x = _act(cfg.projector_act, F.linear(x, *self.linear_1))
        return F.linear(x, *self.linear_2)
