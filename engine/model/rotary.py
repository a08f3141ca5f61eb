"""Rotary position embedding (RoPE) in HF's rotate-half layout, with default, linear and llama3 scaling.

Follows transformers' ``_compute_default_rope_parameters`` / ``_compute_linear_scaling_rope_parameters`` /
``_compute_llama3_parameters`` and ``apply_rotary_pos_emb``: dims ``[0, d/2)`` pair with ``[d/2, d)``, inverse
frequencies in float32, angles from absolute positions.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies, float32 ``(head_dim // 2,)``; ``scaling`` is the HF rope-scaling dict or None."""
    freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "linear":
        return freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / freq
        scaled = torch.where(wavelen > old_len / low, freq / factor, freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    return freq


def cos_sin(
    positions: torch.Tensor, freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape ``(T, 1, head_dim)`` in ``dtype`` for int64 ``positions`` ``(T,)``."""
    angles = positions.to(torch.float32)[:, None] * freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)[:, None, :]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``(T, heads, head_dim)`` by the angles in ``cos``/``sin`` ``(T, 1, head_dim)``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
