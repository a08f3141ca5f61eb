"""What a loader returns: config, HF-named weight tensors and the tokenizer."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.model.config import ModelConfig
from engine.model.tokenizer import Tokenizer
from engine.model.vlm.config import VLMConfig


@dataclass
class Checkpoint:
    """A loaded model: ``tensors`` use HF names (``model.layers.N.self_attn.q_proj.weight``, ...)."""

    path: str
    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    # a vision-language checkpoint: its vision settings and the vision tower / projector tensors
    vlm: VLMConfig | None = None
    vision_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    projector_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    # a GGUF file: the type each HF-named tensor was stored in ("Q4_1", "Q8_0", "F32", ...); empty otherwise
    stored_types: dict[str, str] = field(default_factory=dict)
