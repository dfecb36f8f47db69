"""Host-side page allocator: plain Python, no arrays, testable without a device.

Every pool page except page 0 (the padding sink, never handed out) is in exactly one state:

* in use: reference count >= 1. A page is in use by every sequence whose page table holds it
  (several, when a prefix-cached page is shared) and by ``LLM.nll``'s scratch pages.
* cached: count 0, but its contents are registered in the prefix cache and may be shared
  again (``share``). Cached pages are kept in least-recently-freed order and evicted, oldest
  first, only when ``allocate`` finds no clean page.
* clean: count 0, contents unregistered, on the free list.

``allocate`` hands out only clean or evicted pages, so a page is never handed out while a
sequence still references it; ``free`` of a page nobody holds raises (a double free would
otherwise corrupt the counts). ``num_free`` counts clean and cached pages (both can be
allocated); ``num_used`` counts pages in use.
"""

from __future__ import annotations

import collections
from typing import Callable, Iterable


class PageAllocator:
    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError("the pool needs at least 2 pages (page 0 is the reserved sink)")
        self.num_pages = num_pages
        # Pop from the end: low page ids are handed out first.
        self._free = list(range(num_pages - 1, 0, -1))
        self._refs = [0] * num_pages
        self._cached: set[int] = set()
        # Cached pages nobody holds, least recently freed first (the eviction order).
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        # Called with a page just before an evicted page is handed out again (the prefix
        # cache forgets its contents there).
        self.on_evict: Callable[[int], None] | None = None
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_pages - 1 - self.num_free

    @property
    def num_cached(self) -> int:
        """Pages registered in the prefix cache (in use or not)."""
        return len(self._cached)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def is_cached(self, page: int) -> bool:
        return page in self._cached

    def can_allocate(self, n: int, sharing: Iterable[int] = ()) -> bool:
        """Whether ``n`` pages can be allocated after ``share(sharing)``."""
        return n <= self.num_free_after(sharing)

    def num_free_after(self, sharing: Iterable[int] = ()) -> int:
        """``num_free`` after ``share(sharing)`` (cached pages that nobody holds stop being
        evictable once shared)."""
        return self.num_free - sum(1 for p in set(sharing) if p in self._evictable)

    def allocate(self, n: int) -> list[int]:
        """``n`` pages with count 1: clean pages first, then evicted cached ones (LRU)."""
        if n > self.num_free:
            raise MemoryError(f"asked for {n} pages, {self.num_free} free")
        pages = []
        for _ in range(n):
            if self._free:
                pages.append(self._free.pop())
            else:
                pages.append(self._evict())
        for p in pages:
            self._refs[p] = 1
        return pages

    def _evict(self) -> int:
        page, _ = self._evictable.popitem(last=False)
        self._cached.discard(page)
        self.num_evictions += 1
        if self.on_evict is not None:
            self.on_evict(page)
        return page

    def share(self, pages: Iterable[int]) -> None:
        """Take one more reference to each of ``pages``, which must be in use or cached."""
        pages = list(pages)
        for p in pages:
            self._check(p)
            if self._refs[p] == 0 and p not in self._evictable:
                raise ValueError(f"page {p} is neither in use nor cached; it cannot be shared")
        for p in pages:
            self._evictable.pop(p, None)
            self._refs[p] += 1

    def free(self, pages: Iterable[int]) -> None:
        """Drop one reference to each page, in order. A page nobody holds any more becomes
        cached-evictable (most recently freed last) if registered, else clean."""
        pages = list(pages)
        need = collections.Counter(pages)
        for p, k in need.items():
            self._check(p)
            if self._refs[p] < k:
                raise ValueError(f"page {p} is freed {k} times but held {self._refs[p]} times")
        clean = []
        for p in pages:
            self._refs[p] -= 1
            if self._refs[p] == 0:
                if p in self._cached:
                    self._evictable[p] = None
                else:
                    clean.append(p)
        self._free.extend(reversed(clean))

    def mark_cached(self, page: int) -> None:
        """Register an in-use page's contents (the prefix cache calls this)."""
        self._check(page)
        if self._refs[page] == 0:
            raise ValueError(f"page {page} is not in use; only computed pages can be cached")
        self._cached.add(page)

    def uncache(self, page: int) -> None:
        """Forget a page's registration; if nobody holds it, it becomes clean."""
        self._cached.discard(page)
        if page in self._evictable:
            del self._evictable[page]
            self._free.append(page)

    def _check(self, page: int) -> None:
        if not 0 < page < self.num_pages:
            raise ValueError(f"page {page} is not a pool page")
