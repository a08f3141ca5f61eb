"""What-if replays are child processes: a user runs at most WHATIF_MAX_PER_USER at once and the control plane
WHATIF_MAX_RUNNING (429 beyond either, naming which); a finished run frees its slot."""

import pytest
from cp_factories import AGENT_HOST, EngineWorkerFactory, HostFactory, UserFactory

from controlplane.capacity.limits import whatif_slot

pytestmark = pytest.mark.django_db
ROW = {"timestamp": 0, "input_length": 64, "output_length": 4, "hash_ids": [1]}
BODY = {"trace": "pool:regular", "l1_tokens": "4096"}


@pytest.fixture
def recorded_pool(api_as):
    worker = EngineWorkerFactory(host=HostFactory(name=AGENT_HOST), role="mixed", page_size=16)
    stored = api_as("agent").post(
        "/api/v1/agent/traces/", {"worker_url": worker.url, "requests": [ROW, ROW]}, format="json"
    )
    assert stored.status_code == 202, stored.content


def test_a_user_at_the_limit_gets_a_429_until_their_run_ends(api_as, personas, recorded_pool, settings):
    settings.WHATIF_MAX_PER_USER, settings.WHATIF_MAX_RUNNING = 1, 4
    viewer = api_as("viewer")
    with whatif_slot(user_id=personas["viewer"][0].pk):  # the user's first run, still going
        refused = viewer.post("/api/v1/capacity/whatif/", BODY, format="json")
        other_user = api_as("operator").post("/api/v1/capacity/whatif/", BODY, format="json")
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "too_many_whatif_runs"
    assert refused.json()["error"]["detail"]["limit"] == "per_user"
    assert other_user.status_code == 200, other_user.content
    assert viewer.post("/api/v1/capacity/whatif/", BODY, format="json").status_code == 200


def test_the_control_plane_limit_holds_across_users(api_as, personas, recorded_pool, settings):
    settings.WHATIF_MAX_PER_USER, settings.WHATIF_MAX_RUNNING = 1, 2
    others = [UserFactory(role="viewer") for _ in range(2)]
    with whatif_slot(user_id=others[0].pk), whatif_slot(user_id=others[1].pk):
        refused = api_as("viewer").post("/api/v1/capacity/whatif/", BODY, format="json")
    assert refused.status_code == 429 and refused.json()["error"]["detail"]["limit"] == "overall"
    assert api_as("viewer").post("/api/v1/capacity/whatif/", BODY, format="json").status_code == 200


def test_the_calibration_a_page_load_starts_never_refuses_the_users_run(
    api_as, personas, recorded_pool, settings
):
    """The capacity page starts a calibration replay on every load; the user's Run has a slot of its own
    (both still count against the control plane's limit)."""
    settings.WHATIF_MAX_PER_USER, settings.WHATIF_MAX_RUNNING = 1, 4
    viewer = api_as("viewer")
    with whatif_slot(user_id=personas["viewer"][0].pk, kind="calibration"):
        assert viewer.post("/api/v1/capacity/whatif/", BODY, format="json").status_code == 200
    with whatif_slot(user_id=personas["viewer"][0].pk):  # a Run going: the page still calibrates
        assert viewer.get("/api/v1/capacity/calibration/regular/").status_code == 200
    settings.WHATIF_MAX_RUNNING = 1
    with whatif_slot(user_id=personas["viewer"][0].pk, kind="calibration"):
        refused = viewer.post("/api/v1/capacity/whatif/", BODY, format="json")
    assert refused.status_code == 429 and refused.json()["error"]["detail"]["limit"] == "overall"
