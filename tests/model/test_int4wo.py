"""Int4 weight-only linear layers (``--torchao-config int4wo-<group_size>``): one layer's math, the GGUF's
Q4_1 grid, refused shapes and dtypes, then the real model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.cache.device_pool import DeviceKVPool
from engine.model.forward_batch import ForwardBatch
from engine.model.linear import Int4WeightOnlyLinear, Int8WeightOnlyLinear, QuantizationError, make_linear
from engine.model.runner import ModelRunner


@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_layer_rounds_each_weight_to_its_group_grid_and_matches_the_dequantized_matmul(group_size):
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 128, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(5, 128, generator=gen)
    layer = make_linear(w, b, f"int4wo-{group_size}")
    assert isinstance(layer, Int4WeightOnlyLinear) and layer.packed.dtype == torch.uint8
    assert layer.packed.shape == (96, 64)  # two weights a byte
    assert layer.scales_and_zeros.shape == (128 // group_size, 96, 2)
    assert int(layer.qweight.min()) == 0 and int(layer.qweight.max()) == 15
    groups = w.reshape(96, -1, group_size)
    step = (groups.amax(-1) - groups.amin(-1)) / 15
    err = (layer.dequantized() - w).reshape_as(groups).abs()
    assert err.le(0.55 * step[..., None]).all()  # nearest of 16 levels; bf16 scale/zero add <= 0.05 step
    out = layer(x.bfloat16()).float()
    ref = F.linear(x.bfloat16().float(), layer.dequantized(), b)
    # bf16 activations, bf16 output: relative 2^-8 of the row's magnitude
    assert torch.allclose(out, ref, rtol=2e-2, atol=3e-2 * ref.abs().amax().item())


def test_int4wo_32_keeps_a_q4_1_block_grid_exactly():
    """Weights already of the GGUF Q4_1 form ``d * q + m`` (each block of 32 using q=0 and q=15) get back the
    same q under int4wo-32; only the bf16 rounding of scale and zero moves them (<= 0.1 of a step)."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (64, 4, 32), generator=gen)
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(64, 4, 1, generator=gen) * 0.02 + 1e-3).half().float()
    m = (-d * (6 + 4 * torch.rand(64, 4, 1, generator=gen))).half().float()  # min ~ -max, as in SmolLM2
    w = (d * q + m).reshape(64, 128)
    layer = make_linear(w, None, "int4wo-32")
    assert torch.equal(layer.qweight, q.reshape(64, 128).to(torch.uint8))
    assert (layer.dequantized() - w).reshape(64, 4, 32).abs().le(0.1 * d).all()


def test_smollm2_q4_1_tensors_keep_their_gguf_levels_under_int4wo_32(smollm2_checkpoint):
    w = smollm2_checkpoint.tensors["model.layers.0.mlp.gate_proj.weight"].float()
    groups = w.reshape(w.shape[0], -1, 32)
    lo, hi = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    step = (hi - lo) / 15
    gguf_q = torch.round((groups - lo) / step)
    assert (groups - lo - gguf_q * step).abs().le(1e-3 * step).all()  # the dequantized GGUF is on a 16-grid
    layer = make_linear(w, None, "int4wo-32")
    assert torch.equal(layer.qweight.reshape_as(groups), gguf_q.to(torch.uint8))


def test_shapes_dtypes_and_names_the_int4_kernel_cannot_take_are_refused(tiny_models):
    w = torch.randn(96, 64)
    with pytest.raises(QuantizationError, match="--torchao-config int4wo-128: a 96x64 weight"):
        make_linear(w, None, "int4wo-128")  # 64 input columns: no group of 128
    with pytest.raises(QuantizationError, match="out_features by 16"):
        make_linear(torch.randn(100, 64), None, "int4wo-32")
    folder, _ = tiny_models["llama"]
    with pytest.raises(QuantizationError, match="--torchao-config int4wo-32 needs --dtype bfloat16"):
        ModelRunner(folder, dtype="float32", quantization="int4wo-32")
    with pytest.raises(QuantizationError, match="--torchao-config: unknown quantization 'int4wo-16'"):
        ModelRunner(folder, dtype="bfloat16", quantization="int4wo-16")


def test_smollm2_int4wo_prefill_and_decode_agree_with_float32(smollm2_checkpoint, smollm2_runner):
    """The real model, int4 projections (the LM head, Q8_0 in the GGUF, int8), bf16, against float32 on
    "What is the capital of France?": top-1 inside fp32's top-5 at >= 95% of the prompt positions, and
    decoding on its own K/V along fp32's greedy answer ("... Paris."), its top-1 is fp32's next token at
    >= 11 of the 13 answer positions (docs/model.md: 97% over a prompt set). Not the int4 answer's own text:
    its first token is a near tie with fp32's, which the CPU's kernel path decides ("The" on AVX-512 alone,
    "L'" with AMX), and every later token follows from it."""
    runner = ModelRunner.from_checkpoint(smollm2_checkpoint, dtype="bfloat16", quantization="int4wo-32")
    layer = runner.model.layers[0]
    projections = (layer.qkv, layer.o_proj, layer.mlp.gate_up, layer.mlp.down)
    assert all(isinstance(p, Int4WeightOnlyLinear) for p in projections)
    assert isinstance(runner.model.lm_head, Int8WeightOnlyLinear)
    prompt = runner.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    logits, pools, slots = {}, {}, torch.arange(16, 16 + 256)
    for name, r in (("int4", runner), ("fp32", smollm2_runner)):
        pools[name] = DeviceKVPool(256, 16, **vars(r.kv_pool_spec()))
        batch = ForwardBatch.from_sequences([prompt], [slots[: len(prompt)]])
        logits[name] = r.forward(batch, pools[name], return_all_logits=True)
    top5 = logits["fp32"].topk(5, dim=-1).indices
    in_top5 = (top5 == logits["int4"].argmax(-1, keepdim=True)).any(-1).float().mean().item()
    assert in_top5 >= 0.95
    picks = {name: [int(lg[-1].argmax())] for name, lg in logits.items()}
    seq = list(prompt)
    for _ in range(12):  # both decode fp32's greedy answer, each on its own K/V
        token = picks["fp32"][-1]
        seq.append(token)
        for name, r in (("int4", runner), ("fp32", smollm2_runner)):
            step = r.forward(ForwardBatch.from_sequences([[token]], [slots[: len(seq)]]), pools[name])
            picks[name].append(int(step[0].argmax()))
    answer = runner.tokenizer.decode(picks["fp32"])
    assert "Paris" in answer, answer
    agree = sum(a == b for a, b in zip(picks["int4"], picks["fp32"], strict=True))
    assert agree >= 11, (agree, runner.tokenizer.decode(picks["int4"]), answer)
