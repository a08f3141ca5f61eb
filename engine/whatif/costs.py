"""Costs behind the TTFT estimate: prefill seconds per token and L2 / L3 read bandwidths.

Each is given on the command line or measured on this host: prefill by one forward pass of the model over
``tokens`` new tokens (after a warm-up pass), L2 -> L1 by copying a host buffer into a device-side buffer
(pinned host -> GPU on cuda, memory -> memory on cpu, as the ``direct`` io backend does), L3 -> L2 by
reading back page files written to a temporary directory (the ``file`` backend's path; the page cache is
warm, so this is an upper bound for a disk). The estimate is linear in tokens: a token served from cache
saves one token of prefill and costs its bytes at the tier's bandwidth (L3 tokens pay L3 -> L2 and then
L2 -> L1). Attention's quadratic part is not modelled, so long prompts save more than this says.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass

import torch

MIB = 1 << 20


@dataclass(frozen=True)
class Costs:
    """``prefill_s_per_token`` (s), ``l2_bytes_per_s`` (L2 -> L1), ``l3_bytes_per_s`` (L3 -> L2)."""

    prefill_s_per_token: float
    l2_bytes_per_s: float
    l3_bytes_per_s: float
    measured: tuple[str, ...] = ()

    def saving_s(self, served: tuple[int, int, int], bytes_per_token: int) -> float:
        """Prefill seconds saved by ``served`` = (L1, L2, L3) tokens, less their transfer time."""
        l1, l2, l3 = served
        cached = l1 + l2 + l3
        transfer = (l2 + l3) * bytes_per_token / self.l2_bytes_per_s
        transfer += l3 * bytes_per_token / self.l3_bytes_per_s
        return cached * self.prefill_s_per_token - transfer


def _best_of(fn, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_l2_bandwidth(num_bytes: int = 64 * MIB) -> float:
    """Bytes/s of a host -> device copy (host -> host without a GPU), best of three."""
    cuda = torch.cuda.is_available()
    src = torch.ones(num_bytes, dtype=torch.uint8, pin_memory=cuda)
    dst = torch.empty(num_bytes, dtype=torch.uint8, device="cuda" if cuda else "cpu")

    def copy() -> None:
        dst.copy_(src, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()

    copy()
    return num_bytes / _best_of(copy)


def measure_l3_bandwidth(page_bytes: int, num_bytes: int = 64 * MIB) -> float:
    """Bytes/s of reading ``num_bytes`` back from page files of ``page_bytes`` each, best of three."""
    pages = max(1, num_bytes // page_bytes)
    data = os.urandom(page_bytes)
    with tempfile.TemporaryDirectory(prefix="kvfleet-whatif-") as tmp:
        paths = [os.path.join(tmp, f"{i}.page") for i in range(pages)]
        for path in paths:
            with open(path, "wb") as f:
                f.write(data)

        def read() -> None:
            for path in paths:
                with open(path, "rb") as f:
                    f.readinto(bytearray(page_bytes))

        return pages * page_bytes / _best_of(read)


def measure_prefill(model_path: str, tokens: int = 512, dtype: str = "float32") -> float:
    """Seconds per token of one prefill forward pass of ``tokens`` new tokens on this host's device."""
    from engine.cache.device_pool import DeviceKVPool
    from engine.model.forward_batch import ForwardBatch
    from engine.model.runner import ModelRunner

    device = "cuda" if torch.cuda.is_available() else "cpu"
    runner = ModelRunner(model_path, dtype=dtype, device=device)
    spec = runner.kv_pool_spec()
    pool = DeviceKVPool(tokens, 1, **vars(spec))
    ids = torch.randint(0, runner.config.vocab_size, (tokens,)).tolist()
    batch = ForwardBatch.from_sequences([ids], [torch.arange(1, tokens + 1)], device=device)

    def forward() -> None:
        runner.forward(batch, pool)
        if device == "cuda":
            torch.cuda.synchronize()

    forward()
    return _best_of(forward, repeat=2) / tokens
