"""KV bytes per token: ``2 (K and V) * layers * KV heads * (head_dim * dtype bytes + scale bytes)``.

Follows SGLang's MHA token-to-KV pool, whose ``(size + page_size, H, D)`` K and V buffers per layer make
this the per-token cost of L1 and of every host-pool layout. Example (the tuning guide's): 28 layers,
8 KV heads, head_dim 128, fp16 -> 2 * 28 * 8 * 128 * 2 = 114,688 bytes. ``--kv-cache-dtype int8`` adds
one bfloat16 scale per token and KV head (``SCALE_BYTES``), kept in the same row as the head's values
(``engine/cache/kv_format.py``), so every tier and transfer counts and moves it with them.

With ``--tp-size`` N each rank has its own pools holding its share of the KV heads (KV / N, or one
replicated head when N exceeds them), so the per-rank bytes per token divide by N (at most by KV); the
tiers' token counts are the same on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

KV_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1}
SCALE_BYTES = {"int8": 2}  # one bfloat16 scale per (token, KV head)
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8_e4m3", "fp8_e5m2", "int8")  # --kv-cache-dtype choices


@dataclass(frozen=True)
class KVShape:
    """What one token's KV looks like: ``num_layers`` x ``num_kv_heads`` x ``head_dim`` of ``dtype_bytes``."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    scale_bytes: int = 0  # per (token, KV head): int8's scale

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's K (or V) of one KV head, scale included."""
        return self.head_dim * self.dtype_bytes + self.scale_bytes

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.row_bytes

    def per_rank(self, tp_size: int) -> KVShape:
        """The shape one of ``tp_size`` tensor-parallel ranks stores: its share of the KV heads
        (:func:`kv_heads_per_rank`). Raises ``ValueError`` naming ``--tp-size`` as the engine refuses."""
        return replace(self, num_kv_heads=kv_heads_per_rank(self.num_kv_heads, tp_size))


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads each of ``tp_size`` ranks holds: ``num_kv_heads / tp`` when tp divides them, 1 (replicated
    on ``tp / num_kv_heads`` ranks) when tp is a multiple of them. Raises ``ValueError`` naming ``--tp-size``
    and the counts otherwise, as the engine's start-up check does."""
    if tp_size < 1:
        raise ValueError(f"--tp-size must be >= 1, got {tp_size}")
    if tp_size <= num_kv_heads and num_kv_heads % tp_size:
        raise ValueError(f"--tp-size {tp_size}: the model's {num_kv_heads} KV heads are not divisible by it")
    if tp_size > num_kv_heads and tp_size % num_kv_heads:
        raise ValueError(
            f"--tp-size {tp_size}: more ranks than the model's {num_kv_heads} KV heads needs a multiple "
            "of them"
        )
    return max(1, num_kv_heads // tp_size)


def dtype_bytes(name: str) -> int:
    """Bytes of one element of KV dtype ``name`` (``--dtype`` / ``--kv-cache-dtype`` names).

    Raises ``ValueError`` naming the dtype.
    """
    if name not in KV_DTYPES:
        raise ValueError(f"unknown KV dtype {name!r} (one of {', '.join(KV_DTYPES)})")
    return KV_DTYPES[name]


def resolve_kv_cache_dtype(kv_cache_dtype: str, compute_dtype: str) -> str:
    """The dtype the KV cache stores: ``compute_dtype`` for ``auto``, else ``kv_cache_dtype``.

    Raises ``ValueError`` naming the choices for anything not in :data:`KV_CACHE_DTYPES`."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"{kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    return compute_dtype if kv_cache_dtype == "auto" else kv_cache_dtype


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
    return shape_for(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, dtype)
