"""Prefill/decode disaggregation: move a prompt's KV pages from a prefill worker's L1 pool into the pages
a decode worker reserved (SGLang's ``disaggregation/`` package shape; interface in docs/architecture.md,
PD transport).

``create_kv_manager`` builds the per-process transfer of a role (``PrefillTransfer`` / ``DecodeTransfer``;
upstream calls it the KV manager); P opens a ``KVSender`` per request, D a ``KVReceiver`` per request; the
scheduler polls them (``KVPoll``) and never blocks on the network.
"""

from __future__ import annotations

from engine.cache.device_pool import DeviceKVPool
from engine.disaggregation.base import (
    DisaggregationMode,
    KVPoll,
    KVTransferError,
    TransferBackendError,
    TransferTimeouts,
)
from engine.disaggregation.decode import DecodeTransfer
from engine.disaggregation.prefill import PrefillTransfer
from engine.disaggregation.receiver import KVReceiver
from engine.disaggregation.sender import KVSender
from engine.disaggregation.transport import transport_class

PDTransfer = PrefillTransfer | DecodeTransfer

__all__ = [
    "DecodeTransfer",
    "DisaggregationMode",
    "KVPoll",
    "KVReceiver",
    "KVSender",
    "KVTransferError",
    "PDTransfer",
    "PrefillTransfer",
    "TransferBackendError",
    "TransferTimeouts",
    "create_kv_manager",
]


def create_kv_manager(
    backend: str,
    mode: DisaggregationMode | str,
    pool: DeviceKVPool,
    host: str = "127.0.0.1",
    bootstrap_port: int | None = None,
    prefill_http_port: int | None = None,
    ib_device: str | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    model_kv_heads: int | None = None,
    **timeouts,
) -> PDTransfer:
    """The transfer of this worker's role, with ``pool``'s buffers registered with ``backend``.

    ``mode``: ``prefill`` (starts the bootstrap server on ``bootstrap_port``, 0 = a free port) or
    ``decode``. ``tp_rank`` of ``tp_size``: this process's tensor-parallel rank; a prefill rank > 0 starts
    no bootstrap server and registers at rank 0's, whose bound port ``bootstrap_port`` must then be.
    ``model_kv_heads`` (decode): the model's KV head count, for pairing with a prefill of another tp
    (``ModelConfig.kv_cache_heads``: 1 for an MLA latent, which every rank holds whole; None: the pool's
    heads x ``tp_size``, right only for unreplicated GQA heads, so pass it at ``tp_size`` > 1).
    ``timeouts``: ``TransferTimeouts`` fields overriding upstream's env values.
    Raises ``TransferBackendError`` (backend unknown or unusable), ``ValueError`` (bad mode or port),
    ``OSError`` (bootstrap port taken).
    """
    transport_class(backend)  # fail on a bad backend before binding anything
    mode = DisaggregationMode(mode)
    settings = TransferTimeouts.from_env(**timeouts)
    if mode == DisaggregationMode.PREFILL:
        if bootstrap_port is None or not 0 <= bootstrap_port <= 65535:
            raise ValueError(f"--disaggregation-bootstrap-port must be in [0, 65535], got {bootstrap_port!r}")
        return PrefillTransfer(
            backend, pool, host, bootstrap_port, settings, prefill_http_port, ib_device, tp_rank, tp_size
        )
    if mode == DisaggregationMode.DECODE:
        return DecodeTransfer(backend, pool, host, settings, ib_device, tp_rank, tp_size, model_kv_heads)
    raise ValueError("--disaggregation-mode null has no PD transfer")
