"""Int8 weight-only linear layers (``--torchao-config int8wo``): the math of one layer, then whole models."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from model_testlib import PageAllocator, greedy_generate

from engine.cache.device_pool import DeviceKVPool
from engine.model.forward_batch import ForwardBatch
from engine.model.linear import DenseLinear, Int8WeightOnlyLinear, make_linear
from engine.model.runner import ModelRunner


def test_int8_layer_rounds_each_weight_to_its_row_scale_and_matches_the_dequantized_matmul():
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(5, 64, generator=gen)
    layer = make_linear(w, b, "int8wo")
    assert isinstance(layer, Int8WeightOnlyLinear) and layer.qweight.dtype == torch.int8
    scale = layer.scales.float()
    assert torch.allclose(scale, w.abs().amax(dim=1) / 127, rtol=2e-2)
    assert (layer.dequantized() - w).abs().le(scale[:, None] / 2 + 1e-6).all()  # round to nearest step
    assert layer.qweight.abs().amax(dim=1).ge(125).all()  # a row's largest weight is near +-127
    out = layer(x)
    assert out.shape == (5, 96) and out.dtype == torch.float32
    ref = F.linear(x.bfloat16().float(), layer.dequantized(), b)
    assert torch.allclose(out, ref, rtol=2e-2, atol=2e-2)  # bf16 activations and output inside the kernel
    assert isinstance(make_linear(w, b, None), DenseLinear)


def test_unknown_quantization_is_refused_before_loading(tiny_models):
    folder, _ = tiny_models["llama"]
    with pytest.raises(ValueError, match="int8wo"):
        ModelRunner(folder, quantization="int2wo")


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_int8wo_greedy_tokens_are_in_hf_top5(tiny_models, kind):
    """All linear layers int8 (fp32 model; qwen2 has biases): each of 16 greedy tokens in HF fp32 top-5."""
    folder, hf_model = tiny_models[kind]
    runner = ModelRunner(folder, dtype="float32", quantization="int8wo")
    assert isinstance(runner.model.lm_head, Int8WeightOnlyLinear)
    prompt = torch.randint(3, runner.config.vocab_size, (30,), generator=torch.Generator().manual_seed(1))
    prompt = prompt.tolist()
    pool = DeviceKVPool(1024, 16, **vars(runner.kv_pool_spec()))
    _, outputs = greedy_generate(runner, pool, PageAllocator(pool), [prompt], 16, 16)
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt + outputs[0][:-1]])).logits[0, len(prompt) - 1 :]
    top5 = ref.topk(5, dim=-1).indices
    assert all(tok in top5[i].tolist() for i, tok in enumerate(outputs[0]))


def test_smollm2_int8wo_prefill_agrees_with_float32(smollm2_checkpoint, smollm2_runner):
    """The real model, int8 weights: first answer token "The" as in fp32; top-1 in fp32's top-5 at >= 95% of
    the prompt positions (measured agreement over a prompt set: docs/model.md)."""
    runner = ModelRunner.from_checkpoint(smollm2_checkpoint, dtype="float32", quantization="int8wo")
    prompt = runner.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    logits = {}
    for name, r in (("int8", runner), ("fp32", smollm2_runner)):
        pool = DeviceKVPool(256, 16, **vars(r.kv_pool_spec()))
        batch = ForwardBatch.from_sequences([prompt], [torch.arange(16, 16 + len(prompt))])
        logits[name] = r.forward(batch, pool, return_all_logits=True)
    assert runner.tokenizer.decode([int(logits["int8"][-1].argmax())]) == "The"
    top5 = logits["fp32"].topk(5, dim=-1).indices
    in_top5 = (top5 == logits["int8"].argmax(-1, keepdim=True)).any(-1).float().mean().item()
    assert in_top5 >= 0.95
