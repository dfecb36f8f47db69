"""Host-side page allocator: plain Python, no arrays, testable without a device.

Ownership: a page belongs to at most one sequence, from ``allocate`` until that sequence
``free``s it (on finish, abort or preemption). Page 0 is the padding sink and is never
handed out. A freed page's old contents are never read again: attention masks strictly by
length, and a sequence only reads positions it wrote itself.
"""

from __future__ import annotations


class PageAllocator:
    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError("the pool needs at least 2 pages (page 0 is the reserved sink)")
        self.num_pages = num_pages
        # Pop from the end: low page ids are handed out first.
        self._free = list(range(num_pages - 1, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - 1 - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if not 0 < p < self.num_pages:
                raise ValueError(f"page {p} is not a pool page")
        self._free.extend(reversed(pages))
