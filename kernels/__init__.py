"""Triton kernels (KV page transfer, paged attention) for the engine on a GPU; none are built yet."""
