"""Load a GGUF file (llama.cpp format): metadata -> config, dequantized tensors, BPE tokenizer, chat template.

Tensors are read and dequantized (F32, F16, BF16, Q4_0, Q4_1, Q8_0, K-quants, ...) with the ``gguf`` package
and renamed to HF names. ``deepseek2`` files (DeepSeek-V2/V3: MLA + MoE) are mapped back to the HF layout too:
the stacked experts ``ffn_{gate,up,down}_exps`` split per expert, ``exp_probs_b`` to the router's
``e_score_correction_bias``, and ``kv_b_proj`` rebuilt from the converter's ``attn_k_b`` / ``attn_v_b`` split
(or read as ``attn_kv_b`` from older files). llama.cpp's converter permutes the rows of Q and K of ``llama``
models for its interleaved RoPE; this loader undoes that (rows viewed as ``(heads, head_dim/2, 2)``, inner
axes swapped) so the rotate-half RoPE of engine/model/rotary.py applies. The tokenizer is rebuilt from
``tokenizer.ggml.*``: byte-level BPE (``tokenizer.ggml.model == "gpt2"``) with the pre-tokenizer named by
``tokenizer.ggml.pre``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from tokenizers import decoders, models, pre_tokenizers, processors

from engine.model.config import ModelConfig
from engine.model.errors import ModelLoadError
from engine.model.loader.checkpoint import Checkpoint
from engine.model.tokenizer import Tokenizer

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # deepseek2 (MLA + MoE)
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# deepseek2 tensors that are not one HF tensor each: stacked experts (E, out, in) -> one per expert; the
# converter's split of kv_b_proj (attn_k_b (H, rank, nope), attn_v_b (H, v, rank)) -> kv_b_proj again
_EXPERT_STACKS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_KV_B_PARTS = ("attn_k_b", "attn_v_b")

# Pre-tokenizer split patterns by tokenizer.ggml.pre (as in the models' own tokenizer.json files).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED = 3, 4


class _PlainArrayReader(GGUFReader):
    """``GGUFReader`` that slices a plain ndarray view of its memory map instead of the ``np.memmap`` itself.

    Same parse (gguf==0.19.0 reads every field through ``_get``), about 4x faster on a 49k-token vocabulary:
    ``np.memmap`` slicing runs Python-level ``__getitem__``/``__array_finalize__`` for each of ~250k reads.
    """

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        count = int(count)
        arr = plain[offset : offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


def _pre_tokenizer(pre: str, source: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("default", "gpt2"):
        return byte_level
    if pre in ("smollm", "starcoder", "refact"):
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    patterns = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}
    if pre in patterns:
        split = pre_tokenizers.Split(tokenizers.Regex(patterns[pre]), behavior="isolated")
        return pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    raise ModelLoadError(source, f"unsupported tokenizer.ggml.pre {pre!r}")


def _metadata(reader: GGUFReader) -> dict[str, Any]:
    meta = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        meta[name] = field.contents()
    return meta


def _build_tokenizer(meta: dict[str, Any], config: ModelConfig, source: str) -> Tokenizer:
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(
            source, f"unsupported tokenizer.ggml.model {kind!r} (only byte-level BPE 'gpt2')"
        )
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise ModelLoadError(source, "missing GGUF metadata key 'tokenizer.ggml.tokens'")
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    backend = tokenizers.Tokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
    )
    backend.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"), source)
    backend.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type", [])
    backend.add_special_tokens(
        [
            tokenizers.AddedToken(tokens[i], special=True, normalized=False)
            for i, t in enumerate(types)
            if t == _TOKEN_TYPE_CONTROL
        ]
    )
    backend.add_tokens(
        [
            tokenizers.AddedToken(tokens[i], normalized=False)
            for i, t in enumerate(types)
            if t == _TOKEN_TYPE_USER_DEFINED
        ]
    )
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    bos = tokens[bos_id] if bos_id is not None else None
    if bos is not None and meta.get("tokenizer.ggml.add_bos_token", False):
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    eos = tokens[config.eos_token_ids[0]] if config.eos_token_ids else None
    eos_ids = set(config.eos_token_ids)
    if "tokenizer.ggml.eot_token_id" in meta:
        eos_ids.add(int(meta["tokenizer.ggml.eot_token_id"]))
    return Tokenizer(backend, meta.get("tokenizer.chat_template"), bos, eos, eos_ids)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation for a ``(heads * head_dim, ...)`` array."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _BLOCK_RE.fullmatch(name)
    if m and m.group(2) == "exp_probs_b":  # DeepSeek-V3's routing bias
        return f"model.layers.{m.group(1)}.mlp.gate.e_score_correction_bias"
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def _hf_tensors(name: str, data: np.ndarray, parts: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF name -> array for GGUF tensor ``name``: one, a stacked expert tensor's per-expert slices, or
    none yet (an ``attn_k_b`` / ``attn_v_b`` half waits in ``parts`` for the other, then both give
    ``kv_b_proj``: per head the ``nope`` key rows, then the ``v`` value rows). ``KeyError``: unmapped."""
    m = _BLOCK_RE.fullmatch(name)
    if m and m.group(2) in _EXPERT_STACKS:
        proj = _EXPERT_STACKS[m.group(2)]
        return {f"model.layers.{m.group(1)}.mlp.experts.{e}.{proj}.weight": w for e, w in enumerate(data)}
    if m and m.group(2) in _KV_B_PARTS:
        parts[name] = data
        k_name, v_name = (f"blk.{m.group(1)}.{p}.weight" for p in _KV_B_PARTS)
        if k_name not in parts or v_name not in parts:
            return {}
        k_b, v_b = parts.pop(k_name), parts.pop(v_name)
        kv_b = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)  # (H, nope + v, rank)
        return {f"model.layers.{m.group(1)}.self_attn.kv_b_proj.weight": kv_b.reshape(-1, kv_b.shape[-1])}
    hf = _hf_name(name)
    if hf is None:
        raise KeyError(name)
    return {hf: data}


def _open(path: Path) -> tuple[_PlainArrayReader, dict[str, Any], ModelConfig]:
    try:
        reader = _PlainArrayReader(path)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(path, f"not a readable GGUF file: {exc}") from exc
    meta = _metadata(reader)
    names = {t.name for t in reader.tensors}
    return (
        reader,
        meta,
        ModelConfig.from_gguf(meta, str(path), tie_word_embeddings="output.weight" not in names),
    )


def load_gguf_config(path: Path) -> ModelConfig:
    """Only the model config of a GGUF file (tensors stay unread); raises ``ModelLoadError``."""
    return _open(path)[2]


def load_gguf_layout(path: Path) -> tuple[ModelConfig, dict[str, tuple[str, tuple[int, ...]]]]:
    """The config and, per HF-named tensor of a plain (one GGUF tensor per HF one) name, its stored type
    and HF shape ``(out_features, in_features)`` for a matrix, without reading any tensor data; raises
    ``ModelLoadError``."""
    reader, _, config = _open(path)
    layout = {}
    for t in reader.tensors:
        hf = _hf_name(t.name)
        if hf is not None:
            layout[hf] = (t.tensor_type.name, tuple(reversed([int(d) for d in t.shape])))
    return config, layout


def load_gguf_file(path: Path) -> Checkpoint:
    """Read config, tensors and tokenizer of a GGUF file; raises ``ModelLoadError`` naming ``path``."""
    source = str(path)
    reader, meta, config = _open(path)
    tensors: dict[str, torch.Tensor] = {}
    parts: dict[str, np.ndarray] = {}  # deepseek2's attn_k_b / attn_v_b halves
    stored: dict[str, str] = {}
    for t in reader.tensors:
        try:
            data = dequantize(t.data, t.tensor_type).reshape(tuple(reversed([int(d) for d in t.shape])))
        except NotImplementedError as exc:
            raise ModelLoadError(
                path, f"tensor {t.name!r}: quantization {t.tensor_type.name} unsupported"
            ) from exc
        try:
            mapped = _hf_tensors(t.name, data, parts)
        except KeyError:
            raise ModelLoadError(path, f"unsupported tensor {t.name!r}") from None
        for hf, data in mapped.items():
            stored[hf] = t.tensor_type.name
            if config.architecture == "llama" and hf.endswith(("q_proj.weight", "q_proj.bias")):
                data = _unpermute(data, config.num_attention_heads)
            elif config.architecture == "llama" and hf.endswith(("k_proj.weight", "k_proj.bias")):
                data = _unpermute(data, config.num_key_value_heads)
            data = np.ascontiguousarray(data, dtype=np.float32)
            tensors[hf] = torch.from_numpy(
                data if data.flags.writeable else data.copy()
            )  # F32: a view of the file
    if parts:
        raise ModelLoadError(
            path, f"tensor {min(parts)!r} without its other half of kv_b_proj ({_KV_B_PARTS})"
        )
    return Checkpoint(source, config, tensors, _build_tokenizer(meta, config, source), stored_types=stored)
