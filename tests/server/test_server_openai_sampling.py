"""The OpenAI routes and /generate against transformers (fp32, same weights) through real clients: chat
``logprobs`` / ``top_logprobs``, completions ``echo`` + ``logprobs`` (the shape lm-evaluation-harness reads),
``n`` choices sharing one prefill (also streamed, by choice index), lists of prompts, penalties /
``min_new_tokens`` / ``logit_bias`` / ``stop_regex`` / seeds, and 400s naming the field while the worker keeps
serving."""

from __future__ import annotations

import json
import random
import re

import httpx
import openai
import pytest
import torch
import transformers

from engine.bench.launcher import ServerProcess

pytestmark = pytest.mark.slow
TOL = 1e-4


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return transformers.LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    args = ["--model-path", str(tiny_model_dir), "--max-total-tokens", "2048", "--enable-cache-report"]
    with ServerProcess(args) as proc:
        yield proc.url


@pytest.fixture(scope="module")
def sdk(server):
    with openai.OpenAI(base_url=f"{server}/v1", api_key="sk-test", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=120) as client:
        yield client


def _prompt(seed: int, n: int = 40) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


def _rows(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_chat_logprobs_and_top_logprobs_match_transformers(sdk, hf_model, tiny_model_dir):
    messages = [{"role": "user", "content": "the quick brown fox"}]
    out = sdk.chat.completions.create(
        model="m", messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    ids = list(prompt_ids)
    for item in content:  # greedy: follow the reference's argmax and compare each step
        row = _rows(hf_model, ids)[-1]
        best = int(row.argmax())
        assert item.token == tok.decode([best])
        assert abs(item.logprob - row[best].item()) < TOL
        top_vals, top_ids = torch.topk(row, 3)
        assert [t.token for t in item.top_logprobs] == [tok.decode([i]) for i in top_ids.tolist()]
        assert (
            max(abs(t.logprob - v) for t, v in zip(item.top_logprobs, top_vals.tolist(), strict=True)) < TOL
        )
        ids.append(best)


def test_completion_echo_logprobs_in_lm_eval_shape(sdk, hf_model):
    """What lm-evaluation-harness's local-completions sends for a loglikelihood request (token ids, echo,
    logprobs=1, max_tokens=1, temperature 0) and the fields it reads."""
    prompt = _prompt(11)
    out = sdk.completions.create(model="m", prompt=prompt, echo=True, logprobs=1, max_tokens=1, temperature=0)
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == len(prompt) + 1 and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and len(lp.tokens) == len(prompt) + 1
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    rows = _rows(hf_model, prompt)
    for p in range(1, len(prompt)):
        assert abs(lp.token_logprobs[p] - rows[p - 1, prompt[p]].item()) < TOL
        assert len(lp.top_logprobs[p]) == 1
        assert abs(max(lp.top_logprobs[p].values()) - rows[p - 1].max().item()) < TOL
    assert abs(lp.token_logprobs[-1] - rows[-1].max().item()) < TOL  # the greedy output token
    assert out.choices[0].text.startswith(out.choices[0].text[: lp.text_offset[-1]])


def test_n_choices_share_one_prefill(sdk):
    prompt = _prompt(21, 64)
    out = sdk.completions.create(model="m", prompt=prompt, n=4, max_tokens=6, temperature=1.0, seed=5)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert len({c.text for c in out.choices}) > 1  # seeds 5, 6, 7, 8: different samples
    assert out.usage.prompt_tokens == 64
    # The prompt was computed once; each of the 4 samples found all but its last token cached.
    assert out.usage.prompt_tokens_details.cached_tokens == 4 * 63
    again = sdk.completions.create(model="m", prompt=prompt, n=4, max_tokens=6, temperature=1.0, seed=5)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]  # seeded: reproducible
    chat = sdk.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "a paged KV cache"}], n=4, max_tokens=4
    )
    assert len(chat.choices) == 4


def test_generate_n_returns_one_result_per_sample(http):
    body = {"input_ids": _prompt(31), "sampling_params": {"n": 3, "max_new_tokens": 4, "temperature": 0}}
    out = http.post("/generate", json=body).json()
    assert isinstance(out, list) and len(out) == 3
    assert out[0]["output_ids"] == out[1]["output_ids"] == out[2]["output_ids"]  # greedy
    assert all(r["meta_info"]["cached_tokens"] == 39 for r in out)


def _by_index(chunks) -> dict[int, list]:
    """The choices of streamed chunks, grouped by their ``index``."""
    out: dict[int, list] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            out.setdefault(choice.index, []).append(choice)
    return out


def test_n_choices_stream_by_index_with_one_prefill(sdk):
    prompt = _prompt(22, 48)
    args = {"model": "m", "prompt": prompt, "n": 3, "max_tokens": 6, "temperature": 1.0, "seed": 9}
    whole = sdk.completions.create(**args)
    chunks = list(sdk.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    per = _by_index(chunks)
    assert sorted(per) == [0, 1, 2]
    for choice in whole.choices:  # seeded: the stream's sample j is the non-streamed choice j
        streamed = per[choice.index]
        assert "".join(c.text for c in streamed) == choice.text
        assert streamed[-1].finish_reason == choice.finish_reason
    usage = chunks[-1].usage
    assert usage.prompt_tokens == 48  # the prompt counted once
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens == 3 * 47  # computed once, then cached for each sample

    messages = [{"role": "user", "content": "a paged KV cache"}]
    chat = list(sdk.chat.completions.create(model="m", messages=messages, n=2, max_tokens=4, stream=True))
    per = _by_index(chat)
    assert sorted(per) == [0, 1]
    for choices in per.values():
        assert choices[0].delta.role == "assistant"
        assert choices[-1].finish_reason in ("stop", "length")


def test_completions_take_a_list_of_prompts_in_prompt_major_order(sdk):
    first, second = _prompt(23, 20), _prompt(24, 30)
    greedy = {"model": "m", "max_tokens": 5, "temperature": 0}
    alone = [sdk.completions.create(prompt=p, **greedy).choices[0].text for p in (first, second)]
    both = sdk.completions.create(prompt=[first, second], n=2, **greedy)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [c.text for c in both.choices] == [alone[0], alone[0], alone[1], alone[1]]
    assert both.usage.prompt_tokens == 50
    streamed = _by_index(sdk.completions.create(prompt=[first, second], n=2, stream=True, **greedy))
    assert ["".join(c.text for c in streamed[k]) for k in range(4)] == [c.text for c in both.choices]
    texts = ["the quick brown", "a paged KV"]
    echoed = sdk.completions.create(prompt=texts, echo=True, **greedy)
    assert [c.index for c in echoed.choices] == [0, 1]
    assert all(c.text.startswith(t) for c, t in zip(echoed.choices, texts, strict=True))


def test_generate_streams_a_batch_with_n_as_indexed_frames(http):
    prompts = [_prompt(25, 24), _prompt(26, 32)]
    sampling = {"n": 2, "max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    whole = http.post("/generate", json={"input_ids": prompts, "sampling_params": sampling}).json()
    assert len(whole) == 4
    body = {"input_ids": prompts, "sampling_params": sampling, "stream": True}
    last: dict[int, dict] = {}
    with http.stream("POST", "/generate", json=body) as resp:
        assert resp.status_code == 200
        lines = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    for line in lines[:-1]:
        frame = json.loads(line)
        last[frame["index"]] = frame  # cumulative: the last frame of an index is its whole output
    assert sorted(last) == [0, 1, 2, 3]
    for k in range(4):  # prompt-major, then sample
        assert last[k]["output_ids"] == whole[k]["output_ids"]
        assert last[k]["text"] == whole[k]["text"]
        assert last[k]["meta_info"]["finish_reason"]["type"] == "length"
    assert last[2]["meta_info"]["cached_tokens"] == 31  # prefilled once before the samples


def _greedy_with_logprobs(http, prompt, **sampling) -> dict:
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True, **sampling},
        "return_logprob": True,
    }
    resp = http.post("/generate", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_penalties_and_logit_bias_change_the_logits_as_upstream(http, hf_model):
    prompt = _prompt(41)
    sampling = {
        "frequency_penalty": 0.7,
        "presence_penalty": 0.4,
        "repetition_penalty": 1.3,
        "logit_bias": {"7": 3.0, "11": -2.0},
    }
    got = _greedy_with_logprobs(http, prompt, **sampling)
    output = got["output_ids"]
    for i, (lp, tok, _) in enumerate(got["meta_info"]["output_token_logprobs"]):
        with torch.no_grad():
            row = hf_model(torch.tensor([prompt + output[:i]])).logits[0, -1].float()
        seen = output[:i]
        counts = torch.bincount(torch.tensor(seen, dtype=torch.long), minlength=row.numel()).float()
        rep = torch.where(row > 0, row / 1.3, row * 1.3)
        row = torch.where(counts > 0, rep, row) - 0.7 * counts - 0.4 * (counts > 0).float()
        row[7] += 3.0
        row[11] -= 2.0
        ref = torch.log_softmax(row, dim=-1)
        assert tok == int(ref.argmax())
        assert abs(lp - ref[tok].item()) < TOL


def test_min_new_tokens_holds_back_eos_and_stop_regex_stops(http):
    prompt = _prompt(51)
    eos = 2  # <|im_end|>, the tiny model's EOS
    biased = {"logit_bias": {str(eos): 100.0}, "ignore_eos": False}
    at_once = _greedy_with_logprobs(http, prompt, **biased)
    assert at_once["output_ids"] == [eos]
    held = _greedy_with_logprobs(http, prompt, min_new_tokens=5, **biased)
    assert len(held["output_ids"]) == 6 and held["output_ids"][-1] == eos
    assert eos not in held["output_ids"][:5]

    greedy = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    free = http.post("/generate", json={"input_ids": prompt, "sampling_params": greedy}).json()
    text = free["text"]
    needle = text[len(text) // 2 : len(text) // 2 + 2]
    regex = {**greedy, "stop_regex": re.escape(needle)}
    stopped = http.post("/generate", json={"input_ids": prompt, "sampling_params": regex}).json()
    assert stopped["meta_info"]["finish_reason"]["type"] == "stop"
    assert stopped["meta_info"]["finish_reason"]["matched"] == needle
    assert needle not in stopped["text"] and text.startswith(stopped["text"])


@pytest.mark.parametrize(
    "path, body, named",
    [
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        ("/v1/chat/completions", {"n": 0}, "n"),
        ("/v1/chat/completions", {"logit_bias": {"abc": 1.0}}, "logit_bias"),
        ("/v1/chat/completions", {"logit_bias": {"5": 500}}, "logit_bias"),
        ("/v1/completions", {"n": 0}, "n"),
        ("/v1/completions", {"logit_bias": {"100000": 1}}, "logit_bias"),
        ("/v1/completions", {"logprobs": 50}, "logprobs"),
        ("/v1/completions", {"suffix": "end"}, "suffix"),
    ],
)
def test_bad_sampling_input_is_a_400_naming_the_field(http, path, body, named):
    base = {"messages": [{"role": "user", "content": "Hi"}]} if "chat" in path else {"prompt": "Hi"}
    resp = http.post(path, json={**base, "max_tokens": 2, **body})
    assert resp.status_code == 400, resp.text
    message = resp.json()["error"]["message"]
    assert message.startswith(named) or f" {named}" in message, message
    ok = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200
