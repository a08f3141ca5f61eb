"""L3 -> L2 prefetch operations and termination policies (docs/upstream.md H3).

A ``PrefetchOperation`` is shared by the scheduler thread (which commits it) and the prefetch worker
(which fills its host slots). ``completed_tokens`` only moves, under ``lock``, after the data of those
tokens is in the host pool and while the op is not terminated; once terminated it is frozen, so both
sides agree which slots each frees.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch


@dataclass
class PrefetchOperation:
    """One request's prefetch: ``host_indices`` reserved for ``token_ids`` (page-aligned); ``salt``: the
    request's key space (seeds the L3 chain when ``last_hash`` is None)."""

    rid: str
    token_ids: list[int]
    host_indices: torch.Tensor
    last_hash: str | None
    prefix_keys: list[str] | None = None
    salt: str | None = field(default=None, repr=False)
    start_time: float = field(default_factory=time.monotonic)
    hash_value: list[str] = field(default_factory=list)
    completed_tokens: int = 0
    terminated: bool = False
    failed: bool = False
    hit_done: bool = False
    hit_tokens: int = 0  # the hit query's answer (tokens, MIN over ranks), also when it revoked the op
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def increment(self, tokens: int) -> bool:
        """Count ``tokens`` more as arrived unless terminated; returns False when terminated."""
        with self.lock:
            if self.terminated:
                return False
            self.completed_tokens += tokens
            return True

    def terminate(self) -> int:
        """Stop the op; returns the frozen ``completed_tokens``."""
        with self.lock:
            self.terminated = True
            return self.completed_tokens

    def is_complete(self, page_size: int) -> bool:
        """The hit query returned a non-empty hit and every hit page arrived."""
        with self.lock:
            return bool(self.hash_value) and self.completed_tokens == len(self.hash_value) * page_size


def prefetch_timeout(tokens: int, base: float, per_ki_token: float, maximum: float) -> float:
    """Seconds a ``timeout`` prefetch of ``tokens`` may take: ``min(max, base + per_ki*tokens/1024)``."""
    return min(maximum, base + per_ki_token * tokens / 1024)


def can_terminate(
    policy: str, op: PrefetchOperation, page_size: int, now: float, base: float, per_ki: float, maximum: float
) -> bool:
    """Whether ``policy`` lets the scheduler stop waiting for ``op`` now.

    best_effort: always; wait_complete: when complete; timeout: complete or past
    ``prefetch_timeout(len(hash_value) * page_size, ...)`` (just ``base`` before the hit query returns).
    """
    if policy == "best_effort":
        return True
    if op.is_complete(page_size):
        return True
    if policy == "wait_complete":
        return False
    with op.lock:
        hit_tokens = len(op.hash_value) * page_size
    return now - op.start_time > prefetch_timeout(hit_tokens, base, per_ki, maximum)
