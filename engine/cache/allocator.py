"""Page-aligned slot allocators for the L1 device pool and the L2 host pool.

Follows SGLang's paged allocators (``free_slots`` taken from the front, returned on free, docs/upstream.md H4)
with one change: the free list is kept sorted (freed pages are merged back lazily), so an allocation gets
the lowest free pages, which keeps a request's pages contiguous and makes L1<->L2 copies long runs.
A page is handed out at most once until freed; freeing a page that is not allocated raises.
Thread-safe (the prefetch thread and the scheduler thread share the host allocator).
"""

from __future__ import annotations

import threading

import torch


class PageAllocator:
    """Hands out whole pages as int64 slot tensors (``page * page_size + offset``).

    ``num_pages`` usable pages starting at page ``first_page`` (the device pool starts at page 1: page 0
    is its padding page). Sizes are in tokens.
    """

    def __init__(self, num_pages: int, page_size: int, first_page: int = 0) -> None:
        if num_pages < 0 or page_size < 1:
            raise ValueError(f"bad allocator shape: num_pages={num_pages}, page_size={page_size}")
        self.page_size = page_size
        self.num_pages = num_pages
        self.first_page = first_page
        self._offsets = torch.arange(page_size, dtype=torch.int64)
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Mark every page free."""
        with self._lock:
            self._free = torch.arange(self.first_page, self.first_page + self.num_pages, dtype=torch.int64)
            self._released: list[torch.Tensor] = []
            self._released_pages = 0
            self._in_use = torch.zeros(self.first_page + self.num_pages, dtype=torch.bool)

    @property
    def size(self) -> int:
        """Total tokens this allocator manages."""
        return self.num_pages * self.page_size

    def available_size(self) -> int:
        """Free tokens."""
        return (len(self._free) + self._released_pages) * self.page_size

    def used_size(self) -> int:
        """Allocated tokens."""
        return self.size - self.available_size()

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """``num_tokens`` slots (a multiple of page_size) as whole pages, or None when not enough are free.

        Raises ``ValueError`` when ``num_tokens`` is negative or not page-aligned.
        """
        if num_tokens < 0 or num_tokens % self.page_size:
            raise ValueError(
                f"alloc({num_tokens}): must be a non-negative multiple of page_size {self.page_size}"
            )
        need = num_tokens // self.page_size
        with self._lock:
            if need > len(self._free):
                if need > len(self._free) + self._released_pages:
                    return None
                self._free = torch.cat([self._free, *self._released]).sort().values
                self._released, self._released_pages = [], 0
            pages, self._free = self._free[:need], self._free[need:]
            self._in_use[pages] = True
        return self.pages_to_slots(pages)

    def free(self, slots: torch.Tensor) -> None:
        """Return whole pages. Raises ``ValueError`` for a partial page or a page that is not allocated."""
        if slots.numel() == 0:
            return
        if slots.numel() % self.page_size:
            raise ValueError(f"free: {slots.numel()} slots is not a whole number of pages")
        pages = slots_to_pages(slots, self.page_size)
        with self._lock:
            if not bool(self._in_use[pages].all()) or len(torch.unique(pages)) != len(pages):
                raise ValueError("free: a page is not allocated (double free)")
            self._in_use[pages] = False
            self._released.append(pages.clone())
            self._released_pages += len(pages)

    def pages_to_slots(self, pages: torch.Tensor) -> torch.Tensor:
        """Slot indices of ``pages`` in order."""
        if self.page_size == 1:
            return pages.clone()
        return (pages[:, None] * self.page_size + self._offsets).reshape(-1)


def slots_to_pages(slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """Page numbers of page-aligned ``slots`` (one per page). Raises ``ValueError`` when misaligned."""
    if page_size == 1:
        return slots
    firsts = slots[::page_size]
    if bool((firsts % page_size).any()):
        raise ValueError("slots are not page-aligned")
    return torch.div(firsts, page_size, rounding_mode="floor")
