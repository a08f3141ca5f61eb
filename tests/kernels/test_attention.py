"""Paged decode and extend attention kernels (interpreted) against dense masked SDPA.

Each sequence's K/V sit at scattered slots of a NaN-initialised pool (an unread slot stays NaN, a read of a
wrong one poisons the output); the reference gathers them densely and runs torch SDPA in fp32 with the
causal mask by absolute position. GQA ratios 1/3/4; prefix lengths 0, 1, page-1, page and many pages.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.attention import decode_attention, extend_attention, num_decode_splits

PAGE, KV_HEADS, HEAD_DIM = 16, 2, 16
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
PREFIXES = (0, 1, PAGE - 1, PAGE, 3 * PAGE + 5)


def _pool(total: int, dtype: torch.dtype, gen: torch.Generator):
    """NaN pool of ``total`` + spare slots; returns ``(k_buf, v_buf, slots)`` with ``total`` random
    distinct slots holding random K/V."""
    k_buf = torch.full((total + 64, KV_HEADS, HEAD_DIM), float("nan"), dtype=dtype)
    v_buf = k_buf.clone()
    slots = torch.randperm(total + 64, generator=gen)[:total]
    k_buf[slots] = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v_buf[slots] = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    return k_buf, v_buf, slots


def _table(seq_lens: list[int], slots: torch.Tensor) -> torch.Tensor:
    """``req_to_token`` ``(B, max_len + 3)`` (wider than needed; padding slot 0 is NaN)."""
    table = torch.zeros(len(seq_lens), max(seq_lens) + 3, dtype=torch.int64)
    start = 0
    for b, n in enumerate(seq_lens):
        table[b, :n] = slots[start : start + n]
        start += n
    return table


def _reference(q, k_buf, v_buf, table, seq_lens, extend_lens, scale):
    """Dense masked SDPA in fp32: ``(T, Hq, D)``."""
    group = q.shape[1] // KV_HEADS
    outs, start = [], 0
    for b, (n, e) in enumerate(zip(seq_lens, extend_lens, strict=True)):
        keys = k_buf[table[b, :n]].float().repeat_interleave(group, 1).transpose(0, 1)  # (Hq, n, D)
        values = v_buf[table[b, :n]].float().repeat_interleave(group, 1).transpose(0, 1)
        queries = q[start : start + e].float().transpose(0, 1)  # (Hq, e, D)
        mask = torch.arange(n)[None, :] <= torch.arange(n - e, n)[:, None]
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)
        outs.append(out.transpose(0, 1))
        start += e
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_extend_over_cached_prefixes(group, dtype):
    gen = torch.Generator().manual_seed(group)
    extend_lens = [5, 1, 17, 3, 20]  # new tokens per sequence, one per prefix length
    seq_lens = [p + e for p, e in zip(PREFIXES, extend_lens, strict=True)]
    k_buf, v_buf, slots = _pool(sum(seq_lens), dtype, gen)
    table = _table(seq_lens, slots)
    q = torch.randn(sum(extend_lens), KV_HEADS * group, HEAD_DIM, generator=gen).to(dtype)
    out = torch.full_like(q, float("nan"))
    cu = torch.tensor([0, *extend_lens]).cumsum(0)
    scale = HEAD_DIM**-0.5
    extend_attention(q, k_buf, v_buf, out, table, torch.tensor(seq_lens), cu, max(extend_lens), scale)
    ref = _reference(q, k_buf, v_buf, table, seq_lens, extend_lens, scale)
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=0)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_decode_over_the_page_table(group, dtype, splits):
    """``splits`` 3: split-KV decode, including empty splits for the 1- and 2-token sequences."""
    gen = torch.Generator().manual_seed(10 + group)
    seq_lens = [p + 1 for p in PREFIXES]
    k_buf, v_buf, slots = _pool(sum(seq_lens), dtype, gen)
    table = _table(seq_lens, slots)
    q = torch.randn(len(seq_lens), KV_HEADS * group, HEAD_DIM, generator=gen).to(dtype)
    out = torch.full_like(q, float("nan"))
    scale = HEAD_DIM**-0.5
    decode_attention(q, k_buf, v_buf, out, table, torch.tensor(seq_lens), scale, num_splits=splits)
    ref = _reference(q, k_buf, v_buf, table, seq_lens, [1] * len(seq_lens), scale)
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=0)


def test_head_dim_that_is_not_a_power_of_two():
    gen = torch.Generator().manual_seed(7)
    dim = 24
    k_buf = torch.randn(40, KV_HEADS, dim, generator=gen)
    v_buf = torch.randn(40, KV_HEADS, dim, generator=gen)
    table = torch.randperm(40, generator=gen)[:20].view(1, 20)
    q = torch.randn(1, 2 * KV_HEADS, dim, generator=gen)
    out = torch.full_like(q, float("nan"))
    decode_attention(q, k_buf, v_buf, out, table, torch.tensor([20]), dim**-0.5)
    keys = k_buf[table[0]].repeat_interleave(2, 1).transpose(0, 1)
    values = v_buf[table[0]].repeat_interleave(2, 1).transpose(0, 1)
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, scale=dim**-0.5).transpose(0, 1)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_bad_shapes_are_refused():
    k_buf = torch.zeros(8, 2, 16)
    with pytest.raises(ValueError, match="the KV pool is torch.float32: torch.float16 expected"):
        q = torch.zeros(1, 2, 16, dtype=torch.float16)
        decode_attention(q, k_buf, k_buf, q.clone(), torch.zeros(1, 4, dtype=torch.long), torch.ones(1), 1.0)
    with pytest.raises(ValueError, match="q \\(1, 3, 16\\)"):
        q = torch.zeros(1, 3, 16)
        decode_attention(q, k_buf, k_buf, q.clone(), torch.zeros(1, 4, dtype=torch.long), torch.ones(1), 1.0)


def test_decode_splits_only_when_the_batch_cannot_fill_the_gpu():
    assert num_decode_splits(batch=64, kv_heads=8, max_seq_len=4096) == 1  # 512 programs already
    assert num_decode_splits(batch=1, kv_heads=8, max_seq_len=4096) == 16  # 4096 keys / 256, capped at 16
    assert num_decode_splits(batch=1, kv_heads=8, max_seq_len=300) == 2  # at least 256 keys per split
    assert num_decode_splits(batch=4, kv_heads=2, max_seq_len=100) == 1


def _quantized_pool(total: int, kv_format: str, gen: torch.Generator):
    """Like :func:`_pool` for a quantized KV cache: uint8 rows written by the engine's own encoder, every
    other slot 0xFF bytes (NaN in both float8 formats and in int8's bfloat16 scale). Returns the raw
    buffers, their dequantized fp32 copies (the reference reads those) and the slots."""
    from engine.cache.kv_format import KVFormat

    fmt = KVFormat(kv_format, torch.float32, HEAD_DIM)
    k_buf = torch.full((total + 64, KV_HEADS, fmt.row_dim), 0xFF, dtype=torch.uint8)
    v_buf = k_buf.clone()
    slots = torch.randperm(total + 64, generator=gen)[:total]
    for buf in (k_buf, v_buf):
        buf[slots] = fmt.encode(3 * torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen))
    return k_buf, v_buf, fmt.decode(k_buf), fmt.decode(v_buf), slots


@pytest.mark.parametrize("kv_format", ["fp8_e4m3", "fp8_e5m2", "int8"])
def test_quantized_pools_are_read_as_the_engine_decodes_them(kv_format):
    """The kernels dequantize in place: the same result as attention over the engine's own decode of the
    rows (``KVFormat.decode``), for decode (split and not) and extend, GQA 3."""
    gen = torch.Generator().manual_seed(21)
    scale, group = HEAD_DIM**-0.5, 3
    seq_lens = [p + 1 for p in PREFIXES]
    k_buf, v_buf, k_ref, v_ref, slots = _quantized_pool(sum(seq_lens), kv_format, gen)
    table = _table(seq_lens, slots)
    q = torch.randn(len(seq_lens), KV_HEADS * group, HEAD_DIM, generator=gen)
    ref = _reference(q, k_ref, v_ref, table, seq_lens, [1] * len(seq_lens), scale)
    for splits in (1, 3):
        out = torch.full_like(q, float("nan"))
        lens = torch.tensor(seq_lens)
        decode_attention(q, k_buf, v_buf, out, table, lens, scale, num_splits=splits, kv_format=kv_format)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    extend_lens = [1, 1, 5, 16, 9]
    q = torch.randn(sum(extend_lens), KV_HEADS * group, HEAD_DIM, generator=gen)
    out = torch.full_like(q, float("nan"))
    cu = torch.tensor([0, *extend_lens]).cumsum(0)
    lens = torch.tensor(seq_lens)
    extend_attention(q, k_buf, v_buf, out, table, lens, cu, max(extend_lens), scale, kv_format=kv_format)
    torch.testing.assert_close(
        out, _reference(q, k_ref, v_ref, table, seq_lens, extend_lens, scale), atol=1e-5, rtol=0
    )


def test_a_quantized_pool_needs_its_row_width_and_bytes():
    q = torch.zeros(1, 2, 16)
    table, lens = torch.zeros(1, 4, dtype=torch.long), torch.ones(1)
    with pytest.raises(ValueError, match="k/v rows of 16 for head dim 16 \\(int8: 18 expected\\)"):
        k_buf = torch.zeros(8, 2, 16, dtype=torch.uint8)
        decode_attention(q, k_buf, k_buf, q.clone(), table, lens, 1.0, kv_format="int8")
    with pytest.raises(ValueError, match="torch.uint8 expected"):
        k_buf = torch.zeros(8, 2, 16)
        decode_attention(q, k_buf, k_buf, q.clone(), table, lens, 1.0, kv_format="fp8_e4m3")
