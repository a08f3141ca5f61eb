"""Websocket message envelope and group names (the only shapes the consumer forwards).

Envelope: {"v": 1, "type": "<domain>.<event>", "id": uuid hex, "ts": ISO-8601 UTC, "seq": int, "data": {...}}.
Types: worker.series (the worker page's newest point, telemetry.worker_view), fleet.metrics (the fleet summary
and the first page of its table), fleet.rows (another page of the table, group "fleet.page.<n>"),
pools.samples (a PD router's workers' newest scrapes, the rebalance page's pool figures),
operation.state_changed, operation.target_changed, rebalance.state_changed, rebalance.step_changed,
fleet.alert (a reconciler alert opened, changed or resolved; group "alerts"), control.subscribed,
control.error, control.revoked (server-internal: closes the sockets of a revoked token). Groups clients may
subscribe: "fleet", "fleet.page.<n>", "alerts", "operations", "worker.<id>", "pools.<router id>",
"operation.<id>", "rebalances", "rebalance.<id>"; "token.<prefix>" holds a token's sockets, "user.<id>" every
socket of a user, "session.<digest>" the sockets of one console login session.
"""

import hashlib
import re
import uuid
from datetime import UTC, datetime

EVENT_TYPES = frozenset(
    {
        "worker.series",
        "fleet.metrics",
        "fleet.rows",
        "pools.samples",
        "operation.state_changed",
        "operation.target_changed",
        "rebalance.state_changed",
        "rebalance.step_changed",
        "fleet.alert",
        "control.subscribed",
        "control.error",
        "control.revoked",
    }
)
GROUP_PATTERN = re.compile(
    r"^(fleet|fleet\.page\.\d+|alerts|operations|worker\.\d+|pools\.\d+|operation\.\d+|rebalances|rebalance\.\d+)$"
)
ALERTS_GROUP = "alerts"  # every reconciler alert's fleet.alert events


def envelope(event_type: str, data: dict, seq: int = 0) -> dict:
    if event_type not in EVENT_TYPES:
        raise ValueError(f"unknown event type {event_type!r}")
    return {
        "v": 1,
        "type": event_type,
        "id": uuid.uuid4().hex,
        "ts": datetime.now(UTC).isoformat(),
        "seq": seq,
        "data": data,
    }


def worker_group(worker_id: int) -> str:
    return f"worker.{worker_id}"


def pools_group(router_id: int) -> str:
    """The group of a PD router's rebalance page: its prefill and decode workers' scrapes."""
    return f"pools.{router_id}"


def operation_group(operation_id: int) -> str:
    return f"operation.{operation_id}"


def rebalance_group(rebalance_id: int) -> str:
    return f"rebalance.{rebalance_id}"


def token_group(prefix: str) -> str:
    """The sockets opened with one API token (joined on connect, never subscribable)."""
    return f"token.{prefix}"


def user_group(user_id: int) -> str:
    """Every socket of one user (joined on connect, never subscribable): closed when the user is deactivated
    or deleted."""
    return f"user.{user_id}"


def session_group(session_key: str) -> str:
    """The sockets of one console login session (joined on connect): closed on logout. The key is a
    credential, so the group is named by a digest of it."""
    return "session." + hashlib.sha256(session_key.encode()).hexdigest()[:32]
