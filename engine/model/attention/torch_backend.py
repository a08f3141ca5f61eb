"""Reference attention in plain torch: gather K/V by slot, mask by absolute position, SDPA.

A query at absolute position p of a sequence sees every key of that sequence with position <= p (keys are
``req_slots[i]`` in position order, so key j has position j). Grouped-query attention maps KV head j to query
heads ``j*g .. j*g+g-1`` (HF ``repeat_kv``). Prefill chunks repeat K/V heads (keeps torch on its fused CPU
kernel) and get one SDPA call each (no padding waste); the decodes of a batch share one padded SDPA call in
which the g query heads of a KV head attend as g queries, so K/V are never repeated. A batch of decodes only
reads its K/V from buffers staged across steps (``staged_decode.py``: copied from the pool once, then one
token appended per step), unless they would be too large; then they are gathered per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.cache.device_pool import DeviceKVPool
from engine.model.attention.base import AttentionBackend
from engine.model.attention.staged_decode import DecodeStage
from engine.model.forward_batch import ForwardBatch


@dataclass
class _Extend:
    start: int  # first token of this sequence in the flat batch
    end: int
    slots: torch.Tensor  # (S,) slots of all tokens of the sequence
    mask: torch.Tensor | None  # (E, S) bool, None when the chunk has no cached prefix (plain causal)


@dataclass
class _Decode:
    token_index: torch.Tensor | None  # (Bd,) positions of the decode tokens in the flat batch; None: all
    slots: torch.Tensor  # (Bd * Smax,) slots, row-major, padded with slot 0
    mask: torch.Tensor | None  # (Bd, 1, 1, Smax) bool, None when all sequences have the same length
    shape: tuple[int, int]  # (Bd, Smax)
    keys: torch.Tensor | None = None  # (Bd * Smax, num_kv_heads, head_dim): one layer's gathered K, and V;
    values: torch.Tensor | None = None  # allocated by the first layer, refilled by every later one


class TorchAttentionBackend(AttentionBackend):
    """Works for any mix of prefill chunks (with or without cached prefix) and decodes, on CPU or CUDA."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self._extends: list[_Extend] = []
        self._decode: _Decode | None = None
        self._single = False
        self._stage = DecodeStage()
        self._kv_pool: DeviceKVPool | None = None  # the pool of the current forward (its format decodes)

    def _gather(self, buf: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``buf[slots]`` decoded (``DeviceKVPool.decode``) as ``(*slots.shape, num_kv_heads, head_dim)``.

        ``index_select`` copies rows at memcpy speed; advanced indexing is about 5x slower on CPU.
        """
        rows = torch.index_select(buf, 0, slots.reshape(-1))
        return self._kv_pool.decode(rows.view(*slots.shape, *buf.shape[1:]), dtype)

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.is_decode and min(batch.seq_lens_cpu) > 1:  # all decode: tensors as they are, no loop
            self._extends, self._single = [], False
            self._decode = self._build_decode(batch.req_to_token, batch.seq_lens, batch.seq_lens_cpu, None)
            smax = self._decode.shape[1]
            self._stage.plan(batch.req_to_token[:, :smax], batch.seq_lens, self._decode.mask, batch.seq_keys)
            return
        self._stage.reset()
        self._extends, decode_rows, start = [], [], 0
        positions = batch.positions
        for i, (seq_len, ext) in enumerate(zip(batch.seq_lens_cpu, batch.extend_lens_cpu, strict=True)):
            if ext == 1 and seq_len > 1:
                decode_rows.append((i, start))
            else:
                mask = None
                if ext != seq_len:
                    key_pos = torch.arange(seq_len, device=positions.device)
                    mask = key_pos[None, :] <= positions[start : start + ext, None]
                self._extends.append(_Extend(start, start + ext, batch.req_slots(i), mask))
            start += ext
        self._decode = None
        if decode_rows:
            device = positions.device
            index = torch.tensor([i for i, _ in decode_rows], dtype=torch.long, device=device)
            token_index = torch.tensor([s for _, s in decode_rows], dtype=torch.long, device=device)
            self._decode = self._build_decode(
                batch.req_to_token.index_select(0, index),
                batch.seq_lens.index_select(0, index),
                [batch.seq_lens_cpu[i] for i, _ in decode_rows],
                token_index,
            )
        self._single = len(self._extends) == 1 and self._decode is None

    @staticmethod
    def _build_decode(
        table: torch.Tensor, lens: torch.Tensor, lens_cpu: list[int], token_index: torch.Tensor | None
    ) -> _Decode:
        """Decode rows ``table`` ``(Bd, W)`` of the page table (padded with slot 0) cut to the longest of
        ``lens``, masked unless all have that length."""
        max_len = max(lens_cpu)
        slots = table[:, :max_len].reshape(-1)
        if min(lens_cpu) == max_len:
            return _Decode(token_index, slots, None, (table.shape[0], max_len))
        mask = torch.arange(max_len, device=table.device)[None, :] < lens[:, None]
        return _Decode(token_index, slots, mask[:, None, None, :], (table.shape[0], max_len))

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        batch: ForwardBatch,
        kv_pool: DeviceKVPool,
    ) -> torch.Tensor:
        kv_pool.set_kv(layer_id, batch.out_cache_loc, k, v)
        self._kv_pool = kv_pool
        k_buf, v_buf = kv_pool.get_kv(layer_id)
        if self._single:
            return self._extend(q, k_buf, v_buf, self._extends[0])
        out = torch.empty_like(q)
        for ext in self._extends:
            out[ext.start : ext.end] = self._extend(q[ext.start : ext.end], k_buf, v_buf, ext)
        dec = self._decode
        if dec is not None and dec.token_index is None:
            self._stage.begin(kv_pool)  # decides at the first layer of the batch, no-op for the others
            if self._stage.active:
                keys, values = self._stage.layer_kv(layer_id, k, v, k_buf, v_buf)
                return self._attend(q, kv_pool.decode(keys, q.dtype), kv_pool.decode(values, q.dtype), dec)
            return self._decode_attend(q, k_buf, v_buf, dec)
        if dec is not None:
            out[dec.token_index] = self._decode_attend(q[dec.token_index], k_buf, v_buf, dec)
        return out

    def decode_step_plan(self, kv_pool: DeviceKVPool) -> tuple | None:
        """After ``init_forward_metadata`` of a batch of decodes only, for a caller that runs all its layers
        itself (``engine/model/fused_decode.py``): ``(mode, slots, smax, mask, keys, values, rows, pos)``.
        mode 0: gather each layer's K/V through ``slots`` ``(Bd * smax,)``; 1: refill the staged per-layer
        buffers ``keys``/``values`` through ``slots`` ``(Bd * capacity,)``; 2: append each new token at
        ``rows``/``pos`` of them. None (nothing changed) for any other batch."""
        dec = self._decode
        if dec is None or dec.token_index is not None or self._extends:
            return None
        smax = dec.shape[1]
        if not self._stage.begin(kv_pool):
            return 0, dec.slots, smax, dec.mask, [], [], None, None
        slots, keys, values = self._stage.all_layers()
        if slots is not None:
            return 1, slots, smax, dec.mask, keys, values, None, None
        return 2, dec.slots, smax, dec.mask, keys, values, self._stage.rows, self._stage.pos

    def _extend(
        self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, ext: _Extend
    ) -> torch.Tensor:
        # 4-D (1, H, len, D) inputs: torch's fused CPU kernel takes only 4-D, 3-D falls back to the math path.
        # K/V stay at their KV heads (enable_gqa): the kernel maps query heads onto them, where repeating the
        # whole prefix to every query head cost a copy of it per layer per chunk (same output)
        keys = self._gather(k_buf, ext.slots, q.dtype).unsqueeze(0).transpose(1, 2)  # (1, KV, S, D)
        values = self._gather(v_buf, ext.slots, q.dtype).unsqueeze(0).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(0).transpose(1, 2),  # (1, H, E, D)
            keys,
            values,
            attn_mask=ext.mask,
            is_causal=ext.mask is None,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return out[0].transpose(0, 1)

    def _decode_attend(
        self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, dec: _Decode
    ) -> torch.Tensor:
        """Attention of the decode queries ``q`` ``(Bd, num_heads, head_dim)`` over their sequences' K/V.

        K/V rows are gathered into two buffers allocated by the first layer of the batch and refilled by every
        later one (``index_select(out=)``), so a step allocates them once instead of once per layer. GQA
        without repeating K/V: the g query heads of KV head j act as g queries against that head's keys.
        """
        if dec.keys is None or dec.keys.dtype != k_buf.dtype:
            dec.keys = torch.empty((dec.slots.shape[0], *k_buf.shape[1:]), dtype=k_buf.dtype, device=q.device)
            dec.values = torch.empty_like(dec.keys)
        torch.index_select(k_buf, 0, dec.slots, out=dec.keys)
        torch.index_select(v_buf, 0, dec.slots, out=dec.values)
        bd, smax = dec.shape
        shape = (bd, smax, *k_buf.shape[1:])  # stored rows: (num_kv_heads, row_dim)
        keys = self._kv_pool.decode(dec.keys.view(shape), q.dtype)
        return self._attend(q, keys, self._kv_pool.decode(dec.values.view(shape), q.dtype), dec)

    def _attend(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, dec: _Decode
    ) -> torch.Tensor:
        """Decode queries ``q`` ``(Bd, num_heads, head_dim)`` over ``keys``/``values``
        ``(Bd, Smax, num_kv_heads, head_dim)``, masked by ``dec.mask``."""
        bd = dec.shape[0]
        group = self.num_heads // self.num_kv_heads
        keys = keys.to(q.dtype).transpose(1, 2)
        values = values.to(q.dtype).transpose(1, 2)
        queries = q.reshape(bd, self.num_kv_heads, group, self.head_dim)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=dec.mask, scale=self.scale)
        return out.reshape(bd, self.num_heads, self.head_dim)
