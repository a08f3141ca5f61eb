"""PD in the scheduler, in one process: a prefill and a decode engine on the tiny model paired over the
``fake`` transport (real ZMQ side channel and bootstrap server; the KV bytes travel over ZMQ), against an
aggregated engine. Every test ends with both KV managers' integrity check (``wait_idle``)."""

from __future__ import annotations

import dataclasses
import json
import queue
import random
import time

import httpx
import pytest
from server_testlib import ThreadedServer, run_requests, wait_idle

from engine.disaggregation import transport
from engine.model.runner import ModelRunner
from engine.ports import free_port
from engine.scheduler import Req, SamplingParams
from engine.scheduler.req import Bootstrap
from engine.server.args import ArgumentError, parse_args
from engine.server.builder import build_engine

FLAGS = ["--page-size", "16", "--max-total-tokens", "512", "--chunked-prefill-size", "32"]
PD = ["--disaggregation-transfer-backend", "fake"]


@pytest.fixture
def pair(tiny_model_dir):
    """P and D engines, each with its own model runner (a runner serves one scheduler thread at a time)."""
    engines = []
    for mode in (["prefill", "--disaggregation-bootstrap-port", "0"], ["decode"]):
        args = parse_args(["--model-path", str(tiny_model_dir), *FLAGS, *PD, "--disaggregation-mode", *mode])
        engines.append(build_engine(args, runner=ModelRunner(tiny_model_dir, dtype="float32", device="cpu")))
    yield engines
    for engine in engines:
        engine.scheduler.stop()


def _timeouts(engine, **values) -> None:
    """Shorter transport timeouts than upstream's 10-300 s, so failure paths finish quickly."""
    mgr = engine.scheduler.pd.mgr
    mgr.timeouts = dataclasses.replace(mgr.timeouts, **values)


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


def _submit(engine, rid, prompt, bootstrap, events, **params):
    sp = SamplingParams(**{"max_new_tokens": 8, "temperature": 0.0, **params})
    engine.scheduler.submit(Req(rid, list(prompt), sp, events.put, bootstrap=bootstrap))


def _collect(events: queue.Queue, rids: set[str], timeout: float = 60) -> dict[str, dict]:
    out = {rid: {"ids": [], "meta": {}, "reason": None} for rid in rids}
    deadline = time.monotonic() + timeout
    while rids:
        ev = events.get(timeout=max(0.1, deadline - time.monotonic()))
        res = out[ev.rid]
        res["ids"].extend(ev.new_ids)
        res["meta"].update(ev.meta)
        if ev.finished:
            res["reason"] = ev.finish_reason
            rids.discard(ev.rid)
    return out


def _run_pd(p, d, prompts, **params) -> list[dict]:
    """Each prompt submitted to P and D with one room, as the router does; D's results."""
    port = p.args.disaggregation_bootstrap_port
    p_events, d_events = queue.Queue(), queue.Queue()
    rids = []
    for i, prompt in enumerate(prompts):
        b = Bootstrap("127.0.0.1", port, random.getrandbits(63))
        rid = f"r{i}-{b.room}"
        rids.append(rid)
        _submit(p, rid, prompt, b, p_events, **params)
        _submit(d, rid, prompt, b, d_events, **params)
    on_p = _collect(p_events, set(rids))
    assert all(r["reason"]["type"] == "length" for r in on_p.values()), on_p
    on_d = _collect(d_events, set(rids))
    return [on_d[r] for r in rids]


def test_pd_decode_equals_aggregated_with_chunked_prefill_and_p_side_hits(make_engine, pair):
    p, d = pair
    agg = make_engine(*FLAGS)
    shared = _prompt(1, 64)
    prompts = [shared + _prompt(10 + i, 30) for i in range(3)] + [_prompt(2, 70)]
    want = [r["ids"] for r in run_requests(agg, prompts)]
    first = _run_pd(p, d, prompts[:1])  # computed on P (3 chunks of 32)
    rest = _run_pd(p, d, prompts[1:])  # the shared 64 tokens now hit P's L1
    got = first + rest
    assert [g["ids"] for g in got] == want
    assert got[0]["meta"]["cached_tokens_details"] == {"device": 0, "host": 0, "storage": 0}
    assert [g["meta"]["cached_tokens_details"]["device"] for g in got[1:3]] == [64, 64]
    for g in got:  # D reports P's miss attribution, which covers every token P did not serve
        causes = g["meta"]["miss_tokens_details"]["causes"]
        assert sum(causes.values()) == g["meta"]["prompt_tokens"] - g["meta"]["cached_tokens"]
    assert got[0]["meta"]["miss_tokens_details"]["causes"]["not_seen_here"] > 0
    assert all(g["reason"]["type"] == "length" and len(g["ids"]) == 8 for g in got)
    for engine in (p, d):
        wait_idle(engine)  # and every L1 slot accounted for
    assert d.scheduler.state["num_used_tokens"] == 0 and p.scheduler.state["num_used_tokens"] == 0


def test_first_token_from_p_can_finish_the_request_on_d(pair):
    p, d = pair
    (res,) = _run_pd(p, d, [_prompt(3, 20)], max_new_tokens=1)
    assert len(res["ids"]) == 1 and res["reason"] == {"type": "length", "length": 1}
    wait_idle(d)
    wait_idle(p)


def test_abort_on_d_while_waiting_for_kv_frees_both_sides(pair):
    p, d = pair
    _timeouts(p, unknown_room_timeout_s=0.5)
    _timeouts(d, abort_ack_timeout_s=2.0)
    b = Bootstrap("127.0.0.1", p.args.disaggregation_bootstrap_port, 77)
    events = queue.Queue()
    prompt = _prompt(4, 40)
    _submit(d, "only-d", prompt, b, events)  # P never gets it: D waits for KV
    deadline = time.monotonic() + 10
    while d.scheduler.call(lambda s: len(s.pd.waiting_kv)).result(10) == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert d.scheduler.state["is_idle"] is False
    d.scheduler.abort("only-d")
    res = _collect(events, {"only-d"}, timeout=30)["only-d"]
    assert res["reason"]["type"] == "abort"
    wait_idle(d)
    assert d.scheduler.state["num_used_tokens"] == 0
    assert d.scheduler.pd.mgr.num_rooms() == 0


def test_p_request_without_its_decode_fails_after_the_bootstrap_timeout_and_frees_p(pair):
    p, _ = pair
    events = queue.Queue()
    b = Bootstrap("127.0.0.1", p.args.disaggregation_bootstrap_port, 78)
    _timeouts(p, bootstrap_timeout_s=0.5)
    _submit(p, "only-p", _prompt(5, 40), b, events)
    res = _collect(events, {"only-p"}, timeout=30)["only-p"]
    assert res["reason"]["type"] == "abort" and "bootstrap timeout" in res["reason"]["message"]
    wait_idle(p)
    assert p.scheduler.pd.mgr.num_rooms() == 0


def test_dead_bootstrap_port_fails_the_request_naming_the_address(pair):
    _, d = pair
    dead = free_port()
    _timeouts(d, bootstrap_query_retries=2, bootstrap_query_interval_s=0.1)
    events = queue.Queue()
    _submit(d, "dead", _prompt(6, 20), Bootstrap("127.0.0.1", dead, 79), events)
    res = _collect(events, {"dead"}, timeout=30)["dead"]
    assert res["reason"]["type"] == "abort" and f"127.0.0.1:{dead}" in res["reason"]["message"]
    wait_idle(d)
    assert d.scheduler.state["num_used_tokens"] == 0


def test_nixl_without_the_package_is_a_start_up_error_saying_why(make_engine, monkeypatch):
    # stand-in: the nixl package is installed here, so its absence is simulated at the one check that looks
    monkeypatch.setattr(transport, "nixl_installed", lambda: False)
    with pytest.raises(ArgumentError, match="--disaggregation-transfer-backend nixl: .*not installed"):
        make_engine(*FLAGS, "--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "nixl")


def test_decode_offload_gives_the_next_turn_storage_hits_for_prompt_and_answer(tiny_model_dir, tmp_path):
    """D caches turn 1 (prompt + answer) and HiCache backs it up to the shared L3; after P's L1 and L2 are
    flushed, turn 2's prefill on P finds all of it in L3."""
    l3 = ["--enable-hierarchical-cache", "--hicache-ratio", "4", "--hicache-storage-backend", "file"]
    extra = json.dumps({"file_path": str(tmp_path), "prefetch_threshold": 16})
    l3 += ["--hicache-storage-backend-extra-config", extra]
    l3 += ["--hicache-storage-prefetch-policy", "wait_complete"]
    modes = (
        ["prefill", "--disaggregation-bootstrap-port", "0"],
        ["decode", "--disaggregation-decode-enable-offload-kvcache"],
    )
    engines = []
    try:
        for mode in modes:
            argv = ["--model-path", str(tiny_model_dir), *FLAGS, *PD, *l3, "--disaggregation-mode", *mode]
            runner = ModelRunner(tiny_model_dir, dtype="float32", device="cpu")
            engines.append(build_engine(parse_args(argv), runner=runner))
        p, d = engines
        turn1 = _prompt(8, 60)
        (first,) = _run_pd(p, d, [turn1], max_new_tokens=20)
        wait_idle(d)  # D's write-through to L3 has finished
        wait_idle(p)
        p.scheduler.call(lambda s: s.cache.reset()).result(30)  # P keeps nothing in L1 / L2
        turn2 = turn1 + first["ids"] + _prompt(9, 10)
        (second,) = _run_pd(p, d, [turn2], max_new_tokens=4)
        computed_by_d = len(turn1) + len(first["ids"]) - 1  # the last answer token's KV is never computed
        assert second["meta"]["cached_tokens_details"]["storage"] == computed_by_d // 16 * 16
        assert second["meta"]["cached_tokens_details"]["storage"] > len(turn1)
        wait_idle(d)
        wait_idle(p)
    finally:
        for engine in engines:
            engine.scheduler.stop()


def test_pd_role_switch_flips_idle_workers_and_a_failed_flip_marks_unhealthy(tiny_model_dir):
    """P and D swap roles through POST /pd_role_switch (checked in /server_info), a PD request then runs the
    other way; a busy worker is refused with nothing changed; a flip that cannot bind the new bootstrap port
    leaves the worker unhealthy."""
    engines = []
    try:
        for mode in ("prefill", "decode"):
            argv = ["--model-path", str(tiny_model_dir), *FLAGS, *PD, "--enable-pd-role-switch"]
            argv += ["--disaggregation-mode", mode, "--disaggregation-bootstrap-port", "0"]
            runner = ModelRunner(tiny_model_dir, dtype="float32", device="cpu")
            engines.append(build_engine(parse_args(argv), runner=runner))
        p, d = engines
        with ThreadedServer(p) as ps, ThreadedServer(d) as ds:
            # busy: a PD request waiting for its decode side
            events = queue.Queue()
            _submit(
                p,
                "waits",
                _prompt(12, 20),
                Bootstrap("127.0.0.1", p.args.disaggregation_bootstrap_port, 5),
                events,
            )
            busy = httpx.post(f"{ps.url}/pd_role_switch", json={"new_role": "decode"}, timeout=30)
            assert busy.status_code == 400 and "not idle" in busy.json()["message"]
            assert busy.json()["safe_to_restore"] is True
            p.scheduler.abort("waits")
            _collect(events, {"waits"})
            for server, new in ((ps, "decode"), (ds, "prefill")):
                flip = httpx.post(f"{server.url}/pd_role_switch", json={"new_role": new}, timeout=60)
                assert flip.status_code == 200 and flip.json()["success"], flip.text
                assert httpx.get(f"{server.url}/server_info").json()["disaggregation_mode"] == new
            (res,) = _run_pd(d, p, [_prompt(13, 40)])  # d is the prefill now
            assert res["reason"]["type"] == "length" and len(res["ids"]) == 8
            wait_idle(p)
            wait_idle(d)

            d.args.disaggregation_bootstrap_port = (
                d.scheduler.pd.mgr.bootstrap_port
            )  # taken: the flip must fail
            p.args.disaggregation_bootstrap_port = d.args.disaggregation_bootstrap_port
            failed = httpx.post(f"{ps.url}/pd_role_switch", json={"new_role": "prefill"}, timeout=60)
            assert failed.status_code == 500 and failed.json()["safe_to_restore"] is False
            health = httpx.get(f"{ps.url}/health")
            assert health.status_code == 503 and "restart required" in health.text
    finally:
        for engine in engines:
            engine.scheduler.stop()


def test_a_prefill_switched_to_decode_and_back_serves_its_decode_at_once(tiny_model_dir):
    """P -> D -> P through POST /pd_role_switch, well inside D's 5 s heartbeat: D's entry for P's bootstrap
    address (side-channel endpoint, buffer registration) belongs to the old instance. The next PD request
    still gets the same tokens, within seconds (D re-reads P's bootstrap when its transfer info is not
    acknowledged), and both sides end clean."""
    engines = []
    try:
        for mode in ("prefill", "decode"):
            argv = ["--model-path", str(tiny_model_dir), *FLAGS, *PD, "--enable-pd-role-switch"]
            argv += ["--disaggregation-mode", mode, "--disaggregation-bootstrap-port", "0"]
            runner = ModelRunner(tiny_model_dir, dtype="float32", device="cpu")
            engines.append(build_engine(parse_args(argv), runner=runner))
        p, d = engines
        prompt = _prompt(14, 40)
        (before,) = _run_pd(p, d, [prompt])  # D knows P now
        port = p.args.disaggregation_bootstrap_port
        with ThreadedServer(p) as ps:
            for new in ("decode", "prefill"):
                flip = httpx.post(f"{ps.url}/pd_role_switch", json={"new_role": new}, timeout=60)
                assert flip.status_code == 200 and flip.json()["success"], flip.text
        assert p.args.disaggregation_bootstrap_port == port  # back on the same bootstrap port
        start = time.monotonic()
        (after,) = _run_pd(p, d, [prompt])
        assert time.monotonic() - start < 30  # not D's 300 s waiting timeout
        assert after["ids"] == before["ids"] and after["reason"]["type"] == "length"
        for engine in (p, d):
            wait_idle(engine)
            assert engine.scheduler.state["num_used_tokens"] == 0
            assert engine.scheduler.pd.mgr.num_rooms() == 0
    finally:
        for engine in engines:
            engine.scheduler.stop()


def test_a_decode_request_reaching_a_worker_that_is_a_prefill_now_fails_both_prefills_fast(tiny_model_dir):
    """The router picked W as the decode of a pair with P0, and W switched to prefill before the request
    arrived: W's copy names P0's bootstrap. W answers 500 naming P0's bootstrap address at once and aborts
    the room on P0, whose copy ends too, instead of both waiting for the 300 s bootstrap timeout."""
    engines = []
    try:
        for _ in range(2):
            argv = ["--model-path", str(tiny_model_dir), *FLAGS, *PD, "--disaggregation-mode", "prefill"]
            argv += ["--disaggregation-bootstrap-port", "0"]
            runner = ModelRunner(tiny_model_dir, dtype="float32", device="cpu")
            engines.append(build_engine(parse_args(argv), runner=runner))
        p0, w = engines
        address = f"127.0.0.1:{p0.args.disaggregation_bootstrap_port}"
        b = Bootstrap("127.0.0.1", p0.args.disaggregation_bootstrap_port, 80)
        events = {name: queue.Queue() for name in ("p0", "w")}
        start = time.monotonic()
        _submit(p0, "misrouted", _prompt(15, 30), b, events["p0"])
        _submit(w, "misrouted", _prompt(15, 30), b, events["w"])
        on_w = _collect(events["w"], {"misrouted"}, timeout=30)["misrouted"]["reason"]
        on_p0 = _collect(events["p0"], {"misrouted"}, timeout=30)["misrouted"]["reason"]
        assert time.monotonic() - start < 30
        assert on_w["type"] == "abort" and on_w["status_code"] == 500
        assert f"bootstrap {address} is another prefill, not this one" in on_w["message"]
        assert on_p0["type"] == "abort" and "aborted the room" in on_p0["message"]
        for engine in engines:
            wait_idle(engine)
            assert engine.scheduler.state["num_used_tokens"] == 0
            assert engine.scheduler.pd.mgr.num_rooms() == 0
    finally:
        for engine in engines:
            engine.scheduler.stop()


def test_a_prefill_request_reaching_a_worker_that_is_a_decode_now_fails_at_once(tiny_model_dir):
    """The router picked W as the prefill, and W switched to decode before the request arrived: W's copy
    names W's own former bootstrap port, where no server runs any more. It fails at once naming that address
    (not after D's 15 first-contact tries), with W's pages back."""
    argv = ["--model-path", str(tiny_model_dir), *FLAGS, *PD, "--enable-pd-role-switch"]
    argv += ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "0"]
    w = build_engine(parse_args(argv), runner=ModelRunner(tiny_model_dir, dtype="float32", device="cpu"))
    try:
        port = w.args.disaggregation_bootstrap_port
        with ThreadedServer(w) as server:
            flip = httpx.post(f"{server.url}/pd_role_switch", json={"new_role": "decode"}, timeout=60)
            assert flip.status_code == 200 and flip.json()["success"], flip.text
        events = queue.Queue()
        start = time.monotonic()
        _submit(w, "misrouted", _prompt(16, 30), Bootstrap("127.0.0.1", port, 81), events)
        reason = _collect(events, {"misrouted"}, timeout=30)["misrouted"]["reason"]
        assert time.monotonic() - start < 20  # not the bootstrap timeout; a margin for a loaded box
        assert reason["type"] == "abort" and reason["status_code"] == 500
        assert f"bootstrap 127.0.0.1:{port} is this worker's own, which is a decode now" in reason["message"]
        wait_idle(w)
        assert w.scheduler.state["num_used_tokens"] == 0 and w.scheduler.pd.mgr.num_rooms() == 0
    finally:
        w.scheduler.stop()


def _engine(tiny_model_dir, *mode: str):
    argv = ["--model-path", str(tiny_model_dir), *FLAGS, *PD, "--enable-metrics"]
    argv += ["--disaggregation-mode", *mode]
    return build_engine(parse_args(argv), runner=ModelRunner(tiny_model_dir, dtype="float32", device="cpu"))


def _paired_and_queued_on_p(p, d, rid: str, room: int) -> tuple[queue.Queue, object]:
    """P's L1 held by a lease (a long request's worth), then one PD request on both: D registers the room
    (its transfer info reaches P), and P queues the request, which cannot be admitted. Returns P's event
    queue and the lease (release it with ``_release``)."""
    lease = p.scheduler.call(lambda s: s.kv.reserve("l1-holder", s.pool.size - 2 * s.page_size)).result(10)
    assert lease is not None
    events = queue.Queue()
    b = Bootstrap("127.0.0.1", p.args.disaggregation_bootstrap_port, room)
    prompt = _prompt(room, 40)  # 3 pages; P has fewer free
    _submit(p, rid, prompt, b, events)
    _submit(d, rid, prompt, b, queue.Queue())
    deadline = time.monotonic() + 30
    while not p.scheduler.call(lambda s: s.reqs[rid] in s.prefill.waiting).result(10):  # paired
        assert time.monotonic() < deadline, "D's transfer info did not reach P"
        time.sleep(0.01)
    return events, lease


def _release(engine, lease) -> None:
    engine.scheduler.call(lambda s: s.kv.release(lease, [], insert=False)).result(10)


def _metric(engine, name: str) -> float:
    """The value of ``name`` on ``/metrics`` (0 for a labelled series never incremented, hence absent)."""
    lines = [x for x in engine.metrics.render().decode().splitlines() if x.startswith(name + "{")]
    return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0


def test_a_decode_gone_after_registering_the_room_fails_p_at_the_waiting_timeout(tiny_model_dir, monkeypatch):
    """D registered the room and went away (stopped: no abort reaches P) while P's request waited to be
    prefilled. With upstream's SGLANG_DISAGGREGATION_WAITING_TIMEOUT (short here) P fails the request
    naming D instead of keeping it (and, once prefilled, its pages and prefix lock) for a decode that is
    gone; the failure is counted; P ends with no room, no used slot and every slot accounted for, and no
    socket towards the gone decode."""
    d = _engine(tiny_model_dir, "decode")
    monkeypatch.setenv("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "1")
    p = _engine(tiny_model_dir, "prefill", "--disaggregation-bootstrap-port", "0")
    try:
        events, lease = _paired_and_queued_on_p(p, d, "gone-d", 91)
        endpoint = d.scheduler.pd.mgr.channel.endpoint
        d.scheduler.stop()
        reason = _collect(events, {"gone-d"}, timeout=30)["gone-d"]["reason"]
        assert reason["type"] == "abort" and reason["status_code"] == 500
        assert f"waiting timeout after 1 s: decode {endpoint} registered the room" in reason["message"]
        _release(p, lease)
        wait_idle(p)
        assert p.scheduler.state["num_used_tokens"] == 0 and p.scheduler.pd.mgr.num_rooms() == 0
        assert _metric(p, "sglang:num_transfer_failed_reqs_total") == 1
        assert _metric(p, "sglang:num_bootstrap_failed_reqs_total") == 0
        deadline = time.monotonic() + 10  # P pings a decode it met until it finds it gone, then closes
        while p.scheduler.pd.mgr.channel.has_socket(endpoint):
            assert time.monotonic() < deadline, "P kept its socket towards the gone decode"
            time.sleep(0.05)
    finally:
        for engine in (p, d):
            engine.scheduler.stop()


def test_a_room_d_gives_up_ends_the_request_queued_on_p_at_once(tiny_model_dir):
    """D aborts the room at its own waiting timeout while P's copy is still queued (P overloaded): P ends
    it then, not after computing a prompt nobody will take; both sides end clean."""
    p = _engine(tiny_model_dir, "prefill", "--disaggregation-bootstrap-port", "0")
    d = _engine(tiny_model_dir, "decode")
    try:
        events, lease = _paired_and_queued_on_p(p, d, "given-up", 92)
        _timeouts(d, waiting_timeout_s=0.2)
        reason = _collect(events, {"given-up"}, timeout=30)["given-up"]["reason"]
        assert reason["type"] == "abort" and "aborted the room: waiting timeout" in reason["message"]
        assert _metric(p, "sglang:prompt_tokens_total") == 0  # never admitted, never prefilled
        _release(p, lease)
        for engine in (p, d):
            wait_idle(engine)
            assert engine.scheduler.state["num_used_tokens"] == 0 and engine.scheduler.pd.mgr.num_rooms() == 0
        assert _metric(p, "sglang:num_transfer_failed_reqs_total") == 1
    finally:
        for engine in (p, d):
            engine.scheduler.stop()


def test_a_prompt_the_decode_cannot_hold_is_refused_on_both_sides_before_p_prefills(tiny_model_dir):
    """D's pool (128 tokens) is smaller than P's: D answers 400 at once and tells P, whose copy of the
    request fails with 400 naming D's reason within seconds (not at the 300 s bootstrap timeout), never
    prefilled; both sides end clean."""
    p = _engine(tiny_model_dir, "prefill", "--disaggregation-bootstrap-port", "0")
    d = _engine(tiny_model_dir, "decode", "--max-total-tokens", "128")
    try:
        b = Bootstrap("127.0.0.1", p.args.disaggregation_bootstrap_port, 93)
        prompt = _prompt(93, 150)
        events = queue.Queue()
        start = time.monotonic()
        with ThreadedServer(d) as ds:
            body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 8}}
            body |= {"bootstrap_host": b.host, "bootstrap_port": b.port, "bootstrap_room": b.room}
            refused = httpx.post(f"{ds.url}/generate", json=body, timeout=30)
            _submit(p, "too-long", prompt, b, events)  # the router's copy reaches P after D's refusal
            reason = _collect(events, {"too-long"}, timeout=30)["too-long"]["reason"]
        assert refused.status_code == 400 and "exceeds the KV pool (128 tokens)" in refused.text
        assert time.monotonic() - start < 10
        assert reason["type"] == "abort" and reason["status_code"] == 400
        assert "decode refused the request: prompt (150)" in reason["message"]
        assert _metric(p, "sglang:prompt_tokens_total") == 0  # never prefilled
        for engine in (p, d):
            wait_idle(engine)
            assert engine.scheduler.state["num_used_tokens"] == 0 and engine.scheduler.pd.mgr.num_rooms() == 0
    finally:
        for engine in (p, d):
            engine.scheduler.stop()


def test_a_decode_gone_after_registering_the_room_fails_p_within_seconds(tiny_model_dir):
    """D registered the room and died (stopped: its side channel is closed) while P's request waited to be
    prefilled: P's pings go unanswered and P fails the request naming D within seconds, not at upstream's
    300 s waiting timeout; a new room while every decode P met is gone fails too instead of waiting for
    the bootstrap timeout; P ends idle and clean."""
    p = _engine(tiny_model_dir, "prefill", "--disaggregation-bootstrap-port", "0")
    d = _engine(tiny_model_dir, "decode")
    try:
        events, lease = _paired_and_queued_on_p(p, d, "dies", 94)
        endpoint = d.scheduler.pd.mgr.channel.endpoint
        start = time.monotonic()
        d.scheduler.stop()
        reason = _collect(events, {"dies"}, timeout=30)["dies"]["reason"]
        assert time.monotonic() - start < 10
        assert reason["status_code"] == 500 and f"decode {endpoint} is gone" in reason["message"]
        _submit(
            p,
            "after",
            _prompt(95, 20),
            Bootstrap("127.0.0.1", p.args.disaggregation_bootstrap_port, 95),
            events,
        )
        reason = _collect(events, {"after"}, timeout=30)["after"]["reason"]
        assert (
            reason["status_code"] == 500 and "every decode this prefill has met is gone" in reason["message"]
        )
        assert time.monotonic() - start < 15
        _release(p, lease)
        wait_idle(p)
        assert p.scheduler.state["num_used_tokens"] == 0 and p.scheduler.pd.mgr.num_rooms() == 0
    finally:
        for engine in (p, d):
            engine.scheduler.stop()


def test_a_forged_colliding_room_is_a_400(pair):
    p, d = pair
    b = Bootstrap("127.0.0.1", p.args.disaggregation_bootstrap_port, 96)
    _submit(p, "first", _prompt(96, 20), b, queue.Queue())  # holds the room (no decode takes it)
    body = {"input_ids": _prompt(97, 20), "sampling_params": {"max_new_tokens": 2}}
    body |= {"bootstrap_host": b.host, "bootstrap_port": b.port, "bootstrap_room": b.room}
    with ThreadedServer(p) as ps:
        forged = httpx.post(f"{ps.url}/generate", json=body, timeout=30)
    assert forged.status_code == 400 and "bootstrap room 96 is already active" in forged.text
    p.scheduler.abort("first")
    wait_idle(p)
