// Whole-page copies between KV pools on the CPU (engine/cache/io_backends/direct.py, see page_copy.h).
//
// torch's index_copy_ / index_select move a page one element (at most 16 bytes) at a time through
// TensorIterator, a third to a sixth of a plain copy's bandwidth here (docs/benchmarks.md); a memcpy per
// page, or per run of pages consecutive on both sides, moves it at the copy's speed. One thread: the load
// overlaps the forward pass, whose threads it would otherwise take.
#include "page_copy.h"

#include <algorithm>
#include <cstring>

namespace kvfleet {

namespace {

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
      std::memcpy(a.base + d[i] * a.stride, b.base + s[i] * b.stride, static_cast<size_t>((j - i) * row));
      i = j;
    }
  }
}

}  // namespace kvfleet
