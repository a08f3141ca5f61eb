"""Calibration compares the what-if at each worker's configuration of now with what the worker measured over
its window; when an operation changed that configuration inside the window (a new user detached L3 mid-way,
and the card still said "within target" with the L3 row 4.4 points off), the answer names the change and
gives no verdict. The window's figures stand for the worker's metrics and the replay (both covered by
test_calibration.py on real engines); the audit log is the real one."""

from __future__ import annotations

import math
import time

import pytest
from cp_factories import EngineWorkerFactory

from controlplane.audit.services import audit_record
from controlplane.capacity import calibration as cal
from controlplane.capacity.services import recorded_requests_ingest

pytestmark = pytest.mark.django_db


@pytest.fixture
def measured_window(monkeypatch, tsdb):
    """A worker that recorded traffic (and a real Prometheus holding a scrape of it), whose window runs from a
    minute ago to a minute ahead and whose what-if agrees with what it measured to the token."""
    worker = EngineWorkerFactory(name="cal-a", role="mixed", page_size=16, storage_backend="file")
    tsdb.serve([("cal-a", time.time(), "sglang:max_total_num_tokens 1000\n")])
    row = {"timestamp": 0, "input_length": 100, "output_length": 4, "hash_ids": [7]}
    recorded_requests_ingest(worker=worker, requests=[row], block_tokens=16)
    now_ms = round(time.time() * 1000)
    tiers = {"l1": 20.0, "l2": 50.0, "l3": 10.0}
    defaulted: dict = {}  # settings replayed at the engine's defaults (the worker's could not be read)

    def window(w, pool, block_tokens, history):
        return {"worker": w.name, "worker_id": w.pk, "live": {}, "from_ms": now_ms - 60_000,
                "to_ms": now_ms + 60_000, "starts_after_traffic": False, "window_moved": None,
                "measured_tiers": dict(tiers),
                "measured_cached_tokens": 80.0, "measured_prompt_tokens": 100.0,
                "config_read_at": "2026-12-07T06:00:00+00:00",
                "config_defaulted": dict(defaulted)}  # fmt: skip

    def replay(rows, pool, block_tokens):
        for r in rows:
            r.update(requests=1, whatif_input_tokens=100, whatif_tiers=dict(tiers), whatif_tokens_served=80)

    monkeypatch.setattr(cal, "_worker", window)
    monkeypatch.setattr(cal, "_replay", replay)
    worker.defaulted = defaulted
    return worker


def test_a_window_without_changes_gets_its_verdict(measured_window):
    result = cal.calibration(pool="regular")
    assert result["within_target"] is True and result["config_changes"] == [] and result["note"] == ""


def test_a_detach_inside_the_window_is_named_and_withholds_the_verdict(measured_window):
    audit_record(action="detach", obj=measured_window, before={"storage_backend": "file"}, after={})
    audit_record(action="detach", obj=measured_window, outcome="failure")  # changed nothing: not named
    result = cal.calibration(pool="regular")
    assert result["within_target"] is None
    ((change),) = result["config_changes"]
    assert change["worker"] == "cal-a" and change["action"] == "detach" and change["at"].endswith("+00:00")
    at = change["at"][:19].replace("T", " ")  # the API's ISO time, as the console writes times
    assert f"cal-a: detach at {at} UTC" in result["note"]
    assert "not like for like" in result["note"]


def test_settings_replayed_at_defaults_withhold_the_verdict(measured_window):
    """A worker whose HiCache config could not be read is replayed at the engine's defaults: the answer
    names them and why, and gives no verdict (the replay may not be the worker's cache)."""
    why = "cal-a did not answer /server_info (connection refused)"
    measured_window.defaulted.update(prefetch_threshold=why, eviction=why)
    result = cal.calibration(pool="regular")
    assert result["within_target"] is None
    assert result["note"] == (
        f"cal-a's prefetch_threshold, eviction replayed at the engine's defaults, not its own ({why}): no "
        "verdict until its HiCache config is read"
    )


def test_the_window_moves_past_a_change_once_scrapes_and_traffic_follow_it():
    """A change no longer withholds the verdict for the hour the history covers: the real ``_worker`` (over
    scrapes as `samples.worker_samples` returns them) starts the window at the first scrape after the
    latest change once two scrapes and recorded traffic follow it, measures only from there, and the change
    is then outside the window; before that, the window stays whole and the change withholds the verdict."""
    from controlplane.audit.models import AuditEvent

    worker = EngineWorkerFactory(name="cal-m", role="mixed", page_size=16, storage_backend="file")
    audit_record(action="detach", obj=worker, before={"storage_backend": "file"}, after={})
    t0 = AuditEvent.objects.get().occurred_at.timestamp() - 90  # the log is append-only: times around it

    def scrape(ts, cached, prompt):
        tiers = {"cached_tokens_device": cached, "cached_tokens_host": 0, "cached_tokens_storage": 0}
        return {"ts": ts, "max_total_num_tokens": 1000, "prompt_tokens_total": prompt, **tiers}

    def rows(*at_s):
        reqs = [{"timestamp": round(s * 1000), "input_length": 32, "output_length": 4, "hash_ids": [1, 2]}
                for s in at_s]  # fmt: skip
        recorded_requests_ingest(worker=worker, requests=reqs, block_tokens=16)

    rows(t0 + 10, t0 + 20)
    history = [scrape(t0, 0, 0), scrape(t0 + 60, 40, 64), scrape(t0 + 120, 40, 64)]
    history.append(scrape(t0 + 180, 40, 64))  # one scrape after it and no traffic yet: the window stays
    row = cal._worker(worker, "regular", 16, history)
    assert row["window_moved"] is None and row["from_ms"] == round((t0 + 10) * 1000)
    assert [c["action"] for c in cal._changed_inside([row])] == ["detach"]

    rows(t0 + 200)
    history.append(scrape(t0 + 240, 50, 96))  # a second scrape and a request after the change: it moves
    row = cal._worker(worker, "regular", 16, history)
    assert row["window_moved"]["action"] == "detach" and row["window_moved"]["at"].endswith("+00:00")
    assert row["from_ms"] == math.ceil((t0 + 120) * 1000) and row["to_ms"] == round((t0 + 240) * 1000)
    assert (row["measured_prompt_tokens"], row["measured_cached_tokens"]) == (32, 10)  # only after it
    assert cal._changed_inside([row]) == []
