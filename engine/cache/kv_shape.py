"""One description of a token's KV, shared by the device pool (L1), the host pool (L2) and the sizing.

A token's KV is ``2 (K and V) x num_layers x num_kv_heads`` rows of ``row_bytes`` each: ``head_dim`` values
of ``dtype_bytes`` plus ``scale_bytes`` (int8's bfloat16 scale per token and KV head, kept in the same row;
``kv_format.py``). Every tier holds the same rows, so their bytes per token, per page and the sizing's
figures come from here. An MLA model's latent is one KV head whose K and V rows are its two halves.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class KVShape:
    """What one token's KV looks like: ``num_layers`` x ``num_kv_heads`` x ``head_dim`` of ``dtype_bytes``."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    scale_bytes: int = 0  # per (token, KV head): int8's scale
    latent_dim: int | None = None  # MLA: the latent (2 x head_dim) the one head's K and V rows split

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's K (or V) of one KV head, scale included."""
        return self.head_dim * self.dtype_bytes + self.scale_bytes

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes of one token over every layer and KV head."""
        return 2 * self.num_layers * self.num_kv_heads * self.row_bytes

    def page_bytes(self, page_size: int) -> int:
        """K and V bytes of one page of ``page_size`` tokens (what an L2 page or an L3 page body holds)."""
        return page_size * self.bytes_per_token

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
