"""``--dtype auto``: what a checkpoint's stored format resolves to (``engine/model/compute_mode.py``)."""

from __future__ import annotations

import dataclasses

import tokenizers
import torch
from gguf import GGMLQuantizationType

from engine.model.compute_mode import compute_for_path, resolve_compute
from engine.model.runner import ModelRunner
from tests.model.model_testlib import save_tiny_model, write_gguf


def test_a_q4_1_gguf_resolves_to_its_own_grid_and_explicit_flags_are_kept(smollm2_checkpoint):
    ckpt = smollm2_checkpoint
    assert resolve_compute("auto", None, "cpu", ckpt) == ("bfloat16", "int4wo-32")
    # the sizing tool reads the same from the file's layout alone
    assert compute_for_path("auto", None, "cpu", "smollm2") == ("bfloat16", "int4wo-32")
    assert resolve_compute("float32", None, "cpu", ckpt) == ("float32", None)
    assert resolve_compute("bfloat16", "int8wo", "cpu", ckpt) == ("bfloat16", "int8wo")
    assert resolve_compute("auto", None, "cuda", ckpt) == ("bfloat16", None)
    assert resolve_compute("auto", "int8wo", "cpu", ckpt) == ("float32", "int8wo")
    assert resolve_compute("auto", "int4wo-64", "cpu", ckpt) == ("bfloat16", "int4wo-64")


def test_mixed_blocks_unfit_shapes_and_hf_folders_stay_float32(smollm2_checkpoint):
    ckpt = smollm2_checkpoint
    name = "model.layers.3.mlp.down_proj.weight"
    mixed = dataclasses.replace(ckpt, stored_types={**ckpt.stored_types, name: "Q8_0"})
    unfit = dataclasses.replace(ckpt, tensors={**ckpt.tensors, name: ckpt.tensors[name][:, :40]})
    folder = dataclasses.replace(ckpt, stored_types={})
    for other in (mixed, unfit, folder):
        assert resolve_compute("auto", None, "cpu", other) == ("float32", None)


def test_a_runner_on_a_q4_1_gguf_computes_on_its_blocks_and_a_q8_0_one_in_float32(tmp_path):
    hf_model = save_tiny_model(tmp_path, "llama", seed=21)
    tok = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    write_gguf(tmp_path / "q4_1.gguf", hf_model, tok, qtype=GGMLQuantizationType.Q4_1)
    write_gguf(tmp_path / "q8_0.gguf", hf_model, tok, qtype=GGMLQuantizationType.Q8_0)
    auto = ModelRunner(tmp_path / "q4_1.gguf", dtype="auto")
    assert (auto.dtype, auto.quantization) == (torch.bfloat16, "int4wo-32")
    # every projection keeps the file's weights (the Q4_1 grid is int4wo-32's): within the bfloat16
    # rounding of each block's scale and min, far below one quantization step
    exact = ModelRunner(tmp_path / "q4_1.gguf", dtype="float32")
    for got, want in zip(auto.model.layers[0].linears(), exact.model.layers[0].linears(), strict=True):
        step = want.weight.float().abs().amax() / 7.5
        assert (got.dequantized() - want.weight.float()).abs().amax() < 0.1 * step
    q8 = ModelRunner(tmp_path / "q8_0.gguf", dtype="auto")
    assert (q8.dtype, q8.quantization) == (torch.float32, None)
    assert compute_for_path("auto", None, "cpu", tmp_path / "q4_1.gguf") == ("bfloat16", "int4wo-32")
    assert compute_for_path("auto", None, "cpu", tmp_path / "q8_0.gguf") == ("float32", None)
    assert compute_for_path("auto", None, "cpu", tmp_path) == ("float32", None)  # the HF folder
