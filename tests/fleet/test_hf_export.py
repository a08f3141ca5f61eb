"""engine.fleet.hf_export: the SmolLM2 GGUF written as an HF folder (what upstream SGLang workers load in the
tests and `make demo ENGINE=sglang`) holds the GGUF's weights, rounded to bfloat16, the same config and a
tokenizer that encodes alike, as KVFleet's own loader reads both."""

import torch

from engine.fleet.hf_export import export
from engine.model.loader import load_checkpoint


def test_the_hf_folder_holds_the_ggufs_weights_config_and_tokenizer(tmp_path):
    folder = export("smollm2", tmp_path)
    assert (folder / "config.json").is_file() and (folder / ".complete").is_file()
    assert export("smollm2", tmp_path) == folder  # cached: the second call writes nothing
    gguf, hf = load_checkpoint("smollm2"), load_checkpoint(folder)
    for field in (
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
    ):
        assert getattr(hf.config, field) == getattr(gguf.config, field), field
    assert set(hf.tensors) == set(gguf.tensors)
    for name, weight in gguf.tensors.items():
        expected = weight.to(torch.bfloat16).float()
        assert torch.equal(hf.tensors[name].float(), expected), name
    text = "The capital of France is Paris. <|im_start|>user"
    assert hf.tokenizer.encode(text) == gguf.tokenizer.encode(text)
