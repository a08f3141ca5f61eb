"""A real file L3 backend that also logs which process wrote or read which page (the MLA L3 bench and tests).

Loaded through the ``dynamic`` storage backend (``module_path`` ``engine.bench.counting_storage``,
``class_name`` ``CountingFileStorage``) so a multi-rank worker's every rank uses it; ``count_path`` in the
extra config names the log. Each line is ``<op> <pid> <key>`` for ``op`` in ``set`` (a page handed to the
store to write) and ``get`` (a page read back); lines are appended with one ``write`` each, so ranks do not
interleave them.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch

from engine.cache.storage.base import HiCacheStorageConfig
from engine.cache.storage.file import HiCacheFile


class CountingFileStorage(HiCacheFile):
    """``HiCacheFile`` whose writes and reads are logged to ``count_path``."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict) -> None:
        super().__init__(storage_config)
        self._log = str(kwargs["count_path"])

    def _note(self, op: str, keys: Sequence[str], ok: Sequence[bool]) -> None:
        lines = "".join(f"{op} {os.getpid()} {k}\n" for k, good in zip(keys, ok, strict=True) if good)
        if lines:
            fd = os.open(self._log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, lines.encode())
            finally:
                os.close(fd)

    def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
        ok = super().set(key, value, target_location, target_sizes)
        self._note("set", [key], [ok])
        return ok

    def get(self, key, target_location=None, target_sizes=None):
        out = super().get(key, target_location, target_sizes)
        self._note("get", [key], [out is not None])
        return out

    def batch_set_v1(self, keys, host_indices: torch.Tensor, extra_info=None) -> list[bool]:
        ok = super().batch_set_v1(keys, host_indices, extra_info)
        self._note("set", keys, ok)
        return ok

    def batch_get_v1(self, keys, host_indices: torch.Tensor, extra_info=None) -> list[bool]:
        ok = super().batch_get_v1(keys, host_indices, extra_info)
        self._note("get", keys, ok)
        return ok


def counts(log: Path) -> dict[str, Counter]:
    """``{op: Counter(pid -> pages)}`` from a ``count_path`` log (empty when nothing was logged)."""
    out: dict[str, Counter] = {"set": Counter(), "get": Counter()}
    if log.exists():
        for line in log.read_text().splitlines():
            op, pid, _ = line.split(" ", 2)
            out[op][int(pid)] += 1
    return out
