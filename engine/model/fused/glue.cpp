// The float32 row kernels of glue.h. Plain loops the compiler vectorizes (-O3, `omp simd` for the
// reductions under -fopenmp-simd); each exported function is cloned for AVX512F, AVX2 and baseline x86-64,
// and the loader's resolver picks the clone this CPU runs. Keys and values are read in their pool dtype
// (float32 or bfloat16, widened in registers), never copied to a float32 buffer.
#include "glue.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

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

}  // namespace

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
