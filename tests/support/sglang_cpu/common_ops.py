"""TEST-ONLY STAND-IN: plain-torch versions of the ``sgl_kernel`` CPU ops upstream SGLang's CPU engine calls.

Not KVFleet code and not a product part. The PyPI ``sglang-kernel`` wheels carry CUDA builds only, so on a
CPU-only test host ``sgl_kernel``'s loader finds no library it can load and, as its last resort, imports a
module named ``common_ops``; this one registers, in the ``sgl_kernel`` torch op namespace, exactly the ops the
CPU code paths of ``sglang==0.5.23`` reach with ``SGLANG_USE_CPU_ENGINE=1``, ``--attention-backend
torch_native`` and HiCache's ``--hicache-io-backend direct --hicache-mem-layout layer_first``:

- ``copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc)``: for each buffer ``b`` (base address
  ``data_ptrs[b]``, row size ``strides[b]`` bytes) copy row ``src_loc[i]`` to row ``tgt_loc[i]``; every source
  row is read before any row is written (in-place safe, as upstream's kernel).
- ``assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start, end, out_cache_loc, pool_len)``:
  request ``i``'s row of ``req_to_token`` gets ``out_cache_loc``'s next ``end[i] - start[i]`` slots at columns
  ``start[i]:end[i]``.
- ``transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size)``: for each layer pair,
  ``dst[dst_indices] = src[src_indices]`` (token slots; page_size only groups them upstream).

On a GPU host the real library loads and this module is never imported (``kernels``' GPU check script runs
upstream without it). Everything else (scheduler, radix tree, HiCache controller, storage) is upstream's.
"""

import ctypes

import torch

_lib = torch.library.Library("sgl_kernel", "FRAGMENT")
_lib.define(
    "copy_all_layer_kv_cache_cpu(Tensor data_ptrs, Tensor strides, Tensor tgt_loc, Tensor src_loc) -> ()"
)
_lib.define(
    "assign_req_to_token_pool_cpu(Tensor req_pool_indices, Tensor(a!) req_to_token, Tensor start_offset, "
    "Tensor end_offset, Tensor out_cache_loc, int pool_len) -> ()"
)
_lib.define(
    "transfer_kv_direct(Tensor[] src_layers, Tensor(a!)[] dst_layers, Tensor src_indices, "
    "Tensor dst_indices, int page_size) -> ()"
)


def _copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    tgt, src = tgt_loc.tolist(), src_loc.tolist()
    for base, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        rows = [ctypes.string_at(base + s * stride, stride) for s in src]
        for t, row in zip(tgt, rows, strict=True):
            ctypes.memmove(base + t * stride, row, stride)


def _assign_req_to_token_pool_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
):
    offset = 0
    for row, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True
    ):
        req_to_token[row, start:end] = out_cache_loc[offset : offset + end - start]
        offset += end - start


def _transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
    src_idx, dst_idx = src_indices.long().cpu(), dst_indices.long().cpu()
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst.index_copy_(0, dst_idx.to(dst.device), src.index_select(0, src_idx.to(src.device)).to(dst.device))


_lib.impl("copy_all_layer_kv_cache_cpu", _copy_all_layer_kv_cache_cpu, "CPU")
_lib.impl("assign_req_to_token_pool_cpu", _assign_req_to_token_pool_cpu, "CPU")
_lib.impl("transfer_kv_direct", _transfer_kv_direct, "CompositeExplicitAutograd")
