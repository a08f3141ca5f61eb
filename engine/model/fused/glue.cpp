// The float32 row kernels of glue.h. Plain loops the compiler vectorizes (-O3, `omp simd` for the
// reductions under -fopenmp-simd); each exported function is cloned for AVX512F, AVX2 and baseline x86-64,
// and the loader's resolver picks the clone this CPU runs. Keys and values are read in their pool dtype
// (float32 or bfloat16, widened in registers), never copied to a float32 buffer.
#include "glue.h"

#include <immintrin.h>

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#define KVFLEET_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

namespace kvfleet {
namespace {

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

template <typename T>
inline __attribute__((always_inline)) void scores_impl(const float* q, const T* keys, int64_t len,
                                                       int64_t kv_heads, int64_t group, int64_t head_dim,
                                                       float scale, float* scores, int64_t smax) {
  for (int64_t s = 0; s < len; ++s) {
    const T* k = keys + s * kv_heads * head_dim;
    for (int64_t j = 0; j < kv_heads; ++j) {
      const T* kj = k + j * head_dim;
      for (int64_t g = 0; g < group; ++g) {
        const int64_t h = j * group + g;
        const float* qh = q + h * head_dim;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * widen(kj[d]);
        scores[h * smax + s] = dot * scale;
      }
    }
  }
}

template <typename T>
inline __attribute__((always_inline)) void values_impl(const float* probs, const T* values, int64_t len,
                                                       int64_t kv_heads, int64_t group, int64_t head_dim,
                                                       float* out, int64_t smax) {
  std::fill(out, out + kv_heads * group * head_dim, 0.f);
  for (int64_t s = 0; s < len; ++s) {
    const T* v = values + s * kv_heads * head_dim;
    for (int64_t j = 0; j < kv_heads; ++j) {
      const T* vj = v + j * head_dim;
      for (int64_t g = 0; g < group; ++g) {
        const int64_t h = j * group + g;
        const float p = probs[h * smax + s];
        float* o = out + h * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) o[d] += p * widen(vj[d]);
      }
    }
  }
}

// AVX512F decode attention for head_dim % 16 == 0 and <= kMaxDim: a key row is widened to float32 once per
// KV head and shared by its query heads, each query head's dot product is 16 lanes of FMAs and one
// horizontal add; the value sums of one query head stay in registers (a value row is widened once per query
// head). Inside a decode step these loops wait on the K/V bytes from memory more than on arithmetic
// (docs/benchmarks.md).
constexpr int64_t kMaxDim = 256;

#define KVFLEET_AVX512 __attribute__((target("avx512f")))

KVFLEET_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
KVFLEET_AVX512 inline __m512 load16(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

bool avx512_fits(int64_t head_dim) {
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  return avx512 && head_dim % 16 == 0 && head_dim <= kMaxDim;
}

template <typename T>
KVFLEET_AVX512 void scores_avx512(const float* q, const T* keys, int64_t len, int64_t kv_heads, int64_t group,
                                  int64_t head_dim, float scale, float* scores, int64_t smax) {
  const int64_t chunks = head_dim / 16;
  __m512 k[kMaxDim / 16];
  for (int64_t s = 0; s < len; ++s) {
    for (int64_t j = 0; j < kv_heads; ++j) {
      const T* row = keys + (s * kv_heads + j) * head_dim;
      for (int64_t c = 0; c < chunks; ++c) k[c] = load16(row + c * 16);
      for (int64_t g = 0; g < group; ++g) {
        const int64_t h = j * group + g;
        const float* qh = q + h * head_dim;
        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qh), k[0]);
        for (int64_t c = 1; c < chunks; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qh + c * 16), k[c], acc);
        scores[h * smax + s] = _mm512_reduce_add_ps(acc) * scale;
      }
    }
  }
}

template <typename T>
KVFLEET_AVX512 void values_avx512(const float* probs, const T* values, int64_t len, int64_t kv_heads,
                                  int64_t group, int64_t head_dim, float* out, int64_t smax) {
  const int64_t chunks = head_dim / 16;
  for (int64_t j = 0; j < kv_heads; ++j) {
    for (int64_t g = 0; g < group; ++g) {  // one query head at a time: its sums stay in registers
      const int64_t h = j * group + g;
      const float* p = probs + h * smax;
      __m512 acc[kMaxDim / 16];
      for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_setzero_ps();
      for (int64_t s = 0; s < len; ++s) {
        const __m512 w = _mm512_set1_ps(p[s]);
        const T* row = values + (s * kv_heads + j) * head_dim;
        for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_fmadd_ps(w, load16(row + c * 16), acc[c]);
      }
      for (int64_t c = 0; c < chunks; ++c) _mm512_storeu_ps(out + h * head_dim + c * 16, acc[c]);
    }
  }
}

// fp8 bits -> float32: sign, exponent and mantissa moved to float32's positions, then scaled by the bias
// difference (exact for normal and subnormal values; the encoder clamps, so no inf / NaN pattern occurs)
inline float fp8_e4m3(uint8_t b) {
  const uint32_t bits = (static_cast<uint32_t>(b & 0x80) << 24) | (static_cast<uint32_t>(b & 0x7F) << 20);
  return __builtin_bit_cast(float, bits) * 0x1p120f;
}
inline float fp8_e5m2(uint8_t b) {
  const uint32_t bits = (static_cast<uint32_t>(b & 0x80) << 24) | (static_cast<uint32_t>(b & 0x7F) << 21);
  return __builtin_bit_cast(float, bits) * 0x1p112f;
}

// one quantized row as head_dim floats (int8: the codes; the row's scale is returned)
template <int64_t F>
inline __attribute__((always_inline)) float widen_row(const uint8_t* row, float* out, int64_t head_dim) {
  if constexpr (F == kInt8) {
    const int8_t* q = reinterpret_cast<const int8_t*>(row);
#pragma omp simd
    for (int64_t d = 0; d < head_dim; ++d) out[d] = static_cast<float>(q[d]);
    c10::BFloat16 s;
    std::memcpy(&s.x, row + head_dim, 2);
    return widen(s);
  } else {
#pragma omp simd
    for (int64_t d = 0; d < head_dim; ++d) out[d] = F == kFp8E4M3 ? fp8_e4m3(row[d]) : fp8_e5m2(row[d]);
    return 1.f;
  }
}

template <int64_t F>
inline __attribute__((always_inline)) void scores_quant(const float* q, const uint8_t* keys, int64_t len,
                                                        int64_t kv_heads, int64_t group, int64_t head_dim,
                                                        float scale, float* scores, int64_t smax, float* k) {
  const int64_t row_dim = quant_row_dim(F, head_dim);
  for (int64_t s = 0; s < len; ++s) {
    for (int64_t j = 0; j < kv_heads; ++j) {
      const float row_scale = widen_row<F>(keys + (s * kv_heads + j) * row_dim, k, head_dim) * scale;
      for (int64_t g = 0; g < group; ++g) {
        const int64_t h = j * group + g;
        const float* qh = q + h * head_dim;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * k[d];
        scores[h * smax + s] = dot * row_scale;
      }
    }
  }
}

template <int64_t F>
inline __attribute__((always_inline)) void values_quant(const float* probs, const uint8_t* values, int64_t len,
                                                        int64_t kv_heads, int64_t group, int64_t head_dim,
                                                        float* out, int64_t smax, float* v) {
  const int64_t row_dim = quant_row_dim(F, head_dim);
  std::fill(out, out + kv_heads * group * head_dim, 0.f);
  for (int64_t s = 0; s < len; ++s) {
    for (int64_t j = 0; j < kv_heads; ++j) {
      const float row_scale = widen_row<F>(values + (s * kv_heads + j) * row_dim, v, head_dim);
      for (int64_t g = 0; g < group; ++g) {
        const int64_t h = j * group + g;
        const float p = probs[h * smax + s] * row_scale;
        float* o = out + h * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) o[d] += p * v[d];
      }
    }
  }
}

}  // namespace

void store_quant_rows(uint8_t* dst, const float* src, int64_t heads, int64_t head_dim, int64_t format) {
  const int64_t row_dim = quant_row_dim(format, head_dim);
  for (int64_t h = 0; h < heads; ++h) {
    const float* x = src + h * head_dim;
    uint8_t* row = dst + h * row_dim;
    if (format == kInt8) {
      float amax = 0.f;
      for (int64_t d = 0; d < head_dim; ++d) amax = std::max(amax, std::fabs(x[d]));
      const c10::BFloat16 scale(std::max(amax / 127.f, 1e-30f));
      const float s = widen(scale);
      for (int64_t d = 0; d < head_dim; ++d) {
        const float q = std::min(127.f, std::max(-127.f, std::nearbyint(x[d] / s)));
        row[d] = static_cast<uint8_t>(static_cast<int8_t>(q));
      }
      std::memcpy(row + head_dim, &scale.x, 2);
    } else if (format == kFp8E4M3) {
      for (int64_t d = 0; d < head_dim; ++d)
        row[d] = c10::Float8_e4m3fn(std::min(448.f, std::max(-448.f, x[d]))).x;
    } else {
      for (int64_t d = 0; d < head_dim; ++d)
        row[d] = c10::Float8_e5m2(std::min(57344.f, std::max(-57344.f, x[d]))).x;
    }
  }
}

KVFLEET_CLONES void attention_scores_quant(const float* q, const uint8_t* keys, int64_t len, int64_t kv_heads,
                                           int64_t group, int64_t head_dim, int64_t format, float scale,
                                           float* scores, int64_t smax) {
  std::vector<float> k(head_dim);
  if (format == kInt8)
    scores_quant<kInt8>(q, keys, len, kv_heads, group, head_dim, scale, scores, smax, k.data());
  else if (format == kFp8E4M3)
    scores_quant<kFp8E4M3>(q, keys, len, kv_heads, group, head_dim, scale, scores, smax, k.data());
  else
    scores_quant<kFp8E5M2>(q, keys, len, kv_heads, group, head_dim, scale, scores, smax, k.data());
}

KVFLEET_CLONES void attention_values_quant(const float* probs, const uint8_t* values, int64_t len,
                                           int64_t kv_heads, int64_t group, int64_t head_dim, int64_t format,
                                           float* out, int64_t smax) {
  std::vector<float> v(head_dim);
  if (format == kInt8)
    values_quant<kInt8>(probs, values, len, kv_heads, group, head_dim, out, smax, v.data());
  else if (format == kFp8E4M3)
    values_quant<kFp8E4M3>(probs, values, len, kv_heads, group, head_dim, out, smax, v.data());
  else
    values_quant<kFp8E5M2>(probs, values, len, kv_heads, group, head_dim, out, smax, v.data());
}

KVFLEET_CLONES void rms_norm(const float* x, const float* w, float* out, int64_t rows, int64_t dim, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    float* o = out + r * dim;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < dim; ++i) ss += xr[i] * xr[i];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) o[i] = xr[i] * inv * w[i];
  }
}

KVFLEET_CLONES void rotary(float* x, const float* cos, const float* sin, int64_t heads, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* v = x + h * dim;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float a = v[i], b = v[i + half];
      v[i] = a * cos[i] - b * sin[i];
      v[i + half] = b * cos[i + half] + a * sin[i + half];
    }
  }
}

KVFLEET_CLONES void add_into(float* x, const float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

void store_row(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

void store_row(c10::BFloat16* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = c10::BFloat16(src[i]);  // c10's round to nearest even, NaN kept
}

KVFLEET_CLONES void attention_scores(const float* q, const float* keys, int64_t len, int64_t kv_heads,
                                     int64_t group, int64_t head_dim, float scale, float* scores, int64_t smax) {
  if (avx512_fits(head_dim)) return scores_avx512(q, keys, len, kv_heads, group, head_dim, scale, scores, smax);
  scores_impl(q, keys, len, kv_heads, group, head_dim, scale, scores, smax);
}

KVFLEET_CLONES void attention_scores(const float* q, const c10::BFloat16* keys, int64_t len, int64_t kv_heads,
                                     int64_t group, int64_t head_dim, float scale, float* scores, int64_t smax) {
  if (avx512_fits(head_dim)) return scores_avx512(q, keys, len, kv_heads, group, head_dim, scale, scores, smax);
  scores_impl(q, keys, len, kv_heads, group, head_dim, scale, scores, smax);
}

KVFLEET_CLONES void attention_values(const float* probs, const float* values, int64_t len, int64_t kv_heads,
                                     int64_t group, int64_t head_dim, float* out, int64_t smax) {
  if (avx512_fits(head_dim)) return values_avx512(probs, values, len, kv_heads, group, head_dim, out, smax);
  values_impl(probs, values, len, kv_heads, group, head_dim, out, smax);
}

KVFLEET_CLONES void attention_values(const float* probs, const c10::BFloat16* values, int64_t len,
                                     int64_t kv_heads, int64_t group, int64_t head_dim, float* out,
                                     int64_t smax) {
  if (avx512_fits(head_dim)) return values_avx512(probs, values, len, kv_heads, group, head_dim, out, smax);
  values_impl(probs, values, len, kv_heads, group, head_dim, out, smax);
}

}  // namespace kvfleet
