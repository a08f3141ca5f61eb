"""``n > 1`` through PD, as sglang-router sends it: the same body to the prefill and the decode worker, with
``n`` and lists of ``n`` bootstrap hosts, ports and rooms (one pairing per sample) on the OpenAI routes, one
room on ``/generate`` (sample j then takes room + j). A P/D pair on the tiny model (``fake`` transport, in
one process) answers n choices on every route, streamed or not, equal to an aggregated worker's; malformed
lists are a 400 naming the field."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_testlib import ThreadedServer, wait_idle

from engine.model.runner import ModelRunner
from engine.server.args import parse_args
from engine.server.builder import build_engine

PD = ["--disaggregation-transfer-backend", "fake", "--page-size", "16", "--max-total-tokens", "512"]
MODES = {"prefill": ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "0"],
         "decode": ["--disaggregation-mode", "decode"]}  # fmt: skip
LISTS = {"bootstrap_host": ["127.0.0.1"] * 2, "bootstrap_port": [8998] * 2, "bootstrap_room": [11, 12]}
GREEDY = {"temperature": 0, "ignore_eos": True}
CASES = [
    ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 4, "n": 2, **GREEDY}}),
    ("/v1/completions", {"prompt": "the quick brown", "max_tokens": 4, "n": 2, **GREEDY}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "n": 2,
                              **GREEDY}),
]  # fmt: skip


def _engine(tiny_model_dir, *flags: str):
    argv = ["--model-path", str(tiny_model_dir), *PD, *flags]
    return build_engine(parse_args(argv), runner=ModelRunner(tiny_model_dir, dtype="float32", device="cpu"))


def _texts(path: str, answer) -> list[str]:
    """The n answers' texts of a non-streamed response."""
    if path == "/generate":
        return [r["text"] for r in answer]
    return [c["text"] if "text" in c else c["message"]["content"] for c in answer["choices"]]


def _streamed_texts(path: str, resp: httpx.Response) -> list[str]:
    """The n answers' texts of a streamed response (by choice index)."""
    texts: dict[int, str] = {}
    for line in resp.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        frame = json.loads(line[6:])
        assert "error" not in frame, frame
        if path == "/generate":
            texts[frame["index"]] = frame["text"]  # cumulative
        for c in frame.get("choices", []):
            texts[c["index"]] = texts.get(c["index"], "") + (c.get("text") or c["delta"].get("content") or "")
    return [texts[k] for k in sorted(texts)]


def test_n_2_through_a_pd_pair_equals_the_aggregated_worker(tiny_model_dir):
    p = _engine(tiny_model_dir, *MODES["prefill"])
    d = _engine(tiny_model_dir, *MODES["decode"])
    agg = _engine(tiny_model_dir, "--disaggregation-mode", "null")
    port = p.args.disaggregation_bootstrap_port
    try:
        with (
            ThreadedServer(p) as ps,
            ThreadedServer(d) as ds,
            ThreadedServer(agg) as ags,
            ThreadPoolExecutor(2) as pool,
        ):
            room = 100
            for path, body in CASES:
                want = _texts(path, httpx.post(f"{ags.url}{path}", json=body, timeout=60).json())
                assert len(want) == 2
                for stream in (False, True):
                    pairing = {"bootstrap_host": ["127.0.0.1"] * 2, "bootstrap_port": [port] * 2,
                               "bootstrap_room": [room, room + 1]}  # fmt: skip
                    if path == "/generate":  # what the router sends there: one room for the n samples
                        pairing = {
                            "bootstrap_host": "127.0.0.1",
                            "bootstrap_port": port,
                            "bootstrap_room": room,
                        }
                    room += 2
                    sent = {**body, **pairing, "stream": stream}
                    on_p = pool.submit(httpx.post, f"{ps.url}{path}", json=sent, timeout=60)
                    on_d = pool.submit(httpx.post, f"{ds.url}{path}", json=sent, timeout=60)
                    got_p, got_d = on_p.result(), on_d.result()
                    assert got_p.status_code == 200 and got_d.status_code == 200, (
                        path,
                        got_p.text,
                        got_d.text,
                    )
                    got = _streamed_texts(path, got_d) if stream else _texts(path, got_d.json())
                    assert got == want, (path, stream)
        for engine in (p, d):
            wait_idle(engine)
            assert engine.scheduler.state["num_used_tokens"] == 0 and engine.scheduler.pd.mgr.num_rooms() == 0
    finally:
        for engine in (p, d, agg):
            engine.scheduler.stop()


@pytest.mark.parametrize(
    "extra, named",
    [
        ({"n": 3}, "bootstrap_room: n=3 samples need one room or a list of 3"),
        ({"n": 2, "bootstrap_room": [11, 11]}, "bootstrap_room: the samples' rooms must differ"),
        ({"n": 2, "bootstrap_port": [8998] * 3}, "bootstrap_port: n=2 samples need one value or a list of 2"),
        ({"n": 1}, "bootstrap_room: one prompt per PD request"),
        ({"n": 0}, "n must be an integer >= 1"),
    ],
)
def test_malformed_bootstrap_lists_are_a_400_naming_the_field(serve, extra, named):
    _, client = serve(*PD, *MODES["decode"])
    body = {"prompt": "Hi", "max_tokens": 2, **LISTS, **extra}
    resp = client.post("/v1/completions", json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["message"].startswith(named), resp.text
