"""KV bytes per token: ``2 (K and V) * layers * KV heads * (head_dim * dtype bytes + scale bytes)``.

Follows SGLang's MHA token-to-KV pool, whose ``(size + page_size, H, D)`` K and V buffers per layer make
this the per-token cost of L1 and of every host-pool layout. Example (the tuning guide's): 28 layers,
8 KV heads, head_dim 128, fp16 -> 2 * 28 * 8 * 128 * 2 = 114,688 bytes. ``--kv-cache-dtype int8`` adds
one bfloat16 scale per token and KV head (``SCALE_BYTES``), kept in the same row as the head's values
(``engine/cache/kv_format.py``), so every tier and transfer counts and moves it with them.

With ``--tp-size`` N each rank has its own pools holding its share of the KV heads (KV / N, or one
replicated head when N exceeds them), so the per-rank bytes per token divide by N (at most by KV); the
tiers' token counts are the same on every rank.

MLA models (DeepSeek-V2/V3) cache one latent of ``kv_lora_rank + qk_rope_head_dim`` values per token and
layer, shared by all heads: the pools hold it as one KV head whose K and V rows are its two halves
(``ModelConfig.kv_cache_head_dim``), so the formula above gives ``layers * latent * dtype bytes`` (plus two
int8 scales per token and layer), and at any tp every rank holds the whole latent.
"""

from __future__ import annotations

from dataclasses import replace

from engine.cache.kv_dtypes import SCALE_BYTES, dtype_bytes
from engine.cache.kv_shape import KVShape, kv_heads_per_rank

__all__ = ["KVShape", "kv_heads_per_rank", "model_kv_shape", "shape_for"]


def shape_for(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: str) -> KVShape:
    """The KV shape of a model stored as ``kv_dtype`` (a resolved name: ``float32`` ... ``int8``)."""
    return KVShape(num_layers, num_kv_heads, head_dim, dtype_bytes(kv_dtype), SCALE_BYTES.get(kv_dtype, 0))


def model_kv_shape(model_path: str, dtype: str) -> KVShape:
    """The KV shape of the model at ``model_path`` (HF folder, GGUF file or alias) stored as ``dtype``.

    Reads only the model config. Raises ``ModelLoadError`` for a bad path, ``ValueError`` for a bad dtype.
    """
    from engine.model.loader import load_config

    dtype_bytes(dtype)  # a bad name fails before the config is read
    cfg = load_config(model_path)
    shape = shape_for(cfg.num_hidden_layers, cfg.kv_cache_heads, cfg.kv_cache_head_dim, dtype)
    return replace(shape, latent_dim=2 * cfg.kv_cache_head_dim) if cfg.mla else shape
