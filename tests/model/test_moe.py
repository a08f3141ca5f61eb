"""Mixture-of-experts layers (routed + shared experts) on tiny random checkpoints written by transformers.

DeepSeek-V2 (softmax, group-limited greedy top-k, 2 shared experts), DeepSeek-V3 (sigmoid scores with a
random ``e_score_correction_bias``, grouped top-k, renormalised, 1 shared expert) over MLA, and Qwen3-MoE
(softmax top-k, ``norm_topk_prob``) over GQA: logits within 1e-4 of transformers (fp32) and the same greedy
tokens. Qwen3-MoE at tp 2 (every expert's intermediate columns split, partial sums all-reduced) equals tp 1.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from model_testlib import PageAllocator, greedy_generate, hf_greedy, save_tiny_model
from test_tp_shards import run_group

from engine.cache.device_pool import DeviceKVPool
from engine.distributed import TPConfigError, check_tp_size
from engine.model.errors import ModelLoadError
from engine.model.linear import Int8WeightOnlyLinear, QuantizationError
from engine.model.loader import load_config
from engine.model.moe import MoE
from engine.model.runner import ModelRunner

ATOL = 1e-4
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    out = {}
    for seed, kind in enumerate(("deepseek_v2_moe", "deepseek_v3_moe", "qwen3_moe"), start=31):
        folder = tmp_path_factory.mktemp(f"tiny-{kind}")
        out[kind] = (folder, save_tiny_model(folder, kind, seed=seed))
    return out


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 300, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize(
    ("kind", "router", "moe_layers"),
    [
        ("deepseek_v2_moe", "group_limited_greedy", (1,)),
        ("deepseek_v3_moe", "noaux_tc", (1,)),
        ("qwen3_moe", "softmax", (0, 1)),
    ],
)
def test_moe_models_match_hf(moe_models, kind, router, moe_layers):
    folder, hf_model = moe_models[kind]
    runner = ModelRunner(folder, dtype="float32")
    assert runner.config.topk_method == router and runner.config.moe_layers == moe_layers
    prompts = [_prompt(n, seed=n) for n in (5, 37)]  # a mixed batch: prefill chunks beside decodes
    pool = DeviceKVPool(1024, 16, **vars(runner.kv_pool_spec()))
    logits, outputs = greedy_generate(runner, pool, PageAllocator(pool), prompts, NEW_TOKENS, 12)
    for prompt, got_logits, got in zip(prompts, logits, outputs, strict=True):
        assert got == hf_greedy(hf_model, prompt, NEW_TOKENS)
        with torch.no_grad():
            ref = hf_model(torch.tensor([prompt + got[:-1]])).logits[0]
        assert (got_logits - ref).abs().max().item() < ATOL


def test_v2_greedy_router_matches_hf(tmp_path):
    hf_model = save_tiny_model(tmp_path, "deepseek_v2_moe", seed=3, topk_method="greedy", n_group=None)
    runner = ModelRunner(tmp_path, dtype="float32")
    assert runner.config.topk_method == "greedy"
    pool = DeviceKVPool(256, 4, **vars(runner.kv_pool_spec()))
    prompt = _prompt(20, seed=5)
    _, outputs = greedy_generate(runner, pool, PageAllocator(pool), [prompt], NEW_TOKENS, 8)
    assert outputs[0] == hf_greedy(hf_model, prompt, NEW_TOKENS)


def test_each_routed_layer_picks_the_experts_transformers_picks(moe_models):
    """The router alone: the same expert sets and weights as transformers' router on the same hidden states
    (V3: the bias moves choices, the weights are the unbiased scores)."""
    folder, hf_model = moe_models["deepseek_v3_moe"]
    runner = ModelRunner(folder, dtype="float32")
    moe: MoE = runner.model.layers[1].mlp.moe
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    weights, ids = moe.route(x)
    with torch.no_grad():
        _, hf_weights, hf_ids = hf_model.model.layers[1].mlp.gate(x)
    order, hf_order = ids.sort(dim=-1), hf_ids.sort(dim=-1)
    assert torch.equal(order.values, hf_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), hf_weights.gather(1, hf_order.indices))
    biased = (ids != torch.topk(torch.sigmoid(x @ moe.gate.T), 2, dim=-1)[1].sort(dim=-1).values).any()
    assert biased  # the correction bias changed some token's choice, so the test sees it


def test_qwen3_moe_at_tp2_equals_tp1(moe_models):
    folder = moe_models["qwen3_moe"][0]
    want_logits, want = run_group(folder, 1)
    got_logits, got = run_group(folder, 2)
    assert got == want
    for a, b in zip(got_logits, want_logits, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)


def test_a_tp_the_expert_width_does_not_divide_is_refused(moe_models):
    cfg = dataclasses.replace(load_config(moe_models["qwen3_moe"][0]), moe_intermediate_size=30)
    with pytest.raises(TPConfigError, match="moe_intermediate_size 30 is not divisible by 4.*--ep-size"):
        check_tp_size(cfg, 4)  # the 4 heads and 2 KV heads (replicated) take tp 4


def test_a_router_the_engine_does_not_know_is_refused_naming_the_field(tmp_path):
    save_tiny_model(tmp_path, "deepseek_v2_moe", seed=1, topk_method="sinkhorn")
    with pytest.raises(ModelLoadError, match="topk_method 'sinkhorn' is not supported"):
        ModelRunner(tmp_path)


def test_int8wo_mla_and_moe_greedy_tokens_are_in_hf_top5(tmp_path):
    """Every linear layer int8 (MLA projections, each expert, the shared expert, LM head), decode on the
    CPU kernels: each of 16 greedy tokens in transformers' fp32 top-5."""
    hf_model = save_tiny_model(tmp_path, "deepseek_v3_moe", seed=3, q_lora_rank=32)
    runner = ModelRunner(tmp_path, dtype="float32", quantization="int8wo")
    assert isinstance(runner.model.layers[1].mlp.moe.experts[0][0], Int8WeightOnlyLinear)
    prompt = _prompt(30, seed=1)
    pool = DeviceKVPool(512, 16, **vars(runner.kv_pool_spec()))
    _, outputs = greedy_generate(runner, pool, PageAllocator(pool), [prompt], 16, 16)
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt + outputs[0][:-1]])).logits[0, len(prompt) - 1 :]
    top5 = ref.topk(5, dim=-1).indices
    assert all(tok in top5[i].tolist() for i, tok in enumerate(outputs[0]))


def test_int8wo_refuses_a_width_its_kernel_cannot_take_naming_the_flag(tmp_path):
    """torch's int8 kernel needs in_features divisible by 16 (it crashed the process on q_lora_rank 24)."""
    save_tiny_model(tmp_path, "deepseek_v3", seed=3, q_lora_rank=24)
    with pytest.raises(QuantizationError, match="--torchao-config int8wo: a 128x24 weight needs in_features"):
        ModelRunner(tmp_path, quantization="int8wo")
