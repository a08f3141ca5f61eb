"""L1: the device KV pool, one K and one V buffer per layer, addressed by token slot.

Follows SGLang's ``MHATokenToKVPool``: slot ``s`` of layer ``l`` holds the key/value of one token,
``k_buffer[l][s]`` with shape ``(num_kv_heads, head_dim)``. Slots ``[0, page_size)`` are a padding page
that is never handed out, so a slot index of 0 can be used for padded positions. With a quantized
``kv_cache_dtype`` a slot holds encoded rows (``engine/cache/kv_format.py``): ``(num_kv_heads, row_dim)``
of ``uint8``, values and scale together. An MLA model (DeepSeek) has one head whose K and V rows are the two
halves of its per-token latent (``engine/model/attention/mla.py``).
"""

from __future__ import annotations

import torch

from engine.cache.kv_format import KVFormat
from engine.cache.kv_shape import KVShape


class DeviceKVPool:
    """Per-layer K/V buffers of shape ``(size + page_size, num_kv_heads, row_dim)``.

    All of them are views of one ``kv_buffer`` ``(2, num_layers, size + page_size, num_kv_heads, row_dim)``
    (K then V; the host pool's ``layer_first`` layout), so one kernel launch can move pages of every layer.

    ``dtype`` is the model's compute dtype; ``kv_cache_dtype`` (``auto``: ``dtype``) how rows are stored:
    ``self.dtype`` is the buffers' storage dtype, ``row_dim`` a row's width in it (``head_dim``, plus the
    scale for int8), ``kv_format`` encodes and decodes. ``size`` (tokens) must be a positive multiple of
    ``page_size``. ``device`` is ``cpu`` here and ``cuda`` on a GPU. Raises ``ValueError`` on a size or page
    size that does not fit, or an unknown ``kv_cache_dtype``.
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        kv_cache_dtype: str = "auto",
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if size < page_size or size % page_size:
            raise ValueError(f"device pool size {size} must be a positive multiple of page_size {page_size}")
        self.size = size
        self.page_size = page_size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.kv_format = KVFormat(kv_cache_dtype, dtype, head_dim)
        self.compute_dtype = dtype
        self.dtype = self.kv_format.storage_dtype
        self.row_dim = self.kv_format.row_dim
        item = self.dtype.itemsize
        self.kv_shape = KVShape(num_layers, num_kv_heads, head_dim, item, (self.row_dim - head_dim) * item)
        self.device = torch.device(device)
        shape = (2, num_layers, size + page_size, num_kv_heads, self.row_dim)
        self.kv_buffer = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.k_buffer = list(self.kv_buffer[0])
        self.v_buffer = list(self.kv_buffer[1])

    @property
    def kv_cache_dtype(self) -> str:
        """The resolved storage format name (``float32``, ``bfloat16``, ``fp8_e4m3``, ``int8``, ...)."""
        return self.kv_format.name

    @property
    def quantized(self) -> bool:
        """Rows are encoded (fp8 / int8): readers must :meth:`decode` what they gather."""
        return self.kv_format.quantized

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes of one token over all layers (int8's scales included)."""
        return self.kv_shape.bytes_per_token

    def set_kv(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``/``v`` ``(T, num_kv_heads, head_dim)`` into int64 ``slots`` of shape ``(T,)``."""
        self.k_buffer[layer][slots] = self.kv_format.encode(k)
        self.v_buffer[layer][slots] = self.kv_format.encode(v)

    def get_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole K and V buffers of ``layer`` (stored rows; :meth:`decode` them when ``quantized``)."""
        return self.k_buffer[layer], self.v_buffer[layer]

    def decode(self, rows: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows ``(..., num_kv_heads, row_dim)`` gathered from a buffer as K/V ``(..., num_kv_heads,
        head_dim)`` in ``dtype`` (default: the compute dtype)."""
        return self.kv_format.decode(rows, dtype)
