// Whole-page copies between KV pools on the CPU (engine/cache/io_backends/direct.py, see page_copy.h).
//
// One pass over the pages on one thread (the load overlaps the forward pass, whose threads it would otherwise
// take), a copy per page or per run of pages consecutive on both sides. A transfer of at least
// kStreamBytes writes with non-temporal stores: they skip reading the destination's cache lines before
// writing them (a third of a plain copy's memory traffic) and leave the caches to the forward pass; the
// destination is read back layers later at the earliest, from memory either way. Each run prefetches the
// start of the next run's source, which the hardware prefetcher cannot guess (page_first_direct's host rows
// and page size 1 are short reads far apart). Figures against a contiguous copy: docs/benchmarks.md.
#include "page_copy.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#include <xmmintrin.h>
#endif

namespace kvfleet {

namespace {

constexpr int64_t kStreamBytes = 1 << 20;  // below: plain memcpy (the data may well stay in the caches)
constexpr int64_t kStreamRun = 256;        // shorter runs: memcpy
constexpr int64_t kPrefetchBytes = 1024;   // of the next run's source

// n bytes from src to dst, dst written with non-temporal stores where it is 16-byte aligned.
inline void stream_copy(char* dst, const char* src, int64_t n) {
#if defined(__SSE2__)
  if (n >= kStreamRun && (reinterpret_cast<uintptr_t>(dst) & 15) == 0) {
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
      const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
    }
    if (i < n) std::memcpy(dst + i, src + i, static_cast<size_t>(n - i));
    return;
  }
#endif
  std::memcpy(dst, src, static_cast<size_t>(n));
}

inline void prefetch(const char* p, int64_t n) {
#if defined(__SSE2__)
  for (int64_t q = 0; q < std::min(n, kPrefetchBytes); q += 64) _mm_prefetch(p + q, _MM_HINT_T0);
#endif
}

struct Side {
  char* base;
  int64_t stride;  // bytes between page rows
  int64_t pages;
};

Side side(const at::Tensor& t, const char* name, int64_t index, int64_t* row_bytes) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), "copy_pages: ", name, "[", index, "] is not on the CPU");
  TORCH_CHECK_VALUE(t.dim() == 2, "copy_pages: ", name, "[", index, "] must be 2-D (pages, row), got ",
                    t.dim(), "-D");
  TORCH_CHECK_VALUE(t.size(1) <= 1 || t.stride(1) == 1, "copy_pages: ", name, "[", index,
                    "] rows must be contiguous");
  const int64_t es = static_cast<int64_t>(t.element_size());
  *row_bytes = t.size(1) * es;
  return {static_cast<char*>(t.data_ptr()), t.stride(0) * es, t.size(0)};
}

const int64_t* checked_pages(const at::Tensor& pages, const char* name, int64_t limit) {
  TORCH_CHECK_VALUE(pages.scalar_type() == at::kLong && pages.dim() == 1 && pages.is_contiguous() &&
                        pages.device().is_cpu(),
                    "copy_pages: ", name, " must be a contiguous 1-D int64 CPU tensor");
  const int64_t* p = pages.data_ptr<int64_t>();
  for (int64_t i = 0; i < pages.numel(); ++i) {
    TORCH_CHECK_INDEX(p[i] >= 0 && p[i] < limit, "copy_pages: ", name, "[", i, "] = ", p[i],
                      " is out of range for ", limit, " pages");
  }
  return p;
}

}  // namespace

void copy_pages(const std::vector<at::Tensor>& dsts, const at::Tensor& dst_pages,
                const std::vector<at::Tensor>& srcs, const at::Tensor& src_pages) {
  TORCH_CHECK_VALUE(dsts.size() == srcs.size(), "copy_pages: ", dsts.size(), " destination tensors, ",
                    srcs.size(), " sources");
  TORCH_CHECK_VALUE(dst_pages.numel() == src_pages.numel(), "copy_pages: ", dst_pages.numel(),
                    " destination pages, ", src_pages.numel(), " source pages");
  const int64_t n = dst_pages.numel();
  std::vector<Side> to, from;
  std::vector<int64_t> rows;
  int64_t dst_limit = INT64_MAX, src_limit = INT64_MAX;
  for (size_t t = 0; t < dsts.size(); ++t) {
    int64_t dst_row = 0, src_row = 0;
    to.push_back(side(dsts[t], "dsts", t, &dst_row));
    from.push_back(side(srcs[t], "srcs", t, &src_row));
    TORCH_CHECK_VALUE(dsts[t].scalar_type() == srcs[t].scalar_type() && dst_row == src_row,
                      "copy_pages: dsts[", t, "] and srcs[", t, "] differ in dtype or row length");
    rows.push_back(dst_row);
    dst_limit = std::min(dst_limit, to.back().pages);
    src_limit = std::min(src_limit, from.back().pages);
  }
  if (n == 0 || dsts.empty()) return;
  const int64_t* d = checked_pages(dst_pages, "dst_pages", dst_limit);
  const int64_t* s = checked_pages(src_pages, "src_pages", src_limit);
  int64_t total = 0;
  for (const int64_t row : rows) total += n * row;
  const bool stream = total >= kStreamBytes;
  for (size_t t = 0; t < to.size(); ++t) {
    const int64_t row = rows[t];
    const Side& a = to[t];
    const Side& b = from[t];
    // a run may span pages only where both sides store consecutive pages back to back
    const bool packed = a.stride == row && b.stride == row;
    for (int64_t i = 0; i < n;) {
      int64_t j = i + 1;
      if (packed) {
        while (j < n && d[j] == d[j - 1] + 1 && s[j] == s[j - 1] + 1) ++j;
      }
      if (j < n) prefetch(b.base + s[j] * b.stride, row);
      char* out = a.base + d[i] * a.stride;
      const char* in = b.base + s[i] * b.stride;
      if (stream) {
        stream_copy(out, in, (j - i) * row);
      } else {
        std::memcpy(out, in, static_cast<size_t>((j - i) * row));
      }
      i = j;
    }
  }
#if defined(__SSE2__)
  if (stream) _mm_sfence();  // the streamed stores are visible before the caller reports the copy done
#endif
}

}  // namespace kvfleet
