"""The paged torch model equals transformers (fp32) on tiny random Llama / Qwen2 / Qwen3 models.

Prompts longer than one prefill chunk go through the KV pool in several chunks, into shuffled pages; decode
reads everything back through slots. Logits at every position must be within 1e-4 of HF and greedy tokens
identical.
"""

from __future__ import annotations

import pytest
import torch
from model_testlib import PageAllocator, greedy_generate, hf_greedy, save_tiny_model

from engine.cache.device_pool import DeviceKVPool
from engine.model.runner import ModelRunner

ATOL = 1e-4
NEW_TOKENS = 32


def _prompt(length: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _check_against_hf(runner, hf_model, prompts, page_size, chunk_size):
    pool = DeviceKVPool(2048, page_size, **vars(runner.kv_pool_spec()))
    logits, outputs = greedy_generate(
        runner, pool, PageAllocator(pool, seed=page_size), prompts, NEW_TOKENS, chunk_size
    )
    for prompt, got_logits, got_tokens in zip(prompts, logits, outputs, strict=True):
        expected_tokens = hf_greedy(hf_model, prompt, NEW_TOKENS)
        assert got_tokens == expected_tokens
        ref = _hf_logits(hf_model, prompt + got_tokens[:-1])
        assert got_logits.shape == ref.shape
        assert (got_logits - ref).abs().max().item() < ATOL


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_chunked_prefill_and_decode_match_hf(tiny_models, kind, page_size):
    folder, hf_model = tiny_models[kind]
    runner = ModelRunner(folder, dtype="float32")
    prompt = _prompt(45, seed=1, vocab=runner.config.vocab_size)  # 3 chunks of 16, 16, 13
    _check_against_hf(runner, hf_model, [prompt], page_size, chunk_size=16)


@pytest.mark.parametrize("page_size", [1, 16])
def test_mixed_batch_of_prefill_chunks_and_decodes_matches_hf(tiny_models, page_size):
    folder, hf_model = tiny_models["llama"]
    runner = ModelRunner(folder, dtype="float32")
    prompts = [_prompt(n, seed=n, vocab=runner.config.vocab_size) for n in (1, 7, 30, 41)]
    _check_against_hf(runner, hf_model, prompts, page_size, chunk_size=12)


def test_triton_backend_under_the_interpreter_matches_hf(tiny_models, monkeypatch):
    """The Triton kernels (decode and extend over the page table) on mixed batches, via TRITON_INTERPRET."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    folder, hf_model = tiny_models["llama"]
    runner = ModelRunner(folder, dtype="float32", attention_backend="triton")
    prompts = [_prompt(n, seed=n, vocab=runner.config.vocab_size) for n in (1, 7, 30)]
    _check_against_hf(runner, hf_model, prompts, page_size=16, chunk_size=12)


def test_llama3_rope_scaling_tied_embeddings_and_biases_match_hf(tmp_path):
    rope = {
        "rope_type": "llama3",
        "rope_theta": 50000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    hf_model = save_tiny_model(
        tmp_path,
        "llama",
        seed=7,
        rope_parameters=rope,
        tie_word_embeddings=True,
        attention_bias=True,
        mlp_bias=True,
    )
    runner = ModelRunner(tmp_path, dtype="float32")
    assert runner.config.rope_scaling["rope_type"] == "llama3"
    assert runner.config.tie_word_embeddings and runner.config.o_proj_bias
    _check_against_hf(
        runner, hf_model, [_prompt(70, seed=3, vocab=runner.config.vocab_size)], 16, chunk_size=32
    )


def test_multi_query_heads_and_explicit_head_dim_match_hf(tmp_path):
    hf_model = save_tiny_model(tmp_path, "qwen3", seed=5, num_key_value_heads=1, head_dim=32)
    runner = ModelRunner(tmp_path, dtype="float32")
    assert runner.kv_pool_spec().num_kv_heads == 1 and runner.kv_pool_spec().head_dim == 32
    _check_against_hf(
        runner, hf_model, [_prompt(20, seed=4, vocab=runner.config.vocab_size)], 1, chunk_size=8
    )


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@CUDA
def test_cuda_float32_matches_hf(tiny_models):
    folder, hf_model = tiny_models["qwen2"]
    runner = ModelRunner(folder, dtype="float32", device="cuda")
    assert runner.kv_pool_spec().device.type == "cuda"
    _check_against_hf(
        runner, hf_model, [_prompt(45, seed=1, vocab=runner.config.vocab_size)], 16, chunk_size=16
    )


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_bfloat16_greedy_tokens_are_in_hf_top5(tiny_models, device):
    """bf16 weights and KV pool: each of 32 greedy tokens is in HF fp32's top-5 given the same context."""
    folder, hf_model = tiny_models["qwen2"]
    runner = ModelRunner(folder, dtype="bfloat16", device=device)
    prompt = _prompt(45, seed=1, vocab=runner.config.vocab_size)
    pool = DeviceKVPool(2048, 16, **vars(runner.kv_pool_spec()))
    _, outputs = greedy_generate(runner, pool, PageAllocator(pool), [prompt], NEW_TOKENS, 16)
    ref = _hf_logits(hf_model, prompt + outputs[0][:-1])[len(prompt) - 1 :]
    top5 = ref.topk(5, dim=-1).indices
    assert all(tok in top5[i].tolist() for i, tok in enumerate(outputs[0]))
