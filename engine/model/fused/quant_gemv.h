// Weight-only int4 / int8 matmuls for a few activation rows (a decode batch) with AVX512-VNNI.
// Built with decode_step.cpp into one extension (engine/model/extension.py); see quant_gemv.cpp.
#pragma once

#include <torch/extension.h>

namespace kvfleet {

// Most activation rows each kernel takes; more rows (a larger decode batch, a prefill) go to torch's kernels,
// whose cost per row falls with the rows while these kernels' stays about flat (int4: 4 vpdpbusd per 128
// weights per row; at 3-4 rows torch's int4 kernel is as fast, docs/benchmarks.md).
constexpr int64_t kInt4MaxRows = 2;
constexpr int64_t kInt8MaxRows = 4;

// Whether this CPU runs the kernels (AVX512F, AVX512BW, AVX512-VNNI).
bool gemv_supported();

// Whether this CPU multiplies bfloat16 natively (AVX512-BF16), which makes oneDNN's dense bfloat16 matmul
// the fast one for many rows (linear.py's dense_weight).
bool bf16_matmul_supported();

// int4wo: qweight (N, K) uint8 in 0..15, scales_and_zeros (K / group, N, 2) bfloat16 (torch's int4 CPU
// layout, w = (q - 8) * scale + zero) -> the kernel's uint8 blocks. N % 16 == 0, K % group == 0,
// group % 8 == 0.
at::Tensor int4_pack(const at::Tensor& qweight, const at::Tensor& scales_and_zeros, int64_t group);
// x (M, K) floating point, M <= kInt4MaxRows -> (M, N) float32.
at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& blocks, int64_t out_features, int64_t group);

// int8wo: qweight (N, K) int8 (one scale per row) -> the kernel's int8 blocks. N % 16 == 0, K % 32 == 0.
at::Tensor int8_pack(const at::Tensor& qweight);
// x (M, K) floating point, M <= kInt8MaxRows, scales (N,) bfloat16 -> (M, N) float32.
at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& scales);

}  // namespace kvfleet
