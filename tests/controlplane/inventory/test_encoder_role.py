"""EPD encoder workers in the inventory: the role the agent reports is stored, and their role is never
switched (the role request API refuses it, naming why; nothing is asked of the agent)."""

import pytest
from cp_factories import EngineWorkerFactory, HostFactory

from controlplane.core.exceptions import ConflictError
from controlplane.inventory.models import EngineWorker, WorkerRole
from controlplane.inventory.services import worker_role_request

pytestmark = pytest.mark.django_db


def test_an_encoder_is_never_asked_to_switch_roles(personas):
    worker = EngineWorkerFactory(host=HostFactory(), role=WorkerRole.ENCODER)
    with pytest.raises(ConflictError) as err:
        worker_role_request(worker=worker, role="prefill", actor=personas["operator"][0])
    assert err.value.code == "encoder_role" and "EPD encoder" in err.value.message
    row = EngineWorker.objects.get(pk=worker.pk)
    assert (row.role, row.desired_role, row.role_request_seq) == ("encoder", "", 0)


def test_the_role_api_answers_409_for_an_encoder(api_as):
    worker = EngineWorkerFactory(host=HostFactory(), role=WorkerRole.ENCODER)
    resp = api_as("operator").post(
        f"/api/v1/inventory/workers/{worker.pk}/role/", {"role": "decode"}, format="json"
    )
    assert resp.status_code == 409
    assert "EPD encoder" in resp.json()["error"]["message"]
