"""TinyLFU-style admission for the lower tiers: a count-min sketch with a doorkeeper.

:class:`FrequencySketch` estimates how often a page has been asked for recently. A page is identified by
its prefix: ``id_i = hash(id_{i-1}, page_i)`` over the units of a key (a request's pages), seeded by the
request's ``cache_salt``, so the same tokens under another prefix or salt count apart. The first sighting of
an id only sets its doorkeeper bit (a set cleared at every aging); later sightings increment the sketch's
four counters (4-bit, saturating at 15). After ``sample`` increments every counter is halved and the
doorkeeper cleared, so old popularity fades. ``estimate`` is the smallest of the id's counters plus its
doorkeeper bit.

:class:`engine.cache.policy.CachePolicy` records every counted insert and asks the sketch before it spends
bandwidth and room in a lower tier (``docs/capacity.md``):

* ``l2``: a node that needs host slots when the host pool has none free is written to L2 only when its
  estimate beats the host eviction victim's (TinyLFU's duel); with free slots it is always admitted.
* ``l3``: a node written to L2 is backed up to L3 only when its estimate is at least 2 (asked for twice
  within the window: one-off prompts never reach the store); an L3 prefetch starts only when the first
  page it would fetch has an estimate of at least 2.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

ADMISSIONS = ("none", "tinylfu")
_MASK = (1 << 61) - 1
_SEEDS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x27D4EB2F165667C5)
L3_MIN_ESTIMATE = 2


def salt_seed(salt: str | None) -> int:
    """The chain seed of key space ``salt`` (0 for None), the same in every process."""
    if salt is None:
        return 0
    return int.from_bytes(hashlib.sha256(salt.encode("utf-8")).digest()[:8], "little")


def page_ids(key: Sequence, page_units: int, seed: int = 0) -> list[int]:
    """One prefix-chained id per full page of ``page_units`` units of ``key`` (hashable units)."""
    ids, h = [], seed
    for start in range(0, len(key) - page_units + 1, page_units):
        h = hash((h, tuple(key[start : start + page_units]))) & _MASK
        ids.append(h)
    return ids


class FrequencySketch:
    """Count-min sketch (4 rows of ``width`` 4-bit counters) + doorkeeper, aged every ``sample`` adds.

    ``width`` is rounded up to a power of two; ``sample`` defaults to ``10 * width``."""

    def __init__(self, width: int = 1 << 16, sample: int | None = None) -> None:
        self.width = 1 << max(4, (width - 1).bit_length())
        self.sample = sample or 10 * self.width
        self.rows = [bytearray(self.width) for _ in _SEEDS]
        self.doorkeeper: set[int] = set()
        self.additions = 0

    def _slots(self, item: int) -> list[int]:
        return [((item ^ seed) * 0x9E3779B1 >> 7) & (self.width - 1) for seed in _SEEDS]

    def add(self, item: int) -> None:
        """Count one sighting of ``item``."""
        if item not in self.doorkeeper:
            self.doorkeeper.add(item)
        else:
            for row, slot in zip(self.rows, self._slots(item), strict=True):
                if row[slot] < 15:
                    row[slot] += 1
        self.additions += 1
        if self.additions >= self.sample:
            self._age()

    def estimate(self, item: int) -> int:
        """Estimated recent sightings of ``item`` (0 when never seen since it aged out)."""
        count = min(row[slot] for row, slot in zip(self.rows, self._slots(item), strict=True))
        return count + (item in self.doorkeeper)

    def _age(self) -> None:
        for row in self.rows:
            for i, value in enumerate(row):
                if value:
                    row[i] = value >> 1
        self.doorkeeper.clear()
        self.additions //= 2
