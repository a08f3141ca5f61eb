"""Guided P:D rebalance against three real SmolLM2 engines (--enable-pd-role-switch, Mooncake over TCP)
behind the real router (smg) in PD mode, driven through the REST API and a real Celery worker on Redis.

One module-scoped fleet (P0, P1, D0 at the start: 2P1D) serves every scenario, in order; each scenario
leaves it at 2P1D or says where it leaves it; the last one adds a fourth worker. Client traffic through
the router runs during the role switches: no client request may fail and every answer must be the greedy
text recorded before.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from cp_factories import EngineWorkerFactory

from controlplane.audit.models import AuditEvent
from controlplane.bench.rebalance_fleet import (
    RouterLoad,
    greedy_texts,
    register,
    router_workers,
    server_roles,
    start_engines,
    start_router,
    stop_engines,
)
from controlplane.inventory.models import EngineWorker
from controlplane.rebalance.models import Rebalance
from controlplane.workerclient import RouterClient
from engine.bench.launcher import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]
ENV = {"SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2", "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "2"}
DEADLINE_S = 240.0  # a rebalance on a loaded 2-core machine (drain, switch, gates, soak per step)
SP = {"max_new_tokens": 8, "temperature": 0}
PROMPTS = [
    f"Question {i}: what is the colour of the sky over the sea at dawn in story {i}?" for i in range(6)
]
START = {"p0": "prefill", "p1": "prefill", "d0": "decode"}


@pytest.fixture(scope="module")
def fleet():
    procs = start_engines(START, switch=True, env=ENV)
    try:
        with start_router({n: p.url for n, p in procs.items()}, START, timeout=90) as router:
            expected = greedy_texts(router.url, PROMPTS, SP)
            yield {"procs": procs, "router": router.url, "expected": expected}
    finally:
        stop_engines(procs)  # with the worker the last scenario adds


def _poll(check, what: str, limit_s: float = 90.0):
    deadline = time.monotonic() + limit_s
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for: {what}"
        time.sleep(0.2)
    return value


def _urls(fleet) -> dict[str, str]:
    return {n: p.url for n, p in fleet["procs"].items()}


def _traffic(fleet) -> RouterLoad:
    """Two clients sending the prompts through the router in turn until stopped; every answer checked."""
    return RouterLoad(fleet["router"], fleet["expected"], SP)


@pytest.fixture
def inventory(fleet, celery_worker_process):
    """The router and its workers as inventory rows (each with the role it runs now)."""
    urls = _urls(fleet)
    return register(fleet["router"], urls, server_roles(urls), name="pd")


def _roles(fleet) -> dict[str, str]:
    """name -> live role in /server_info; the router lists each worker with that same type."""
    urls = _urls(fleet)

    def agree():
        listed, live = router_workers(fleet["router"]), server_roles(urls)
        return live if {n: listed.get(u) for n, u in urls.items()} == live else None

    try:  # smg registers a posted worker asynchronously: a moment may pass before it lists it
        return _poll(agree, "the router to list every worker in its live role", limit_s=60)
    except AssertionError:
        entries = httpx.get(f"{fleet['router']}/workers", timeout=5).json()["workers"]
        raise AssertionError((server_roles(urls), entries)) from None


def _split(roles: dict[str, str]) -> tuple[int, int]:
    return sum(r == "prefill" for r in roles.values()), sum(r == "decode" for r in roles.values())


def _create(api, router, target, **extra) -> httpx.Response:
    body = {"router": router.pk, "target": target, "soak_s": 3, "idle_timeout_s": 60, **extra}
    return api.post("/api/v1/rebalances/", body, format="json")


def _wait_state(rb_id: int, states: set[str], limit_s: float = DEADLINE_S) -> Rebalance:
    def reached():
        rb = Rebalance.objects.get(pk=rb_id)
        return rb if rb.state in states else None

    try:
        return _poll(reached, f"rebalance {rb_id} in {states}", limit_s)
    except AssertionError:
        rb = Rebalance.objects.get(pk=rb_id)
        raise AssertionError(
            (rb.state, rb.explanation, list(rb.steps.values("state", "explanation")))
        ) from None


def _audit(rb_id: int) -> list[AuditEvent]:
    return list(AuditEvent.objects.filter(extra__rebalance_id=rb_id).order_by("id"))


def _altered(canary: dict, text: str) -> dict:
    """The recorded canary set with the expected text of its last (longest) prompt replaced."""
    prompts = [*canary["prompts"][:-1], {**canary["prompts"][-1], "expected_text": text}]
    return {**canary, "prompts": prompts}


def _hold_pd_request(proc: ServerProcess) -> socket.socket:
    """A PD request on a prefill whose decode side never connects: it waits in the prefill's bootstrap
    queue (the worker is not idle) until the socket closes (the engine aborts it on disconnect)."""
    info = httpx.get(f"{proc.url}/server_info").json()
    body = {"text": "held", "sampling_params": {"max_new_tokens": 4}, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": info["disaggregation_bootstrap_port"], "bootstrap_room": 99}  # fmt: skip
    body = json.dumps(body).encode()
    head = "POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(body)}\r\n\r\n"
    sock = socket.create_connection(("127.0.0.1", proc.port))
    sock.sendall(head.encode() + body)
    _poll(lambda: not httpx.get(f"{proc.url}/server_info").json()["is_idle"], "held request queued")
    return sock


def test_the_reconciler_repairs_a_router_restarted_with_its_original_worker_list(fleet):
    """P1 switched in place to decode, as a rebalance step leaves it (the router lists it as a decode, its
    record's assigned role is decode); then the router lists it from its original command line, as a
    prefill, as a restarted router does. One reconcile pass registers it as a decode again, and no request
    after the repair fails or answers wrong. Leaves the fleet at 2P1D."""
    from controlplane.rebalance.services.reconcile import reconcile_all
    from controlplane.workerclient import WorkerClient

    procs, url = fleet["procs"], fleet["router"]
    p1 = procs["p1"]
    port = httpx.get(f"{p1.url}/server_info").json()["disaggregation_bootstrap_port"]
    urls = _urls(fleet)
    _, workers = register(url, urls, server_roles(urls), name="pd-reconcile")
    EngineWorker.objects.filter(pk=workers["p1"].pk).update(assigned_role="decode")
    client = RouterClient(url)
    client.remove_worker(p1.url)
    assert WorkerClient(p1.url).pd_role_switch("decode").success
    client.add_worker(p1.url, worker_type="decode")
    _poll(lambda: router_workers(url).get(p1.url) == "decode", "router lists P1 as decode")
    client.remove_worker(p1.url)  # the router restarted from its argv: --prefill P1 PORT
    client.add_worker(p1.url, worker_type="prefill", bootstrap_port=port)
    _poll(lambda: router_workers(url).get(p1.url) == "prefill", "router lists P1 as prefill again")

    (repair,) = reconcile_all()
    assert repair["action"] == "reconcile_router" and repair["worker"] == "p1"
    _poll(lambda: router_workers(url).get(p1.url) == "decode", "router lists P1 as decode after repair")
    assert _split(_roles(fleet)) == (1, 2)
    assert reconcile_all() == []
    with _traffic(fleet) as traffic:
        _poll(lambda: len(traffic.answers) >= 6, "six answers through the repaired router", 240)
    traffic.check()

    client.remove_worker(p1.url)  # back to 2P1D for the scenarios after this one
    assert WorkerClient(p1.url).pd_role_switch("prefill").success
    client.add_worker(p1.url, worker_type="prefill", bootstrap_port=port)
    _poll(lambda: router_workers(url).get(p1.url) == "prefill", "router lists P1 as prefill")
    assert _split(_roles(fleet)) == (2, 1)


def test_2p1d_to_1p2d_under_traffic(fleet, inventory, api_as):
    router, workers = inventory
    assert _roles(fleet) == START
    with _traffic(fleet) as traffic:
        r = _create(api_as("operator"), router, {"prefill": 1, "decode": 2}, reason="decode-heavy load")
        assert r.status_code == 201, r.content
        plan = r.json()
        assert plan["before"] == {"prefill": 2, "decode": 1} and plan["state"] == "running"
        (step,) = plan["steps"]  # the less loaded prefill at that moment (traffic runs)
        assert (step["from_role"], step["to_role"]) == ("prefill", "decode") and step["worker_name"] in START
        moved = step["worker_name"]
        prompts = plan["canary"]["prompts"]  # short, a sentence, one spanning KV pages (16 tokens each)
        assert len(prompts) == 3 and all(p["expected_text"] for p in prompts)
        tokens = [p["prompt_tokens"] for p in prompts]
        assert tokens == sorted(tokens) and tokens[0] < 16 and tokens[2] > 2 * 16, tokens
        second = _create(api_as("operator"), router, {"prefill": 1, "decode": 2})
        assert second.status_code == 409 and second.json()["error"]["code"] == "rebalance_active"
        rb = _wait_state(plan["id"], {"succeeded", "rolled_back", "failed", "aborted"})
    traffic.check()
    assert rb.state == "succeeded", rb.explanation
    assert _roles(fleet) == {**START, moved: "decode"}
    workers[moved].refresh_from_db()
    assert workers[moved].role == "decode"
    records = _audit(rb.pk)
    assert [e.action for e in records] == ["rebalance_create", "role_switch", "rebalance_finished"]
    switch = records[1]
    assert switch.outcome == "success" and switch.object_repr == moved
    assert (switch.before["role"], switch.after["role"]) == ("prefill", "decode")
    assert "served 3s (no SLO set: checked health and errors only)" in rb.steps.get().explanation
    (cost,) = api_as("viewer").get(f"/api/v1/rebalances/{rb.pk}/").json()["steps"]  # measured, in place
    assert cost["restart_s"] is None and 0 < cost["out_of_router_s"] < DEADLINE_S, cost


def test_per_step_approval_pause_and_resume_back_to_2p1d(fleet, inventory, api_as):
    router, workers = inventory
    before = _roles(fleet)
    assert _split(before) == (1, 2)
    op, viewer = api_as("operator"), api_as("viewer")
    r = _create(op, router, {"prefill": 2, "decode": 1}, approval="per_step")
    assert r.status_code == 201, r.content
    rb_id, (step,) = r.json()["id"], r.json()["steps"]
    assert (step["from_role"], step["to_role"]) == ("decode", "prefill")
    assert r.json()["state"] == "awaiting_approval"
    assert viewer.post(f"/api/v1/rebalances/{rb_id}/approve/").status_code == 403
    assert api_as("agent").get(f"/api/v1/rebalances/{rb_id}/").status_code == 403
    assert op.post(f"/api/v1/rebalances/{rb_id}/pause/", {"reason": "hold"}).json()["state"] == "paused"
    refused = op.post(f"/api/v1/rebalances/{rb_id}/approve/")
    assert refused.status_code == 409 and "paused" in refused.json()["error"]["message"]
    op.post(f"/api/v1/rebalances/{rb_id}/resume/")
    _wait_state(rb_id, {"awaiting_approval"})  # resumed: the step still waits for its approval
    assert _roles(fleet) == before  # nothing ran yet
    with _traffic(fleet) as traffic:
        assert op.post(f"/api/v1/rebalances/{rb_id}/approve/").status_code == 202
        rb = _wait_state(rb_id, {"succeeded", "rolled_back", "failed", "aborted"})
    traffic.check()
    assert rb.state == "succeeded", rb.explanation
    assert _roles(fleet) == {**before, step["worker_name"]: "prefill"}
    actions = [e.action for e in _audit(rb_id)]
    assert actions[:4] == ["rebalance_create", "rebalance_pause", "rebalance_resume", "rebalance_approve"]
    assert actions[4:] == ["role_switch", "rebalance_finished"]


def test_wrong_canary_rolls_the_switch_back_under_traffic(fleet, inventory, api_as):
    router, _ = inventory
    before = _roles(fleet)
    assert _split(before) == (2, 1)
    op = api_as("operator")
    r = _create(op, router, {"prefill": 1, "decode": 2}, approval="per_step")
    rb_id = r.json()["id"]
    rb = Rebalance.objects.get(pk=rb_id)
    real = rb.canary["prompts"][2]["expected_text"]  # the long one: every prompt of the set is checked
    Rebalance.objects.filter(pk=rb_id).update(canary=_altered(rb.canary, "not what SmolLM2 says"))
    with _traffic(fleet) as traffic:
        op.post(f"/api/v1/rebalances/{rb_id}/approve/")
        rb = _wait_state(rb_id, {"succeeded", "rolled_back", "failed", "aborted"})
    step = rb.steps.get()
    assert (rb.state, step.state) == ("rolled_back", "rolled_back"), (rb.explanation, step.explanation)
    traffic.check()
    assert _roles(fleet) == before
    assert step.switch_sent
    assert f"answered {real!r}, expected 'not what SmolLM2 says'" in step.rollback_cause
    records = _audit(rb_id)
    assert [e.action for e in records] == [
        "rebalance_create", "rebalance_approve", "role_switch_rollback", "rebalance_finished",
    ]  # fmt: skip
    rollback = records[2]
    assert rollback.outcome == "success" and "canary" in rollback.message
    assert (rollback.before["role"], rollback.after["role"]) == ("prefill", "prefill")
    assert records[3].outcome == "failure" and "rolled back: fleet at 2P1D" in records[3].message


def test_abort_while_draining_and_a_busy_worker_times_out(fleet, inventory, api_as):
    router, _ = inventory
    before = _roles(fleet)
    assert _split(before) == (2, 1)
    op = api_as("operator")
    # Abort: the planned donor holds a PD request, so it stays draining; abort re-adds it as a prefill.
    r = _create(op, router, {"prefill": 1, "decode": 2}, approval="per_step")
    rb_id, donor = r.json()["id"], r.json()["steps"][0]["worker_name"]
    held = _hold_pd_request(fleet["procs"][donor])
    try:
        op.post(f"/api/v1/rebalances/{rb_id}/approve/")
        _poll(lambda: Rebalance.objects.get(pk=rb_id).steps.get().state == "draining", "step draining")
        _poll(
            lambda: "pd_transfers=1" in Rebalance.objects.get(pk=rb_id).steps.get().explanation, "busy seen"
        )
        assert op.post(f"/api/v1/rebalances/{rb_id}/abort/", {"reason": "stop"}).status_code == 202
        rb = _wait_state(rb_id, {"aborted", "failed", "succeeded", "rolled_back"})
        assert rb.state == "aborted", rb.explanation
        step = rb.steps.get()
        assert (
            step.state == "cancelled" and not step.switch_sent and "re-added as prefill" in step.explanation
        )
        assert _roles(fleet) == before
        # Refused switch: the same held request keeps the donor busy past a short idle timeout.
        r = _create(op, router, {"prefill": 1, "decode": 2}, approval="per_step", idle_timeout_s=4)
        rb_id = r.json()["id"]
        assert r.json()["steps"][0]["worker_name"] != donor  # the least loaded prefill is planned first
        held2 = _hold_pd_request(fleet["procs"][r.json()["steps"][0]["worker_name"]])
        try:
            op.post(f"/api/v1/rebalances/{rb_id}/approve/")
            rb = _wait_state(rb_id, {"aborted", "failed", "succeeded", "rolled_back"})
        finally:
            held2.close()
    finally:
        held.close()
    assert rb.state == "rolled_back", rb.explanation
    step = rb.steps.get()
    assert step.state == "failed" and not step.switch_sent
    assert "not idle within 4s" in step.explanation and "pd_transfers=1" in step.explanation
    assert _roles(fleet) == before
    assert [e.action for e in _audit(rb_id)][-2:] == ["role_switch", "rebalance_finished"]


def test_two_steps_pause_between_them_and_approve_each(fleet, inventory, api_as):
    """A fourth worker joins as a prefill (3P1D); 3P1D -> 1P3D takes two steps: a pause asked during step 0
    takes effect after it, resume waits for step 1's approval, then step 1 runs. Runs last (adds a worker)."""
    router, _ = inventory
    extra = start_engines({"p2": "prefill"}, switch=True, env=ENV)["p2"]
    fleet["procs"]["p2"] = extra  # the fixture's teardown stops it
    RouterClient(fleet["router"]).add_worker(extra.url)
    _poll(lambda: router_workers(fleet["router"]).get(extra.url) == "prefill", "router lists p2 as prefill")
    EngineWorkerFactory(name="p2", url=extra.url, router=router, role="prefill")
    before = _roles(fleet)
    assert _split(before) == (3, 1)
    op = api_as("operator")
    r = _create(op, router, {"prefill": 1, "decode": 3}, approval="per_step", soak_s=5)
    assert r.status_code == 201, r.content
    rb_id, steps = r.json()["id"], r.json()["steps"]
    assert [(s["index"], s["from_role"], s["to_role"]) for s in steps] == [
        (0, "prefill", "decode"),
        (1, "prefill", "decode"),
    ]
    with _traffic(fleet) as traffic:
        op.post(f"/api/v1/rebalances/{rb_id}/approve/")
        running = {"draining", "switching", "gating", "soaking"}
        _poll(lambda: Rebalance.objects.get(pk=rb_id).steps.get(index=0).state in running, "step 0 running")
        assert op.post(f"/api/v1/rebalances/{rb_id}/pause/").json()["pause_requested"] is True
        rb = _wait_state(rb_id, {"paused", "succeeded", "rolled_back", "failed", "aborted"})
        assert rb.state == "paused", rb.explanation
        assert [s.state for s in rb.steps.order_by("index")] == ["succeeded", "pending"]
        op.post(f"/api/v1/rebalances/{rb_id}/resume/")
        rb = _wait_state(rb_id, {"awaiting_approval", "succeeded", "rolled_back", "failed", "aborted"})
        assert rb.state == "awaiting_approval" and "step 2 (" in rb.explanation  # the second, as shown
        op.post(f"/api/v1/rebalances/{rb_id}/approve/")
        rb = _wait_state(rb_id, {"succeeded", "rolled_back", "failed", "aborted"})
    traffic.check()
    assert rb.state == "succeeded", rb.explanation
    assert _roles(fleet) == {**before, **{s["worker_name"]: "decode" for s in steps}}
    actions = [e.action for e in _audit(rb_id)]
    assert actions == [
        "rebalance_create", "rebalance_approve", "rebalance_pause", "role_switch",
        "rebalance_resume", "rebalance_approve", "role_switch", "rebalance_finished",
    ]  # fmt: skip


def test_a_failed_second_step_rolls_back_the_first(fleet, inventory, api_as):
    """1P3D -> 3P1D, per step: step 0 succeeds; before step 1 the recorded canary text is altered in the
    database, so step 1's gate fails: it rolls itself back, then the rebalance rolls step 0 back (drained,
    switched back, re-added): 1P3D again, no client request failed."""
    router, _ = inventory
    before = _roles(fleet)
    assert _split(before) == (1, 3)
    op = api_as("operator")
    r = _create(op, router, {"prefill": 3, "decode": 1}, approval="per_step")
    rb_id = r.json()["id"]
    with _traffic(fleet) as traffic:
        op.post(f"/api/v1/rebalances/{rb_id}/approve/")
        rb = _wait_state(rb_id, {"awaiting_approval", "succeeded", "rolled_back", "failed", "aborted"})
        assert rb.state == "awaiting_approval" and rb.steps.get(index=0).state == "succeeded", rb.explanation
        Rebalance.objects.filter(pk=rb_id).update(canary=_altered(rb.canary, "altered"))
        op.post(f"/api/v1/rebalances/{rb_id}/approve/")
        rb = _wait_state(rb_id, {"succeeded", "rolled_back", "failed", "aborted"})
    traffic.check()
    assert rb.state == "rolled_back", rb.explanation
    assert _roles(fleet) == before
    first, second = rb.steps.order_by("index")
    assert (first.state, second.state) == ("rolled_back", "rolled_back")
    assert "canary" in second.rollback_cause and "the rebalance rolls back" in first.rollback_cause
    records = [(e.action, e.object_repr) for e in _audit(rb_id)]
    assert records == [
        ("rebalance_create", str(rb)), ("rebalance_approve", str(rb)), ("role_switch", first.worker.name),
        ("rebalance_approve", str(rb)), ("role_switch_rollback", second.worker.name),
        ("role_switch_rollback", first.worker.name), ("rebalance_finished", str(rb)),
    ]  # fmt: skip


def test_an_abort_after_the_switch_finishes_the_step(fleet, inventory, api_as):
    """1P3D -> 2P2D aborted while its step soaks: past its safe point, the step finishes and the rebalance
    ends aborted with it kept: 2P2D, every worker in the router in its role. (A soak's SLO breach rolling a
    step back is read from the TSDB, which this module's Celery worker has none of: the gate's figures are
    tested against a real Prometheus in tests/controlplane/telemetry/test_readers_equal_raw.py.)"""
    router, _ = inventory
    before = _roles(fleet)
    assert _split(before) == (1, 3)
    op = api_as("operator")
    r = _create(op, router, {"prefill": 2, "decode": 2}, soak_s=5)
    rb_id = r.json()["id"]

    def soaking_or_done():
        rb = Rebalance.objects.get(pk=rb_id)
        step = rb.steps.get()
        return (
            (rb.state, step.state, step.explanation)
            if step.state == "soaking" or rb.state != "running"
            else None
        )

    seen = _poll(soaking_or_done, "step soaking", DEADLINE_S)
    assert seen[:2] == ("running", "soaking"), seen
    assert op.post(f"/api/v1/rebalances/{rb_id}/abort/").json()["abort_requested"] is True
    rb = _wait_state(rb_id, {"succeeded", "rolled_back", "failed", "aborted"})
    assert (
        rb.state == "aborted" and "1 of 1 steps done" in rb.explanation and "fleet at 2P2D" in rb.explanation
    )
    step = rb.steps.get()
    assert step.state == "succeeded"
    assert _roles(fleet) == {**before, step.worker.name: "prefill"}
