"""A DeepSeek-V3-architecture (MLA) worker with HiCache: the latent KV in every tier gives the output of its
recompute, and the worker reports the latent's real bytes per token.

The tiny checkpoint is written by transformers (tests/model/model_testlib.py); the engine is the real one
(scheduler, radix tree, L1 device pool, L2 host pool, file L3 backend), in process.
"""

from __future__ import annotations

import json
import queue
import random
import time

import httpx
import pytest
from server_testlib import ThreadedServer, model_testlib, run_requests, wait_idle

from engine.bench.counting_storage import counts
from engine.bench.launcher import ServerProcess
from engine.fleet.mooncake_master import MooncakeMaster
from engine.fleet.router import RouterProcess
from engine.model.runner import ModelRunner
from engine.ports import free_port
from engine.scheduler import Req, SamplingParams
from engine.scheduler.req import Bootstrap
from engine.server.args import ArgumentError, parse_args
from engine.server.builder import build_engine

PROMPT_LEN = 120
NEW_TOKENS = 10
LATENT = 32 + 16  # the tiny models' kv_lora_rank + qk_rope_head_dim


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory):
    """(folder, fp32 HF reference) of a tiny random DeepseekV3ForCausalLM."""
    folder = tmp_path_factory.mktemp("tiny-deepseek-v3")
    return folder, model_testlib().save_tiny_model(folder, "deepseek_v3", seed=21)


@pytest.fixture(scope="module")
def mla_runner(mla_model):
    return ModelRunner(mla_model[0], dtype="float32", device="cpu")


@pytest.fixture
def make_mla_engine(mla_model, mla_runner):
    engines = []

    def make(*flags: str):
        args = parse_args(["--model-path", str(mla_model[0]), *flags])
        engine = build_engine(args, runner=mla_runner)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.scheduler.stop()


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(PROMPT_LEN)]


def _flush(sched):
    sched.require_idle("flush cache")
    sched.cache.reset()


def _hicache_flags(tmp_path, page_size: int) -> list[str]:
    extra = json.dumps({"file_path": str(tmp_path / "l3"), "prefetch_threshold": 16})
    return [
        "--page-size", str(page_size), "--max-total-tokens", "1024", "--chunked-prefill-size", "48",
        "--enable-hierarchical-cache", "--hicache-ratio", "4", "--hicache-write-policy", "write_through",
        "--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config", extra,
        "--hicache-storage-prefetch-policy", "wait_complete",
    ]  # fmt: skip


def _every_tier(engine, prompt: list[int], aligned: int) -> list[list[int]]:
    """Greedy ids of ``prompt`` cold, from L1, from L2 (after evicting L1) and from L3 (after a flush), each
    checked to have been served by that tier."""
    cold = run_requests(engine, [prompt], max_new_tokens=NEW_TOKENS)[0]
    assert cold["meta"]["cached_tokens"] == 0
    l1 = run_requests(engine, [prompt], max_new_tokens=NEW_TOKENS)[0]
    assert l1["meta"]["cached_tokens_details"] == {"device": aligned, "host": 0, "storage": 0}
    wait_idle(engine)
    assert engine.scheduler.call(lambda s: s.cache.evict(10**6)).result(30) >= aligned
    wait_idle(engine)
    l2 = run_requests(engine, [prompt], max_new_tokens=NEW_TOKENS)[0]
    assert l2["meta"]["cached_tokens_details"]["host"] == aligned
    wait_idle(engine)
    engine.scheduler.call(_flush).result(30)
    l3 = run_requests(engine, [prompt], max_new_tokens=NEW_TOKENS)[0]
    assert l3["meta"]["cached_tokens_details"]["storage"] == aligned
    return [r["ids"] for r in (cold, l1, l2, l3)]


@pytest.mark.parametrize("page_size", [1, 16])
def test_latent_from_every_tier_gives_the_cold_output_which_is_transformers(
    make_mla_engine, mla_model, tmp_path, page_size
):
    engine = make_mla_engine(*_hicache_flags(tmp_path, page_size))
    pool, host = engine.scheduler.pool, engine.scheduler.cache.host_pool
    assert (pool.num_kv_heads, pool.head_dim) == (1, LATENT // 2)
    assert host.kv_buffer.shape[-1] == LATENT // 2 and host.num_kv_heads == 1
    prompt = _prompt(page_size)
    cold, *hits = _every_tier(engine, prompt, (PROMPT_LEN - 1) // page_size * page_size)
    assert all(ids == cold for ids in hits)
    assert cold == model_testlib().hf_greedy(mla_model[1], prompt, NEW_TOKENS)


def test_latent_from_a_mooncake_l3_gives_the_cold_output(make_mla_engine):
    """The same tiers with L3 in a real Mooncake store (``mooncake_master`` on loopback, page_first L2)."""
    with MooncakeMaster() as master:
        extra = json.dumps({
            "master_server_address": master.master_address, "metadata_server": master.metadata_url,
            "protocol": "tcp", "global_segment_size": "64mb", "local_buffer_size": "16mb",
            "prefetch_threshold": 16,
        })  # fmt: skip
        engine = make_mla_engine(
            "--page-size", "16", "--max-total-tokens", "1024", "--chunked-prefill-size", "48",
            "--enable-hierarchical-cache", "--hicache-ratio", "4", "--hicache-write-policy", "write_through",
            "--hicache-mem-layout", "page_first", "--hicache-storage-backend", "mooncake",
            "--hicache-storage-backend-extra-config", extra,
            "--hicache-storage-prefetch-policy", "wait_complete",
        )  # fmt: skip
        cold, *hits = _every_tier(engine, _prompt(9), (PROMPT_LEN - 1) // 16 * 16)
        engine.scheduler.stop()  # its store client before the master (the fixture's second stop is a no-op)
    assert all(ids == cold for ids in hits)


def test_int8_latent_from_every_tier_gives_its_recompute(make_mla_engine, tmp_path):
    """The int8 latent (values and each half row's scale) moves through L2 and L3 as stored: every tier gives
    the tokens of the int8 cold run."""
    engine = make_mla_engine(*_hicache_flags(tmp_path, 16), "--kv-cache-dtype", "int8")
    assert engine.scheduler.pool.row_dim == LATENT // 2 + 2
    cold, *hits = _every_tier(engine, _prompt(5), (PROMPT_LEN - 1) // 16 * 16)
    assert all(ids == cold for ids in hits)


def test_model_info_reports_the_latent_bytes_per_token(make_mla_engine):
    engine = make_mla_engine("--max-total-tokens", "256")
    with ThreadedServer(engine) as server:
        info = httpx.get(f"{server.url}/model_info", timeout=30).json()
    assert info["architecture"] == "deepseek_v3"
    assert info["kv_shape"] == {
        "num_layers": 2,
        "num_kv_heads": 1,
        "head_dim": LATENT // 2,
        "latent_dim": LATENT,
    }
    assert info["kv_bytes_per_token"] == 2 * LATENT * 4  # 2 layers x 48 float32 values


def test_the_triton_backend_is_refused_for_mla_naming_the_flag(mla_model, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # so the CPU's own refusal of Triton does not come first
    with pytest.raises(ArgumentError, match=r"--attention-backend triton: deepseek_v3 \(MLA\)"):
        build_engine(parse_args(["--model-path", str(mla_model[0]), "--attention-backend", "triton"]))


PD_FLAGS = ["--page-size", "16", "--max-total-tokens", "512", "--chunked-prefill-size", "48"]


def _run_pd(p, d, prompts: list[list[int]]) -> list[dict]:
    """Each prompt submitted to the prefill and the decode engine with one bootstrap room, as the router
    does; the decode's results (``{"ids", "meta", "reason"}``)."""
    rooms = [
        Bootstrap("127.0.0.1", p.args.disaggregation_bootstrap_port, random.getrandbits(63)) for _ in prompts
    ]
    sp = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0)
    events = [queue.Queue(), queue.Queue()]
    for i, (prompt, room) in enumerate(zip(prompts, rooms, strict=True)):
        for engine, sink in zip((p, d), events, strict=True):
            engine.scheduler.submit(Req(f"r{i}", list(prompt), sp, sink.put, bootstrap=room))
    out = []
    for sink in events:
        results = {f"r{i}": {"ids": [], "meta": {}, "reason": None} for i in range(len(prompts))}
        pending = set(results)
        while pending:
            ev = sink.get(timeout=120)
            results[ev.rid]["ids"] += ev.new_ids
            results[ev.rid]["meta"].update(ev.meta)
            if ev.finished:
                results[ev.rid]["reason"] = ev.finish_reason
                pending.discard(ev.rid)
        out.append([results[f"r{i}"] for i in range(len(prompts))])
    return out[1]


def test_pd_of_the_latent_over_mooncake_equals_the_aggregated_worker(make_mla_engine, mla_model, caplog):
    """P tp 1 -> D tp 1 of the MLA model through Mooncake's real TransferEngine (engines in this process):
    the decode's greedy tokens equal an aggregated worker's, and P's transport sent exactly the latent's bytes
    per token of each prompt's whole pages."""
    folder = str(mla_model[0])
    agg = make_mla_engine(*PD_FLAGS)
    prompts = [_prompt(31), _prompt(32)[:70]]
    want = [r["ids"] for r in run_requests(agg, prompts, max_new_tokens=NEW_TOKENS)]
    pd = [*PD_FLAGS, "--disaggregation-transfer-backend", "mooncake", "--disaggregation-mode"]
    engines = []
    try:
        with caplog.at_level("INFO", logger="engine.server.builder"):
            for mode in (["prefill", "--disaggregation-bootstrap-port", "0"], ["decode"]):
                args = parse_args(["--model-path", folder, *pd, *mode])
                engines.append(build_engine(args, runner=ModelRunner(folder, dtype="float32", device="cpu")))
        p, d = engines
        got = _run_pd(p, d, prompts)
        assert [g["ids"] for g in got] == want
        assert all(g["reason"]["type"] == "length" for g in got)
        for engine in (p, d):
            wait_idle(engine)
        pool = p.scheduler.pool
        assert pool.bytes_per_token == 2 * LATENT * 4  # 2 layers x 48 float32 values
        tokens = sum(-(-len(prompt) // 16) * 16 for prompt in prompts)  # whole pages
        assert p.scheduler.pd.mgr.transport.bytes_sent == tokens * pool.bytes_per_token
        assert "PD of deepseek_v3 (MLA)" in caplog.text  # slicing by heads: a no-op, logged
    finally:
        for engine in engines:
            engine.scheduler.stop()


def test_pd_from_a_tp2_prefill_behind_the_router_equals_the_aggregated_engine(make_mla_engine, mla_model):
    """Real processes behind the real router (smg, ``--pd-disaggregation``): a tp-2 prefill (two rank
    processes, each holding the whole latent) and a tp-1 decode over Mooncake. The decode takes the latent
    whole from prefill rank 0 (rank 1 joins each room with an empty share); its greedy tokens equal an
    aggregated tp-1 engine's, and both workers end with no PD request."""
    flags = ["--model-path", str(mla_model[0]), "--page-size", "4", "--max-total-tokens", "512"]
    prompts = [_prompt(41)[:37], _prompt(42)[:12]]
    sp = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    want = [r["ids"] for r in run_requests(make_mla_engine(*flags[2:]), prompts, **sp)]
    bp = free_port()
    pd = [*flags, "--disaggregation-transfer-backend", "mooncake", "--disaggregation-mode"]
    p_flags = [*pd, "prefill", "--tp", "2", "--disaggregation-bootstrap-port", str(bp)]
    with (
        ServerProcess(p_flags, 600) as p,
        ServerProcess([*pd, "decode"], 600) as d,
        RouterProcess(["--pd-disaggregation", "--prefill", p.url, str(bp), "--decode", d.url]) as router,
        httpx.Client(base_url=router.url, timeout=120) as client,
    ):
        got = []
        for ids in prompts:
            resp = client.post("/generate", json={"input_ids": ids, "sampling_params": sp})
            assert resp.status_code == 200, resp.text
            got.append(resp.json()["output_ids"])
        assert got == want
        for worker in (p, d):
            assert httpx.get(f"{worker.url}/server_info", timeout=10).json()["num_pd_transfer_reqs"] == 0
        assert "PD of deepseek_v3 (MLA)" in d.log_tail(100_000)


def test_the_staging_buffer_is_refused_for_a_pd_worker_of_an_mla_model(mla_model, monkeypatch):
    monkeypatch.setenv("SGLANG_DISAGG_STAGING_BUFFER", "1")
    args = parse_args(["--model-path", str(mla_model[0]), "--disaggregation-mode", "decode"])
    with pytest.raises(ArgumentError, match=r"SGLANG_DISAGG_STAGING_BUFFER=1: .*deepseek_v3 \(MLA\)") as err:
        build_engine(args)
    assert "GQA/MHA KV only" in str(err.value) and "unset SGLANG_DISAGG_STAGING_BUFFER" in str(err.value)


def _generate(client: httpx.Client, ids: list[int]) -> tuple[list[int], dict]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"], r.json()["meta_info"]["cached_tokens_details"]


def _when_idle_flush(client: httpx.Client, timeout: float = 60.0) -> None:
    """POST /flush_cache until it succeeds (a 400 while cache I/O such as backups still runs)."""
    deadline = time.monotonic() + timeout
    while (resp := client.post("/flush_cache")).status_code != 200:
        assert "not idle" in resp.text and time.monotonic() < deadline, resp.text
        time.sleep(0.05)


def test_at_tp2_one_rank_writes_the_latent_to_l3_and_every_rank_reads_it(mla_model, tmp_path):
    """Both ranks hold the same latent: only rank 0 hands pages to the store (a logging file backend counts
    each process's writes and reads), both ranks read them back on a storage hit, and the output is the cold
    run's. The keys name no rank: a tp-1 worker on the same L3 serves the prompt from storage with the same
    tokens."""
    log = tmp_path / "l3-ops.log"
    extra = {
        "backend_name": "counting-file", "module_path": "engine.bench.counting_storage",
        "class_name": "CountingFileStorage", "file_path": str(tmp_path / "l3"), "count_path": str(log),
        "prefetch_threshold": 4, "tp_lcm_size": 2,  # a no-op for MLA (the worker logs so)
    }  # fmt: skip
    (tmp_path / "l3").mkdir()
    prompt = [(7 * i + 3) % 300 + 10 for i in range(48)]

    def flags(tp: int) -> list[str]:
        return ["--model-path", str(mla_model[0]), "--tp", str(tp), "--page-size", "4",
                "--max-total-tokens", "96", "--enable-hierarchical-cache", "--hicache-storage-backend",
                "dynamic", "--hicache-storage-backend-extra-config", json.dumps(extra),
                "--hicache-storage-prefetch-policy", "wait_complete"]  # fmt: skip

    with ServerProcess(flags(2)) as server, httpx.Client(base_url=server.url, timeout=120) as client:
        cold, details = _generate(client, prompt)
        assert details == {"device": 0, "host": 0, "storage": 0}
        _when_idle_flush(client)  # the backups are done; L1 and L2 emptied on both ranks
        written = counts(log)["set"]
        assert list(written) == [server.proc.pid] and written[server.proc.pid] >= 11, written
        out, details = _generate(client, prompt)
        assert out == cold and details["storage"] >= 44, details
        read = counts(log)["get"]
        assert len(read) == 2 and min(read.values()) >= 11, read  # rank 0 and rank 1 each read the pages
        logged = server.log_tail(10**6)
    assert list(counts(log)["set"]) == [server.proc.pid]  # still rank 0 alone (the answer's new page)
    assert "tp_lcm_size 2: no-op for deepseek_v3 (MLA)" in logged

    with ServerProcess(flags(1)) as server, httpx.Client(base_url=server.url, timeout=120) as client:
        out, details = _generate(client, prompt)
    assert out == cold and details["storage"] >= 44, details
