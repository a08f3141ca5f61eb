"""Sampling and log-probability features through the real router (smg) in PD mode, against an
aggregated worker with the same weights: a P and a D worker on the tiny model (``fake`` transport, in this
process) behind the router, one module-scoped fleet. P computes the prompt's log-probabilities and the first
token's and sends them with the KV; D reports the rest (``input_token_logprobs`` empty on ``/generate``: the
router puts P's there)."""

from __future__ import annotations

import httpx
import pytest
from server_testlib import ThreadedServer, wait_idle

from engine.fleet.router import RouterProcess
from engine.model.runner import ModelRunner
from engine.server.args import parse_args
from engine.server.builder import build_engine

PD = ["--disaggregation-transfer-backend", "fake", "--page-size", "16", "--max-total-tokens", "1024"]
PROMPT = "the quick brown fox jumps over the lazy dog and then it runs far away"
TOL = 1e-4


def _engine(model_dir, *flags: str):
    argv = ["--model-path", str(model_dir), *flags]
    return build_engine(parse_args(argv), runner=ModelRunner(model_dir, dtype="float32", device="cpu"))


@pytest.fixture(scope="module")
def fleet(tiny_model_dir):
    p = _engine(
        tiny_model_dir, *PD, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", "0"
    )
    d = _engine(tiny_model_dir, *PD, "--disaggregation-mode", "decode")
    agg = _engine(tiny_model_dir, "--page-size", "16", "--max-total-tokens", "1024")
    try:
        with ThreadedServer(p) as ps, ThreadedServer(d) as ds, ThreadedServer(agg) as ags:
            workers = ["--pd-disaggregation", "--prefill", ps.url, str(p.args.disaggregation_bootstrap_port)]
            with RouterProcess([*workers, "--decode", ds.url]) as router:
                # smg routes the OpenAI routes by model: the name the workers serve
                model = httpx.get(f"{router.url}/v1/models", timeout=10).json()["data"][0]["id"]
                yield {"router": router.url, "agg": ags.url, "p": p, "d": d, "model": model}
    finally:
        for engine in (p, d, agg):
            engine.scheduler.stop()


def _post(url: str, path: str, body: dict) -> dict:
    resp = httpx.post(f"{url}{path}", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _close(a, b, where: str) -> None:
    """Equal nesting of ``[logprob, token_id, text]`` triples (or None), logprobs within ``TOL``."""
    if a is None or b is None:
        assert a is None and b is None, where
        return
    if not (len(a) == 3 and isinstance(a[1], int)):  # a list of entries, not one triple
        assert len(a) == len(b), (where, len(a), len(b))
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _close(x, y, f"{where}[{i}]")
        return
    (la, ta, _), (lb, tb, _) = a, b
    assert ta == tb, where
    assert (la is None and lb is None) or abs(la - lb) < TOL, (where, la, lb)


def _idle(fleet) -> None:
    for engine in (fleet["p"], fleet["d"]):
        wait_idle(engine)
        assert engine.scheduler.state["num_used_tokens"] == 0 and engine.scheduler.pd.mgr.num_rooms() == 0


@pytest.mark.parametrize("start", [0, 5, -1])
def test_generate_prompt_logprobs_through_the_router_equal_aggregated(fleet, start):
    body = {
        "text": PROMPT,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
        "logprob_start_len": start,
        "top_logprobs_num": 3,
        "token_ids_logprob": [5, 17, 42],
    }
    want, got = _post(fleet["agg"], "/generate", body), _post(fleet["router"], "/generate", body)
    assert got["output_ids"] == want["output_ids"]
    for key in ("input_token_logprobs", "output_token_logprobs", "input_top_logprobs", "output_top_logprobs",
                "input_token_ids_logprobs", "output_token_ids_logprobs"):  # fmt: skip
        assert want["meta_info"][key], key
        _close(got["meta_info"][key], want["meta_info"][key], key)
    _idle(fleet)


def test_completions_echo_logprobs_through_the_router_equal_aggregated(fleet):
    """What lm-evaluation-harness sends for a loglikelihood item, and the same with generated tokens."""
    for body in (
        {
            "model": fleet["model"],
            "prompt": PROMPT,
            "max_tokens": 1,
            "echo": True,
            "logprobs": 1,
            "temperature": 0,
        },
        {
            "model": fleet["model"],
            "prompt": PROMPT,
            "max_tokens": 4,
            "echo": True,
            "logprobs": 3,
            "temperature": 0,
        },
    ):
        want = _post(fleet["agg"], "/v1/completions", body)["choices"][0]
        got = _post(fleet["router"], "/v1/completions", body)["choices"][0]
        assert got["text"] == want["text"]
        a, b = got["logprobs"], want["logprobs"]
        assert a["tokens"] == b["tokens"] and a["text_offset"] == b["text_offset"]
        assert a["token_logprobs"][0] is None and b["token_logprobs"][0] is None
        assert (
            max(abs(x - y) for x, y in zip(a["token_logprobs"][1:], b["token_logprobs"][1:], strict=True))
            < TOL
        )
        assert a["top_logprobs"][0] is None
        for x, y in zip(a["top_logprobs"][1:], b["top_logprobs"][1:], strict=True):
            assert x.keys() == y.keys() and all(abs(x[k] - y[k]) < TOL for k in x)
    _idle(fleet)


def test_chat_n_2_through_the_router_equals_aggregated(fleet):
    body = {"model": fleet["model"], "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 5,
            "n": 2, "temperature": 0.8, "seed": 11}  # fmt: skip
    want = _post(fleet["agg"], "/v1/chat/completions", body)["choices"]
    got = _post(fleet["router"], "/v1/chat/completions", body)["choices"]
    assert [c["index"] for c in got] == [0, 1]
    assert [c["message"]["content"] for c in got] == [c["message"]["content"] for c in want]
    _idle(fleet)


def test_seeded_sampling_through_the_router_equals_aggregated(fleet):
    """The first token is drawn on P, the rest on D, each from the request's own generator seeded alike."""
    sp = {"max_new_tokens": 12, "temperature": 1.0, "top_p": 0.95, "ignore_eos": True, "sampling_seed": 1234}
    body = {"text": PROMPT, "sampling_params": sp}
    want = _post(fleet["agg"], "/generate", body)["output_ids"]
    assert (
        want
        != _post(fleet["agg"], "/generate", {**body, "sampling_params": {**sp, "sampling_seed": 7}})[
            "output_ids"
        ]
    )
    assert _post(fleet["router"], "/generate", body)["output_ids"] == want
    comp = {"model": fleet["model"], "prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "seed": 99}
    want_text = _post(fleet["agg"], "/v1/completions", comp)["choices"][0]["text"]
    assert _post(fleet["router"], "/v1/completions", comp)["choices"][0]["text"] == want_text
    _idle(fleet)
