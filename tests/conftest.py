"""Suite-wide pytest configuration and fixtures (area fixtures live in tests/<area>/conftest.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def _model_testlib():
    """``tests/model/model_testlib.py`` loaded by path (the test folders are not packages)."""
    path = Path(__file__).resolve().parent / "model" / "model_testlib.py"
    spec = importlib.util.spec_from_file_location("suite_model_testlib", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A 2-layer random Llama (vocab 320, 512 positions) with a BPE tokenizer and chat template, written
    once per session by transformers (seed 7)."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    _model_testlib().save_tiny_model(folder, "llama", seed=7)
    return folder
