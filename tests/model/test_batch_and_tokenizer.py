"""ForwardBatch construction and checks, layer hook, backend registry, and the tokenizer of a tiny model."""

from __future__ import annotations

import pytest
import torch
from model_testlib import CHAT_TEMPLATE

from engine.cache.device_pool import DeviceKVPool
from engine.model import attention
from engine.model.attention import (
    TorchAttentionBackend,
    get_attention_backend,
    register_attention_backend,
)
from engine.model.forward_batch import ForwardBatch
from engine.model.runner import ModelRunner
from engine.model.tokenizer import ChatTemplateError, Tokenizer


@pytest.fixture(scope="module")
def llama_runner(tiny_models):
    return ModelRunner(tiny_models["llama"][0], dtype="float32")


def test_from_sequences_derives_positions_and_out_cache_loc():
    batch = ForwardBatch.from_sequences(
        [[7, 8, 9], [4]], [torch.tensor([40, 41, 12, 13, 14]), torch.tensor([3, 9])]
    )
    assert batch.input_ids.tolist() == [7, 8, 9, 4]
    assert batch.positions.tolist() == [2, 3, 4, 1]
    assert batch.out_cache_loc.tolist() == [12, 13, 14, 9]
    assert batch.req_to_token.tolist() == [[40, 41, 12, 13, 14], [3, 9, 0, 0, 0]]
    assert (batch.seq_lens.tolist(), batch.cu_seqlens.tolist()) == ([5, 2], [0, 3, 4])
    assert (batch.seq_lens_cpu, batch.extend_lens_cpu, batch.batch_size, batch.is_decode) == (
        [5, 2],
        [3, 1],
        2,
        False,
    )


def test_for_decode_builds_the_same_batch_as_from_sequences():
    slots = [torch.tensor(s) for s in ([16, 17, 40, 41, 42], [64, 65], [80, 81, 82, 83, 90, 91])]
    got = ForwardBatch.for_decode([7, 8, 9], slots)
    ref = ForwardBatch.from_sequences([[7], [8], [9]], slots)
    for name in ("input_ids", "positions", "out_cache_loc", "req_to_token", "seq_lens", "cu_seqlens"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    assert (got.seq_lens_cpu, got.extend_lens_cpu) == ([5, 2, 6], [1, 1, 1]) and got.is_decode
    assert got.out_cache_loc.tolist() == [42, 65, 91] and got.positions.tolist() == [4, 1, 5]
    with pytest.raises(ValueError, match="2 tokens for 3 slot lists"):
        ForwardBatch.for_decode([7, 8], slots)


@pytest.mark.parametrize(
    ("seq_lens", "extend_lens", "message"),
    [([3], [2], "sum\\(extend_lens\\) = 2 but the batch has 3 tokens"), ([2], [3], "need 0 < extend_len")],
)
def test_inconsistent_lengths_raise(seq_lens, extend_lens, message):
    ids = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match=message):
        table = torch.arange(seq_lens[0]).view(1, -1)
        cu = torch.tensor([0, extend_lens[0]])
        ForwardBatch(ids, ids, ids, table, torch.tensor(seq_lens), cu, seq_lens, extend_lens)


def test_layer_hook_runs_before_each_layer_in_order(llama_runner):
    calls = []
    pool = DeviceKVPool(64, 1, **vars(llama_runner.kv_pool_spec()))
    batch = ForwardBatch.from_sequences([[5, 6, 7]], [torch.tensor([9, 4, 30])], layer_hook=calls.append)
    logits = llama_runner.forward(batch, pool)
    assert calls == [0, 1]
    assert logits.shape == (1, llama_runner.config.vocab_size) and logits.dtype == torch.float32
    assert pool.k_buffer[1][[9, 4, 30]].abs().sum() > 0 and pool.k_buffer[1][1].abs().sum() == 0


def test_registry_returns_registered_backends_and_rejects_others(monkeypatch):
    monkeypatch.setattr(attention, "_BACKENDS", dict(attention._BACKENDS))  # registrations end with the test
    assert get_attention_backend("torch") is TorchAttentionBackend

    class Custom(TorchAttentionBackend):
        pass

    register_attention_backend("custom", Custom)
    assert get_attention_backend("custom") is Custom
    with pytest.raises(TypeError):
        register_attention_backend("bad", object)
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        get_attention_backend("nope")


def test_tiny_tokenizer_template_eos_and_streaming(llama_runner):
    tok = llama_runner.tokenizer
    messages = [{"role": "user", "content": "the lazy dog"}]
    assert (
        tok.apply_chat_template(messages)
        == "<|im_start|>user\nthe lazy dog<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.eos_token_ids == {tok.token_to_id("<|im_end|>")}
    ids = tok.encode("caf\u00e9 \u2713 done")
    stream = tok.detokenizer()
    assert "".join(stream.step(i) for i in ids) == "caf\u00e9 \u2713 done"


def test_chat_template_errors_are_reported(llama_runner):
    backend = llama_runner.tokenizer.backend
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer(backend).apply_chat_template([{"role": "user", "content": "hi"}])
    strict = Tokenizer(backend, "{{ raise_exception('roles must alternate') }}" + CHAT_TEMPLATE)
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        strict.apply_chat_template([{"role": "user", "content": "hi"}])
