"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over the paged L1 pool, in plain torch.

The pool holds one latent per token and layer: the normalised ``c_kv`` (``kv_lora_rank`` values) followed by
the rotated ``k_pe`` (``qk_rope_head_dim``), shared by every head (upstream's ``MLATokenToKVPool``). KVFleet's
pools keep a K and a V row per (token, layer, head); an MLA pool has one head whose K row is the latent's
first half and whose V row its second half, so the bytes per token are upstream's and every tier, layout,
L3 page and PD transfer moves the latent unchanged (``--kv-cache-dtype``: each half is encoded as a row).

Per sequence, attention reads the latent of all its tokens through its slots. A prefill chunk expands it
with ``kv_b_proj`` into per-head ``k_nope`` / ``v`` (transformers' ``expand_kv``), appends the shared
``k_pe`` to every head's key and runs SDPA with the causal mask by absolute position (a query at position p
sees keys 0..p). A sequence adding one token (decode) attends in the latent space instead (upstream's
weight absorption): its query's ``q_nope`` goes through each head's ``W_UK`` (the k part of ``kv_b_proj``)
into the latent, scores are taken against the cached latent ``[c_kv, k_pe]`` itself, and the weighted sum
of ``c_kv`` goes through each head's ``W_UV``: the same numbers without expanding every cached token for
every head at every step (``S x heads x (qk_nope + v) x kv_lora_rank`` multiply-adds per layer saved).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.cache.device_pool import DeviceKVPool
from engine.model.forward_batch import ForwardBatch


@dataclass
class _Seq:
    start: int  # first new token of this sequence in the flat batch
    end: int
    slots: torch.Tensor  # (S,) slots of all tokens of the sequence, in position order
    mask: torch.Tensor | None  # (E, S) bool; None: the new tokens are the whole sequence (plain causal)


class MLAAttention:
    """One instance serves every layer of a model: ``init_forward_metadata`` once per batch, ``forward``
    once per layer. Works for any mix of prefill chunks (with or without cached prefix) and decodes, on the
    CPU or CUDA."""

    def __init__(
        self,
        num_heads: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        scale: float,
    ) -> None:
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.scale = scale
        self.latent_dim = kv_lora_rank + qk_rope_head_dim
        self._seqs: list[_Seq] = []

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Each sequence's slots and, when it has a cached prefix, its position mask."""
        self._seqs, start = [], 0
        for i, (seq_len, ext) in enumerate(zip(batch.seq_lens_cpu, batch.extend_lens_cpu, strict=True)):
            mask = None
            if ext != seq_len:
                key_pos = torch.arange(seq_len, device=batch.positions.device)
                mask = key_pos[None, :] <= batch.positions[start : start + ext, None]
            self._seqs.append(_Seq(start, start + ext, batch.req_slots(i), mask))
            start += ext

    def forward(
        self,
        q: torch.Tensor,
        latent: torch.Tensor,
        layer_id: int,
        batch: ForwardBatch,
        kv_pool: DeviceKVPool,
        kv_b: Callable[[torch.Tensor], torch.Tensor],
        absorbed: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Attention output ``(T, num_heads, v_head_dim)``.

        ``q``: ``(T, num_heads, qk_nope_head_dim + qk_rope_head_dim)`` (RoPE applied to its rope part);
        ``latent``: ``(T, kv_lora_rank + qk_rope_head_dim)``, the new tokens' normalised ``c_kv`` then rotated
        ``k_pe``, written to ``batch.out_cache_loc`` of layer ``layer_id`` before attention reads the pool;
        ``kv_b``: ``kv_b_proj``, ``(S, kv_lora_rank)`` to
        ``(S, num_heads * (qk_nope_head_dim + v_head_dim))``; ``absorbed``: its weight split per head,
        ``W_UK`` ``(num_heads, qk_nope_head_dim, kv_lora_rank)`` and ``W_UV`` ``(num_heads, v_head_dim,
        kv_lora_rank)``, for the one-token sequences (None: they expand too).
        """
        half = self.latent_dim // 2
        kv_pool.set_kv(layer_id, batch.out_cache_loc, latent[:, None, :half], latent[:, None, half:])
        k_buf, v_buf = kv_pool.get_kv(layer_id)
        tokens, heads = q.shape[0], self.num_heads
        out = q.new_empty((tokens, heads, self.v_head_dim))
        for seq in self._seqs:
            lo = kv_pool.decode(torch.index_select(k_buf, 0, seq.slots), q.dtype)
            hi = kv_pool.decode(torch.index_select(v_buf, 0, seq.slots), q.dtype)
            cached = torch.cat((lo, hi), dim=-1)[:, 0]  # (S, latent_dim)
            if absorbed is not None and seq.end - seq.start == 1:
                out[seq.start] = self._absorbed(q[seq.start], cached, *absorbed)
                continue
            c_kv, k_pe = cached.split((self.kv_lora_rank, self.qk_rope_head_dim), dim=-1)
            s = cached.shape[0]
            kv = kv_b(c_kv).view(s, heads, self.qk_nope_head_dim + self.v_head_dim)
            k_nope, v = kv.split((self.qk_nope_head_dim, self.v_head_dim), dim=-1)
            k = torch.cat((k_nope, k_pe[:, None, :].expand(s, heads, self.qk_rope_head_dim)), dim=-1)
            o = F.scaled_dot_product_attention(
                q[seq.start : seq.end].transpose(0, 1).unsqueeze(0),  # (1, H, E, Dqk)
                k.transpose(0, 1).unsqueeze(0),  # (1, H, S, Dqk)
                v.transpose(0, 1).unsqueeze(0),  # (1, H, S, Dv)
                attn_mask=seq.mask,
                is_causal=seq.mask is None,
                scale=self.scale,
            )
            out[seq.start : seq.end] = o[0].transpose(0, 1)
        return out

    def _absorbed(
        self, q: torch.Tensor, cached: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor
    ) -> torch.Tensor:
        """One query ``q`` ``(H, qk_nope + qk_rope)`` over its sequence's latent ``cached``
        ``(S, latent_dim)``, in the latent space: ``(H, v_head_dim)``."""
        q_nope, q_pe = q.split((self.qk_nope_head_dim, self.qk_rope_head_dim), dim=-1)
        query = torch.cat((torch.einsum("hn,hnr->hr", q_nope, w_uk), q_pe), dim=-1)  # (H, latent_dim)
        scores = (query @ cached.T).float() * self.scale  # (H, S)
        probs = torch.softmax(scores, dim=-1).to(cached.dtype)
        out_latent = probs @ cached[:, : self.kv_lora_rank]  # (H, kv_lora_rank)
        return torch.einsum("hr,hvr->hv", out_latent, w_uv)
