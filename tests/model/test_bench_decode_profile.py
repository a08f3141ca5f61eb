"""``engine.bench.decode_profile``'s setup: a long context prefilled in chunks through the extend path
computes what one pass does, rewinding returns to it, a copy in another KV format holds the same K/V
re-encoded, and the variants table runs end to end on a tiny model (one prefill per model)."""

from __future__ import annotations

import pytest
import torch

from engine.bench import decode_profile
from engine.bench.decode_profile import DecodeSetup
from engine.model.loader import load_checkpoint
from engine.model.runner import ModelRunner


def test_a_chunked_prefill_decodes_as_a_single_pass(tiny_models):
    runner = ModelRunner(tiny_models["llama"][0], dtype="float32", fused_decode=False)
    whole = DecodeSetup(runner, batch=2, context=45, steps=4, chunk=45)
    chunked = DecodeSetup(runner, batch=2, context=45, steps=4, chunk=16)
    assert chunked.ids == whole.ids  # same prompts, same greedy token after the prefill
    rows = [s[:45] for s in whole.slots]
    for a, b in zip(rows, [s[:45] for s in chunked.slots], strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(
            chunked.pool.kv_buffer[:, :, b], whole.pool.kv_buffer[:, :, a], atol=1e-5, rtol=0
        )
    whole.step()
    chunked.step()
    assert chunked.ids == whole.ids


def test_rewind_returns_to_the_prefilled_context_and_decodes_the_same_tokens_again(tiny_models):
    runner = ModelRunner(tiny_models["qwen2"][0], dtype="float32")
    setup = DecodeSetup(runner, batch=2, context=20, steps=6, chunk=8)
    for _ in range(4):
        setup.step()
    first = [list(ids) for ids in setup.ids]
    setup.rewind()
    assert setup.lens == [20, 20] and all(len(ids) == 21 for ids in setup.ids)
    for _ in range(4):
        setup.step()
    assert setup.ids == first


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_with_kv_holds_the_same_context_re_encoded(tiny_models, kv):
    runner = ModelRunner(tiny_models["llama"][0], dtype="float32")
    setup = DecodeSetup(runner, batch=1, context=30, steps=3, chunk=12)
    other = setup.with_kv(kv)
    assert other.pool.kv_cache_dtype == kv and other.lens == [30]
    assert other.ids == [ids[:31] for ids in setup.ids]
    slots = setup.slots[0][:30]
    want = other.pool.kv_format.round_trip(setup.pool.kv_buffer[:, :, slots])
    assert torch.equal(other.pool.decode(other.pool.kv_buffer[:, :, slots]), want)
    other.step()
    assert other.lens == [31]


def test_variants_prefill_once_per_model_and_print_a_ratio_per_variant(tiny_models, capsys, monkeypatch):
    calls: list[int] = []
    real_init = DecodeSetup.__init__

    def counting_init(self, *args, prefill=True, **kwargs):
        calls.append(prefill)
        real_init(self, *args, prefill=prefill, **kwargs)

    monkeypatch.setattr(DecodeSetup, "__init__", counting_init)
    ckpt = load_checkpoint(tiny_models["llama"][0])
    specs = ["float32@1", "float32@1:kv=int8", "float32@1:kv=fp8_e4m3", "float32@1:python"]
    decode_profile.variants(ckpt, batch=1, context=40, steps=2, rounds=2, specs=specs, chunk=16)
    assert calls.count(True) == 2  # one prefill for the fused model, one for the Python path's
    out = capsys.readouterr().out
    assert "prefilled 1 x 40 tokens in chunks of 16" in out
    table = out[out.index("variant ") :].splitlines()[1:]
    assert [line.split()[0] for line in table] == specs
    assert table[0].split()[3] == "1.00"
