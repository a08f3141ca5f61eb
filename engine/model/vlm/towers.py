"""The vision tower a checkpoint names: CLIP + projector (LLaVA) or Qwen3-VL's."""

from __future__ import annotations

import torch

from engine.model.loader.checkpoint import Checkpoint
from engine.model.vlm.clip import VisionEncoder
from engine.model.vlm.config import VisionConfig
from engine.model.vlm.qwen3 import Qwen3VisionEncoder

VisionTower = VisionEncoder | Qwen3VisionEncoder
"""Either tower: ``encode_images(list[ProcessedImage])`` gives each image's ``(tokens, embed_dim)``."""


def make_vision_encoder(checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device) -> VisionTower:
    """The tower of a vision-language ``checkpoint`` (``checkpoint.vlm`` set); ``ModelLoadError`` naming
    the checkpoint for a missing or mis-shaped tensor."""
    vlm = checkpoint.vlm
    assert vlm is not None, "a vision-language checkpoint"
    if isinstance(vlm.vision, VisionConfig):
        return VisionEncoder(
            vlm.vision,
            checkpoint.vision_tensors,
            checkpoint.projector_tensors,
            dtype,
            device,
            checkpoint.path,
        )
    return Qwen3VisionEncoder(vlm.vision, checkpoint.vision_tensors, dtype, device, checkpoint.path)
