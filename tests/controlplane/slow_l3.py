"""A real file L3 backend with injected latency: every batch read (an L3 -> L2 prefetch) waits
``read_delay_s`` seconds first, so loading a prefix from L3 costs more than recomputing it, as on hardware
whose L3 is slower than its prefill (a file L3 hit measured at 2,450 ms TTFT against 1,725 ms recomputed).
Writes and hit queries are not slowed. Loaded into a real engine through the ``dynamic`` backend (module
``tests.controlplane.slow_l3``, class ``SlowFile``, extra config ``read_delay_s`` + ``file_path``)."""

import time

from engine.cache.storage.file import HiCacheFile


class SlowFile(HiCacheFile):
    def __init__(self, storage_config, kwargs):
        super().__init__(storage_config)
        self.read_delay_s = float(kwargs["read_delay_s"])

    def batch_get(self, *args, **kwargs):
        time.sleep(self.read_delay_s)  # on the cache's prefetch thread, never the scheduler's
        return super().batch_get(*args, **kwargs)

    def batch_get_v1(self, *args, **kwargs):
        time.sleep(self.read_delay_s)
        return super().batch_get_v1(*args, **kwargs)
