"""Constrained decoding on ``/generate`` (SGLang's ``regex``, ``ebnf``, ``json_schema``): a real worker
process on the tiny random model, whose unconstrained output is noise, so every match below is the
grammar's work.

Also: constrained and unconstrained requests in one batch (the mask stays on its own row), bad constraints
are a 400 naming the field while the worker keeps serving, and ``--grammar-backend none`` refuses them
naming the flag.
"""

from __future__ import annotations

import concurrent.futures
import json
import re

import httpx
import pytest

from engine.bench.launcher import ServerProcess

pytestmark = pytest.mark.slow

PROMPTS = ["the quick brown fox", "a paged KV cache", "caf\u00e9 na\u00efve", "done"]
EMAIL = r"[a-z]{3,8}@(kv|fleet)\.(com|org)"
YES_NO = 'root ::= answer " " answer\nanswer ::= "yes" | "no" | "maybe"'


@pytest.fixture(scope="module")
def worker(tiny_model_dir):
    flags = ["--model-path", str(tiny_model_dir), "--max-total-tokens", "4096", "--enable-metrics"]
    with ServerProcess(flags) as server, httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def _generate(client, text, **params) -> httpx.Response:
    sp = {"max_new_tokens": 48, "temperature": 1.0, **params}
    return client.post("/generate", json={"text": text, "sampling_params": sp})


def _so_requests(client) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("sglang:num_so_requests_total{"):
            return float(line.split()[-1])
    return 0.0


def test_regex_output_matches_for_every_prompt_of_a_batch_and_counts(worker):
    before = _so_requests(worker)
    out = _generate(worker, PROMPTS, regex=EMAIL)
    assert out.status_code == 200, out.text
    for item in out.json():
        assert re.fullmatch(EMAIL, item["text"]), item["text"]
        assert item["meta_info"]["finish_reason"]["type"] == "stop"
    assert _so_requests(worker) == before + len(PROMPTS)  # upstream's sglang:num_so_requests_total


def test_ebnf_output_is_a_sentence_of_the_grammar(worker):
    out = _generate(worker, PROMPTS, ebnf=YES_NO)
    assert out.status_code == 200, out.text
    for item in out.json():
        assert re.fullmatch(r"(yes|no|maybe) (yes|no|maybe)", item["text"]), item["text"]


def test_json_schema_output_validates(worker):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "level": {"enum": ["low", "high"]}},
        "required": ["ok", "level"],
    }
    out = _generate(worker, PROMPTS, json_schema=json.dumps(schema), max_new_tokens=200)
    assert out.status_code == 200, out.text
    for item in out.json():
        value = json.loads(item["text"])
        assert (
            set(value) == {"ok", "level"}
            and isinstance(value["ok"], bool)
            and value["level"] in ("low", "high")
        )


def test_streamed_constrained_text_matches(worker):
    body = {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 48, "regex": EMAIL}, "stream": True}
    with worker.stream("POST", "/generate", json=body) as resp:
        frames = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    assert re.fullmatch(EMAIL, frames[-1]["text"])


def test_constrained_and_free_requests_share_batches_without_mixing(worker):
    alone = _generate(worker, PROMPTS[1], temperature=0, max_new_tokens=24).json()["text"]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        free = [
            pool.submit(_generate, worker, PROMPTS[1], temperature=0, max_new_tokens=24) for _ in range(3)
        ]
        constrained = [pool.submit(_generate, worker, p, regex=EMAIL) for p in PROMPTS]
        assert all(re.fullmatch(EMAIL, f.result().json()["text"]) for f in constrained)
        assert [f.result().json()["text"] for f in free] == [alone] * 3


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"regex": "[a-"}, "sampling_params.regex"),
        ({"json_schema": "{not json"}, "sampling_params.json_schema"),
        ({"json_schema": json.dumps({"type": "nonsense"})}, "sampling_params.json_schema"),
        ({"ebnf": "root ::= "}, "sampling_params.ebnf"),
        ({"regex": "a", "ebnf": 'root ::= "a"'}, "sampling_params.regex"),
    ],
)
def test_bad_constraint_is_a_400_naming_the_field_and_the_worker_serves_on(worker, params, field):
    bad = _generate(worker, "hi", **params)
    assert bad.status_code == 400
    assert field in bad.json()["error"]["message"]
    assert _generate(worker, "hi", regex="[0-9]{3}").json()["text"].isdigit()


def test_grammar_backend_none_refuses_constraints_naming_the_flag(serve):
    _, client = serve("--grammar-backend", "none")
    resp = _generate(client, "hi", regex="[0-9]+")
    assert resp.status_code == 400 and "--grammar-backend none" in resp.json()["error"]["message"]
    assert _generate(client, "hi", max_new_tokens=2).status_code == 200
