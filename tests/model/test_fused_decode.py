"""The fused decode step (``engine/model/fused_decode.py``, one C++ call per decode-only batch) computes the
Python path's function: in float32 its logits equal the Python path's to float32 rounding (Llama / Qwen2
with biases / Qwen3 with q/k norm); in bfloat16 (plain and int8wo), where it keeps activations float32
between the matmuls, its logits are closer to the float32 model's than the bfloat16 Python path's; int4wo-32
stays within a bfloat16 tolerance of the Python path; all over staged K/V (refilled and appended), per-step
gathers, batch changes and rows of different lengths. It calls the layer hook of every layer; a runner where
it cannot be built warns and decodes on the Python path."""

from __future__ import annotations

import logging
import statistics

import pytest
import torch
from model_testlib import save_tiny_model
from test_staged_decode import Pair

from engine.cache.device_pool import DeviceKVPool
from engine.model import extension, fused_decode
from engine.model.attention.staged_decode import STAGE_HEADROOM, DecodeStage
from engine.model.forward_batch import ForwardBatch
from engine.model.runner import ModelRunner
from engine.server.args import parse_args

FLOAT32_ROUNDING = 1e-5  # of the largest logit (measured up to 2.6e-6)


def _run(pair: Pair) -> None:
    for name, length in (("a", 9), ("b", 23), ("c", 5)):
        pair.prefill(name, length, seed=length)
    for _ in range(3):  # appended to the staged K/V
        pair.decode(["a", "b", "c"])
    pair.decode(["a", "c"])  # b left: refilled
    pair.prefill("d", 14, seed=14)
    pair.decode(["c", "a", "d"])
    for _ in range(STAGE_HEADROOM + 2):  # past the staged capacity
        pair.decode(["c", "a", "d"])


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_float32_fused_decode_step_equals_the_python_path(tiny_models, kind):
    """Staged (fused) against per-step gathers (Python), the comparison of test_staged_decode."""
    pair = Pair(tiny_models[kind][0], staged={"fused_decode": True}, tolerance=FLOAT32_ROUNDING)
    assert pair.staged.fused_decode and not pair.gathered.fused_decode
    _run(pair)


@pytest.mark.parametrize(("kind", "quant"), [("llama", None), ("qwen2", "int8wo")])
def test_bfloat16_fused_decode_step_is_closer_to_float32_than_the_python_path(tiny_models, kind, quant):
    """Both bfloat16 paths against the float32 Python path with the same quantization, on the same tokens."""
    reference = {"dtype": "float32", "quantization": quant}
    gaps = {}
    for fused in (True, False):
        side = {"dtype": "bfloat16", "quantization": quant, "fused_decode": fused}
        pair = Pair(tiny_models[kind][0], staged=side, gathered=reference, tolerance=0.25)
        assert pair.staged.fused_decode == fused
        _run(pair)
        gaps[fused] = statistics.mean(((g - w).abs().max() / w.abs().max()).item() for g, w in pair.logits)
    assert gaps[True] < gaps[False], gaps


def test_int4_fused_decode_step_agrees_with_the_python_path(tiny_models):
    side = {"dtype": "bfloat16", "quantization": "int4wo-32"}
    pair = Pair(tiny_models["qwen3"][0], staged={**side, "fused_decode": True}, gathered=side, tolerance=0.05)
    _run(pair)  # measured up to 0.014 (the Python path rounds every activation to bfloat16)


@pytest.mark.parametrize("head_dim", [20, 24])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_head_dims_the_avx512_loops_do_not_take_run_the_avx2_or_portable_loops(tmp_path, dtype, head_dim):
    """head_dim 24 (a multiple of 8, not 16) with 5 query heads per KV head: glue.cpp's AVX2 loops 8 values
    wide, a block of 4 query heads and one of 1; head_dim 20: its portable loops. Float32 and bfloat16 K/V."""
    save_tiny_model(tmp_path, "qwen3", seed=7, head_dim=head_dim, num_attention_heads=10)
    side = {"dtype": dtype, "fused_decode": True}
    tolerance = FLOAT32_ROUNDING if dtype == "float32" else 0.25
    pair = Pair(tmp_path, staged=side, gathered={"dtype": dtype}, tolerance=tolerance)
    assert pair.staged.kv_pool_spec().head_dim == head_dim and pair.staged.fused_decode
    _run(pair)


def test_fused_decode_step_gathering_per_step_equals_the_python_path(tiny_models):
    """A batch too large to stage (``max_bytes`` 0) gathers per layer in the fused step too."""
    pair = Pair(tiny_models["qwen2"][0], staged={"fused_decode": True}, tolerance=FLOAT32_ROUNDING)
    pair.staged.model.attn._stage = DecodeStage(max_bytes=0)
    _run(pair)


QUANT_MODELS = {128: None, 20: {"head_dim": 20}, 24: {"head_dim": 24, "num_attention_heads": 10}}


@pytest.mark.parametrize(
    ("kv", "staged", "head_dim"),
    [(kv, staged, 128) for kv in ("int8", "fp8_e4m3", "fp8_e5m2") for staged in (True, False)]
    + [
        ("int8", True, 20),
        ("fp8_e4m3", True, 20),
        ("int8", True, 24),
        ("fp8_e4m3", True, 24),
        ("fp8_e5m2", True, 24),
    ],
)
def test_fused_decode_step_on_a_quantized_pool_agrees_with_the_python_path(
    tiny_models, tmp_path, kv, staged, head_dim
):
    """fp8 / int8 rows written and read by the C++ step (staged K/V refilled and appended, or gathered per
    layer) against the Python path decoding the same format: logits within a small fraction of the largest
    (the two write rows from K/V that differ by float32 rounding, which now and then rounds a value to the
    neighbouring code), and both pools decode to the same K/V up to that. head_dim 128: glue.cpp's AVX2 loops
    16 values wide; 24 with 5 query heads per KV head: 8 wide, blocks of 4 and 1 query heads; 20: its
    portable loops."""
    folder = tiny_models["qwen3"][0]
    if QUANT_MODELS[head_dim] is not None:
        save_tiny_model(tmp_path, "qwen3", seed=7, **QUANT_MODELS[head_dim])
        folder = tmp_path
    pair = Pair(folder, staged={"fused_decode": True}, tolerance=2e-3, kv_cache_dtype=kv)
    assert pair.staged.kv_pool_spec().head_dim == head_dim
    if not staged:
        pair.staged.model.attn._stage = DecodeStage(max_bytes=0)
    assert pair.staged.fused_decode and pair.pools["staged"].quantized
    ran: list[bool] = []
    step = pair.staged.model.fused_step

    def recording(batch, pool):
        logits = step(batch, pool)
        if batch.is_decode:
            ran.append(logits is not None)
        return logits

    pair.staged.model.fused_step = recording
    _run(pair)
    assert ran and all(ran)
    a, b = (pair.pools[side] for side in ("staged", "gathered"))
    same = (a.kv_buffer == b.kv_buffer).all(-1).float().mean().item()
    assert same > 0.99, same
    # values away from their neighbours by more than rounding: only those neighbouring codes (one in 1e5 here)
    got, want = a.decode(a.kv_buffer), b.decode(b.kv_buffer)
    far = ((got - want).abs() > 0.02 + 0.07 * want.abs()).float().mean().item()
    assert far < 1e-4, far


def test_fused_decode_step_calls_the_layer_hook_of_every_layer_and_leaves_prefill_to_python(tiny_models):
    runner = ModelRunner(tiny_models["llama"][0])
    assert runner.fused_decode
    pool = DeviceKVPool(64, 1, **vars(runner.kv_pool_spec()))
    calls: list[int] = []
    slots = torch.arange(1, 8)
    runner.forward(ForwardBatch.from_sequences([[5, 6, 7, 8, 9, 10]], [slots[:6]]), pool)
    fused = runner.model.fused_step
    seen: list[bool] = []
    runner.model.fused_step = lambda b, p: seen.append(True) or fused(b, p)
    runner.forward(ForwardBatch.for_decode([11], [slots], layer_hook=calls.append), pool)
    assert calls == list(range(runner.config.num_hidden_layers))
    assert seen == [True]
    prefill = ForwardBatch.from_sequences([[1, 2]], [torch.tensor([20, 21])])
    runner.model.attn.init_forward_metadata(prefill)
    assert fused(prefill, pool) is None  # a prefill chunk is left to the Python path


def test_a_runner_that_cannot_build_it_warns_and_decodes_on_the_python_path(tiny_models, monkeypatch, caplog):
    def unavailable():
        raise extension.ExtensionUnavailable("cannot build decode_step.cpp in /x: no compiler")

    monkeypatch.setattr(fused_decode, "load_extension", unavailable)
    with caplog.at_level(logging.WARNING):
        runner = ModelRunner(tiny_models["llama"][0])
    assert not runner.fused_decode
    assert "no compiler" in caplog.text and "--disable-fused-decode" in caplog.text
    assert not ModelRunner(tiny_models["llama"][0], fused_decode=False).fused_decode


def test_disable_fused_decode_flag():
    assert parse_args(["--model-path", "smollm2", "--disable-fused-decode"]).disable_fused_decode
    assert not parse_args(["--model-path", "smollm2"]).disable_fused_decode


def test_a_lock_left_by_a_killed_build_does_not_block_the_next_load(monkeypatch):
    """cpp_extension waits for ever on its ``lock`` file; a build killed mid-way leaves it behind."""
    extension.load_extension()  # built (by make venv or an earlier test)
    stale = extension.build_directory() / "lock"
    stale.touch()
    monkeypatch.setattr(extension, "_loaded", None)
    assert extension.load_extension().FusedDecoder is not None
    assert not stale.exists()
