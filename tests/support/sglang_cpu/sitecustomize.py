"""TEST-ONLY STAND-IN, loaded by Python at start-up from ``PYTHONPATH`` (see ``common_ops.py``).

Upstream SGLang's HiCache host pool (``sglang.srt.mem_cache.pool_host.mha``) pins its memory through CUDA and
binds its copy functions only on CUDA/HIP/XPU. On a CPU-only test host this hook, run right after that module
is imported, makes the host pool default to unpinned memory and binds ``transfer_kv_direct`` to
``sgl_kernel``'s own wrapper (whose op ``common_ops`` provides). Nothing else of upstream is changed.
"""

import importlib.abc
import importlib.machinery
import os
import sys

_TARGET = "sglang.srt.mem_cache.pool_host.mha"


def _patch(module) -> None:
    from sgl_kernel.kvcacheio import transfer_kv_direct

    module.transfer_kv_direct = transfer_kv_direct
    for cls in (module.MHATokenToKVPoolHost, getattr(module, "HiSparseMHATokenToKVPoolHost", None)):
        if cls is None or "__init__" not in vars(cls):
            continue
        init = cls.__init__

        def unpinned(self, *args, __init=init, **kwargs):
            kwargs["pin_memory"] = False
            __init(self, *args, **kwargs)

        cls.__init__ = unpinned


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
    sys.meta_path.insert(0, _Hook())
