"""Every Triton kernel compiles ahead of time for the GPUs KVFleet targets and fits their shared memory.

No GPU is needed: ``triton.compile`` on an ``ASTSource`` with a ``GPUTarget`` lowers a kernel to PTX and runs
the ptxas that ships with Triton, giving the cubin and the shared memory one program (a block) needs. Each
kernel is compiled for sm_80 (A100) and sm_90 (H100/H200) with the constexprs and argument types the engine
launches it with: the models the engine serves (head_dim 64 as SmolLM2, 128 as Llama-3 / Qwen2.5 / Qwen3;
2 to 8 query heads per KV head), the pool dtypes (bfloat16 at both head sizes, float16 and float32 at 128,
the largest tiles), split-KV decode, and page copies of small and large rows. The launch defaults
(4 warps, 3 stages) apply, as at run time. A kernel that fails to compile, or needs more shared memory per
block than the device has, fails here instead of at its first launch on that GPU. Measured with Triton 3.9:
at most 42 KiB (fp32 attention at head_dim 128), the copy kernel none. Compiled kernels land in Triton's
cache (``~/.triton/cache``), so only the first run after a kernel changes pays the compile time.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from kernels import attention, transfer
from kernels.launch import Kernel

# Shared memory one block may use (the opt-in maximum): A100 163 KiB, H100/H200 227 KiB.
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
POINTER = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32"}
COMPUTE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@pytest.fixture(autouse=True)
def triton_interpreter(monkeypatch):
    """Overrides the package's fixture: compiling for a GPU must not run under the interpreter."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def compile_kernel(kernel: Kernel, types: dict[str, str], constexprs: dict, capability: int):
    """``kernel`` compiled for ``sm_<capability>``: arguments typed by ``types`` (others ``i32``, as Triton
    types a Python int), ``constexprs`` fixed."""
    params = inspect.signature(kernel.fn).parameters
    signature = {p: "constexpr" if p in constexprs else types.get(p, "i32") for p in params}
    source = ASTSource(fn=JITFunction(kernel.fn), signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", capability, 32))


def _attention_args(dtype: torch.dtype, head_dim: int, group: int, kv: str = "auto") -> tuple[dict, dict]:
    """Types and constexprs shared by the decode and extend kernels, as ``kernels.attention`` sets them;
    ``kv``: the pool's ``kv_format`` (a quantized one is a uint8 pool)."""
    pointer = POINTER[dtype]
    pool = "*u8" if kv in attention.KV_FORMATS else pointer
    types = {"q": pointer, "k_buf": pool, "v_buf": pool, "out": pointer, "scale": "fp32"}
    types |= {"req_to_token": "*i64", "seq_lens": "*i64", "cu_seqlens": "*i64"}
    constexprs = {
        "GROUP": group,
        "HEAD_DIM": head_dim,
        "BLOCK_D": max(16, triton.next_power_of_2(head_dim)),
        "BLOCK_N": attention.BLOCK_N,
        "PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "COMPUTE": COMPUTE[dtype],
        "KV_FORMAT": attention.KV_FORMATS.get(kv, 0),
    }
    return types, constexprs


def _decode(dtype: torch.dtype, head_dim: int, group: int, splits: int, kv: str = "auto"):
    types, constexprs = _attention_args(dtype, head_dim, group, kv)
    mid = "*fp32" if splits > 1 else types["out"]  # one split writes ``out`` directly
    types |= {"mid_o": mid, "mid_lse": mid}
    return attention._decode_kernel, types, constexprs | {"BLOCK_H": attention.BLOCK_H, "SPLITS": splits}


def _extend(dtype: torch.dtype, head_dim: int, group: int, kv: str = "auto"):
    types, constexprs = _attention_args(dtype, head_dim, group, kv)
    return attention._extend_kernel, types, constexprs | {"BLOCK_M": attention.BLOCK_M}


def _combine(dtype: torch.dtype, head_dim: int, splits: int):
    types = {"out": POINTER[dtype], "mid_o": "*fp32", "mid_lse": "*fp32"}
    block_d = max(16, triton.next_power_of_2(head_dim))
    constexprs = {"HEAD_DIM": head_dim, "BLOCK_D": block_d, "SPLITS": splits}
    return attention._decode_combine_kernel, types, constexprs | {"BLOCK_S": triton.next_power_of_2(splits)}


def _copy_pages(row_bytes: int, page_size: int):
    """A page copy of ``row_bytes`` per token, moved as int64 words (``PagedKV`` picks the widest)."""
    row = row_bytes // 8
    types = {name: "i64" for name in inspect.signature(transfer._copy_pages_kernel.fn).parameters}  # strides
    types |= {name: "*i64" for name in ("src", "dst", "src_pages", "dst_pages")}
    block = min(triton.next_power_of_2(page_size * row), transfer.MAX_BLOCK)
    return transfer._copy_pages_kernel, types, {"ROW": row, "PAGE": page_size, "BLOCK": block}


LAUNCHES = {
    "decode bf16 d64 (SmolLM2, 3 per KV head)": _decode(torch.bfloat16, 64, 3, 1),
    "decode bf16 d128 split-KV (Llama-3-8B)": _decode(torch.bfloat16, 128, 4, 8),
    "decode fp16 d128 (Qwen2.5-1.5B, 6 per KV head)": _decode(torch.float16, 128, 6, 1),
    "decode fp32 d128": _decode(torch.float32, 128, 8, 1),
    "decode combine bf16 d64": _combine(torch.bfloat16, 64, 3),
    "decode combine bf16 d128": _combine(torch.bfloat16, 128, attention.MAX_SPLITS),
    "extend bf16 d64": _extend(torch.bfloat16, 64, 3),
    "extend bf16 d128": _extend(torch.bfloat16, 128, 4),
    "extend fp16 d128": _extend(torch.float16, 128, 6),
    "extend fp32 d128": _extend(torch.float32, 128, 8),
    **{
        f"decode bf16 d128 split-KV, {kv} KV": _decode(torch.bfloat16, 128, 4, 8, kv)
        for kv in attention.KV_FORMATS
    },
    **{f"extend bf16 d128, {kv} KV": _extend(torch.bfloat16, 128, 4, kv) for kv in attention.KV_FORMATS},
    "copy pages, SmolLM2 bf16 rows, page 1": _copy_pages(3 * 64 * 2, 1),
    "copy pages, Llama-3-8B bf16 rows, page 64": _copy_pages(8 * 128 * 2, 64),
}


@pytest.mark.parametrize("capability", sorted(SHARED_LIMIT))
@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_kernel_compiles_and_fits_the_shared_memory_of_a_block(launch, capability):
    kernel, types, constexprs = LAUNCHES[launch]
    compiled = compile_kernel(kernel, types, constexprs, capability)
    assert compiled.asm["cubin"]
    assert compiled.metadata.shared <= SHARED_LIMIT[capability], (
        f"{launch} needs {compiled.metadata.shared} bytes of shared memory on sm_{capability}, "
        f"the device has {SHARED_LIMIT[capability]}"
    )
