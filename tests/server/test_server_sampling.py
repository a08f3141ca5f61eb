"""Decoding controls: stop token ids, stop strings, max_new_tokens, seeded sampling, top-k/top-p/min-p."""

from __future__ import annotations

import pytest
import torch
from server_testlib import run_requests

from engine.scheduler import SamplingParams
from engine.scheduler.sampler import sample

PROMPT = [5, 9, 17, 33, 65, 129, 7, 11, 13]


def test_stop_token_id_ends_generation_at_its_first_occurrence(make_engine):
    engine = make_engine()
    greedy = run_requests(engine, [PROMPT], max_new_tokens=12)[0]["ids"]
    stop = greedy[4]
    first = greedy.index(stop)
    got = run_requests(engine, [PROMPT], max_new_tokens=12, stop_token_ids=[stop])[0]
    assert got["ids"] == greedy[: first + 1]
    assert got["reason"] == {"type": "stop", "matched": stop}


def test_eos_stops_unless_ignore_eos(make_engine):
    engine = make_engine()
    greedy = run_requests(engine, [PROMPT], max_new_tokens=12)[0]["ids"]
    eos = greedy[2]
    engine.scheduler.decode.eos_token_ids = (eos,)  # the stop rule lives in the DecodeManager
    stopped = run_requests(engine, [PROMPT], max_new_tokens=12)[0]
    assert stopped["ids"] == greedy[: greedy.index(eos) + 1] and stopped["reason"]["matched"] == eos
    ignored = run_requests(engine, [PROMPT], max_new_tokens=12, ignore_eos=True)[0]
    assert ignored["ids"] == greedy and ignored["reason"] == {"type": "length", "length": 12}


def test_stop_string_over_http_is_trimmed(serve):
    _, client = serve()
    sp = {"max_new_tokens": 16, "temperature": 0}
    full = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": sp}).json()
    text = full["text"]
    assert len(text) > 6
    stop = text[3:6]
    got = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": {**sp, "stop": stop}}).json()
    assert got["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert got["text"] == text[: text.index(stop)]
    kept = client.post(
        "/generate",
        json={"input_ids": PROMPT, "sampling_params": {**sp, "stop": [stop], "no_stop_trim": True}},
    ).json()
    assert kept["text"].startswith(text[: text.index(stop)] + stop)


def test_max_new_tokens_zero_returns_no_tokens(make_engine):
    got = run_requests(make_engine(), [PROMPT], max_new_tokens=0)[0]
    assert got["ids"] == [] and got["reason"] == {"type": "length", "length": 0}


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(serve):
    _, client = serve()
    greedy = client.post(
        "/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 10, "temperature": 0}}
    ).json()["output_ids"]
    sp = {"max_new_tokens": 10, "temperature": 1.5, "top_p": 0.95, "sampling_seed": 1234}
    a = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": sp}).json()["output_ids"]
    b = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": sp}).json()["output_ids"]
    assert a == b
    top1 = client.post(
        "/generate",
        json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 10, "temperature": 1.0, "top_k": 1}},
    ).json()["output_ids"]
    assert top1 == greedy


def test_sampler_filters():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    gens = [torch.Generator().manual_seed(0)]
    for _ in range(50):  # top_k=2 only ever draws the two best tokens
        assert sample(logits, [SamplingParams(temperature=1.0, top_k=2)], gens)[0] in (2, 3)
    for _ in range(50):  # top_p small keeps only the best token
        assert sample(logits, [SamplingParams(temperature=1.0, top_p=0.1)], gens)[0] == 3
    for _ in range(50):  # min_p 0.5 drops tokens under half the best probability
        assert sample(logits, [SamplingParams(temperature=1.0, min_p=0.5)], gens)[0] in (2, 3)
    assert sample(logits, [SamplingParams(temperature=0.0)], [None]) == [3]


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ({"top_k": 0}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"stop": [""]}, "stop"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_new_tokens": 200}, "min_new_tokens"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"stop_regex": "("}, "stop_regex"),
        ({"n": 0}, "sampling_params.n"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
    ],
)
def test_sampling_params_validation_names_the_field(raw, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams.from_dict(raw)
