"""GGUF loading: tiny HF models written the way llama.cpp's converter writes them load back equal to HF.

Covers the llama Q/K row permutation (undone by the loader), Qwen2 biases (not permuted), Q8_0 dequantization,
config from metadata, and the byte-level BPE tokenizer rebuilt from ``tokenizer.ggml.*``.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import tokenizers
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from model_testlib import (
    PageAllocator,
    greedy_generate,
    hf_greedy,
    save_tiny_model,
    write_deepseek2_gguf,
    write_gguf,
)

from engine.cache.device_pool import DeviceKVPool
from engine.model.config import ModelConfig
from engine.model.errors import ModelLoadError
from engine.model.loader import load_checkpoint
from engine.model.runner import ModelRunner

PROMPT = [5, 17, 200, 31, 4, 99, 123, 250, 8, 64, 77, 1, 2, 3, 300, 42, 11, 19, 23]


def _assert_runner_matches_hf(runner: ModelRunner, hf_model) -> None:
    pool = DeviceKVPool(512, 16, **vars(runner.kv_pool_spec()))
    logits, outputs = greedy_generate(runner, pool, PageAllocator(pool), [PROMPT], 16, chunk_size=8)
    assert outputs[0] == hf_greedy(hf_model, PROMPT, 16)
    with torch.no_grad():
        ref = hf_model(torch.tensor([PROMPT + outputs[0][:-1]])).logits[0]
    assert (logits[0] - ref).abs().max().item() < 1e-4


def test_llama_gguf_with_permuted_qk_matches_hf(tmp_path):
    hf_model = save_tiny_model(tmp_path, "llama", seed=11)
    write_gguf(
        tmp_path / "tiny.gguf", hf_model, tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    )
    runner = ModelRunner(tmp_path / "tiny.gguf", dtype="float32")
    cfg = runner.config
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        "llama",
        2,
        4,
        2,
    )
    assert cfg.rope_theta == 5000.0 and cfg.vocab_size == 320 and not cfg.tie_word_embeddings
    _assert_runner_matches_hf(runner, hf_model)


def test_qwen2_gguf_with_biases_matches_hf(tmp_path):
    hf_model = save_tiny_model(tmp_path, "qwen2", seed=12)
    write_gguf(
        tmp_path / "tiny.gguf", hf_model, tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    )
    runner = ModelRunner(tmp_path / "tiny.gguf", dtype="float32")
    assert runner.config.architecture == "qwen2" and runner.config.attention_bias
    _assert_runner_matches_hf(runner, hf_model)


def test_q8_0_tensors_dequantize_to_the_quantized_hf_weights(tmp_path):
    hf_model = save_tiny_model(tmp_path, "llama", seed=13)
    write_gguf(
        tmp_path / "q8.gguf",
        hf_model,
        tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json")),
        qtype=GGMLQuantizationType.Q8_0,
    )
    loaded = load_checkpoint(tmp_path / "q8.gguf").tensors
    for name, weight in hf_model.state_dict().items():
        w = weight.float().numpy()
        expected = (
            dequantize(quantize(w, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
            if w.ndim == 2
            else w
        )
        assert torch.equal(loaded[name], torch.from_numpy(expected.reshape(w.shape))), name
    q = loaded["model.layers.0.self_attn.q_proj.weight"]
    assert 0 < (q - hf_model.state_dict()["model.layers.0.self_attn.q_proj.weight"]).abs().max() < 0.05


def test_gguf_tokenizer_and_chat_template_match_the_hf_folder(tmp_path):
    hf_model = save_tiny_model(tmp_path, "llama", seed=14)
    write_gguf(
        tmp_path / "tiny.gguf", hf_model, tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    )
    from_gguf = load_checkpoint(tmp_path / "tiny.gguf").tokenizer
    from_folder = load_checkpoint(tmp_path).tokenizer
    messages = [{"role": "user", "content": "the lazy dog \u2713"}]
    for text in ["the quick brown fox", "caf\u00e9 \u4f60\u597d \u2713", "<|im_start|>user\nhi<|im_end|>"]:
        assert from_gguf.encode(text) == from_folder.encode(text)
    assert from_gguf.encode_chat(messages) == from_folder.encode_chat(messages)
    assert from_gguf.decode(from_gguf.encode("caf\u00e9 \u2713")) == "caf\u00e9 \u2713"
    assert from_gguf.eos_token_ids == {from_folder.token_to_id("<|im_end|>")}


# the released DeepSeek configs' yarn shape (mscale == mscale_all_dim, which is what the GGUF keeps)
YARN = {
    "rope_type": "yarn", "rope_theta": 5000.0, "factor": 8.0, "original_max_position_embeddings": 16,
    "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.8, "mscale_all_dim": 0.8,
}  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "overrides"),
    [
        ("deepseek_v2_moe", {}),
        ("deepseek_v3_moe", {}),
        ("deepseek_v3_moe", {"rope_parameters": YARN, "max_position_embeddings": 128}),
    ],
    ids=["v2", "v3", "v3-yarn"],
)
def test_deepseek2_gguf_loads_equal_to_the_hf_folder(tmp_path, kind, overrides):
    """llama.cpp's ``deepseek2`` layout (stacked experts, kv_b_proj split into attn_k_b / attn_v_b, one MQA
    head of the latent's width; yarn as its type, factor, original context and log multiplier): every
    tensor loads equal to the HF folder's, the config is the folder's, and the runner's greedy tokens and
    logits are transformers'."""
    hf_model = save_tiny_model(tmp_path, kind, seed=15, **overrides)
    write_deepseek2_gguf(tmp_path / "tiny.gguf", tmp_path)
    hf, gg = load_checkpoint(tmp_path), load_checkpoint(tmp_path / "tiny.gguf")
    assert gg.config.rms_norm_eps == pytest.approx(hf.config.rms_norm_eps)  # stored as float32
    # every field but those the GGUF keeps elsewhere (eps above; BOS / EOS ids: the tokenizer's metadata)
    ids = {"bos_token_id": None, "eos_token_ids": ()}
    assert replace(gg.config, rms_norm_eps=hf.config.rms_norm_eps, **ids) == replace(hf.config, **ids)
    assert sorted(gg.tensors) == sorted(hf.tensors)
    for name, tensor in hf.tensors.items():
        assert torch.equal(gg.tensors[name], tensor.float()), name
    _assert_runner_matches_hf(ModelRunner(tmp_path / "tiny.gguf", dtype="float32"), hf_model)


def test_a_deepseek2_gguf_with_half_of_kv_b_is_refused_naming_the_tensor(tmp_path):
    save_tiny_model(tmp_path, "deepseek_v3_moe", seed=16)
    path = tmp_path / "tiny.gguf"
    write_deepseek2_gguf(path, tmp_path)
    data = bytearray(path.read_bytes())  # layer 0's attn_v_b renamed into layer 9: both halves unpaired
    at = data.find(b"blk.0.attn_v_b.weight")
    data[at : at + 5] = b"blk.9"
    (tmp_path / "broken.gguf").write_bytes(data)
    with pytest.raises(
        ModelLoadError, match=r"'blk\.0\.attn_k_b\.weight' without its other half of kv_b_proj"
    ):
        load_checkpoint(tmp_path / "broken.gguf")


def test_a_rope_scaling_the_loader_does_not_map_is_refused_naming_the_key():
    meta = {"general.architecture": "qwen2", "qwen2.attention.head_count": 4, "qwen2.embedding_length": 64}
    meta["qwen2.rope.scaling.type"] = "yarn"  # mapped for deepseek2 only
    with pytest.raises(ModelLoadError, match=r"GGUF qwen2\.rope\.scaling\.type 'yarn' is not mapped"):
        ModelConfig.from_gguf(meta, "tiny.gguf", tie_word_embeddings=True)
