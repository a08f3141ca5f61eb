"""Inventory writes beyond generic CRUD, one module per job:

- workers: create / update (keys encrypted), drain / undrain from the worker's router;
- roles: the PD role a worker was seen running, and restarts in another role asked of its agent;
- agent: an agent's register and heartbeat;
- live_state: the L3 backend operations read back and the HiCache config read from the worker (by its
  agent, on demand, by operations), recorded on the worker;
- isolation: the cache isolation self-test of a worker (the agent's check, audited);
- routers: create / update, and the router's kind and version probed from it.
"""

from controlplane.inventory.services.agent import agent_heartbeat, agent_register
from controlplane.inventory.services.isolation import worker_check_isolation
from controlplane.inventory.services.live_state import (
    profile_extra,
    storage_profile_matching,
    worker_config_observed,
    worker_hicache,
    worker_hicache_read,
    worker_hicache_reported,
    worker_storage_observed,
)
from controlplane.inventory.services.roles import (
    worker_role_observed,
    worker_role_request,
    worker_role_withdraw,
)
from controlplane.inventory.services.routers import router_create, router_identify, router_update
from controlplane.inventory.services.workers import worker_create, worker_drain, worker_undrain, worker_update

__all__ = [
    "agent_heartbeat",
    "agent_register",
    "profile_extra",
    "router_create",
    "router_identify",
    "router_update",
    "storage_profile_matching",
    "worker_config_observed",
    "worker_check_isolation",
    "worker_create",
    "worker_drain",
    "worker_hicache",
    "worker_hicache_read",
    "worker_hicache_reported",
    "worker_role_observed",
    "worker_role_request",
    "worker_role_withdraw",
    "worker_storage_observed",
    "worker_undrain",
    "worker_update",
]
