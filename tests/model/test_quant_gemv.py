"""KVFleet's VNNI weight-only matmuls (``fused/quant_gemv.cpp`` through ``linear.py``): closer to the float32
matmul of the dequantized weight than torch's kernels, for every int4 group size and both int8 group widths
and each row count they take; more rows go to torch's kernel; bad input is refused; a runner takes them for
int8wo / int4wo unless ``--disable-cpu-quant-kernels``."""

from __future__ import annotations

import pytest
import torch

from engine.model.config import INT4_GROUP_SIZES
from engine.model.extension import load_extension
from engine.model.linear import Int4WeightOnlyLinear, Int8WeightOnlyLinear
from engine.model.runner import ModelRunner
from engine.server.args import parse_args

ext = load_extension()
needs_vnni = pytest.mark.skipif(not ext.gemv_supported(), reason="this CPU has no AVX512-VNNI")
needs_bf16 = pytest.mark.skipif(not ext.bf16_matmul_supported(), reason="this CPU has no AVX512-BF16")


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def _pair(layer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the layer with torch's kernel, the same layer with the VNNI kernel) on ``x``."""
    torch_out = layer(x)
    assert layer.use_cpu_kernels(ext)
    return torch_out, layer(x)


@needs_vnni
@pytest.mark.parametrize("group", INT4_GROUP_SIZES)
@pytest.mark.parametrize("rows", [1, 2])
def test_int4_kernel_is_closer_to_float32_than_torchs(group, rows):
    torch.manual_seed(group + rows)
    layer = Int4WeightOnlyLinear(torch.randn(96, 512), None, group)
    # float32 activations (bfloat16 values): the layer returns float32, so the output is not rounded either
    x = torch.randn(rows, 512, dtype=torch.bfloat16).float()
    ref = x @ layer.dequantized().T
    torch_out, ours = _pair(layer, x)
    assert ours.dtype == torch.float32 and ours.shape == (rows, 96)
    assert _relative_error(ours, ref) < 2e-4  # the 16-bit activations' error alone
    assert _relative_error(ours, ref) < _relative_error(torch_out, ref) / 4  # torch's: bfloat16 in and out


@needs_vnni
@pytest.mark.parametrize("in_features", [576, 544])  # groups of 64 inputs, and of 32
@pytest.mark.parametrize("rows", [1, 3, 4])
def test_int8_kernel_is_closer_to_float32_than_torchs(in_features, rows):
    torch.manual_seed(in_features + rows)
    layer = Int8WeightOnlyLinear(torch.randn(64, in_features) * 0.05, None)
    x = torch.randn(rows, in_features) * torch.linspace(0.01, 10, in_features)  # uneven magnitudes
    ref = x @ layer.dequantized().T
    torch_out, ours = _pair(layer, x)
    assert _relative_error(ours, ref) < 2e-4  # float32 output: the 16-bit activations' error alone
    assert _relative_error(ours, ref) < _relative_error(torch_out, ref) / 4
    assert ours.dtype == torch.float32


@needs_vnni
def test_zero_activations_and_a_bias_and_leading_dims():
    bias = torch.randn(32, dtype=torch.bfloat16)
    layer = Int4WeightOnlyLinear(torch.randn(32, 64), bias, 32)
    layer.use_cpu_kernels(ext)
    x = torch.zeros(1, 1, 64, dtype=torch.bfloat16)
    out = layer(x)
    assert out.shape == (1, 1, 32)
    assert torch.equal(out[0, 0], bias)


@needs_vnni
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_activation_gives_non_finite_outputs_as_torchs_kernels_do(bad):
    for layer in (
        Int4WeightOnlyLinear(torch.randn(32, 64), None, 32),
        Int8WeightOnlyLinear(torch.randn(32, 64), None),
    ):
        layer.use_cpu_kernels(ext)
        x = torch.randn(2, 64)
        x[0, 5] = bad
        out = layer(x)
        assert not out[0].isfinite().any()  # the row with it: no finite garbage
        assert out[1].isfinite().all()  # the other row is untouched


@needs_vnni
def test_more_rows_than_the_kernel_takes_go_to_torchs_kernel():
    layer = Int4WeightOnlyLinear(torch.randn(32, 64), None, 32)
    x = torch.randn(ext.INT4_MAX_ROWS + 1, 64, dtype=torch.bfloat16)
    torch_out, ours = _pair(layer, x)
    assert torch.equal(ours, torch_out)
    layer = Int8WeightOnlyLinear(torch.randn(32, 64), None)
    x = torch.randn(ext.INT8_MAX_ROWS + 1, 64, dtype=torch.bfloat16)
    torch_out, ours = _pair(layer, x)
    assert torch.equal(ours, torch_out)


def test_a_shape_the_int8_kernel_cannot_take_keeps_torchs_kernel_for_decode_rows():
    layer = Int8WeightOnlyLinear(torch.randn(24, 64), None)  # 24 output rows: not whole tiles of 16
    layer.use_cpu_kernels(ext)
    assert layer.vnni_blocks is None and layer.vnni_max_rows == 0
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    assert torch.equal(layer(x), torch._weight_int8pack_mm(x, layer.qweight, layer.scales))


@needs_bf16
def test_int4_prefill_rows_take_a_dense_bfloat16_matmul_over_the_dequantized_weight():
    layer = Int4WeightOnlyLinear(torch.randn(48, 128), None, 32)
    x = torch.randn(Int4WeightOnlyLinear.DENSE_MIN_ROWS, 128, dtype=torch.bfloat16)
    torch_out, ours = _pair(layer, x)
    assert layer.dense_weight.dtype == torch.bfloat16 and layer.dense_scales is None
    assert torch.equal(ours, torch.nn.functional.linear(x, layer.dequantized().to(torch.bfloat16)))
    assert _relative_error(ours, x.float() @ layer.dequantized().T) < 1e-2  # bfloat16 weights and output
    fewer = x[:-1]  # one row fewer: torch's kernel
    assert torch.equal(layer(fewer), layer.torch_mm(fewer))


@needs_bf16
def test_int8_prefill_rows_multiply_the_exact_codes_and_scale_the_float32_output():
    layer = Int8WeightOnlyLinear(torch.randn(48, 128), None)
    x = torch.randn(Int8WeightOnlyLinear.DENSE_MIN_ROWS, 128)  # float32 activations: float32 output
    torch_out, ours = _pair(layer, x)
    assert torch.equal(layer.dense_weight.float(), layer.qweight.float())  # the codes, not rounded again
    ref = x @ layer.dequantized().T
    # the activations' and the product's bfloat16 rounding, as torch's kernel (measured 2.4e-3 and 2.3e-3)
    assert _relative_error(ours, ref) < 4e-3
    fewer = x[:-1]
    assert torch.equal(layer(fewer), layer.torch_mm(fewer.to(torch.bfloat16)).float())


@needs_vnni
def test_float16_activations_and_an_empty_batch():
    """--dtype float16 --torchao-config int8wo: float16 rows reach the VNNI kernel (widened, not refused)."""
    layer = Int8WeightOnlyLinear(torch.randn(32, 64), None)
    layer.use_cpu_kernels(ext)
    x = torch.randn(1, 64, dtype=torch.float16)
    out = layer(x)
    assert out.dtype == torch.float16
    assert _relative_error(out, x.float() @ layer.dequantized().T) < 1e-3  # float16 output rounding
    assert layer(torch.empty(0, 64)).shape == (0, 32)
    assert Int8WeightOnlyLinear(torch.randn(32, 64), None)(torch.empty(0, 64)).shape == (0, 32)  # no kernels


@needs_vnni
def test_bad_input_is_refused_with_the_reason():
    layer = Int4WeightOnlyLinear(torch.randn(32, 64), None, 32)
    layer.use_cpu_kernels(ext)
    too_many = torch.randn(ext.INT4_MAX_ROWS + 1, 64)
    with pytest.raises(RuntimeError, match=r"takes up to 2 rows, got 3"):
        ext.int4_gemv(too_many, layer.vnni_blocks, 32, 32)
    with pytest.raises(RuntimeError, match=r"int4 blocks do not match \(32, 32\)"):  # 32 inputs, not 64
        ext.int4_gemv(torch.randn(1, 32), layer.vnni_blocks, 32, 32)
    with pytest.raises(RuntimeError, match=r"int4 blocks do not match \(48, 64\)"):
        ext.int4_gemv(torch.randn(1, 64), layer.vnni_blocks, 48, 32)
    with pytest.raises(RuntimeError, match="must be floating point, got Int"):
        ext.int4_gemv(torch.ones(1, 64, dtype=torch.int32), layer.vnni_blocks, 32, 32)
    with pytest.raises(RuntimeError, match="0..15"):
        ext.int4_pack(torch.full((16, 32), 16, dtype=torch.uint8), layer.scales_and_zeros[:1, :16], 32)
    with pytest.raises(RuntimeError, match="N % 16 == 0"):
        ext.int8_pack(torch.zeros(8, 64, dtype=torch.int8))


@needs_vnni
def test_a_quantized_runner_takes_the_kernels_unless_disabled(tiny_models):
    path = tiny_models["llama"][0]
    runner = ModelRunner(path, dtype="bfloat16", quantization="int4wo-32")
    assert runner.cpu_quant_kernels
    assert runner.model.layers[0].qkv.vnni_blocks is not None
    assert runner.model.lm_head.vnni_blocks is not None  # int8 head under int4wo
    off = ModelRunner(path, dtype="bfloat16", quantization="int4wo-32", cpu_quant_kernels=False)
    assert not off.cpu_quant_kernels and off.model.layers[0].qkv.vnni_blocks is None
    assert not ModelRunner(path).cpu_quant_kernels  # nothing to take in float32


def test_disable_cpu_quant_kernels_flag():
    assert parse_args(["--model-path", "smollm2", "--disable-cpu-quant-kernels"]).disable_cpu_quant_kernels
    assert not parse_args(["--model-path", "smollm2"]).disable_cpu_quant_kernels
