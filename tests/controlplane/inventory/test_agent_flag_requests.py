"""The agent's side of restart_with_flags through the real API: a register carries each worker's command
line and flag table (the register's audit record keeps only the table's size), a heartbeat answer carries
the newest flags request until the agent acknowledges it carried it out or failed, and acknowledgements
only move forward (a restarted agent counts from 0 again and is not sent the old request again)."""

import pytest

from controlplane.audit.models import AuditEvent
from controlplane.inventory.models import EngineWorker
from controlplane.inventory.services.flags import worker_flags_progress, worker_flags_request

pytestmark = pytest.mark.django_db
URL = "http://10.0.0.7:30000"
LINE = ["--model-path=m", "--port=30000", "--page-size=16"]


def test_flags_requests_travel_in_heartbeats_until_acknowledged(agent_for):
    client = agent_for("gpu-f")
    table = {
        "page_size": ["--page-size", True],
        "port": ["--port", True],
        "model_path": ["--model-path", True],
    }
    worker = {"name": "gpu-f-w0", "url": URL, "command_line": LINE, "launch_flags": table}
    assert (
        client.post(
            "/api/v1/agent/register/", {"host": {"name": "gpu-f"}, "workers": [worker]}, format="json"
        ).status_code
        == 200
    )
    row = EngineWorker.objects.get(url=URL)
    assert (row.command_line, row.launch_flags) == (LINE, table)
    record = AuditEvent.objects.filter(action="register").latest("id")
    assert record.after["workers"][0]["launch_flags"] == "3 entries"

    def beat(acks=None) -> list:
        body = {"host": "gpu-f", "workers": [URL], **({"flag_acks": acks} if acks else {})}
        return client.post("/api/v1/agent/heartbeat/", body, format="json").json()["flags"]

    assert beat() == []
    new = [*LINE[:2], "--page-size=32"]
    seq = worker_flags_request(worker=row, flags=new, actor=None, reason="test")
    # asked again while pending (a step run twice): the same request, audited once
    assert worker_flags_request(worker=row, flags=new, actor=None, reason="test") == seq
    assert beat() == [{"worker_url": URL, "flags": new, "seq": seq}]
    assert worker_flags_progress(row, seq)[0] == "waiting"
    failed = beat({URL: {"applied": 0, "failed": seq, "failure": "the new process exited with code 2"}})
    assert failed == [] and worker_flags_progress(row, seq) == (
        "failed",
        "the new process exited with code 2",
    )
    back = worker_flags_request(worker=row, flags=LINE, actor=None, reason="revert")
    assert beat({URL: {"applied": 0, "failed": seq, "failure": "the new process exited with code 2"}}) == [
        {"worker_url": URL, "flags": LINE, "seq": back}
    ]
    assert (
        beat({URL: {"applied": back, "failed": seq, "failure": "the new process exited with code 2"}}) == []
    )
    assert worker_flags_progress(row, back) == ("applied", "")
    assert beat({URL: {"applied": 0, "failed": 0}}) == []  # a restarted agent: nothing sent again
    row.refresh_from_db()
    assert (row.flags_applied_seq, row.flags_failed_seq, row.desired_flags) == (back, seq, LINE)
    asked = AuditEvent.objects.filter(action="restart_requested").order_by("id")
    assert [(e.before["command_line"], e.after["command_line"]) for e in asked] == [(LINE, new), (LINE, LINE)]
