"""L3 page keys: a per-page SHA-256 chain over token ids, seeded with a namespace digest.

Follows SGLang's ``get_hash_str`` chain (docs/upstream.md H5): each token id is encoded as a 4-byte
little-endian unsigned integer and each page's digest chains on the previous page's raw 32 bytes, so a
key names a page *and its whole prefix*. The first page of a chain is seeded with a namespace digest of
(model, KV dtype, host layout, page size, TP shard, KV producer: weights digest, quantization and compute
dtype, :mod:`engine.model.loader.fingerprint`), so two models, checkpoints, quantizations, dtypes,
layouts, page sizes or shards never share a key (a decision that differs from upstream:
docs/architecture.md). A request's ``cache_salt`` reseeds its chain (:func:`salted_namespace`), so requests
with different salts never share a key either; without a salt the keys are the plain namespace's.

The same function serves ``exists``/``get``/``set`` and the radix-tree nodes, so the prefetch path
(re-hashing from a node's last key) and the tree reproduce identical chains.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch

NAMESPACE_VERSION = 2
_MAX_TOKEN = 2**32


def normalize_dtype_name(kv_dtype: str | torch.dtype) -> str:
    """``torch.float16`` / ``"torch.float16"`` / ``"float16"`` -> ``"float16"``."""
    name = str(kv_dtype)
    return name.removeprefix("torch.")


def namespace_digest(
    model_name: str,
    kv_dtype: str | torch.dtype,
    layout: str,
    page_size: int,
    tp_rank: int,
    tp_size: int,
    replicated: bool = False,
    producer: str = "",
    lcm_shards: int | None = None,
) -> bytes:
    """32-byte SHA-256 digest naming the KV namespace a page belongs to.

    ``replicated`` (MLA-style KV, identical on every rank) leaves the rank out so all ranks share keys;
    ``lcm_shards`` (pages stored in that many KV-head shards, ``tp_lcm_size``:
    :mod:`engine.cache.storage.shards`) names that count instead of the rank, so every rank and every TP
    size sharing it chains the same keys; otherwise the shard ``tp_rank/tp_size`` is part of the digest.
    ``producer`` names what computed the KV (:func:`engine.model.loader.fingerprint.kv_producer`; empty
    when unknown, e.g. a bare cache). Raises ``ValueError`` for an empty model name, ``page_size < 1``,
    ``lcm_shards < 1`` or a rank outside ``[0, tp_size)``.
    """
    if not model_name:
        raise ValueError("model_name must be a non-empty string")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} must be in [0, tp_size={tp_size})")
    if lcm_shards is not None and lcm_shards < 1:
        raise ValueError(f"lcm_shards must be >= 1, got {lcm_shards}")
    if replicated:
        shard = "replicated"
    elif lcm_shards is not None:
        shard = f"lcm{lcm_shards}"
    else:
        shard = f"tp{tp_rank}of{tp_size}"
    text = "\n".join(
        (
            f"kvfleet-l3-namespace-v{NAMESPACE_VERSION}",
            f"model={model_name}",
            f"dtype={normalize_dtype_name(kv_dtype)}",
            f"layout={layout}",
            f"page_size={page_size}",
            f"shard={shard}",
            f"producer={producer}",
        )
    )
    return hashlib.sha256(text.encode("utf-8")).digest()


def salted_namespace(namespace: bytes, salt: str | None) -> bytes:
    """The chain seed of requests with ``salt``: ``namespace`` itself for None, else
    ``sha256(namespace || b"cache_salt=" || utf8(salt))`` (32 bytes)."""
    if salt is None:
        return namespace
    return hashlib.sha256(namespace + b"cache_salt=" + salt.encode("utf-8")).digest()


def _token_bytes(token_ids: Sequence[int] | torch.Tensor | np.ndarray) -> bytes:
    arr = token_ids.detach().cpu().numpy() if isinstance(token_ids, torch.Tensor) else np.asarray(token_ids)
    if arr.size == 0:
        return b""
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ValueError(f"token_ids must be a 1-D sequence of integers, got dtype {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) >= _MAX_TOKEN:
        raise ValueError("token ids must be in [0, 2**32)")
    return arr.astype("<u4", copy=False).tobytes()


def page_hashes(
    token_ids: Sequence[int] | torch.Tensor | np.ndarray,
    page_size: int,
    prior: str | None,
    namespace: bytes,
) -> list[str]:
    """One 64-char lowercase hex SHA-256 per FULL page of ``token_ids`` (a trailing partial page is ignored).

    ``h_0 = sha256(namespace || le32(page 0))`` when ``prior`` is None, else
    ``sha256(bytes.fromhex(prior) || le32(page 0))``;
    ``h_i = sha256(bytes.fromhex(h_{i-1}) || le32(page i))``.
    ``token_ids``: 1-D ints (list, numpy array or tensor), each in ``[0, 2**32)``.
    Raises ``ValueError`` on an out-of-range token, ``page_size < 1``, a namespace that is not 32 bytes,
    or a ``prior`` that is not 64 hex characters.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if len(namespace) != 32:
        raise ValueError(f"namespace must be a 32-byte digest, got {len(namespace)} bytes")
    if prior is None:
        chain = namespace
    else:
        if len(prior) != 64:
            raise ValueError(f"prior must be a 64-char hex digest, got {prior!r}")
        chain = bytes.fromhex(prior)
    data = _token_bytes(token_ids)
    page_bytes = 4 * page_size
    keys = []
    for start in range(0, len(data) - page_bytes + 1, page_bytes):
        chain = hashlib.sha256(chain + data[start : start + page_bytes]).digest()
        keys.append(chain.hex())
    return keys
