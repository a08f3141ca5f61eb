"""Test-only helpers: tiny random HF models on disk, a shuffled page allocator, greedy generation.

The greedy loop here is a minimal driver of ``ModelRunner.forward`` for parity tests; the real scheduler lives
in engine/scheduler.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import tokenizers
import torch
import transformers
from gguf import GGMLQuantizationType
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


# MLA (DeepSeek-V2/V3) on top of the base: a 48-value latent (32 + 16 rope) instead of 2 x 2 x 16 K/V values,
# every layer dense (first_k_dense_replace = layers); V3 also a low-rank q (q_lora_rank)
TINY_MLA = dict(
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    first_k_dense_replace=2,
)
MLA_KINDS = {"deepseek_v2": dict(q_lora_rank=None), "deepseek_v3": dict(q_lora_rank=24)}
# MoE on top: layer 0 dense, layer 1 routed over 8 experts of 32 features, top 2 (+ shared experts); V2 picks
# in 1 of 2 groups (group_limited_greedy), V3 in 2 of 4 groups by the biased sigmoid scores (noaux_tc);
# Qwen3-MoE: softmax top 2 of 8, renormalised, both layers MoE
TINY_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
MOE_KINDS = {
    "deepseek_v2_moe": dict(
        first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=2, topk_method="group_limited_greedy",
        n_group=2, topk_group=1, routed_scaling_factor=1.5,
    ),
    "deepseek_v3_moe": dict(
        first_k_dense_replace=1, n_routed_experts=8, n_shared_experts=1, n_group=4, topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=2.5,
    ),
    "qwen3_moe": dict(num_experts=8, norm_topk_prob=True),
}  # fmt: skip


def tiny_config(kind: str, **overrides) -> transformers.PretrainedConfig:
    """A 2-layer GQA (4 query / 2 KV heads) config of ``kind`` llama | qwen2 | qwen3, large init (no ties);
    ``deepseek_v2`` | ``deepseek_v3``: the same sizes with MLA (``TINY_MLA``); ``deepseek_v2_moe`` |
    ``deepseek_v3_moe`` | ``qwen3_moe``: with MoE layers (``MOE_KINDS``)."""
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
    arch = kind.removesuffix("_moe") if kind.startswith("deepseek") else kind
    if arch in MLA_KINDS:
        base.update(TINY_MLA, **MLA_KINDS[arch])
    if kind in MOE_KINDS:
        base.update(TINY_MOE, **MOE_KINDS[kind])
    base.update(overrides)
    cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "deepseek_v2": transformers.DeepseekV2Config,
        "deepseek_v3": transformers.DeepseekV3Config,
        "qwen3_moe": transformers.Qwen3MoeConfig,
    }
    return cls[arch](**base)


def save_tiny_model(folder: Path, kind: str, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """Save a random tiny model and tokenizer into ``folder``; returns the fp32 HF reference model."""
    torch.manual_seed(seed)
    cfg = tiny_config(kind, **overrides)
    model_cls = {
        "llama": transformers.LlamaForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
        "deepseek_v2": transformers.DeepseekV2ForCausalLM,
        "deepseek_v3": transformers.DeepseekV3ForCausalLM,
        "qwen3_moe": transformers.Qwen3MoeForCausalLM,
    }[kind.removesuffix("_moe") if kind.startswith("deepseek") else kind]
    model = model_cls(cfg).eval()
    for layer in model.model.layers:  # V3's routing bias starts at zero: make it choose
        bias = getattr(getattr(layer.mlp, "gate", None), "e_score_correction_bias", None)
        if bias is not None:
            bias.copy_(torch.randn(bias.shape) * 0.2)
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
        batch = ForwardBatch.from_sequences(new_ids, [slots[i] for i in rows], device=runner.device)
        logits = runner.forward(batch, pool, return_all_logits=True)
        offsets = batch.cu_seqlens.tolist()
        for j, i in enumerate(rows):
            seq_logits = logits[offsets[j] : offsets[j + 1]].cpu()
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


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter order for Q/K rows of llama models (HF rotate-half -> interleaved pairs)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(
    path: Path,
    hf_model: transformers.PreTrainedModel,
    tok: tokenizers.Tokenizer,
    qtype: GGMLQuantizationType | None = None,
) -> None:
    """Write ``hf_model`` and ``tok`` as a GGUF file the way llama.cpp's converter lays them out.

    2-D weights are quantized to ``qtype`` when given (norms stay F32); Q/K rows of llama are permuted.
    """
    cfg = hf_model.config
    arch = cfg.model_type
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    _add_tokenizer(writer, tok, cfg.vocab_size)
    names = {v: k for k, v in _GGUF_NAMES.items()}
    for hf_name, t in hf_model.state_dict().items():
        name = hf_name
        for hf_part, gguf_part in names.items():
            name = name.replace(hf_part, gguf_part)
        w = t.detach().float().numpy()
        if arch == "llama" and "q_proj" in hf_name:
            w = _llama_cpp_permute(w, cfg.num_attention_heads)
        elif arch == "llama" and "k_proj" in hf_name:
            w = _llama_cpp_permute(w, cfg.num_key_value_heads)
        if qtype is not None and w.ndim == 2:
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_tokenizer(writer: gguf.GGUFWriter, tok: tokenizers.Tokenizer, vocab_size: int) -> None:
    """``tok`` as llama.cpp's ``tokenizer.ggml.*`` keys (byte-level BPE, padded to ``vocab_size``)."""
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    types = [3 if t in specials else 1 for t in tokens]
    tokens += [f"<unused_{i}>" for i in range(vocab_size - len(tokens))]
    types += [5] * (vocab_size - len(types))
    merges = json.loads(tok.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_bos_token_id(vocab["<|endoftext|>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


# HF name part -> llama.cpp deepseek2 name part (its converter's tensor map), most specific first
_DEEPSEEK2_NAMES = {
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
    "model.layers.": "blk.", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.o_proj": "attn_output",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias", "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}  # fmt: skip


def write_deepseek2_gguf(path: Path, folder: Path, qtype: GGMLQuantizationType | None = None) -> None:
    """The tiny DeepSeek HF checkpoint in ``folder`` as llama.cpp's converter writes a ``deepseek2`` GGUF
    today: one KV head of ``kv_lora_rank + rope`` (``key_length``; the per-head sizes in ``*_mla``),
    experts stacked per layer (``ffn_*_exps``, ``(E, out, in)``), ``kv_b_proj`` split into ``attn_k_b``
    (per head, transposed: ``(H, rank, nope)``) and ``attn_v_b`` (``(H, v, rank)``), V3's sigmoid gating.
    2-D weights are quantized to ``qtype`` when given."""
    from safetensors.torch import load_file

    cfg = json.loads((folder / "config.json").read_text())
    w = {k: t.float().numpy() for k, t in load_file(str(folder / "model.safetensors")).items()}
    rank, rope, nope, v = (
        cfg["kv_lora_rank"],
        cfg["qk_rope_head_dim"],
        cfg["qk_nope_head_dim"],
        cfg["v_head_dim"],
    )
    heads, layers = cfg["num_attention_heads"], cfg["num_hidden_layers"]
    writer = gguf.GGUFWriter(str(path), "deepseek2")
    writer.add_block_count(layers)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(1)
    rope_cfg = cfg.get("rope_parameters") or cfg
    writer.add_rope_freq_base(rope_cfg["rope_theta"])
    if rope_cfg.get("rope_type") == "yarn":  # the converter keeps mscale_all_dim only
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope_cfg["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope_cfg["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_log_mul(0.1 * rope_cfg["mscale_all_dim"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_leading_dense_block_count(cfg.get("first_k_dense_replace", layers))
    if cfg.get("q_lora_rank") is not None:
        writer.add_q_lora_rank(cfg["q_lora_rank"])
    writer.add_kv_lora_rank(rank)
    writer.add_key_length(rank + rope)
    writer.add_value_length(rank)
    writer.add_key_length_mla(nope + rope)
    writer.add_value_length_mla(v)
    writer.add_rope_dimension_count(rope)
    writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    writer.add_expert_shared_count(cfg.get("n_shared_experts") or 0)
    experts = cfg.get("n_routed_experts")
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
        writer.add_expert_group_count(cfg.get("n_group") or 1)
        writer.add_expert_group_used_count(cfg.get("topk_group") or 1)
        writer.add_expert_weights_scale(cfg["routed_scaling_factor"])
        if cfg.get("norm_topk_prob"):
            writer.add_expert_weights_norm(True)
        gating = gguf.ExpertGatingFuncType.SIGMOID if cfg["model_type"] == "deepseek_v3" else None
        if gating is not None:
            writer.add_expert_gating_func(gating)
    _add_tokenizer(writer, tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json")), cfg["vocab_size"])

    def add(name: str, arr: np.ndarray) -> None:
        if qtype is not None and arr.ndim == 2:
            writer.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, np.ascontiguousarray(arr))

    for i in range(layers):
        p = f"model.layers.{i}."
        kv_b = w.pop(p + "self_attn.kv_b_proj.weight").reshape(heads, nope + v, rank)
        add(f"blk.{i}.attn_k_b.weight", kv_b[:, :nope].transpose(0, 2, 1))
        add(f"blk.{i}.attn_v_b.weight", kv_b[:, nope:])
        for proj, part in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
            names = [f"{p}mlp.experts.{e}.{proj}.weight" for e in range(experts or 0)]
            if names and names[0] in w:
                add(f"blk.{i}.ffn_{part}_exps.weight", np.stack([w.pop(n) for n in names]))
    for hf_name, arr in w.items():
        name = hf_name
        for hf_part, gguf_part in _DEEPSEEK2_NAMES.items():
            name = name.replace(hf_part, gguf_part)
        add(name, arr)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


_GGUF_NAMES = {  # gguf name part -> HF name part (most specific first)
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output.": "lm_head.",
    "blk.": "model.layers.",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q.": "self_attn.q_proj.",
    "attn_k.": "self_attn.k_proj.",
    "attn_v.": "self_attn.v_proj.",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def tp_rank_logits(
    rank: int, size: int, folder: str, init_method: str, quantization, dtype: str, out
) -> None:
    """One tensor-parallel rank (a spawned process) running ``greedy_generate`` on the model in ``folder``
    over ``TP_PROMPTS``; rank 0 puts ``(logits as numpy arrays, tokens)`` on the queue ``out``."""
    torch.set_num_threads(1)
    from engine.distributed import init_tp_group

    group = init_tp_group(rank, size, init_method)
    runner = ModelRunner(
        folder, dtype=dtype, quantization=quantization, tp=group, fused_decode=False, cpu_quant_kernels=False
    )
    pool = DeviceKVPool(256, 4, **vars(runner.kv_pool_spec()))
    logits, tokens = greedy_generate(runner, pool, PageAllocator(pool), TP_PROMPTS, 5, chunk_size=6)
    group.close()  # after the last collective, before exit (see TPGroup.close)
    if rank == 0:
        out.put(([x.float().numpy() for x in logits], tokens))


TP_PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 8, 9], [11, 12, 13]]
