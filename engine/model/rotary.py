"""Rotary position embedding (RoPE) in HF's rotate-half layout, with default, linear, llama3 and yarn scaling.

Follows transformers' ``_compute_default_rope_parameters`` / ``_compute_linear_scaling_rope_parameters`` /
``_compute_llama3_parameters`` / ``_compute_yarn_parameters`` (whose ``attention_factor`` scales cos and
sin) and ``apply_rotary_pos_emb``: dims ``[0, d/2)`` pair with ``[d/2, d)``, inverse
frequencies in float32, angles from absolute positions.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, max_position_embeddings: int = 4096
) -> torch.Tensor:
    """Inverse frequencies, float32 ``(head_dim // 2,)``; ``scaling`` is the HF rope-scaling dict or None;
    ``max_position_embeddings`` is read only by yarn without a ``factor``."""
    freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "yarn":
        return _yarn_inv_freq(freq, head_dim, theta, scaling, max_position_embeddings)
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


def yarn_factor(scaling: dict[str, Any], max_position_embeddings: int) -> float:
    """Yarn's ``factor``, or the ratio of ``max_position_embeddings`` to the original context without one."""
    factor = scaling.get("factor")
    if factor is None:  # DeepSeek-V3 style: the ratio of the context lengths
        return max_position_embeddings / float(scaling["original_max_position_embeddings"])
    return float(factor)


def _yarn_inv_freq(
    freq: torch.Tensor, dim: int, theta: float, scaling: dict[str, Any], max_position_embeddings: int
) -> torch.Tensor:
    """transformers' ``_compute_yarn_parameters``: extrapolated frequencies above the ``beta_fast`` /
    ``beta_slow`` correction range, interpolated (divided by ``factor``) below it, a linear ramp between."""
    factor = yarn_factor(scaling, max_position_embeddings)
    original = float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singularity
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return (freq / factor) * (1 - extrapolation) + freq * extrapolation


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 for ``scale <= 1``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(scaling: dict[str, Any] | None, max_position_embeddings: int = 4096) -> float:
    """What cos and sin are multiplied by: 1, or yarn's ``attention_factor`` (given, else
    ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when both are set, else
    ``mscale(factor)``)."""
    if (scaling or {}).get("rope_type") != "yarn":
        return 1.0
    assert scaling is not None
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = yarn_factor(scaling, max_position_embeddings)
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def cos_sin(
    positions: torch.Tensor, freq: torch.Tensor, dtype: torch.dtype, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape ``(T, 1, head_dim)`` in ``dtype`` for int64 ``positions`` ``(T,)``, times
    ``scale`` (:func:`attention_factor`)."""
    angles = positions.to(torch.float32)[:, None] * freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)[:, None, :]
    if scale == 1.0:
        return emb.cos().to(dtype), emb.sin().to(dtype)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def mrope_cos_sin(
    positions: torch.Tensor,
    freq: torch.Tensor,
    section: tuple[int, ...],
    dtype: torch.dtype,
    interleaved: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """M-RoPE: cos and sin ``(T, 1, head_dim)`` for int64 ``positions`` ``(3, T)`` (time, row, column).
    Interleaved (Qwen3-VL, transformers' ``Qwen3VLTextRotaryEmbedding``): rotary pair ``i`` takes the row
    angle when ``i % 3 == 1`` and ``i < 3 * section[1]``, the column angle when ``i % 3 == 2`` and ``i < 3
    * section[2]``, else the time angle. Not interleaved (Qwen2.5-VL): the first ``section[0]`` pairs take
    the time angle, the next ``section[1]`` the row angle, the last ``section[2]`` the column angle."""
    angles = positions.to(torch.float32)[..., None] * freq  # (3, T, head_dim / 2)
    if interleaved:
        mixed = angles[0].clone()
        for dim in (1, 2):
            idx = slice(dim, section[dim] * 3, 3)
            mixed[:, idx] = angles[dim][:, idx]
    else:
        mixed = torch.cat([part[i] for i, part in enumerate(angles.split(list(section), dim=-1))], dim=-1)
    emb = torch.cat((mixed, mixed), dim=-1)[:, None, :]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``(T, heads, head_dim)`` by the angles in ``cos``/``sin`` ``(T, 1, head_dim)``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
