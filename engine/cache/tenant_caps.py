"""Per-tenant occupancy caps on L2 and L3, and what they made the cache do.

A cap belongs to an *owner*: the part of a cache salt before its first ``/`` (the whole salt when it has
none; unsalted requests have no owner and are never capped). The worker's tenants file gives its tenants
salts built that way (``engine.server.tenants.tenant_salt``: a tenant's own salt, and
``<tenant salt>/<digest>`` for a body salt under it), so one cap covers every key space of a tenant.

- L2 (``l2_tokens``): tokens of the host pool the owner's tree nodes hold. A host copy that would take the
  owner over its cap first evicts the owner's own host-only leaves (least valuable first, by the tree's
  eviction policy); if they cannot make room (its pages are pinned or have children), the copy is refused
  (a write-back eviction then drops the device leaf, as an L2 admission refusal does) and so is an L3
  prefetch into L2. Other tenants' pages are never evicted for it.
- L3 (``l3_pages``): pages this worker has sent to the L3 backend for the owner since the backend was
  attached or last cleared (the backends have no delete, so a tenant over its cap stops being backed up
  rather than evicting its own keys; the pages already written stay readable).

Counters (``snapshot``) are per owner: host tokens held, L3 pages sent, host tokens evicted to stay under
the cap, host tokens refused an L2 copy, L3 pages not backed up. All mutation happens on the scheduler
thread; ``snapshot`` copies.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


def salt_owner(salt: str | None) -> str | None:
    """The owner a salt's pages count against (the part before the first ``/``; None for no salt)."""
    return None if salt is None else salt.split("/", 1)[0]


@dataclass(frozen=True)
class TenantCap:
    """One owner's caps: ``l2_tokens`` host-pool tokens, ``l3_pages`` pages sent to L3 (None: no cap).
    Raises ``ValueError`` naming the field for a cap that is not a positive integer."""

    l2_tokens: int | None = None
    l3_pages: int | None = None

    def __post_init__(self) -> None:
        for name in ("l2_tokens", "l3_pages"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


class TenantCaps:
    """The caps of one cache, keyed by owner (see :func:`salt_owner`), and their counters."""

    def __init__(self, caps: dict[str, TenantCap] | None = None) -> None:
        self.caps: dict[str, TenantCap] = dict(caps or {})
        self.l3_pages: Counter[str] = Counter()
        self.l2_evicted_tokens: Counter[str] = Counter()
        self.l2_refused_tokens: Counter[str] = Counter()
        self.l3_skipped_pages: Counter[str] = Counter()

    def __bool__(self) -> bool:
        return bool(self.caps)

    def of(self, salt: str | None) -> tuple[str, TenantCap] | None:
        """``(owner, cap)`` for a salt whose owner has a cap, else None."""
        owner = salt_owner(salt)
        cap = self.caps.get(owner) if owner is not None else None
        return None if cap is None or owner is None else (owner, cap)

    def reset_l3(self) -> None:
        """A new or cleared L3: nothing sent to it yet."""
        self.l3_pages.clear()

    def snapshot(self, host_tokens: dict[str | None, int]) -> dict[str, dict]:
        """Per capped owner: its caps, ``l2_tokens_used`` (from ``host_tokens``: tokens held per owner),
        ``l3_pages_sent`` and the counters."""
        return {
            owner: {
                "l2_tokens_cap": cap.l2_tokens,
                "l3_pages_cap": cap.l3_pages,
                "l2_tokens_used": host_tokens.get(owner, 0),
                "l3_pages_sent": self.l3_pages[owner],
                "l2_evicted_tokens": self.l2_evicted_tokens[owner],
                "l2_refused_tokens": self.l2_refused_tokens[owner],
                "l3_skipped_pages": self.l3_skipped_pages[owner],
            }
            for owner, cap in self.caps.items()
        }
