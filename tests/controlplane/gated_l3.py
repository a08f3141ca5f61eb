"""A real file L3 backend whose writes wait for a gate file: L2->L3 backups stay in flight, deterministically,
until the test creates it. Loaded into a real engine through the ``dynamic`` backend (module
``tests.controlplane.gated_l3``, class ``GatedFile``, extra config ``gate_file`` + ``file_path``)."""

import time
from pathlib import Path

from engine.cache.storage.file import HiCacheFile


class GatedFile(HiCacheFile):
    def __init__(self, storage_config, kwargs):
        super().__init__(storage_config)
        self.gate = Path(kwargs["gate_file"])

    def _wait_for_gate(self) -> None:
        while not self.gate.exists():  # polled on the backend's I/O thread, never the scheduler's
            time.sleep(0.02)

    def set(self, *args, **kwargs):
        self._wait_for_gate()
        return super().set(*args, **kwargs)

    def batch_set_v1(self, *args, **kwargs):
        self._wait_for_gate()
        return super().batch_set_v1(*args, **kwargs)
