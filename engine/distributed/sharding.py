"""Which part of a Llama-family model one tensor-parallel rank owns (upstream's Megatron-style split).

Query heads are split evenly: rank ``r`` of ``tp`` owns heads ``[r * H/tp, (r+1) * H/tp)``. KV heads are
split evenly when ``tp <= KV``; when ``tp > KV`` each rank holds one KV head, replicated on ``tp / KV`` ranks
(rank ``r`` holds head ``r // (tp / KV)``, the head its query heads attend to). The MLP's intermediate
columns are split evenly; the vocabulary (embedding and LM head rows) is padded to a multiple of tp and split
evenly, the padding rows being zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class ModelShape(Protocol):
    """What sharding reads of a model's config (``engine.model.config.ModelConfig`` has it): counts and
    sizes, no weights."""

    @property
    def num_attention_heads(self) -> int: ...
    @property
    def num_key_value_heads(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def head_dim(self) -> int: ...


class TPConfigError(ValueError):
    """The model cannot be split over this many ranks; the message names ``--tp-size`` and the counts."""


def check_tp_size(cfg: ModelShape, tp_size: int) -> None:
    """Refuse a tp size the model's head counts do not take (upstream's asserts, as one message).

    Raises ``TPConfigError`` when ``num_attention_heads % tp != 0``, when ``tp <= KV heads`` and
    ``KV % tp != 0``, when ``tp > KV heads`` and ``tp % KV != 0``, or when ``intermediate_size % tp != 0``.
    """
    heads, kv, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    counts = f"{heads} attention heads, {kv} KV heads"
    if tp_size < 1:
        raise TPConfigError(f"--tp-size must be >= 1, got {tp_size}")
    if heads % tp_size:
        raise TPConfigError(
            f"--tp-size {tp_size}: the model's {heads} attention heads are not divisible by {tp_size} "
            f"({counts}; tp sizes that divide the heads: {_divisors(heads)})"
        )
    if tp_size <= kv and kv % tp_size:
        raise TPConfigError(f"--tp-size {tp_size}: the model's {kv} KV heads are not divisible by {tp_size}")
    if tp_size > kv and tp_size % kv:
        raise TPConfigError(
            f"--tp-size {tp_size}: more ranks than the model's {kv} KV heads, so each is replicated, "
            f"which needs tp to be a multiple of {kv}"
        )
    if inter % tp_size:
        raise TPConfigError(
            f"--tp-size {tp_size}: the model's intermediate_size {inter} is not divisible by {tp_size}"
        )
    moe_inter = getattr(cfg, "moe_intermediate_size", 0)  # MoE experts split like the dense MLP
    if moe_inter and moe_inter % tp_size:
        raise TPConfigError(
            f"--tp-size {tp_size}: the model's moe_intermediate_size {moe_inter} is not divisible by "
            f"{tp_size} (experts are split by intermediate columns; --ep-size is not built)"
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class TPShard:
    """What rank ``rank`` of ``size`` owns of a model with config ``cfg`` (checked by ``check_tp_size``)."""

    cfg: ModelShape
    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tp rank {self.rank} must be in [0, {self.size})")
        check_tp_size(self.cfg, self.size)

    @property
    def num_heads(self) -> int:
        """Query heads on this rank."""
        return self.cfg.num_attention_heads // self.size

    @property
    def kv_replicas(self) -> int:
        """Ranks holding each KV head: 1 when tp <= KV heads, else tp / KV."""
        return max(1, self.size // self.cfg.num_key_value_heads)

    @property
    def num_kv_heads(self) -> int:
        """KV heads on this rank (1 when replicated)."""
        return max(1, self.cfg.num_key_value_heads // self.size)

    @property
    def kv_shard(self) -> int:
        """Which of the ``num_kv_shards`` distinct KV shards this rank holds."""
        return self.rank // self.kv_replicas

    @property
    def num_kv_shards(self) -> int:
        """Distinct KV shards over the group: min(tp, KV heads)."""
        return self.size // self.kv_replicas

    @property
    def kv_writer(self) -> bool:
        """The one rank of its replicas that writes its KV shard to shared storage."""
        return self.rank % self.kv_replicas == 0

    def head_rows(self) -> tuple[slice, slice]:
        """Rows of the q and of the k (or v) projection weights this rank owns (output features)."""
        d = self.cfg.head_dim
        q0 = self.rank * self.num_heads * d
        k0 = self.kv_shard * self.num_kv_heads * d
        return slice(q0, q0 + self.num_heads * d), slice(k0, k0 + self.num_kv_heads * d)

    def inter_cols(self, width: int | None = None) -> slice:
        """Intermediate (MLP) features this rank owns of an MLP ``width`` wide (default: the dense MLP's
        ``intermediate_size``; an MoE expert's is ``moe_intermediate_size``)."""
        per = (self.cfg.intermediate_size if width is None else width) // self.size
        return slice(self.rank * per, (self.rank + 1) * per)

    @property
    def vocab_per_rank(self) -> int:
        """Vocabulary rows per rank after padding the vocabulary to a multiple of tp."""
        return -(-self.cfg.vocab_size // self.size)

    def vocab_rows(self) -> tuple[int, int]:
        """``[start, end)`` of the real vocabulary rows this rank owns (end - start may be < per rank)."""
        per = self.vocab_per_rank
        start = min(self.rank * per, self.cfg.vocab_size)
        return start, min(start + per, self.cfg.vocab_size)
