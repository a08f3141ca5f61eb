"""Tensor parallelism: the rank group every collective goes through, and how a model is cut into shards.

``group.py`` holds ``TPGroup`` (all-reduce, all-gather, object broadcast from rank 0; gloo on the CPU, NCCL
for tensors on CUDA with a gloo group beside it for Python objects) and ``init_tp_group``; ``sharding.py``
holds ``TPShard`` (which query heads, KV heads, MLP columns and vocabulary rows a rank owns) and the
start-up check that a model's head counts suit a tp size.
"""

from engine.distributed.group import TPGroup, init_tp_group, single_rank
from engine.distributed.sharding import TPConfigError, TPShard, check_tp_size

__all__ = ["TPConfigError", "TPGroup", "TPShard", "check_tp_size", "init_tp_group", "single_rank"]
