"""Test-only helpers: tiny random HF models on disk, a shuffled page allocator, greedy generation.

The greedy loop here is a minimal driver of ``ModelRunner.forward`` for parity tests; the real scheduler lives
in engine/scheduler.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import tokenizers
import torch
import transformers
from tokenizers import decoders, models, pre_tokenizers, trainers

from engine.cache.device_pool import DeviceKVPool
from engine.model.forward_batch import ForwardBatch
from engine.model.runner import ModelRunner

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TINY_VOCAB = 320
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a paged KV cache stores keys and values per token slot",
    "caf\u00e9 na\u00efve \u2713 done \u4f60\u597d",
] * 20


def save_tiny_tokenizer(folder: Path) -> tokenizers.Tokenizer:
    """Train a byte-level BPE (vocab < TINY_VOCAB) and save tokenizer.json + tokenizer_config.json."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB - 8,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(folder / "tokenizer.json"))
    cfg = {"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "bos_token": None}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tok


def tiny_config(kind: str, **overrides) -> transformers.PretrainedConfig:
    """A 2-layer GQA (4 query / 2 KV heads) config of ``kind`` llama | qwen2 | qwen3, large init (no ties)."""
    base = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=TINY_VOCAB,
        initializer_range=0.2,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
    )
    base.update(overrides)
    cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }
    return cls[kind](**base)


def save_tiny_model(folder: Path, kind: str, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """Save a random tiny model and tokenizer into ``folder``; returns the fp32 HF reference model."""
    torch.manual_seed(seed)
    cfg = tiny_config(kind, **overrides)
    model_cls = {
        "llama": transformers.LlamaForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
    }[kind]
    model = model_cls(cfg).eval()
    model.save_pretrained(folder)
    save_tiny_tokenizer(folder)
    return model


class PageAllocator:
    """Hands out whole pages of a DeviceKVPool in shuffled order, so a sequence's slots are non-contiguous."""

    def __init__(self, pool: DeviceKVPool, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        num_pages = pool.size // pool.page_size
        self.page_size = pool.page_size
        self.free = (torch.randperm(num_pages, generator=gen) + 1).tolist()  # page 0 is padding

    def extend(self, slots: torch.Tensor, new_len: int) -> torch.Tensor:
        """``slots`` grown to ``new_len`` tokens, taking a new page when the last one is full."""
        slots = slots.tolist()
        while len(slots) < new_len:
            page = self.free.pop() if len(slots) % self.page_size == 0 else slots[-1] // self.page_size
            slots.append(page * self.page_size + len(slots) % self.page_size)
        return torch.tensor(slots, dtype=torch.long)


def greedy_generate(
    runner: ModelRunner,
    pool: DeviceKVPool,
    alloc: PageAllocator,
    prompts: list[list[int]],
    max_new_tokens: int,
    chunk_size: int,
) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Greedy decode of all prompts in one batch per step; prefill goes in chunks of ``chunk_size`` tokens.

    Prefill chunks of later prompts share batches with decodes of earlier ones, so batches are mixed.
    Returns, per prompt, the logits at every position run ``(len(prompt) + max_new_tokens - 1, vocab)`` and
    the new tokens.
    """
    n = len(prompts)
    done = [0] * n  # tokens of prompt i already in the KV pool
    slots = [torch.zeros(0, dtype=torch.long) for _ in range(n)]
    all_logits: list[list[torch.Tensor]] = [[] for _ in range(n)]
    outputs: list[list[int]] = [[] for _ in range(n)]
    while any(len(o) < max_new_tokens for o in outputs):
        new_ids, rows, budget = [], [], chunk_size
        for i in range(n):
            if done[i] < len(prompts[i]):
                if budget == 0:
                    continue
                take = min(budget, len(prompts[i]) - done[i])
                budget -= take
                new = prompts[i][done[i] : done[i] + take]
            elif len(outputs[i]) < max_new_tokens:
                new = [outputs[i][-1]]
            else:
                continue
            slots[i] = alloc.extend(slots[i], slots[i].shape[0] + len(new))
            new_ids.append(new)
            rows.append(i)
        batch = ForwardBatch.from_sequences(new_ids, [slots[i] for i in rows])
        logits = runner.forward(batch, pool, return_all_logits=True)
        offsets = torch.tensor([0] + batch.extend_lens).cumsum(0).tolist()
        for j, i in enumerate(rows):
            seq_logits = logits[offsets[j] : offsets[j + 1]]
            all_logits[i].append(seq_logits)
            if done[i] < len(prompts[i]):
                done[i] += len(new_ids[j])
                if done[i] < len(prompts[i]):
                    continue
            outputs[i].append(int(seq_logits[-1].argmax()))
    return [torch.cat(p) for p in all_logits], outputs


def hf_greedy(model: transformers.PreTrainedModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy output (all-ones attention mask, no early EOS stop)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()
