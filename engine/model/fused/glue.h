// The float32 row kernels between a decode step's matmuls (decode_step.cpp): RMSNorm, RoPE, residual add,
// K/V row stores, GQA decode attention. Each is compiled for AVX512F, AVX2 and baseline x86-64 and picks the
// best one the CPU runs when the extension loads (GCC target_clones); see glue.cpp.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace kvfleet {

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w for `rows` rows of `dim` (out may be x)
void rms_norm(const float* x, const float* w, float* out, int64_t rows, int64_t dim, float eps);
// rotate-half RoPE of `heads` vectors of `dim` in place; cos / sin: (dim,) of the token's position
void rotary(float* x, const float* cos, const float* sin, int64_t heads, int64_t dim);
// x += y over n values
void add_into(float* x, const float* y, int64_t n);
// dst[i] = src[i] over n values (bfloat16: rounded to nearest even, as torch's .to(bfloat16))
void store_row(float* dst, const float* src, int64_t n);
void store_row(c10::BFloat16* dst, const float* src, int64_t n);

// Decode attention of one sequence: q (kv_heads * group query heads x head_dim) over its first `len` keys,
// contiguous rows of kv_heads x head_dim (query head h reads KV head h / group). attention_scores writes
// scale * q.k to scores (heads x smax); the caller turns each head's first len scores into probabilities;
// attention_values writes sum(p * v) to out (heads x head_dim).
void attention_scores(const float* q, const float* keys, int64_t len, int64_t kv_heads, int64_t group,
                      int64_t head_dim, float scale, float* scores, int64_t smax);
void attention_scores(const float* q, const c10::BFloat16* keys, int64_t len, int64_t kv_heads, int64_t group,
                      int64_t head_dim, float scale, float* scores, int64_t smax);
void attention_values(const float* probs, const float* values, int64_t len, int64_t kv_heads, int64_t group,
                      int64_t head_dim, float* out, int64_t smax);
void attention_values(const float* probs, const c10::BFloat16* values, int64_t len, int64_t kv_heads,
                      int64_t group, int64_t head_dim, float* out, int64_t smax);

// Quantized K/V rows (engine/cache/kv_format.py): a row is one KV head of one token, `row_dim` bytes.
// kFp8E4M3 / kFp8E5M2: head_dim float8 bit patterns (no scale); kInt8: head_dim int8 values, then one
// bfloat16 scale (x ~= q * scale), row_dim = head_dim + 2.
enum KVQuant : int64_t { kFp8E4M3 = 1, kFp8E5M2 = 2, kInt8 = 3 };
inline int64_t quant_row_dim(int64_t format, int64_t head_dim) { return head_dim + (format == kInt8 ? 2 : 0); }

// encode `heads` rows of head_dim floats into heads * row_dim bytes at dst, as KVFormat.encode does
// (fp8: clamped to the format's finite range, rounded to nearest even; int8: scale = bfloat16(amax / 127),
// q = round-half-even(x / scale) clamped to +-127)
void store_quant_rows(uint8_t* dst, const float* src, int64_t heads, int64_t head_dim, int64_t format);
// attention_scores / attention_values over quantized rows (rows of kv_heads x row_dim bytes): each K/V row
// is widened to float32 once and shared by its `group` query heads; an int8 row's scale multiplies the dot
// product (keys) or the probability (values)
void attention_scores_quant(const float* q, const uint8_t* keys, int64_t len, int64_t kv_heads, int64_t group,
                            int64_t head_dim, int64_t format, float scale, float* scores, int64_t smax);
void attention_values_quant(const float* probs, const uint8_t* values, int64_t len, int64_t kv_heads,
                            int64_t group, int64_t head_dim, int64_t format, float* out, int64_t smax);

}  // namespace kvfleet
