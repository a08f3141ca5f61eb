"""Load an HF model folder (a decoder, or a LLaVA checkpoint: its text tower plus vision tensors):
``config.json``, ``*.safetensors``, ``tokenizer.json`` and the chat template.

The chat template comes from ``chat_template.jinja`` (transformers>=4.49) or the ``chat_template`` field
of ``tokenizer_config.json`` (a string, or a list of ``{name, template}`` where ``default`` is used). Stop
ids are the union of ``eos_token_id`` in ``config.json`` and ``generation_config.json`` and the tokenizer's
eos token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tokenizers
from safetensors import SafetensorError
from safetensors.torch import load_file

from engine.model.config import ModelConfig
from engine.model.errors import ModelLoadError
from engine.model.loader.checkpoint import Checkpoint
from engine.model.tokenizer import Tokenizer
from engine.model.vlm.clip import split_vision_tensors
from engine.model.vlm.config import is_vlm, load_vlm_config
from engine.model.vlm.qwen3 import is_qwen3_vl, qwen_text_config, qwen_vl_type, split_qwen3_tensors


def _read_json(path: Path, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise ModelLoadError(path.parent, f"{path.name} not found")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(path, f"not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(path, "expected a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json spells special tokens as a string or as ``{"content": ...}``."""
    return value.get("content") if isinstance(value, dict) else value


def _chat_template(folder: Path, tok_cfg: dict[str, Any]) -> str | None:
    """``chat_template.jinja``, else ``chat_template.json``'s ``chat_template`` (how Qwen-VL checkpoints
    ship theirs), else ``tokenizer_config.json``'s, as transformers looks them up."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _read_json(folder / "chat_template.json", required=False).get("chat_template")
    if isinstance(template, str):
        return template
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _eos_ids(*configs: dict[str, Any]) -> set[int]:
    ids: set[int] = set()
    for cfg in configs:
        eos = cfg.get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else ([] if eos is None else [eos]))
    return ids


def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The decoder's config: a LLaVA checkpoint's ``text_config`` (a Llama decoder), a Qwen3-VL one's (a
    Qwen3 decoder with M-RoPE), else ``cfg``."""
    if not is_vlm(cfg):
        return cfg
    text = qwen_text_config(cfg) if is_qwen3_vl(cfg) else dict(cfg.get("text_config") or {})
    if qwen_vl_type(cfg) == "qwen3_vl":
        text["model_type"], text["architectures"] = "qwen3", ["Qwen3ForCausalLM"]
    elif qwen_vl_type(cfg) == "qwen2_5_vl":
        text["model_type"], text["architectures"] = "qwen2", ["Qwen2ForCausalLM"]
    text.setdefault("model_type", "llama")
    text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
    return text


def load_hf_config(folder: Path) -> ModelConfig:
    """Only the (text) model config of ``folder`` (its ``config.json``); raises ``ModelLoadError``."""
    raw = _read_json(folder / "config.json", required=True)
    return ModelConfig.from_hf(_text_config(raw), source=str(folder / "config.json"))


def load_hf_folder(folder: Path) -> Checkpoint:
    """Read config, weights and tokenizer of ``folder``.

    Raises ``ModelLoadError`` naming the file and the reason.
    """
    raw = _read_json(folder / "config.json", required=True)
    config = ModelConfig.from_hf(_text_config(raw), source=str(folder / "config.json"))
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(folder, "no *.safetensors weight files")
    tensors = {}
    for f in files:
        try:
            tensors.update(load_file(f))
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f, f"cannot read safetensors: {exc}") from exc
    tok_file = folder / "tokenizer.json"
    if not tok_file.is_file():
        raise ModelLoadError(folder, "tokenizer.json not found")
    try:
        backend = tokenizers.Tokenizer.from_file(str(tok_file))
    except Exception as exc:  # tokenizers raises a bare Exception on malformed files
        raise ModelLoadError(tok_file, f"cannot parse tokenizer: {exc}") from exc
    tok_cfg = _read_json(folder / "tokenizer_config.json", required=False)
    gen_cfg = _read_json(folder / "generation_config.json", required=False)
    tokenizer = Tokenizer(
        backend,
        chat_template=_chat_template(folder, tok_cfg),
        bos_token=_token_text(tok_cfg.get("bos_token")),
        eos_token=_token_text(tok_cfg.get("eos_token")),
        eos_token_ids=set(config.eos_token_ids) | _eos_ids(gen_cfg),
    )
    if not is_vlm(raw):
        return Checkpoint(str(folder), config, tensors, tokenizer)
    if is_qwen3_vl(raw):
        text, vision = split_qwen3_tensors(tensors)
        return Checkpoint(str(folder), config, text, tokenizer, load_vlm_config(folder, raw), vision)
    text, vision, projector = split_vision_tensors(tensors)
    return Checkpoint(str(folder), config, text, tokenizer, load_vlm_config(folder, raw), vision, projector)
