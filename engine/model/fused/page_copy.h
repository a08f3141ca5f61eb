// Whole-page copies between KV pools on the CPU (the cache's L2 <-> L1 load-back and backup, direct io).
// Built with decode_step.cpp into one extension (engine/model/extension.py); see page_copy.cpp.
#pragma once

#include <torch/extension.h>

#include <vector>

namespace kvfleet {

// dsts[t][dst_pages[i]] = srcs[t][src_pages[i]] for every pair t and i, in one single-threaded pass.
// dsts[t] / srcs[t]: CPU tensors of shape (pages, row) whose rows are contiguous (stride(1) == 1), the same
// dtype and row length within a pair; dst_pages / src_pages: int64, 1-D, contiguous, equally long, each
// index in [0, pages) of every tensor on its side. Pages consecutive on both sides whose rows are stored
// back to back on both sides go as one copy; a call moving 1 MiB or more writes with non-temporal
// stores (on x86). Source and destination must not overlap. Raises ValueError for a bad argument,
// IndexError for a page out of range (nothing is copied then).
void copy_pages(const std::vector<at::Tensor>& dsts, const at::Tensor& dst_pages,
                const std::vector<at::Tensor>& srcs, const at::Tensor& src_pages);

}  // namespace kvfleet
