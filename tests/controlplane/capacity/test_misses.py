"""Fleet miss attribution (controlplane/capacity/misses.py): the workers' own causes, with their
``not_seen_here`` split into fleet-wide first sightings (``new``) and prefixes another worker computed
(``elsewhere``) from the recorded traffic; counts add up exactly to the measured misses."""

from __future__ import annotations

import pytest
from cp_factories import AGENT_HOST, EngineWorkerFactory, HostFactory

from controlplane.capacity.misses import MISS_CAUSES, attribute_rows
from engine.cache.misses import MISS_CAUSES as WORKER_CAUSES
from engine.whatif.replay import ceiling_share
from engine.whatif.trace import TraceRequest

P = 16  # page = block


def _row(ts, worker, ids, length, misses=None, out=1, out_ids=()):
    row = {"timestamp": ts, "worker": worker, "input_length": length, "output_length": out, "hash_ids": ids,
           "output_hash_ids": list(out_ids)}  # fmt: skip
    return {**row, "misses": misses} if misses is not None else row


# r0 (w0) computes pages 1, 2 first and answers into block 3; r1 (w1) asks pages 1, 2 that w0 computed;
# r2 (w0) continues r0's conversation: 1, 2 served, page 3 (r0's answer, computed only by w0) not seen
# by its record; r3 (w1) is one partial page; r4 (w1) reports no attribution (it still adds history).
ROWS = [
    _row(
        0,
        "w0",
        [1, 2, 3],
        40,
        {"causes": {"not_seen_here": 32, "partial_page": 8}, "unseen": [[0, 32]]},
        out=10,
        out_ids=[3, 6],
    ),  # fmt: skip
    _row(1, "w1", [1, 2, 4], 40, {"causes": {"not_seen_here": 32, "partial_page": 8}, "unseen": [[0, 32]]}),
    _row(
        2, "w0", [1, 2, 3, 5], 56, {"causes": {"not_seen_here": 16, "partial_page": 8}, "unseen": [[32, 48]]}
    ),
    _row(3, "w1", [9], 10, {"causes": {"partial_page": 10}, "unseen": []}),
    _row(4, "w1", [1, 2, 3], 40),
]


def test_not_seen_here_splits_into_new_elsewhere_and_what_only_this_worker_computed():
    out = attribute_rows(ROWS, block_tokens=P, page_size=P)
    w0, w1, fleet = out["workers"]["w0"], out["workers"]["w1"], out["fleet"]
    nonzero = lambda f: {c: t for c, t in f["causes"].items() if t}  # noqa: E731
    assert nonzero(w0) == {"new": 32, "not_seen_here": 16, "partial_page": 16}
    assert nonzero(w1) == {"elsewhere": 32, "partial_page": 18}
    assert nonzero(fleet) == {"new": 32, "elsewhere": 32, "not_seen_here": 16, "partial_page": 34}
    assert (w0["requests"], w0["attributed_requests"], w1["requests"], w1["attributed_requests"]) == (
        2,
        2,
        3,
        2,
    )
    # exactly the measured misses: input less served, per worker and for the fleet
    for f in (w0, w1, fleet):
        assert f["miss_tokens"] == sum(f["causes"].values()) == f["input_tokens"] - f["served_tokens"]
    assert (w0["input_tokens"], w0["served_tokens"], w1["input_tokens"], w1["served_tokens"]) == (
        96,
        32,
        50,
        0,
    )
    assert list(fleet["causes"]) == list(MISS_CAUSES) == ["new", "elsewhere", *WORKER_CAUSES]
    # the ceiling is the what-if's (first sightings fleet-wide, answers included), over the same requests
    reqs = [
        TraceRequest(0, r["input_length"], r["output_length"], tuple(r["hash_ids"]), r["worker"],
                     tuple(r["output_hash_ids"]))
        for r in ROWS[:4]
    ]  # fmt: skip
    assert fleet["ceiling_share"] == pytest.approx(ceiling_share(reqs, block_tokens=P, page_size=P))
    assert (w0["ceiling_tokens"], w1["ceiling_tokens"]) == (48, 32)
    assert w1["served_share"] == 0 and w0["cause_shares"]["new"] == pytest.approx(32 / 96)


def test_the_newest_requests_each_carry_their_own_split_causes():
    """The sampled per-request view: each of the newest attributed requests with its own causes (the fleet
    split included), newest first; the requests' figures add up to the worker's."""
    rows = [{**r, "arrived_ms": 5000 + r["timestamp"]} for r in ROWS]
    out = attribute_rows(rows, block_tokens=P, page_size=P, recent=2)
    w0, w1, fleet = out["workers"]["w0"], out["workers"]["w1"], out["fleet"]
    assert [(r["worker"], r["arrived_ms"]) for r in w0["recent"]] == [("w0", 5002), ("w0", 5000)]
    assert [(r["worker"], r["arrived_ms"]) for r in fleet["recent"]] == [("w1", 5003), ("w0", 5002)]
    assert [r["arrived_ms"] for r in w1["recent"]] == [5003, 5001]  # r4 carries no attribution
    newest, first = w0["recent"]
    assert {c: t for c, t in first["causes"].items() if t} == {"new": 32, "partial_page": 8}
    assert {c: t for c, t in newest["causes"].items() if t} == {"not_seen_here": 16, "partial_page": 8}
    assert newest["served_share"] == pytest.approx(32 / 56) and newest["ceiling_share"] == pytest.approx(
        48 / 56
    )
    for key in ("input_tokens", "served_tokens", "miss_tokens", "ceiling_tokens"):
        assert newest[key] + first[key] == w0[key]
    assert "recent" not in attribute_rows(rows, block_tokens=P, page_size=P)["fleet"]


def test_the_ceiling_is_never_under_what_the_worker_served():
    """A worker that served a prefix the rows never computed (traffic before them, or not recorded): an
    unbounded cache would have served it too, so the ceiling holds at least the served tokens."""
    row = _row(0, "w0", [7, 8, 9], 40, {"causes": {"not_seen_here": 0, "partial_page": 8}, "unseen": []})
    w0 = attribute_rows([row], block_tokens=P, page_size=P)["workers"]["w0"]
    assert (w0["served_tokens"], w0["ceiling_tokens"]) == (32, 32)
    assert w0["ceiling_share"] >= w0["served_share"]


def test_a_worker_with_no_attributed_traffic_has_no_shares():
    out = attribute_rows([ROWS[4]], block_tokens=P, page_size=P)
    w1 = out["workers"]["w1"]
    assert (w1["requests"], w1["attributed_requests"], w1["served_share"], w1["ceiling_share"]) == (
        1,
        0,
        None,
        None,
    )
    assert out["fleet"]["cause_shares"]["new"] is None


@pytest.mark.django_db
def test_misses_api_per_worker_and_fleet_from_what_the_agent_shipped(api_as):
    host = HostFactory(name=AGENT_HOST)
    workers = {n: EngineWorkerFactory(name=n, host=host, role="mixed", page_size=P) for n in ("w0", "w1")}
    agent = api_as("agent")
    for row in ROWS:
        body = {k: v for k, v in row.items() if k != "worker"}
        body["timestamp"] += 1_000_000
        batch = {"worker_url": workers[row["worker"]].url, "block_tokens": P, "requests": [body]}
        sent = agent.post("/api/v1/agent/traces/", batch, format="json")
        assert sent.status_code == 202, sent.content
    viewer = api_as("viewer")
    got = viewer.get("/api/v1/capacity/misses/", {"pool": "regular"})
    assert got.status_code == 200, got.content
    body = got.json()
    assert body["causes"] == list(MISS_CAUSES) and body["page_size"] == P and body["block_tokens"] == P
    assert body["fleet"]["causes"]["elsewhere"] == 32 and body["workers"]["w0"]["causes"]["new"] == 32
    assert body["fleet"]["miss_tokens"] == 146 - 32
    assert body["tenants"] is None and body["tenants_unavailable"]  # no TSDB here: absent, and why
    later = viewer.get("/api/v1/capacity/misses/", {"pool": "regular", "since_ms": 1_000_002}).json()
    assert later["fleet"]["requests"] == 3  # r2, r3, r4: r2's page 3 is now a first sighting
    assert later["workers"]["w0"]["causes"]["new"] == 16
    sampled = viewer.get("/api/v1/capacity/misses/", {"pool": "regular", "recent": 1}).json()
    assert [r["arrived_ms"] for r in sampled["workers"]["w1"]["recent"]] == [1_000_003]
    assert sampled["workers"]["w1"]["recent"][0]["causes"]["partial_page"] == 10
    for query, field in (
        ({"pool": "gpu"}, "pool"),
        ({"since_ms": "x"}, "since_ms"),
        ({"recent": 101}, "recent"),
    ):
        refused = viewer.get("/api/v1/capacity/misses/", query)
        assert refused.status_code == 400 and field in refused.json()["error"]["detail"]


@pytest.mark.django_db
def test_ingest_refuses_misses_that_cannot_be_the_worker_s(api_as):
    worker = EngineWorkerFactory(host=HostFactory(name=AGENT_HOST), role="mixed", page_size=P)
    agent = api_as("agent")
    base = {"timestamp": 0, "input_length": 40, "output_length": 1, "hash_ids": [1, 2, 3]}
    for misses, why in (
        ({"causes": {"new": 32}}, "unknown cause 'new'"),
        ({"causes": {"not_seen_here": 32}, "unseen": [[0, 48]]}, "not a range of the 39 matchable tokens"),
        ({"causes": {"not_seen_here": 16}, "unseen": [[0, 32]]}, "more than causes.not_seen_here"),
    ):
        body = {"worker_url": worker.url, "block_tokens": P, "requests": [{**base, "misses": misses}]}
        refused = agent.post("/api/v1/agent/traces/", body, format="json")
        assert refused.status_code == 400 and why in refused.content.decode(), refused.content
    assert not worker.recorded_requests.exists()
