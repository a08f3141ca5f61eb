// Weight-only int4 / int8 matmuls for a decode batch (up to kInt4MaxRows / kInt8MaxRows activation rows) with
// AVX512-VNNI.
//
// At one row torch's CPU kernels (_weight_int4pack_mm_for_cpu, _weight_int8pack_mm) dequantize every weight
// to float and multiply-add 16 lanes per instruction, which leaves them compute-bound at about a third of the
// memory bandwidth. Here the weights stay integers and `vpdpbusd` multiplies 64 bytes per instruction
// (16 output rows x 4 inputs), as llama.cpp's quantized dot products do, except that the activations are
// not rounded to 8 bits (Q8_1): each group of inputs is quantized to 16 bits, x ~ d * (256 * hi + lo) with
// hi signed and lo unsigned bytes, and both byte planes go through `vpdpbusd`. Per group of `group` inputs
// and output row n (int4, torchao's w = (q - 8) * scale + zero):
//   y_n += scale * d * (256 * sum(q * hi) + sum(q * lo)) + (zero - 8 * scale) * sum(x)
// with sum(x) taken from the unquantized activations. Per input row and group the error is that of a 16-bit
// quantization (|x - d * xq| <= d / 2, d = max|x| / 32767), smaller than the bfloat16 rounding torch's
// kernels apply to the activations (tests/model/test_quant_gemv.py measures both against float32).
//
// Weight blocks: 16 output rows per tile; a 64-byte vector holds 4 consecutive inputs of each of the 16 rows
// (row j in 32-bit lane j), so `vpdpbusd` with one broadcast 4-byte activation word accumulates all 16 rows.
// int4: per (tile, group): group / 8 vectors, byte 4j+b = q[j][8c+b] | q[j][8c+4+b] << 4, then the group's 16
// scales and 16 zeros as bfloat16 (64 bytes). int8: per (tile, group of 64 or 32 inputs) group / 4 vectors of
// signed bytes; the row scales stay in their own (N,) tensor.
#include "quant_gemv.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace kvfleet {
namespace {

constexpr int64_t kTile = 16;    // output rows per tile (one int32 lane each)
constexpr int64_t kGrain = 16;   // tiles per parallel task

// Activation rows quantized per group to 16 bits, split into a signed high and an unsigned low byte.
struct Quantized {
  int64_t rows, k, group, groups;
  std::vector<int8_t> hi;       // (rows, k)
  std::vector<uint8_t> lo;      // (rows, k)
  std::vector<float> scale;     // (rows, groups): d
  std::vector<float> sum;       // (rows, groups): sum of the unquantized inputs
  std::vector<int32_t> hi_sum;  // (rows, groups): sum of hi
};

Quantized quantize(const at::Tensor& x, int64_t group) {
  at::Tensor xf = x.to(at::kFloat).contiguous();
  Quantized q{xf.size(0), xf.size(1), group, xf.size(1) / group, {}, {}, {}, {}, {}};
  const int64_t n = q.rows * q.k, ng = q.rows * q.groups;
  q.hi.resize(n);
  q.lo.resize(n);
  q.scale.resize(ng);
  q.sum.resize(ng);
  q.hi_sum.resize(ng);
  const float* src = xf.data_ptr<float>();
  for (int64_t g = 0; g < ng; ++g) {
    const float* v = src + g * group;
    float amax = 0.f, sum = 0.f;
    for (int64_t i = 0; i < group; ++i) {
      amax = std::max(amax, std::fabs(v[i]));
      sum += v[i];
    }
    // a NaN or infinity in the group: no finite code for it, so the group's d is NaN and every output is
    // NaN, as torch's kernels would give (the codes are zeros)
    const bool finite = std::isfinite(sum) && std::isfinite(amax);
    const float inv = finite && amax > 0.f ? 32767.f / amax : 0.f;
    int32_t hi_sum = 0;
    for (int64_t i = 0; i < group; ++i) {
      const int32_t xq = inv > 0.f ? static_cast<int32_t>(std::nearbyint(v[i] * inv)) : 0;
      q.hi[g * group + i] = static_cast<int8_t>(xq >> 8);  // arithmetic shift: xq = 256 * hi + lo
      q.lo[g * group + i] = static_cast<uint8_t>(xq & 0xFF);
      hi_sum += xq >> 8;
    }
    q.scale[g] = finite ? amax / 32767.f : std::numeric_limits<float>::quiet_NaN();
    q.sum[g] = sum;
    q.hi_sum[g] = hi_sum;
  }
  return q;
}

int32_t word(const void* p) {
  int32_t w;
  std::memcpy(&w, p, 4);
  return w;
}

__attribute__((target("avx512f,avx512bw,avx512vnni"))) __m512 bf16x16(const void* p) {
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// 16 outputs (one tile) of activation rows 0..R-1 for int4 blocks with C = group / 8 vectors per group:
// each weight vector is unpacked once and multiplied with every row.
template <int R, int C>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void int4_tile(const uint8_t* tile, const Quantized& a,
                                                                      float* out, int64_t out_stride) {
  constexpr int64_t block = C * 64 + 64;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < a.groups; ++g) {
    const uint8_t* blk = tile + g * block;
    const int64_t k0 = g * C * 8;
    __m512i h0[R], h1[R], l0[R], l1[R];
    for (int r = 0; r < R; ++r) h0[r] = h1[r] = l0[r] = l1[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const __m512i v = _mm512_loadu_si512(blk + c * 64);
      const __m512i qa = _mm512_and_si512(v, nibble);                        // inputs 8c .. 8c+3
      const __m512i qb = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);  // inputs 8c+4 .. 8c+7
      for (int r = 0; r < R; ++r) {
        const int8_t* hi = a.hi.data() + r * a.k + k0 + c * 8;
        const uint8_t* lo = a.lo.data() + r * a.k + k0 + c * 8;
        h0[r] = _mm512_dpbusd_epi32(h0[r], qa, _mm512_set1_epi32(word(hi)));  // q (u8) x hi (s8)
        h1[r] = _mm512_dpbusd_epi32(h1[r], qb, _mm512_set1_epi32(word(hi + 4)));
        l0[r] = _mm512_dpbusd_epi32(l0[r], _mm512_set1_epi32(word(lo)), qa);  // lo (u8) x q (s8, 0..15)
        l1[r] = _mm512_dpbusd_epi32(l1[r], _mm512_set1_epi32(word(lo + 4)), qb);
      }
    }
    const __m512 scale = bf16x16(blk + C * 64), zero = bf16x16(blk + C * 64 + 32);
    const __m512 min = _mm512_fmadd_ps(scale, _mm512_set1_ps(-8.f), zero);
    for (int r = 0; r < R; ++r) {
      const __m512i dot =
          _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(h0[r], h1[r]), 8), _mm512_add_epi32(l0[r], l1[r]));
      const int64_t ag = r * a.groups + g;
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(scale, _mm512_set1_ps(a.scale[ag])), acc[r]);
      acc[r] = _mm512_fmadd_ps(min, _mm512_set1_ps(a.sum[ag]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * out_stride, acc[r]);
}

// 16 outputs of activation row `row` for int8 blocks; `scales`: the tile's 16 bfloat16 row scales.
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void int8_tile(const int8_t* tile, const uint16_t* scales,
                                                                      const Quantized& a, int64_t row,
                                                                      float* out) {
  const int64_t chunks = a.group / 4;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const int8_t* hi = a.hi.data() + row * a.k;
  const uint8_t* lo = a.lo.data() + row * a.k;
  __m512 acc = _mm512_setzero_ps();
  for (int64_t g = 0; g < a.groups; ++g) {
    const int8_t* blk = tile + g * chunks * 64;
    const int64_t k0 = g * a.group;
    __m512i h0 = _mm512_setzero_si512(), h1 = h0, l0 = h0, l1 = h0;
    for (int64_t c = 0; c < chunks; c += 2) {
      const __m512i w0 = _mm512_loadu_si512(blk + c * 64), w1 = _mm512_loadu_si512(blk + c * 64 + 64);
      const int64_t k = k0 + c * 4;
      l0 = _mm512_dpbusd_epi32(l0, _mm512_set1_epi32(word(lo + k)), w0);  // lo (u8) x w (s8)
      l1 = _mm512_dpbusd_epi32(l1, _mm512_set1_epi32(word(lo + k + 4)), w1);
      // hi is signed too: (w + 128) (u8) x hi (s8), minus 128 * sum(hi) below
      h0 = _mm512_dpbusd_epi32(h0, _mm512_xor_si512(w0, flip), _mm512_set1_epi32(word(hi + k)));
      h1 = _mm512_dpbusd_epi32(h1, _mm512_xor_si512(w1, flip), _mm512_set1_epi32(word(hi + k + 4)));
    }
    const int64_t ag = row * a.groups + g;
    const __m512i high = _mm512_sub_epi32(_mm512_add_epi32(h0, h1), _mm512_set1_epi32(128 * a.hi_sum[ag]));
    const __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(high, 8), _mm512_add_epi32(l0, l1));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(a.scale[ag]), acc);
  }
  _mm512_storeu_ps(out, _mm512_mul_ps(acc, bf16x16(scales)));
}

using Int4Tile = void (*)(const uint8_t*, const Quantized&, float*, int64_t);

template <int C>
Int4Tile int4_kernel_for_rows(int64_t rows) {
  static_assert(kInt4MaxRows == 2, "one instantiation per row count");
  constexpr Int4Tile kernels[] = {int4_tile<1, C>, int4_tile<2, C>};
  return kernels[rows - 1];
}

// the instantiation for `rows` activation rows and `chunks` = group / 8 (group 32, 64, 128, 256)
Int4Tile int4_kernel(int64_t rows, int64_t chunks) {
  switch (chunks) {
    case 4: return int4_kernel_for_rows<4>(rows);
    case 8: return int4_kernel_for_rows<8>(rows);
    case 16: return int4_kernel_for_rows<16>(rows);
    case 32: return int4_kernel_for_rows<32>(rows);
  }
  TORCH_CHECK(false, "int4 group must be 32, 64, 128 or 256, got ", chunks * 8);
}

int64_t int8_group(int64_t in_features) { return in_features % 64 == 0 ? 64 : 32; }

void check_rows(const at::Tensor& x, int64_t in_features, int64_t max_rows) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == in_features, "activations must be (M, ", in_features, "), got ",
              x.sizes());
  TORCH_CHECK(x.size(0) <= max_rows, "this VNNI kernel takes up to ", max_rows, " rows, got ", x.size(0));
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), "activations must be floating point, got ", x.scalar_type());
}

}  // namespace

bool bf16_matmul_supported() { return __builtin_cpu_supports("avx512bf16"); }

bool gemv_supported() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni");
}

at::Tensor int4_pack(const at::Tensor& qweight, const at::Tensor& scales_and_zeros, int64_t group) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kByte, "qweight must be (N, K) uint8");
  const int64_t n = qweight.size(0), k = qweight.size(1);
  TORCH_CHECK(n % kTile == 0 && group % 8 == 0 && k % group == 0, "int4 blocks need N % 16 == 0 and K % group "
              "== 0 with group % 8 == 0, got N=", n, " K=", k, " group=", group);
  const int64_t groups = k / group, chunks = group / 8, block = chunks * 64 + 64;
  TORCH_CHECK(scales_and_zeros.scalar_type() == at::kBFloat16 &&
                  scales_and_zeros.sizes() == at::IntArrayRef({groups, n, 2}),
              "scales_and_zeros must be (K / group, N, 2) bfloat16");
  at::Tensor q = qweight.contiguous();
  at::Tensor sz = scales_and_zeros.contiguous();
  at::Tensor out = at::empty({n / kTile * groups * block}, at::kByte);
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const uint16_t* szp = reinterpret_cast<const uint16_t*>(sz.data_ptr<at::BFloat16>());
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t t = 0; t < n / kTile; ++t) {
    for (int64_t g = 0; g < groups; ++g) {
      uint8_t* blk = dst + (t * groups + g) * block;
      for (int64_t c = 0; c < chunks; ++c) {
        for (int64_t j = 0; j < kTile; ++j) {
          const uint8_t* src = qp + (t * kTile + j) * k + g * group + c * 8;
          for (int64_t b = 0; b < 4; ++b) {
            TORCH_CHECK(src[b] <= 15 && src[b + 4] <= 15, "qweight values must be in 0..15");
            blk[c * 64 + j * 4 + b] = static_cast<uint8_t>(src[b] | (src[b + 4] << 4));
          }
        }
      }
      uint16_t* scales = reinterpret_cast<uint16_t*>(blk + chunks * 64);
      for (int64_t j = 0; j < kTile; ++j) {
        scales[j] = szp[(g * n + t * kTile + j) * 2];
        scales[kTile + j] = szp[(g * n + t * kTile + j) * 2 + 1];
      }
    }
  }
  return out;
}

at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& blocks, int64_t out_features, int64_t group) {
  const int64_t in_features = x.size(-1);
  check_rows(x, in_features, kInt4MaxRows);
  TORCH_CHECK(gemv_supported(), "this CPU has no AVX512-VNNI");
  const int64_t groups = in_features / group, tile_bytes = groups * (group / 8 * 64 + 64);
  TORCH_CHECK(blocks.numel() == out_features / kTile * tile_bytes && out_features % kTile == 0 &&
                  in_features % group == 0,
              "int4 blocks do not match (", out_features, ", ", in_features, ") with group ", group);
  const Quantized a = quantize(x, group);
  at::Tensor out = at::empty({a.rows, out_features}, at::kFloat);
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  float* y = out.data_ptr<float>();
  const Int4Tile kernel = int4_kernel(a.rows, group / 8);
  at::parallel_for(0, out_features / kTile, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      kernel(w + t * tile_bytes, a, y + t * kTile, out_features);
  });
  return out;
}

at::Tensor int8_pack(const at::Tensor& qweight) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kChar, "qweight must be (N, K) int8");
  const int64_t n = qweight.size(0), k = qweight.size(1);
  TORCH_CHECK(n % kTile == 0 && k % 32 == 0, "int8 blocks need N % 16 == 0 and K % 32 == 0, got N=", n,
              " K=", k);
  const int64_t group = int8_group(k);
  // (N, K) -> (tiles, 16, groups, chunks, 4) -> (tiles, groups, chunks, 16, 4)
  return qweight.reshape({n / kTile, kTile, k / group, group / 4, 4}).permute({0, 2, 3, 1, 4}).contiguous()
      .reshape({-1});
}

at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& scales) {
  const int64_t out_features = scales.numel(), in_features = x.size(-1);
  check_rows(x, in_features, kInt8MaxRows);
  TORCH_CHECK(gemv_supported(), "this CPU has no AVX512-VNNI");
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.is_contiguous(), "scales must be bfloat16");
  TORCH_CHECK(blocks.numel() == out_features * in_features && out_features % kTile == 0 &&
                  in_features % 32 == 0,
              "int8 blocks do not match (", out_features, ", ", in_features, ")");
  const Quantized a = quantize(x, int8_group(in_features));
  at::Tensor out = at::empty({a.rows, out_features}, at::kFloat);
  const int8_t* w = blocks.data_ptr<int8_t>();
  const uint16_t* s = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
  float* y = out.data_ptr<float>();
  at::parallel_for(0, out_features / kTile, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t r = 0; r < a.rows; ++r)
        int8_tile(w + t * kTile * in_features, s + t * kTile, a, r, y + r * out_features + t * kTile);
  });
  return out;
}

}  // namespace kvfleet
