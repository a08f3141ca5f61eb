"""KV bytes per token of a model: ``2 (K and V) * layers * KV heads * head_dim * dtype bytes``.

Follows SGLang's MHA token-to-KV pool, whose ``(size + page_size, H, D)`` K and V buffers per layer make
this the per-token cost of L1 and of every host-pool layout. Example (the tuning guide's): 28 layers,
8 KV heads, head_dim 128, fp16 -> 2 * 28 * 8 * 128 * 2 = 114,688 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

KV_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}


@dataclass(frozen=True)
class KVShape:
    """What one token's KV looks like: ``num_layers`` x ``num_kv_heads`` x ``head_dim`` of ``dtype_bytes``."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


def dtype_bytes(name: str) -> int:
    """Bytes of one element of KV dtype ``name`` (``--dtype`` / ``--kv-cache-dtype`` names).

    Raises ``ValueError`` naming the dtype.
    """
    if name not in KV_DTYPES:
        raise ValueError(f"unknown KV dtype {name!r} (one of {', '.join(KV_DTYPES)})")
    return KV_DTYPES[name]


def model_kv_shape(model_path: str, dtype: str) -> KVShape:
    """The KV shape of the model at ``model_path`` (HF folder, GGUF file or alias) stored as ``dtype``.

    Reads only the model config. Raises ``ModelLoadError`` for a bad path, ``ValueError`` for a bad dtype.
    """
    from engine.model.loader import load_config

    size = dtype_bytes(dtype)
    cfg = load_config(model_path)
    return KVShape(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, size)
