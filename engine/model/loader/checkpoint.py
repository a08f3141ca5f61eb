"""What a loader returns: config, HF-named weight tensors and the tokenizer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.config import ModelConfig
from engine.model.tokenizer import Tokenizer


@dataclass
class Checkpoint:
    """A loaded model: ``tensors`` use HF names (``model.layers.N.self_attn.q_proj.weight``, ...)."""

    path: str
    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    tokenizer: Tokenizer
