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

// fp8 bits -> float32, exactly (the encoder clamps, so no inf / NaN pattern occurs): a normal value's
// exponent re-biased in float32's exponent field, a subnormal one (and zero) its mantissa times a power of
// two. No float32 subnormal is formed on the way: Intel cores multiply those through microcode assists.
template <int kMant, int kBias>
inline float fp8_value(uint8_t b) {
  const uint32_t m = b & 0x7F, sign = static_cast<uint32_t>(b & 0x80) << 24;
  const float mag = m < (1u << kMant) ? static_cast<float>(m) * std::ldexp(1.f, 1 - kBias - kMant)
                                      : __builtin_bit_cast(float, (m << (23 - kMant)) + ((127u - kBias) << 23));
  return __builtin_bit_cast(float, __builtin_bit_cast(uint32_t, mag) | sign);
}
inline float fp8_e4m3(uint8_t b) { return fp8_value<3, 7>(b); }
inline float fp8_e5m2(uint8_t b) { return fp8_value<2, 15>(b); }

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

// AVX2 + FMA decode attention for head_dim % 8 == 0 and <= kMaxDim, on every K/V format: float32,
// bfloat16, int8 (codes widened, the row's scale folded into the score and the probability) and fp8 (bit
// patterns moved into float32's fields in registers, as fp8_e4m3 / fp8_e5m2 above, bit for bit). Each K/V
// row is widened once and shared by the query heads of its KV head (up to 4 at a time, kBlock), so a
// quantized row costs a few integer ops per 8 values and never goes through a float32 buffer.
// scores: the key row stays in registers, the 4 dot products of a block are reduced together (3 hadds);
// values: per KV head, tiles of kTile tokens, 16 output values of each query head of a block in registers,
// the tile's rows re-read from L1 / L2 for the next 16 values.
#define KVFLEET_AVX2 __attribute__((target("avx2,fma")))

bool avx2_fits(int64_t head_dim) {
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return avx2 && head_dim % 8 == 0 && head_dim <= kMaxDim;
}

// one row format: the element type T, a row's length in T for head_dim values, 8 values at an offset as
// float32, and the row's scale (1 without one)
struct F32Rows {
  using T = float;
  static int64_t row_dim(int64_t d) { return d; }
  KVFLEET_AVX2 static __m256 load8(const T* p) { return _mm256_loadu_ps(p); }
  static float scale(const T*, int64_t) { return 1.f; }
};
struct BF16Rows {
  using T = c10::BFloat16;
  static int64_t row_dim(int64_t d) { return d; }
  KVFLEET_AVX2 static __m256 load8(const T* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static float scale(const T*, int64_t) { return 1.f; }
};
template <int64_t F>
struct QuantRows {
  using T = uint8_t;
  static int64_t row_dim(int64_t d) { return quant_row_dim(F, d); }
  // 8 values as float32 (int8: the codes, the row's scale applied by the caller; fp8: the values, as
  // fp8_value above in integer ops and one blend. Moving the bits into float32's fields and rescaling by a
  // power of two afterwards gives the same values, but fp8's small exponents land on float32 subnormals,
  // which Intel cores multiply through microcode assists: fp8 KV decoded 2.4x slower than bfloat16 there.)
  KVFLEET_AVX2 static __m256 load8(const T* p) {
    // sign-extended bytes: bit 7 (fp8's sign) is copied to bits 8-31
    const __m256i x = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    if constexpr (F == kInt8) {
      return _mm256_cvtepi32_ps(x);
    } else {
      constexpr int kMant = F == kFp8E4M3 ? 3 : 2, kBias = F == kFp8E4M3 ? 7 : 15;
      const __m256i bits = _mm256_and_si256(x, _mm256_set1_epi32(0x7F));  // exponent and mantissa
      const __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(bits, 23 - kMant),
                                              _mm256_set1_epi32((127 - kBias) << 23));
      const __m256 unit = _mm256_set1_ps(std::ldexp(1.f, 1 - kBias - kMant));  // a subnormal's mantissa step
      const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(bits), unit);
      const __m256 is_sub = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(1 << kMant), bits));
      const __m256 mag = _mm256_blendv_ps(_mm256_castsi256_ps(normal), sub, is_sub);
      return _mm256_or_ps(mag, _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(INT32_MIN))));
    }
  }
  static float scale(const T* row, int64_t d) {
    if constexpr (F == kInt8) {
      c10::BFloat16 s;
      std::memcpy(&s.x, row + d, 2);
      return widen(s);
    } else {
      return 1.f;
    }
  }
};

constexpr int64_t kBlock = 4;   // query heads of one KV head handled together
constexpr int64_t kTile = 256;  // tokens per tile of the value sums

// the 4 sums of a, b, c, d's lanes
KVFLEET_AVX2 inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// the scores of query heads h0 .. h0 + G - 1 (G <= kBlock, q: theirs) against one key row, at out[g * smax]
template <class R, int64_t G>
KVFLEET_AVX2 inline __attribute__((always_inline)) void score_row(const float* q, const typename R::T* row,
                                                                  int64_t head_dim, float scale, float* out,
                                                                  int64_t smax) {
  __m256 acc[kBlock];
  for (int64_t g = 0; g < kBlock; ++g) acc[g] = _mm256_setzero_ps();
  for (int64_t c = 0; c < head_dim; c += 8) {
    const __m256 k = R::load8(row + c);
    for (int64_t g = 0; g < G; ++g) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * head_dim + c), k, acc[g]);
  }
  float dots[4];
  _mm_storeu_ps(dots, hsum4(acc[0], acc[1], acc[2], acc[3]));
  const float row_scale = R::scale(row, head_dim) * scale;
  for (int64_t g = 0; g < G; ++g) out[g * smax] = dots[g] * row_scale;
}

// token by token, KV head by KV head: the keys are read in memory order
template <class R>
KVFLEET_AVX2 void scores_avx2(const float* q, const typename R::T* keys, int64_t len, int64_t kv_heads,
                              int64_t group, int64_t head_dim, float scale, float* scores, int64_t smax) {
  const int64_t row_dim = R::row_dim(head_dim);
  for (int64_t s = 0; s < len; ++s) {
    for (int64_t j = 0; j < kv_heads; ++j) {
      const typename R::T* row = keys + (s * kv_heads + j) * row_dim;
      for (int64_t g0 = 0; g0 < group; g0 += kBlock) {
        const int64_t h0 = j * group + g0;
        const float* qh = q + h0 * head_dim;
        float* out = scores + h0 * smax + s;
        switch (std::min(kBlock, group - g0)) {
          case 1: score_row<R, 1>(qh, row, head_dim, scale, out, smax); break;
          case 2: score_row<R, 2>(qh, row, head_dim, scale, out, smax); break;
          case 3: score_row<R, 3>(qh, row, head_dim, scale, out, smax); break;
          default: score_row<R, 4>(qh, row, head_dim, scale, out, smax);
        }
      }
    }
  }
}

// out[h] += sum over tokens s0 .. s1 - 1 of p[h][s] * row_scale * v[s] for query heads h0 .. h0 + G - 1
// (G <= kBlock) of KV head j, 16 output values at a time in registers (8 when head_dim % 16 != 0)
template <class R, int64_t G>
KVFLEET_AVX2 void values_block_avx2(const float* probs, const typename R::T* values, int64_t s0, int64_t s1,
                                    int64_t kv_heads, int64_t head_dim, float* out, int64_t smax, int64_t j,
                                    int64_t h0) {
  const int64_t row_dim = R::row_dim(head_dim);
  const int64_t step = head_dim % 16 == 0 ? 16 : 8;
  for (int64_t d0 = 0; d0 < head_dim; d0 += step) {
    __m256 acc[G][2];
    for (int64_t g = 0; g < G; ++g) {
      acc[g][0] = _mm256_loadu_ps(out + (h0 + g) * head_dim + d0);
      acc[g][1] = step == 16 ? _mm256_loadu_ps(out + (h0 + g) * head_dim + d0 + 8) : _mm256_setzero_ps();
    }
    for (int64_t s = s0; s < s1; ++s) {
      const typename R::T* row = values + (s * kv_heads + j) * row_dim;
      const float row_scale = R::scale(row, head_dim);
      const __m256 v0 = R::load8(row + d0);
      const __m256 v1 = step == 16 ? R::load8(row + d0 + 8) : _mm256_setzero_ps();
      for (int64_t g = 0; g < G; ++g) {
        const __m256 w = _mm256_set1_ps(probs[(h0 + g) * smax + s] * row_scale);
        acc[g][0] = _mm256_fmadd_ps(w, v0, acc[g][0]);
        if (step == 16) acc[g][1] = _mm256_fmadd_ps(w, v1, acc[g][1]);
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      _mm256_storeu_ps(out + (h0 + g) * head_dim + d0, acc[g][0]);
      if (step == 16) _mm256_storeu_ps(out + (h0 + g) * head_dim + d0 + 8, acc[g][1]);
    }
  }
}

template <class R>
KVFLEET_AVX2 void values_avx2(const float* probs, const typename R::T* values, int64_t len, int64_t kv_heads,
                              int64_t group, int64_t head_dim, float* out, int64_t smax) {
  std::fill(out, out + kv_heads * group * head_dim, 0.f);
  const int64_t token_bytes = kv_heads * R::row_dim(head_dim) * static_cast<int64_t>(sizeof(typename R::T));
  for (int64_t s0 = 0; s0 < len; s0 += kTile) {
    const int64_t s1 = std::min(len, s0 + kTile);
    // the next tile on its way from memory while this one (in L1 / L2 after its first pass) is summed
    const char* next = reinterpret_cast<const char*>(values) + s1 * token_bytes;
    for (int64_t b = 0; b < (std::min(len, s1 + kTile) - s1) * token_bytes; b += 64)
      _mm_prefetch(next + b, _MM_HINT_T0);
    for (int64_t j = 0; j < kv_heads; ++j) {
      for (int64_t g0 = 0; g0 < group; g0 += kBlock) {
        const int64_t h0 = j * group + g0;
        switch (std::min(kBlock, group - g0)) {
          case 1: values_block_avx2<R, 1>(probs, values, s0, s1, kv_heads, head_dim, out, smax, j, h0); break;
          case 2: values_block_avx2<R, 2>(probs, values, s0, s1, kv_heads, head_dim, out, smax, j, h0); break;
          case 3: values_block_avx2<R, 3>(probs, values, s0, s1, kv_heads, head_dim, out, smax, j, h0); break;
          default: values_block_avx2<R, 4>(probs, values, s0, s1, kv_heads, head_dim, out, smax, j, h0);
        }
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
  if (avx2_fits(head_dim)) {
    if (format == kInt8) return scores_avx2<QuantRows<kInt8>>(q, keys, len, kv_heads, group, head_dim, scale, scores, smax);
    if (format == kFp8E4M3)
      return scores_avx2<QuantRows<kFp8E4M3>>(q, keys, len, kv_heads, group, head_dim, scale, scores, smax);
    return scores_avx2<QuantRows<kFp8E5M2>>(q, keys, len, kv_heads, group, head_dim, scale, scores, smax);
  }
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
  if (avx2_fits(head_dim)) {
    if (format == kInt8) return values_avx2<QuantRows<kInt8>>(probs, values, len, kv_heads, group, head_dim, out, smax);
    if (format == kFp8E4M3)
      return values_avx2<QuantRows<kFp8E4M3>>(probs, values, len, kv_heads, group, head_dim, out, smax);
    return values_avx2<QuantRows<kFp8E5M2>>(probs, values, len, kv_heads, group, head_dim, out, smax);
  }
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
  if (avx2_fits(head_dim)) return scores_avx2<F32Rows>(q, keys, len, kv_heads, group, head_dim, scale, scores, smax);
  scores_impl(q, keys, len, kv_heads, group, head_dim, scale, scores, smax);
}

KVFLEET_CLONES void attention_scores(const float* q, const c10::BFloat16* keys, int64_t len, int64_t kv_heads,
                                     int64_t group, int64_t head_dim, float scale, float* scores, int64_t smax) {
  if (avx512_fits(head_dim)) return scores_avx512(q, keys, len, kv_heads, group, head_dim, scale, scores, smax);
  if (avx2_fits(head_dim)) return scores_avx2<BF16Rows>(q, keys, len, kv_heads, group, head_dim, scale, scores, smax);
  scores_impl(q, keys, len, kv_heads, group, head_dim, scale, scores, smax);
}

KVFLEET_CLONES void attention_values(const float* probs, const float* values, int64_t len, int64_t kv_heads,
                                     int64_t group, int64_t head_dim, float* out, int64_t smax) {
  if (avx512_fits(head_dim)) return values_avx512(probs, values, len, kv_heads, group, head_dim, out, smax);
  if (avx2_fits(head_dim)) return values_avx2<F32Rows>(probs, values, len, kv_heads, group, head_dim, out, smax);
  values_impl(probs, values, len, kv_heads, group, head_dim, out, smax);
}

KVFLEET_CLONES void attention_values(const float* probs, const c10::BFloat16* values, int64_t len,
                                     int64_t kv_heads, int64_t group, int64_t head_dim, float* out,
                                     int64_t smax) {
  if (avx512_fits(head_dim)) return values_avx512(probs, values, len, kv_heads, group, head_dim, out, smax);
  if (avx2_fits(head_dim)) return values_avx2<BF16Rows>(probs, values, len, kv_heads, group, head_dim, out, smax);
  values_impl(probs, values, len, kv_heads, group, head_dim, out, smax);
}

}  // namespace kvfleet
