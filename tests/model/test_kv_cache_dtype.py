"""A quantized KV cache (``--kv-cache-dtype fp8_e4m3|fp8_e5m2|int8``): what a row holds, what a reader gets
back, and what the model computes from it against the full-precision cache."""

from __future__ import annotations

import pytest
import torch

from engine.cache.device_pool import DeviceKVPool
from engine.cache.kv_format import KVFormat
from engine.model.forward_batch import ForwardBatch
from engine.model.runner import ModelRunner
from engine.sizing.kv import shape_for


def test_int8_rows_carry_their_scale_and_decode_within_half_a_step():
    fmt = KVFormat("int8", torch.float32, head_dim=64)
    x = (
        torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(0))
        * torch.tensor([0.01, 1.0, 300.0])[:, None]
    )
    rows = fmt.encode(x)
    assert rows.shape == (5, 3, 66) and rows.dtype == torch.uint8
    scale = rows[..., 64:].contiguous().view(torch.bfloat16).float()  # the scale sits after the values
    assert torch.all(scale > 0)
    err = (fmt.decode(rows) - x).abs()
    assert torch.all(err <= scale / 2 * 1.0001)
    assert torch.equal(fmt.decode(torch.zeros(1, 1, 66, dtype=torch.uint8)), torch.zeros(1, 1, 64))


@pytest.mark.parametrize(
    ("name", "fp8"), [("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)]
)
def test_fp8_rows_are_the_float8_bits_and_saturate(name, fp8):
    fmt = KVFormat(name, torch.bfloat16, head_dim=8)
    x = torch.tensor([[[0.5, -1.25, 3.0, 1e6, -1e6, 0.0, 7.0, 100.0]]], dtype=torch.bfloat16)
    rows = fmt.encode(x)
    assert rows.dtype == torch.uint8 and rows.shape == (1, 1, 8)
    back = fmt.decode(rows)
    assert back.dtype == torch.bfloat16 and torch.isfinite(back).all()
    assert back[0, 0, 3] == torch.finfo(fp8).max and back[0, 0, 4] == -torch.finfo(fp8).max
    assert torch.equal(back[0, 0, :3], x[0, 0, :3])  # exactly representable values survive


@pytest.mark.parametrize("name", ["auto", "bfloat16", "fp8_e4m3", "fp8_e5m2", "int8"])
def test_pool_bytes_per_token_are_the_sizings(name):
    pool = DeviceKVPool(
        16, 4, num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float32, kv_cache_dtype=name
    )
    resolved = "float32" if name == "auto" else name
    assert pool.kv_cache_dtype == resolved
    assert pool.bytes_per_token == shape_for(3, 2, 8, resolved).bytes_per_token
    assert pool.kv_buffer.element_size() * pool.kv_buffer[:, :, 0].numel() == pool.bytes_per_token


def test_an_unknown_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match="'int4' is not one of auto, bfloat16, fp8_e4m3, fp8_e5m2, int8"):
        DeviceKVPool(16, 4, 1, 1, 8, kv_cache_dtype="int4")


def _greedy(runner: ModelRunner, kv_cache_dtype: str, ids: list[int], steps: int) -> tuple[list[int], list]:
    pool = DeviceKVPool(256, 1, **vars(runner.kv_pool_spec()), kv_cache_dtype=kv_cache_dtype)
    slots = torch.arange(1, len(ids) + 1)
    logits = [runner.forward(ForwardBatch.from_sequences([ids], [slots]), pool)[0]]
    out = [int(logits[-1].argmax())]
    for _ in range(steps):
        slots = torch.arange(1, slots.shape[0] + 2)
        logits.append(runner.forward(ForwardBatch.for_decode([out[-1]], [slots]), pool)[0])
        out.append(int(logits[-1].argmax()))
    return out, logits


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2", "int8"])
def test_fused_decode_step_reads_a_quantized_pool_in_its_format(tiny_models, name):
    """The C++ decode step writes and reads fp8 / int8 rows itself (no Python fallback): the same greedy
    tokens as the Python path over the same quantized cache, logits within float32 rounding of the rows."""
    folder = tiny_models["llama"][0]
    fused = ModelRunner(folder, dtype="float32")
    python = ModelRunner(folder, dtype="float32", fused_decode=False)
    ran: list[bool] = []
    step = fused.model.fused_step

    def recording(batch, pool):
        logits = step(batch, pool)
        ran.append(logits is not None)
        return logits

    fused.model.fused_step = recording
    ids = list(range(5, 30))
    got, got_logits = _greedy(fused, name, ids, 6)
    want, want_logits = _greedy(python, name, ids, 6)
    assert ran == [False] + [True] * 6 and got == want  # the prefill stays on the Python path
    for a, b in zip(got_logits, want_logits, strict=True):
        assert ((a - b).abs().max() / b.abs().max()).item() <= 1e-3


@pytest.mark.parametrize(("name", "bound"), [("bfloat16", 0.02), ("int8", 0.03), ("fp8_e4m3", 0.15)])
def test_quantized_cache_logits_stay_near_the_full_precision_cache(tiny_models, name, bound):
    """Relative max logit error against the float32 cache over prefill and 6 decode steps fed the same
    tokens; bounds a few times what it measures on this tiny model (``python -m engine.bench.drift``
    measures the same on SmolLM2)."""
    runner = ModelRunner(tiny_models["llama"][0], dtype="float32", fused_decode=False)
    ids = list(range(5, 45))
    tokens, full = _greedy(runner, "auto", ids, 6)
    pool = DeviceKVPool(256, 1, **vars(runner.kv_pool_spec()), kv_cache_dtype=name)
    slots = torch.arange(1, len(ids) + 1)
    got = [runner.forward(ForwardBatch.from_sequences([ids], [slots]), pool)[0]]
    for tok in tokens[:-1]:
        slots = torch.arange(1, slots.shape[0] + 2)
        got.append(runner.forward(ForwardBatch.for_decode([tok], [slots]), pool)[0])
    gap = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, full, strict=True))
    assert 0 < gap <= bound, gap


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2", "int8"])
def test_triton_kernels_read_a_quantized_pool_as_the_torch_path_does(tiny_models, name, monkeypatch):
    """The Triton backend (interpreted) dequantizes the pool's rows in its kernels: prefill and decode
    logits equal the torch backend's on the same quantized cache, and the greedy tokens match."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    folder = tiny_models["llama"][0]
    torch_path = ModelRunner(folder, dtype="float32", fused_decode=False)
    triton_path = ModelRunner(folder, dtype="float32", fused_decode=False, attention_backend="triton")
    ids = list(range(5, 30))
    want, want_logits = _greedy(torch_path, name, ids, 4)
    got, got_logits = _greedy(triton_path, name, ids, 4)
    assert got == want
    for a, b in zip(got_logits, want_logits, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
