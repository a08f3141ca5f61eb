"""What a step reads from and does to one PD worker and its router, all through controlplane.workerclient
(and, for a restart in a new role, the inventory's agent-role request): live PD state, idle, how its role
can change, router membership with type and bootstrap port, gates (health, bootstrap server, canary through
a chosen prefill/decode pair)."""

import time

from django.conf import settings

from controlplane.inventory.models import EngineWorker
from controlplane.inventory.services import worker_role_observed, worker_role_request, worker_role_withdraw
from controlplane.rebalance.models import Rebalance, SwitchMethod
from controlplane.rebalance.services import canary
from controlplane.workerclient import RouterClient, WorkerClient, WorkerError, bootstrap_host, bootstrap_info


def client_for(worker: EngineWorker, timeout: float | None = None) -> WorkerClient:
    return WorkerClient(worker.url, worker.admin_key, timeout=timeout, api_key=worker.api_key)


def router_for(rb: Rebalance) -> RouterClient:
    return RouterClient(rb.router.url)


def live_state(worker: EngineWorker) -> dict:
    """The worker's PD state from /server_info: role (`disaggregation_mode`), bootstrap port (a prefill's),
    idle flag and the counts behind it (running, waiting, PD transfers in flight, HTTP requests accepted and
    not answered yet: `is_idle` is false while any of them is not 0).
    Raises WorkerError when the worker does not answer."""
    info = client_for(worker).server_info()
    role = info.get("disaggregation_mode")
    return {
        "role": role,
        "bootstrap_port": info.get("disaggregation_bootstrap_port") if role == "prefill" else None,
        "is_idle": info.get("is_idle") is True,
        "num_running_reqs": info.get("num_running_reqs"),
        "num_waiting_reqs": info.get("num_waiting_reqs"),
        "num_pd_transfer_reqs": info.get("num_pd_transfer_reqs"),
        "num_http_reqs": info.get("num_http_reqs"),
        # in place only where the worker speaks KVFleet's /pd_role_switch contract (probed: upstream SGLang's
        # route answers otherwise, so it is restarted in the new role by its agent instead)
        "role_switch": info.get("enable_pd_role_switch") is True and worker.can("role_switch"),
        "page_size": info.get("page_size"),
    }


ROLE_FIELDS = ("role", "bootstrap_port", "role_switch", "page_size")


def role_facts(state: dict | None) -> dict | None:
    """The part of a `live_state` that says what the worker is (role, bootstrap port, role switch, page
    size), without the load counters that change by the second; None stays None."""
    return None if state is None else {k: state[k] for k in ROLE_FIELDS if k in state}


def agent_managed(worker: EngineWorker) -> bool:
    """An agent runs the worker: an agent registered it on its host (``EngineWorker.last_seen`` is set only
    by agent register and heartbeat; a worker typed in by hand has none, even on an agent's host), so that
    agent can restart it in another role."""
    return worker.host_id is not None and worker.last_seen is not None


def switch_method(worker: EngineWorker, state: dict) -> str | None:
    """How the worker's role can change: ``switch`` in place when it runs with ``--enable-pd-role-switch``
    (its live /server_info says so), else ``restart`` by its agent, else None (it cannot change role)."""
    if state.get("role_switch"):
        return SwitchMethod.SWITCH
    return SwitchMethod.RESTART if agent_managed(worker) else None


def cannot_switch_reason(worker: EngineWorker) -> str:
    return (
        f"{worker.name} cannot change role: not started with --enable-pd-role-switch, and no agent runs it "
        "to restart it in the new role (no agent registered it)"
    )


def request_restart(rb: Rebalance, worker: EngineWorker, role: str, live_role: str) -> int:
    """Ask the worker's agent to restart it in `role` (its ``desired_role``, audited; the agent reads it
    from its next heartbeat answer); returns the request's generation (``role_request_seq``). The role the
    worker was just seen running, `live_role`, is recorded first, so a stale inventory role never turns the
    request into a no-op."""
    worker_role_observed(worker=worker, role=live_role)
    answer = worker_role_request(
        worker=worker, role=role, actor=rb.created_by, reason=f"rebalance {rb.pk}: run as {role}"
    )
    return answer["request_seq"]


def withdraw_restart(rb: Rebalance, worker: EngineWorker) -> int:
    """Withdraw the worker's pending agent restart, if any (audited); returns the generation its agent must
    report as seen before the live process can be trusted (no older request will be carried out then)."""
    return worker_role_withdraw(
        worker=worker, actor=rb.created_by, reason=f"rebalance {rb.pk}: restart withdrawn (rollback)"
    )


def agent_ack(worker: EngineWorker) -> tuple[int, int]:
    """(seen, applied) as the worker's agent last reported them: the newest role-request generation it has
    processed, and the newest request it carried out (restarted the worker in that role)."""
    row = EngineWorker.objects.values("role_seen_seq", "role_applied_seq").get(pk=worker.pk)
    return row["role_seen_seq"], row["role_applied_seq"]


def restarted(worker: EngineWorker, role: str) -> tuple[dict | None, str]:
    """(live state, what was seen): the state once the worker's /server_info reports `role` and /health
    answers, else None with what it shows (unreachable while the agent restarts it, the old role, ...)."""
    try:
        state = live_state(worker)
        if state["role"] != role:
            return None, f"still runs {state['role']}"
        client_for(worker).health()
    except WorkerError as exc:
        return None, f"not answering ({exc.message})"
    return state, f"runs {role}, healthy"


def busy_summary(state: dict) -> str:
    return (
        f"running={state.get('num_running_reqs')} waiting={state.get('num_waiting_reqs')} "
        f"pd_transfers={state.get('num_pd_transfer_reqs')} http={state.get('num_http_reqs')}"
    )


def router_entry(rb: Rebalance, worker: EngineWorker) -> dict | None:
    return router_for(rb).find_worker(worker.router_url)


def router_add(rb: Rebalance, worker: EngineWorker, state: dict) -> None:
    """Register the worker with its live role and (prefill) bootstrap port, and return once the router lists
    it with that type (the router queues the add: POST /workers answers 202 first), polled every 0.1 s
    for at most REBALANCE_ROUTER_JOIN_TIMEOUT_S. Raises WorkerError (also when it is not listed in time)."""
    router = router_for(rb)
    url, role = worker.router_url, state["role"]
    router.add_worker(url, worker_type=role, bootstrap_port=state["bootstrap_port"])
    deadline = time.monotonic() + settings.REBALANCE_ROUTER_JOIN_TIMEOUT_S
    while (entry := router.find_worker(url)) is None or entry.get("worker_type") != role:
        if time.monotonic() >= deadline:
            raise WorkerError(f"router {rb.router.name} does not list it as {state['role']}: {entry}")
        time.sleep(0.1)


def router_remove(rb: Rebalance, worker: EngineWorker) -> None:
    router_for(rb).remove_worker(worker.router_url)


def gate(rb: Rebalance, worker: EngineWorker, state: dict, *, canary: bool) -> str:
    """'' when the worker may serve in its live role, else why not: /health answers, a prefill's bootstrap
    server answers GET /route (every rank registered), and with `canary` every canary prompt sent through the
    new pairing (this worker with a peer of the other role the router serves) gives the greedy text recorded
    before the rebalance started."""
    try:
        client_for(worker).health()
    except WorkerError as exc:
        return f"health check failed: {exc.message}"
    if state["role"] == "prefill":
        if not state["bootstrap_port"]:
            return "prefill reports no bootstrap port"
        try:
            bootstrap_info(bootstrap_host(worker.url), state["bootstrap_port"])
        except WorkerError as exc:
            return f"bootstrap server on port {state['bootstrap_port']} does not answer: {exc.message}"
    if not canary:
        return ""
    return _canary(rb, worker, state)


def _peer(rb: Rebalance, role: str) -> tuple[EngineWorker, dict] | None:
    """A worker of `role` the router serves now (healthy in its list), with its router entry."""
    listed = {str(e.get("url", "")).rstrip("/"): e for e in router_for(rb).list_workers()}
    for worker in rb.router.workers.order_by("name"):
        entry = listed.get(worker.router_url)
        if entry and entry.get("worker_type") == role and entry.get("is_healthy", True):
            return worker, entry
    return None


def _canary(rb: Rebalance, worker: EngineWorker, state: dict) -> str:
    other = "decode" if state["role"] == "prefill" else "prefill"
    try:
        peer = _peer(rb, other)
    except WorkerError as exc:
        return f"canary: cannot list the router's workers: {exc.message}"
    if peer is None:
        return f"canary: the router serves no healthy {other} to pair with"
    peer_worker, entry = peer
    timeout = settings.REBALANCE_CANARY_TIMEOUT_S
    mine, theirs = client_for(worker, timeout), client_for(peer_worker, timeout)
    if state["role"] == "prefill":
        return canary.check(rb.canary, mine, theirs, state["bootstrap_port"])
    return canary.check(rb.canary, theirs, mine, entry.get("bootstrap_port"))
