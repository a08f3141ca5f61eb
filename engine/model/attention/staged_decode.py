"""Decode K/V staged across steps: each decoding sequence's K/V copied out of the pool once, not every step.

The torch backend's decode attention needs every sequence's keys and values as dense tensors; gathering them
from the pool through the page table copies all of them in every layer of every step (at 4 sequences x 450
tokens that is 2.8 MB per layer, about a fifth of an fp32 decode step here). ``DecodeStage`` keeps, per
layer, a buffer ``(Bd, capacity, num_kv_heads, head_dim)`` of the decode batch's K/V. While each step is the
previous step's sequences one token longer (same page-table rows up to the old lengths, every length + 1,
the same pool, the same ``ForwardBatch.seq_keys`` when given, room left), a layer only appends the new
token's K/V there and reads the buffer; any other batch (a sequence joins or leaves, a prefill or mixed batch
in between, a row outgrowing ``capacity``) refills the buffers from the pool, with ``STAGE_HEADROOM`` tokens
of room per row. Rows past a sequence's length hold finite values (the padding slot's, or zero) that the
attention mask hides. The scheduler passes each request's ``KVLease`` as its ``seq_key``, so a new request
whose KV arrived on slots another one just freed (a PD decode worker receives KV without a forward pass, so
no prefill batch comes in between) is refilled even when its slots and length look like the old one's.

The buffers are exact copies of the pool's rows, so attention over them equals attention over a fresh gather.
They cost ``Bd x capacity x pool.bytes_per_token`` bytes; above ``STAGE_MAX_BYTES`` (or the ``max_bytes`` of
a ``DecodeStage``) a batch is not staged and the backend gathers per step as before. Pool rows of a decoding
sequence change only through its own new tokens while it holds its slots, which is what keeps the copies
valid between steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.cache.device_pool import DeviceKVPool

STAGE_MAX_BYTES = 512 * 2**20  # staged K/V of all layers of one decode batch, at most
STAGE_HEADROOM = 64  # tokens of room per sequence for the steps before the next refill


class DecodeStage:
    """Per-layer staged K/V of the current decode batch (one instance per attention backend); ``max_bytes``
    bounds the buffers of one batch (0: never stage)."""

    def __init__(self, max_bytes: int = STAGE_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._pool: DeviceKVPool | None = None
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []
        self._table: torch.Tensor | None = None  # (Bd, Smax) rows held, zero past each length
        self._lens: torch.Tensor | None = None  # (Bd,)
        self._seq_keys: tuple | None = None  # the batch's ``seq_keys`` (kept alive, compared with ``is``)
        self._next: tuple[torch.Tensor, torch.Tensor, bool] | None = None  # this batch: table, lens, extends
        self._refill = False  # this batch: copy whole rows in every layer (else append one token)
        self._layers_done = 0  # layers of the current batch whose buffers are up to date
        self._active = False  # this batch uses the buffers
        self._rows = torch.empty(0, dtype=torch.long)
        self._pos = torch.empty(0, dtype=torch.long)

    def reset(self) -> None:
        """A batch that is not all decodes ran: the next decode batch refills (buffers are kept for reuse)."""
        self._table = self._lens = self._next = self._seq_keys = None
        self._active = False

    def plan(
        self,
        table: torch.Tensor,
        lens: torch.Tensor,
        mask: torch.Tensor | None,
        seq_keys: tuple | None = None,
    ) -> None:
        """A decode batch: page-table rows ``table`` ``(Bd, Smax)`` (cut to the longest sequence), lengths
        ``lens`` ``(Bd,)``, the padding mask ``(Bd, 1, 1, Smax)`` (None when all have length Smax) and the
        ``ForwardBatch.seq_keys`` (None: slots and lengths alone decide)."""
        if mask is not None:
            table = table.masked_fill(~mask[:, 0, 0, :], 0)
        old, old_keys = self._table, self._seq_keys
        same_keys = (seq_keys is None and old_keys is None) or (
            seq_keys is not None
            and old_keys is not None
            and len(seq_keys) == len(old_keys)
            and all(a is b for a, b in zip(seq_keys, old_keys, strict=True))
        )
        self._seq_keys = seq_keys
        extends = (
            same_keys
            and old is not None
            and self._layers_done == len(self._keys)  # the previous batch ran through every layer
            and old.shape == (table.shape[0], table.shape[1] - 1)
            and torch.equal(self._lens + 1, lens)
        )
        if extends:
            kept = table[:, :-1]
            if mask is not None:  # the new token of a shorter row lands inside the old width
                kept = kept.masked_fill(~mask[:, 0, 0, 1:], 0)
            extends = torch.equal(kept, old)
        self._next = (table, lens, extends)
        self._active = False

    def begin(self, kv_pool: DeviceKVPool) -> bool:
        """At the first layer of a planned batch: True when its attention reads the staged buffers."""
        if self._next is None:
            return False
        table, lens, extends = self._next
        self._next = None
        bd, smax = table.shape
        capacity = self._keys[0].shape[1] if self._keys else 0
        self._refill = not (extends and self._pool is kv_pool and smax <= capacity)
        reusable = (
            self._keys
            and self._keys[0].shape[0] == bd
            and smax <= capacity <= smax + 2 * STAGE_HEADROOM
            and self._keys[0].dtype == kv_pool.dtype  # another pool may store other rows
            and self._keys[0].shape[-1] == kv_pool.row_dim
        )
        if self._refill and not reusable:
            capacity = smax + STAGE_HEADROOM
            self._keys, self._values = [], []
            if bd * capacity * kv_pool.bytes_per_token > self.max_bytes:
                self._table = self._lens = None
                return False
            shape = (bd, capacity, kv_pool.num_kv_heads, kv_pool.row_dim)  # stored rows, as in the pool
            for _ in range(kv_pool.num_layers):
                self._keys.append(torch.empty(shape, dtype=kv_pool.dtype, device=kv_pool.device))
                self._values.append(torch.empty(shape, dtype=kv_pool.dtype, device=kv_pool.device))
        self._pool, self._table, self._lens = kv_pool, table, lens
        self._rows = torch.arange(bd, device=lens.device)
        self._pos = lens - 1
        self._layers_done = 0
        self._active = True
        return True

    def all_layers(self) -> tuple[torch.Tensor | None, list[torch.Tensor], list[torch.Tensor]]:
        """For a caller that runs every layer of the current (active) batch itself, as ``layer_kv`` would:
        the refill slots ``(Bd * capacity,)`` (None: append one token at ``rows``/``pos``) and the per-layer
        key and value buffers; marks every layer up to date."""
        capacity, smax = self._keys[0].shape[1], self._table.shape[1]
        slots = F.pad(self._table, (0, capacity - smax)).reshape(-1) if self._refill else None
        self._layers_done = len(self._keys)
        return slots, self._keys, self._values

    @property
    def rows(self) -> torch.Tensor:
        """Row ``i`` of every sequence of the current batch ``(Bd,)``, where its new token is appended."""
        return self._rows

    @property
    def pos(self) -> torch.Tensor:
        """Where each sequence's new token goes in its row ``(Bd,)`` (its length - 1)."""
        return self._pos

    @property
    def active(self) -> bool:
        """The current batch reads the staged buffers (``begin`` returned True)."""
        return self._active

    def layer_kv(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored K and V rows ``(Bd, Smax, num_kv_heads, row_dim)`` of ``layer`` for the current batch
        (the pool's storage dtype: ``DeviceKVPool.decode`` them).

        ``k``/``v`` ``(Bd, num_kv_heads, head_dim)``: its new tokens' K/V, already in ``k_buf``/``v_buf``."""
        keys, values = self._keys[layer], self._values[layer]
        bd, capacity = keys.shape[:2]
        smax = self._table.shape[1]
        if self._refill:  # whole rows, padded with slot 0 up to the capacity (finite values everywhere)
            slots = F.pad(self._table, (0, capacity - smax)).reshape(-1)
            torch.index_select(k_buf, 0, slots, out=keys.view(bd * capacity, *keys.shape[2:]))
            torch.index_select(v_buf, 0, slots, out=values.view(bd * capacity, *values.shape[2:]))
        else:
            keys[self._rows, self._pos] = self._pool.kv_format.encode(k)
            values[self._rows, self._pos] = self._pool.kv_format.encode(v)
        self._layers_done += 1
        return keys[:, :smax], values[:, :smax]
