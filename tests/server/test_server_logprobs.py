"""``/generate`` log-probabilities against transformers (fp32, same weights), with the prompt's prefix
recomputed or served from L1, L2 (hierarchical cache) and L3 (file backend): every tier gives the same
numbers, and each is within 1e-4 of the reference."""

from __future__ import annotations

import json
import random

import httpx
import pytest
import torch
import transformers

from engine.bench.launcher import ServerProcess

pytestmark = pytest.mark.slow

PROMPT_LEN = 150
START = 70  # logprob_start_len: the prefix cache may serve at most this many tokens (64 with pages of 16)
NEW = 6
TOP = 5
IDS = [3, 17, 250]
TOL = 1e-4


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(PROMPT_LEN)]


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return transformers.LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    l3 = tmp_path_factory.mktemp("l3")
    extra = json.dumps({"file_path": str(l3), "prefetch_threshold": 16})
    args = [
        "--model-path", str(tiny_model_dir), "--page-size", "16", "--max-total-tokens", "512",
        "--chunked-prefill-size", "64", "--enable-hierarchical-cache", "--hicache-ratio", "4",
        "--hicache-write-policy", "write_through", "--hicache-storage-backend", "file",
        "--hicache-storage-backend-extra-config", extra,
        "--hicache-storage-prefetch-policy", "wait_complete",
    ]  # fmt: skip
    with ServerProcess(args) as proc, httpx.Client(base_url=proc.url, timeout=120) as client:
        yield client


def _generate(client, prompt, **fields) -> dict:
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
        "top_logprobs_num": TOP,
        "token_ids_logprob": IDS,
        **fields,
    }
    resp = client.post("/generate", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _reference(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Log-softmax rows of every position of prompt + output ``(L, vocab)`` from transformers."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def _check_against(ref: torch.Tensor, prompt: list[int], got: dict, start: int) -> None:
    meta = got["meta_info"]
    output = got["output_ids"]
    inp = meta["input_token_logprobs"]
    assert [t for _, t, _ in inp] == prompt[start:]
    assert inp[0][0] is None and meta["input_top_logprobs"][0] is None
    for p in range(start + 1, len(prompt)):  # prompt token p is scored by row p - 1
        lp, tok, text = inp[p - start]
        assert tok == prompt[p] and text is None
        assert abs(lp - ref[p - 1, tok].item()) < TOL
        _check_top(ref[p - 1], meta["input_top_logprobs"][p - start])
        _check_ids(ref[p - 1], meta["input_token_ids_logprobs"][p - start])
    assert [t for _, t, _ in meta["output_token_logprobs"]] == output
    for i, (lp, tok, _) in enumerate(meta["output_token_logprobs"]):
        row = ref[len(prompt) + i - 1]
        assert tok == int(row.argmax())  # greedy
        assert abs(lp - row[tok].item()) < TOL
        _check_top(row, meta["output_top_logprobs"][i])
        _check_ids(row, meta["output_token_ids_logprobs"][i])


def _check_top(row: torch.Tensor, top: list) -> None:
    vals, ids = torch.topk(row, TOP)
    assert [t for _, t, _ in top] == ids.tolist()
    assert max(abs(lp - v) for (lp, _, _), v in zip(top, vals.tolist(), strict=True)) < TOL


def _check_ids(row: torch.Tensor, entries: list) -> None:
    assert [t for _, t, _ in entries] == IDS
    assert max(abs(lp - row[t].item()) for lp, t, _ in entries) < TOL


def _numbers(got: dict) -> list[float]:
    meta = got["meta_info"]
    out = [lp for lp, _, _ in meta["input_token_logprobs"][1:] + meta["output_token_logprobs"]]
    for key in ("input_top_logprobs", "output_top_logprobs", "input_token_ids_logprobs"):
        out += [lp for entry in meta[key] if entry for lp, _, _ in entry]
    return out


def test_logprobs_match_transformers_and_agree_across_tiers(server, hf_model):
    prompt = _prompt(1)
    cold = _generate(server, prompt, logprob_start_len=START)
    assert cold["meta_info"]["cached_tokens"] == 0
    ref = _reference(hf_model, prompt, cold["output_ids"])
    _check_against(ref, prompt, cold, START)

    l1 = _generate(server, prompt, logprob_start_len=START)
    assert l1["meta_info"]["cached_tokens_details"]["device"] == 64  # capped at logprob_start_len
    for filler in range(2, 8):  # other prompts push the first one's pages out of L1 (into L2)
        _generate(server, _prompt(filler), return_logprob=False)
    l2 = _generate(server, prompt, logprob_start_len=START)
    assert l2["meta_info"]["cached_tokens_details"] == {"device": 0, "host": 64, "storage": 0}
    assert server.post("/flush_cache").status_code == 200  # L1 and L2 cleared; L3 keeps the pages
    l3 = _generate(server, prompt, logprob_start_len=START)
    assert l3["meta_info"]["cached_tokens_details"] == {"device": 0, "host": 0, "storage": 64}

    for got in (l1, l2, l3):
        assert got["output_ids"] == cold["output_ids"]
        _check_against(ref, prompt, got, START)
        diff = max(abs(a - b) for a, b in zip(_numbers(got), _numbers(cold), strict=True))
        assert diff < 1e-5


def test_default_start_reports_output_logprobs_with_text(server, hf_model):
    """Without logprob_start_len only the last prompt token is listed (logprob None); the whole prefix may
    come from the cache. return_text_in_logprobs adds each token's text."""
    prompt = _prompt(5)
    got = _generate(server, prompt, return_text_in_logprobs=True)
    meta = got["meta_info"]
    assert meta["input_token_logprobs"] == [[None, prompt[-1], meta["input_token_logprobs"][0][2]]]
    assert isinstance(meta["input_token_logprobs"][0][2], str)
    ref = _reference(hf_model, prompt, got["output_ids"])
    for i, (lp, tok, text) in enumerate(meta["output_token_logprobs"]):
        assert abs(lp - ref[PROMPT_LEN - 1 + i, tok].item()) < TOL and isinstance(text, str)
    again = _generate(server, prompt, return_text_in_logprobs=True)
    assert again["meta_info"]["cached_tokens"] == 144  # every whole page before the last token
    assert again["meta_info"]["output_token_logprobs"] == meta["output_token_logprobs"]


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"logprob_start_len": -2}, "logprob_start_len"),
        ({"top_logprobs_num": -1}, "top_logprobs_num"),
        ({"token_ids_logprob": [1, 100000]}, "token_ids_logprob"),
    ],
)
def test_bad_logprob_fields_are_a_400_naming_the_field(server, fields, named):
    resp = server.post("/generate", json={"input_ids": [5, 6, 7], "return_logprob": True, **fields})
    assert resp.status_code == 400 and named in resp.json()["error"]["message"]
    assert _generate(server, [5, 6, 7])["output_ids"]  # still serving


def test_a_stream_carries_the_logprobs_so_far(server):
    prompt = _prompt(6)
    whole = _generate(server, prompt, logprob_start_len=START)
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
        "logprob_start_len": START,
        "stream": True,
    }
    frames = []
    with server.stream("POST", "/generate", json=body) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                frames.append(json.loads(line[6:]))
    counts = [len(f["meta_info"]["output_token_logprobs"]) for f in frames]
    assert counts == sorted(counts) and counts[-1] == NEW
    last = frames[-1]["meta_info"]
    for key in ("input_token_logprobs", "output_token_logprobs"):
        assert [t for _, t, _ in last[key]] == [t for _, t, _ in whole["meta_info"][key]]
        got = [lp for lp, _, _ in last[key][1:]]
        want = [lp for lp, _, _ in whole["meta_info"][key][1:]]
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-5
