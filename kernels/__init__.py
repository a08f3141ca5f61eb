"""Triton kernels for the engine's GPU path: KV page transfer (``transfer``), paged attention (``attention``).

Imported only by ``engine`` (its ``kernel`` io backend and ``triton`` attention backend); ``launch`` picks
compiled CUDA or, with ``TRITON_INTERPRET=1``, Triton's interpreter on the CPU.
"""
