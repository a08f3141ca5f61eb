"""The KV cache's storage dtypes (torch-free: the control plane and the sizing tool read it too).

``--dtype`` / ``--kv-cache-dtype`` names, their element bytes, and the per (token, KV head) scale an ``int8``
row carries (``engine/cache/kv_format.py`` lays rows out; ``engine/sizing/kv.py`` counts their bytes).
"""

from __future__ import annotations

KV_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1}
SCALE_BYTES = {"int8": 2}  # one bfloat16 scale per (token, KV head)
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8_e4m3", "fp8_e5m2", "int8")  # --kv-cache-dtype choices


def resolve_kv_cache_dtype(kv_cache_dtype: str, compute_dtype: str) -> str:
    """The dtype the KV cache stores: ``compute_dtype`` for ``auto``, else ``kv_cache_dtype``.

    Raises ``ValueError`` naming the choices for anything not in :data:`KV_CACHE_DTYPES`."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"{kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    return compute_dtype if kv_cache_dtype == "auto" else kv_cache_dtype


def dtype_bytes(name: str) -> int:
    """Bytes of one element of KV dtype ``name`` (``--dtype`` / ``--kv-cache-dtype`` names).

    Raises ``ValueError`` naming the dtype.
    """
    if name not in KV_DTYPES:
        raise ValueError(f"unknown KV dtype {name!r} (one of {', '.join(KV_DTYPES)})")
    return KV_DTYPES[name]
