"""Which live views are open: a count of websockets per worker page and per rebalance page in Redis, so each
publisher queries the TSDB once per interval for the open views only (one query for all of them), whatever
their viewers. Keys ``<prefix>:tm:watchers`` (hash: worker id -> sockets joined to its ``worker.<id>`` group)
and ``<prefix>:tm:watchers:pools`` (hash: router id -> sockets joined to its ``pools.<id>`` group, the
rebalance page's pool figures) and ``<prefix>:tm:watchers:fleetpages`` (hash: page -> sockets joined to its
``fleet.page.<page>`` group, a page of the fleet table past the first). A consumer adds on join and subtracts
on leave or disconnect; a count that a crashed process left behind only costs a query for nobody until its
counts are rebalanced by later joins and leaves (never below 0).
"""

from controlplane.telemetry.store import client, key

# group kind -> the hash of its sockets per id
_KEYS = {"worker": ("watchers",), "pools": ("watchers", "pools"), "fleet.page": ("watchers", "fleetpages")}


def ids(groups, kind: str = "worker") -> list[int]:
    """The ids of the ``<kind>.<id>`` groups among ``groups`` (kind ``worker``, ``pools``, ``fleet.page``)."""
    prefix = f"{kind}."
    return [int(g[len(prefix) :]) for g in groups if g.startswith(prefix) and g[len(prefix) :].isdigit()]


def worker_ids(groups) -> list[int]:
    """The worker ids of the ``worker.<id>`` groups among ``groups``."""
    return ids(groups, "worker")


def change(joined: list[int], left: list[int], kind: str = "worker") -> None:
    """Count one more socket on each of ``joined``, one fewer on each of ``left`` (at least 0), of the
    ``kind`` groups (``worker``: worker ids; ``pools``: router ids; ``fleet.page``: pages)."""
    if not joined and not left:
        return
    name = key(*_KEYS[kind])
    pipe = client().pipeline(transaction=False)
    for obj_id in joined:
        pipe.hincrby(name, str(obj_id), 1)
    for obj_id in left:
        pipe.hincrby(name, str(obj_id), -1)
    counts = pipe.execute()
    gone = [w for w, n in zip([*joined, *left], counts, strict=True) if n <= 0]
    if gone:
        client().hdel(name, *map(str, gone))


def change_groups(joined, left) -> None:
    """:func:`change` for every counted kind among the group names ``joined`` and ``left``."""
    for kind in _KEYS:
        change(ids(joined, kind), ids(left, kind), kind)


def watched(kind: str = "worker") -> list[int]:
    """Ids of the ``kind`` views (``worker``: worker ids; ``pools``: router ids; ``fleet.page``: pages of
    the fleet table) at least one socket has open now."""
    return sorted(int(w) for w, n in client().hgetall(key(*_KEYS[kind])).items() if int(n) > 0)
