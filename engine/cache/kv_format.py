"""How a KV cache row is stored: ``--kv-cache-dtype auto|bfloat16|fp8_e4m3|fp8_e5m2|int8``.

A row is one token's K (or V) of one KV head. Every pool buffer (L1, L2 in each layout), every L3 page and
every PD transfer moves rows as opaque elements of the pool's storage dtype, so whatever a row holds travels
with it. A :class:`KVFormat` turns the model's K/V ``(..., H, D)`` into rows ``(..., H, row_dim)`` and back:

* ``auto`` / ``bfloat16`` / ``float32`` / ``float16``: the row is the head's ``D`` values in that dtype.
* ``fp8_e4m3`` / ``fp8_e5m2``: ``D`` bytes, torch's ``float8_e4m3fn`` / ``float8_e5m2`` bit patterns stored
  as ``uint8`` (values clamped to the format's finite range, no scale: a scale of 1.0, as upstream's default).
* ``int8``: ``D + 2`` bytes: ``D`` int8 values then one bfloat16 scale, so ``x ~= q * scale`` per
  (token, KV head). The scale is ``amax / 127`` rounded to bfloat16 first and the values quantized against
  the rounded scale, so the only error is the int8 rounding.

Reading dequantizes to the compute dtype. The scale layout is part of ``name`` (``int8`` means this one),
which is what the L3 namespace and the PD first contact compare.
"""

from __future__ import annotations

import torch

from engine.cache.kv_dtypes import SCALE_BYTES, resolve_kv_cache_dtype

_FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_PLAIN = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
INT8_SCALE_LAYOUT = "per-token-head-bf16"  # int8's scale: one bfloat16 per (token, KV head), after the values


class KVFormat:
    """The storage format of a KV pool.

    ``kv_cache_dtype``: a ``--kv-cache-dtype`` choice; ``compute_dtype``: the model's dtype (what ``auto``
    resolves to and what :meth:`decode` returns). Raises ``ValueError`` for an unknown name.
    """

    def __init__(self, kv_cache_dtype: str, compute_dtype: torch.dtype, head_dim: int) -> None:
        compute_name = str(compute_dtype).removeprefix("torch.")
        self.name = resolve_kv_cache_dtype(kv_cache_dtype, compute_name)
        self.compute_dtype = compute_dtype
        self.head_dim = head_dim
        self.quantized = self.name in _FP8 or self.name == "int8"
        if self.name in _PLAIN:
            self.storage_dtype = _PLAIN[self.name]
        elif self.quantized:
            self.storage_dtype = torch.uint8
        else:
            raise ValueError(f"{kv_cache_dtype!r}: unsupported KV cache dtype")
        self.row_dim = head_dim + SCALE_BYTES.get(self.name, 0)

    @property
    def layout_name(self) -> str:
        """``name`` plus its scale layout (what the L3 namespace and the PD check compare)."""
        return f"int8/{INT8_SCALE_LAYOUT}" if self.name == "int8" else self.name

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Rows ``(..., H, row_dim)`` of ``storage_dtype`` for K or V ``x`` ``(..., H, D)``."""
        if not self.quantized:
            return x.to(self.storage_dtype)
        if self.name in _FP8:
            fp8 = _FP8[self.name]
            limit = torch.finfo(fp8).max
            return x.float().clamp(-limit, limit).to(fp8).view(torch.uint8)
        xf = x.float()
        scale = (xf.abs().amax(dim=-1, keepdim=True) / 127.0).clamp_min(1e-30).to(torch.bfloat16)
        q = torch.round(xf / scale.float()).clamp(-127, 127).to(torch.int8)
        return torch.cat((q.view(torch.uint8), scale.view(torch.uint8)), dim=-1)

    def decode(self, rows: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """K or V ``(..., H, D)`` in ``dtype`` (default: compute dtype) from rows ``(..., H, row_dim)``."""
        dtype = dtype or self.compute_dtype
        if not self.quantized:
            return rows.to(dtype)
        if self.name in _FP8:
            return rows.view(_FP8[self.name]).to(dtype)
        rows = rows.contiguous()
        d = self.head_dim
        q = rows[..., :d].view(torch.int8)
        scale = rows[..., d:].view(torch.bfloat16)
        return (q.to(torch.float32) * scale.to(torch.float32)).to(dtype)

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """``decode(encode(x))``: what a reader of the pool sees for ``x``."""
        return self.decode(self.encode(x), x.dtype)
