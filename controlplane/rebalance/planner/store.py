"""Planner state and the newest recommendation per router, in Redis (the telemetry store's client).

Keys (prefix settings.REDIS_KEY_PREFIX): ``<p>:plan:<router id>:state`` (PlannerState JSON) and
``<p>:plan:<router id>:rec`` (the recommendation JSON). Both are derived data: losing them restarts the
persistence and smoothing windows, nothing else.
"""

import json

from django.conf import settings

from controlplane.rebalance.planner.core import PlannerState
from controlplane.telemetry.store import client


def _key(router_id: int, what: str) -> str:
    return f"{settings.REDIS_KEY_PREFIX}:plan:{router_id}:{what}"


def load_state(router_id: int) -> PlannerState:
    raw = client().get(_key(router_id, "state"))
    return PlannerState.from_dict(json.loads(raw)) if raw else PlannerState()


def save(router_id: int, state: PlannerState, recommendation: dict) -> None:
    pipe = client().pipeline()
    pipe.set(_key(router_id, "state"), json.dumps(state.to_dict()))
    pipe.set(_key(router_id, "rec"), json.dumps(recommendation))
    pipe.execute()


def latest(router_id: int) -> dict | None:
    raw = client().get(_key(router_id, "rec"))
    return json.loads(raw) if raw else None
