"""Triton attention over the paged L1 pool (``--attention-backend triton``; SGLang's ``triton`` backend).

Per layer: the new tokens' K/V go to ``out_cache_loc`` (encoded, for a quantized ``--kv-cache-dtype``: the
kernels read and dequantize the rows themselves), then one kernel launch reads every key through the
batch's ``req_to_token`` page table (``kernels.attention``): the decode kernel when every sequence adds one
token (split over the keys when the batch is too small to fill the GPU), else the causal extend kernel over
all sequences (a decode in a mixed batch is an extend of one token). Runs on CUDA, or on the CPU under
``TRITON_INTERPRET=1`` (Triton's interpreter; slow). ``kernels`` is imported when the backend is built, so
the torch backend never imports Triton.
"""

from __future__ import annotations

import torch

from engine.cache.device_pool import DeviceKVPool
from engine.model.attention.base import AttentionBackend
from engine.model.forward_batch import ForwardBatch


class TritonAttentionBackend(AttentionBackend):
    """Decode and extend attention with Triton kernels; same inputs and outputs as the torch backend."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        from kernels import attention

        self._kernels = attention
        self._decode = False
        self._max_extend = 0
        self._splits = 1

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self._decode = batch.is_decode
        self._max_extend = max(batch.extend_lens_cpu)
        if self._decode:
            longest = max(batch.seq_lens_cpu)
            self._splits = self._kernels.num_decode_splits(batch.batch_size, self.num_kv_heads, longest)

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
        k_buf, v_buf = kv_pool.get_kv(layer_id)  # a quantized pool's raw rows: the kernels dequantize
        fmt = kv_pool.kv_format
        q = q.to(fmt.compute_dtype if fmt.quantized else k_buf.dtype)
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if self._decode:
            self._kernels.decode_attention(
                q, k_buf, v_buf, out, batch.req_to_token, batch.seq_lens, self.scale, self._splits, fmt.name
            )
        else:
            self._kernels.extend_attention(
                q,
                k_buf,
                v_buf,
                out,
                batch.req_to_token,
                batch.seq_lens,
                batch.cu_seqlens,
                self._max_extend,
                self.scale,
                fmt.name,
            )
        return out
