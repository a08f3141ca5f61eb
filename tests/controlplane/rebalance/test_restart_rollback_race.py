"""The rollback of a restart-method step knows which process it talks to (the step runner on the real
database, the agent's state reported through the real heartbeat API; the worker and router are the real-HTTP
fakes of fakes.py).

A step asked the worker's agent to restart a decode as a prefill and its wait ran out. The agent may have
taken the request just then: the old process (still a decode) then answers /server_info and /health like a
worker that was never touched, until the agent stops it. The rollback withdraws the request and trusts the
live process only once the agent reports (heartbeat ``role_acks``) having seen the withdrawal's generation:
it then has restarted the worker (the rollback restarts it back) or never will (the old process stays).
"""

from datetime import timedelta

import pytest
from cp_factories import RouterFactory
from django.utils import timezone

from controlplane.inventory.models import EngineWorker
from controlplane.inventory.services import worker_role_request
from controlplane.rebalance.models import Rebalance, RebalanceStep
from controlplane.rebalance.services import rebalance_advance

pytestmark = pytest.mark.django_db
HOST = "gpu-race"


@pytest.fixture
def timed_out(fake_worker, fake_router, agent_for, personas, settings):
    """(rebalance, step, fake worker, agent client): a decode run by an agent, asked (request #1) to restart
    as a prefill by a step whose wait has run out; the router lists the old process."""
    settings.REBALANCE_RESTART_TIMEOUT_S = 300
    worker = fake_worker(pd_role="decode")
    agent = agent_for(HOST)
    body = {"host": {"name": HOST}, "workers": [{"name": "a0", "url": worker.url, "role": "decode"}]}
    assert agent.post("/api/v1/agent/register/", body, format="json").status_code == 200
    router = RouterFactory(name="pd", url=fake_router.url, mode="pd")
    row = EngineWorker.objects.get(url=worker.url)
    EngineWorker.objects.filter(pk=row.pk).update(router=router)
    fake_router.add(worker.url)
    asked = worker_role_request(worker=row, role="prefill", actor=personas["operator"][0])
    rb = Rebalance.objects.create(
        router=router, before_prefill=1, before_decode=2, target_prefill=2, target_decode=1, soak_s=1,
        idle_timeout_s=60, state="running", created_by=personas["operator"][0],
    )  # fmt: skip
    step = RebalanceStep.objects.create(
        rebalance=rb, index=0, worker=row, from_role="decode", to_role="prefill", method="restart",
        state="switching", switch_sent=True, restart_seq=asked["request_seq"],
        restart_requested_at=timezone.now() - timedelta(seconds=301), started_at=timezone.now(),
    )  # fmt: skip
    assert rebalance_advance(rebalance_id=rb.pk) == 0  # the wait ran out: rolling back
    step.refresh_from_db()
    assert step.state == "rolling_back" and "did not restart it as prefill within 300s" in step.rollback_cause
    return rb, step, worker, agent


def _beat(agent, url: str, seen: int, applied: int, role: str) -> dict:
    body = {"host": HOST, "workers": [url], "roles": {url: role},
            "role_acks": {url: {"seen": seen, "applied": applied}}}  # fmt: skip
    answer = agent.post("/api/v1/agent/heartbeat/", body, format="json")
    assert answer.status_code == 200, answer.content
    return answer.json()


def _advance(rb: Rebalance, times: int = 3) -> RebalanceStep:
    for _ in range(times):
        rebalance_advance(rebalance_id=rb.pk)
    return rb.steps.get()


def test_an_agent_that_took_the_request_as_the_wait_ran_out_restarts_it_and_the_rollback_restarts_it_back(
    timed_out, fake_router
):
    rb, step, worker, agent = timed_out
    step = _advance(rb)  # the old decode answers, healthy, but its agent has not confirmed the withdrawal
    assert step.state == "rolling_back" and step.withdrawn_seq == 2
    assert "withdrew its restart as prefill (request #2); its agent has confirmed #0" in step.explanation
    assert worker.url not in fake_router.urls(), "the old process is not re-added before the agent confirms"
    row = EngineWorker.objects.get(url=worker.url)
    assert (row.desired_role, row.role_request_seq) == ("", 2)

    # The agent had taken request #1 (its answer said so) before the withdrawal reached it: it stops the old
    # decode and starts a prefill; its next heartbeat says it has seen #2.
    assert _beat(agent, worker.url, seen=1, applied=1, role="decode")["request_seq"] == {worker.url: 2}
    assert _advance(rb).state == "rolling_back" and worker.url not in fake_router.urls()
    worker.pd_role = "prefill"
    _beat(agent, worker.url, seen=2, applied=1, role="prefill")
    step = _advance(rb, 1)  # settled: the prefill stays, so it is restarted back as a decode
    assert (
        step.restart_requested_at is not None
        and "asked its agent to restart it as decode" in step.explanation
    )
    answer = _beat(agent, worker.url, seen=2, applied=1, role="prefill")
    assert answer["restart"] == [{"worker_url": worker.url, "role": "decode", "seq": 3}]
    assert worker.url not in fake_router.urls()
    worker.pd_role = "decode"
    step = _advance(rb)
    assert step.state == "rolled_back", step.explanation
    assert "rolled back to decode (restarted by its agent;" in step.explanation
    assert fake_router.registered[-1] == {"url": worker.url, "worker_type": "decode"}
    assert Rebalance.objects.get(pk=rb.pk).state == "rolled_back"


def test_an_agent_that_never_took_the_request_leaves_the_old_process_which_is_re_added(
    timed_out, fake_router
):
    rb, step, worker, agent = timed_out
    assert _advance(rb).state == "rolling_back" and worker.url not in fake_router.urls()
    _beat(agent, worker.url, seen=2, applied=0, role="decode")  # it saw the withdrawal before taking #1
    step = _advance(rb)
    assert step.state == "rolled_back", step.explanation
    assert "not restarted: its agent confirmed it never carried out the withdrawn restart" in step.explanation
    assert step.restart_requested_at is None and worker.url in fake_router.urls()
    row = EngineWorker.objects.get(url=worker.url)
    assert (row.role, row.desired_role, row.role_seen_seq) == ("decode", "", 2)


def test_an_agent_that_never_confirms_leaves_the_worker_out_of_the_router(timed_out, fake_router, settings):
    rb, step, worker, agent = timed_out
    _beat(agent, worker.url, seen=1, applied=0, role="decode")  # it last saw request #1, then fell silent
    settings.REBALANCE_RESTART_TIMEOUT_S = 0
    RebalanceStep.objects.filter(pk=step.pk).update(idle_deadline_at=timezone.now())
    step = _advance(rb, 1)
    assert step.state == "rollback_failed", step.explanation
    assert (
        "its agent has confirmed #1, not #2 in time (it may still restart it); left out" in step.explanation
    )
    assert worker.url not in fake_router.urls()
    assert EngineWorker.objects.get(url=worker.url).desired_role == ""
