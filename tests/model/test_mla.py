"""DeepSeek-V2/V3 (multi-head latent attention) on tiny random checkpoints written by transformers.

The paged model equals transformers (fp32) over chunked prefill, mixed batches and decode through shuffled
pages; the pool holds one latent per token and layer (``kv_lora_rank + qk_rope_head_dim`` values, as one
head's K and V half rows), which is what the sizing reports; a quantized ``--kv-cache-dtype`` stores the
latent encoded; what MLA cannot run with yet is refused naming the flag or the field.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from model_testlib import PageAllocator, greedy_generate, hf_greedy, save_tiny_model, tiny_config
from test_tp_shards import run_group

from engine.cache.device_pool import DeviceKVPool
from engine.model.errors import ModelLoadError
from engine.model.forward_batch import ForwardBatch
from engine.model.runner import ModelRunner
from engine.sizing.kv import model_kv_shape, shape_for

ATOL = 1e-4
NEW_TOKENS = 24
LATENT = 32 + 16  # tiny models: kv_lora_rank + qk_rope_head_dim


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 300, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _check_against_hf(runner, hf_model, prompts, page_size, chunk_size):
    pool = DeviceKVPool(2048, page_size, **vars(runner.kv_pool_spec()))
    logits, outputs = greedy_generate(
        runner, pool, PageAllocator(pool, seed=page_size), prompts, NEW_TOKENS, chunk_size
    )
    for prompt, got_logits, got_tokens in zip(prompts, logits, outputs, strict=True):
        assert got_tokens == hf_greedy(hf_model, prompt, NEW_TOKENS)
        with torch.no_grad():
            ref = hf_model(torch.tensor([prompt + got_tokens[:-1]])).logits[0].float()
        assert got_logits.shape == ref.shape
        assert (got_logits - ref).abs().max().item() < ATOL


@pytest.mark.parametrize("kind", ["deepseek_v2", "deepseek_v3"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_chunked_prefill_and_decode_match_hf(tiny_mla_models, kind, page_size):
    folder, hf_model = tiny_mla_models[kind]
    runner = ModelRunner(folder, dtype="float32")
    assert runner.config.mla and runner.config.architecture == kind
    assert runner.config.q_lora_rank == (None if kind == "deepseek_v2" else 24)
    _check_against_hf(runner, hf_model, [_prompt(45, seed=1)], page_size, chunk_size=16)


def test_mixed_batch_of_prefill_chunks_and_decodes_matches_hf(tiny_mla_models):
    folder, hf_model = tiny_mla_models["deepseek_v3"]
    runner = ModelRunner(folder, dtype="float32")
    prompts = [_prompt(n, seed=n) for n in (1, 7, 30, 41)]
    _check_against_hf(runner, hf_model, prompts, page_size=16, chunk_size=12)


def test_v3_rotate_half_rope_and_attention_biases_match_hf(tmp_path):
    """``rope_interleave: false`` (rotate-half RoPE) and ``attention_bias`` (q_a, kv_a and o biases)."""
    hf_model = save_tiny_model(tmp_path, "deepseek_v3", seed=5, rope_interleave=False, attention_bias=True)
    runner = ModelRunner(tmp_path, dtype="float32")
    assert not runner.config.rope_interleave and runner.config.attention_bias
    _check_against_hf(runner, hf_model, [_prompt(30, seed=2)], page_size=4, chunk_size=8)


YARN = {
    "rope_type": "yarn", "rope_theta": 5000.0, "factor": 8.0, "original_max_position_embeddings": 16,
    "beta_fast": 32, "beta_slow": 1, "mscale": 0.8, "mscale_all_dim": 1.0,
}  # fmt: skip


@pytest.mark.parametrize("kind", ["deepseek_v2", "deepseek_v3"])
def test_yarn_rope_matches_hf(tmp_path, kind):
    """The released checkpoints' yarn RoPE: the ramped frequencies, cos / sin times the attention factor
    (mscale / mscale_all_dim) and the softmax scale times mscale_all_dim's mscale squared, past the original
    16 positions."""
    hf_model = save_tiny_model(
        tmp_path, kind, seed=4, rope_parameters=dict(YARN), max_position_embeddings=128
    )
    runner = ModelRunner(tmp_path, dtype="float32")
    assert runner.config.rope_scaling["rope_type"] == "yarn"
    _check_against_hf(runner, hf_model, [_prompt(40, seed=6)], page_size=4, chunk_size=16)


def test_yarn_is_refused_for_a_gqa_model_naming_it(tmp_path):
    save_tiny_model(tmp_path, "qwen3", seed=1, rope_parameters=dict(YARN))
    with pytest.raises(
        ModelLoadError, match="rope_type 'yarn' is supported for DeepSeek \\(MLA\\) models only"
    ):
        ModelRunner(tmp_path)


def test_the_pool_holds_one_latent_per_token_and_layer(tiny_mla_models):
    """One head, K and V rows each half the latent: the bytes of ``layers x latent`` values, which the
    sizing reports from the config alone; a GQA model of the same hidden size needs 4/3 of them here
    (2 KV heads x 16 x K and V = 64 values against 48)."""
    folder = tiny_mla_models["deepseek_v2"][0]
    spec = ModelRunner(folder, dtype="float32").kv_pool_spec()
    assert (spec.num_kv_heads, spec.head_dim) == (1, LATENT // 2)
    pool = DeviceKVPool(64, 16, **vars(spec))
    assert pool.bytes_per_token == 2 * LATENT * 4
    assert model_kv_shape(str(folder), "float32").bytes_per_token == pool.bytes_per_token
    assert model_kv_shape(str(folder), "bfloat16").bytes_per_token == 2 * LATENT * 2
    gqa = tiny_config("llama")
    gqa_bytes = shape_for(2, gqa.num_key_value_heads, gqa.hidden_size // gqa.num_attention_heads, "float32")
    assert gqa_bytes.bytes_per_token == 2 * 2 * 2 * 16 * 4


def test_latent_written_to_the_pool_is_normalised_c_kv_then_rotated_k_pe(tiny_mla_models):
    """The rows of a token are ``kv_a_layernorm(c_kv)`` followed by ``k_pe`` after RoPE (at position 0 RoPE
    is the identity up to the interleaved layout's permutation), not the expanded per-head K/V."""
    folder, hf_model = tiny_mla_models["deepseek_v2"]
    runner = ModelRunner(folder, dtype="float32")
    pool = DeviceKVPool(16, 1, **vars(runner.kv_pool_spec()))
    runner.forward(ForwardBatch.from_sequences([[7]], [torch.tensor([1])]), pool)
    k_rows, v_rows = pool.get_kv(0)
    latent = torch.cat((k_rows[1, 0], v_rows[1, 0]))
    attn = hf_model.model.layers[0].self_attn
    with torch.no_grad():
        h = hf_model.model.layers[0].input_layernorm(hf_model.model.embed_tokens(torch.tensor([7])))
        c_kv, k_pe = attn.kv_a_proj_with_mqa(h)[0].split((32, 16))
        c_kv = attn.kv_a_layernorm(c_kv)
    torch.testing.assert_close(latent[:32], c_kv, atol=1e-6, rtol=0)
    torch.testing.assert_close(latent[32:], torch.cat((k_pe[0::2], k_pe[1::2])), atol=1e-6, rtol=0)


def _greedy(runner: ModelRunner, kv_cache_dtype: str, ids: list[int], steps: int):
    pool = DeviceKVPool(256, 1, **vars(runner.kv_pool_spec()), kv_cache_dtype=kv_cache_dtype)
    slots = torch.arange(1, len(ids) + 1)
    logits = [runner.forward(ForwardBatch.from_sequences([ids], [slots]), pool)[0]]
    out = [int(logits[-1].argmax())]
    for _ in range(steps):
        slots = torch.arange(1, slots.shape[0] + 2)
        logits.append(runner.forward(ForwardBatch.for_decode([out[-1]], [slots]), pool)[0])
        out.append(int(logits[-1].argmax()))
    return out, logits, pool


@pytest.mark.parametrize(
    ("name", "row_bytes", "bound"), [("int8", LATENT // 2 + 2, 0.03), ("fp8_e4m3", LATENT // 2, 0.15)]
)
def test_quantized_kv_stores_the_latent_encoded(tiny_mla_models, name, row_bytes, bound):
    """``--kv-cache-dtype`` on the latent: rows are uint8 (int8: each half row carries its bfloat16 scale),
    the bytes per token follow, and the logits stay near the float32 latent's (relative max error; bounds
    as the GQA models' in test_kv_cache_dtype.py)."""
    runner = ModelRunner(tiny_mla_models["deepseek_v3"][0], dtype="float32")
    ids = list(range(5, 45))
    tokens, full, _ = _greedy(runner, "auto", ids, 6)
    pool = DeviceKVPool(256, 1, **vars(runner.kv_pool_spec()), kv_cache_dtype=name)
    assert pool.dtype == torch.uint8 and pool.row_dim == row_bytes
    assert pool.bytes_per_token == 2 * 2 * row_bytes
    slots = torch.arange(1, len(ids) + 1)
    got = [runner.forward(ForwardBatch.from_sequences([ids], [slots]), pool)[0]]
    for tok in tokens[:-1]:
        slots = torch.arange(1, slots.shape[0] + 2)
        got.append(runner.forward(ForwardBatch.for_decode([tok], [slots]), pool)[0])
    gap = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, full, strict=True))
    assert 0 < gap <= bound, gap


@pytest.fixture(scope="module")
def v3_moe_folder(tmp_path_factory):
    """DeepSeek-V3 with MLA, an MoE layer (shared expert, grouped routing) and attention biases."""
    folder = tmp_path_factory.mktemp("tiny-deepseek-v3-moe-tp")
    save_tiny_model(folder, "deepseek_v3_moe", seed=9, attention_bias=True)
    return folder


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_mla_and_moe_at_tp_equal_tp1(v3_moe_folder, tp):
    """Heads split over the ranks (q, kv_b rows, o columns all-reduced), the latent whole on each rank,
    experts split by columns: logits and greedy tokens equal tp 1's; each rank's pool holds the latent."""
    want_logits, want = run_group(v3_moe_folder, 1)
    got_logits, got = run_group(v3_moe_folder, tp)
    assert got == want
    for a, b in zip(got_logits, want_logits, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)


def test_flags_mla_cannot_run_with_yet_are_refused_naming_them(tiny_mla_models):
    folder = tiny_mla_models["deepseek_v2"][0]
    with pytest.raises(
        ValueError, match="--attention-backend triton: deepseek_v2 \\(MLA\\).*--attention-backend torch"
    ):
        ModelRunner(folder, attention_backend="triton")


def test_an_odd_latent_is_refused_naming_its_fields(tmp_path):
    save_tiny_model(tmp_path, "deepseek_v2", seed=1, kv_lora_rank=31)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["kv_lora_rank"] == 31
    with pytest.raises(ModelLoadError, match="kv_lora_rank 31 \\+ qk_rope_head_dim 16 must be even"):
        ModelRunner(tmp_path)


def test_decode_in_the_latent_space_equals_expanding_the_latent(tiny_mla_models):
    """A one-token step attends through the absorbed ``W_UK`` / ``W_UV`` (no per-head expansion of the
    cache): the same output as expanding every cached token, within float32 rounding, over sequences of
    different lengths in one batch."""
    runner = ModelRunner(tiny_mla_models["deepseek_v3"][0], dtype="float32")
    pool = DeviceKVPool(256, 1, **vars(runner.kv_pool_spec()))
    lens = (9, 30)
    slots = [torch.arange(1, 1 + n) + 100 * i for i, n in enumerate(lens)]
    runner.forward(ForwardBatch.from_sequences([_prompt(n, seed=n) for n in lens], slots), pool)
    grown = [torch.cat((s, s[-1:] + 1)) for s in slots]
    batch = ForwardBatch.for_decode([7, 8], grown)
    layer, attn = runner.model.layers[1], runner.model.attn
    attn.init_forward_metadata(batch)
    q = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(0))
    latent = torch.randn(2, LATENT, generator=torch.Generator().manual_seed(1))
    expanded = attn.forward(q, latent, 1, batch, pool, layer.kv_b)
    absorbed = attn.forward(q, latent, 1, batch, pool, layer.kv_b, layer.absorbed)
    torch.testing.assert_close(absorbed, expanded, atol=1e-5, rtol=1e-5)
