"""Paged attention over the L1 KV pool: decode (one new token per sequence) and extend (prefill chunks).

Follows upstream's Triton attention backend (SGLang ``decode_attention.py`` / ``extend_attention.py``) in
what it computes: keys and values are read through a token page table ``req_to_token`` (row ``b`` lists the
pool slot of every token of sequence ``b`` in position order), grouped-query attention maps KV head ``j`` to
query heads ``j*G .. j*G+G-1`` (HF ``repeat_kv``), softmax is computed online in fp32 (flash attention), and
the new tokens' K/V are already in the pool when the kernel runs, so an extend reads its cached prefix and
itself the same way. Decode runs one program per sequence, KV head and KV split; with more than one split a
second launch merges the parts by their log-sum-exp (upstream's two-stage decode).

Shapes: ``Hq`` query heads, ``Hkv`` KV heads (``Hq % Hkv == 0``), ``D`` head dim (any; padded to a power of
two >= 16 inside the kernel), pool buffers ``(S, Hkv, R)`` with a contiguous last dim: ``R = D`` values of
``q``'s dtype, or a quantized KV cache's encoded rows (``engine/cache/kv_format.py``), read and dequantized
in the kernel (``kv_format``): ``fp8_e4m3`` / ``fp8_e5m2`` ``R = D`` bytes of float8 bits, ``int8``
``R = D + 2`` bytes, the int8 values then a bfloat16 scale. The float8 bits are widened through
float16's bit layout (integer shifts), so the same code runs on sm_80, which has no e4m3 type, and under
the interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import interpreting
from kernels.launch import helper, jit

BLOCK_N = 32  # keys per step
BLOCK_M = 16  # extend queries per program
BLOCK_H = 16  # decode: query heads of one KV head, padded (tl.dot needs >= 16 rows)
DECODE_PROGRAMS = 256  # split-KV decode aims at this many programs (about 2 per SM on an H100/H200)
MIN_SPLIT_KEYS = 256
MAX_SPLITS = 16
# Row reductions through ``tl.reduce`` with the standard library's combine functions rather than ``tl.max`` /
# ``tl.sum``: those are jit functions themselves, which an interpreted launch cannot call when Triton was
# imported without TRITON_INTERPRET (see kernels.launch); the interpreter maps these two to numpy.
_MAX = tl.standard._elementwise_max
_SUM = tl.standard._sum_combine
# ``kv_format`` -> the kernels' KV_FORMAT constexpr (any other name: rows of q's dtype)
KV_FORMATS = {"fp8_e4m3": 1, "fp8_e5m2": 2, "int8": 3}


@helper
def _load_rows(
    buf, rows, d, row_mask, d_mask, HEAD_DIM: tl.constexpr, KV_FORMAT: tl.constexpr, COMPUTE: tl.constexpr
):
    """K or V ``(BLOCK_N, BLOCK_D)`` in ``COMPUTE``: the pool rows at element offsets ``rows`` of ``buf``,
    dequantized per ``KV_FORMAT``; masked rows and columns read as 0."""
    raw = tl.load(buf + rows[:, None] + d[None, :], mask=row_mask[:, None] & d_mask[None, :], other=0)
    if KV_FORMAT == 0:
        x = raw.to(COMPUTE)
    elif (
        KV_FORMAT == 3
    ):  # int8 values, then a little-endian bfloat16 scale: its bits are a float32's top half
        lo = tl.load(buf + rows + HEAD_DIM, mask=row_mask, other=0).to(tl.int32)
        hi = tl.load(buf + rows + HEAD_DIM + 1, mask=row_mask, other=0).to(tl.int32)
        scale = ((hi << 24) | (lo << 16)).to(tl.float32, bitcast=True)
        x = (raw.to(tl.int8, bitcast=True).to(tl.float32) * scale[:, None]).to(COMPUTE)
    else:
        bits = raw.to(tl.int32)
        if KV_FORMAT == 1:  # e4m3fn: exponent and mantissa into float16's fields (bias 7 -> 15, so x 2^8)
            half = ((bits & 0x80) << 8) | ((bits & 0x7F) << 7)
            f = half.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
            f = tl.where((bits & 0x7F) == 0x7F, float("nan"), f)  # e4m3fn's only NaN pattern
        else:  # e5m2 is float16's top byte
            f = (bits << 8).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        x = f.to(COMPUTE)
    return x


@jit
def _decode_kernel(
    q,
    k_buf,
    v_buf,
    out,
    mid_o,
    mid_lse,
    req_to_token,
    seq_lens,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_req,
    num_heads,
    scale,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
    COMPUTE: tl.constexpr,
    KV_FORMAT: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + b)
    split_len = (seq_len + SPLITS - 1) // SPLITS
    first = split * split_len
    end = tl.minimum(first + split_len, seq_len)
    h = tl.arange(0, BLOCK_H)
    h_mask = h < GROUP
    heads = kv_head * GROUP + h
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q_tile = tl.load(
        q + b * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(COMPUTE)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_H], 0.0, tl.float32)
    acc = tl.full([BLOCK_H, BLOCK_D], 0.0, tl.float32)
    row = req_to_token + b.to(tl.int64) * stride_req
    for start in range(first, end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_mask = n < end
        slots = tl.load(row + n, mask=n_mask, other=0).to(tl.int64)
        k = _load_rows(
            k_buf, slots * stride_kt + kv_head * stride_kh, d, n_mask, d_mask, HEAD_DIM, KV_FORMAT, COMPUTE
        )
        s = tl.dot(q_tile, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _MAX))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, _SUM)
        v = _load_rows(
            v_buf, slots * stride_vt + kv_head * stride_vh, d, n_mask, d_mask, HEAD_DIM, KV_FORMAT, COMPUTE
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE), v, input_precision=PRECISION)
        m_i = m_new
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # an empty split (past a short sequence) has l = 0
    mask = h_mask[:, None] & d_mask[None, :]
    if SPLITS == 1:
        tl.store(
            out + b * stride_ot + heads[:, None] * stride_oh + d[None, :],
            o.to(out.dtype.element_ty),
            mask=mask,
        )
    else:
        part = (b * num_heads + heads).to(tl.int64) * SPLITS + split
        tl.store(mid_o + part[:, None] * HEAD_DIM + d[None, :], o, mask=mask)
        lse = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(mid_lse + part, lse, mask=h_mask)


@jit
def _decode_combine_kernel(
    out,
    mid_o,
    mid_lse,
    stride_ot,
    stride_oh,
    num_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    s_mask = sp < SPLITS
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    part = (b * num_heads + head).to(tl.int64) * SPLITS + sp
    lse = tl.load(mid_lse + part, mask=s_mask, other=float("-inf"))
    weight = tl.exp(lse - tl.reduce(lse, 0, _MAX))  # split 0 always holds keys, so the max is finite
    o = tl.load(
        mid_o + part[:, None] * HEAD_DIM + d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0
    )
    o = tl.reduce(o * weight[:, None], 0, _SUM) / tl.reduce(weight, 0, _SUM)
    tl.store(out + b * stride_ot + head * stride_oh + d, o.to(out.dtype.element_ty), mask=d_mask)


@jit
def _extend_kernel(
    q,
    k_buf,
    v_buf,
    out,
    req_to_token,
    seq_lens,
    cu_seqlens,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_req,
    scale,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    COMPUTE: tl.constexpr,
    KV_FORMAT: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    block = tl.program_id(2)
    q_start = tl.load(cu_seqlens + b)
    extend = tl.load(cu_seqlens + b + 1) - q_start
    seq_len = tl.load(seq_lens + b)
    prefix = seq_len - extend
    kv_head = head // GROUP
    m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = m < extend
    q_pos = prefix + m
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    tokens = (q_start + m).to(tl.int64)
    q_tile = tl.load(
        q + tokens[:, None] * stride_qt + head * stride_qh + d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(COMPUTE)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    # keys up to the last query of this block (causal); none when the block lies past this sequence
    end = tl.minimum(seq_len, prefix + (block + 1) * BLOCK_M)
    end = tl.where(block * BLOCK_M < extend, end, 0)
    row = req_to_token + b.to(tl.int64) * stride_req
    for start in range(0, end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_mask = n < end
        slots = tl.load(row + n, mask=n_mask, other=0).to(tl.int64)
        k = _load_rows(
            k_buf, slots * stride_kt + kv_head * stride_kh, d, n_mask, d_mask, HEAD_DIM, KV_FORMAT, COMPUTE
        )
        s = tl.dot(q_tile, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(n_mask[None, :] & (n[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _MAX))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, _SUM)
        v = _load_rows(
            v_buf, slots * stride_vt + kv_head * stride_vh, d, n_mask, d_mask, HEAD_DIM, KV_FORMAT, COMPUTE
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE), v, input_precision=PRECISION)
        m_i = m_new
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out + tokens[:, None] * stride_ot + head * stride_oh + d[None, :],
        o.to(out.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def _check(
    q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, out: torch.Tensor, kv_format: str
) -> tuple[int, int, int]:
    """(group, padded head dim, KV_FORMAT); raises ``ValueError`` for shapes or dtypes that do not fit."""
    if q.shape[1] % k_buf.shape[1] or k_buf.shape != v_buf.shape or out.shape != q.shape:
        raise ValueError(
            f"q {tuple(q.shape)}, k/v {tuple(k_buf.shape)}/{tuple(v_buf.shape)}, out {tuple(out.shape)}"
        )
    fmt = KV_FORMATS.get(kv_format, 0)
    row = q.shape[2] + (2 if kv_format == "int8" else 0)
    if k_buf.shape[2] != row or any(t.stride(-1) != 1 for t in (q, k_buf, v_buf, out)):
        raise ValueError(
            f"k/v rows of {k_buf.shape[2]} for head dim {q.shape[2]} ({kv_format}: {row} expected), "
            "or a last dim that is not contiguous"
        )
    want = torch.uint8 if fmt else q.dtype
    if k_buf.dtype != want:
        raise ValueError(f"the KV pool is {k_buf.dtype}: {want} expected for q {q.dtype} and {kv_format!r}")
    return q.shape[1] // k_buf.shape[1], max(16, triton.next_power_of_2(q.shape[2])), fmt


def _compute_dtype(dtype: torch.dtype) -> tl.dtype:
    """The dtype ``tl.dot`` runs in: the pool's, except fp32 for 16-bit pools under the interpreter, whose
    ``dot`` mishandles bf16 (numpy has no bf16; an exact widening, so results agree within rounding)."""
    if interpreting() and dtype != torch.float32:
        return tl.float32
    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dtype]


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 in full precision; ignored for 16-bit inputs


def num_decode_splits(batch: int, kv_heads: int, max_seq_len: int) -> int:
    """KV splits per sequence for decode: enough programs to fill a GPU (``DECODE_PROGRAMS``) when the batch
    is small, each split at least ``MIN_SPLIT_KEYS`` keys, at most ``MAX_SPLITS``."""
    by_length = -(-max_seq_len // MIN_SPLIT_KEYS)
    by_occupancy = -(-DECODE_PROGRAMS // max(1, batch * kv_heads))
    return max(1, min(by_length, by_occupancy, MAX_SPLITS))


def decode_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    out: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int = 1,
    kv_format: str = "auto",
) -> None:
    """Decode attention, written to ``out``.

    ``q``/``out``: ``(B, Hq, D)``, the one new token of each sequence (position ``seq_lens[b] - 1``);
    ``k_buf``/``v_buf``: ``(S, Hkv, R)`` one layer of the pool: ``q``'s dtype, or uint8 rows of the
    quantized ``kv_format`` (``fp8_e4m3``, ``fp8_e5m2``, ``int8``; see the module docstring);
    ``req_to_token``: integer ``(B, W)``, ``W >= max(seq_lens)``; ``seq_lens``: integer ``(B,)``, each
    >= 1. Every key of the sequence is attended. ``num_splits`` > 1 cuts each sequence's keys into that
    many parts run by separate programs and merged by their log-sum-exp in a second launch (upstream's
    split-KV decode; see :func:`num_decode_splits`). Raises ``ValueError`` for mismatched shapes or dtypes.
    """
    group, block_d, fmt = _check(q, k_buf, v_buf, out, kv_format)
    if group > BLOCK_H:
        raise ValueError(f"decode kernel handles at most {BLOCK_H} query heads per KV head, got {group}")
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    batch, heads, kv_heads = q.shape[0], q.shape[1], k_buf.shape[1]
    if batch == 0:
        return
    mid_o = mid_lse = out  # unused with one split
    if num_splits > 1:
        mid_o = torch.empty((batch, heads, num_splits, q.shape[2]), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((batch, heads, num_splits), dtype=torch.float32, device=q.device)
    _decode_kernel[(batch, kv_heads, num_splits)](
        q,
        k_buf,
        v_buf,
        out,
        mid_o,
        mid_lse,
        req_to_token,
        seq_lens,
        q.stride(0),
        q.stride(1),
        k_buf.stride(0),
        k_buf.stride(1),
        v_buf.stride(0),
        v_buf.stride(1),
        out.stride(0),
        out.stride(1),
        req_to_token.stride(0),
        heads,
        scale,
        GROUP=group,
        HEAD_DIM=q.shape[2],
        BLOCK_D=block_d,
        BLOCK_H=BLOCK_H,
        BLOCK_N=BLOCK_N,
        SPLITS=num_splits,
        PRECISION=_precision(q.dtype),
        COMPUTE=_compute_dtype(q.dtype),
        KV_FORMAT=fmt,
    )
    if num_splits > 1:
        _decode_combine_kernel[(batch, heads)](
            out,
            mid_o,
            mid_lse,
            out.stride(0),
            out.stride(1),
            heads,
            HEAD_DIM=q.shape[2],
            BLOCK_D=block_d,
            SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits),
        )


def extend_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    out: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_extend: int,
    scale: float,
    kv_format: str = "auto",
) -> None:
    """Causal extend attention, written to ``out``.

    ``q``/``out``: ``(T, Hq, D)``, the new tokens of all sequences concatenated; sequence ``b`` owns rows
    ``cu_seqlens[b] .. cu_seqlens[b+1]-1`` (integer ``(B+1,)``, ``cu_seqlens[0] == 0``), which are its last
    ``E_b`` positions; ``seq_lens`` integer ``(B,)`` (cached prefix + new); ``max_extend`` >= every ``E_b``
    (a host int: it sizes the grid). The query at position p attends the keys at positions 0..p. Other
    arguments as :func:`decode_attention`. Raises ``ValueError`` for mismatched shapes or dtypes.
    """
    group, block_d, fmt = _check(q, k_buf, v_buf, out, kv_format)
    batch = seq_lens.shape[0]
    if batch == 0 or max_extend == 0:
        return
    _extend_kernel[(batch, q.shape[1], triton.cdiv(max_extend, BLOCK_M))](
        q,
        k_buf,
        v_buf,
        out,
        req_to_token,
        seq_lens,
        cu_seqlens,
        q.stride(0),
        q.stride(1),
        k_buf.stride(0),
        k_buf.stride(1),
        v_buf.stride(0),
        v_buf.stride(1),
        out.stride(0),
        out.stride(1),
        req_to_token.stride(0),
        scale,
        GROUP=group,
        HEAD_DIM=q.shape[2],
        BLOCK_D=block_d,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        PRECISION=_precision(q.dtype),
        COMPUTE=_compute_dtype(q.dtype),
        KV_FORMAT=fmt,
    )
