"""The names of the radix cache's eviction policies (``--radix-eviction-policy``), the one list.

The engine's flag, the HiCache config, the admin contract (``PUT /hicache/config``), the what-if CLI and
the control plane's capacity what-if all take their choices from here. Imports only ``typing``, so the
control plane and the flag parser can use it without torch. ``arc`` is KVFleet's own (not an upstream
SGLang name); the others are upstream's. The order is the one every choice list shows.
"""

from __future__ import annotations

from typing import Literal, get_args

EvictionPolicy = Literal["lru", "lfu", "fifo", "mru", "filo", "priority", "arc"]
EVICTION_POLICIES: tuple[str, ...] = get_args(EvictionPolicy)
